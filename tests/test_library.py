"""`spare_jax.make_train_step` on models that are not ours, against a plain single-device reference.

The reference is written directly with `jax.grad` and optax: the mean of the
loss over all ``G * m`` micro-batches of the global batch, one optimizer
update per step. SPARe, through random non-interrupting live sets, must land
on the same parameters (fp32 round-off: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen, nnx

import spare_jax
from spare_jax import reorder

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3


# ---------------------------------------------------------------- three model families


class _NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def nnx_family():
    """Flax NNX MLP classifier; batches are dicts {"x", "y"}."""
    graphdef, params = nnx.split(_NnxMlp(nnx.Rngs(0)))

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def batch(rng, rows):
        x = rng.normal(size=(rows, 6)).astype(np.float32)
        return {"x": x, "y": (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1)}

    return params, loss_fn, batch


class _LinenMlp(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(1)(linen.tanh(linen.Dense(8)(x)))[:, 0]


def linen_family():
    """Flax Linen regressor; batches are tuples (x, y)."""
    module = _LinenMlp()
    params = module.init(jax.random.key(1), jnp.zeros((1, 5)))

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((module.apply(params, x) - y) ** 2)

    def batch(rng, rows):
        x = rng.normal(size=(rows, 5)).astype(np.float32)
        return x, np.sin(x.sum(1)).astype(np.float32)

    return params, loss_fn, batch


def pytree_family():
    """Plain JAX: a list of arrays, logistic regression; batches are dicts of arrays."""
    rng = np.random.default_rng(2)
    params = [rng.normal(size=(4, 2)).astype(np.float32), np.zeros(2, np.float32)]

    def loss_fn(params, batch):
        w, b = params
        logits = batch["features"] @ w + b
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def batch(rng, rows):
        f = rng.normal(size=(rows, 4)).astype(np.float32)
        return {"features": f, "label": (f.sum(1) > 0).astype(np.int32)}

    return params, loss_fn, batch


FAMILIES = {"nnx": nnx_family, "linen": linen_family, "pytree": pytree_family}


# ---------------------------------------------------------------- the reference


def reference(params, loss_fn, tx, batches, units):
    """Plain single-device training: mean loss over the ``units`` micro-batches of each batch."""
    params = jax.tree.map(jnp.asarray, params)
    opt_state = tx.init(params)

    def global_loss(p, batch):
        micro = jax.tree.map(lambda x: x.reshape(units, -1, *x.shape[1:]), batch)
        return jnp.mean(jax.vmap(loss_fn, in_axes=(None, 0))(p, micro))

    for batch in batches:
        grads = jax.grad(global_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def random_alive(placement, rng) -> np.ndarray:
    """A random live set that leaves every shard a live holder (at least one dead group)."""
    while True:
        alive = rng.random(placement.groups) > 0.4
        if not alive.all() and reorder.uncovered(placement, alive).size == 0:
            return alive


def assert_close(a, b):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), RTOL, ATOL), a, b
    )


def run_spare(family, mesh_shape, r, m, policy, seed, tx=None):
    params, loss_fn, make_batch = FAMILIES[family]()
    tx = tx or optax.adamw(1e-2)
    mesh = spare_jax.make_mesh(mesh_shape)
    step = spare_jax.make_train_step(
        loss_fn, tx, mesh, strategy="spare", redundancy=r, microbatches=m, policy=policy
    )
    rng = np.random.default_rng(seed)
    batches = [make_batch(rng, step.groups * m * 2) for _ in range(STEPS)]
    state = step.init(params)
    loads = []
    for batch in batches:
        state, metrics = step(state, batch, random_alive(step.placement, rng))
        loads.append(metrics["max_load"])
        assert np.isfinite(float(metrics["loss"]))
    ref = reference(params, loss_fn, tx, batches, step.groups * m)
    return step, state, ref, loads


GRID = [
    (shape, r, m, policy)
    for shape in [(1, 4, 2), (2, 2, 2)]
    for r in (2, 3)
    for m in (1, 2)
    for policy in ("adaptive", "fixed")
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,r,m,policy", GRID)
def test_matches_single_device_reference(mesh_shape, r, m, policy):
    seed = zlib.crc32(repr((mesh_shape, r, m, policy)).encode())  # hash() of a str varies by run
    step, state, ref, loads = run_spare("nnx", mesh_shape, r, m, policy, seed)
    assert max(loads) > m, "random failures must move work"
    assert_close(step.params(state), ref)
    assert step.compiles == 1


@pytest.mark.parametrize("family", ["linen", "pytree"])
def test_other_families_and_tuple_batches(family):
    step, state, ref, _ = run_spare(family, (1, 4, 2), 2, 2, "adaptive", seed=7)
    assert_close(step.params(state), ref)
    assert jax.tree.structure(step.params(state)) == jax.tree.structure(ref)


def test_sgd_update_is_the_global_mean_gradient():
    """SGD(lr=1): the update is exactly the global mean gradient (Adam would hide a scale error)."""
    step, state, ref, _ = run_spare("pytree", (2, 2, 2), 2, 2, "adaptive", 3, optax.sgd(1.0))
    assert_close(step.params(state), ref)


def test_replication_and_dp_take_the_same_global_batch():
    params, loss_fn, make_batch = nnx_family()
    tx = optax.sgd(0.1)
    mesh = spare_jax.make_mesh((1, 4, 2))
    batch = make_batch(np.random.default_rng(0), 4 * 2 * 2)
    ref = reference(params, loss_fn, tx, [batch], 8)
    for strategy, r, alive in (
        ("replication", 2, [True, False, False, True]),
        ("dp", 1, [True] * 4),
    ):
        step = spare_jax.make_train_step(
            loss_fn, tx, mesh, strategy=strategy, redundancy=r, microbatches=2
        )
        state, metrics = step(step.init(params), batch, np.array(alive))
        assert metrics["max_load"] == 2 * r
        assert_close(step.params(state), ref)


def test_interruption_leaves_state_untouched_and_alive_never_recompiles():
    params, loss_fn, make_batch = pytree_family()
    mesh = spare_jax.make_mesh((1, 4, 2))
    step = spare_jax.make_train_step(loss_fn, optax.adam(1e-2), mesh, redundancy=2, microbatches=2)
    state = step.init(params)
    batch = make_batch(np.random.default_rng(1), 16)
    for dead in ([], [0], [0, 2], [1], [3]):
        state, _ = step(state, batch, reorder.alive_mask(4, dead))
    assert step.compiles == 1
    before = jax.tree.map(np.asarray, step.params(state))
    with pytest.raises(reorder.Interruption) as err:
        step(state, batch, reorder.alive_mask(4, [1, 2]))
    assert err.value.uncovered.tolist() == [2]  # shard 2 is held by groups 2 and 1
    assert_close(step.params(state), before)
    state, _ = step(state, batch, reorder.alive_mask(4, []))  # the state is still usable
    assert int(np.asarray(state.step)) == 6


def test_non_finite_step_keeps_the_state():
    """A NaN loss or gradient leaves parameters, optimizer state and step count as they were."""
    params, loss_fn, make_batch = pytree_family()
    mesh = spare_jax.make_mesh((1, 4, 2))
    step = spare_jax.make_train_step(loss_fn, optax.adam(1e-2), mesh, redundancy=2, microbatches=2)
    batch = make_batch(np.random.default_rng(1), 16)
    state, metrics = step(step.init(params), batch, np.ones(4, bool))
    assert bool(metrics["finite"])
    before = jax.tree.map(np.asarray, state)
    poisoned = {**batch, "features": batch["features"].copy()}
    poisoned["features"][5, 0] = np.nan
    state, metrics = step(state, poisoned, np.ones(4, bool))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)


def test_drop_policy_is_the_inexact_exception():
    params, loss_fn, make_batch = pytree_family()
    tx = optax.sgd(1.0)
    mesh = spare_jax.make_mesh((1, 4, 2))
    batch = make_batch(np.random.default_rng(4), 16)
    ref = reference(params, loss_fn, tx, [batch], 8)
    step = spare_jax.make_train_step(loss_fn, tx, mesh, redundancy=2, microbatches=2, policy="drop")
    state, _ = step(step.init(params), batch, reorder.alive_mask(4, [1]))
    errors = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), state.params, ref)
    assert max(jax.tree.leaves(errors)) > 100 * ATOL


def test_state_round_trips_through_orbax(tmp_path):
    params, loss_fn, make_batch = nnx_family()
    mesh = spare_jax.make_mesh((2, 2, 2))
    step = spare_jax.make_train_step(loss_fn, optax.adamw(1e-2), mesh, redundancy=2)
    batch = make_batch(np.random.default_rng(5), 8)
    state, _ = step(step.init(params), batch, np.ones(4, bool))
    expected = jax.tree.map(np.asarray, state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "s", state)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "s", step.abstract_state(params))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), expected)
    state, _ = step(restored, batch, np.ones(4, bool))  # restored state trains on


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b, a: ({"x": b["x"][:-1], "y": b["y"][:-1]}, a), "multiple of G\\*m"),
        (lambda b, a: ({"x": b["x"], "y": b["y"][:-2]}, a), "share one leading"),
        (lambda b, a: (b, a[:3]), "alive must be a bool array of shape \\(4,\\)"),
        (lambda b, a: (b, a.astype(int)), "alive must be a bool array"),
        (lambda b, a: ({}, a), "batch must hold at least one array"),
    ],
)
def test_bad_input_names_the_argument(mutate, match):
    params, loss_fn, make_batch = nnx_family()
    step = spare_jax.make_train_step(
        loss_fn, optax.sgd(0.1), spare_jax.make_mesh((1, 4, 2)), microbatches=2
    )
    batch, alive = mutate(make_batch(np.random.default_rng(0), 16), np.ones(4, bool))
    with pytest.raises(ValueError, match=match):
        step(step.init(params), batch, alive)


def test_bad_construction_names_the_argument():
    params, loss_fn, make_batch = pytree_family()
    mesh = spare_jax.make_mesh((1, 4, 2))
    cases = [
        ({"strategy": "raid"}, "strategy must be one of"),
        ({"redundancy": 2.5}, "redundancy must be an integer"),
        ({"redundancy": 5}, "must not exceed"),
        ({"microbatches": 0}, "microbatches must be >= 1"),
        ({"policy": "greedy"}, "policy must be one of"),
        ({"strategy": "dp", "redundancy": 2}, "redundancy 1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            spare_jax.make_train_step(loss_fn, optax.sgd(0.1), mesh, **kwargs)
    with pytest.raises(ValueError, match="optimizer must be"):
        spare_jax.make_train_step(loss_fn, "adam", mesh)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        step = spare_jax.make_train_step(lambda p, b: b["features"] @ p[0], optax.sgd(0.1), mesh)
        step(step.init(params), make_batch(np.random.default_rng(0), 8), np.ones(4, bool))
    with pytest.raises(ValueError, match=r"param_specs\[0\] = .* names the group axis 'data'"):
        step = spare_jax.make_train_step(
            loss_fn, optax.sgd(0.1), mesh, param_specs=[jax.P("data"), jax.P()]
        )
        step.init(params)

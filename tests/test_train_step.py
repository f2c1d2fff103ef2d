"""The failure-masked step on the project's LM: exact, compiled once per slot bound, no hidden data.

Exactness tolerance: after K steps, parameters and per-step losses of a run
through failures match the failure-free run with ``rtol=1e-5, atol=1e-6``
(fp32 round-off of summing the same micro-batch gradients in another order).
The drop-and-renormalise baseline must miss that tolerance by at least 100x.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lm import data as data_lib
from lm import model as model_lib
from lm import setup as experiment

from spare_jax import mesh as mesh_lib
from spare_jax import reorder, slots
from spare_jax import train_step as step_lib

RTOL, ATOL = 1e-5, 1e-6
K = 4
CFG = model_lib.ModelConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=1, d_ff=32)
BATCH = 2


@functools.cache
def _model():
    graphdef, params = model_lib.init_params(CFG, 0)
    return functools.partial(model_lib.loss_fn, graphdef), params


def _step(mesh_shape, strategy="spare", r=2, m=1, policy="adaptive", tx=None, slot_bound=None):
    loss, params = _model()
    return step_lib.make_train_step(
        loss,
        tx or experiment.make_optimizer(3e-3, 2, 20),
        mesh_lib.make_mesh(mesh_shape),
        strategy=strategy,
        redundancy=r,
        microbatches=m,
        policy=policy,
        param_specs=model_lib.param_specs(params),
        slot_bound=slot_bound,
    )


def _batch(step, t):
    source = data_lib.MarkovSource(CFG.vocab, CFG.seq_len, BATCH, seed=1)
    return data_lib.global_batch(source, step.groups * step.microbatches, t)


def _run(step, dead_at=None, steps=K):
    """Train ``steps`` steps with groups dying at the given steps; (losses, params, loads)."""
    state = step.init(_model()[1])
    alive = np.ones(step.groups, bool)
    losses, loads = [], []
    for t in range(steps):
        for g in (dead_at or {}).get(t, []):
            alive[g] = False
        state, metrics = step(state, _batch(step, t), alive)
        losses.append(float(metrics["loss"]))
        loads.append(metrics["max_load"])
    return np.array(losses), jax.device_get(step.params(state)), loads


def _max_error(a, b) -> float:
    """Largest |a-b| / (ATOL + RTOL |b|) over all leaves: <= 1 means within tolerance."""
    errs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y) / (ATOL + RTOL * np.abs(y)))), a, b)
    return max(jax.tree.leaves(errs))


def _random_schedule(placement, rng, steps=K, max_failures=3) -> dict[int, list[int]]:
    """Failures at random steps >= 1 that never interrupt (dead sets only grow)."""
    dead: list[int] = []
    schedule: dict[int, list[int]] = {}
    for _ in range(rng.integers(1, max_failures + 1)):
        candidates = [g for g in range(placement.groups) if g not in dead]
        rng.shuffle(candidates)
        for g in candidates:
            alive = reorder.alive_mask(placement.groups, dead + [g])
            if reorder.uncovered(placement, alive).size == 0:
                dead.append(g)
                schedule.setdefault(int(rng.integers(1, steps)), []).append(g)
                break
    return schedule


# The LM on two meshes; tests/test_library.py covers the full grid (r, m, meshes,
# policies) against a single-device reference with another model.
CASES = [((2, 2, 2), 2, 2), ((8, 1, 1), 3, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,r,m", CASES)
def test_failures_match_failure_free_run(mesh_shape, r, m):
    adaptive = _step(mesh_shape, r=r, m=m)
    fixed = _step(mesh_shape, r=r, m=m, policy="fixed")
    ref_losses, ref_params, ref_loads = _run(adaptive)
    assert ref_loads == [m] * K
    rng = np.random.default_rng(100 * r + 10 * m + mesh_shape[0])
    for trial in range(2):
        schedule = _random_schedule(adaptive.placement, rng)
        assert schedule, "a failure schedule must kill someone"
        for step in (adaptive, fixed) if trial == 0 else (adaptive,):
            losses, params, loads = _run(step, schedule)
            assert max(loads) > m, "failures must change the assignment"
            np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
            assert _max_error(params, ref_params) <= 1.0, (schedule, step.policy)
    assert adaptive.compiles == fixed.compiles == 1  # one compilation through every live set


def test_drop_and_renormalise_misses_the_tolerance():
    schedule = {1: [3], 2: [6]}
    _, ref_params, _ = _run(_step((8, 1, 1)))
    _, exact_params, _ = _run(_step((8, 1, 1)), schedule)
    _, drop_params, _ = _run(_step((8, 1, 1), policy="drop"), schedule)
    assert _max_error(exact_params, ref_params) <= 1.0
    drop_error = _max_error(drop_params, ref_params)
    assert drop_error > 100.0, f"drop baseline error only {drop_error:.3g}x the tolerance"


def test_strategies_train_on_the_same_batch():
    """Failure-free spare (r=2), replication (r=2) and dp give the same losses: like for like."""
    spare, _, _ = _run(_step((8, 1, 1)))
    replication, rep_params, rep_loads = _run(_step((8, 1, 1), "replication"))
    dp, dp_params, dp_loads = _run(_step((8, 1, 1), "dp", r=1))
    np.testing.assert_allclose(replication, spare, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dp, spare, rtol=RTOL, atol=ATOL)
    assert _max_error(rep_params, dp_params) <= 1.0
    assert dp_loads == [1] * K and rep_loads == [2] * K  # replication always pays r x


def test_replication_with_failures_is_exact():
    ref_losses, ref_params, _ = _run(_step((8, 1, 1), "replication"))
    losses, params, loads = _run(_step((8, 1, 1), "replication"), {1: [0], 2: [3, 5]})
    assert loads == [2] * K
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert _max_error(params, ref_params) <= 1.0


def test_no_recompile_within_the_slot_bound():
    m = 2
    step = _step((8, 1, 1), m=m, slot_bound=m + 1)
    state = step.init(_model()[1])
    for t, dead in enumerate([[], [1], [1, 5], [2], [2, 5], [0, 4], [3, 7]]):
        state, metrics = step(state, _batch(step, t), reorder.alive_mask(8, dead))
        assert metrics["max_load"] <= m + 1
    assert step.compiles == 1
    # Fixed order puts a dead group's whole shard on one neighbour: 2m = 4 slots
    # exceed the bound of 3, so the step compiles exactly once more.
    fixed = step_lib.SpareStep(
        step.loss_fn, step.tx, step.mesh, step.placement, microbatches=m, policy="fixed"
    )
    fixed.slot_bound, fixed._jitted = step.slot_bound, step._jitted  # share the executable
    fixed.compiles = step.compiles
    state, metrics = fixed(state, _batch(step, 9), reorder.alive_mask(8, [2]))
    assert metrics["max_load"] == 2 * m and fixed.slot_bound == 2 * m and fixed.compiles == 2
    state, _ = fixed(state, _batch(step, 10), reorder.alive_mask(8, [5]))
    assert fixed.compiles == 2


def test_state_sharding_and_donation():
    step = _step((2, 2, 2), m=2)
    state = step.init(_model()[1])
    up = state.params["blocks"][0]["mlp"]["up"]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert state.params["embed"].sharding.spec == jax.sharding.PartitionSpec(None, None)
    old_leaf = state.params["head"]
    new_state, _ = step(state, _batch(step, 0), reorder.alive_mask(4, [1]))
    assert old_leaf.is_deleted(), "the train state must be donated"
    assert not _model()[1]["head"].is_deleted(), "init must copy, not alias, the caller's params"
    up = new_state.params["blocks"][0]["mlp"]["up"]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    mu = new_state.opt_state[0].mu["blocks"][0]["mlp"]["up"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_stacks_hold_each_groups_shards_once_per_holder():
    step = _step((1, 4, 2), r=2, m=2)
    batch = _batch(step, 3)
    stacks = jax.device_get(step.stacks(batch))
    ids = slots.unit_ids(step.placement, 2)
    assert stacks.shape == (4, 4, BATCH, CFG.seq_len + 1)
    for g in range(4):
        for j, u in enumerate(ids[g]):
            np.testing.assert_array_equal(stacks[g, j], batch[u * BATCH : (u + 1) * BATCH])
    device = step.stacks(jnp.asarray(batch))  # a device batch is gathered on device
    np.testing.assert_array_equal(jax.device_get(device), stacks)
    step.stacks(jnp.asarray(_batch(step, 4)))  # ... by one compiled gather, not one per call
    (gather,) = step._stacks._gathers.values()
    assert gather._cache_size() == 1


@pytest.mark.parametrize(
    "mesh_shape,dead", [((8, 1, 1), [1, 4]), pytest.param((2, 2, 2), [2], marks=pytest.mark.slow)]
)
def test_synchronised_gradient_is_the_global_mean_gradient(mesh_shape, dead):
    """With SGD(lr=1) the update is the gradient: the plain mean over all G*m micro-batches.

    (Adam is invariant to a uniform gradient scale, so this catches what the
    failure-vs-failure-free comparisons alone cannot.)
    """
    m = 2
    step = _step(mesh_shape, m=m, tx=optax.sgd(1.0))
    loss, params = _model()
    batch = _batch(step, 0)
    units = batch.reshape(step.groups * m, BATCH, -1)
    ref = jax.grad(lambda p: jnp.mean(jnp.stack([loss(p, jnp.asarray(u)) for u in units])))(params)
    for d in ([], dead):
        new, _ = step(step.init(params), batch, reorder.alive_mask(step.groups, d))
        grad = jax.tree.map(lambda a, b: a - b, jax.device_get(params), jax.device_get(new.params))
        np.testing.assert_allclose(optax.tree.norm(grad), optax.tree.norm(ref), rtol=1e-5)
        assert _max_error(grad, ref) <= 1.0


def test_a_slow_group_walks_fewer_slots_and_the_gradient_stays_exact():
    """Speeds give a slow group fewer micro-batches; every group computes only its own
    (each micro-batch once, no empty slot computed), and the update is still the plain
    mean gradient over all G*m micro-batches."""
    m = 4
    loss, params = _model()
    seen: list[bytes] = []

    def counted(p, microbatch):
        jax.debug.callback(lambda x: seen.append(np.asarray(x).tobytes()), microbatch)
        return loss(p, microbatch)

    step = step_lib.make_train_step(
        counted,
        optax.sgd(1.0),
        mesh_lib.make_mesh((8, 1, 1)),
        redundancy=2,
        microbatches=m,
        param_specs=model_lib.param_specs(params),
    )
    speeds = np.ones(8)
    speeds[3] = 0.25
    loads = reorder.assign_by_speed(step.placement, speeds, m).loads
    assert loads[3] < m < loads.max()  # the slow group sheds work to its neighbours
    batch = _batch(step, 0)
    units = batch.reshape(step.groups * m, BATCH, -1)
    ref = jax.grad(lambda p: jnp.mean(jnp.stack([loss(p, jnp.asarray(u)) for u in units])))(params)
    state = step.init(params)
    jax.block_until_ready(state)
    seen.clear()
    new, metrics = step(state, batch, np.ones(8, bool), speeds=speeds)
    jax.block_until_ready(new)
    jax.effects_barrier()
    assert metrics["max_load"] == loads.max()
    # Walking the busiest load on every group would compute 8 * max_load > G * m slots.
    assert len(seen) == step.groups * m
    assert sorted(seen) == sorted(u.tobytes() for u in units)
    grad = jax.tree.map(lambda a, b: a - b, jax.device_get(params), jax.device_get(new.params))
    assert _max_error(grad, ref) <= 1.0


def test_speeds_are_checked():
    step = _step((8, 1, 1))
    with pytest.raises(ValueError, match="shape"):
        step.table(np.ones(8, bool), speeds=np.ones(7))
    with pytest.raises(ValueError, match="adaptive"):
        _step((8, 1, 1), policy="fixed").table(np.ones(8, bool), speeds=np.ones(8))

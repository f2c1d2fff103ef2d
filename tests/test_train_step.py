"""The failure-masked step is exact, compiles once per slot bound, and moves no hidden data.

Exactness tolerance: after K steps, parameters and per-step losses of a run
through failures match the failure-free run with ``rtol=1e-5, atol=1e-6``
(fp32 round-off of summing the same micro-batch gradients in another order).
The drop-and-renormalise baseline must miss that tolerance by at least 100x.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from spare_jax import data as data_lib
from spare_jax import mesh as mesh_lib
from spare_jax import model as model_lib
from spare_jax import placement as placement_lib
from spare_jax import reorder
from spare_jax import train_step as step_lib

RTOL, ATOL = 1e-5, 1e-6
K = 4
CFG = model_lib.ModelConfig(vocab=32, seq_len=8, d_model=16, heads=2, layers=1, d_ff=32)
BATCH = 2


# Every test pads each group's stack to STACK local micro-batches (rows past r*m
# are never indexed), so one compiled step serves every (placement, r, m) on a mesh.
STACK = 6


@functools.cache
def _setup(mesh_shape: tuple[int, int, int], bound: int = STACK):
    """Mesh, compiled step (shared by every placement) and a host copy of the init state."""
    mesh = mesh_lib.make_mesh(mesh_shape)
    tx = step_lib.make_optimizer(3e-3, 2, 20)
    graphdef, state, shardings = step_lib.init_state(CFG, tx, mesh, seed=0)
    step = step_lib.TrainStep(mesh, graphdef, tx, shardings, slot_bound=bound)
    host = jax.device_get(state)
    return mesh, step, host, shardings


def _tokens(step, source, placement, m, t):
    stack = data_lib.stack_inputs(source, placement, m, t)
    pad = STACK - stack.shape[1]
    return step.put_tokens(np.pad(stack, ((0, 0), (0, pad), (0, 0), (0, 0))))


def _fresh(host, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), host, shardings)


def _run(
    setup,
    placement,
    m,
    dead_at: dict[int, list[int]] | None = None,
    policy="adaptive",
    steps: int = K,
):
    """Train `steps` steps; return (losses, host params, max loads)."""
    _, step, host, shardings = setup
    state = _fresh(host, shardings)
    source = data_lib.MarkovSource(CFG.vocab, CFG.seq_len, BATCH, seed=1)
    alive = np.ones(placement.groups, bool)
    losses, loads = [], []
    for t in range(steps):
        for g in (dead_at or {}).get(t, []):
            alive[g] = False
        if policy == "drop":
            plan = step_lib.drop_and_renormalise_plan(placement, alive, m)
        else:
            plan = step_lib.plan_from_assignment(reorder.assign(placement, alive, m, policy))
        tokens = _tokens(step, source, placement, m, t)
        device_plan = step.put_plan(plan)
        with jax.transfer_guard("disallow"):
            state, metrics = step(state, tokens, device_plan)
        losses.append(float(jax.device_get(metrics["loss"])))
        loads.append(plan.max_load)
    return np.array(losses), jax.device_get(state.params), loads


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


CASES = [(shape, r, m) for shape in [(2, 2, 2), (8, 1, 1)] for r in (2, 3) for m in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,r,m", CASES)
def test_failures_match_failure_free_run(mesh_shape, r, m):
    setup = _setup(mesh_shape)
    placement = mesh_lib.placement_for("spare", setup[0], r)
    ref_losses, ref_params, ref_loads = _run(setup, placement, m)
    assert ref_loads == [m] * K
    rng = np.random.default_rng(100 * r + 10 * m + mesh_shape[0])
    for trial in range(2):
        schedule = _random_schedule(placement, rng)
        assert schedule, "a failure schedule must kill someone"
        for policy in ("adaptive", "fixed") if trial == 0 else ("adaptive",):
            losses, params, loads = _run(setup, placement, m, schedule, policy)
            assert max(loads) > m, "failures must change the assignment"
            np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
            assert _max_error(params, ref_params) <= 1.0, (schedule, policy)
    assert setup[1].compiles == 1  # one compilation for every case on this mesh


def test_drop_and_renormalise_misses_the_tolerance():
    setup = _setup((8, 1, 1))
    placement = mesh_lib.placement_for("spare", setup[0], 2)
    _, ref_params, _ = _run(setup, placement, 1)
    schedule = {1: [3], 2: [6]}
    _, exact_params, _ = _run(setup, placement, 1, schedule)
    _, drop_params, _ = _run(setup, placement, 1, schedule, policy="drop")
    assert _max_error(exact_params, ref_params) <= 1.0
    drop_error = _max_error(drop_params, ref_params)
    assert drop_error > 100.0, f"drop baseline error only {drop_error:.3g}x the tolerance"
    worst = max(
        jax.tree.leaves(
            jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), drop_params, ref_params)
        )
    )
    assert worst > 1e-4


def test_strategies_train_on_the_same_batch():
    """Failure-free spare (r=2), replication (r=2) and dp give the same losses: like for like."""
    spare_setup = _setup((8, 1, 1))
    mesh = spare_setup[0]
    spare, _, _ = _run(spare_setup, mesh_lib.placement_for("spare", mesh, 2), 1)
    replication, rep_params, _ = _run(
        spare_setup, mesh_lib.placement_for("replication", mesh, 2), 1
    )
    dp, dp_params, dp_loads = _run(_setup((8, 1, 1)), mesh_lib.placement_for("dp", mesh, 1), 1)
    np.testing.assert_allclose(replication, spare, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dp, spare, rtol=RTOL, atol=ATOL)
    assert _max_error(rep_params, dp_params) <= 1.0
    assert dp_loads == [1] * K


def test_replication_with_failures_is_exact():
    setup = _setup((8, 1, 1))
    placement = mesh_lib.placement_for("replication", setup[0], 2)
    ref_losses, ref_params, ref_loads = _run(setup, placement, 1)
    losses, params, loads = _run(setup, placement, 1, {1: [0], 2: [3, 5]})
    assert ref_loads == loads == [2] * K  # replication always pays r x
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
    assert _max_error(params, ref_params) <= 1.0


def test_data_parallel_failure_interrupts():
    placement = placement_lib.data_parallel(8)
    with pytest.raises(reorder.Interruption) as err:
        reorder.assign(placement, reorder.alive_mask(8, [5]), 1)
    assert list(err.value.uncovered) == [5]


def test_no_recompile_within_the_slot_bound():
    m, r = 2, 2
    mesh, step, host, shardings = _setup((8, 1, 1), bound=m + 1)
    placement = mesh_lib.placement_for("spare", mesh, r)
    source = data_lib.MarkovSource(CFG.vocab, CFG.seq_len, BATCH, seed=1)
    state = _fresh(host, shardings)
    live_sets = [[], [1], [1, 5], [2], [2, 5], [0, 4], [3, 7]]
    for t, dead in enumerate(live_sets):
        plan = step_lib.plan_from_assignment(
            reorder.assign(placement, reorder.alive_mask(8, dead), m)
        )
        assert plan.max_load <= m + 1
        with jax.transfer_guard("disallow"):
            state, _ = step(state, _tokens(step, source, placement, m, t), step.put_plan(plan))
    assert step.compiles == 1
    assert step._jitted._cache_size() == 1
    # Fixed order puts a dead group's whole shard on one neighbour: 2m = 4 slots
    # exceed the bound of 3, so the step compiles exactly once more.
    plan = step_lib.plan_from_assignment(
        reorder.assign(placement, reorder.alive_mask(8, [2]), m, "fixed")
    )
    assert plan.max_load == 2 * m
    state, _ = step(state, _tokens(step, source, placement, m, 9), step.put_plan(plan))
    assert step.compiles == 2 and step.slot_bound == 2 * m
    plan = step_lib.plan_from_assignment(reorder.assign(placement, reorder.alive_mask(8, [5]), m))
    state, _ = step(state, _tokens(step, source, placement, m, 10), step.put_plan(plan))
    assert step.compiles == 2


def test_state_sharding_and_donation():
    mesh, step, host, shardings = _setup((2, 2, 2))
    state = _fresh(host, shardings)
    assert state.params["blocks"][0]["mlp"]["up"].sharding.spec == jax.sharding.PartitionSpec(
        None, "model"
    )
    assert state.params["embed"].sharding.spec == jax.sharding.PartitionSpec(None, None)
    placement = mesh_lib.placement_for("spare", mesh, 2)
    source = data_lib.MarkovSource(CFG.vocab, CFG.seq_len, BATCH, seed=1)
    plan = step_lib.plan_from_assignment(reorder.assign(placement, reorder.alive_mask(4, [1]), 2))
    old_leaf = state.params["head"]
    with jax.transfer_guard("disallow"):
        new_state, _ = step(state, _tokens(step, source, placement, 2, 0), step.put_plan(plan))
    assert old_leaf.is_deleted(), "the train state must be donated"
    up = new_state.params["blocks"][0]["mlp"]["up"]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    mu = new_state.opt_state[0].mu["blocks"][0]["mlp"]["up"]
    assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_plan_rejects_inconsistent_assignments():
    placement = placement_lib.cyclic(4, 2)
    plan = step_lib.plan_from_assignment(reorder.assign(placement, reorder.alive_mask(4, [2]), 2))
    assert plan.denom == 8.0 and plan.exact
    assert np.all(plan.index[2] == -1) and plan.alive[2] == 0.0
    assert plan.weight.sum() == 8
    padded = plan.padded(6)
    assert padded.slots == 6 and np.all(padded.index[:, plan.slots :] == -1)
    with pytest.raises(ValueError):
        plan.padded(plan.slots - 1)
    drop = step_lib.drop_and_renormalise_plan(placement, reorder.alive_mask(4, [2]), 2)
    assert not drop.exact and drop.denom == 6.0


@pytest.mark.parametrize(
    "mesh_shape,dead", [((8, 1, 1), [1, 4]), pytest.param((2, 2, 2), [2], marks=pytest.mark.slow)]
)
def test_synchronised_gradient_is_the_global_mean_gradient(mesh_shape, dead):
    """With SGD(lr=1) the update is the gradient: the plain mean over all G*m micro-batches.

    (Adam is invariant to a uniform gradient scale, so this catches what the
    failure-vs-failure-free comparisons alone cannot.)
    """
    import jax.numpy as jnp
    import optax

    m = 2
    mesh = mesh_lib.make_mesh(mesh_shape)
    tx = optax.sgd(1.0)
    graphdef, state, shardings = step_lib.init_state(CFG, tx, mesh, seed=0)
    host = jax.device_get(state)
    placement = mesh_lib.placement_for("spare", mesh, 2)
    groups = placement.groups
    source = data_lib.MarkovSource(CFG.vocab, CFG.seq_len, BATCH, seed=1)
    units = np.stack([source.unit(0, u) for u in range(groups * m)])
    ref = jax.grad(
        lambda p: jnp.mean(
            jnp.stack([model_lib.loss_fn(graphdef, p, jnp.asarray(u)) for u in units])
        )
    )(host.params)
    step = step_lib.TrainStep(mesh, graphdef, tx, shardings, slot_bound=2 * m)
    for d in ([], dead):
        plan = step_lib.plan_from_assignment(
            reorder.assign(placement, reorder.alive_mask(groups, d), m)
        )
        new, _ = step(
            _fresh(host, shardings),
            step.put_tokens(data_lib.stack_inputs(source, placement, m, 0)),
            step.put_plan(plan),
        )
        grad = jax.tree.map(lambda a, b: a - b, host.params, jax.device_get(new.params))
        np.testing.assert_allclose(optax.tree.norm(grad), optax.tree.norm(ref), rtol=1e-5)
        assert _max_error(grad, ref) <= 1.0

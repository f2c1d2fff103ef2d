"""Speed-aware assignment: optimal makespan against an independent max-flow, validity,
equal speeds as the adaptive assignment, speed 0 as a dead group."""

from unittest import mock

import numpy as np
import pytest
import scipy.sparse
import scipy.sparse.csgraph
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reorder import check_valid as check_assignment

from spare_jax import placement, reorder, strategies

TOL = 1e-9  # the capacity of group g at makespan T is floor(T * s_g + TOL)

SPEEDS = st.one_of(
    st.sampled_from([0.0, 0.25, 1 / 3, 0.5, 1.0, 1.0, 1.0, 2.0, 3.0]),
    st.floats(0.05, 4.0),
)


@st.composite
def stacking(draw):
    """A stacking placement: rings (cyclic, strided, several rings, domain-aware,
    data parallel) or a relabelled circulant that goes through max-flow."""
    kind = draw(st.sampled_from(["cyclic", "strided", "rings", "domain_aware", "custom", "dp"]))
    g = draw(st.integers(2, 16))
    r = draw(st.integers(1, min(4, g)))
    if kind == "cyclic":
        return strategies.placement("spare", g, r)
    if kind == "strided":
        return strategies.placement("strided", g, r)
    if kind == "rings" and g % 2 == 0 and g // 2 >= r:
        return strategies.placement("spare", g, r, ring_size=g // 2)
    if kind == "domain_aware":
        return placement.domain_aware(np.arange(g) // (g // r), r)
    if kind == "dp":
        return strategies.placement("dp", g, 1)
    others = st.lists(st.integers(1, g - 1), min_size=r - 1, max_size=r - 1, unique=True)
    offsets = [0, *draw(others)]
    relabel = np.array(draw(st.permutations(range(g))))
    return placement.from_stacks(relabel[(np.arange(g)[:, None] + np.array(offsets)) % g])


def reference_makespan(p, speeds, m):
    """Smallest T among all k / s_g whose capacities floor(T s_g + TOL) route every
    micro-batch (scipy max-flow, source -> shard -> live holder -> sink)."""
    units = p.shard_units * m
    total = p.shards * units
    live = [g for g in range(p.groups) if speeds[g] > 0]
    candidates = sorted({k / speeds[g] for g in live for k in range(1, p.depth * units + 1)})
    sink = p.shards + p.groups + 1

    def routes(t):
        rows, cols, caps = [], [], []
        edges = []  # (from, to, capacity)
        for s in range(p.shards):
            edges.append((0, 1 + s, units))
            edges += [(1 + s, 1 + p.shards + int(h), units) for h in p.holders(s) if speeds[h] > 0]
        for g in live:
            edges.append((1 + p.shards + g, sink, min(int(np.floor(t * speeds[g] + TOL)), total)))
        rows, cols, caps = zip(*edges, strict=True)
        graph = scipy.sparse.csr_array(
            (np.array(caps, np.int32), (rows, cols)), shape=(sink + 1, sink + 1)
        )
        return scipy.sparse.csgraph.maximum_flow(graph, 0, sink).flow_value == total

    lo, hi = 0, len(candidates) - 1
    assert routes(candidates[hi]), "the largest candidate must route everything"
    while lo < hi:
        mid = (lo + hi) // 2
        if routes(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def check_valid(a, p, speeds, m, t):
    """Every micro-batch once, to a holder of speed > 0; loads within T s_g; tables agree."""
    alive = speeds > 0
    assert (a.alive == alive).all()
    check_assignment(a, p, alive, m)  # the adaptive assignment's own checks
    assert (a.loads[~alive] == 0).all()
    assert (a.loads <= np.floor(t * speeds + TOL)).all()
    assert np.max(a.loads[alive] / speeds[alive]) == pytest.approx(t, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(stacking(), st.integers(1, 3), st.data())
def test_makespan_is_optimal_and_assignment_valid(p, m, data):
    speeds = np.array(data.draw(st.lists(SPEEDS, min_size=p.groups, max_size=p.groups)))
    missing = reorder.uncovered(p, speeds > 0)
    if missing.size:
        with pytest.raises(reorder.Interruption) as info:
            reorder.assign_by_speed(p, speeds, m)
        assert info.value.uncovered.tolist() == missing.tolist()
        with pytest.raises(reorder.Interruption):
            reorder.makespan(p, speeds, m)
        return
    t = reorder.makespan(p, speeds, m)
    assert t == pytest.approx(reference_makespan(p, speeds, m), rel=1e-12)
    a = reorder.assign_by_speed(p, speeds, m)
    check_valid(a, p, speeds, m, t)


@settings(max_examples=60, deadline=None)
@given(stacking(), st.integers(1, 3), st.integers(0, 8), st.data())
def test_float_bisection_before_listing_finds_the_same_optimum(p, m, most, data):
    # Large problems bisect on T as a float until few candidates remain; force it here.
    speeds = np.array(data.draw(st.lists(SPEEDS, min_size=p.groups, max_size=p.groups)))
    if reorder.uncovered(p, speeds > 0).size:
        return
    with mock.patch.object(reorder, "_MAX_LISTED", most):
        t = reorder.makespan(p, speeds, m)
        a = reorder.assign_by_speed(p, speeds, m)
    assert t == pytest.approx(reference_makespan(p, speeds, m), rel=1e-12)
    check_valid(a, p, speeds, m, t)


@settings(max_examples=100, deadline=None)
@given(
    stacking(),
    st.integers(1, 4),
    st.floats(0.1, 5.0),
    st.data(),
)
def test_equal_speeds_give_the_adaptive_assignment(p, m, speed, data):
    alive = np.array(data.draw(st.lists(st.booleans(), min_size=p.groups, max_size=p.groups)))
    if reorder.uncovered(p, alive).size:
        return
    speeds = np.where(alive, speed, 0.0)
    expected = reorder.assign(p, alive, m)
    a = reorder.assign_by_speed(p, speeds, m)
    assert a.max_load == expected.max_load == reorder.max_load(p, alive, m)
    assert reorder.makespan(p, speeds, m) == pytest.approx(expected.max_load / speed, rel=1e-12)
    for name in ("owner", "loads", "work", "counted", "alive"):
        assert np.array_equal(getattr(a, name), getattr(expected, name)), name


@settings(max_examples=80, deadline=None)
@given(stacking(), st.integers(1, 3), st.data())
def test_speed_zero_is_a_dead_group(p, m, data):
    speeds = np.array(data.draw(st.lists(SPEEDS, min_size=p.groups, max_size=p.groups)))
    speeds[speeds == 0] = 1.0
    dead = data.draw(st.integers(0, p.groups - 1))
    killed = speeds.copy()
    killed[dead] = 0.0
    missing = reorder.uncovered(p, reorder.alive_mask(p.groups, [dead]))
    if missing.size:
        with pytest.raises(reorder.Interruption) as info:
            reorder.makespan(p, killed, m)
        assert info.value.uncovered.tolist() == missing.tolist()
        return
    a = reorder.assign_by_speed(p, killed, m)
    assert a.loads[dead] == 0 and not (a.owner == dead).any() and not a.alive[dead]
    check_valid(a, p, killed, m, reorder.makespan(p, killed, m))
    # Losing a group never shortens the step.
    assert reorder.makespan(p, killed, m) >= reorder.makespan(p, speeds, m)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 5).flatmap(lambda r: st.tuples(st.just(r), st.integers(1, 4))),
    st.integers(1, 3),
    st.data(),
)
def test_replication_computes_every_live_members_shard(rs, m, data):
    r, sets = rs
    p = strategies.placement("replication", r * sets, r)
    speeds = np.array(data.draw(st.lists(SPEEDS, min_size=p.groups, max_size=p.groups)))
    alive = speeds > 0
    if reorder.uncovered(p, alive).size:
        with pytest.raises(reorder.Interruption):
            reorder.assign_by_speed(p, speeds, m)
        return
    t = reorder.makespan(p, speeds, m)
    assert t == pytest.approx(r * m / speeds[alive].min(), rel=1e-12)
    a = reorder.assign_by_speed(p, speeds, m)
    check_valid(a, p, speeds, m, t)
    expected = reorder.assign(p, alive, m)
    for name in ("owner", "loads", "work", "counted"):
        assert np.array_equal(getattr(a, name), getattr(expected, name)), name


def test_one_straggler_sheds_work_to_its_neighbours():
    # Group 3 at half speed: capacity floor(T / 2). T = 4.5 gives 7 * 4 + 2 = 30 < 32
    # micro-batches; T = 5 fits (group 3 takes 2, its neighbours below one extra each).
    p = placement.cyclic(8, 2)
    speeds = np.ones(8)
    speeds[3] = 0.5
    assert reorder.makespan(p, speeds, 4) == 5.0
    a = reorder.assign_by_speed(p, speeds, 4)
    assert a.loads[3] == 2 and a.max_load == 5 and a.loads.sum() == 32
    # All nominal: the failure-free load m; speeds twice nominal halve the time.
    assert reorder.makespan(p, np.ones(8), 4) == 4.0
    assert reorder.makespan(p, np.full(8, 2.0), 4) == 2.0
    # Data parallelism cannot move work: the slowest group sets the pace.
    dp = placement.data_parallel(4)
    assert reorder.makespan(dp, np.array([1.0, 2.0, 0.5, 1.0]), 4) == 8.0


def test_large_ring_with_distinct_speeds():
    rng = np.random.default_rng(0)
    p = placement.cyclic(3_000, 4)
    speeds = rng.uniform(0.2, 2.0, p.groups)
    speeds[rng.random(p.groups) < 0.02] = 0.0
    t = reorder.makespan(p, speeds, 8)
    a = reorder.assign_by_speed(p, speeds, 8)
    alive = speeds > 0
    assert np.max(a.loads[alive] / speeds[alive]) == pytest.approx(t, rel=1e-12)
    assert (a.loads <= np.floor(t * speeds + TOL)).all()
    assert np.bincount(a.owner.ravel(), minlength=p.groups).tolist() == a.loads.tolist()
    # The max-flow path on the same holders agrees.
    general = placement.from_stacks(placement.cyclic(300, 4).stacks)
    small = speeds[:300]
    if not reorder.uncovered(general, small > 0).size:
        ring = placement.cyclic(300, 4)
        assert reorder.makespan(general, small, 2) == pytest.approx(
            reorder.makespan(ring, small, 2), rel=1e-12
        )


@pytest.mark.parametrize(
    "speeds, match",
    [
        (np.ones(5), r"shape \(6,\)"),
        (np.ones((6, 1)), r"shape \(6,\)"),
        (np.ones(6, bool), "real-valued"),
        (np.array(["1"] * 6), "real-valued"),
        (np.array([1.0, np.nan, 1, 1, 1, 1]), "finite; group 1"),
        (np.array([1.0, 1, np.inf, 1, 1, 1]), "finite; group 2"),
        (np.array([1.0, 1, 1, -0.5, 1, 1]), ">= 0 .*group 3"),
    ],
)
def test_bad_speeds(speeds, match):
    p = placement.cyclic(6, 2)
    for fn in (reorder.makespan, reorder.assign_by_speed):
        with pytest.raises(ValueError, match=match):
            fn(p, speeds, 2)


def test_bad_microbatches():
    p = placement.cyclic(6, 2)
    with pytest.raises(ValueError, match="microbatches"):
        reorder.assign_by_speed(p, np.ones(6), 0)

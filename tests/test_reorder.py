"""Adaptive reordering: validity, optimality against brute-force max-flow, baselines."""

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spare_jax import placement, reorder
from spare_jax.incremental import LoadTracker


def brute_force_load(p, alive, m):
    """Smallest L such that networkx max-flow routes every micro-batch."""
    units = p.shard_units * m
    graph = nx.DiGraph()
    for s in range(p.shards):
        graph.add_edge("src", ("s", s), capacity=units)
        for h in p.holders(s):
            if alive[h]:
                graph.add_edge(("s", s), ("g", int(h)), capacity=units)
    for load in range(1, p.redundancy * units + 1):
        for g in np.flatnonzero(alive):
            graph.add_edge(("g", int(g)), "snk", capacity=load)
        if nx.maximum_flow_value(graph, "src", "snk") == p.shards * units:
            return load
    raise AssertionError("no feasible load")


def cyclic_case():
    """A ring, a redundancy, micro-batches and a random live mask."""
    return st.integers(2, 40).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.integers(2, min(5, g)),
            st.integers(1, 4),
            st.lists(st.booleans(), min_size=g, max_size=g).filter(any),
        )
    )


def longest_dead_run(alive):
    """Longest circular run of dead groups (brute force)."""
    g = len(alive)
    best = 0
    for start in range(g):
        run = 0
        while run < g and not alive[(start + run) % g]:
            run += 1
        best = max(best, run)
    return best


def check_valid(a, p, alive, m):
    """Every micro-batch exactly once, to a live holder; loads, work and owner agree."""
    units = p.shard_units * m
    assert a.owner.shape == (p.shards, units)
    assert alive[a.owner].all()
    for s in range(p.shards):
        assert set(a.owner[s].tolist()) <= set(p.holders(s).tolist())
    counted = np.zeros((p.shards, units), int)
    for g in range(p.groups):
        for slot in range(a.max_load):
            pos, mb = a.work[g, slot]
            if pos < 0:
                assert not a.counted[g, slot]
                continue
            shard = p.stack(g)[pos]
            if a.counted[g, slot]:
                assert a.owner[shard, mb] == g
                counted[shard, mb] += 1
    assert (counted == 1).all()
    assert a.loads.max() == a.max_load
    assert ((a.work[:, :, 0] >= 0).sum(axis=1) == a.loads).all()
    assert (a.loads[~alive] == 0).all()


@settings(max_examples=150, deadline=None)
@given(cyclic_case())
def test_adaptive_is_valid_and_optimal(case):
    g, r, m, alive = case
    alive = np.array(alive)
    p = placement.cyclic(g, r)
    dead_run = longest_dead_run(alive)
    if dead_run >= r:
        with pytest.raises(reorder.Interruption):
            reorder.assign(p, alive, m)
        return
    a = reorder.assign(p, alive, m)
    check_valid(a, p, alive, m)
    assert a.max_load == brute_force_load(p, alive, m)
    assert reorder.max_load(p, alive, m) == a.max_load


@settings(max_examples=100, deadline=None)
@given(cyclic_case())
def test_fixed_order_load_is_m_times_one_plus_longest_dead_run(case):
    g, r, m, alive = case
    alive = np.array(alive)
    p = placement.cyclic(g, r)
    dead_run = longest_dead_run(alive)
    if dead_run >= r:
        with pytest.raises(reorder.Interruption):
            reorder.max_load(p, alive, m, policy="fixed")
        return
    a = reorder.assign(p, alive, m, policy="fixed")
    check_valid(a, p, alive, m)
    assert a.max_load == m * (1 + dead_run)
    # Whole shards go to the first live holder in stack order.
    for s in range(g):
        first = next(h for h in p.holders(s) if alive[h])
        assert (a.owner[s] == first).all()


@settings(max_examples=60, deadline=None)
@given(cyclic_case())
def test_max_flow_path_agrees_with_ring_path(case):
    g, r, m, alive = case
    alive = np.array(alive)
    ring = placement.cyclic(g, r)
    general = placement.from_stacks(ring.stacks)
    if reorder.uncovered(ring, alive).size:
        return
    a = reorder.assign(general, alive, m)
    check_valid(a, general, alive, m)
    assert a.max_load == reorder.max_load(ring, alive, m)


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 30), st.integers(2, 4), st.integers(1, 3), st.data())
def test_strided_and_domain_aware_optimal(g, r, m, data):
    r = min(r, g)
    alive = np.array(data.draw(st.lists(st.booleans(), min_size=g, max_size=g).filter(any)))
    domains = np.arange(g) // (g // r)  # domains of floor(G/r) groups: the largest allowed
    for p in (
        placement.strided(g, r),
        placement.domain_aware(domains, r),
        placement.cyclic(g, r, ring_size=g // 2) if g % 2 == 0 and g // 2 >= r else None,
    ):
        if p is None or reorder.uncovered(p, alive).size:
            continue
        a = reorder.assign(p, alive, m)
        check_valid(a, p, alive, m)
        assert a.max_load == brute_force_load(p, alive, m)


def test_interruption_lists_uncovered_shards():
    p = placement.cyclic(10, 3)
    alive = reorder.alive_mask(10, [4, 5, 6])
    with pytest.raises(reorder.Interruption) as info:
        reorder.assign(p, alive, 2)
    assert info.value.uncovered.tolist() == [6]
    assert "6" in str(info.value)


@given(
    st.integers(2, 8).flatmap(lambda r: st.tuples(st.just(r), st.integers(1, 12))),
    st.integers(1, 4),
    st.data(),
)
def test_replication_costs_r_and_counts_each_microbatch_once(rs, m, data):
    r, sets = rs
    g = r * sets
    p = placement.replication(g, r)
    alive = np.array(data.draw(st.lists(st.booleans(), min_size=g, max_size=g)))
    if (~alive.reshape(sets, r)).all(axis=1).any():
        with pytest.raises(reorder.Interruption):
            reorder.assign(p, alive, m)
        return
    a = reorder.assign(p, alive, m)
    check_valid(a, p, alive, m)
    assert a.max_load == r * m and a.overhead == r
    assert (a.loads[alive] == r * m).all()


def test_failure_free_load_is_m():
    for p in (placement.cyclic(12, 3), placement.strided(12, 3), placement.data_parallel(12)):
        a = reorder.assign(p, np.ones(12, bool), 4)
        assert a.max_load == 4 and a.overhead == 1.0
        # Each group computes its own shard, stack position 0.
        assert (a.work[:, :, 0] == 0).all()


def test_sparse_failures_cost_one_extra_microbatch():
    # Far-apart single failures: work shifts along a chain, L = m + 1.
    p = placement.cyclic(200, 3)
    alive = reorder.alive_mask(200, [10, 80, 150])
    assert reorder.max_load(p, alive, 8) == 9
    assert reorder.max_load(p, alive, 1) == 2
    assert reorder.max_load(p, alive, 8, policy="fixed") == 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alive": np.ones(5, bool)}, "shape"),
        ({"alive": np.ones(6, int)}, "bool"),
        ({"microbatches": 0}, "microbatches"),
        ({"policy": "greedy"}, "policy"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {
        "placement": placement.cyclic(6, 2),
        "alive": np.ones(6, bool),
        "microbatches": 1,
        "policy": "adaptive",
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        reorder.assign(**args)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: reorder.alive_mask(6, [1.0]), "dead group id must be an integer"),
        (lambda: reorder.alive_mask(6, ["2"]), "dead group id must be an integer"),
        (lambda: reorder.alive_mask(6, [6]), "dead group id must be <= 5"),
        (lambda: reorder.alive_mask(6, [-1]), "dead group id must be >= 0"),
        (lambda: reorder.alive_mask(2.5, []), "groups must be an integer"),
        (lambda: reorder.uncovered(placement.cyclic(6, 2), np.ones(5, bool)), "shape"),
        (lambda: reorder.uncovered(placement.cyclic(6, 2), np.ones(6)), "bool"),
    ],
)
def test_live_set_helpers_refuse_nonsense(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(3, 60),
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from(["adaptive", "fixed"]),
    st.sampled_from(["cyclic", "strided", "custom"]),
    st.randoms(),
)
def test_tracker_matches_full_solve(g, r, m, policy, kind, rand):
    r = min(r, g)
    p = {"cyclic": placement.cyclic, "strided": placement.strided}.get(kind)
    p = p(g, r) if p else placement.from_stacks(placement.cyclic(g, r).stacks)
    tracker = LoadTracker(p, m, policy)
    order = list(range(g))
    rand.shuffle(order)
    for group in order:
        try:
            load = tracker.fail(group)
        except reorder.Interruption:
            assert reorder.uncovered(p, tracker.alive).size
            return
        assert load == reorder.max_load(p, tracker.alive, m, policy)

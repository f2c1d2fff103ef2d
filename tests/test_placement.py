"""Placements: stacks, holders, rings and input validation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spare_jax import placement, strategies


@given(st.integers(1, 60), st.data())
def test_cyclic_matches_definition(groups, data):
    r = data.draw(st.integers(1, groups))
    p = placement.cyclic(groups, r)
    assert (p.groups, p.redundancy, p.shards) == (groups, r, groups)
    for i in range(groups):
        assert p.stack(i).tolist() == [(i + k) % groups for k in range(r)]
        assert p.holders(i).tolist() == [(i - k) % groups for k in range(r)]
        # Holder k of shard i holds it at stack position k.
        for k, h in enumerate(p.holders(i)):
            assert p.stack(h)[k] == i


@given(st.integers(2, 80), st.data())
def test_strided_holders_are_distinct_and_spread(groups, data):
    r = data.draw(st.integers(1, groups))
    p = placement.strided(groups, r)
    for s in range(groups):
        h = p.holders(s)
        assert len(set(h.tolist())) == r
        assert s in p.stack(h[0])
    assert p.rings is not None and p.rings.size == groups


def test_strided_with_explicit_stride():
    p = placement.strided(12, 3, stride=4)
    assert p.stack(1).tolist() == [1, 5, 9]
    assert p.rings.shape == (4, 3)
    with pytest.raises(ValueError, match="stride"):
        placement.strided(12, 4, stride=4)


@settings(max_examples=200)
@given(st.integers(1, 50), st.data())
def test_domain_aware_exactly_when_possible(groups, data):
    r = data.draw(st.integers(1, groups))
    n_domains = data.draw(st.integers(1, groups))
    domains = np.array(
        data.draw(st.lists(st.integers(0, n_domains - 1), min_size=groups, max_size=groups))
    )
    largest = np.bincount(domains).max()
    if largest > groups // r:
        with pytest.raises(ValueError, match="domain"):
            placement.domain_aware(domains, r)
        return
    p = placement.domain_aware(domains, r)
    for s in range(groups):
        assert len(set(domains[p.holders(s)].tolist())) == r


def test_replication_sets():
    p = placement.replication(6, 3)
    assert p.shards == 2 and p.shard_units == 3 and p.duplicate_work
    assert p.holders(1).tolist() == [3, 4, 5]
    assert p.stack(4).tolist() == [1]


def test_data_parallel_is_r1():
    p = placement.data_parallel(5)
    assert p.redundancy == 1 and p.stack(3).tolist() == [3]


def test_multiple_rings():
    p = placement.cyclic(8, 2, ring_size=4)
    assert p.stack(3).tolist() == [3, 0]
    assert p.stack(7).tolist() == [7, 4]
    assert p.holders(4).tolist() == [4, 7]


def test_from_stacks_roundtrip():
    base = placement.cyclic(9, 3)
    p = placement.from_stacks(base.stacks)
    assert np.array_equal(p.holders_table, base.holders_table)
    assert p.rings is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: placement.cyclic(10, 0), "redundancy must be >= 1"),
        (lambda: placement.cyclic(3, 4), "must not exceed groups"),
        (lambda: placement.cyclic(10, 2.5), "redundancy must be an integer"),
        (lambda: placement.cyclic("10", 2), "groups must be an integer"),
        (lambda: placement.cyclic(0, 1), "groups must be >= 1"),
        (lambda: placement.replication(10, 3), "divisible"),
        (lambda: placement.cyclic(10, 2, ring_size=3), "ring_size"),
        (lambda: placement.domain_aware([0, 0, 1], 2), "floor"),
        (lambda: placement.from_stacks([[0, 0], [1, 1]]), "same shard"),
        (lambda: strategies.placement("ring", 4, 2), "strategy must be one of"),
        (lambda: strategies.placement("dp", 4, 2), "redundancy 1"),
        (lambda: strategies.placement("spare", 4, 2, layout="zigzag"), "layout must be one of"),
    ],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_arrays_are_read_only():
    p = placement.cyclic(4, 2)
    with pytest.raises(ValueError):
        p.stacks[0, 0] = 3
    with pytest.raises(IndexError):
        p.holders(4)

"""The slot table: one encoding of a step's work, one padder, one index layout."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spare_jax import placement, reorder, slots, strategies


@pytest.mark.parametrize(
    "kind,r", [("cyclic", 2), ("cyclic", 3), ("replication", 2), ("data_parallel", 1)]
)
def test_every_strategy_covers_the_same_global_batch(kind, r):
    p = strategies.placement(kind, 6, r)
    ids = slots.unit_ids(p, 2)
    assert ids.shape == (6, slots.stack_size(p, 2))
    assert set(ids.ravel().tolist()) == set(range(12))  # the same G*m units for every strategy
    for g in range(6):  # a group's stack is its shards in stack order
        per_shard = p.shard_units * 2
        expected = [s * per_shard + j for s in p.stack(g) for j in range(per_shard)]
        assert ids[g].tolist() == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 24), st.integers(1, 4), st.integers(1, 3), st.randoms())
def test_table_computes_each_unit_once_on_a_live_holder(g, r, m, rand):
    """Through `for_live_set`, every unit is counted exactly once, by a live group that holds it."""
    p = placement.cyclic(g, min(r, g))
    alive = np.array([rand.random() > 0.3 for _ in range(g)])
    try:
        table = slots.for_live_set(p, alive, m, rand.choice(["adaptive", "fixed"]))
    except reorder.Interruption as err:
        assert err.uncovered.size and not alive[p.holders_table[err.uncovered]].any()
        return
    ids = slots.unit_ids(p, m)
    counted = table.weight > 0
    groups, cols = np.nonzero(counted)
    units = ids[groups, table.index[groups, cols]]
    assert sorted(units.tolist()) == list(range(g * m))
    assert alive[groups].all() and (table.index[~alive] == -1).all()
    assert table.alive.tolist() == alive.astype(np.float32).tolist()
    assert float(table.denom) == g * m
    assert table.max_load == int((table.index >= 0).sum(axis=1).max())


def test_pad_is_the_one_padder():
    table = slots.for_live_set(placement.cyclic(4, 2), reorder.alive_mask(4, [2]), 2, "adaptive")
    assert table.width == table.max_load == 3
    padded = table.pad(6)
    assert (
        padded.width == 6 and (padded.index[:, 3:] == -1).all() and padded.weight[:, 3:].sum() == 0
    )
    np.testing.assert_array_equal(padded.index[:, :3], table.index)
    assert padded.max_load == 3
    with pytest.raises(ValueError, match="bound must be >="):
        table.pad(2)


def test_drop_is_inexact_and_never_interrupts_while_someone_lives():
    p = placement.cyclic(4, 2)
    table = slots.for_live_set(p, reorder.alive_mask(4, [2]), 2, "drop")
    assert float(table.denom) == 6.0  # 3 live groups x 2 micro-batches, not G * m = 8
    assert (table.index[2] == -1).all()
    table = slots.for_live_set(p, reorder.alive_mask(4, [1, 2]), 2, "drop")
    assert float(table.denom) == 4.0
    with pytest.raises(reorder.Interruption):
        slots.for_live_set(p, np.zeros(4, bool), 2, "drop")


def test_replication_counts_one_copy():
    p = placement.replication(4, 2)
    table = slots.for_live_set(p, np.ones(4, bool), 1, "adaptive")
    assert table.max_load == 2 and float(table.weight.sum()) == 4.0  # 2 shards x 2 units
    assert (table.weight.sum(axis=1) == [2, 0, 2, 0]).all()  # the first holder's copy counts

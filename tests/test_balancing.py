"""spare_jax.balancing: the speed tracker's decisions and the one collective that shares speeds."""

import jax
import numpy as np
import pytest

from spare_jax import balancing, reorder, strategies
from spare_jax import mesh as mesh_lib

G, M = 8, 2
PLACEMENT = strategies.placement("spare", G, 2)
ALIVE = np.ones(G, bool)


def _walked(speeds):
    if speeds is None:
        return reorder.assign(PLACEMENT, ALIVE, M).loads
    return reorder.assign_by_speed(PLACEMENT, speeds, M).loads


def _tracker(rates, **kw):
    tracker = balancing.SpeedTracker(G, **kw)
    tracker.observe(np.asarray(rates, float))
    return tracker


def test_a_slow_group_is_given_fewer_microbatches():
    rates = np.full(G, 100.0)
    rates[3] = 25.0
    tracker = _tracker(rates)
    speeds = tracker.choose(PLACEMENT, ALIVE, M, _walked(None), None)
    assert speeds is not None and speeds[3] == 0.25 and np.all(np.delete(speeds, 3) == 1.0)
    after = _walked(speeds)
    assert after[3] < M and after.sum() == G * M  # every micro-batch once
    # Once in force, the same figures change nothing (no thrashing).
    assert tracker.choose(PLACEMENT, ALIVE, M, after, speeds) is speeds


def test_noise_below_the_threshold_changes_nothing():
    rates = 100.0 * (1 + 0.05 * np.sin(np.arange(G)))  # +-5%: rounds to 1 or 15/16
    tracker = _tracker(rates)
    assert tracker.choose(PLACEMENT, ALIVE, M, _walked(None), None) is None


def test_equal_speeds_back_restore_the_plain_table():
    slow = np.full(G, 100.0)
    slow[5] = 10.0
    tracker = _tracker(slow, smoothing=1.0)
    speeds = tracker.choose(PLACEMENT, ALIVE, M, _walked(None), None)
    assert speeds is not None
    tracker.observe(np.full(G, 100.0))
    assert tracker.choose(PLACEMENT, ALIVE, M, _walked(speeds), speeds) is None


def test_unmeasured_groups_count_as_full_speed_and_dead_ones_as_zero():
    rates = np.zeros(G)  # 0: no figure this time
    rates[:4] = 50.0
    rates[2] = 12.5
    alive = ALIVE.copy()
    alive[6] = False
    speeds = _tracker(rates).relative(alive)
    assert speeds[2] == 0.25 and speeds[6] == 0.0
    assert np.all(speeds[[0, 1, 3, 4, 5, 7]] == 1.0)


def test_the_running_mean_keeps_old_figures_where_a_share_has_none():
    tracker = _tracker([10.0] * G, smoothing=0.5)
    tracker.observe(np.array([20.0] + [0.0] * (G - 1)))
    np.testing.assert_allclose(tracker.rates, [15.0] + [10.0] * (G - 1))


@pytest.mark.parametrize("field", ["smoothing", "threshold", "quantum"])
def test_bad_settings(field):
    with pytest.raises(ValueError, match=field):
        balancing.SpeedTracker(G, **{field: 0.0})


def test_share_takes_the_maximum_over_the_mesh():
    mesh = mesh_lib.make_mesh((1, 4, 2))
    mine = np.array([0.0, 3.0, 0.0, 7.5])
    np.testing.assert_array_equal(balancing.share(mesh, mine), mine)
    assert jax.device_count() == 8

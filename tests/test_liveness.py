"""The live set of a run: schedule entries fire once, re-joins, replacement, exact continuation."""

import json

import numpy as np
import pytest

from spare_jax import liveness


def test_schedule_fires_once_even_when_the_step_is_re_executed():
    f = liveness.Failures(4, schedule={2: [1], 3: [1, 2]})
    assert f.advance(0) == liveness.Change()
    change = f.advance(2)
    assert change.failed == (1,) and change.scheduled == (1,)
    assert f.advance(3).failed == (2,)  # group 1 is already dead: only 2 fails
    f.replace_all()  # a rollback: every group is back
    assert f.alive.all()
    assert f.advance(2) == liveness.Change() and f.advance(3) == liveness.Change()
    assert f.alive.all()


def test_hot_rejoin_after_repair_steps():
    f = liveness.Failures(4, schedule={1: [3]}, repair_steps=3)
    f.advance(1)
    assert not f.alive[3]
    for t in (2, 3):
        assert f.advance(t) == liveness.Change() and not f.alive[3]
    assert f.advance(4).rejoined == (3,) and f.alive[3]
    f.fail([0], step=6)  # a failure the data plane found, on a process still alive
    assert not f.alive[0] and f.rejoin_at == {0: 9}


def test_groups_of_a_dead_process_are_not_repaired():
    f = liveness.Failures(4, schedule={2: [1]}, repair_steps=3)
    f.advance(2)  # group 1 fails in simulation: back at step 5
    f.fail([1, 3], 4, repair=False)  # then its process (and group 3's) really dies
    f.fail([2], 4)  # a simulated failure found by the data plane is repaired
    changes = [f.advance(t) for t in range(3, 12)]
    assert [c.rejoined for c in changes if c.rejoined] == [(2,)]
    assert f.alive.tolist() == [True, False, True, False]


def test_random_failures_continue_exactly_from_a_saved_state():
    a = liveness.Failures(50, rate=0.05, seed=3)
    for t in range(10):
        a.advance(t)
    saved = json.loads(json.dumps(a.state_dict()))  # through JSON, as in a checkpoint
    b = liveness.Failures(50, rate=0.05, seed=99)
    b.load_state_dict(saved)
    for t in range(10, 30):
        assert a.advance(t) == b.advance(t)
    np.testing.assert_array_equal(a.alive, b.alive)


def test_total_rate_for_the_interval_model():
    assert liveness.Failures(4, rate=0.01).total_rate == 0.01
    assert liveness.Failures(4, schedule={9: [1, 2]}).total_rate == pytest.approx(2 / (4 * 10))
    assert liveness.Failures(4).total_rate == 0.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("3-1", "expected step:group"),
        ("9:1", "step must lie"),
        ("1:4", "group must lie"),
        ("a:b", "integers"),
    ],
)
def test_parse_schedule_names_the_bad_entry(spec, match):
    with pytest.raises(ValueError, match=match):
        liveness.parse_schedule(spec, groups=4, steps=8)


def test_bad_arguments():
    with pytest.raises(ValueError, match="failure_rate must be <= 1"):
        liveness.Failures(4, rate=1.5)
    with pytest.raises(ValueError, match="failure_rate must be finite"):
        liveness.Failures(4, rate=float("nan"))
    with pytest.raises(ValueError, match="repair_steps must be >= 0"):
        liveness.Failures(4, repair_steps=-1)
    f = liveness.Failures(4)
    with pytest.raises(ValueError, match="has 5 groups, this run has 4"):
        f.load_state_dict({**f.state_dict(), "alive": [True] * 5})

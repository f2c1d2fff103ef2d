"""Failure paths without processes: a failed optimizer update (a group spanning processes
leaves the job; otherwise a relaunch) and a failed collective with every process alive.

The update takes the state (donated), so a process whose update failed has
no state to go on with. When its group spans processes, the failure is a
collective inside the group (a group-mate died in it): the group is lost,
not the job, so the process leaves with status 77 and the job masks the
group. A group inside one process has no collective in its update: a
failure there is the process's own and the job relaunches.

A collective that fails with every process alive (a stalled peer) is
retried, from the second failure on over rebuilt collectives, and when
`recovery.RETRIES` retries have failed the job relaunches.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spare_jax import balancing, errors, recovery, trainer


class _FailingStep:
    def update(self, state, grad_sum, loss_sum, table):
        raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset")


class _Owner:
    """The parts of `Trainer` that the update's failure path reads."""

    _update = balancing.Balancing._update
    _leave_group = recovery.ProcessLoss._leave_group

    def __init__(self, spanning: bool):
        self.spanning, self.t, self.state, self.step = spanning, 7, {"w": 0}, _FailingStep()
        # 4 groups of 2 devices; groups 2 and 3 span processes (1, 2) and (2, 3).
        self.owners = np.array([[0, 0], [1, 1], [1, 2], [2, 3]])


class _Exit(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    def _exit(status):
        raise _Exit(status)

    monkeypatch.setattr(os, "_exit", _exit)


def _sums():
    return jnp.zeros(2), jnp.zeros(()), jnp.asarray(True)


def test_a_spanning_group_whose_update_failed_leaves_with_status_77(
    exits, monkeypatch, capfd, tmp_path
):
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    monkeypatch.setenv("SPARE_JAX_LAUNCH_DIR", str(tmp_path))  # under the launcher: events
    with pytest.raises(_Exit) as left:
        _Owner(spanning=True)._update(_sums(), None)
    assert left.value.args == (errors.EXIT_GROUP_LOST,)
    out, err = capfd.readouterr()
    events = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if "event" in line]
    assert {"kind": "group_lost", "process": 2, "groups": [2, 3], "step": 7} in events
    assert "update of step 7 failed inside the group" in err and "Gloo all-reduce" in err


def test_a_group_inside_one_process_whose_update_failed_relaunches(exits):
    with pytest.raises(errors.Relaunch, match="step 7: the optimizer update failed"):
        _Owner(spanning=False)._update(_sums(), None)


class _Retrying:
    """The parts of `Trainer` that a failed collective with every process alive touches."""

    _collective_failed = recovery.ProcessLoss._collective_failed

    def __init__(self):
        self.t, self._transient, self._resync, self.rebuilt = 5, 0, False, []

    def _rebuild_collectives(self, why):
        self.rebuilt.append(why)


def test_a_failed_collective_is_retried_then_retried_on_rebuilt_collectives_then_relaunched():
    """A pair that timed out stays closed: from the second failure in a row on, every process
    rebuilds its collectives before the retry; when RETRIES retries have failed, a relaunch."""
    owner = _Retrying()
    owner._collective_failed("Gloo all-reduce failed: Connection closed by peer")
    assert owner.rebuilt == [] and owner._resync  # the first retry: the same collectives
    for n in range(2, recovery.RETRIES + 1):
        owner._resync = False
        owner._collective_failed("Gloo all-reduce failed: Connection closed by peer")
        assert len(owner.rebuilt) == n - 1 and owner._resync
    assert "Connection closed by peer" in owner.rebuilt[0]
    with pytest.raises(errors.Relaunch, match="the last time on rebuilt ones"):
        owner._collective_failed("Gloo all-reduce failed: Connection closed by peer")


class _Reading:
    """The parts of `Trainer` that read a step's input."""

    _input = trainer.Trainer._input
    _prefetch = trainer.Trainer._prefetch

    def __init__(self):
        self.step, self.total, self.batches, self._held, self.input_rows = object(), 10, None, {}, 0


def test_a_retried_step_reads_no_input_again_and_a_changed_step_reads_once(monkeypatch):
    """A retry on the same step (a process that left with its group, a failed collective)
    reuses step t's input and keeps t + 1's read ahead; a new step (a loss) reads t again."""
    reads = []

    def load(step, batches, t):
        reads.append((step, t))
        return f"stacks {t}", 4

    monkeypatch.setattr(trainer.inputs, "load", load)
    owner = _Reading()
    first = owner.step
    for _attempt in range(3):  # the first attempt, then two retries of step 3
        assert owner._input(3) == ("stacks 3", 4)
        owner._prefetch(4)
    assert reads == [(first, 3), (first, 4)]
    owner._held.pop(3)  # step 3 done: step 4 was read ahead
    assert owner._input(4) == ("stacks 4", 4) and reads == [(first, 3), (first, 4)]
    owner.step = second = object()  # a loss: the survivors' step lays input out anew
    for _attempt in range(2):
        assert owner._input(4) == ("stacks 4", 4)
    owner._prefetch(10)  # past the last step: nothing to read
    assert reads == [(first, 3), (first, 4), (second, 4)] and owner.input_rows == 12
    assert set(owner._held) == {4} and owner._held[4][0] is second

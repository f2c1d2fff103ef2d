"""The launcher's bookkeeping without processes: the eviction rule, death lines, repeats,
the job's own launch directory, and the binaries run as modules."""

from __future__ import annotations

import subprocess
import sys
import time

import launching as lj
import pytest

from spare_jax import launch, runlog
from spare_jax.launch_watch import Signature, Tail, Watch, death_line, status_name


def _watch(positions: dict[int, tuple[int, str, float]], floor_s: float = 30.0) -> Watch:
    watch = Watch(floor_s)
    for i, (step, phase, since) in positions.items():
        watch.seen(i, step, phase, 0.1, since)
    return watch


def test_a_worker_behind_peers_that_wait_for_it_past_the_bound_is_evicted():
    watch = _watch({0: (8, "step", 0.0), 1: (8, "data", 0.0), 2: (8, "sync", 0.0)})
    assert watch.stuck(29.0, range(3)) == []  # under the bound
    ((index, reason),) = watch.stuck(31.0, range(3))
    assert index == 1 and "building the batch of step 8" in reason and "bound 30 s" in reason


def test_a_worker_inside_the_step_its_peers_have_left_is_evicted():
    """Its peers finished their part and wait in the live-set check; it never got there."""
    watch = _watch({0: (8, "sync", 0.0), 1: (8, "step", 0.0), 2: (8, "sync", 0.0)})
    assert [i for i, _ in watch.stuck(31.0, range(3))] == [1]


def test_a_worker_inside_the_step_is_first_given_the_collective_timeout():
    """A peer that left a collective on a dead process's error leaves the others in it until
    the CPU collective timeout: they reach the live-set check then, and are not evicted."""
    positions = {0: (8, "sync", 0.0), 1: (8, "step", 0.0), 2: (8, "sync", 0.0)}
    watch = _watch(positions)
    watch.collective_s = 300.0
    assert watch.inside() == pytest.approx(305.1)  # the timeout, a 0.1 s step, 5 s to report
    assert watch.stuck(31.0, range(3)) == [] and watch.stuck(305.0, range(3)) == []
    ((index, reason),) = watch.stuck(306.0, range(3))
    assert index == 1 and "inside step 8" in reason and "bound 305 s" in reason
    behind = _watch({0: (8, "sync", 0.0), 1: (8, "data", 0.0)})  # not in a collective
    behind.collective_s = 300.0
    assert [i for i, _ in behind.stuck(31.0, range(2))] == [1]


def test_busy_workers_and_workers_level_with_their_peers_are_never_evicted():
    for busy in runlog.BUSY_PHASES:
        watch = _watch({0: (8, "sync", 0.0), 1: (8, busy, 0.0)})
        assert watch.stuck(1e6, range(2)) == [], busy
    level = _watch({0: (8, "step", 0.0), 1: (8, "step", 0.0)})  # all in one place: a slow step
    assert level.stuck(1e6, range(2)) == []


def test_a_worker_that_moves_restarts_its_clock_and_the_dead_are_forgotten():
    watch = _watch({0: (8, "sync", 0.0), 1: (8, "data", 0.0)})
    watch.seen(1, 8, "step", 0.1, 25.0)
    assert watch.stuck(31.0, range(2)) == []  # at (8, step) for 6 s only
    assert [i for i, _ in watch.stuck(56.0, range(2))] == [1]
    watch.forget(1)
    assert watch.stuck(1e6, range(2)) == []
    assert watch.stuck(1e6, [0]) == []


def test_the_bound_is_the_floor_or_ten_median_steps_and_zero_turns_it_off():
    watch = Watch(30.0)
    for i, step_s in enumerate([1.0, 5.0, 9.0]):
        watch.seen(i, 3, "step", step_s, 0.0)
    assert watch.bound() == 50.0
    assert Watch(30.0).bound() == 30.0
    off = _watch({0: (8, "sync", 0.0), 1: (8, "data", 0.0)}, floor_s=0.0)
    assert off.stuck(1e6, range(2)) == []


def test_tail_keeps_the_exception_line_of_a_traceback():
    tail = Tail()
    for line in [
        "loading shard 3\n",
        "Traceback (most recent call last):\n",
        '  File "x.py", line 3, in <module>\n',
        "    raise OSError(5, 'Input/output error')\n",
        "OSError: [Errno 5] Input/output error\n",
        "ValueError: not in a traceback\n",
    ]:
        tail.feed(line)
    assert tail.first == tail.last == "OSError: [Errno 5] Input/output error"
    for line in ["Traceback (most recent call last):\n", "jax.errors.JaxRuntimeError: boom\n"]:
        tail.feed(line)
    assert tail.last == "jax.errors.JaxRuntimeError: boom" and tail.first.startswith("OSError")


def test_a_death_line_names_the_worker_its_status_or_signal_its_error_and_its_log():
    assert status_name(-11) == "SIGSEGV" and status_name(3) == "status 3"
    line = death_line(2, -9, "the fault injector (--kill)", "", "runs/x/launch/worker-2.log")
    assert line == (
        "worker 2 killed by SIGKILL; the fault injector (--kill); log: runs/x/launch/worker-2.log"
    )
    line = death_line(1, 1, "", "ValueError: bad", "w.log")
    assert line == "worker 1 exited with status 1; ValueError: bad; log: w.log"


def test_a_repeat_is_the_same_status_and_error_at_the_same_step_and_never_a_collective():
    first = Signature(1, "ValueError: batch", -1)
    assert first.same_as(Signature(1, "ValueError: batch", -1))
    assert not first.same_as(None)
    assert not first.same_as(Signature(1, "ValueError: other", -1))
    assert not first.same_as(Signature(-9, "ValueError: batch", -1))
    assert not Signature(-9, "", 7).same_as(Signature(-9, "", 8))
    assert Signature(-9, "", 7).same_as(Signature(-9, "", 7))  # an OOM kill at one step
    gloo = "jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: timeout"
    assert not Signature(1, gloo, 15).same_as(Signature(1, gloo, 15))


@pytest.mark.parametrize(
    ("command", "want"),
    [
        (["python", "train.py", "--workdir=runs/a"], "runs/a/launch"),
        (["python", "train.py", "--workdir", "/data/b", "--steps=3"], "/data/b/launch"),
        (["python", "my.py", "--out=o"], "o/launch"),
        (["python", "my.py", "--output_dir=o2"], "o2/launch"),
    ],
)
def test_the_default_launch_directory_is_under_the_jobs_work_directory(command, want):
    assert launch.default_launch_dir(command) == want


def test_without_a_work_directory_each_job_gets_a_fresh_one():
    one = launch.default_launch_dir(["python", "my.py"], now=0.0)
    two = launch.default_launch_dir(["python", "my.py"], now=1.0)
    assert one.startswith("runs/launch-") and one != two


def test_runlog_at_is_silent_without_a_launcher(monkeypatch, capsys):
    monkeypatch.delenv("SPARE_JAX_LAUNCH_DIR", raising=False)
    runlog.at(3, "data")
    runlog.at(3, "checkpoint")
    assert capsys.readouterr().out == ""


def test_a_busy_phase_is_sent_at_once_under_a_launcher(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPARE_JAX_LAUNCH_DIR", str(tmp_path))
    runlog.at(5, "checkpoint", step_s=0.25)
    out = capsys.readouterr().out
    assert (
        out == 'spare-jax-event: {"kind": "at", "step": 5, "phase": "checkpoint", "step_s": 0.25}\n'
    )


def test_a_long_busy_phase_is_said_again_so_the_launcher_sees_progress(
    monkeypatch, capsys, tmp_path
):
    """A compile of minutes is progress: the reporter repeats a busy phase, not a step phase."""
    monkeypatch.setenv("SPARE_JAX_LAUNCH_DIR", str(tmp_path))
    monkeypatch.setattr(runlog, "_BUSY_REPEAT_S", 0.2)
    runlog.at(11, "compile")
    time.sleep(2.0)
    runlog.at(11, "step")
    time.sleep(2.0)
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if '"step": 11' in line]
    compiles = [line for line in said if '"compile"' in line]
    steps = [line for line in said if '"step",' in line or '"phase": "step"' in line]
    assert len(compiles) >= 2, said  # said again while it lasts
    assert len(steps) == 1, said  # a step phase only when it changes


@pytest.mark.parametrize("binary", ["train", "launch", "reproduce", "validate", "plan"])
def test_the_binaries_run_as_modules_from_the_repository_root(binary):
    done = subprocess.run(
        [sys.executable, "-m", f"experiments.{binary}", "--help"],
        cwd=lj.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ModuleNotFoundError" not in done.stderr

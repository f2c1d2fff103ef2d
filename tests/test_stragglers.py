"""A slow worker, slowed from outside, is given less work; the run stays exact.

`experiments/regression.py --balance` runs as 4 worker processes of 2 CPU
devices (one group each, r = 2, m = 2). From step 3 the test stops and
continues worker 1 in a duty cycle (SIGSTOP 80 ms, SIGCONT 20 ms: about a
fifth of its speed), as a throttled host would run, until the job reports a
``straggler`` event. Then: the event names group 1 and gives it fewer
slots (every micro-batch still walked once), no worker was lost, and every
leaf of every worker's final parameters equals a single-device `jax.grad`
run (rtol 1e-5, atol 1e-6). Slow: one multi-process job, run by CI after
the README's test command.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import launching as lj
import pytest

pytestmark = pytest.mark.slow

STEPS = 100  # windows enough for a busy CI machine's noisy timings to agree


def _duty_cycle(pid: int, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.08)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def _naming(workdir, group: int) -> list[dict]:
    """The ``straggler`` events that name ``group`` and take slots off it (noise on a
    shared machine may also make another group look slow for a window)."""
    return [
        e
        for e in lj.events(workdir, "straggler")
        if e["group"] == group and e["walked_after"][group] < e["walked_before"][group]
    ]


def test_a_slowed_worker_is_given_less_work_and_the_run_stays_exact(tmp_path):
    env = lj.env(tmp_path / "jax_cache")
    workdir = tmp_path / "run"
    args = (f"--steps={STEPS}", "--checkpoint_steps=10", "--balance")
    worker = lj.regression_command(workdir, *args)
    job = lj.Job(lj.launcher(workdir, worker), workdir, env)
    stop = threading.Event()
    pid = None
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        pid = lj.pids_of(workdir)[1]
        slowing = threading.Thread(target=_duty_cycle, args=(pid, stop), daemon=True)
        slowing.start()
        job.wait_for(lambda: _naming(workdir, 1), timeout=240, what="a straggler event naming 1")
        stop.set()
        slowing.join(timeout=5)
        code = job.finish()
    finally:
        stop.set()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)  # never leave it stopped
            except ProcessLookupError:
                pass
        job.close()
    assert code == 0, job.output()[-3000:]
    first = _naming(workdir, 1)[0]
    assert first["group"] == 1 and first["speed"] < 1.0, first
    assert first["walked_after"][1] < first["walked_before"][1], first
    assert sum(first["walked_after"]) == sum(first["walked_before"]) == 4 * 2  # G * m, once
    assert not lj.events(workdir, "process_failure") and not lj.events(workdir, "relaunch")
    lj.assert_params(workdir, lj.reference_params(STEPS), range(4))
    lj.steps_of_last_attempt_are_contiguous(workdir, STEPS)
    lj.no_process_left(workdir)

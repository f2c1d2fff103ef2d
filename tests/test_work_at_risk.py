"""Checkpoints cap the work at risk: a run SIGKILLed between saves under the default interval.

``experiments/regression.py`` runs long enough (4,000 steps of a few ms) that
the analytical model, at the built-in GPU MTBF, would save only after warm-up
and at the end. The interval's ceiling (`checkpoint.Interval.ceiling`) saves
more often; a SIGKILL from outside, with no chance to save, must then lose no
more steps than the work at risk the ceiling allows (its ``ceiling_s`` over the
step time, from the interval notice in force at the kill), and a rerun
resumes and finishes. Without the ceiling the rerun redoes nearly everything.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import launching as lj
import pytest

pytestmark = pytest.mark.slow

STEPS = 4000
NOTICE = re.compile(r"the ceiling \((\w+): ([\d.]+) s of work\) under .* for step ([\d.]+) s")


def test_a_kill_between_checkpoints_loses_no_more_than_the_ceiling(tmp_path, tmp_path_factory):
    env = lj.env(tmp_path_factory.mktemp("cache"))
    command = lj.regression_command(tmp_path, f"--steps={STEPS}")
    log = tmp_path.parent / f"{tmp_path.name}.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            command, cwd=lj.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            deadline = time.monotonic() + 240

            def reached() -> int:
                return max((r["step"] for r in lj.records(tmp_path) if "loss" in r), default=-1)

            while len(lj.events(tmp_path, "checkpoint")) < 3 or reached() < STEPS // 2:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no second ceiling save within 240 s"
                time.sleep(0.005)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    reached = max(r["step"] for r in lj.records(tmp_path) if "loss" in r) + 1
    notices = NOTICE.findall(log.read_text())
    assert notices, log.read_text()[-3000:]
    _, ceiling_s, step_s = notices[-1]
    risk_steps = float(ceiling_s) / float(step_s)
    done = subprocess.run(
        command, cwd=lj.ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (resume,) = lj.events(tmp_path, "resume")
    lost = reached - resume["step"]
    # The notice's step time is a median: allow timing noise, never half the run.
    assert lost <= 1.5 * risk_steps + 5, (lost, risk_steps, notices[-1])
    assert lost < STEPS // 4, (lost, resume)
    summary = lj.summary(tmp_path)
    assert summary["checkpoint_interval_source"] == "ceiling"
    figures = summary["checkpoint_interval_figures"]
    assert figures["ceiling_steps"] < figures["model_steps"] == STEPS
    assert figures["ceiling_by"] in ("unmodelled", "run_fraction", "save_cost")

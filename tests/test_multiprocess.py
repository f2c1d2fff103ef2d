"""Real process failures: 4 worker processes, SIGKILL mid-step, survivors finish exactly.

`experiments/launch.py` runs 4 processes of 2 CPU devices (one group each),
hosts the coordination service itself, and SIGKILLs a worker in the middle of
a step. The checks: the run completes, and its float64 parameter checksum
equals a single-process run without failures (rtol 1e-5).

These tests start several JAX processes each; they are slow and bounded
(every wait has a timeout, and the launcher kills its workers on any exit).
The heartbeat timeout is 5 s here, longer than the launcher's 3 s default,
so that a CI machine busy compiling four processes does not take a slow
worker for a dead one; `benchmarks/recovery.py` measures the fast settings.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--config=configs/lm_tiny.py:smoke", "--steps=12", "--heartbeat_s=5"]
RTOL = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> float:
    workdir = tmp_path_factory.mktemp("reference")
    out = subprocess.run(
        [sys.executable, "experiments/train.py", *ARGS[:2], f"--workdir={workdir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads((workdir / "summary.json").read_text())["param_checksum"]


def _launch(env, workdir, *kills: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [
            sys.executable,
            "experiments/launch.py",
            "--processes=4",
            f"--workdir={workdir}",
            *ARGS,
            *(f"--kill={k}" for k in kills),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:])
    return out


def _events(workdir, name):
    return [r for r in read_records(str(workdir / "metrics.jsonl")) if r.get("event") == name]


def test_survivors_finish_the_step_without_a_restart(env, tmp_path, reference):
    _launch(env, tmp_path, "6:2")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isclose(summary["param_checksum"], reference, rel_tol=RTOL)
    assert summary["final_step"] == 12 and summary["rollbacks"] == 0
    (failure,) = _events(tmp_path, "process_failure")
    assert failure["process"] == [2] and failure["groups"] == [2] and failure["step"] == 6
    assert 0 < failure["detect_s"] < 60
    (recovered,) = _events(tmp_path, "recovered")
    assert recovered["step"] == 6 and recovered["live_groups"] == 3
    assert recovered["rolled_back"] is False
    assert not _events(tmp_path, "rollback") and not _events(tmp_path, "relaunch")
    assert not _events(tmp_path, "resume"), "survivors read no checkpoint"
    steps = [r for r in read_records(str(tmp_path / "metrics.jsonl")) if "event" not in r]
    assert [r["step"] for r in steps] == list(range(12))  # step 6 once: retried, not repeated
    assert all(r["live_groups"] == 3 for r in steps[6:])


def test_two_neighbours_interrupt_and_a_relaunch_rolls_back(env, tmp_path, reference):
    # Processes 2 and 3 hold groups 2 and 3, the only holders of shard 3.
    _launch(env, tmp_path, "7:2", "7:3")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert math.isclose(summary["param_checksum"], reference, rel_tol=RTOL)
    (relaunch,) = _events(tmp_path, "relaunch")
    assert relaunch["rolled_back"] is True and relaunch["to_step"] <= 7
    assert relaunch["lost_steps"] == 7 - relaunch["to_step"] and relaunch["relaunch_s"] > 0
    assert _events(tmp_path, "resume")[-1]["step"] == relaunch["to_step"]


def _workers_of(workdir) -> list[int]:
    """Pids of the processes whose command line names this work directory."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if f"--workdir={workdir}" in cmdline and "train.py" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_no_worker_outlives_a_killed_launcher(env, tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "experiments/launch.py",
            "--processes=4",
            f"--workdir={tmp_path}",
            *ARGS,
            "--steps=200",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while len(_workers_of(tmp_path)) < 4:
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.2)
    finally:
        launcher.kill()  # SIGKILL: the launcher's own clean-up never runs
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _workers_of(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _workers_of(tmp_path)
    for pid in left:  # leave nothing behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers outlived their launcher: {left}"

"""experiments/train.py end to end: rollback, re-join, resume after SIGKILL, corrupt checkpoints.

Every run is a real subprocess; the exactness check compares every leaf of the
final parameters (``params-0.npz``) with a failure-free run of the same command
(rtol 1e-5, atol 1e-6: fp32 round-off of summing the same gradients in another
order), and the float64 checksum of ``summary.json`` as well. Compiled steps are
shared between the runs through JAX's persistent compilation cache, so each run
costs seconds, not a compile.
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

import numpy as np
import pytest

from spare_jax import analysis, checkpoint
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "experiments" / "train.py"
SMOKE = ["--config=configs/lm_tiny.py:smoke", "--steps=16"]
FIELDS = {"step", "loss", "live_groups", "max_load", "step_time_s", "attempt"}
RTOL = 1e-5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _cmd(*args: str) -> list[str]:
    return [sys.executable, str(TRAIN), *SMOKE, *args]


def _train(env, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        _cmd(*args), cwd=ROOT, capture_output=True, check=False, text=True, timeout=timeout, env=env
    )


def _summary(workdir: pathlib.Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())


def _events(workdir: pathlib.Path, name: str) -> list[dict]:
    return [r for r in read_records(str(workdir / "metrics.jsonl")) if r.get("event") == name]


def _steps(workdir: pathlib.Path) -> list[dict]:
    return [r for r in read_records(str(workdir / "metrics.jsonl")) if "event" not in r]


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> pathlib.Path:
    """The failure-free run's work directory."""
    workdir = tmp_path_factory.mktemp("reference")
    out = _train(env, f"--workdir={workdir}")
    assert out.returncode == 0, out.stderr
    return workdir


def same_parameters(workdir: pathlib.Path, reference: pathlib.Path, process: int = 0) -> None:
    """Every leaf of the final parameters equals the failure-free run's (fp32 round-off)."""
    summary, want = _summary(workdir), _summary(reference)
    assert summary["final_step"] == want["final_step"]
    assert math.isclose(summary["param_checksum"], want["param_checksum"], rel_tol=RTOL)
    got, ref = np.load(workdir / f"params-{process}.npz"), np.load(reference / "params-0.npz")
    with got, ref:
        assert sorted(got.files) == sorted(ref.files) and len(ref.files) > 1
        for name in ref.files:
            np.testing.assert_allclose(got[name], ref[name], rtol=RTOL, atol=1e-6, err_msg=name)


def test_rejoin_and_rollback_end_with_the_failure_free_parameters(env, tmp_path, reference):
    # Group 1 fails before step 2 and re-joins 3 steps later; groups 2 and 3 fail
    # together before step 6, leaving shard 3 without a live holder: roll back to
    # the checkpoint of step 4 (saved every 4 steps), replace them, and go on.
    out = _train(
        env,
        f"--workdir={tmp_path}",
        "--failures=2:1,6:2,6:3",
        "--repair_steps=3",
        "--checkpoint_steps=4",
    )
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    summary = _summary(tmp_path)
    same_parameters(tmp_path, reference)
    assert summary["rollbacks"] == 1 and summary["checkpoint_interval_source"] == "pinned"
    assert [(e["step"], e["groups"]) for e in _events(tmp_path, "failure")] == [
        (2, [1]),
        (6, [2, 3]),
    ]
    assert [(e["step"], e["groups"]) for e in _events(tmp_path, "rejoin")] == [(5, [1])]
    (rollback,) = _events(tmp_path, "rollback")
    assert (rollback["from_step"], rollback["to_step"], rollback["lost_steps"]) == (6, 4, 2)
    assert rollback["restore_s"] > 0 and rollback["uncovered"] == [3]
    assert [e["step"] for e in _events(tmp_path, "checkpoint")] == [4, 8, 12, 16]
    steps = _steps(tmp_path)
    assert all(FIELDS <= set(r) for r in steps)
    live = {(r["step"], r["attempt"]): r["live_groups"] for r in steps}
    assert [live[(t, 0)] for t in range(6)] == [4, 4, 3, 3, 3, 4]  # fail at 2, back at 5
    assert live[(4, 1)] == live[(6, 1)] == 4  # after the rollback every group is back
    goodput = summary["goodput"]
    assert goodput["lost_s"] > 0 and goodput["recovery_s"] > 0 and goodput["reordering_s"] > 0
    parts = ("useful_s", "reordering_s", "checkpoint_s", "recovery_s", "lost_s")
    assert math.isclose(goodput["total_s"], sum(goodput[k] for k in parts), abs_tol=1e-5)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds (polled every millisecond)."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, "the run ended before the kill point"
            assert time.monotonic() < deadline, "no kill point within the timeout"
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.slow  # starts processes: run after the README's command
def test_resume_after_sigkill_during_a_save_and_at_a_random_point(env, tmp_path, reference):
    args = (f"--workdir={tmp_path}", "--checkpoint_steps=3", "--failures=4:0")
    metrics = tmp_path / "metrics.jsonl"

    # 1. Killed while the async save of step 6 is being written (Orbax's temporary
    #    directory exists), the way a node dies in the middle of a save.
    proc = subprocess.Popen(
        _cmd(*args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpts = tmp_path / "checkpoints"
    _kill_when(proc, lambda: any(p.name.startswith("6.") for p in ckpts.glob("6.*")))
    first = metrics.read_text()
    # 2. Rerun: resumes from the latest complete checkpoint; killed again after a
    #    random number of further steps.
    proc = subprocess.Popen(
        _cmd(*args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    extra = int(time.time_ns() % 5) + 1
    _kill_when(proc, lambda: len([r for r in _steps(tmp_path) if r["attempt"] == 1]) >= extra)
    assert metrics.read_text().startswith(first), "a rerun must append, never truncate"
    # 3. Rerun to the end.
    out = _train(env, *args)
    assert out.returncode == 0, out.stderr
    summary = _summary(tmp_path)
    same_parameters(tmp_path, reference)
    resumes = _events(tmp_path, "resume")
    assert len(resumes) >= 1 and all(e["step"] in (3, 6, 9, 12, 15) for e in resumes)
    assert resumes[0]["step"] in (3, 6)  # 6 only if its save committed before the kill landed
    saved_steps = [e["step"] for e in _events(tmp_path, "checkpoint")]
    assert saved_steps[0] == 3 and len(saved_steps) == len(set(saved_steps)), saved_steps
    assert summary["attempts"] == 3
    assert len(_events(tmp_path, "failure")) == 1, "a scheduled failure fires once"


@pytest.mark.slow  # starts processes: run after the README's command
def test_corrupt_and_foreign_checkpoints_are_skipped(env, tmp_path, reference):
    args = (f"--workdir={tmp_path}", "--checkpoint_steps=4")
    assert _train(env, *args).returncode == 0
    ckpts = tmp_path / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [8, 12, 16]
    for f in (ckpts / "16" / "state").rglob("*"):  # truncate every data file of step 16
        if f.is_file() and f.stat().st_size > 16:
            f.write_bytes(f.read_bytes()[:8])
    (ckpts / "20").mkdir()
    (ckpts / "20" / "junk").write_text("not a checkpoint")
    (ckpts / "notes").mkdir()  # a directory that is not a step at all
    out = _train(env, *args)
    assert out.returncode == 0, out.stderr
    assert "skipping checkpoint" in out.stderr and str(ckpts / "16") in out.stderr
    assert "Traceback" not in out.stderr
    assert _events(tmp_path, "resume")[-1]["step"] == 12
    same_parameters(tmp_path, reference)
    assert sorted(p.name.split("-")[0] for p in (ckpts / "corrupt").iterdir()) == ["16", "20"]
    # Nothing restores any more: one clear line and exit status 2.
    for step in (12, 16, 8):
        for f in (ckpts / str(step)).rglob("*"):
            if f.is_file():
                f.write_bytes(b"")
    out = _train(env, *args)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "none of the 3 checkpoint(s)" in errors[0]
    assert "Traceback" not in out.stderr


def test_auto_interval_is_the_analysis_optimum_for_the_measured_figures(env, tmp_path):
    out = _train(env, f"--workdir={tmp_path}", "--failure_rate=0.02", "--steps=24")
    assert out.returncode == 0, out.stderr
    summary = _summary(tmp_path)
    f = summary["checkpoint_interval_figures"]
    model = checkpoint.IntervalModel(
        strategy="spare",
        redundancy=2,
        microbatches=2,
        policy="adaptive",
        groups=4,
        devices_per_group=2,
        steps=24,
        failure_rate=0.02,
        gpu_mtbf_hours=5.1e4,
    )
    scenario = model.scenario(f["step_s"], f["save_stall_s"], f["save_s"], f["restore_s"])
    estimate = analysis.time_to_train(scenario, "spare", redundancy=2, microbatches=2)
    tau = estimate.checkpoint_interval_s
    if not math.isfinite(estimate.time_to_train_s):
        # Measured saves that outlast the model's MTTI (a loaded machine): no interval
        # finishes the run, and the documented fall-back is the save cost's renewal optimum.
        tau = analysis.exact_optimum(f["save_stall_s"], estimate.mean_time_to_interruption_s)
    assert math.isclose(tau, f["interval_s"], rel_tol=1e-9)
    expected = min(max(round(tau / f["step_s"]), 1), 24)
    assert f["model_steps"] == expected
    # The ceiling on the work at risk caps the optimum (checkpoint.Interval.ceiling).
    capped = expected > f["ceiling_steps"]
    assert summary["checkpoint_interval_source"] == ("ceiling" if capped else "model")
    assert summary["checkpoint_interval_steps"] == min(expected, f["ceiling_steps"])
    assert math.isclose(scenario.group_mtbf_s, f["step_s"] / 0.02, rel_tol=1e-9)
    assert "checkpoint interval" in out.stderr  # logged with the figures it came from


def test_data_parallel_failure_rolls_back_instead_of_stopping(env, tmp_path, reference):
    out = _train(env, f"--workdir={tmp_path}", "--strategy=dp", "--failures=5:2")
    assert out.returncode == 0, out.stderr
    (rollback,) = _events(tmp_path, "rollback")
    assert rollback["from_step"] == 5 and rollback["uncovered"] == [2]
    same_parameters(tmp_path, reference)


@pytest.mark.slow
def test_default_run_learns_below_unigram_entropy(env, tmp_path):
    """The default config (run from another directory, no --config) learns the Markov stream."""
    from lm.data import MarkovSource

    out = subprocess.run(
        [sys.executable, str(TRAIN), f"--workdir={tmp_path}", "--failures=50:1,120:3"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
        text=True,
        timeout=400,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    steps = _steps(tmp_path)
    source = MarkovSource(64, 32, 8, seed=0, branching=3)
    final = sum(r["loss"] for r in steps[-10:]) / 10
    assert final < 0.5 * source.unigram_entropy()
    assert final < source.entropy_rate() + 0.3

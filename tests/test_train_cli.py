"""experiments/train.py end to end: metrics contract, interruption and bad flags."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "experiments" / "train.py"
FIELDS = {"step", "loss", "live_groups", "max_load", "step_time_s"}


def _train(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TRAIN), *args],
        cwd=cwd,
        capture_output=True,
        check=False,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _metrics(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_through_failures(tmp_path):
    out = _train("--config=configs/lm_tiny.py:smoke", f"--workdir={tmp_path}", "--failures=2:1,5:3")
    assert out.returncode == 0, out.stderr
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(8))
    assert all(FIELDS <= set(r) for r in records)
    assert [r["live_groups"] for r in records] == [4, 4, 3, 3, 3, 2, 2, 2]
    assert [r["max_load"] for r in records] == [2, 2, 3, 3, 3, 4, 4, 4]  # ring of 4, r=2, m=2
    assert all(math.isfinite(r["loss"]) and r["step_time_s"] > 0 for r in records)
    assert records[-1]["compiles"] == 1 and all(r["exact"] for r in records)
    assert "done: 8 steps" in out.stdout


def test_data_parallel_failure_interrupts_with_exit_3(tmp_path):
    out = _train(
        "--config=configs/lm_tiny.py:smoke",
        f"--workdir={tmp_path}",
        "--strategy=dp",
        "--failures=0:2",
    )
    assert out.returncode == 3
    last = out.stderr.strip().splitlines()[-1]
    assert "interrupted at step 0" in last and "shard(s) [2] have no live holder" in last
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--strategy=raid"],
        ["--failures=3-1"],
        ["--config.model.nope=1"],
        ["--config=configs/missing.py"],
        ["--redundancy=9"],
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, args):
    out = _train("--config=configs/lm_tiny.py:smoke", f"--workdir={tmp_path}", *args)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr


@pytest.mark.slow
def test_default_run_learns_below_unigram_entropy(tmp_path):
    """The default config (run from another directory, no --config) learns the Markov stream."""
    from spare_jax.data import MarkovSource

    out = _train(f"--workdir={tmp_path}", "--failures=50:1,120:3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    records = _metrics(tmp_path)
    source = MarkovSource(64, 32, 8, seed=0, branching=3)
    final = sum(r["loss"] for r in records[-10:]) / 10
    assert final < 0.5 * source.unigram_entropy()
    assert final < source.entropy_rate() + 0.3

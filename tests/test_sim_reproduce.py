"""experiments/reproduce.py: artefacts of --quick, and the same plans as experiments/plan.py."""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
import subprocess
import sys

import pytest

from spare_jax import analysis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPRODUCE = os.path.join(ROOT, "experiments", "reproduce.py")
PLAN = os.path.join(ROOT, "experiments", "plan.py")
RESULTS = os.path.join(ROOT, "docs", "results")
ARTEFACTS = (
    "overhead_vs_redundancy",
    "endurable_failures",
    "availability_vs_redundancy",
    "time_to_train",
    "reduction_vs_replication",
)
PLAN_ROWS = ("checkpoint_restart", "replication", "spare_fixed", "spare_adaptive")


def _plan_json(*args: str) -> dict[str, dict]:
    """experiments/plan.py --json's rows by strategy name."""
    done = subprocess.run(
        [sys.executable, PLAN, "--json", *args],
        check=True,
        cwd=ROOT,
        timeout=300,
        capture_output=True,
        text=True,
    )
    return {row["name"]: row for row in json.loads(done.stdout)["strategies"]}


def _csv(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _assert_same_plans(rows: list[dict], expected: dict[str, dict]) -> None:
    """time_to_train.csv rows (one GPU count) choose what plan.py chooses."""
    by = {row["name"]: row for row in rows}
    for name in PLAN_ROWS:
        got, want = by[name], expected[name]
        assert (int(got["redundancy"]), int(got["microbatches"])) == (
            want["redundancy"],
            want["microbatches"],
        ), name
        assert math.isclose(
            float(got["closed_form_h"]) / 24.0, want["time_to_train_days"], rel_tol=1e-9
        ), name


def test_search_constants_are_the_optimiser_defaults():
    params = inspect.signature(analysis.optimise).parameters
    assert (
        tuple(params["redundancies"].default) == analysis.DEFAULT_REDUNDANCIES == tuple(range(1, 9))
    )
    assert (
        tuple(params["microbatches"].default) == analysis.DEFAULT_MICROBATCHES == (1, 2, 4, 8, 16)
    )


def test_committed_results_agree_with_plan_cli():
    """docs/results (the full run) plans 600k GPUs as `python experiments/plan.py` does."""
    rows = [
        row
        for row in _csv(os.path.join(RESULTS, "time_to_train.csv"))
        if int(row["gpus"]) == 600_000
    ]
    expected = _plan_json()
    _assert_same_plans(rows, expected)
    head = next(
        row
        for row in _csv(os.path.join(RESULTS, "reduction_vs_replication.csv"))
        if int(row["gpus"]) == 600_000
    )
    rep = expected["replication"]["time_to_train_days"]
    spare = expected["spare_adaptive"]["time_to_train_days"]
    assert math.isclose(float(head["closed_form_reduction"]), 1.0 - spare / rep, rel_tol=1e-9)


@pytest.mark.slow
def test_reproduce_quick_writes_artefacts_with_plan_cli_plans(tmp_path):
    out = tmp_path / "results"
    subprocess.run(
        [sys.executable, REPRODUCE, f"--out={out}", "--quick"],
        check=True,
        cwd=ROOT,
        timeout=600,
        capture_output=True,
    )
    for name in ARTEFACTS:
        png = out / f"{name}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
        assert len(_csv(str(out / f"{name}.csv"))) >= 2
    # --quick: 48 h of work at 9,600 and 96,000 GPUs.
    rows = [row for row in _csv(str(out / "time_to_train.csv")) if int(row["gpus"]) == 96_000]
    _assert_same_plans(rows, _plan_json("--gpus=96000", "--work_hours=48"))
    cases = [row["case"] for row in _csv(str(out / "sensitivity.csv"))]
    assert any(c.startswith("m fixed at 8") for c in cases)
    assert any(c.startswith("r at most 6") for c in cases)
    summary = (out / "summary.md").read_text()
    assert "| GPUs |" in summary and "Sensitivity" in summary and "Headline" in summary

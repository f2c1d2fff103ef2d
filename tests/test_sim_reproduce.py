"""Smoke test of experiments/reproduce.py --quick: every artefact is written."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTEFACTS = (
    "overhead_vs_redundancy",
    "endurable_failures",
    "availability_vs_redundancy",
    "time_to_train",
    "reduction_vs_replication",
)


@pytest.mark.slow
def test_reproduce_quick_writes_figures_tables_and_summary(tmp_path):
    out = tmp_path / "results"
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "experiments", "reproduce.py"),
            f"--out={out}",
            "--quick",
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
        capture_output=True,
    )
    for name in ARTEFACTS:
        png = out / f"{name}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
        with open(out / f"{name}.csv") as f:
            assert len(list(csv.DictReader(f))) >= 2
    assert (out / "sensitivity.csv").exists()
    summary = (out / "summary.md").read_text()
    assert "| GPUs |" in summary and "Sensitivity" in summary

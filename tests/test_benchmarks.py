"""Benchmark scripts stay runnable (their figures are read by people, not asserted)."""

import pathlib
import py_compile
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmark_compiles(script):
    py_compile.compile(str(script), doraise=True)


def test_reorder_benchmark_runs_and_prints_targets():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reorder.py"), "--repeats=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "assign adaptive, G=75000 r=4 m=8 5% dead" in result.stdout
    assert "assign max-flow" in result.stdout

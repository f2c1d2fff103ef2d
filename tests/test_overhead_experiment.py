"""The overhead experiment binary: outputs, claims in miniature, bad flags."""

import csv
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BINARY = ROOT / "experiments" / "overhead.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BINARY), *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_sweep_writes_table_csv_and_plot(tmp_path):
    out = tmp_path / "o"
    result = run(
        "--groups",
        "240",
        "--trials",
        "4",
        "--redundancy",
        "2,3,4",
        "--microbatches",
        "1,4",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "replication" in result.stdout and "adaptive" in result.stdout
    assert (out / "overhead.png").stat().st_size > 10_000
    rows = list(csv.DictReader(open(out / "summary.csv")))
    by = {(int(r["r"]), r["policy"], int(r["m"])): r for r in rows}
    assert len(rows) == 3 * 4
    for r in (2, 3, 4):
        rep = by[(r, "replication", 1)]
        assert float(rep["overhead_mean"]) == r
        adaptive, fixed = by[(r, "adaptive", 1)], by[(r, "fixed", 1)]
        # Whole shards: any failure costs 2x, and adaptive never loses to fixed order.
        assert 2.0 <= float(adaptive["overhead_mean"]) <= float(fixed["overhead_mean"])
        assert float(by[(r, "adaptive", 4)]["overhead_mean"]) < float(adaptive["overhead_mean"])
        assert adaptive["failures_to_interruption"] == fixed["failures_to_interruption"]
    curve = list(csv.DictReader(open(out / "overhead.csv")))
    assert {row["policy"] for row in curve} == {"adaptive", "fixed", "replication"}


@pytest.mark.parametrize(
    "args",
    [
        ["--groups=abc"],
        ["--redundancy=x"],
        ["--groups", "1"],
        ["--groups", "3", "--redundancy", "4"],
        ["stray"],
    ],
)
def test_bad_flags_exit_2_with_one_line(args):
    result = run(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

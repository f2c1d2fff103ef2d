"""The analysis, reorder, simulator and start-up benchmarks run tiny and print sane figures.

Each runs as a subprocess (as a person runs it) on a small scenario; the
printed medians must parse as non-negative times, and the figures printed
beside them must agree with the library (loads, failure counts, means).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUMBER = r"([0-9][0-9,]*\.?[0-9]*(?:e[-+]?[0-9]+)?|nan)"


def _process(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )


def _run(script: str, *args: str) -> str:
    result = _process(script, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _seconds(value: str, unit: str) -> float:
    scale = {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    out = float(value.replace(",", "")) * scale
    assert math.isfinite(out) and out >= 0.0
    return out


def test_analysis_benchmark():
    out = _run("analysis.py", "--repeats=1", "--gpus=80000", "--quick")
    rows = re.findall(r"^(TTT|optimise)(.*?)\s+" + NUMBER + r" (ms|s)\b", out, flags=re.MULTILINE)
    assert len(rows) == 6, out
    times = {f"{kind}{name}".strip(): _seconds(value, unit) for kind, name, value, unit in rows}
    warm = times["TTT, spare r=3 m=8, optimal interval, warm"]
    cold = times["TTT, spare r=3 m=8, cold (tables built)"]
    assert warm < cold  # the warm evaluation reuses the tables the cold one builds
    assert "10,000 groups" in out and "r 1..3 x m 1..8" in out


def test_reorder_benchmark():
    out = _run("reorder.py", "--repeats=2", "--groups=2000", "--flow_groups=400")
    for fraction in ("1%", "5%"):
        label = f"G=2000 r=4 m=8 {fraction} dead"
        assign = re.search(rf"assign adaptive, {label}\s+{NUMBER}(ms)\s+200ms\s+(\d+)", out)
        fixed = re.search(rf"assign fixed order, {label}\s+{NUMBER}(ms)\s+(\d+)", out)
        incr = re.search(rf"one more failure, incremental, {label}\s+{NUMBER}(us)\s+(\d+)", out)
        assert assign and fixed and incr, out
        _seconds(assign[1], assign[2])
        _seconds(incr[1], incr[2])
        load, fixed_load, after = int(assign[3]), int(fixed[3]), int(incr[3])
        # 8 micro-batches per shard: at least m, at most the whole stack of r shards;
        # adaptive never above fixed order; one more failure never lowers the load.
        assert 8 <= load <= fixed_load <= 4 * 8 and load <= after <= 4 * 8
    flow = re.search(
        rf"assign max-flow, G=400 r=4 m=1 2% dead\s+{NUMBER}(ms)\s+2000ms\s+(\d+)", out
    )
    assert flow, out
    assert 1 <= int(flow[3]) <= 4


def test_sim_benchmark():
    out = _run(
        "sim.py", "--repeats=1", "--gpus=8000", "--work_hours=24", "--replicas=2", "--trials=50"
    )
    runs = re.findall(
        rf"simulate (\S+(?: \(hot\))?)\s+r=(\d): median\s+{NUMBER} s\s+\((\d+) failures, "
        rf"(\d+) interruptions, time-to-train (\d+) h\)",
        out,
    )
    assert len(runs) == 5, out
    for label, r, sec, failures, interruptions, hours in runs:
        _seconds(sec, "s")
        assert int(interruptions) <= int(failures)
        assert int(hours) >= 24 * (int(r) if label == "replication" else 1)
        if label == "checkpoint_restart":
            assert int(interruptions) == int(failures)  # every failure interrupts plain DP
    many = re.findall(rf"simulate_many spare r=(\d) x2 on 2 processes:\s+{NUMBER} s", out)
    assert [r for r, _ in many] == ["3", "2"], out
    means = re.findall(r"failures_to_interruption G=1000 r=(\d) x50 trials: .* \(mean (\d+)\)", out)
    assert [r for r, _ in means] == ["2", "4"], out
    assert int(means[0][1]) < int(means[1][1])  # r = 4 endures more failures than r = 2
    assert all(int(r) <= int(mean) <= 1000 for r, mean in means)


def test_startup_benchmark_splits_the_imports_by_package(tmp_path):
    out = _run(
        "startup.py",
        "--module=spare_jax.mesh",
        "--starts=1",
        "--concurrent=2",
        f"--out={tmp_path}",
    )
    assert re.search(r"\bml_dtypes \d", out.splitlines()[0]), out  # the versions come first
    lines = re.findall(
        rf"import spare_jax\.mesh, (alone|2 at once) \((\d+) starts, medians, s\): "
        rf"wall {NUMBER}, imports {NUMBER}; (.*)$",
        out,
        flags=re.MULTILINE,
    )
    assert [(case, int(n)) for case, n, *_ in lines] == [("alone", 1), ("2 at once", 2)], out
    (record,) = [json.loads(line) for line in (tmp_path / "startup.jsonl").read_text().splitlines()]
    for case, _, wall, total, parts in lines:
        figures = record["cases"][case]
        assert float(wall) >= float(total) > 0.0
        shown = dict(p.split(" ") for p in parts.split(", "))
        assert list(shown.values()) == sorted(shown.values(), reverse=True)  # heaviest first
        assert {"jax", "numpy", "spare_jax"} <= figures.keys() and "flax" not in figures
        packages = sum(v for k, v in figures.items() if k not in ("wall", "total"))
        # Each start's packages add up to its total; medians of them nearly do.
        assert abs(packages - figures["total"]) < 0.5 * figures["total"], figures


def test_startup_benchmark_counts_each_module_once_for_its_own_package():
    spec = importlib.util.spec_from_file_location("startup", ROOT / "benchmarks" / "startup.py")
    startup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(startup)
    text = """import time: self [us] | cumulative | imported package
import time:       100 |        100 |       ml_dtypes._ext
import time:        50 |        150 |     ml_dtypes
import time:       300 |        450 |   jax._src.core
import time:        20 |        470 | jax
import time:         5 |          5 | spare_jax
a line of the program's own output
"""
    assert startup.import_seconds(text) == pytest.approx(
        {"total": 475e-6, "ml_dtypes": 150e-6, "jax": 320e-6, "spare_jax": 5e-6}
    )
    with pytest.raises(RuntimeError, match="no import times"):
        startup.import_seconds("Traceback (most recent call last): ...")


def test_startup_benchmark_names_a_module_that_does_not_import_on_one_line():
    result = _process("startup.py", "--module=no_such_module")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no_such_module" in lines[0], result.stderr

"""experiments/validate.py: its JSON contract, its outputs, and exit status 2 on bad input."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from spare_jax import strategies
from spare_jax.sim import simgrid_compat as compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
VALIDATE = ROOT / "experiments" / "validate.py"
METRICS = {"endurable_failures", "mtti_s", "overhead", "time_to_train_s"}


def _run(*args: str, cwd: pathlib.Path = ROOT, env: dict | None = None):
    return subprocess.run(
        [sys.executable, str(VALIDATE), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=env,
    )


def _one_line_usage_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--no_such_flag"], "no_such_flag"),
        (["--redundancy=two"], "--redundancy"),
        (["--map_gradients=-1"], "--map_gradients"),
        (["--epochs=0"], "epochs"),
    ],
)
def test_bad_flags_exit_2_on_one_line(args, says, tmp_path):
    assert says in _one_line_usage_error(_run(*args, "--out", str(tmp_path)))


@pytest.mark.skipif(not compat.available(), reason=compat.INSTALL_HINT)  # checked first
def test_unwritable_out_is_refused_before_any_computation(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        line = _one_line_usage_error(_run("--quick", "--out", str(out)))
        assert "--out" in line


def test_without_simgrid_says_how_to_install(tmp_path):
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "simgrid.py").write_text("raise ImportError('no SimGrid here')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow))
    line = _one_line_usage_error(_run("--quick", "--out", str(tmp_path / "out"), env=env))
    assert compat.INSTALL_HINT in line
    assert not (tmp_path / "out" / "summary.json").exists()


def test_default_out_is_under_runs():
    out = _run("--helpfull")
    assert out.returncode == 0
    assert "runs/validate" in out.stdout


@pytest.mark.skipif(not compat.available(), reason=compat.INSTALL_HINT)
@pytest.mark.slow
def test_quick_json_contract(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out_dir = tmp_path / "out"
    out = _run("--quick", "--json", "--out", str(out_dir), cwd=cwd)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert isinstance(data["simgrid_version"], str) and data["simgrid_version"][0].isdigit()
    speedup = data["speedup_fast_vs_simgrid"]
    assert isinstance(speedup, float) and speedup > 1.0
    rows = data["rows"]
    names = {v.name for v in strategies.VARIANTS}
    keys = set()
    for row in rows:
        assert row["metric"] in METRICS and row["strategy"] in names
        assert row["network"] in compat.NETWORK_MODELS
        assert isinstance(row["groups"], int) and isinstance(row["redundancy"], int)
        for field in ("closed_form", "fast_sim", "simgrid", "rel_diff"):
            assert isinstance(row[field], (int, float)) and math.isfinite(row[field]), field
        assert row["rel_diff"] == pytest.approx(row["simgrid"] / row["closed_form"] - 1.0)
        assert row["agree"] is (abs(row["rel_diff"]) <= data["tolerance"])
        key = (row["metric"], row["groups"], row["redundancy"], row["strategy"], row["network"])
        assert key not in keys
        keys.add(key)
    assert {r["metric"] for r in rows} == METRICS
    assert {r["network"] for r in rows} == set(compat.NETWORK_MODELS)
    assert {r["strategy"] for r in rows} == names
    # Pass 1 plays the fast simulator's own failure trace, epoch by epoch.
    assert all(r["same_trace_as_fast_sim"] for r in rows if r["metric"] == "endurable_failures")
    for name in ("agreement.csv", "divergence_map.csv", "speed.csv", "summary.json", "summary.md"):
        assert (out_dir / name).stat().st_size > 0, name
    for name in ("agreement.png", "divergence_map.png"):
        assert (out_dir / name).read_bytes()[:4] == b"\x89PNG", name
    assert json.loads((out_dir / "summary.json").read_text()) == data
    assert list(cwd.iterdir()) == []  # nothing written outside --out


def test_doc_holds_the_generated_tables():
    """docs/validation.md quotes the tables `--out docs/validation` wrote, unchanged."""
    doc = (ROOT / "docs" / "validation.md").read_text()
    summary = (ROOT / "docs" / "validation" / "summary.md").read_text()
    tables = [block for block in summary.split("\n\n") if block.startswith("|")]
    assert len(tables) == 2
    for table in tables:
        assert table.strip() in doc
    speed = [block for block in summary.split("\n\n") if block.startswith("Speed")]
    assert speed and speed[0].strip() in doc

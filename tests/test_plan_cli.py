"""experiments/plan.py: table and valid JSON; configs/scenarios.py loads (bad input elsewhere)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from spare_jax import analysis
from spare_jax.scenario import Scenario

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN = ROOT / "experiments" / "plan.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PLAN), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def _configs():
    spec = importlib.util.spec_from_file_location(
        "scenarios_config", ROOT / "configs" / "scenarios.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_json_default_scenario():
    out = _run("--json")
    assert out.returncode == 0, out.stderr
    data = _strict_json(out.stdout)
    names = [s["name"] for s in data["strategies"]]
    assert names == ["checkpoint_restart", "replication", "spare_fixed", "spare_adaptive"]
    for s in data["strategies"]:
        for key in (
            "redundancy",
            "checkpoint_interval_s",
            "microbatches",
            "time_to_train_days",
            "availability",
            "overhead_mean",
        ):
            assert key in s
    by = {s["name"]: s for s in data["strategies"]}
    want = 1 - by["spare_adaptive"]["time_to_train_days"] / by["replication"]["time_to_train_days"]
    assert data["reduction_vs_replication"] == pytest.approx(want)
    # Matches the library's optimiser on the same scenario.
    plan = analysis.optimise(Scenario(), "replication")
    assert by["replication"]["redundancy"] == plan.redundancy
    assert by["replication"]["time_to_train_days"] == pytest.approx(
        plan.estimate.time_to_train_days
    )


def _strict_json(text: str) -> dict:
    """json.loads that refuses NaN and Infinity (not JSON, though Python writes them)."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_table_and_overrides():
    out = _run(
        "--gpus", "80000", "--checkpoint_s", "120", "--restart_s", "900", "--redundancy", "1,2,3"
    )
    assert out.returncode == 0, out.stderr
    assert (
        "80,000 GPUs" in out.stdout
        and "checkpoint 120 s" in out.stdout
        and "restart 900 s" in out.stdout
    )
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[4:8]}
    assert set(rows) == {"checkpoint_restart", "replication", "spare_fixed", "spare_adaptive"}
    assert all(int(row[1]) <= 3 for row in rows.values())


def test_scenario_config_flag_and_deprecated_list_flag():
    out = _run("--scenario=configs/scenarios.py:small", "--json", "--redundancies", "1,2")
    assert out.returncode == 0, out.stderr
    data = _strict_json(out.stdout)
    assert data["scenario"]["gpus"] == 10_000
    assert {s["redundancy"] for s in data["strategies"]} <= {1, 2}


def test_json_is_valid_when_a_result_is_infinite():
    """Checkpoint/restart never finishes here: its figures are null, not Infinity or NaN."""
    out = _run(
        "--gpus", "80000", "--gpu_mtbf_hours", "10", "--redundancy", "1,2", "--microbatches", "1",
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    by = {row["name"]: row for row in _strict_json(out.stdout)["strategies"]}
    assert by["checkpoint_restart"]["time_to_train_days"] is None
    assert by["checkpoint_restart"]["reduction_vs_replication"] is None
    assert by["replication"]["time_to_train_days"] > 0


@pytest.mark.parametrize("variant", [None, "llama3", "small"])
def test_every_scenario_config_loads(variant):
    module = _configs()
    scenario = module.to_scenario(module.get_config(variant))
    assert isinstance(scenario, Scenario)
    if variant is None:
        assert scenario == Scenario()


def test_unknown_config_variant_and_field():
    module = _configs()
    with pytest.raises(ValueError, match="unknown scenario"):
        module.get_config("huge")
    config = module.get_config()
    config.unlock()
    config.nonsense = 1
    with pytest.raises(ValueError, match="unknown scenario field"):
        module.to_scenario(config)
    config = module.get_config()
    config.gpus = -8
    with pytest.raises(ValueError, match="gpus"):
        module.to_scenario(config)

"""experiments/plan.py: table, JSON and exit status 2 on bad input; configs/scenarios.py loads."""

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
    data = json.loads(out.stdout)
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


def test_table_and_overrides():
    out = _run(
        "--gpus", "80000", "--checkpoint_s", "120", "--restart_s", "900", "--redundancies", "1,2,3"
    )
    assert out.returncode == 0, out.stderr
    assert (
        "80,000 GPUs" in out.stdout
        and "checkpoint 120 s" in out.stdout
        and "restart 900 s" in out.stdout
    )
    lines = [
        line
        for line in out.stdout.splitlines()
        if line.startswith(("checkpoint_restart", "spare_"))
    ]
    assert len(lines) == 3


def test_scenario_config_flag():
    out = _run("--scenario=configs/scenarios.py:small", "--json", "--redundancies", "1,2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["scenario"]["gpus"] == 10_000


@pytest.mark.parametrize(
    "args",
    [
        ("--gpus", "-5"),
        ("--gpus", "0"),
        ("--gpus_per_group", "0"),
        ("--checkpoint_s", "-1"),
        ("--gpu_mtbf_hours", "0"),
        ("--gpus", "16", "--redundancies", "3"),
        ("--redundancies", "0"),
        ("--failure_law", "gamma"),
        ("--gpus", "100"),
        ("--bogus", "1"),
        ("--microbatches", "x"),
    ],
)
def test_bad_values_exit_2_with_one_line(args):
    out = _run(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("variant", [None, "llama3", "small"])
def test_every_scenario_config_loads(variant):
    module = _configs()
    scenario = module.to_scenario(module.get_config(variant))
    assert isinstance(scenario, Scenario)
    if variant is None:
        assert scenario == Scenario()


def test_unknown_config_variant_and_field():
    module = _configs()
    with pytest.raises(ValueError):
        module.get_config("huge")
    config = module.get_config()
    config.unlock() if hasattr(config, "unlock") else None
    config.nonsense = 1
    with pytest.raises(ValueError):
        module.to_scenario(config)

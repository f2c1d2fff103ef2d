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
    names = {"checkpoint_restart", "replication", "spare_fixed", "spare_adaptive"}
    lines = out.stdout.splitlines()
    assert lines[1].startswith("micro-batch b = 8,192 tokens (one 8,192-token sequence)")
    rows = {cells[0]: cells for cells in map(str.split, lines) if cells and cells[0] in names}
    assert set(rows) == names
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


def test_json_reports_each_plans_global_batch():
    """G x m x b per strategy, in tokens and sequences, as analysis.Batch computes it."""
    args = ("--scenario=configs/scenarios.py:small", "--redundancy=1,2,4", "--microbatches=1,4")
    out = _run(*args, "--microbatch_tokens=16384", "--sequence_tokens=4096", "--json")
    assert out.returncode == 0, out.stderr
    data = _strict_json(out.stdout)
    batch = analysis.Batch(microbatch_tokens=16_384, sequence_tokens=4_096)
    groups = data["scenario"]["groups"]
    assert data["batch"]["microbatch_sequences"] == 4
    assert data["batch"]["max_global_batch_tokens"] is None
    for row in data["strategies"]:
        m = row["microbatches"]
        assert row["global_batch_tokens"] == int(batch.global_tokens(groups, m))
        assert row["global_batch_sequences"] == int(batch.global_sequences(groups, m))
        assert row["global_batch_tokens"] == row["global_batch_sequences"] * 4_096


def test_cap_chooses_microbatches_within_it():
    """The cap admits m <= 2 where the uncapped optimum takes more; plan.py keeps to it."""
    scenario = Scenario(gpus=96_000, work_hours=48.0)
    cap = scenario.groups * 2 * analysis.DEFAULT_MICROBATCH_TOKENS
    search = ("--gpus=96000", "--work_hours=48", "--redundancy=1,8", "--microbatches=1,2,16")
    free = _strict_json(_run(*search, "--json").stdout)
    out = _run(*search, f"--max_global_batch_tokens={cap}", "--json")
    assert out.returncode == 0, out.stderr
    data = _strict_json(out.stdout)
    assert data["batch"]["max_microbatches"] == 2
    by = {row["name"]: row for row in data["strategies"]}
    assert {row["name"]: row for row in free["strategies"]}["spare_adaptive"]["microbatches"] > 2
    batch = analysis.Batch(max_global_batch_tokens=cap)
    want = analysis.optimise(
        scenario, "spare", redundancies=(1, 8), microbatches=(1, 2, 16), batch=batch
    )
    got = by["spare_adaptive"]
    assert (got["redundancy"], got["microbatches"]) == (want.redundancy, want.microbatches)
    assert got["microbatches"] <= 2 and got["global_batch_tokens"] <= cap
    assert got["time_to_train_days"] == pytest.approx(want.estimate.time_to_train_days)
    # The table says so, with the batch beside the headline's reduction.
    text = _run(*search, f"--max_global_batch_tokens={cap}").stdout
    assert f"capped at {cap:,} tokens (m <= 2 at 12,000 groups)" in text
    assert f"at m = {got['microbatches']}: a global batch of" in text.splitlines()[-1]
    assert "batch_seq" in text and "batch_tok" in text


def test_cap_below_one_microbatch_per_group_is_one_line_exit_2():
    """The paper's scale in 8-GPU groups cannot take Llama 3's 16M-token batch."""
    out = _run(f"--max_global_batch_tokens={analysis.REFERENCE_BATCH_TOKENS}")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1
    groups = Scenario().groups
    most = analysis.REFERENCE_BATCH_TOKENS // analysis.DEFAULT_MICROBATCH_TOKENS
    assert "below one micro-batch per group" in out.stderr
    assert f"{groups:,} groups" in out.stderr and f"at most {most:,} groups" in out.stderr

"""experiments/reproduce.py: artefacts of --quick, and the same plans as experiments/plan.py."""

from __future__ import annotations

import csv
import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys

import pytest

from spare_jax import analysis
from spare_jax.scenario import Scenario

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
    "headline_by_batch",
    "stragglers",
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


def _floats(rows: list[dict], key: str) -> list[float]:
    return [float(row[key]) for row in rows]


def _check_overhead(rows: list[dict]) -> None:
    """Epoch overhead vs r, simulated and closed form, in the order the figure shows.

    The simulation plays the same epochs for every policy and m, so its order is
    exact; its agreement with the closed form is tested with enough epochs in
    tests/test_sim_validation.py (here: 4 epochs per point).
    """
    by = {(row["strategy"], int(row["microbatches"]), int(row["redundancy"])): row for row in rows}
    for r in sorted({int(row["redundancy"]) for row in rows}):
        for column in ("sim_mean", "closed_form_mean"):
            mean = {key[:2]: float(row[column]) for key, row in by.items() if key[2] == r}
            assert mean[("replication", 1)] == r
            m16, m8, m1 = (mean[("spare adaptive", m)] for m in (16, 8, 1))
            assert 1.0 <= m16 <= m8 <= m1 <= mean[("spare fixed", 8)] + 1e-12 <= r + 1e-12
        for key, row in by.items():
            if key[2] == r:
                assert float(row["sim_mean"]) <= float(row["sim_worst"]) + 1e-12 <= r + 1e-12


def _check_endurance(rows: list[dict]) -> None:
    """Mean failures to interruption: sim vs exact within 4 s.e. + 1%, and its orderings."""
    cf = {}
    for row in rows:
        sim_f, se, exact = float(row["sim"]), float(row["sim_se"]), float(row["closed_form"])
        assert abs(sim_f - exact) <= 4 * se + 0.01 * exact, row
        cf[(row["strategy"], int(row["groups"]), int(row["redundancy"]))] = exact
    for (strategy, g, r), value in cf.items():
        assert value >= r
        larger = [v for (s2, g2, r2), v in cf.items() if (s2, r2) == (strategy, r) and g2 > g]
        assert all(v > value for v in larger)  # more groups endure more failures
        if ("replication", g, r) in cf and strategy == "spare":
            assert cf[("replication", g, r)] > value  # replication endures ~r^(1/r) more


def _check_availability(rows: list[dict]) -> None:
    for row in rows:
        for avail, ratio in (("closed_form", "closed_form_ratio"), ("sim", "sim_ratio")):
            assert 0.0 < float(row[ratio]) <= float(row[avail]) <= 1.0, row
        if row["strategy"] == "replication":
            assert float(row["closed_form_ratio"]) <= 1.0 / int(row["redundancy"]) + 1e-12


def _check_time_to_train(rows: list[dict], work_hours: float) -> dict[int, dict[str, dict]]:
    by_gpus: dict[int, dict[str, dict]] = {}
    for row in rows:
        assert float(row["closed_form_h"]) > work_hours and float(row["sim_h"]) > work_hours
        by_gpus.setdefault(int(row["gpus"]), {})[row["name"]] = row
    for by in by_gpus.values():
        t = {name: float(row["closed_form_h"]) for name, row in by.items()}
        # SPARe adaptive searches a superset of checkpoint/restart's and fixed order's plans.
        assert t["spare_adaptive"] <= min(t["checkpoint_restart"], t["spare_fixed"]) * (1 + 1e-9)
        assert t["replication"] <= t["replication_r2"] * (1 + 1e-9)  # r >= 2 is a narrower search
    return by_gpus


def _check_reduction(rows: list[dict], ttt: dict[int, dict[str, dict]]) -> None:
    for row in rows:
        t = {name: float(x["closed_form_h"]) for name, x in ttt[int(row["gpus"])].items()}
        want = 1 - t["spare_adaptive"] / t["replication"]
        assert math.isclose(float(row["closed_form_reduction"]), want, rel_tol=1e-9)
        assert float(row["closed_form_reduction_r2"]) >= float(row["closed_form_reduction"])


def _check_sensitivity(rows: list[dict]) -> None:
    base = rows[0]
    assert base["case"].startswith("baseline")
    for row in rows[1:]:  # quick: narrower searches only, so SPARe can only get slower
        assert float(row["spare_closed_form_h"]) >= float(base["spare_closed_form_h"]) * (1 - 1e-9)


def _check_stragglers(rows: list[dict]) -> None:
    """Each response's factor against what it must be: waiting costs 1/s once any group is
    slow; the speed-aware makespan is never worse than waiting or evicting."""
    assert {int(r["redundancy"]) for r in rows} == {2, 4}
    for row in rows:
        f = {k: float(row[f"{k}_factor"]) for k in ("wait", "evict", "speed_aware")}
        if int(row["slow_groups"]) == 0:
            assert f["wait"] == f["evict"] == f["speed_aware"] == 1.0, row
            continue
        assert f["wait"] == pytest.approx(1 / float(row["slow_speed"]))
        assert 1.0 <= f["speed_aware"] <= f["wait"], row
        if not math.isnan(f["evict"]):
            assert f["speed_aware"] <= f["evict"] + 1e-9, row
        base = float(row["base_h"])
        assert float(row["speed_aware_h"]) == pytest.approx(base * f["speed_aware"])


@pytest.mark.slow
def test_reproduce_quick_writes_results_that_hold_with_plan_cli_plans(tmp_path):
    """--quick into the default --out (runs/reproduce under the working directory)."""
    subprocess.run(
        [sys.executable, REPRODUCE, "--quick"],
        check=True,
        cwd=tmp_path,
        timeout=600,
        capture_output=True,
    )
    out = tmp_path / "runs" / "reproduce"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted(
        [f"{name}.{ext}" for name in ARTEFACTS for ext in ("csv", "png")]
        + ["sensitivity.csv", "domains.csv", "summary.md", "headline_by_batch.md"]
    )
    _check_overhead(_csv(str(out / "overhead_vs_redundancy.csv")))
    _check_endurance(_csv(str(out / "endurable_failures.csv")))
    _check_availability(_csv(str(out / "availability_vs_redundancy.csv")))
    ttt = _check_time_to_train(_csv(str(out / "time_to_train.csv")), work_hours=48.0)
    _check_reduction(_csv(str(out / "reduction_vs_replication.csv")), ttt)
    _check_sensitivity(_csv(str(out / "sensitivity.csv")))
    _check_stragglers(_csv(str(out / "stragglers.csv")))
    # --quick: 48 h of work at 9,600 and 96,000 GPUs.
    rows = list(ttt[96_000].values())
    _assert_same_plans(rows, _plan_json("--gpus=96000", "--work_hours=48"))
    cases = [row["case"] for row in _csv(str(out / "sensitivity.csv"))]
    assert any(c.startswith("m fixed at 8") for c in cases)
    assert any(c.startswith("r at most 6") for c in cases)
    summary = (out / "summary.md").read_text()
    assert "| GPUs |" in summary and "Sensitivity" in summary and "The optimum at" in summary
    _check_headline(_csv(str(out / "headline_by_batch.csv")), Scenario(gpus=96_000, work_hours=48))
    # summary.md leads with the headline table, as written on its own.
    table = (out / "headline_by_batch.md").read_text().strip()
    assert summary.index(table) < summary.index("## Time-to-train")


# ---------------------------------------------------------------- the headline along m and batch

HEADLINE_MD = os.path.join(RESULTS, "headline_by_batch.md")
FRAMINGS = ("optimum", "r=2", "r=4", "r=8")


def _headline_plans(row: dict, base: Scenario) -> tuple[analysis.Plan, analysis.Plan]:
    """SPARe's and replication's plans for one headline row, from the optimiser itself."""
    m = int(row["microbatches"])
    rs = None if row["framing"] == "optimum" else (int(row["framing"].removeprefix("r=")),)
    search = {} if rs is None else {"redundancies": rs}
    spare_at = dataclasses.replace(base, gpus_per_group=int(row["gpus_per_group"]))
    rep_at = dataclasses.replace(base, gpus_per_group=int(row["replication_gpus_per_group"]))
    spare = analysis.optimise(spare_at, "spare", microbatches=(m,), **search)
    return spare, analysis.optimise(rep_at, "replication", **search)


def _check_headline(rows: list[dict], base: Scenario, check_plans=lambda row: True) -> None:
    """Layout and batch of every row by analysis.Batch and capped_groups; plans re-derived.

    Rows without a cap run on the scenario's groups; with one, on the most groups
    (whole base groups, a multiple of 8) whose G x m x b fits, replication on the
    m = 1 layout. `check_plans(row)` picks the rows whose closed forms are re-derived
    with `analysis.optimise` (each costs a few optimiser runs).
    """
    assert {row["framing"] for row in rows} == set(FRAMINGS)
    halves = {bool(row["max_global_batch_tokens"]) for row in rows}
    assert halves == {False, True}
    for row in rows:
        m, g, b = int(row["microbatches"]), int(row["groups"]), int(row["microbatch_tokens"])
        cap = int(row["max_global_batch_tokens"]) if row["max_global_batch_tokens"] else None
        batch = analysis.Batch(b, None, cap)
        assert int(row["gpus"]) == base.gpus and g * int(row["gpus_per_group"]) == base.gpus
        assert int(row["global_batch_tokens"]) == int(batch.global_tokens(g, m))
        assert int(row["global_batch_sequences"]) == int(batch.global_sequences(g, m))
        if cap is None:
            assert g == base.groups and int(row["replication_groups"]) == base.groups
        else:
            assert bool(batch.fits(g, m))
            limits = [cap // (k * b) for k in (m, 1)]
            want = analysis.capped_groups(base.gpus, base.gpus_per_group, limits, multiple_of=8)
            assert [g, int(row["replication_groups"])] == want.tolist()
        if row["framing"] != "optimum":
            r = int(row["framing"].removeprefix("r="))
            assert int(row["spare_r"]) == int(row["replication_r"]) == r
        assert math.isfinite(float(row["sim_reduction"]))
        if check_plans(row):
            spare, rep = _headline_plans(row, base)
            assert (int(row["spare_r"]), int(row["replication_r"])) == (
                spare.redundancy,
                rep.redundancy,
            )
            want = 1 - spare.estimate.time_to_train_s / rep.estimate.time_to_train_s
            assert math.isclose(float(row["closed_form_reduction"]), want, rel_tol=1e-9)


def test_headline_quick_alone_holds_with_the_optimiser(tmp_path):
    """--parts=headline writes the table alone (no summary.md) and agrees with analysis."""
    done = subprocess.run(
        [sys.executable, REPRODUCE, "--quick", "--parts=headline", "--replicas=2", "--out=out"],
        check=False,
        cwd=tmp_path,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        f"headline_by_batch.{ext}" for ext in ("csv", "md", "png")
    ]
    rows = _csv(str(out / "headline_by_batch.csv"))
    assert len(rows) == 2 * 5 * len(FRAMINGS)  # both halves fit every m at 96,000 GPUs
    _check_headline(
        rows,
        Scenario(gpus=96_000, work_hours=48),
        check_plans=lambda row: int(row["microbatches"]) in (1, 16),
    )
    md = (out / "headline_by_batch.md").read_text()
    assert md.count("| m | groups x GPUs |") == 2 and "Under a cap of 16,777,216 tokens" in md


def test_committed_headline_holds_with_the_optimiser():
    """docs/results/headline_by_batch (the full run) against analysis.optimise at 600k GPUs.

    The plans of the rows without a cap at m = 1 and m = 16 (the whole-shard
    regime and plan.py's optimum) and the capped m = 1 row are re-derived; the
    layout and batch arithmetic of every row is checked.
    """
    rows = _csv(os.path.join(RESULTS, "headline_by_batch.csv"))
    assert len(rows) == 2 * 5 * len(FRAMINGS)

    def chosen(row: dict) -> bool:
        if row["max_global_batch_tokens"]:
            return int(row["microbatches"]) == 1 and row["framing"] == "optimum"
        return int(row["microbatches"]) in (1, 16)

    _check_headline(rows, Scenario(), check_plans=chosen)
    # The optimum at m = 16 is the plan `python experiments/plan.py` prints.
    top = next(
        row
        for row in rows
        if not row["max_global_batch_tokens"]
        and row["framing"] == "optimum"
        and int(row["microbatches"]) == 16
    )
    head = next(
        row
        for row in _csv(os.path.join(RESULTS, "reduction_vs_replication.csv"))
        if int(row["gpus"]) == 600_000
    )
    assert int(top["spare_r"]) == int(head["spare_r"]) and int(head["spare_m"]) == 16
    assert math.isclose(
        float(top["closed_form_reduction"]), float(head["closed_form_reduction"]), rel_tol=1e-9
    )


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_docs_quote_the_generated_headline_table():
    """docs/results.md and summary.md carry the generated table verbatim; README its rows."""
    with open(HEADLINE_MD) as f:
        rows = _table_rows(f.read())
    assert len(rows) == 2 * 6  # two tables: header and five rows each
    with open(os.path.join(RESULTS, "summary.md")) as f:
        summary = f.read()
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        results = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for line in rows:
        assert line in summary and line in results, line
    for line in rows[:6]:  # the README shows the table without a cap
        assert line in readme, line


def test_committed_stragglers_hold():
    """docs/results/stragglers.csv (--parts=stragglers) obeys what each response must give."""
    rows = _csv(os.path.join(RESULTS, "stragglers.csv"))
    _check_stragglers(rows)
    assert {int(r["groups"]) for r in rows} == {75_000}

"""Plan a training run: best redundancy, checkpoint interval and micro-batches per strategy.

For checkpoint/restart, replication, SPARe with fixed order and SPARe with
adaptive reordering, prints side by side the optimum of the closed-form model
(`spare_jax.analysis.optimise`) and what it gives: expected time-to-train,
availability, effective training-time ratio, mean overhead and the reduction
versus replication.

    python experiments/plan.py                      # built-in 600k-GPU scenario
    python experiments/plan.py --gpus 100000 --checkpoint_s 120 --json
    python experiments/plan.py --scenario=configs/scenarios.py:llama3

Bad values (negative, zero, r > G, ...) print one line and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

from absl import app, flags
from ml_collections import config_flags
from tqdm import tqdm

from spare_jax import analysis, cli
from spare_jax.analysis import planner as ttt
from spare_jax.scenario import Scenario

_CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "scenarios.py"
)
_SCENARIO = config_flags.DEFINE_config_file(
    "scenario", _CONFIG, "Scenario config file.", lock_config=True
)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_REDUNDANCIES = flags.DEFINE_list(
    "redundancies", [str(r) for r in analysis.DEFAULT_REDUNDANCIES], "Candidate redundancies r."
)
_MICROBATCHES = flags.DEFINE_list(
    "microbatches",
    [str(m) for m in analysis.DEFAULT_MICROBATCHES],
    "Candidate micro-batches m (SPARe adaptive).",
)
_RESTART_S = flags.DEFINE_float(
    "restart_s",
    None,
    "Restart cost in seconds at this run's GPU count (sets restart_s_ref "
    "and restart_ref_gpus; growth with N keeps restart_exponent).",
)

# One override flag per Scenario field (None: keep the scenario's value).
_FIELD_FLAGS = {}
for _field in dataclasses.fields(Scenario):
    _help = f"Override scenario.{_field.name} (default from --scenario)."
    if _field.type in ("int", int):
        _FIELD_FLAGS[_field.name] = flags.DEFINE_integer(_field.name, None, _help)
    elif _field.type in ("float", float):
        _FIELD_FLAGS[_field.name] = flags.DEFINE_float(_field.name, None, _help)
    elif _field.type in ("bool", bool):
        _FIELD_FLAGS[_field.name] = flags.DEFINE_bool(_field.name, None, _help)
    else:
        _FIELD_FLAGS[_field.name] = flags.DEFINE_string(_field.name, None, _help)

ROWS = (
    ("checkpoint_restart", "checkpoint_restart", "adaptive"),
    ("replication", "replication", "adaptive"),
    ("spare_fixed", "spare", "fixed"),
    ("spare_adaptive", "spare", "adaptive"),
)


def build_scenario() -> Scenario:
    """The scenario from --scenario plus the per-field override flags."""
    values = dict(_SCENARIO.value.to_dict())
    fields = {f.name for f in dataclasses.fields(Scenario)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise app.UsageError(f"unknown scenario field(s): {', '.join(unknown)}")
    for name, holder in _FIELD_FLAGS.items():
        if holder.value is not None:
            values[name] = holder.value
    if _RESTART_S.value is not None:
        values["restart_s_ref"] = _RESTART_S.value
        values["restart_ref_gpus"] = values["gpus"]
    try:
        return Scenario(**values).validate()
    except (TypeError, ValueError) as error:
        raise app.UsageError(str(error)) from None


def plan(
    scenario: Scenario, redundancies: list[int], microbatches: list[int], show_progress: bool = True
) -> dict:
    """Optimise every strategy; return the JSON-ready result."""
    total = sum(
        ttt.candidate_count(
            scenario, s, policy=p, redundancies=redundancies, microbatches=microbatches
        )
        for _, s, p in ROWS
    )
    plans = {}
    with tqdm(
        total=total,
        desc="optimising",
        delay=1.0,
        disable=not show_progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        for name, strategy, policy in ROWS:
            plans[name] = analysis.optimise(
                scenario,
                strategy,
                policy=policy,
                redundancies=redundancies,
                microbatches=microbatches,
                progress=bar.update,
            )
    rep = plans["replication"].estimate.time_to_train_s

    def reduction(t: float) -> float | None:
        value = 1.0 - t / rep
        return value if math.isfinite(value) else None

    def finite(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    rows = []
    for name, p in plans.items():
        e = p.estimate
        rows.append(
            {
                "name": name,
                "redundancy": p.redundancy,
                "checkpoint_interval_s": finite(p.checkpoint_interval_s),
                "microbatches": p.microbatches,
                "time_to_train_days": finite(e.time_to_train_days),
                "availability": e.availability,
                "effective_ratio": e.effective_ratio,
                "overhead_mean": e.overhead_mean,
                "mean_time_to_interruption_h": e.mean_time_to_interruption_s / 3600.0,
                "interruptions": finite(e.interruptions),
                "lost_work_h": finite(e.lost_work_s / 3600.0),
                "reduction_vs_replication": reduction(e.time_to_train_s),
            }
        )
    return {
        "scenario": dataclasses.asdict(scenario)
        | {"groups": scenario.groups, "restart_seconds": scenario.restart_seconds()},
        "strategies": rows,
        "reduction_vs_replication": reduction(plans["spare_adaptive"].estimate.time_to_train_s),
    }


def _fmt(value, spec: str) -> str:
    return "inf" if value is None else format(value, spec)


def table(result: dict) -> str:
    """Aligned text table of `plan`'s result."""
    s = result["scenario"]
    head = (
        f"{s['gpus']:,} GPUs, {s['groups']:,} groups of {s['gpus_per_group']}; GPU MTBF "
        f"{s['gpu_mtbf_hours']:,.0f} h ({s['failure_law']}); work {s['work_hours']:,.0f} h; "
        f"checkpoint {s['checkpoint_s']:g} s; restart {s['restart_seconds']:,.0f} s; "
        f"repair {s['repair']}"
    )
    cols = (
        "strategy",
        "r",
        "m",
        "ckpt_min",
        "TTT_days",
        "avail",
        "eff_ratio",
        "overhead",
        "MTTI_h",
        "restarts",
        "vs_repl",
    )
    lines = []
    for row in result["strategies"]:
        tau = row["checkpoint_interval_s"]
        lines.append(
            (
                row["name"],
                str(row["redundancy"]),
                str(row["microbatches"]),
                _fmt(None if tau is None else tau / 60.0, ".1f"),
                _fmt(row["time_to_train_days"], ",.1f"),
                f"{row['availability']:.4f}",
                f"{row['effective_ratio']:.4f}",
                f"{row['overhead_mean']:.3f}",
                f"{row['mean_time_to_interruption_h']:,.2f}",
                _fmt(row["interruptions"], ",.2f"),
                _fmt(
                    None
                    if row["reduction_vs_replication"] is None
                    else 100.0 * row["reduction_vs_replication"],
                    "+.1f",
                )
                + "%",
            )
        )
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    fmt = lambda cells: "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    out = [head, "", fmt(cols), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines]
    red = result["reduction_vs_replication"]
    out += [
        "",
        "SPARe adaptive vs replication (each at its optimum): "
        + ("n/a" if red is None else f"{100.0 * red:.1f}% less time-to-train"),
    ]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    del argv
    scenario = build_scenario()
    redundancies = cli.int_list("redundancies", _REDUNDANCIES.value)
    microbatches = cli.int_list("microbatches", _MICROBATCHES.value)
    if max(redundancies) > scenario.groups:
        raise app.UsageError(
            f"redundancy r={max(redundancies)} exceeds the number of groups "
            f"G={scenario.groups} (set --redundancies)"
        )
    result = plan(scenario, redundancies, microbatches, show_progress=not _JSON.value)
    if _JSON.value:
        print(json.dumps(result, indent=2, sort_keys=False))
    else:
        print(table(result))


if __name__ == "__main__":
    cli.run(main)

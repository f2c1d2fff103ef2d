"""Plan a training run: best redundancy, checkpoint interval and micro-batches per strategy.

For checkpoint/restart, replication, SPARe with fixed order and SPARe with
adaptive reordering (the variants of `spare_jax.strategies`), prints side by
side the optimum of the closed-form model (`spare_jax.analysis.optimise`) and
what it gives: expected time-to-train, availability, effective training-time
ratio, mean overhead and the reduction versus replication.

    python experiments/plan.py                      # built-in 600k-GPU scenario
    python experiments/plan.py --gpus 100000 --checkpoint_s 120 --json
    python experiments/plan.py --scenario=configs/scenarios.py:llama3
    python experiments/plan.py --redundancy 2,3,4 --microbatches 4,8

`--redundancy` and `--microbatches` are comma-separated candidate lists
(`--redundancies` is a deprecated alias of `--redundancy`). Bad values
(negative, zero, non-finite, r > G, sizes beyond the model's limits, ...)
print one line and exit with status 2, before any work. `--json` always prints
valid JSON: non-finite results are null.

The batch: every plan reads a global batch of G x m x b tokens a step (b:
`--microbatch_tokens`, one 8,192-token sequence by default, Llama 3 405B's
sequence length; `--sequence_tokens` when a micro-batch holds several
sequences), reported per strategy in sequences and tokens. With
`--max_global_batch_tokens` (16777216 is Llama 3 405B's 16M-token batch) the
search keeps to the m whose batch fits; a cap below one micro-batch per group
is refused (exit 2), naming the most groups it admits.

    python experiments/plan.py --gpus_per_group 600 --max_global_batch_tokens 16777216
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

from absl import app, flags
from tqdm import tqdm

from spare_jax import analysis, cli, strategies
from spare_jax.analysis import planner
from spare_jax.analysis.batch import short_count
from spare_jax.scenario import Scenario

_CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "scenarios.py"
)
_SCENARIO = cli.config_file_flag("scenario", os.path.normpath(_CONFIG), "Scenario config file.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_REDUNDANCY = flags.DEFINE_list(
    "redundancy",
    [str(r) for r in analysis.DEFAULT_REDUNDANCIES],
    "Candidate redundancies r (comma-separated).",
)
flags.DEFINE_alias("redundancies", "redundancy")  # deprecated spelling
_MICROBATCHES = flags.DEFINE_list(
    "microbatches",
    [str(m) for m in analysis.DEFAULT_MICROBATCHES],
    "Candidate micro-batches m (SPARe adaptive; comma-separated).",
)
_MICROBATCH_TOKENS = flags.DEFINE_integer(
    "microbatch_tokens",
    analysis.DEFAULT_MICROBATCH_TOKENS,
    "Tokens in one micro-batch, b (default: one 8,192-token sequence, Llama 3 405B's "
    "sequence length; sources in docs/planning.md).",
)
_SEQUENCE_TOKENS = flags.DEFINE_integer(
    "sequence_tokens",
    None,
    "Tokens in one sequence (default: --microbatch_tokens, one sequence per micro-batch).",
)
_MAX_BATCH = flags.DEFINE_integer(
    "max_global_batch_tokens",
    None,
    "Cap on the global batch G x m x b, tokens a step (default: none; Llama 3 405B's "
    "was 16M = 16777216); the search keeps to the m that fit.",
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


def build_scenario() -> Scenario:
    """The scenario from --scenario plus the per-field override flags."""
    values = dict(cli.config_value(_SCENARIO).to_dict())
    for name, holder in _FIELD_FLAGS.items():
        if holder.value is not None:
            values[name] = holder.value
    if _RESTART_S.value is not None:
        values["restart_s_ref"] = _RESTART_S.value
        values["restart_ref_gpus"] = values.get("gpus")
    try:
        return Scenario.from_mapping(values)
    except (TypeError, ValueError) as error:
        raise app.UsageError(str(error)) from None


def json_ready(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (JSON has no inf or NaN)."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def build_batch() -> analysis.Batch:
    """The micro-batch and the cap from the flags (`app.UsageError` if bad)."""
    try:
        return analysis.Batch(_MICROBATCH_TOKENS.value, _SEQUENCE_TOKENS.value, _MAX_BATCH.value)
    except ValueError as error:
        raise app.UsageError(str(error)) from None


def plan(
    scenario: Scenario,
    redundancies: list[int],
    microbatches: list[int],
    show_progress: bool = True,
    batch: analysis.Batch | None = None,
) -> dict:
    """Optimise every variant; return the result (`json_ready` makes it valid JSON).

    `batch` (default `analysis.Batch()`: one 8,192-token sequence per micro-batch,
    no cap) sets each plan's global batch, G x m x b, and the cap the search keeps to.

    Raises:
        ValueError: a candidate beyond the model's limits, or a cap below one
            micro-batch per group (checked before any work).
    """
    batch = analysis.Batch() if batch is None else batch
    search = {"redundancies": redundancies, "microbatches": microbatches, "batch": batch}
    total = sum(
        planner.candidate_count(scenario, v.strategy, policy=v.policy, **search)
        for v in strategies.VARIANTS
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
        for v in strategies.VARIANTS:
            plans[v.name] = analysis.optimise(
                scenario, v.strategy, policy=v.policy, progress=bar.update, **search
            )
    rep = plans["replication"].estimate.time_to_train_s
    rows = []
    for name, p in plans.items():
        e = p.estimate
        rows.append(
            {
                "name": name,
                "redundancy": p.redundancy,
                "checkpoint_interval_s": p.checkpoint_interval_s,
                "microbatches": p.microbatches,
                "time_to_train_days": e.time_to_train_days,
                "availability": e.availability,
                "effective_ratio": e.effective_ratio,
                "overhead_mean": e.overhead_mean,
                "mean_time_to_interruption_h": e.mean_time_to_interruption_s / 3600.0,
                "interruptions": e.interruptions,
                "lost_work_h": e.lost_work_s / 3600.0,
                "reduction_vs_replication": 1.0 - e.time_to_train_s / rep,
                "global_batch_sequences": int(
                    batch.global_sequences(scenario.groups, p.microbatches)
                ),
                "global_batch_tokens": int(batch.global_tokens(scenario.groups, p.microbatches)),
            }
        )
    return {
        "scenario": dataclasses.asdict(scenario)
        | {"groups": scenario.groups, "restart_seconds": scenario.restart_seconds()},
        "batch": dataclasses.asdict(batch)
        | {
            "microbatch_sequences": batch.microbatch_sequences,
            "max_microbatches": batch.max_microbatches(scenario.groups),
        },
        "strategies": rows,
        "reduction_vs_replication": 1.0 - plans["spare_adaptive"].estimate.time_to_train_s / rep,
    }


def batch_line(result: dict) -> str:
    """One line on the micro-batch and the cap."""
    b = result["batch"]
    n, seq = b["microbatch_sequences"], b["microbatch_tokens"] // b["microbatch_sequences"]
    what = f"{n} sequences of {seq:,} tokens" if n > 1 else f"one {seq:,}-token sequence"
    line = f"micro-batch b = {b['microbatch_tokens']:,} tokens ({what})"
    if b["max_global_batch_tokens"] is None:
        return line + "; global batch G x m x b, no cap"
    return (
        line + f"; global batch G x m x b capped at {b['max_global_batch_tokens']:,} tokens "
        f"(m <= {b['max_microbatches']} at {result['scenario']['groups']:,} groups)"
    )


def table(result: dict) -> str:
    """Aligned text table of `plan`'s result (non-finite values print as inf or nan)."""
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
        "batch_seq",
        "batch_tok",
    )
    lines = [
        (
            row["name"],
            str(row["redundancy"]),
            str(row["microbatches"]),
            f"{row['checkpoint_interval_s'] / 60.0:.1f}",
            f"{row['time_to_train_days']:,.1f}",
            f"{row['availability']:.4f}",
            f"{row['effective_ratio']:.4f}",
            f"{row['overhead_mean']:.3f}",
            f"{row['mean_time_to_interruption_h']:,.2f}",
            f"{row['interruptions']:,.2f}",
            f"{100.0 * row['reduction_vs_replication']:+.1f}%",
            short_count(row["global_batch_sequences"]),
            short_count(row["global_batch_tokens"]),
        )
        for row in result["strategies"]
    ]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]

    def fmt(cells: tuple[str, ...] | list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [head, batch_line(result), "", fmt(cols), fmt(["-" * w for w in widths])]
    out += [fmt(line) for line in lines]
    red = result["reduction_vs_replication"]
    spare = result["strategies"][-1]
    out += [
        "",
        "SPARe adaptive vs replication (each at its optimum): "
        + (
            f"{100.0 * red:.1f}% less time-to-train, at m = {spare['microbatches']}: a global "
            f"batch of {short_count(spare['global_batch_sequences'])} sequences "
            f"({short_count(spare['global_batch_tokens'])} tokens) a step"
            if math.isfinite(red)
            else "n/a"
        ),
    ]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    del argv
    scenario = build_scenario()
    redundancies = cli.int_list("redundancy", _REDUNDANCY.value)
    microbatches = cli.int_list("microbatches", _MICROBATCHES.value)
    if max(redundancies) > scenario.groups:
        raise app.UsageError(
            f"redundancy r={max(redundancies)} exceeds the number of groups "
            f"G={scenario.groups} (set --redundancy)"
        )
    batch = build_batch()
    try:
        batch.check_groups(scenario.groups)
        result = plan(
            scenario, redundancies, microbatches, show_progress=not _JSON.value, batch=batch
        )
    except ValueError as error:  # beyond the model's limits, or over the cap: before work
        raise app.UsageError(str(error)) from None
    if _JSON.value:
        print(json.dumps(json_ready(result), indent=2, allow_nan=False))
    else:
        print(table(result))


if __name__ == "__main__":
    cli.run(main)

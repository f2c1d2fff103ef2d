"""Simulator speed, by default at the paper's largest scale (a benchmark, not a test).

    python benchmarks/sim.py            # medians (timeit.repeat) over --repeats runs
    python benchmarks/sim.py --quick    # one repeat, 10 replicas
    python benchmarks/sim.py --gpus 8000 --work_hours 24 --replicas 4 --trials 100

Targets (the README's benchmark table): one full run at 600k GPUs (75,000
groups, a month of failure-free work, thousands of failures) in at most 10 s;
100 replicas in at most 2 min on 2 cores. The machine may be shared: report
medians, not minima.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import timeit

from absl import app, flags

from spare_jax import cli, sim
from spare_jax.scenario import Scenario

MAX_REPEATS = 1_000
MAX_TRIALS = 1_000_000

QUICK = flags.DEFINE_bool("quick", False, "one repeat and 10 replicas")
REPEATS = flags.DEFINE_integer(
    "repeats",
    5,
    "repeats of each single-run measurement",
    lower_bound=1,
    upper_bound=MAX_REPEATS,
)
REPLICAS = flags.DEFINE_integer(
    "replicas",
    100,
    "replicas of the simulate_many measurement",
    lower_bound=1,
    upper_bound=sim.batch.MAX_REPLICAS,
)
GPUS = flags.DEFINE_integer("gpus", 600_000, "GPUs of the scenario (8 per group)")
WORK_HOURS = flags.DEFINE_float("work_hours", 720.0, "failure-free work of each run, hours")
TRIALS = flags.DEFINE_integer(
    "trials",
    1_000,
    "trials of the failures_to_interruption measurement",
    lower_bound=1,
    upper_bound=MAX_TRIALS,
)


def _median_time(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of one call over `repeats`, the last call's result)."""
    out = []
    times = timeit.repeat(lambda: out.append(fn()), repeat=repeats, number=1)
    return statistics.median(times), out[-1]


def main(argv: list[str]) -> None:
    del argv
    quick = QUICK.value
    repeats = 1 if quick else REPEATS.value
    replicas = 10 if quick else REPLICAS.value
    try:
        scenario = Scenario(gpus=GPUS.value, work_hours=WORK_HOURS.value)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    groups = scenario.groups
    print(
        f"scenario: {scenario.gpus} GPUs, {groups} groups, "
        f"{scenario.work_hours:.0f} h of work, restart {scenario.restart_seconds():.0f} s"
    )
    hot = dataclasses.replace(scenario, repair="hot")
    runs = [
        ("spare", 3, 3.0 * 3600, scenario),
        ("spare", 2, 1.5 * 3600, scenario),
        ("replication", 2, 1.5 * 3600, scenario),
        ("checkpoint_restart", 1, 190.0, scenario),
        ("spare", 3, 3.0 * 3600, hot),
    ]
    for i, (strategy, r, tau, sc) in enumerate(runs):
        if r > groups or (strategy == "replication" and groups % r):
            continue
        run = functools.partial(
            sim.simulate, sc, strategy, redundancy=r, checkpoint_interval_s=tau, seed=i
        )
        sec, res = _median_time(run, repeats)
        label = strategy + (" (hot)" if sc.repair == "hot" else "")
        print(
            f"simulate {label:18s} r={r}: median {sec:7.3f} s  ({res.failures} failures, "
            f"{res.interruptions} interruptions, time-to-train {res.time_to_train_s / 3600:.0f} h)"
        )
    for r in (3, 2):  # r = 2 is the slow case: its optimal load changes most often
        if r > groups:
            continue
        run = functools.partial(
            sim.simulate_many,
            scenario,
            "spare",
            replicas=replicas,
            redundancy=r,
            checkpoint_interval_s=3.0 * 3600,
            progress=False,
        )
        sec, summary = _median_time(run, 1)
        print(
            f"simulate_many spare r={r} x{replicas} on 2 processes: {sec:7.3f} s "
            f"(time-to-train {summary.mean['time_to_train_s'] / 3600:.1f} "
            f"+- {summary.stderr['time_to_train_s'] / 3600:.1f} h)"
        )
    for r in (2, 4):
        if r > groups:
            continue
        run = functools.partial(
            sim.failures_to_interruption, "spare", groups, r, trials=TRIALS.value
        )
        sec, f = _median_time(run, repeats)
        print(
            f"failures_to_interruption G={groups} r={r} x{TRIALS.value} trials: "
            f"median {sec:7.3f} s (mean {f.mean():.0f})"
        )


if __name__ == "__main__":
    cli.run(main)

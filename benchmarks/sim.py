"""Simulator speed at the paper's largest scale (issue #4; a benchmark, not a test).

    python benchmarks/sim.py            # medians over --repeats runs
    python benchmarks/sim.py --quick    # one repeat, 10 replicas

Targets: one full run at 600k GPUs (75,000 groups, a month of failure-free
work, thousands of failures) in at most 10 s; 100 replicas in at most 2 min on
2 cores. The machine may be shared: report medians, not minima.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

from absl import flags

from spare_jax import cli, sim
from spare_jax.scenario import Scenario

QUICK = flags.DEFINE_bool("quick", False, "one repeat and 10 replicas")
REPEATS = flags.DEFINE_integer("repeats", 5, "repeats of each single-run measurement")
REPLICAS = flags.DEFINE_integer("replicas", 100, "replicas of the simulate_many measurement")


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str]) -> None:
    del argv
    quick = QUICK.value
    repeats = 1 if quick else REPEATS.value
    replicas = 10 if quick else REPLICAS.value
    scenario = Scenario()
    print(
        f"scenario: {scenario.gpus} GPUs, {scenario.groups} groups, "
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
        run = functools.partial(
            sim.simulate, sc, strategy, redundancy=r, checkpoint_interval_s=tau, seed=i
        )
        sec, res = _median_time(run, repeats)
        label = strategy + (" (hot)" if sc.repair == "hot" else "")
        print(
            f"simulate {label:18s} r={r}: median {sec:6.2f} s  ({res.failures} failures, "
            f"{res.interruptions} interruptions, time-to-train {res.time_to_train_s / 3600:.0f} h)"
        )
    for r in (3, 2):  # r = 2 is the slow case: its optimal load changes most often
        start = time.perf_counter()
        summary = sim.simulate_many(
            scenario,
            "spare",
            replicas=replicas,
            redundancy=r,
            checkpoint_interval_s=3.0 * 3600,
            progress=False,
        )
        sec = time.perf_counter() - start
        print(
            f"simulate_many spare r={r} x{replicas} on 2 processes: {sec:6.1f} s "
            f"(time-to-train {summary.mean['time_to_train_s'] / 3600:.1f} "
            f"+- {summary.stderr['time_to_train_s'] / 3600:.1f} h)"
        )
    for r in (2, 4):
        run = functools.partial(sim.failures_to_interruption, "spare", 75_000, r, trials=1000)
        sec, f = _median_time(run, repeats)
        print(
            f"failures_to_interruption G=75000 r={r} x1000 trials: median {sec:5.2f} s "
            f"(mean {f.mean():.0f})"
        )


if __name__ == "__main__":
    cli.run(main)

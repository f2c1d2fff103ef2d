"""Benchmark of the closed-form model at 600k GPUs (75,000 groups of 8).

Prints medians over repeated runs:

    python benchmarks/analysis.py [--repeats 5]
    python benchmarks/analysis.py --validate     # overhead model vs exact loads (docs table)

Targets (issue 4): one closed-form time-to-train evaluation in at most 10 ms;
the optimiser in at most 5 s. "Cold" clears every cache first (survival
curves, overhead tables, age-model bands); "warm" re-evaluates with the
per-(G, r, m) tables already built, as the optimiser and a planning session do.
"""

import math
import statistics
import time
from collections.abc import Callable

import numpy as np
from absl import flags

from spare_jax import analysis, cli, placement, reorder
from spare_jax.analysis import endurance, overhead_model, planner, renewal
from spare_jax.scenario import Scenario

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repetitions per measurement.")
_VALIDATE = flags.DEFINE_bool(
    "validate", False, "Print the overhead-model validation table instead."
)
_SAMPLES = flags.DEFINE_integer("samples", 60, "Random dead sets per validation cell.")


def validate(samples: int, seed: int = 0) -> None:
    """Model E[o | k] vs the mean exact optimal load of uniform good dead sets."""
    rng = np.random.default_rng(seed)
    print("| G | r | m | k / E[F] | k | exact mean (s.e.) | model | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for groups in (1_000, 10_000, 75_000):
        for r in (2, 3, 4):
            p = placement.cyclic(groups, r)
            mean_f = analysis.endurable_failures("spare", groups, r)
            for m in (1, 8, 16):
                for frac in (0.25, 0.5, 1.0, 1.5):
                    k = max(r, int(frac * mean_f))
                    vals = []
                    while len(vals) < samples:
                        dead = rng.choice(groups, k, replace=False)
                        try:
                            vals.append(
                                reorder.max_load(p, reorder.alive_mask(groups, dead), m) / m
                            )
                        except reorder.Interruption:
                            continue
                    v = np.array(vals)
                    model = analysis.overhead("adaptive", groups, r, m, k)
                    rel = model / v.mean() - 1
                    worst = max(worst, abs(rel))
                    print(
                        f"| {groups:,} | {r} | {m} | {frac:g} | {k} | {v.mean():.4f} "
                        f"({v.std() / math.sqrt(v.size):.4f}) | {model:.4f} | {100 * rel:+.2f}% |",
                        flush=True,
                    )
    print(f"\nlargest |relative error|: {100 * worst:.2f}% (includes Monte Carlo noise)")


def clear_caches() -> None:
    """Forget every cached table (the next evaluation pays the full cost)."""
    endurance.log_survival_curve.cache_clear()
    overhead_model._adaptive_table.cache_clear()
    renewal._band.cache_clear()
    planner._epoch.cache_clear()


def median_s(fn: Callable[[], object], repeats: int, cold: bool) -> float:
    """Median wall time of `fn`; `cold` clears the caches before each call."""
    fn()
    times = []
    for _ in range(repeats):
        if cold:
            clear_caches()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> None:
    del argv
    if _VALIDATE.value:
        validate(_SAMPLES.value)
        return
    n = _REPEATS.value
    s = Scenario()
    rows = []

    def ttt(tau=None):
        return lambda: analysis.time_to_train(
            s, "spare", redundancy=3, microbatches=8, checkpoint_interval_s=tau
        )

    rows.append(
        ("TTT, spare r=3 m=8, fixed interval, warm", median_s(ttt(7200.0), 5 * n, False), 0.010)
    )
    rows.append(
        ("TTT, spare r=3 m=8, optimal interval, warm", median_s(ttt(), 5 * n, False), 0.010)
    )
    rows.append(
        (
            "TTT, replication r=2, optimal interval, warm",
            median_s(lambda: analysis.time_to_train(s, "replication", redundancy=2), 5 * n, False),
            0.010,
        )
    )
    rows.append(("TTT, spare r=3 m=8, cold (tables built)", median_s(ttt(), n, True), None))
    rows.append(
        (
            "optimise spare adaptive (r 1..8 x m 1..16), cold",
            median_s(lambda: analysis.optimise(s, "spare"), n, True),
            5.0,
        )
    )

    def all_four():
        for strategy, policy in (
            ("checkpoint_restart", "adaptive"),
            ("replication", "adaptive"),
            ("spare", "fixed"),
            ("spare", "adaptive"),
        ):
            analysis.optimise(s, strategy, policy=policy)

    rows.append(("optimise all four strategies (plan.py), cold", median_s(all_four, n, True), None))
    width = max(len(r[0]) for r in rows)
    print(f"{'measurement'.ljust(width)}  {'median':>10}  target")
    for name, value, target in rows:
        goal = (
            ""
            if target is None
            else (f"<= {target * 1e3:.0f} ms" if target < 1 else f"<= {target:.0f} s")
        )
        ok = "" if target is None else ("  ok" if value <= target else "  OVER")
        shown = f"{value * 1e3:8.2f} ms" if value < 1 else f"{value:8.2f} s "
        print(f"{name.ljust(width)}  {shown}  {goal}{ok}")


if __name__ == "__main__":
    cli.run(main)

"""Benchmark of the closed-form model, by default at 600k GPUs (75,000 groups of 8).

Prints medians over repeated runs (`timeit.repeat`):

    python benchmarks/analysis.py [--repeats 5] [--gpus 600000]
    python benchmarks/analysis.py --quick        # optimiser search r 1..3 x m {1, 8}
    python benchmarks/analysis.py --validate     # overhead model vs exact loads (docs table)

Targets (the README's benchmark table): one closed-form time-to-train
evaluation in at most 10 ms; the optimiser in at most 5 s. "Cold" clears every
cache first (survival curves, overhead tables, age-model bands); "warm"
re-evaluates with the per-(G, r, m) tables already built, as the optimiser and
a planning session do.
"""

from __future__ import annotations

import math
import statistics
import timeit
from collections.abc import Callable

import numpy as np
from absl import app, flags

from spare_jax import analysis, cli, placement, reorder, strategies
from spare_jax.scenario import Scenario

MAX_REPEATS = 1_000
MAX_SAMPLES = 10_000

_REPEATS = flags.DEFINE_integer(
    "repeats",
    5,
    "Timed repetitions per measurement.",
    lower_bound=1,
    upper_bound=MAX_REPEATS,
)
_GPUS = flags.DEFINE_integer("gpus", 600_000, "GPUs of the benchmarked scenario (8 per group).")
_QUICK = flags.DEFINE_bool("quick", False, "Narrow the optimiser's search to r 1..3, m 1 and 8.")
_VALIDATE = flags.DEFINE_bool(
    "validate", False, "Print the overhead-model validation table instead."
)
_SAMPLES = flags.DEFINE_integer(
    "samples",
    60,
    "Random dead sets per validation cell.",
    lower_bound=1,
    upper_bound=MAX_SAMPLES,
)


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
                    model = analysis.overhead("spare", groups, r, m, k)
                    rel = model / v.mean() - 1
                    worst = max(worst, abs(rel))
                    print(
                        f"| {groups:,} | {r} | {m} | {frac:g} | {k} | {v.mean():.4f} "
                        f"({v.std() / math.sqrt(v.size):.4f}) | {model:.4f} | {100 * rel:+.2f}% |",
                        flush=True,
                    )
    print(f"\nlargest |relative error|: {100 * worst:.2f}% (includes Monte Carlo noise)")


def median_s(fn: Callable[[], object], repeats: int, cold: bool) -> float:
    """Median wall time of one call of `fn`; `cold` clears the caches before each call."""
    if cold:
        return statistics.median(
            timeit.repeat(fn, setup=analysis.clear_caches, repeat=repeats, number=1)
        )
    fn()  # builds the tables a warm measurement reuses
    return statistics.median(timeit.repeat(fn, repeat=repeats, number=1))


def main(argv: list[str]) -> None:
    del argv
    if _VALIDATE.value:
        validate(_SAMPLES.value)
        return
    n = _REPEATS.value
    try:
        s = Scenario(gpus=_GPUS.value)
    except ValueError as error:
        raise app.UsageError(f"--gpus: {error}") from None
    r_spare, r_rep = min(3, s.groups), 2 if s.groups % 2 == 0 else 1
    if _QUICK.value:
        search = {"redundancies": (1, 2, 3), "microbatches": (1, 8)}
    else:
        search = {
            "redundancies": analysis.DEFAULT_REDUNDANCIES,
            "microbatches": analysis.DEFAULT_MICROBATCHES,
        }
    rs, ms = search["redundancies"], search["microbatches"]
    space = f"r {min(rs)}..{max(rs)} x m {min(ms)}..{max(ms)}"
    rows = []

    def ttt(tau: float | None = None) -> Callable[[], object]:
        return lambda: analysis.time_to_train(
            s, "spare", redundancy=r_spare, microbatches=8, checkpoint_interval_s=tau
        )

    spare = f"spare r={r_spare} m=8"
    rows.append((f"TTT, {spare}, fixed interval, warm", median_s(ttt(7200.0), 5 * n, False), 0.010))
    rows.append((f"TTT, {spare}, optimal interval, warm", median_s(ttt(), 5 * n, False), 0.010))

    def replication() -> object:
        return analysis.time_to_train(s, "replication", redundancy=r_rep)

    rows.append(
        (
            f"TTT, replication r={r_rep}, optimal interval, warm",
            median_s(replication, 5 * n, False),
            0.010,
        )
    )
    rows.append((f"TTT, {spare}, cold (tables built)", median_s(ttt(), n, True), None))
    rows.append(
        (
            f"optimise spare adaptive ({space}), cold",
            median_s(lambda: analysis.optimise(s, "spare", **search), n, True),
            5.0,
        )
    )

    def all_four() -> None:
        for v in strategies.VARIANTS:
            analysis.optimise(s, v.strategy, policy=v.policy, **search)

    rows.append(("optimise all four strategies (plan.py), cold", median_s(all_four, n, True), None))
    width = max(len(r[0]) for r in rows)
    print(f"scenario: {s.gpus:,} GPUs, {s.groups:,} groups; medians of timeit.repeat")
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

"""Benchmark of the reorder core, by default at 600k GPUs (75,000 groups of 8).

Prints medians over repeated runs (`timeit.repeat`) and the ratios the README's
benchmark table quotes:

    python benchmarks/reorder.py [--repeats 15] [--groups 75000] [--flow_groups 10000]
    python benchmarks/reorder.py --sections=speeds   # one section (repeat the flag for more)

Targets (the README's benchmark table): adaptive assignment at G = 75,000,
r = 4, m = 8 with 1% and 5% of groups dead in at most 0.2 s; the general
max-flow path at G = 10,000, r = 4, m = 1, 2% dead in at most 2 s; memory
O(G * r). Section `speeds`: the speed-aware assignment (stragglers) at the same
G, r, m, with 1% of the groups at a third of nominal speed, in at most 0.2 s,
beside the adaptive assignment with every group alive.
"""

from __future__ import annotations

import functools
import statistics
import time
import timeit
import tracemalloc
from collections.abc import Callable

import numpy as np
from absl import flags

from spare_jax import cli, placement, reorder
from spare_jax.incremental import LoadTracker

MAX_REPEATS = 1_000
MAX_GROUPS = 1_000_000  # the assignment holds O(G r m) integers

_REPEATS = flags.DEFINE_integer(
    "repeats", 15, "Timed repetitions per measurement.", lower_bound=1, upper_bound=MAX_REPEATS
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random dead sets (>= 0).", lower_bound=0)
_GROUPS = flags.DEFINE_integer(
    "groups", 75_000, "Groups G of the assignment cases.", lower_bound=8, upper_bound=MAX_GROUPS
)
_FLOW_GROUPS = flags.DEFINE_integer(
    "flow_groups",
    10_000,
    "Groups G of the max-flow case.",
    lower_bound=8,
    upper_bound=MAX_GROUPS,
)

_SECTIONS = flags.DEFINE_multi_enum(
    "sections",
    ["assign", "flow", "speeds"],
    ["assign", "flow", "speeds"],
    "Sections to run: adaptive assignment with dead groups (and incremental updates), "
    "general max-flow, speed-aware assignment.",
)
SLOW_FRACTION, SLOW_SPEED = 0.01, 1 / 3


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of one call of `fn` over `repeats` calls (after one warm-up call)."""
    fn()
    return statistics.median(timeit.repeat(fn, repeat=repeats, number=1))


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak Python-tracked allocation of one call, MiB (NumPy buffers included)."""
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def survivable(rng: np.random.Generator, p: placement.Placement, fraction: float) -> np.ndarray:
    """A random live mask with about `fraction` of the groups dead and every shard covered."""
    alive = rng.random(p.groups) >= fraction
    while reorder.uncovered(p, alive).size:
        alive = rng.random(p.groups) >= fraction
    return alive


def one_more_failure_s(tracker: LoadTracker, order: np.ndarray) -> float:
    """Median time of `tracker.fail` over the groups of `order` (until an interruption).

    Timed call by call: each failure changes the tracker, so no call can be repeated.
    """
    times = []
    for group in order.tolist():
        start = time.perf_counter()
        try:
            tracker.fail(group)
        except reorder.Interruption:
            break
        times.append(time.perf_counter() - start)
    return statistics.median(times) if times else float("nan")


def main(argv: list[str]) -> None:
    del argv
    repeats = _REPEATS.value
    rng = np.random.default_rng(_SEED.value)
    groups, r, m = _GROUPS.value, 4, 8
    ring = placement.cyclic(groups, r)
    print(f"reorder benchmark: medians of {repeats} runs, numpy {np.__version__}")
    print(f"{'case':<52} {'median':>10} {'target':>8} {'value':>7}")
    run = set(_SECTIONS.value)
    for fraction in (0.01, 0.05) if "assign" in run else ():
        alive = survivable(rng, ring, fraction)
        label = f"G={groups} r={r} m={m} {fraction:.0%} dead"
        assign = functools.partial(reorder.assign, ring, alive, m)
        t_assign = median_s(assign, repeats)
        t_load = median_s(functools.partial(reorder.max_load, ring, alive, m), repeats)
        t_fixed = median_s(functools.partial(reorder.assign, ring, alive, m, "fixed"), repeats)
        load = reorder.max_load(ring, alive, m)
        mem = peak_mib(assign)
        print(f"{'assign adaptive, ' + label:<52} {t_assign * 1e3:>8.1f}ms {'200ms':>8} {load:>7}")
        print(f"{'max_load only, ' + label:<52} {t_load * 1e3:>8.1f}ms {'':>8} {load:>7}")
        fixed_load = reorder.max_load(ring, alive, m, "fixed")
        print(
            f"{'assign fixed order, ' + label:<52} {t_fixed * 1e3:>8.1f}ms {'':>8} {fixed_load:>7}"
        )
        print(
            f"{'  peak memory of assign (MiB), bytes/(G*r)':<52} {mem:>8.1f}MB {'':>8} "
            f"{mem * 2**20 / (groups * r):>7.0f}"
        )

        # Incremental: one more failure after this dead set, versus a full re-solve.
        tracker = LoadTracker(ring, m, alive=alive)
        order = rng.permutation(np.flatnonzero(alive))[: repeats * 20]
        t_incr = one_more_failure_s(tracker, order)
        print(
            f"{'one more failure, incremental, ' + label:<52} {t_incr * 1e6:>8.1f}us {'':>8} "
            f"{tracker.max_load:>7}"
        )
        print(f"{'  full max_load / incremental (ratio)':<52} {t_load / t_incr:>9.0f}x")

    if "flow" in run:
        groups_f, r_f = _FLOW_GROUPS.value, 4
        general = placement.from_stacks(placement.cyclic(groups_f, r_f).stacks)
        alive = survivable(rng, general, 0.02)
        t_flow = median_s(
            functools.partial(reorder.assign, general, alive, 1), max(3, repeats // 3)
        )
        load = reorder.max_load(general, alive, 1)
        print(
            f"{f'assign max-flow, G={groups_f} r={r_f} m=1 2% dead':<52} {t_flow * 1e3:>8.1f}ms "
            f"{'2000ms':>8} {load:>7}"
        )

    if "speeds" in run:
        # Stragglers: 1% of the groups at a third of nominal speed, none dead. The value
        # column is the makespan in nominal micro-batch times (the adaptive row: max_load).
        speeds = np.where(rng.random(groups) < SLOW_FRACTION, SLOW_SPEED, 1.0)
        label = f"G={groups} r={r} m={m} {SLOW_FRACTION:.0%} at speed 1/3"
        t_speed = median_s(functools.partial(reorder.assign_by_speed, ring, speeds, m), repeats)
        t_span = median_s(functools.partial(reorder.makespan, ring, speeds, m), repeats)
        alive = np.ones(groups, dtype=bool)
        t_adaptive = median_s(functools.partial(reorder.assign, ring, alive, m), repeats)
        span = reorder.makespan(ring, speeds, m)
        print(
            f"{'assign by speed, ' + label:<52} {t_speed * 1e3:>8.1f}ms {'200ms':>8} {span:>7.2f}"
        )
        print(f"{'makespan only, ' + label:<52} {t_span * 1e3:>8.1f}ms {'':>8} {span:>7.2f}")
        print(
            f"{f'assign adaptive, G={groups} r={r} m={m} all alive':<52} "
            f"{t_adaptive * 1e3:>8.1f}ms {'':>8} {reorder.max_load(ring, alive, m):>7}"
        )
        print(f"{'  by speed / adaptive (ratio)':<52} {t_speed / t_adaptive:>9.2f}x")


if __name__ == "__main__":
    cli.run(main)

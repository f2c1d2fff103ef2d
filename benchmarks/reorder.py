"""Benchmark of the reorder core at 600k GPUs (75,000 groups of 8).

Prints medians over repeated runs and the ratios the issue asks for:

    python benchmarks/reorder.py [--repeats 15]

Targets (issue 2): adaptive assignment at G = 75,000, r = 4, m = 8 with 1% and
5% of groups dead in at most 0.2 s; the general max-flow path at G = 10,000,
r = 4, m = 1, 2% dead in at most 2 s; memory O(G * r).
"""

import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from absl import flags

from spare_jax import cli, placement, reorder
from spare_jax.incremental import LoadTracker

_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed repetitions per measurement.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random dead sets.")


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn` over `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak Python-tracked allocation of one call, MiB (NumPy buffers included)."""
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def main(argv: list[str]) -> None:
    del argv
    repeats = _REPEATS.value
    rng = np.random.default_rng(_SEED.value)
    groups, r, m = 75_000, 4, 8
    ring = placement.cyclic(groups, r)
    print(f"reorder benchmark: medians of {repeats} runs, numpy {np.__version__}")
    print(f"{'case':<52} {'median':>10} {'target':>8} {'value':>7}")
    for fraction in (0.01, 0.05):
        alive = rng.random(groups) >= fraction
        while reorder.uncovered(ring, alive).size:
            alive = rng.random(groups) >= fraction
        label = f"G={groups} r={r} m={m} {fraction:.0%} dead"
        t_assign = median_s(lambda: reorder.assign(ring, alive, m), repeats)
        t_load = median_s(lambda: reorder.max_load(ring, alive, m), repeats)
        t_fixed = median_s(lambda: reorder.assign(ring, alive, m, "fixed"), repeats)
        load = reorder.max_load(ring, alive, m)
        mem = peak_mib(lambda: reorder.assign(ring, alive, m))
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
        order = rng.permutation(np.flatnonzero(alive))
        tracker = LoadTracker(ring, m, alive=alive)
        times = []
        for group in order[: repeats * 20]:
            start = time.perf_counter()
            try:
                tracker.fail(int(group))
            except reorder.Interruption:
                break
            times.append(time.perf_counter() - start)
        t_incr = statistics.median(times)
        print(
            f"{'one more failure, incremental, ' + label:<52} {t_incr * 1e6:>8.1f}us {'':>8} "
            f"{tracker.max_load:>7}"
        )
        print(f"{'  full max_load / incremental (ratio)':<52} {t_load / t_incr:>9.0f}x")

    groups_f, r_f = 10_000, 4
    general = placement.from_stacks(placement.cyclic(groups_f, r_f).stacks)
    alive = rng.random(groups_f) >= 0.02
    while reorder.uncovered(general, alive).size:
        alive = rng.random(groups_f) >= 0.02
    t_flow = median_s(lambda: reorder.assign(general, alive, 1), max(3, repeats // 3))
    load = reorder.max_load(general, alive, 1)
    print(
        f"{'assign max-flow, G=10000 r=4 m=1 2% dead':<52} {t_flow * 1e3:>8.1f}ms "
        f"{'2000ms':>8} {load:>7}"
    )


if __name__ == "__main__":
    cli.run(main)

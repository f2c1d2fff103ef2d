"""Computation overhead versus dead groups: adaptive reordering, fixed order, replication.

For each redundancy r, kills groups one at a time in a random order (the same
order for every variant of a trial) until the first interruption, and records
the overhead max_load / m after every failure:

    python experiments/overhead.py --groups 10000 --trials 20 --out runs/overhead

`--redundancy` and `--microbatches` are comma-separated lists. Writes, under
`--out` (checked before any work), `overhead.csv` (one row per r, variant, m
and dead count), `summary.csv`, `overhead.png`, and prints the summary table.
Variants are the row names of `spare_jax.strategies.VARIANTS`. Replication
needs G divisible by r; where it is not, replication uses the largest multiple
of r below G.
"""

from __future__ import annotations

import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from absl import app, flags
from tqdm import tqdm

from spare_jax import cli, reorder, strategies
from spare_jax.incremental import LoadTracker

# Sizes a sweep is built for: the tracker walks up to G failures per trial, r and m.
MAX_GROUPS = 1_000_000
MAX_TRIALS = 10_000
MAX_REDUNDANCY = 32
MAX_MICROBATCHES = 1024

_GROUPS = flags.DEFINE_integer(
    "groups", 10_000, "Number of groups G.", lower_bound=2, upper_bound=MAX_GROUPS
)
_REDUNDANCY = flags.DEFINE_list(
    "redundancy", ["2", "3", "4", "5", "6", "7", "8"], "Redundancies r to sweep (comma-separated)."
)
_MICROBATCHES = flags.DEFINE_list(
    "microbatches", ["1", "8"], "Micro-batches per shard m for adaptive reordering."
)
_LAYOUT = flags.DEFINE_enum(
    "layout", "cyclic", list(strategies.LAYOUTS), "Stacking layout for SPARe."
)
flags.DEFINE_alias("placement", "layout")  # deprecated spelling
_TRIALS = flags.DEFINE_integer(
    "trials", 20, "Random failure orders per r.", lower_bound=1, upper_bound=MAX_TRIALS
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed (>= 0).", lower_bound=0)
_OUT = flags.DEFINE_string("out", "runs/overhead", "Output directory.")

REPLICATION, SPARE_FIXED, SPARE_ADAPTIVE = (
    strategies.variant(name) for name in ("replication", "spare_fixed", "spare_adaptive")
)


def trace_loads(tracker: LoadTracker, order: np.ndarray) -> np.ndarray:
    """Max load after 0, 1, 2, ... failures of `order`, up to the interruption."""
    loads = [tracker.max_load]
    for group in order:
        try:
            loads.append(tracker.fail(int(group)))
        except reorder.Interruption:
            break
    return np.array(loads)


def replication_lifetime(groups: int, r: int, order: np.ndarray) -> int:
    """Failures survived by replication: the last count before a whole set is dead."""
    rank = np.empty(groups, np.int64)
    rank[order] = np.arange(groups)
    return int(rank.reshape(-1, r).max(axis=1).min())


def run(
    groups: int, redundancies: list[int], micro: list[int], layout: str, trials: int, seed: int
) -> dict[tuple[int, str, int], list[np.ndarray]]:
    """Overhead traces keyed by (r, variant name, m)."""
    rng = np.random.default_rng(seed)
    traces: dict[tuple[int, str, int], list[np.ndarray]] = {}
    bar = tqdm(total=len(redundancies) * trials, desc="overhead sweep", unit="trial")
    for r in redundancies:
        stack = strategies.placement("spare", groups, r, layout=layout)
        rep_groups = groups - groups % r
        for _ in range(trials):
            order = rng.permutation(groups)
            for m in micro:
                loads = trace_loads(LoadTracker(stack, m, SPARE_ADAPTIVE.policy), order)
                traces.setdefault((r, SPARE_ADAPTIVE.name, m), []).append(loads / m)
            fixed = trace_loads(LoadTracker(stack, 1, SPARE_FIXED.policy), order)
            traces.setdefault((r, SPARE_FIXED.name, 1), []).append(fixed.astype(float))
            rep_order = order[order < rep_groups]
            life = replication_lifetime(rep_groups, r, rep_order)
            traces.setdefault((r, REPLICATION.name, 1), []).append(np.full(life + 1, float(r)))
            bar.update()
    bar.close()
    return traces


def summarise(traces: dict[tuple[int, str, int], list[np.ndarray]]) -> list[dict[str, object]]:
    """Per (r, variant, m): failures to interruption, mean and worst overhead before it."""
    rows = []
    for (r, variant, m), runs in sorted(traces.items()):
        lifetimes = np.array([len(t) - 1 for t in runs])
        after_failure = np.concatenate([t[1:] for t in runs if len(t) > 1] or [np.ones(1)])
        rows.append(
            {
                "r": r,
                "variant": variant,
                "m": m,
                "failures_to_interruption": lifetimes.mean(),
                "overhead_mean": after_failure.mean(),
                "overhead_median": float(np.median(after_failure)),
                "overhead_worst": max(t.max() for t in runs),
            }
        )
    return rows


def mean_curve(runs: list[np.ndarray]) -> np.ndarray:
    """Mean overhead at each dead count over the trials not yet interrupted."""
    top = max(len(t) for t in runs)
    grid = np.full((len(runs), top), np.nan)
    for i, t in enumerate(runs):
        grid[i, : len(t)] = t
    alive = np.sum(~np.isnan(grid), axis=0)
    return np.where(alive >= max(1, len(runs) // 4), np.nanmean(grid, axis=0), np.nan)


def plot(traces, rows, micro: list[int], groups: int, layout: str, path: str) -> None:
    """overhead.png: mean overhead versus dead groups per r, and the summary versus r."""
    redundancies = sorted({r for r, _, _ in traces})
    fig, axes = plt.subplots(1, len(micro) + 1, figsize=(5.2 * (len(micro) + 1), 4.2))
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(redundancies)))
    for ax, m in zip(axes, micro, strict=False):
        for colour, r in zip(colours, redundancies, strict=True):
            curve = mean_curve(traces[(r, SPARE_ADAPTIVE.name, m)])
            ax.plot(np.arange(len(curve)), curve, color=colour, label=f"r={r}")
            fixed = mean_curve(traces[(r, SPARE_FIXED.name, 1)])
            ax.plot(np.arange(len(fixed)), fixed, color=colour, ls=":", lw=1)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("dead groups (until interruption)")
        ax.set_ylabel("overhead (max load / m)")
        ax.set_title(f"adaptive, m={m} (solid); fixed order (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    ax = axes[-1]
    series = [(REPLICATION, 1, "s-"), (SPARE_FIXED, 1, "^-")]
    series += [(SPARE_ADAPTIVE, mm, "o-") for mm in micro]
    for v, m, style in series:
        sel = [row for row in rows if row["variant"] == v.name and row["m"] == m]
        label = f"{v.label}, m={m}" if v is SPARE_ADAPTIVE else v.label
        rr = [row["r"] for row in sel]
        ax.plot(rr, [row["overhead_mean"] for row in sel], style, label=f"{label} (mean)")
        if v is not REPLICATION:
            worst = [row["overhead_worst"] for row in sel]
            ax.plot(rr, worst, style[0] + "--", alpha=0.5, label=f"{label} (worst)")
    ax.set_xlabel("redundancy r")
    ax.set_ylabel("overhead until interruption")
    ax.set_title(f"G={groups}, {layout} stacking")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with cli.replace_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)


def write(out: str, traces, rows: list[dict[str, object]]) -> None:
    """summary.csv and overhead.csv under `out`."""
    with cli.replace_file(os.path.join(out, "summary.csv"), newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with cli.replace_file(os.path.join(out, "overhead.csv"), newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["r", "variant", "m", "dead", "overhead_mean", "trials_alive"])
        for (r, variant, m), runs in sorted(traces.items()):
            curve = mean_curve(runs)
            for dead, value in enumerate(curve):
                if not np.isnan(value):
                    alive = sum(len(t) > dead for t in runs)
                    writer.writerow([r, variant, m, dead, f"{value:.4f}", alive])


def main(argv: list[str]) -> None:
    del argv
    groups = _GROUPS.value
    redundancies = cli.int_list(
        "redundancy", _REDUNDANCY.value, high=MAX_REDUNDANCY, why="stacks of r shards per group"
    )
    micro = cli.int_list(
        "microbatches",
        _MICROBATCHES.value,
        high=MAX_MICROBATCHES,
        why="the load tracker raises a load one micro-batch at a time",
    )
    if max(redundancies) > groups:
        raise app.UsageError(f"--redundancy values must not exceed --groups={groups}")
    out = cli.output_dir("out", _OUT.value)
    traces = run(groups, redundancies, micro, _LAYOUT.value, _TRIALS.value, _SEED.value)
    rows = summarise(traces)
    write(out, traces, rows)
    plot(traces, rows, micro, groups, _LAYOUT.value, os.path.join(out, "overhead.png"))
    print(
        f"\nG={groups}, {_LAYOUT.value} stacking, {_TRIALS.value} trials per r, "
        f"seed {_SEED.value}. Overhead = max load / m after each failure, until interruption."
    )
    print(
        f"{'r':>2} {'variant':<14} {'m':>2} {'E[failures]':>12} {'mean':>6} {'median':>7} "
        f"{'worst':>6}"
    )
    for row in rows:
        print(
            f"{row['r']:>2} {row['variant']:<14} {row['m']:>2} "
            f"{row['failures_to_interruption']:>12.1f} {row['overhead_mean']:>6.3f} "
            f"{row['overhead_median']:>7.3f} {row['overhead_worst']:>6.3f}"
        )
    print(f"\nwrote {out}/summary.csv, overhead.csv, overhead.png")


if __name__ == "__main__":
    cli.run(main)

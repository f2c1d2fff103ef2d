"""Computation overhead versus dead groups: adaptive reordering, fixed order, replication.

For each redundancy r, kills groups one at a time in a random order (the same
order for every policy of a trial) until the first interruption, and records
the overhead max_load / m after every failure:

    python experiments/overhead.py --groups 10000 --trials 20 --out runs/overhead

Writes `overhead.csv` (one row per r, policy, m and dead count), `summary.csv`,
`overhead.png`, and prints the summary table. Replication needs G divisible by
r; where it is not, replication uses the largest multiple of r below G.
"""

from __future__ import annotations

import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

from spare_jax import cli, reorder, strategies  # noqa: E402
from spare_jax.incremental import LoadTracker  # noqa: E402

_GROUPS = flags.DEFINE_integer("groups", 10_000, "Number of groups G.", lower_bound=2)
_REDUNDANCY = flags.DEFINE_list(
    "redundancy", ["2", "3", "4", "5", "6", "7", "8"], "Redundancies r to sweep."
)
_MICROBATCHES = flags.DEFINE_list(
    "microbatches", ["1", "8"], "Micro-batches per shard m for adaptive reordering."
)
_PLACEMENT = flags.DEFINE_enum(
    "placement", "cyclic", ["cyclic", "strided"], "Stacking placement for SPARe."
)
_TRIALS = flags.DEFINE_integer("trials", 20, "Random failure orders per r.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_OUT = flags.DEFINE_string("out", "runs/overhead", "Output directory.")


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
    groups: int, redundancies: list[int], micro: list[int], kind: str, trials: int, seed: int
) -> dict[tuple[int, str, int], list[np.ndarray]]:
    """Overhead traces keyed by (r, policy, m); policy adaptive, fixed or replication."""
    rng = np.random.default_rng(seed)
    traces: dict[tuple[int, str, int], list[np.ndarray]] = {}
    bar = tqdm(total=len(redundancies) * trials, desc="overhead sweep", unit="trial")
    for r in redundancies:
        stack = strategies.placement("spare", groups, r, layout=kind)
        rep_groups = groups - groups % r
        for _ in range(trials):
            order = rng.permutation(groups)
            for m in micro:
                loads = trace_loads(LoadTracker(stack, m, "adaptive"), order)
                traces.setdefault((r, "adaptive", m), []).append(loads / m)
            fixed = trace_loads(LoadTracker(stack, 1, "fixed"), order)
            traces.setdefault((r, "fixed", 1), []).append(fixed.astype(float))
            rep_order = order[order < rep_groups]
            life = replication_lifetime(rep_groups, r, rep_order)
            traces.setdefault((r, "replication", 1), []).append(np.full(life + 1, float(r)))
            bar.update()
    bar.close()
    return traces


def summarise(traces: dict[tuple[int, str, int], list[np.ndarray]]) -> list[dict[str, object]]:
    """Per (r, policy, m): failures to interruption, mean and worst overhead before it."""
    rows = []
    for (r, policy, m), runs in sorted(traces.items()):
        lifetimes = np.array([len(t) - 1 for t in runs])
        after_failure = np.concatenate([t[1:] for t in runs if len(t) > 1] or [np.ones(1)])
        rows.append(
            dict(
                r=r,
                policy=policy,
                m=m,
                failures_to_interruption=lifetimes.mean(),
                overhead_mean=after_failure.mean(),
                overhead_median=float(np.median(after_failure)),
                overhead_worst=max(t.max() for t in runs),
            )
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


def plot(traces, rows, micro: list[int], groups: int, kind: str, path: str) -> None:
    redundancies = sorted({r for r, _, _ in traces})
    fig, axes = plt.subplots(1, len(micro) + 1, figsize=(5.2 * (len(micro) + 1), 4.2))
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(redundancies)))
    for ax, m in zip(axes, micro):
        for colour, r in zip(colours, redundancies):
            curve = mean_curve(traces[(r, "adaptive", m)])
            ax.plot(np.arange(len(curve)), curve, color=colour, label=f"r={r}")
            fixed = mean_curve(traces[(r, "fixed", 1)])
            ax.plot(np.arange(len(fixed)), fixed, color=colour, ls=":", lw=1)
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("dead groups (until interruption)")
        ax.set_ylabel("overhead (max load / m)")
        ax.set_title(f"adaptive, m={m} (solid); fixed order (dotted)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    ax = axes[-1]
    for policy, m, style in [("replication", 1, "s-"), ("fixed", 1, "^-")] + [
        ("adaptive", mm, "o-") for mm in micro
    ]:
        sel = [row for row in rows if row["policy"] == policy and row["m"] == m]
        label = policy if policy != "adaptive" else f"SPARe adaptive, m={m}"
        ax.plot(
            [row["r"] for row in sel],
            [row["overhead_mean"] for row in sel],
            style,
            label=f"{label} (mean)",
        )
        if policy == "adaptive" or policy == "fixed":
            ax.plot(
                [row["r"] for row in sel],
                [row["overhead_worst"] for row in sel],
                style[0] + "--",
                alpha=0.5,
                label=f"{label} (worst)",
            )
    ax.set_xlabel("redundancy r")
    ax.set_ylabel("overhead until interruption")
    ax.set_title(f"G={groups}, {kind} stacking")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    groups = _GROUPS.value
    redundancies = cli.int_list("redundancy", _REDUNDANCY.value)
    micro = cli.int_list("microbatches", _MICROBATCHES.value)
    if max(redundancies) > groups:
        raise app.UsageError(f"--redundancy values must not exceed --groups={groups}")
    traces = run(groups, redundancies, micro, _PLACEMENT.value, _TRIALS.value, _SEED.value)
    rows = summarise(traces)
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "summary.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(_OUT.value, "overhead.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["r", "policy", "m", "dead", "overhead_mean", "trials_alive"])
        for (r, policy, m), runs in sorted(traces.items()):
            curve = mean_curve(runs)
            for dead, value in enumerate(curve):
                if not np.isnan(value):
                    writer.writerow(
                        [r, policy, m, dead, f"{value:.4f}", sum(len(t) > dead for t in runs)]
                    )
    plot(traces, rows, micro, groups, _PLACEMENT.value, os.path.join(_OUT.value, "overhead.png"))
    print(
        f"\nG={groups}, {_PLACEMENT.value} stacking, {_TRIALS.value} trials per r, "
        f"seed {_SEED.value}. Overhead = max load / m after each failure, until interruption."
    )
    print(
        f"{'r':>2} {'policy':<12} {'m':>2} {'E[failures]':>12} {'mean':>6} {'median':>7} "
        f"{'worst':>6}"
    )
    for row in rows:
        print(
            f"{row['r']:>2} {row['policy']:<12} {row['m']:>2} "
            f"{row['failures_to_interruption']:>12.1f} {row['overhead_mean']:>6.3f} "
            f"{row['overhead_median']:>7.3f} {row['overhead_worst']:>6.3f}"
        )
    print(f"\nwrote {_OUT.value}/summary.csv, overhead.csv, overhead.png")


if __name__ == "__main__":
    cli.run(main)

"""Reproduce the SPARe paper's results in our model: figures, CSV and a markdown table.

    python experiments/reproduce.py --out docs/results          # full (about 10 min, 2 cores)
    python experiments/reproduce.py --out /tmp/results --quick  # smoke variant (seconds)

Writes under --out, one PNG and one CSV per result:

* overhead_vs_redundancy: computation overhead (time-weighted over an
    interruption epoch, and worst) vs r for stacking with adaptive reordering,
    fixed order and replication; simulation and closed form;
* endurable_failures: mean failures to interruption vs G, closed form (lines)
    and simulation (markers), stacking and replication, r = 2, 3, 4;
* availability_vs_redundancy: availability at 600k GPUs vs r;
* time_to_train: time-to-train vs GPUs (10k to 600k) per strategy, each at its
    optimised redundancy and checkpoint interval;
* reduction_vs_replication: 1 - T(SPARe) / T(replication) vs GPUs;
* sensitivity (CSV + table only): the 600k reduction under changed failure
    rate, restart cost growth, group size, checkpoint cost, failure law;

and summary.md, the tables docs/results.md quotes. Plans (r, checkpoint
interval) come from `analysis.optimise`; every plan is then simulated
(`sim.simulate_many`) and both numbers are reported side by side.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402
from absl import app, flags  # noqa: E402

from spare_jax import analysis, sim  # noqa: E402
from spare_jax.analysis import weights  # noqa: E402
from spare_jax.scenario import Scenario  # noqa: E402

OUT = flags.DEFINE_string("out", "docs/results", "output folder")
QUICK = flags.DEFINE_bool("quick", False, "small, fast variant (smoke test)")
REPLICAS = flags.DEFINE_integer("replicas", None, "simulated runs per point (default 8; quick 1)")
SEED = flags.DEFINE_integer("seed", 0, "base seed")

HOUR = 3600.0
M = 8  # micro-batches per shard
STRATEGIES = (  # label, strategy, policy, candidate redundancies
    ("checkpoint/restart", "checkpoint_restart", "adaptive", (1,)),
    ("replication", "replication", "adaptive", (2, 3, 4)),
    ("SPARe fixed order", "spare", "fixed", (2, 3, 4, 5, 6)),
    ("SPARe adaptive", "spare", "adaptive", (2, 3, 4, 5, 6)),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    quick: bool
    replicas: int
    trials: int
    overhead_groups: int
    endurance_groups: tuple[int, ...]
    gpus: tuple[int, ...]
    work_hours: float


def _settings(quick: bool, replicas: int | None) -> Settings:
    if quick:
        return Settings(True, replicas or 1, 60, 3_000, (120, 1_200, 12_000), (9_600, 96_000), 48.0)
    return Settings(
        False,
        replicas or 8,
        2_000,
        75_000,
        (120, 600, 1_200, 6_000, 12_000, 30_000, 75_000),
        (9_600, 24_000, 48_000, 96_000, 192_000, 384_000, 600_000),
        720.0,
    )


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _figure(path: str, ax_setup, panels: int = 1) -> None:
    """Draw with `ax_setup(axes)` (one axis, or a list when panels > 1), legend outside."""
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels + 3.2, 4.6), dpi=130, squeeze=False)
    axes = list(axes[0])
    ax_setup(axes[0] if panels == 1 else axes)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[-1].get_legend_handles_labels()
    for ax in axes[:-1]:
        h, lab = ax.get_legend_handles_labels()
        handles, labels = h + handles, lab + labels
    seen = dict(zip(labels, handles, strict=True))
    fig.legend(
        list(seen.values()),
        list(seen),
        loc="center left",
        bbox_to_anchor=(0.995, 0.5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def _style_legend(ax, entries: list[tuple[str, str]], styles: list[tuple[str, dict]]) -> None:
    """Legend entries by colour (series) and by line style (what is drawn)."""
    for label, color in entries:
        ax.plot([], [], color=color, lw=6, label=label)
    for label, kw in styles:
        ax.plot([], [], label=label, **{"color": "0.3", **kw})


def _plain_log_axis(axis) -> None:
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _fits(strategy: str, groups: int, r: int) -> bool:
    return strategy != "replication" or groups % r == 0


# ---------------------------------------------------------------- plans and runs


def plan(scenario: Scenario, strategy: str, policy: str, redundancies: tuple[int, ...], m: int = M):
    """Best (r, checkpoint interval) by the closed-form model, and its estimate."""
    rs = tuple(r for r in redundancies if _fits(strategy, scenario.groups, r))
    p = analysis.optimise(scenario, strategy, policy=policy, redundancies=rs, microbatches=(m,))
    return p.redundancy, p.checkpoint_interval_s, p.estimate


def estimate(scenario: Scenario, strategy: str, policy: str, r: int):
    """Closed-form estimate at r with the model's best checkpoint interval."""
    est = analysis.time_to_train(scenario, strategy, redundancy=r, microbatches=M, policy=policy)
    return r, est.checkpoint_interval_s, est


def simulate(
    scenario: Scenario,
    strategy: str,
    policy: str,
    r: int,
    tau: float,
    settings: Settings,
    seed: int,
    layout: str = "cyclic",
    m: int = M,
) -> sim.Summary:
    return sim.simulate_many(
        scenario,
        strategy,
        replicas=settings.replicas,
        seed=seed,
        progress=False,
        redundancy=r,
        checkpoint_interval_s=tau,
        microbatches=m,
        policy=policy,
        layout=layout,
    )


# ---------------------------------------------------------------- figures


def fig_overhead(settings: Settings, out: str) -> list[dict]:
    g = settings.overhead_groups
    trials = 4 if settings.quick else 16
    rows = []
    cases = [("adaptive", 8), ("adaptive", 1), ("fixed", 8)]
    for r in tqdm.trange(1, 7, desc="overhead vs r", leave=False):
        w = weights.time_in_state("spare", g, r, 1.0)
        k = np.arange(w.size)
        for policy, m in cases:
            integral, length, top = sim.epoch_overhead(
                "spare" if r > 1 else "dp", g, r, m, policy=policy, trials=trials, seed=r
            )
            mean, se = sim.ratio_mean(integral, length)
            closed = float(
                np.dot(w, analysis.overhead(policy if r > 1 else "dp", g, r, m, k)) / w.sum()
            )
            rows.append(
                dict(
                    strategy=f"spare {policy}",
                    microbatches=m,
                    redundancy=r,
                    sim_mean=mean,
                    sim_mean_se=se,
                    sim_worst=top.mean(),
                    closed_form_mean=closed,
                )
            )
        rows.append(
            dict(
                strategy="replication",
                microbatches=8,
                redundancy=r,
                sim_mean=float(r),
                sim_mean_se=0.0,
                sim_worst=float(r),
                closed_form_mean=float(r),
            )
        )

    def setup(ax):
        series = [
            ("spare adaptive", 8, "C0", "SPARe adaptive, m=8"),
            ("spare adaptive", 1, "C2", "SPARe adaptive, m=1 (whole shards)"),
            ("spare fixed", 8, "C1", "SPARe fixed order"),
            ("replication", 8, "C3", "replication"),
        ]
        for name, m, color, _ in series:
            sel = [x for x in rows if x["strategy"] == name and x["microbatches"] == m]
            rr = [x["redundancy"] for x in sel]
            ax.errorbar(
                rr,
                [x["sim_mean"] for x in sel],
                [x["sim_mean_se"] for x in sel],
                fmt="o-",
                color=color,
                lw=1.8,
            )
            ax.plot(rr, [x["closed_form_mean"] for x in sel], "x", color="k", ms=7)
            ax.plot(rr, [x["sim_worst"] for x in sel], "--", color=color, alpha=0.6, lw=1.2)
        _style_legend(
            ax,
            [(s[3], s[2]) for s in series],
            [
                ("simulation, time-weighted mean", dict(marker="o", ls="-")),
                ("closed form, time-weighted mean", dict(marker="x", ls="none", color="k")),
                ("simulation, worst seen (mean over epochs)", dict(ls="--")),
            ],
        )
        ax.set_xlabel("redundancy r")
        ax.set_ylabel("computation overhead (max load / m)")
        ax.set_title(f"Overhead over an interruption epoch, G = {g:,} groups")

    _figure(os.path.join(out, "overhead_vs_redundancy.png"), setup)
    _write_csv(os.path.join(out, "overhead_vs_redundancy.csv"), rows)
    return rows


def fig_endurance(settings: Settings, out: str) -> list[dict]:
    rows = []
    for g in tqdm.tqdm(settings.endurance_groups, desc="endurable failures", leave=False):
        for strategy in ("spare", "replication"):
            for r in (2, 3, 4):
                if not _fits(strategy, g, r):
                    continue
                f = sim.failures_to_interruption(strategy, g, r, trials=settings.trials, seed=g + r)
                rows.append(
                    dict(
                        strategy=strategy,
                        groups=g,
                        redundancy=r,
                        closed_form=analysis.endurable_failures(strategy, g, r),
                        sim=f.mean(),
                        sim_se=f.std(ddof=1) / math.sqrt(f.size),
                    )
                )

    def setup(ax):
        for i, r in enumerate((2, 3, 4)):
            for strategy, marker in (("spare", "o"), ("replication", "s")):
                sel = [x for x in rows if x["strategy"] == strategy and x["redundancy"] == r]
                gg = [x["groups"] for x in sel]
                ls = "-" if strategy == "spare" else "--"
                ax.plot(gg, [x["closed_form"] for x in sel], ls, color=f"C{i}")
                ax.plot(gg, [x["sim"] for x in sel], marker, color=f"C{i}", mfc="none", ms=7)
        _style_legend(
            ax,
            [(f"r = {r}", f"C{i}") for i, r in enumerate((2, 3, 4))],
            [
                ("SPARe (cyclic stacking), closed form", dict(ls="-")),
                ("SPARe, simulation", dict(marker="o", ls="none", mfc="none")),
                ("replication, closed form", dict(ls="--")),
                ("replication, simulation", dict(marker="s", ls="none", mfc="none")),
            ],
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis)
        _plain_log_axis(ax.yaxis)
        ax.set_xlabel("groups G")
        ax.set_ylabel("mean failures to interruption")
        ax.set_title("Endurable failures (each failure hits a live group)")

    _figure(os.path.join(out, "endurable_failures.png"), setup)
    _write_csv(os.path.join(out, "endurable_failures.csv"), rows)
    return rows


def _scenario(settings: Settings, **changes) -> Scenario:
    return dataclasses.replace(Scenario(work_hours=settings.work_hours), **changes)


def fig_availability(settings: Settings, out: str) -> list[dict]:
    scenario = _scenario(settings, gpus=settings.gpus[-1])
    rows = []
    for r in tqdm.trange(1, 6, desc="availability vs r", leave=False):
        for strategy, policy in (("spare", "adaptive"), ("replication", "adaptive")):
            name = "checkpoint_restart" if r == 1 else strategy
            if not _fits(name, scenario.groups, r):
                continue
            if r == 1 and rows:  # checkpoint/restart: one run serves both series
                rows.append(dict(rows[0], strategy=strategy))
                continue
            _, tau, est = estimate(scenario, name, policy, r)
            summary = simulate(scenario, name, policy, r, tau, settings, seed=100 + r)
            rows.append(
                dict(
                    strategy=strategy,
                    redundancy=r,
                    checkpoint_interval_s=tau,
                    closed_form=est.availability,
                    sim=summary.mean["availability"],
                    sim_se=summary.stderr["availability"],
                    closed_form_ratio=est.effective_ratio,
                    sim_ratio=summary.mean["effective_ratio"],
                )
            )

    def setup(axes):
        for strategy, color, marker, label in (
            ("spare", "C0", "o", "SPARe adaptive"),
            ("replication", "C3", "s", "replication"),
        ):
            sel = [x for x in rows if x["strategy"] == strategy]
            rr = [x["redundancy"] for x in sel]
            for ax, key in zip(axes, ("", "_ratio"), strict=True):
                ax.plot(
                    rr,
                    [x["sim" + key] for x in sel],
                    marker + "-",
                    color=color,
                    mfc="none",
                    ms=8 if strategy == "spare" else 5,
                    label=f"{label}: simulation",
                )
                ax.plot(
                    rr,
                    [x["closed_form" + key] for x in sel],
                    "x:",
                    color=color,
                    ms=8,
                    label=f"{label}: closed form",
                )
        axes[0].set_ylabel("availability (uptime / wall time)")
        axes[1].set_ylabel("effective ratio (work / time-to-train)")
        for ax in axes:
            ax.set_xlabel("redundancy r (r = 1: checkpoint/restart)")
            ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(1))
        axes[1].set_ylim(0, 1.02)
        axes[0].set_title(f"Availability at {scenario.gpus:,} GPUs")
        axes[1].set_title("Effective training-time ratio")

    _figure(os.path.join(out, "availability_vs_redundancy.png"), setup, panels=2)
    _write_csv(os.path.join(out, "availability_vs_redundancy.csv"), rows)
    return rows


def compare(
    scenario: Scenario, settings: Settings, seed: int, strategies=STRATEGIES, m: int = M
) -> list[dict]:
    """Plan every strategy on `scenario`, simulate the plan, one row each."""
    rows = []
    for label, strategy, policy, rs in strategies:
        r, tau, est = plan(scenario, strategy, policy, rs, m)
        summary = simulate(scenario, strategy, policy, r, tau, settings, seed, m=m)
        rows.append(
            dict(
                gpus=scenario.gpus,
                label=label,
                redundancy=r,
                checkpoint_interval_s=tau,
                closed_form_h=est.time_to_train_s / HOUR,
                sim_h=summary.mean["time_to_train_s"] / HOUR,
                sim_se_h=summary.stderr["time_to_train_s"] / HOUR,
                sim_overhead=summary.mean["overhead_mean"],
                sim_availability=summary.mean["availability"],
                sim_interruptions=summary.mean["interruptions"],
            )
        )
    return rows


def fig_time_to_train(settings: Settings, out: str) -> list[dict]:
    rows = []
    for gpus in tqdm.tqdm(settings.gpus, desc="time-to-train vs GPUs", leave=False):
        rows += compare(_scenario(settings, gpus=gpus), settings, seed=gpus)
    work = settings.work_hours

    def setup(ax):
        for i, (label, *_rest) in enumerate(STRATEGIES):
            sel = [x for x in rows if x["label"] == label]
            n = [x["gpus"] for x in sel]
            ax.errorbar(
                n,
                [x["sim_h"] for x in sel],
                [x["sim_se_h"] for x in sel],
                fmt="o-",
                color=f"C{i}",
                label=f"{label}: sim",
            )
            ax.plot(
                n,
                [x["closed_form_h"] for x in sel],
                "x:",
                color=f"C{i}",
                ms=8,
                label=f"{label}: closed form",
            )
        ax.axhline(work, color="k", lw=0.8, label=f"failure-free work ({work:.0f} h)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis)
        _plain_log_axis(ax.yaxis)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("time-to-train (hours)")
        ax.set_title("Time-to-train, each strategy at its optimised r and checkpoint interval")

    _figure(os.path.join(out, "time_to_train.png"), setup)
    _write_csv(os.path.join(out, "time_to_train.csv"), rows)
    return rows


def reductions(rows: list[dict], spare_label: str = "SPARe adaptive") -> list[dict]:
    out = []
    for gpus in sorted({x["gpus"] for x in rows}):
        by = {x["label"]: x for x in rows if x["gpus"] == gpus}
        rep, spa = by["replication"], by[spare_label]
        out.append(
            dict(
                gpus=gpus,
                spare_r=spa["redundancy"],
                replication_r=rep["redundancy"],
                sim_reduction=1 - spa["sim_h"] / rep["sim_h"],
                closed_form_reduction=1 - spa["closed_form_h"] / rep["closed_form_h"],
            )
        )
    return out


def fig_reduction(ttt_rows: list[dict], out: str) -> list[dict]:
    rows = reductions(ttt_rows)

    def setup(ax):
        n = [x["gpus"] for x in rows]
        ax.plot(n, [100 * x["sim_reduction"] for x in rows], "o-", label="simulation")
        ax.plot(
            n, [100 * x["closed_form_reduction"] for x in rows], "x:", ms=8, label="closed form"
        )
        ax.axhspan(40, 50, color="C2", alpha=0.15, label="paper's claim (40~50%)")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("time-to-train reduction vs replication (%)")
        ax.set_title("SPARe (adaptive) vs replication, both optimised")

    _figure(os.path.join(out, "reduction_vs_replication.png"), setup)
    _write_csv(os.path.join(out, "reduction_vs_replication.csv"), rows)
    return rows


SENSITIVITY = (
    ("baseline", {}),
    ("GPU MTBF x0.5 (25.5k h)", dict(gpu_mtbf_hours=2.55e4)),
    ("GPU MTBF x2 (102k h)", dict(gpu_mtbf_hours=1.02e5)),
    ("restart cost flat (exponent 0)", dict(restart_exponent=0.0)),
    ("restart cost quadratic (exponent 2)", dict(restart_exponent=2.0)),
    ("4 GPUs per group", dict(gpus_per_group=4)),
    ("16 GPUs per group", dict(gpus_per_group=16)),
    ("checkpoint 10 s", dict(checkpoint_s=10.0)),
    ("checkpoint 300 s", dict(checkpoint_s=300.0)),
    ("Weibull failures, shape 0.7", dict(failure_law="weibull")),
    ("async checkpoint (5 s stall)", dict(checkpoint_async=True)),
    ("hot re-join, MTTR 4 h", dict(repair="hot")),
    ("16 micro-batches per shard", dict(_microbatches=16)),
)


def sensitivity(settings: Settings, out: str) -> list[dict]:
    rows = []
    cases = (*SENSITIVITY[:2], SENSITIVITY[-1]) if settings.quick else SENSITIVITY
    pair = (STRATEGIES[1], STRATEGIES[3])
    for i, (name, changes) in enumerate(tqdm.tqdm(cases, desc="sensitivity", leave=False)):
        changes = dict(changes)
        m = changes.pop("_microbatches", M)
        scenario = _scenario(settings, gpus=settings.gpus[-1], **changes)
        res = compare(scenario, settings, seed=7_000 + i, strategies=pair, m=m)
        red = reductions(res)[0]
        rep, spa = res
        rows.append(
            dict(
                case=name,
                replication_r=rep["redundancy"],
                spare_r=spa["redundancy"],
                replication_sim_h=rep["sim_h"],
                spare_sim_h=spa["sim_h"],
                sim_reduction=red["sim_reduction"],
                closed_form_reduction=red["closed_form_reduction"],
            )
        )
    _write_csv(os.path.join(out, "sensitivity.csv"), rows)
    return rows


def domains(settings: Settings, out: str) -> list[dict]:
    """Whole-rack failures: cyclic vs strided stacking vs replication (simulation)."""
    scenario = _scenario(
        settings, gpus=settings.gpus[-1], domain_groups=16, domain_failure_fraction=0.05
    )
    rows = []
    cases = (
        ("replication", "replication", "cyclic", STRATEGIES[1][3]),
        ("SPARe adaptive, cyclic", "spare", "cyclic", STRATEGIES[3][3]),
        ("SPARe adaptive, strided", "spare", "strided", STRATEGIES[3][3]),
    )
    for i, (label, strategy, layout, rs) in enumerate(
        tqdm.tqdm(cases, desc="failure domains", leave=False)
    ):
        r, tau, est = plan(scenario, strategy, "adaptive", rs)
        summary = simulate(scenario, strategy, "adaptive", r, tau, settings, 9_000 + i, layout)
        rows.append(
            dict(
                case=label,
                redundancy=r,
                checkpoint_interval_s=tau,
                closed_form_h=est.time_to_train_s / HOUR,
                sim_h=summary.mean["time_to_train_s"] / HOUR,
                sim_se_h=summary.stderr["time_to_train_s"] / HOUR,
                sim_interruptions=summary.mean["interruptions"],
            )
        )
    _write_csv(os.path.join(out, "domains.csv"), rows)
    return rows


# ---------------------------------------------------------------- summary


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(format(x[c[0]], c[2]) for c in columns) + " |" for x in rows]
    return "\n".join([head, sep, *body])


def write_summary(
    out: str, settings: Settings, parts: dict[str, list[dict]], seconds: float
) -> None:
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    red = [
        dict(x, sim_pct=pct(x["sim_reduction"]), cf_pct=pct(x["closed_form_reduction"]))
        for x in parts["reduction"]
    ]
    sens = [
        dict(x, sim_pct=pct(x["sim_reduction"]), cf_pct=pct(x["closed_form_reduction"]))
        for x in parts["sensitivity"]
    ]
    text = [
        "# Reproduced results (generated by experiments/reproduce.py)",
        "",
        f"Settings: quick={settings.quick}, {settings.replicas} simulated runs per point, "
        f"{settings.work_hours:.0f} h of failure-free work, m = {M}; {seconds / 60:.1f} min.",
        "",
        "## Time-to-train (hours), each strategy at its optimised r and checkpoint interval",
        "",
        _table(
            parts["time_to_train"],
            [
                ("gpus", "GPUs", ","),
                ("label", "strategy", "s"),
                ("redundancy", "r", "d"),
                ("checkpoint_interval_s", "interval (s)", ".0f"),
                ("closed_form_h", "closed form", ".0f"),
                ("sim_h", "simulation", ".0f"),
                ("sim_se_h", "sim s.e.", ".1f"),
                ("sim_overhead", "overhead", ".3f"),
                ("sim_availability", "availability", ".3f"),
            ],
        ),
        "",
        "## Reduction of time-to-train vs replication",
        "",
        _table(
            red,
            [
                ("gpus", "GPUs", ","),
                ("spare_r", "SPARe r", "d"),
                ("replication_r", "replication r", "d"),
                ("sim_pct", "simulation", "s"),
                ("cf_pct", "closed form", "s"),
            ],
        ),
        "",
        f"## Sensitivity at {settings.gpus[-1]:,} GPUs",
        "",
        _table(
            sens,
            [
                ("case", "case", "s"),
                ("spare_r", "SPARe r", "d"),
                ("replication_r", "replication r", "d"),
                ("spare_sim_h", "SPARe (h)", ".0f"),
                ("replication_sim_h", "replication (h)", ".0f"),
                ("sim_pct", "reduction, sim", "s"),
                ("cf_pct", "reduction, closed form", "s"),
            ],
        ),
        "",
        f"## Whole-rack failures at {settings.gpus[-1]:,} GPUs "
        "(16-group domains, 5% of the group failure rate)",
        "",
        _table(
            parts["domains"],
            [
                ("case", "case", "s"),
                ("redundancy", "r", "d"),
                ("closed_form_h", "closed form (h)", ".0f"),
                ("sim_h", "simulation (h)", ".0f"),
                ("sim_se_h", "sim s.e.", ".1f"),
                ("sim_interruptions", "interruptions", ".1f"),
            ],
        ),
        "",
    ]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(text))


def main(argv: list[str]) -> None:
    del argv
    settings = _settings(QUICK.value, REPLICAS.value)
    out = OUT.value
    os.makedirs(out, exist_ok=True)
    start = time.time()
    parts = {}
    steps = [
        ("overhead", lambda: fig_overhead(settings, out)),
        ("endurance", lambda: fig_endurance(settings, out)),
        ("availability", lambda: fig_availability(settings, out)),
        ("time_to_train", lambda: fig_time_to_train(settings, out)),
        ("reduction", lambda: fig_reduction(parts["time_to_train"], out)),
        ("sensitivity", lambda: sensitivity(settings, out)),
        ("domains", lambda: domains(settings, out)),
    ]
    for name, step in tqdm.tqdm(steps, desc="reproduce"):
        parts[name] = step()
    write_summary(out, settings, parts, time.time() - start)
    print(f"wrote {out}/ in {(time.time() - start) / 60:.1f} min")


if __name__ == "__main__":
    app.run(main)

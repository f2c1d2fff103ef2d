"""Figures, CSV files and the markdown summary of experiments/reproduce.py.

Plotting and file plumbing only: every number comes in as rows (lists of
dicts) computed by reproduce.py; nothing here runs the model or the simulator.
Every file is written whole through `cli.replace_file`.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

from spare_jax import cli
from spare_jax.analysis.batch import short_count

Rows = list[dict]

# Series colour per strategy label (time-to-train figure).
COLORS = {
    "checkpoint/restart": "C1",
    "replication": "C3",
    "replication (r >= 2)": "0.45",
    "SPARe fixed order": "C4",
    "SPARe adaptive": "C0",
}
# Line width per label: where optima coincide (r = 1) the wider lines stay visible below.
WIDTHS = {"checkpoint/restart": 6.0, "replication": 3.5}


def write_csv(path: str, rows: Rows) -> None:
    """Write `rows` (same keys in every row) as a CSV file with a header."""
    with cli.replace_file(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _figure(path: str, ax_setup: Callable, panels: int = 1) -> None:
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
    with cli.replace_file(path, "wb") as f:
        fig.savefig(f, format="png", bbox_inches="tight")
    plt.close(fig)


def _style_legend(
    ax, entries: Sequence[tuple[str, str]], styles: Sequence[tuple[str, dict]]
) -> None:
    """Legend entries by colour (series) and by line style (what is drawn)."""
    for label, color in entries:
        ax.plot([], [], color=color, lw=6, label=label)
    for label, kw in styles:
        ax.plot([], [], label=label, **{"color": "0.3", **kw})


def _plain_log_axis(axis) -> None:
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def overhead(rows: Rows, out: str, groups: int) -> None:
    """overhead_vs_redundancy.{png,csv}: epoch overhead vs r per policy and m."""
    series = [
        ("spare adaptive", 16, "C0", "SPARe adaptive, m=16"),
        ("spare adaptive", 8, "C9", "SPARe adaptive, m=8"),
        ("spare adaptive", 1, "C2", "SPARe adaptive, m=1 (whole shards)"),
        ("spare fixed", 8, "C1", "SPARe fixed order"),
        ("replication", 1, "C3", "replication"),
    ]

    def setup(ax):
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
                ms=4,
            )
            ax.plot(rr, [x["closed_form_mean"] for x in sel], "x", color="k", ms=6)
            ax.plot(rr, [x["sim_worst"] for x in sel], "--", color=color, alpha=0.6, lw=1.2)
        _style_legend(
            ax,
            [(s[3], s[2]) for s in series],
            [
                ("simulation, time-weighted mean", {"marker": "o", "ls": "-"}),
                ("closed form, time-weighted mean", {"marker": "x", "ls": "none", "color": "k"}),
                ("simulation, worst seen (mean over epochs)", {"ls": "--"}),
            ],
        )
        ax.set_xlabel("redundancy r")
        ax.set_ylabel("computation overhead (max load / m)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MultipleLocator(1))
        ax.set_title(f"Overhead over a whole interruption epoch, G = {groups:,} groups")

    _figure(os.path.join(out, "overhead_vs_redundancy.png"), setup)
    write_csv(os.path.join(out, "overhead_vs_redundancy.csv"), rows)


def endurance(rows: Rows, out: str, redundancies: Sequence[int]) -> None:
    """endurable_failures.{png,csv}: failures to interruption vs G."""

    def setup(ax):
        for i, r in enumerate(redundancies):
            for strategy, marker in (("spare", "o"), ("replication", "s")):
                sel = [x for x in rows if x["strategy"] == strategy and x["redundancy"] == r]
                gg = [x["groups"] for x in sel]
                ls = "-" if strategy == "spare" else "--"
                ax.plot(gg, [x["closed_form"] for x in sel], ls, color=f"C{i}")
                ax.plot(gg, [x["sim"] for x in sel], marker, color=f"C{i}", mfc="none", ms=7)
        _style_legend(
            ax,
            [(f"r = {r}", f"C{i}") for i, r in enumerate(redundancies)],
            [
                ("SPARe (cyclic stacking), closed form", {"ls": "-"}),
                ("SPARe, simulation", {"marker": "o", "ls": "none", "mfc": "none"}),
                ("replication, closed form", {"ls": "--"}),
                ("replication, simulation", {"marker": "s", "ls": "none", "mfc": "none"}),
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
    write_csv(os.path.join(out, "endurable_failures.csv"), rows)


def availability(rows: Rows, out: str, gpus: int) -> None:
    """availability_vs_redundancy.{png,csv}: availability and effective ratio vs r."""

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
        axes[0].set_title(f"Availability at {gpus:,} GPUs")
        axes[1].set_title("Effective training-time ratio (best m, interval per r)")

    _figure(os.path.join(out, "availability_vs_redundancy.png"), setup, panels=2)
    write_csv(os.path.join(out, "availability_vs_redundancy.csv"), rows)


def time_to_train(rows: Rows, out: str, labels: Sequence[str], work_hours: float) -> None:
    """time_to_train.{png,csv}: time-to-train vs GPUs, each strategy at its optimum."""

    def setup(ax):
        for label in labels:
            sel = [x for x in rows if x["label"] == label]
            n = [x["gpus"] for x in sel]
            color, lw = COLORS[label], WIDTHS.get(label, 1.6)
            ax.errorbar(
                n,
                [x["sim_h"] for x in sel],
                [x["sim_se_h"] for x in sel],
                fmt="o-",
                color=color,
                ms=4,
                lw=lw,
                alpha=0.55 if lw > 2 else 1.0,
            )
            ax.plot(n, [x["closed_form_h"] for x in sel], "x:", color=color, ms=8)
        ax.axhline(work_hours, color="k", lw=0.8)
        _style_legend(
            ax,
            [(label, COLORS[label]) for label in labels],
            [
                ("simulation (± s.e.)", {"marker": "o", "ls": "-"}),
                ("closed form", {"marker": "x", "ls": ":"}),
                (f"failure-free work ({work_hours:.0f} h)", {"color": "k", "lw": 0.8}),
            ],
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        _plain_log_axis(ax.xaxis)
        _plain_log_axis(ax.yaxis)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("time-to-train (hours)")
        ax.set_title(
            "Time-to-train, each strategy at its optimised r, m and interval\n"
            "(where an optimum is r = 1, that line coincides with checkpoint/restart)",
            fontsize=10,
        )

    _figure(os.path.join(out, "time_to_train.png"), setup)
    write_csv(os.path.join(out, "time_to_train.csv"), rows)


def reduction(rows: Rows, out: str) -> None:
    """reduction_vs_replication.{png,csv}: 1 - T(SPARe) / T(replication) vs GPUs."""

    def setup(ax):
        n = [x["gpus"] for x in rows]
        ax.errorbar(
            n,
            [100 * x["sim_reduction"] for x in rows],
            [100 * x["sim_reduction_se"] for x in rows],
            fmt="o-",
            color="C0",
            ms=5,
            label="vs replication's optimum (r in 1..8): simulation ± s.e.",
        )
        ax.plot(
            n,
            [100 * x["closed_form_reduction"] for x in rows],
            "x:",
            color="C0",
            ms=8,
            label="vs replication's optimum: closed form (= plan.py)",
        )
        ax.errorbar(
            n,
            [100 * x["sim_reduction_r2"] for x in rows],
            [100 * x["sim_reduction_r2_se"] for x in rows],
            fmt="s-",
            color="0.45",
            mfc="none",
            ms=5,
            label="vs replication with r >= 2: simulation ± s.e.",
        )
        ax.plot(
            n,
            [100 * x["closed_form_reduction_r2"] for x in rows],
            "x:",
            color="0.45",
            ms=8,
            label="vs replication with r >= 2: closed form",
        )
        ax.axhspan(40, 50, color="C2", alpha=0.15, label="paper's claim (40~50%)")
        # The plans under the axis: SPARe adaptive's (r, m) and replication's r.
        ax.set_ylim(-11, 53)
        ax.axhline(0, color="k", lw=0.6)
        for x in rows:
            ax.text(
                x["gpus"],
                -4.5,
                f"r={x['spare_r']}, m={x['spare_m']}",
                ha="center",
                fontsize=7,
                color="C0",
            )
            ax.text(x["gpus"], -8.5, f"r={x['replication_r']}", ha="center", fontsize=7, color="C3")
        ax.plot([], [], ls="none", label="SPARe's plan (blue) and replication's r (red), below 0")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("time-to-train reduction (%)")
        ax.set_title("SPARe adaptive vs replication, each at its optimum")

    _figure(os.path.join(out, "reduction_vs_replication.png"), setup)
    write_csv(os.path.join(out, "reduction_vs_replication.csv"), rows)


# Colour per framing of the headline table (reproduce.FRAMINGS).
FRAMING_COLORS = {"optimum": "C0", "r=2": "C1", "r=4": "C2", "r=8": "C3"}


def _framing_label(framing: str) -> str:
    if framing == "optimum":
        return "each at its optimum (SPARe's best r at this m)"
    return f"equal redundancy {framing.replace('=', ' = ')}"


def _halves(rows: Rows) -> list[Rows]:
    """The headline rows without a cap, then with it (either may be empty)."""
    return [
        [x for x in rows if not x["max_global_batch_tokens"]],
        [x for x in rows if x["max_global_batch_tokens"]],
    ]


def headline(rows: Rows, out: str, replicas: int) -> None:
    """headline_by_batch.{png,csv,md}: reduction vs replication along m and the framing."""
    halves = [h for h in _halves(rows) if h]

    def setup(axes):
        axes = axes if isinstance(axes, list) else [axes]
        for ax, half in zip(axes, halves, strict=True):
            for framing, color in FRAMING_COLORS.items():
                sel = [x for x in half if x["framing"] == framing]
                mm = [x["microbatches"] for x in sel]
                ax.errorbar(
                    mm,
                    [100 * x["sim_reduction"] for x in sel],
                    [100 * x["sim_reduction_se"] for x in sel],
                    fmt="o-",
                    color=color,
                    ms=4,
                    lw=1.6,
                )
                ax.plot(mm, [100 * x["closed_form_reduction"] for x in sel], "x:", color=color)
            ax.axhspan(40, 50, color="C2", alpha=0.12)
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xscale("log", base=2)
            first = {x["microbatches"]: x for x in half if x["framing"] == "optimum"}
            ax.set_xticks(list(first))
            ax.set_xticklabels(
                [
                    f"{m}\n{short_count(x['global_batch_tokens'])}\n{x['gpus_per_group']:,}"
                    for m, x in first.items()
                ],
                fontsize=8,
            )
            ax.minorticks_off()
            ax.set_xlabel(
                "micro-batches per group m / global batch (tokens a step) / GPUs per group",
                fontsize=9,
            )
            ax.set_ylabel("time-to-train reduction vs replication (%)")
            cap = half[0]["max_global_batch_tokens"]
            ax.set_title(
                f"{half[0]['gpus']:,} GPUs, micro-batch {half[0]['microbatch_tokens']:,} tokens, "
                + (f"batch capped at {int(cap):,} tokens a step" if cap else "no cap on the batch"),
                fontsize=10,
            )
        _style_legend(
            axes[-1],
            [(_framing_label(f), c) for f, c in FRAMING_COLORS.items()],
            [
                (f"simulation (± s.e., {_runs(replicas)} a plan)", {"marker": "o", "ls": "-"}),
                ("closed form (= plan.py)", {"marker": "x", "ls": ":"}),
                ("paper's claim (40~50%)", {"lw": 8, "color": "C2", "alpha": 0.12}),
            ],
        )

    _figure(os.path.join(out, "headline_by_batch.png"), setup, panels=len(halves))
    write_csv(os.path.join(out, "headline_by_batch.csv"), rows)
    with cli.replace_file(os.path.join(out, "headline_by_batch.md")) as f:
        f.write(headline_markdown(rows, replicas) + "\n")


def headline_markdown(rows: Rows, replicas: int) -> str:
    """The headline table in Markdown: one table without the cap, one with it."""
    text = []
    for half in _halves(rows):
        if not half:
            continue
        x0, cap = half[0], half[0]["max_global_batch_tokens"]
        rep_r = next(x["replication_r"] for x in half if x["framing"] == "optimum")
        if not cap:
            text.append(
                f"At {x0['gpus']:,} GPUs ({x0['groups']:,} groups of {x0['gpus_per_group']}), "
                f"micro-batch {x0['microbatch_tokens']:,} tokens, no cap on the global batch. "
                "Each cell: reduction of time-to-train against replication, closed form / "
                f"simulation ± s.e. ({_runs(replicas)} a plan). Each at its optimum: SPARe "
                f"adaptive at its best r for this m (column SPARe r) against replication at its "
                f"best r ({rep_r}); equal r: both at that r. Checkpoint intervals optimised."
            )
        else:
            text.append(
                f"Under a cap of {int(cap):,} tokens a step: each m runs on the most groups whose "
                f"global batch fits (whole {x0['base_gpus_per_group']}-GPU base groups, G a "
                "multiple of 8 so that replication runs at every r compared); replication, "
                "whose time does not depend on m, runs on the m = 1 layout "
                f"({x0['replication_groups']:,} groups of {x0['replication_gpus_per_group']:,} "
                f"GPUs; its best r = {rep_r})."
            )
        by_m: dict[int, dict[str, dict]] = {}
        for x in half:
            by_m.setdefault(int(x["microbatches"]), {})[x["framing"]] = x
        text += [
            "",
            (
                "| m | groups x GPUs | global batch (sequences) | tokens | SPARe r "
                "| each at its optimum | equal r = 2 | equal r = 4 | equal r = 8 |"
            ),
            "|" + "---|" * 9,
        ]
        for m, cells in by_m.items():
            x = cells["optimum"]
            text.append(
                f"| {m} | {int(x['groups']):,} x {int(x['gpus_per_group']):,} "
                f"| {int(x['global_batch_sequences']):,} | {short_count(x['global_batch_tokens'])} "
                f"| {x['spare_r']} | "
                + " | ".join(_cell(cells[f]) if f in cells else "n/a" for f in FRAMING_COLORS)
                + " |"
            )
        text.append("")
    return "\n".join(text).rstrip("\n")


def _runs(n: int) -> str:
    return f"{n} run" + ("s" if n > 1 else "")


def _cell(x: dict) -> str:
    return (
        f"{_pct(x['closed_form_reduction'])} / {_pct(x['sim_reduction'])} "
        f"± {100 * x['sim_reduction_se']:.1f}"
    )


# ---------------------------------------------------------------- summary.md


def _table(rows: Rows, columns: Sequence[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(c[1] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(format(x[c[0]], c[2]) for c in columns) + " |" for x in rows]
    return "\n".join([head, sep, *body])


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _with_pct(rows: Rows) -> Rows:
    return [
        dict(
            x,
            sim_pct=f"{_pct(x['sim_reduction'])} ± {100 * x['sim_reduction_se']:.1f}",
            cf_pct=_pct(x["closed_form_reduction"]),
        )
        for x in rows
    ]


def summary(out: str, header: str, parts: dict[str, Rows], gpus: int, replicas: int) -> None:
    """summary.md: the tables docs/results.md quotes, the headline along the batch first."""
    head = parts["reduction"][-1]
    free = {
        x["microbatches"]: x
        for x in parts["headline"]
        if not x["max_global_batch_tokens"] and x["framing"] == "optimum"
    }
    at = free.get(head["spare_m"])
    batch = (
        f" (a global batch of {int(at['global_batch_sequences']):,} sequences, "
        f"{short_count(at['global_batch_tokens'])} tokens a step, at "
        f"{at['microbatch_tokens']:,} tokens a micro-batch)"
        if at and at["gpus"] == head["gpus"]
        else ""
    )
    text = [
        "# Reproduced results (generated by experiments/reproduce.py)",
        "",
        header,
        "",
        f"## The reduction against replication at {gpus:,} GPUs, along m, batch and framing",
        "",
        headline_markdown(parts["headline"], replicas),
        "",
        (
            f"**The optimum at {head['gpus']:,} GPUs**: SPARe adaptive at r = {head['spare_r']}, "
            f"m = {head['spare_m']}{batch} vs replication at r = {head['replication_r']}: "
            f"closed form {_pct(head['closed_form_reduction'])} less time-to-train "
            f"(the number `python experiments/plan.py` prints), simulation of the same plans "
            f"{_pct(head['sim_reduction'])} ± {100 * head['sim_reduction_se']:.1f} (s.e.)."
        ),
        "",
        "## Time-to-train (hours), each strategy at its optimised r, m and checkpoint interval",
        "",
        _table(
            parts["time_to_train"],
            [
                ("gpus", "GPUs", ","),
                ("label", "strategy", "s"),
                ("redundancy", "r", "d"),
                ("microbatches", "m", "d"),
                ("checkpoint_interval_s", "interval (s)", ".0f"),
                ("closed_form_h", "closed form", ".0f"),
                ("sim_h", "simulation", ".0f"),
                ("sim_se_h", "sim s.e.", ".1f"),
                ("sim_overhead", "overhead", ".3f"),
                ("sim_availability", "availability", ".3f"),
                ("sim_interruptions", "interruptions", ".1f"),
            ],
        ),
        "",
        "## Reduction of time-to-train vs replication",
        "",
        (
            "Against replication's optimum over r in 1..8 (r = 1 is checkpoint/restart), "
            "and against replication restricted to r >= 2."
        ),
        "",
        _table(
            [
                dict(
                    x,
                    r2_sim=f"{_pct(x['sim_reduction_r2'])} ± {100 * x['sim_reduction_r2_se']:.1f}",
                    r2_cf=_pct(x["closed_form_reduction_r2"]),
                )
                for x in _with_pct(parts["reduction"])
            ],
            [
                ("gpus", "GPUs", ","),
                ("spare_r", "SPARe r", "d"),
                ("spare_m", "SPARe m", "d"),
                ("replication_r", "replication r", "d"),
                ("sim_pct", "simulation ± s.e.", "s"),
                ("cf_pct", "closed form", "s"),
                ("r2_sim", "vs r >= 2: simulation", "s"),
                ("r2_cf", "vs r >= 2: closed form", "s"),
            ],
        ),
        "",
        f"## Sensitivity at {gpus:,} GPUs",
        "",
        _table(
            _with_pct(parts["sensitivity"]),
            [
                ("case", "case", "s"),
                ("spare_r", "SPARe r", "d"),
                ("spare_m", "SPARe m", "d"),
                ("replication_r", "replication r", "d"),
                ("spare_sim_h", "SPARe (h)", ".0f"),
                ("replication_sim_h", "replication (h)", ".0f"),
                ("sim_pct", "reduction, sim ± s.e.", "s"),
                ("cf_pct", "reduction, closed form", "s"),
            ],
        ),
        "",
        f"## Whole-rack failures at {gpus:,} GPUs (16-group domains, 5% of the group failure rate)",
        "",
        _table(
            parts["domains"],
            [
                ("case", "case", "s"),
                ("redundancy", "r", "d"),
                ("microbatches", "m", "d"),
                ("closed_form_h", "closed form (h)", ".0f"),
                ("sim_h", "simulation (h)", ".0f"),
                ("sim_se_h", "sim s.e.", ".1f"),
                ("sim_interruptions", "interruptions", ".1f"),
            ],
        ),
        "",
    ]
    with cli.replace_file(os.path.join(out, "summary.md")) as f:
        f.write("\n".join(text))


def stragglers(rows: Rows, out: str) -> None:
    """stragglers.{png,csv}: time-to-train vs the fraction of slow groups, per response."""
    rs = sorted({x["redundancy"] for x in rows})
    series = [
        ("wait_h", "C3", "s-", "wait for the slowest group"),
        ("evict_h", "C1", "D--", "evict the slow groups (masked as dead)"),
        ("speed_aware_h", "C0", "o-", "SPARe speed-aware assignment"),
    ]

    def setup(axes):
        for ax, r in zip(axes, rs, strict=True):
            sel = [x for x in rows if x["redundancy"] == r and x["slow_fraction"] > 0]
            pct = [100 * x["slow_fraction"] for x in sel]
            for key, color, fmt, label in series:
                ax.plot(pct, [x[key] for x in sel], fmt, color=color, ms=5, lw=1.8, label=label)
            stuck = [
                (p, x["wait_h"])
                for p, x in zip(pct, sel, strict=True)
                if x["evict_h"] != x["evict_h"]
            ]
            if stuck:
                ax.plot(
                    *zip(*stuck, strict=True),
                    "x",
                    color="C1",
                    ms=9,
                    mew=2,
                    label="evict: a shard has no fast holder left (cannot run)",
                )
            base = sel[0]["base_h"]
            ax.axhline(base, color="k", lw=0.8, label="no stragglers")
            ax.set_xscale("log")
            ax.set_xlabel("groups slowed 3x (%)")
            ax.set_ylabel("time-to-train (hours)")
            ax.set_title(
                f"SPARe r = {r}, m = {sel[0]['microbatches']}, "
                f"{sel[0]['groups']:,} groups ({sel[0]['gpus']:,} GPUs)",
                fontsize=10,
            )

    _figure(os.path.join(out, "stragglers.png"), setup, panels=len(rs))
    write_csv(os.path.join(out, "stragglers.csv"), rows)

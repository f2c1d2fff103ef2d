"""Closed form, fast simulator and SimGrid side by side, and where the network parts them.

Every scenario is scaled so that some group fails every `--steps_per_failure`
steps, which keeps the runs short in simulated time. Three passes:

1. Endurable failures and mean time to interruption: `analysis` against
   `sim.failures_to_interruption` / `sim.time_to_interruption` and SimGrid
   epochs (`simgrid.epochs`) on the fast simulator's own failure trace.
2. Computation overhead (SimGrid's step time over its failure-free step time,
   against max load / m) and time-to-train on SimGrid's ``CM02`` model with a
   small gradient, for SPARe adaptive, SPARe fixed order, replication and
   checkpoint/restart. SimGrid's runs share their failure traces with the
   first fast-simulator runs; SimGrid's mean is estimated through the paired
   differences (`paired`).
3. The divergence map: SimGrid's default ``LV08`` model, realistic gradients
   and growing G (SPARe adaptive): where communication parts SimGrid and the
   closed form, by how much. It also times the fast simulator and SimGrid
   (every step simulated) on one scenario, in steps per wall second.

    python experiments/validate.py                          # runs/validate
    python experiments/validate.py --out docs/validation    # docs/validation.md's artefacts
    python experiments/validate.py --quick --json           # seconds; one JSON object

Writes summary.md (the tables, also printed), agreement.csv,
divergence_map.csv, speed.csv, summary.json, agreement.png and
divergence_map.png under --out. Needs SimGrid (python3-simgrid); without it,
says in one line how to get it and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time

import _figures  # experiments/ is on sys.path when this file runs as a script
import matplotlib.pyplot as plt
import numpy as np
from absl import app, flags

from spare_jax import analysis, cli, sim, strategies
from spare_jax.scenario import Scenario
from spare_jax.sim import simgrid
from spare_jax.sim import simgrid_compat as compat

_OUT = flags.DEFINE_string("out", "runs/validate", "Output directory.")
_QUICK = flags.DEFINE_bool("quick", False, "Seconds: one small cell per pass (CI).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the tables.")
_GROUPS = flags.DEFINE_list("groups", ["120", "600", "2400"], "G of pass 1.")
_TRAIN_GROUPS = flags.DEFINE_list("train_groups", ["120", "480"], "G of pass 2.")
_MAP_GROUPS = flags.DEFINE_list("map_groups", ["120", "480", "1200"], "G of the map.")
_MAP_GRADIENTS = flags.DEFINE_list(
    "map_gradients", ["1e8", "2e9", "1.6e10", "1.4e11"], "Gradient bytes per group of the map."
)
_REFERENCE = flags.DEFINE_float("map_reference", 1.6e10, "Map gradient also reported as rows.")
_REDUNDANCY = flags.DEFINE_list("redundancy", ["2", "3", "4"], "Redundancies r.")
_MAP_R = flags.DEFINE_integer("map_redundancy", 3, "r of the map.", lower_bound=2)
_EPOCHS = flags.DEFINE_integer("epochs", 2000, "SimGrid epochs per pass-1 cell.", lower_bound=1)
_RUNS = flags.DEFINE_integer("runs", 4, "SimGrid training runs per cell.", lower_bound=1)
_FAST_RUNS = flags.DEFINE_integer("fast_runs", 200, "Fast-simulator runs per cell.", lower_bound=2)
_BUDGET = flags.DEFINE_integer("step_budget", 2000, "Steps simulated per cell.", lower_bound=1)
_MAP_BUDGET = flags.DEFINE_integer("map_step_budget", 600, "Per map cell.", lower_bound=1)
_MAX_INT = flags.DEFINE_integer("max_interruptions", 200, "Per cell, at most.", lower_bound=1)
_DP_INT = flags.DEFINE_integer("dp_interruptions", 1000, "Per dp cell.", lower_bound=1)
_PHI = flags.DEFINE_float("steps_per_failure", 200.0, "Steps between failures.", lower_bound=1)
_STEP_S = flags.DEFINE_float("step_compute_s", 1.0, "Failure-free compute of a step, s.")
_MICRO = flags.DEFINE_integer("microbatches", 8, "Micro-batches per shard m.", lower_bound=1)
_DETECTION_S = flags.DEFINE_float("detection_s", 2.0, "Failure detection delay, s.", lower_bound=0)
_RESTART_S = flags.DEFINE_float("restart_s", 600.0, "Restart cost, s.", lower_bound=0)
_CHECKPOINT_S = flags.DEFINE_float("checkpoint_s", 30.0, "Checkpoint save, s.", lower_bound=0)
_GRADIENT = flags.DEFINE_float("gradient_bytes", 1e8, "Gradient bytes of pass 2.", lower_bound=0)
_BANDWIDTH = flags.DEFINE_float("bandwidth_Bps", 400e9, "Link bandwidth per group, B/s.")
_LATENCY = flags.DEFINE_float("latency_s", 2e-6, "Latency per link, s.", lower_bound=0)
_TOLERANCE = flags.DEFINE_float("tolerance", 0.05, "Agreement: |rel_diff| at most.", lower_bound=0)
_SPEED_STEPS = flags.DEFINE_integer("speed_steps", 200, "Steps SimGrid times.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Base seed.", lower_bound=0)
_PROCESSES = flags.DEFINE_integer("processes", None, "SimGrid processes (default min(2, CPUs)).")

GPUS_PER_GROUP = 8
METRICS = ("endurable_failures", "mtti_s", "overhead", "time_to_train_s")


# --quick: one small cell per pass, small samples (seconds; the CI contract).
QUICK = {
    "groups": ["120"],
    "train_groups": ["120"],
    "map_groups": ["120"],
    "map_gradients": ["1e8", "1.6e10"],
    "redundancy": ["2"],
    "map_redundancy": 2,
    "epochs": 1000,
    "runs": 2,
    "fast_runs": 40,
    "dp_interruptions": 100,
    "step_budget": 300,
    "map_step_budget": 100,
    "speed_steps": 50,
}


def grid() -> dict[str, list]:
    """The list flags, parsed (after --quick's values); bad values raise UsageError."""
    if _QUICK.value:
        for name, value in QUICK.items():
            flags.FLAGS[name].value = value
    try:
        gradients = [float(v) for v in _MAP_GRADIENTS.value]
    except ValueError:
        raise app.UsageError("--map_gradients must be a comma-separated list of numbers") from None
    if not gradients or not all(0 < g < math.inf for g in gradients):
        raise app.UsageError(f"--map_gradients must be finite and > 0, got {gradients}")
    try:  # the per-step and network flags, by the checks the SimGrid model applies itself
        cluster("CM02")
        simgrid.Workload(step_compute_s=_STEP_S.value, gradient_bytes=_GRADIENT.value).validate()
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    names = ("groups", "train_groups", "map_groups", "redundancy")
    return {n: cli.int_list(n, flags.FLAGS[n].value, low=2) for n in names} | {
        "map_gradients": gradients
    }


def scenario(groups: int, work_s: float, restart_s: float) -> Scenario:
    """G groups of 8 GPUs, a failure every --steps_per_failure steps, restarts of `restart_s`."""
    group_mtbf_s = _PHI.value * _STEP_S.value * groups
    return Scenario(
        gpus=groups * GPUS_PER_GROUP,
        gpus_per_group=GPUS_PER_GROUP,
        gpu_mtbf_hours=group_mtbf_s * GPUS_PER_GROUP / 3600.0,
        work_hours=work_s / 3600.0,
        checkpoint_s=_CHECKPOINT_S.value,
        restart_s_ref=restart_s,
        restart_ref_gpus=groups * GPUS_PER_GROUP,
        restart_exponent=1.0,
    )


def cluster(network: str) -> simgrid.Cluster:
    return simgrid.Cluster(
        network=network, bandwidth_Bps=_BANDWIDTH.value, latency_s=_LATENCY.value
    ).validate()


def seeds(n: int, salt: int) -> list[int]:
    """Seeds shared by both simulators: run i of each sees the same failure trace."""
    return [
        int(s.generate_state(1)[0]) for s in np.random.SeedSequence([_SEED.value, salt]).spawn(n)
    ]


def variants(groups: int, redundancies: list[int]):
    """(variant, r) to run at G: stacking and replication at every r (G divisible), dp at r = 1."""
    for v in strategies.VARIANTS:
        for r in [1] if v.strategy == "dp" else redundancies:
            if v.strategy != "replication" or groups % r == 0:
                yield v, r


def row(metric, groups, r, name, net, cf, fast, sg, samples: int, stderr: float) -> dict:
    """One row of the JSON contract (plus samples and the relative standard error)."""
    rel = sg / cf - 1.0
    return {
        "metric": metric,
        "groups": groups,
        "redundancy": r,
        "strategy": name,
        "network": net,
        "closed_form": float(cf),
        "fast_sim": float(fast),
        "simgrid": float(sg),
        "rel_diff": float(rel),
        "agree": bool(abs(rel) <= _TOLERANCE.value),
        "samples": int(samples),
        "stderr_rel": float(stderr),
    }


def _mean_err(values) -> tuple[float, float]:
    """Mean and relative standard error."""
    a = np.asarray(values, float)
    err = a.std(ddof=1) / math.sqrt(a.size) if a.size > 1 else 0.0
    return float(a.mean()), float(err / a.mean())


# ---------------------------------------------------------------- pass 1


def failure_specs(grid: dict) -> tuple[list[dict], list[tuple]]:
    """SimGrid `epochs` payloads and their cells (the policy does not change interruptions)."""
    specs, cells = [], []
    for g in grid["groups"]:
        for v, r in variants(g, grid["redundancy"]):
            if v.name != "spare_fixed":
                sc, seed = scenario(g, 3600.0, _RESTART_S.value), seeds(1, 100 * g + r)[0]
                n = _EPOCHS.value * (5 if r == 1 else 1)  # dp epochs are one failure each
                kw = {"redundancy": r, "epochs": n, "seed": seed, "detection_s": _DETECTION_S.value}
                specs.append(simgrid.epochs_spec(sc, v.strategy, cluster=cluster("CM02"), **kw))
                cells.append((g, r, v, sc, seed))
    return specs, cells


def same_trace(sc: Scenario, strategy: str, r: int, seed: int, ep: simgrid.Epochs) -> bool:
    """Whether SimGrid's epochs are those of the fast simulator's failure process, one by one."""
    process = sim.RandomFailures(
        strategies.placement(strategy, sc.groups, r),
        sc.group_mtbf_s,
        rng=np.random.default_rng(seed),
    )
    clock, fails, ups = 0.0, [], []
    for _ in range(ep.failures.size):
        seg = process.segment(clock, math.inf)
        fails.append(seg.event_times.size)
        ups.append(seg.interruption)
        clock += seg.interruption
        process.restart(clock)
    return bool(np.array_equal(fails, ep.failures) and np.allclose(ups, ep.uptime_s, rtol=1e-9))


def failure_rows(cells: list[tuple], results: list) -> list[dict]:
    rows = []
    for (g, r, v, sc, seed), ep in zip(cells, results, strict=True):
        trials = max(20_000, ep.failures.size)
        fast_f = sim.failures_to_interruption(v.strategy, g, r, trials=trials, seed=seed).mean()
        fast_t = sim.time_to_interruption(
            v.strategy, g, r, sc.group_mtbf_s, trials=trials, seed=seed
        ).mean()
        cf_f = analysis.endurable_failures(v.strategy, g, r)
        cf_t = analysis.mean_time_to_interruption(v.strategy, g, r, sc.group_mtbf_s)
        extra = {"same_trace_as_fast_sim": same_trace(sc, v.strategy, r, seed, ep)}
        for metric, cf, fast, values in (
            ("endurable_failures", cf_f, fast_f, ep.failures),
            ("mtti_s", cf_t, fast_t, ep.uptime_s),
        ):
            mean, err = _mean_err(values)
            rows.append(row(metric, g, r, v.name, "CM02", cf, fast, mean, values.size, err) | extra)
    return rows


# ---------------------------------------------------------------- passes 2 and 3


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training configuration run by all three; `interruptions` expected per run."""

    groups: int
    r: int
    variant: strategies.Variant
    network: str
    gradient: float
    runs: int
    interruptions: float

    def estimate(self, steps: int) -> tuple[Scenario, analysis.Estimate]:
        """The closed form's scenario (restart plus detection) and estimate for `steps` of work."""
        cf = scenario(self.groups, steps * _STEP_S.value, _RESTART_S.value + _DETECTION_S.value)
        v = self.variant
        return cf, analysis.time_to_train(
            cf, v.strategy, redundancy=self.r, microbatches=_MICRO.value, policy=v.policy
        )

    @functools.cached_property
    def setup(self) -> tuple[Scenario, Scenario, analysis.Estimate]:
        """(SimGrid's scenario, the closed form's and fast simulator's, the closed-form estimate).

        The work is sized so that the closed form expects `interruptions` per run.
        """
        mtbf = _PHI.value * _STEP_S.value * self.groups
        mtti = analysis.mean_time_to_interruption(self.variant.strategy, self.groups, self.r, mtbf)
        steps = max(1, round(self.interruptions * mtti / _STEP_S.value))
        steps = max(1, round(steps * self.interruptions / self.estimate(steps)[1].interruptions))
        cf, est = self.estimate(steps)
        return scenario(self.groups, steps * _STEP_S.value, _RESTART_S.value), cf, est

    def kwargs(self, seed: int) -> dict:
        v, est = self.variant, self.setup[2]
        return {
            "redundancy": self.r,
            "checkpoint_interval_s": est.checkpoint_interval_s,
            "microbatches": _MICRO.value,
            "policy": v.policy,
            "seed": seed,
        }

    def specs(self, **workload) -> list[dict]:
        wl = simgrid.Workload(
            step_compute_s=_STEP_S.value,
            gradient_bytes=self.gradient,
            detection_s=_DETECTION_S.value,
            **workload,
        )
        sg = self.setup[0]
        return [
            simgrid.run_spec(
                sg,
                self.variant.strategy,
                cluster=cluster(self.network),
                workload=wl,
                **self.kwargs(s),
            )
            for s in seeds(self.runs, 7 * self.groups + self.r)
        ]

    def fast(self, runs: int) -> list[sim.RunResult]:
        """Fast-simulator runs; the first `self.runs` share SimGrid's seeds (failure traces)."""
        picked = seeds(runs, 7 * self.groups + self.r)
        return [
            sim.simulate(self.setup[1], self.variant.strategy, **self.kwargs(s)) for s in picked
        ]


def cell(g: int, r: int, v: strategies.Variant, net: str, gradient: float, budget: int) -> Cell:
    """A cell whose SimGrid runs simulate about `budget` steps (one per failure)."""
    if r == 1:
        total = _DP_INT.value  # checkpoint/restart simulates no step per epoch
    else:
        per_epoch = analysis.endurable_failures(v.strategy, g, r)
        total = min(_MAX_INT.value, max(_RUNS.value, budget / per_epoch))
    return Cell(g, r, v, net, gradient, _RUNS.value, total / _RUNS.value)


def paired(sg: list[float], fast: list[float]) -> tuple[float, float, float]:
    """SimGrid's mean, its relative standard error, and SimGrid vs the fast simulator.

    Run i of SimGrid and of the fast simulator play one failure trace (i <
    len(sg)), so the failure process's noise, which dominates, is common to
    both. SimGrid's mean is estimated as the fast simulator's mean over all its
    runs plus the mean paired difference (the fast simulator as a control
    variate): unbiased for SimGrid's expectation, with the noise of the few
    SimGrid runs reduced to that of their differences.
    """
    n, f = len(sg), np.asarray(fast, float)
    diff = np.asarray(sg, float) - f[:n]
    mean = float(f.mean() + diff.mean())
    var = f.var(ddof=1) / f.size + (diff.var(ddof=1) / n if n > 1 else 0.0)
    return mean, float(math.sqrt(var) / mean), float(diff.mean() / f[:n].mean())


def train_rows(c: Cell, runs: list[simgrid.Run], fast_runs: int) -> list[dict]:
    """Overhead and time-to-train rows of one cell; SimGrid-only measurements as extra fields."""
    est, fast = c.setup[2], c.fast(max(fast_runs, c.runs))
    extra = {
        "gradient_bytes": c.gradient,
        "allreduce": runs[0].allreduce,
        "step_s": runs[0].step_s,
        "comm_share": 1.0 - runs[0].compute_s / runs[0].step_s,
        "overhead_load": float(np.mean([x.overhead_load for x in runs])),
        "interruptions": float(np.mean([x.result.interruptions for x in runs])),
        "void_share": float(np.mean([x.void_s / x.result.time_to_train_s for x in runs])),
        "fast_runs": len(fast),
    }
    out = []
    for metric, field, cf in (
        ("overhead", "overhead_mean", est.overhead_mean),
        ("time_to_train_s", "time_to_train_s", est.time_to_train_s),
    ):
        sg = [getattr(x.result, field) for x in runs]
        f = [getattr(x, field) for x in fast]
        mean, err, vs_fast = paired(sg, f)
        key = (c.groups, c.r, c.variant.name, c.network)
        out.append(
            row(metric, *key, cf, float(np.mean(f)), mean, len(runs), err)
            | extra
            | {"simgrid_runs_mean": float(np.mean(sg)), "simgrid_vs_fast": vs_fast}
        )
    return out


def map_cell(rows: list[dict]) -> dict:
    """One cell of the divergence map, from its overhead and time-to-train rows."""
    o, t = rows
    return {
        "groups": o["groups"],
        "gradient_bytes": o["gradient_bytes"],
        "allreduce": o["allreduce"],
        "step_s": o["step_s"],
        "comm_share": o["comm_share"],
        "overhead_closed": o["closed_form"],
        "overhead_simgrid": o["simgrid"],
        "overhead_load": o["overhead_load"],
        "overhead_vs_load": o["simgrid_runs_mean"] / o["overhead_load"] - 1.0,
        "ttt_closed_s": t["closed_form"],
        "ttt_fast_s": t["fast_sim"],
        "ttt_simgrid_s": t["simgrid"],
        "ttt_rel_diff": t["rel_diff"],
        "ttt_stderr_rel": t["stderr_rel"],
        "ttt_vs_fast": t["simgrid_vs_fast"],
    }


def speed(c: Cell, steps: int, cached: simgrid.Run) -> dict:
    """Steps per wall second on one scenario: fast simulator, SimGrid with every step simulated.

    Each is timed three times (SimGrid in one process, one run after the other), best kept.
    """
    spec = c.specs(cache_steps=False, max_steps=steps)[0]
    probe = max(simgrid.play([spec] * 3), key=lambda p: p.simulated_steps / p.driver_wall_s)
    walls, result = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        result = c.fast(1)[0]
        walls.append(time.perf_counter() - t0)
    fast_steps = (c.setup[1].work_hours * 3600.0 + result.lost_progress_s) / _STEP_S.value
    out = {
        "groups": c.groups,
        "redundancy": c.r,
        "strategy": c.variant.name,
        "fast_sim_steps_per_s": fast_steps / min(walls),
        "simgrid_steps_per_s": probe.simulated_steps / probe.driver_wall_s,
        "simgrid_cached_steps_per_s": cached.steps / cached.driver_wall_s,
        "fast_sim_steps": fast_steps,
        "simgrid_steps": probe.simulated_steps,
    }
    out["speedup_fast_vs_simgrid"] = out["fast_sim_steps_per_s"] / out["simgrid_steps_per_s"]
    return out


# ---------------------------------------------------------------- output


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _md(head: list[str], body: list[list[str]]) -> str:
    """A Markdown table."""
    lines = [head, ["---"] * len(head), *body]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def report(result: dict) -> str:
    """The tables of summary.md (and of stdout): agreement, divergence map, speed."""
    head = ["metric", "G", "r", "strategy", "network", "closed form", "fast sim", "SimGrid"]
    head += ["SimGrid vs closed", "std. error", "agree"]
    body = [
        [r["metric"], str(r["groups"]), str(r["redundancy"]), r["strategy"], r["network"]]
        + [f"{r[k]:.5g}" for k in ("closed_form", "fast_sim", "simgrid")]
        + [_pct(r["rel_diff"]), f"{100 * r['stderr_rel']:.1f}%", "yes" if r["agree"] else "**no**"]
        for r in result["rows"]
    ]
    map_head = ["G", "gradient (B)", "all-reduce", "step (s)", "comm. share", "overhead"]
    map_head += ["vs max load / m", "TTT vs closed form", "TTT vs fast sim"]
    map_body = [
        [str(c["groups"]), f"{c['gradient_bytes']:.1e}", c["allreduce"], f"{c['step_s']:.4f}"]
        + [f"{100 * c['comm_share']:.1f}%", f"{c['overhead_simgrid']:.3f}"]
        + [
            _pct(c["overhead_vs_load"]),
            f"{_pct(c['ttt_rel_diff'])} ± {100 * c['ttt_stderr_rel']:.1f}",
        ]
        + [_pct(c["ttt_vs_fast"])]
        for c in result["divergence_map"]
    ]
    sp = result["speed"]
    tol = f"{100 * result['tolerance']:g}%"
    return "\n\n".join(
        [
            f"SimGrid {result['simgrid_version']}; agree: |SimGrid / closed form - 1| <= {tol}.",
            _md(head, body),
            "Divergence map (LV08, SPARe adaptive; TTT vs closed form ± one standard error):",
            _md(map_head, map_body),
            (
                f"Speed (G = {sp['groups']}, r = {sp['redundancy']}, {sp['strategy']}): fast "
                f"simulator {sp['fast_sim_steps_per_s']:,.0f} steps/s; SimGrid "
                f"{sp['simgrid_steps_per_s']:,.1f} steps/s with every step simulated "
                f"({sp['simgrid_cached_steps_per_s']:,.0f} advancing identical steps at once); "
                f"{sp['speedup_fast_vs_simgrid']:,.0f}x."
            ),
        ]
    )


def _clean(value: object) -> object:
    """NumPy scalars unwrapped; NaN and infinities as None (valid JSON, empty CSV cells)."""
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value


def plot_agreement(path: str, rows: list[dict]) -> None:
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(10, 2.6 * len(METRICS)), squeeze=False)
    for ax, metric in zip(axes[:, 0], METRICS, strict=True):
        mine = [r for r in rows if r["metric"] == metric]
        labels = [
            f"{r['network']} G={r['groups']} r={r['redundancy']} {r['strategy']}" for r in mine
        ]
        colors = ["tab:green" if r["agree"] else "tab:red" for r in mine]
        ax.bar(range(len(mine)), [100 * r["rel_diff"] for r in mine], color=colors)
        for sign in (1, -1):
            ax.axhline(sign * 100 * _TOLERANCE.value, color="grey", ls="--", lw=0.8)
        ax.set_xticks(range(len(mine)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("SimGrid vs closed form, %", fontsize=8)
        ax.set_title(metric, fontsize=9)
    _save(fig, path)


def plot_map(path: str, cells: list[dict]) -> None:
    gs = sorted({c["groups"] for c in cells})
    bs = sorted({c["gradient_bytes"] for c in cells})
    fields = [
        ("comm_share", "communication share of a failure-free step, %"),
        ("overhead_vs_load", "overhead vs max load / m (same steps), %"),
        ("ttt_vs_fast", "time-to-train vs fast sim (same trace), %"),
    ]
    fig, axes = plt.subplots(1, len(fields), figsize=(5 * len(fields), 3.4))
    for ax, (field, title) in zip(axes, fields, strict=True):
        grid = np.full((len(gs), len(bs)), np.nan)
        for c in cells:
            grid[gs.index(c["groups"]), bs.index(c["gradient_bytes"])] = 100 * c[field]
        top = float(np.nanmax(np.abs(grid))) or 1.0
        ax.imshow(grid, origin="lower", cmap="coolwarm", aspect="auto", vmin=-top, vmax=top)
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:+.1f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(bs)), [f"{b / 1e9:g}" for b in bs])
        ax.set_yticks(range(len(gs)), [str(g) for g in gs])
        ax.set(xlabel="gradient per group per step, GB", ylabel="groups G")
        ax.set_title(title, fontsize=9)
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    with cli.replace_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
    plt.close(fig)


def write(out: str, result: dict) -> None:
    """Every artefact under `out` (and nowhere else)."""
    rows, cells = result["rows"], result["divergence_map"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    _figures.write_csv(
        os.path.join(out, "agreement.csv"), [{k: r.get(k) for k in keys} for r in rows]
    )
    _figures.write_csv(os.path.join(out, "divergence_map.csv"), cells)
    _figures.write_csv(os.path.join(out, "speed.csv"), [result["speed"]])
    with cli.replace_file(os.path.join(out, "summary.json")) as f:
        json.dump(result, f, indent=1, allow_nan=False)
    with cli.replace_file(os.path.join(out, "summary.md")) as f:
        f.write(report(result) + "\n")
    plot_agreement(os.path.join(out, "agreement.png"), rows)
    plot_map(os.path.join(out, "divergence_map.png"), cells)


# ---------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    del argv
    cfg = grid()
    if not compat.available():
        raise app.UsageError(compat.INSTALL_HINT)
    cli.output_dir("out", _OUT.value)  # before any computation
    f_specs, f_cells = failure_specs(cfg)
    adaptive = strategies.variant("spare_adaptive")
    train = [
        cell(g, r, v, "CM02", _GRADIENT.value, _BUDGET.value)
        for g in cfg["train_groups"]
        for v, r in variants(g, cfg["redundancy"])
    ]
    mapped = [
        cell(g, _MAP_R.value, adaptive, "LV08", b, _MAP_BUDGET.value)
        for g in cfg["map_groups"]
        for b in cfg["map_gradients"]
    ]
    specs = f_specs + [s for c in train + mapped for s in c.specs()]
    procs = _PROCESSES.value or min(2, os.cpu_count() or 1)
    sys.stderr.write(f"validate: {len(specs)} SimGrid runs, {procs} processes\n")
    results = simgrid.play(specs, max(1, procs))
    rows = failure_rows(f_cells, results[: len(f_specs)])
    at, runs = len(f_specs), {}
    for c in train + mapped:
        runs[c], at = results[at : at + c.runs], at + c.runs
    rows += [r for c in train for r in train_rows(c, runs[c], _FAST_RUNS.value)]
    cells = []
    for c in mapped:
        both = train_rows(c, runs[c], _FAST_RUNS.value)
        cells.append(map_cell(both))
        rows += both if math.isclose(c.gradient, _REFERENCE.value) else []
    probe = max((c for c in train if c.variant == adaptive), key=lambda c: (c.groups, c.r == 3))
    sp = speed(probe, _SPEED_STEPS.value, runs[probe][0])
    result = {
        "simgrid_version": compat.version(),
        "tolerance": _TOLERANCE.value,
        "rows": rows,
        "divergence_map": cells,
        "speed": sp,
        "speedup_fast_vs_simgrid": sp["speedup_fast_vs_simgrid"],
    }
    result = json.loads(json.dumps(result, default=_clean), parse_constant=lambda _: None)
    write(_OUT.value, result)
    print(json.dumps(result, allow_nan=False) if _JSON.value else report(result))


if __name__ == "__main__":
    cli.run(main)

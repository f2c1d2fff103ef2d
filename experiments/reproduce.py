"""Reproduce the SPARe paper's results in our model: figures, CSV and a markdown table.

    python experiments/reproduce.py                      # full, into runs/reproduce (~4 min)
    python experiments/reproduce.py --quick              # smoke variant (~10 s)
    python experiments/reproduce.py --out docs/results   # regenerate the committed results

The default `--out` is `runs/reproduce`: regenerating docs/results, which
docs/results.md quotes, is an explicit `--out docs/results`. The output
directory is checked before any work, and each file is replaced whole (through
a temporary file), so an interrupted run keeps the files it had finished.

Every plan comes from `analysis.optimise` with the same search as
experiments/plan.py: redundancy in `analysis.DEFAULT_REDUNDANCIES` (1..8;
replication: divisors of G), micro-batches in `analysis.DEFAULT_MICROBATCHES`
(SPARe adaptive) and the checkpoint interval. The simulator (`sim.simulate_many`)
then plays each plan and both numbers are reported side by side.

Writes under --out, one PNG and one CSV per result:

* overhead_vs_redundancy: computation overhead over an interruption epoch
    (time-weighted, and worst) vs r: adaptive reordering (m = 1, 8, 16), fixed
    order, replication; simulation and closed form;
* endurable_failures: mean failures to interruption vs G, closed form and
    simulation, stacking and replication, r = 2, 3, 4;
* availability_vs_redundancy: availability and effective ratio at 600k GPUs vs r;
* time_to_train: time-to-train vs GPUs (10k to 600k) per strategy at its optimum,
    plus replication restricted to r >= 2 (the paper's baseline);
* reduction_vs_replication: 1 - T(SPARe) / T(replication) vs GPUs;
* sensitivity (CSV + table): the 600k reduction under a narrower search (m = 8,
    r <= 6), costly micro-batches, failure rate, restart growth, group size,
    checkpoint cost, failure law, async checkpoints and hot re-join;
* domains (CSV + table): whole-rack failures, cyclic vs strided stacking;
* headline_by_batch (CSV, PNG and Markdown): the reduction vs replication at
    the largest scale along the micro-batch count m (each with the global batch
    G x m x b it implies, b = --microbatch_tokens) and the framing (each strategy
    at its optimum; equal redundancy r = 2, 4, 8), closed form and simulation;
    then the same under a cap on the global batch (--max_global_batch_tokens,
    default Llama 3 405B's 16M tokens a step), where each m gets the smallest
    groups (whole base groups of the scenario) whose batch fits;
* stragglers: time-to-train at the largest scale vs the fraction of groups
    persistently slowed 3x, SPARe r = 2 and 4: waiting for them, evicting them
    (masked as dead) and the speed-aware assignment (`reorder.makespan`);

and summary.md, the tables docs/results.md quotes (written when every part
runs; `--parts=headline` regenerates that table alone). Figures and files are
drawn by experiments/_figures.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import _figures  # experiments/ is on sys.path when this file runs as a script
import numpy as np
import tqdm
from absl import app, flags

from spare_jax import analysis, cli, reorder, sim, strategies
from spare_jax.analysis import weights
from spare_jax.scenario import Scenario
from spare_jax.strategies import Variant

MAX_REPLICAS = 1_000  # simulated runs per point: ~1 s each at 600k GPUs

OUT = flags.DEFINE_string("out", "runs/reproduce", "output directory (docs/results: the docs)")
QUICK = flags.DEFINE_bool("quick", False, "small, fast variant (smoke test)")
REPLICAS = flags.DEFINE_integer(
    "replicas",
    None,
    "simulated runs per point (default 8; quick 1)",
    lower_bound=1,
    upper_bound=MAX_REPLICAS,
)
SEED = flags.DEFINE_integer(
    "seed", 0, "base seed (>= 0), added to every per-point seed", lower_bound=0
)
MICROBATCH_TOKENS = flags.DEFINE_integer(
    "microbatch_tokens",
    analysis.DEFAULT_MICROBATCH_TOKENS,
    "tokens in one micro-batch b, for the global batch G x m x b of the headline table "
    "(default: one 8,192-token sequence, Llama 3 405B's sequence length)",
)
MAX_BATCH = flags.DEFINE_integer(
    "max_global_batch_tokens",
    analysis.REFERENCE_BATCH_TOKENS,
    "cap on the global batch (tokens a step) of the headline table's second half "
    "(default: Llama 3 405B's 16M)",
)
PARTS = flags.DEFINE_list(
    "parts",
    None,
    "results to compute (default: all, and summary.md): overhead, endurance, availability, "
    "time_to_train, reduction (needs time_to_train), sensitivity, domains, headline, "
    "stragglers",
)

HOUR = 3600.0
REDUNDANCIES = analysis.DEFAULT_REDUNDANCIES
MICROBATCHES = analysis.DEFAULT_MICROBATCHES
# The reference micro-batch count of docs/design.md (7. Computation overhead), for the
# sensitivity cases and the overhead figure.
REFERENCE_M = 8

# The rows of experiments/plan.py (`strategies.VARIANTS`), plus replication without
# r = 1 (its own search, `SEARCH`).
VARIANTS = strategies.VARIANTS
REPLICATION, SPARE = strategies.variant("replication"), strategies.variant("spare_adaptive")
REPLICATION_R2 = Variant("replication_r2", "replication (r >= 2)", "replication", "adaptive")
SEARCH = {REPLICATION_R2.name: tuple(r for r in REDUNDANCIES if r >= 2)}
# The headline table's framings: each strategy at its own optimum, and equal
# redundancy (SPARe and replication at the same r).
OPTIMUM = "optimum"
EQUAL_R = (2, 4, 8)
FRAMINGS = (OPTIMUM, *(f"r={r}" for r in EQUAL_R))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Size of the run: quick (smoke) or full."""

    quick: bool
    replicas: int
    trials: int
    overhead_groups: int
    overhead_trials: int
    endurance_groups: tuple[int, ...]
    gpus: tuple[int, ...]
    work_hours: float
    seed: int = 0


def _settings(quick: bool, replicas: int | None, seed: int = 0) -> Settings:
    if quick:
        return Settings(
            True, replicas or 1, 60, 3_000, 4, (120, 1_200, 12_000), (9_600, 96_000), 48.0, seed
        )
    return Settings(
        False,
        replicas or 8,
        2_000,
        75_000,
        16,
        (120, 600, 1_200, 6_000, 12_000, 30_000, 75_000),
        (9_600, 24_000, 48_000, 96_000, 192_000, 384_000, 600_000),
        720.0,
        seed,
    )


def _fits(strategy: str, groups: int, r: int) -> bool:
    return strategy != "replication" or groups % r == 0


def _scenario(settings: Settings, **changes) -> Scenario:
    return dataclasses.replace(Scenario(work_hours=settings.work_hours), **changes)


# ---------------------------------------------------------------- plans and runs


def plan(
    scenario: Scenario,
    v: Variant,
    redundancies: tuple[int, ...] | None = None,
    microbatches: tuple[int, ...] = MICROBATCHES,
) -> analysis.Plan:
    """The closed-form optimum of `v` (plan.py's search unless narrowed)."""
    return analysis.optimise(
        scenario,
        v.strategy,
        policy=v.policy,
        redundancies=SEARCH.get(v.name, REDUNDANCIES) if redundancies is None else redundancies,
        microbatches=microbatches,
    )


def simulate(
    scenario: Scenario, p: analysis.Plan, settings: Settings, seed: int, layout: str = "cyclic"
) -> sim.Summary:
    """Play plan `p` `settings.replicas` times."""
    return sim.simulate_many(
        scenario,
        p.strategy,
        replicas=settings.replicas,
        seed=settings.seed + seed,
        progress=False,
        redundancy=p.redundancy,
        checkpoint_interval_s=p.checkpoint_interval_s,
        microbatches=p.microbatches,
        policy=p.policy,
        layout=layout,
    )


def run(scenario: Scenario, v: Variant, settings: Settings, seed: int, **search) -> dict:
    """Plan `v` on `scenario`, simulate the plan; one row."""
    p = plan(scenario, v, **search)
    summary = simulate(scenario, p, settings, seed)
    return {
        "gpus": scenario.gpus,
        "name": v.name,
        "label": v.label,
        "redundancy": p.redundancy,
        "microbatches": p.microbatches,
        "checkpoint_interval_s": p.checkpoint_interval_s,
        "closed_form_h": p.estimate.time_to_train_s / HOUR,
        "sim_h": summary.mean["time_to_train_s"] / HOUR,
        "sim_se_h": summary.stderr["time_to_train_s"] / HOUR,
        "sim_overhead": summary.mean["overhead_mean"],
        "sim_availability": summary.mean["availability"],
        "sim_interruptions": summary.mean["interruptions"],
    }


def _ratio_se(a: dict, b: dict) -> float:
    """Standard error of a.sim_h / b.sim_h (independent runs, first order)."""
    q = a["sim_h"] / b["sim_h"]
    return q * math.hypot(a["sim_se_h"] / a["sim_h"], b["sim_se_h"] / b["sim_h"])


def reduction(spare: dict, replication: dict) -> dict:
    """1 - T(SPARe) / T(replication): simulation (with s.e.) and closed form."""
    return {
        "sim_reduction": 1 - spare["sim_h"] / replication["sim_h"],
        "sim_reduction_se": _ratio_se(spare, replication),
        "closed_form_reduction": 1 - spare["closed_form_h"] / replication["closed_form_h"],
    }


# ---------------------------------------------------------------- results


def overhead_rows(settings: Settings) -> list[dict]:
    """Epoch overhead vs r at G = settings.overhead_groups (sim and closed form)."""
    g = settings.overhead_groups
    rows = []
    cases = [("adaptive", 16), ("adaptive", REFERENCE_M), ("adaptive", 1), ("fixed", REFERENCE_M)]
    for r in tqdm.tqdm(REDUNDANCIES, desc="overhead vs r", leave=False):
        w = weights.time_in_state("spare", g, r, 1.0)
        k = np.arange(w.size)
        for policy, m in cases:
            kind = "spare" if r > 1 else "dp"
            integral, length, top = sim.epoch_overhead(
                kind,
                g,
                r,
                m,
                policy=policy,
                trials=settings.overhead_trials,
                seed=settings.seed + r,
            )
            mean, se = sim.ratio_mean(integral, length)
            closed = float(np.dot(w, analysis.overhead(kind, g, r, m, k, policy=policy)) / w.sum())
            rows.append(
                {
                    "strategy": f"spare {policy}",
                    "microbatches": m,
                    "redundancy": r,
                    "sim_mean": mean,
                    "sim_mean_se": se,
                    "sim_worst": float(top.mean()),
                    "closed_form_mean": closed,
                }
            )
        rows.append(
            {
                "strategy": "replication",
                "microbatches": 1,
                "redundancy": r,
                "sim_mean": float(r),
                "sim_mean_se": 0.0,
                "sim_worst": float(r),
                "closed_form_mean": float(r),
            }
        )
    return rows


def endurance_rows(settings: Settings, redundancies: tuple[int, ...]) -> list[dict]:
    """Mean failures to interruption vs G: closed form and simulation."""
    rows = []
    for g in tqdm.tqdm(settings.endurance_groups, desc="endurable failures", leave=False):
        for strategy in ("spare", "replication"):
            for r in redundancies:
                if not _fits(strategy, g, r):
                    continue
                f = sim.failures_to_interruption(
                    strategy, g, r, trials=settings.trials, seed=settings.seed + g + r
                )
                rows.append(
                    {
                        "strategy": strategy,
                        "groups": g,
                        "redundancy": r,
                        "closed_form": analysis.endurable_failures(strategy, g, r),
                        "sim": float(f.mean()),
                        "sim_se": float(f.std(ddof=1) / math.sqrt(f.size)),
                    }
                )
    return rows


def availability_rows(settings: Settings) -> list[dict]:
    """Availability and effective ratio vs r at the largest scale (best m, interval per r)."""
    scenario = _scenario(settings, gpus=settings.gpus[-1])
    rows = []
    for r in tqdm.tqdm(REDUNDANCIES, desc="availability vs r", leave=False):
        for v in (SPARE, REPLICATION):
            if not _fits(v.strategy, scenario.groups, r):
                continue
            if r == 1 and rows:  # checkpoint/restart: one run serves both series
                rows.append(dict(rows[0], strategy=v.strategy))
                continue
            p = plan(scenario, v, redundancies=(r,))
            summary = simulate(scenario, p, settings, seed=100 + r)
            rows.append(
                {
                    "strategy": v.strategy,
                    "redundancy": r,
                    "microbatches": p.microbatches,
                    "checkpoint_interval_s": p.checkpoint_interval_s,
                    "closed_form": p.estimate.availability,
                    "sim": summary.mean["availability"],
                    "sim_se": summary.stderr["availability"],
                    "closed_form_ratio": p.estimate.effective_ratio,
                    "sim_ratio": summary.mean["effective_ratio"],
                }
            )
    return rows


def time_to_train_rows(settings: Settings) -> list[dict]:
    """Every strategy at its optimum (and replication with r >= 2) at each GPU count."""
    rows = []
    for gpus in tqdm.tqdm(settings.gpus, desc="time-to-train vs GPUs", leave=False):
        scenario = _scenario(settings, gpus=gpus)
        rows += [run(scenario, v, settings, seed=gpus) for v in (*VARIANTS, REPLICATION_R2)]
    return rows


def reduction_rows(ttt: list[dict]) -> list[dict]:
    """SPARe adaptive vs replication (optimum over r in 1..8, and r >= 2) per GPU count."""
    rows = []
    for gpus in sorted({x["gpus"] for x in ttt}):
        by = {x["name"]: x for x in ttt if x["gpus"] == gpus}
        spa, rep, rep2 = by[SPARE.name], by[REPLICATION.name], by[REPLICATION_R2.name]
        r2 = reduction(spa, rep2)
        rows.append(
            dict(
                gpus=gpus,
                spare_r=spa["redundancy"],
                spare_m=spa["microbatches"],
                replication_r=rep["redundancy"],
                **reduction(spa, rep),
                sim_reduction_r2=r2["sim_reduction"],
                sim_reduction_r2_se=r2["sim_reduction_se"],
                closed_form_reduction_r2=r2["closed_form_reduction"],
            )
        )
    return rows


# name, Scenario changes, search narrowing (redundancies / microbatches for `plan`)
SENSITIVITY = (
    ("baseline (plan.py's search)", {}, {}),
    (f"m fixed at {REFERENCE_M} (the design's reference)", {}, {"microbatches": (REFERENCE_M,)}),
    ("r at most 6", {}, {"redundancies": tuple(r for r in REDUNDANCIES if r <= 6)}),
    (
        f"r at most 6 and m = {REFERENCE_M}",
        {},
        {"redundancies": tuple(r for r in REDUNDANCIES if r <= 6), "microbatches": (REFERENCE_M,)},
    ),
    ("micro-batches cost 2% each", {"microbatch_overhead": 0.02}, {}),
    ("GPU MTBF x0.5 (25.5k h)", {"gpu_mtbf_hours": 2.55e4}, {}),
    ("GPU MTBF x2 (102k h)", {"gpu_mtbf_hours": 1.02e5}, {}),
    ("restart cost flat (exponent 0)", {"restart_exponent": 0.0}, {}),
    ("restart cost quadratic (exponent 2)", {"restart_exponent": 2.0}, {}),
    ("4 GPUs per group", {"gpus_per_group": 4}, {}),
    ("16 GPUs per group", {"gpus_per_group": 16}, {}),
    ("checkpoint 10 s", {"checkpoint_s": 10.0}, {}),
    ("checkpoint 300 s", {"checkpoint_s": 300.0}, {}),
    ("Weibull failures, shape 0.7", {"failure_law": "weibull"}, {}),
    ("async checkpoint (5 s stall)", {"checkpoint_async": True}, {}),
    ("hot re-join, MTTR 4 h", {"repair": "hot"}, {}),
)


def sensitivity_rows(settings: Settings) -> list[dict]:
    """The reduction at the largest scale under changed parameters or a narrower search."""
    rows = []
    cases = SENSITIVITY[:4] if settings.quick else SENSITIVITY
    for i, (name, changes, search) in enumerate(tqdm.tqdm(cases, desc="sensitivity", leave=False)):
        scenario = _scenario(settings, gpus=settings.gpus[-1], **changes)
        # The baseline reuses time_to_train's seed: its row is the headline's runs.
        seed = scenario.gpus if not (changes or search) else 7_000 + i
        rep = run(scenario, REPLICATION, settings, seed, **search)
        spa = run(scenario, SPARE, settings, seed, **search)
        rows.append(
            dict(
                case=name,
                replication_r=rep["redundancy"],
                spare_r=spa["redundancy"],
                spare_m=spa["microbatches"],
                replication_sim_h=rep["sim_h"],
                spare_sim_h=spa["sim_h"],
                replication_closed_form_h=rep["closed_form_h"],
                spare_closed_form_h=spa["closed_form_h"],
                **reduction(spa, rep),
            )
        )
    return rows


def domain_rows(settings: Settings) -> list[dict]:
    """Whole-rack failures: cyclic vs strided stacking vs replication."""
    scenario = _scenario(
        settings, gpus=settings.gpus[-1], domain_groups=16, domain_failure_fraction=0.05
    )
    rows = []
    cases = (
        ("replication", REPLICATION, "cyclic"),
        ("SPARe adaptive, cyclic", SPARE, "cyclic"),
        ("SPARe adaptive, strided", SPARE, "strided"),
    )
    for i, (label, v, layout) in enumerate(tqdm.tqdm(cases, desc="failure domains", leave=False)):
        p = plan(scenario, v)
        summary = simulate(scenario, p, settings, 9_000 + i, layout)
        rows.append(
            {
                "case": label,
                "redundancy": p.redundancy,
                "microbatches": p.microbatches,
                "checkpoint_interval_s": p.checkpoint_interval_s,
                "closed_form_h": p.estimate.time_to_train_s / HOUR,
                "sim_h": summary.mean["time_to_train_s"] / HOUR,
                "sim_se_h": summary.stderr["time_to_train_s"] / HOUR,
                "sim_interruptions": summary.mean["interruptions"],
            }
        )
    return rows


def headline_groups(
    scenario: Scenario, batch: analysis.Batch, microbatches: tuple[int, ...] = MICROBATCHES
) -> np.ndarray:
    """Groups per m for the headline table: the scenario's without a cap; with one,
    the most (smallest groups, whole base groups, G a multiple of every r compared)
    whose global batch G x m x b fits (0: none)."""
    ms = np.asarray(microbatches, dtype=np.int64)
    if batch.max_global_batch_tokens is None:
        return np.full(ms.shape, scenario.groups, dtype=np.int64)
    limit = batch.max_global_batch_tokens // (ms * batch.microbatch_tokens)
    return analysis.capped_groups(
        scenario.gpus, scenario.gpus_per_group, limit, multiple_of=math.lcm(*EQUAL_R)
    )


def _with_groups(scenario: Scenario, groups: int) -> Scenario:
    return dataclasses.replace(scenario, gpus_per_group=scenario.gpus // int(groups))


def headline_rows(settings: Settings, batch: analysis.Batch) -> list[dict]:
    """Reduction vs replication at the largest scale along m and the framing.

    One row per (m, framing): SPARe adaptive pinned at m, either at its best r
    against replication at its best ("optimum") or both at the same r. With a cap
    (`batch.max_global_batch_tokens`), each m runs on the most groups whose batch
    fits (`headline_groups`), and replication, whose time does not depend on m, on
    the m = 1 layout (the most groups any m allows). Simulations of the same plan
    are shared between rows.
    """
    base = _scenario(settings, gpus=settings.gpus[-1])
    groups = headline_groups(base, batch)
    if groups[0] == 0:
        raise ValueError("no layout fits the cap at m = 1")
    rep_scenario = _with_groups(base, groups[0])
    runs: dict[tuple, dict] = {}

    def measure(scenario: Scenario, p: analysis.Plan) -> dict:
        key = (scenario, p.strategy, p.policy, p.redundancy, p.microbatches)
        if key not in runs:
            summary = simulate(scenario, p, settings, seed=11_000 + len(runs))
            runs[key] = {
                "r": p.redundancy,
                "interval": p.checkpoint_interval_s,
                "closed_form_h": p.estimate.time_to_train_s / HOUR,
                "sim_h": summary.mean["time_to_train_s"] / HOUR,
                "sim_se_h": summary.stderr["time_to_train_s"] / HOUR,
            }
        return runs[key]

    rows = []
    cases = [
        (m, g, f) for m, g in zip(MICROBATCHES, groups.tolist(), strict=True) for f in FRAMINGS
    ]
    desc = "headline, capped" if batch.max_global_batch_tokens else "headline"
    for m, g, framing in tqdm.tqdm(cases, desc=desc, leave=False):
        if g == 0:
            continue  # no layout fits this m under the cap
        scenario = _with_groups(base, g)
        rs = None if framing == OPTIMUM else (int(framing.removeprefix("r=")),)
        spa = measure(scenario, plan(scenario, SPARE, redundancies=rs, microbatches=(m,)))
        rep = measure(rep_scenario, plan(rep_scenario, REPLICATION, redundancies=rs))
        rows.append(
            dict(
                max_global_batch_tokens=batch.max_global_batch_tokens,
                microbatch_tokens=batch.microbatch_tokens,
                microbatches=m,
                framing=framing,
                gpus=scenario.gpus,
                groups=g,
                gpus_per_group=scenario.gpus_per_group,
                base_gpus_per_group=base.gpus_per_group,
                global_batch_sequences=int(batch.global_sequences(g, m)),
                global_batch_tokens=int(batch.global_tokens(g, m)),
                spare_r=spa["r"],
                spare_interval_s=spa["interval"],
                replication_r=rep["r"],
                replication_groups=rep_scenario.groups,
                replication_gpus_per_group=rep_scenario.gpus_per_group,
                spare_closed_form_h=spa["closed_form_h"],
                replication_closed_form_h=rep["closed_form_h"],
                spare_sim_h=spa["sim_h"],
                replication_sim_h=rep["sim_h"],
                **reduction(spa, rep),
            )
        )
    return rows


# Stragglers: a fraction of the groups persistently slowed 3x (a throttled GPU or a bad
# link; our choice, the case benchmarks/stragglers.py measures), random slow sets.
SLOW_SPEED = 1 / 3
SLOW_FRACTIONS = (0.0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
STRAGGLER_R = (2, 4)


def straggler_rows(settings: Settings) -> list[dict]:
    """Time-to-train at the largest scale with a fraction of the groups persistently slow.

    SPARe adaptive at r in `STRAGGLER_R`, m = `REFERENCE_M`, its optimal interval:
    the closed form's time-to-train without stragglers times the step-time factor
    of each response to them, the median over random slow sets (slow groups
    stay slow for the whole run; failures as without them):

    * wait: every step waits for the slowest group, 1 / `SLOW_SPEED`;
    * evict: the slow groups are masked as dead, the adaptive max load / m; a
      draw where some shard has no fast holder cannot run (counted, and the
      factor is missing where any draw cannot);
    * speed-aware: `reorder.makespan` at the groups' speeds / m.
    """
    scenario = _scenario(settings, gpus=settings.gpus[-1])
    groups, m = scenario.groups, REFERENCE_M
    rng = np.random.default_rng(settings.seed + 27)
    draws = 2 if settings.quick else 5
    rows = []
    for r in STRAGGLER_R:
        p = plan(scenario, SPARE, redundancies=(r,), microbatches=(m,))
        base_h = p.estimate.time_to_train_s / HOUR
        placement = strategies.placement("spare", groups, r)
        for fraction in tqdm.tqdm(SLOW_FRACTIONS, desc=f"stragglers r={r}", leave=False):
            slow_groups = round(fraction * groups)
            wait, evict, aware = [], [], []
            for _ in range(draws):
                speeds = np.ones(groups)
                speeds[rng.choice(groups, slow_groups, replace=False)] = SLOW_SPEED
                wait.append(1 / SLOW_SPEED if slow_groups else 1.0)
                try:
                    evict.append(reorder.assign(placement, speeds == 1.0, m).max_load / m)
                except reorder.Interruption:
                    evict.append(math.nan)
                aware.append(reorder.makespan(placement, speeds, m) / m)
            factors = {
                "wait": float(np.median(wait)),
                "evict": float(np.median(evict)) if not np.isnan(evict).any() else math.nan,
                "speed_aware": float(np.median(aware)),
            }
            rows.append(
                {
                    "gpus": scenario.gpus,
                    "groups": groups,
                    "redundancy": r,
                    "microbatches": m,
                    "slow_speed": SLOW_SPEED,
                    "slow_fraction": fraction,
                    "slow_groups": slow_groups,
                    "draws": draws,
                    "evict_cannot_run": float(np.isnan(evict).mean()),
                    "base_h": base_h,
                    **{f"{k}_factor": v for k, v in factors.items()},
                    **{f"{k}_h": base_h * v for k, v in factors.items()},
                }
            )
    return rows


PART_NAMES = (
    "overhead",
    "endurance",
    "availability",
    "time_to_train",
    "reduction",
    "sensitivity",
    "domains",
    "headline",
    "stragglers",
)


def _parts() -> tuple[str, ...]:
    """--parts, checked (`app.UsageError` naming the problem)."""
    names = tuple(PARTS.value) if PARTS.value else PART_NAMES
    unknown = [n for n in names if n not in PART_NAMES]
    if unknown or not names:
        raise app.UsageError(
            f"--parts must list some of {', '.join(PART_NAMES)}; got {','.join(names) or '()'}"
        )
    if "reduction" in names and "time_to_train" not in names:
        raise app.UsageError("--parts=reduction needs time_to_train too")
    return names


def _batches(settings: Settings) -> tuple[analysis.Batch, analysis.Batch]:
    """The headline table's batch without and with the cap (`app.UsageError` if bad)."""
    try:
        free = analysis.Batch(MICROBATCH_TOKENS.value)
        capped = analysis.Batch(MICROBATCH_TOKENS.value, None, MAX_BATCH.value)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    base = _scenario(settings, gpus=settings.gpus[-1])
    if headline_groups(base, capped)[0] == 0:
        raise app.UsageError(
            f"max_global_batch_tokens={MAX_BATCH.value:,} is below one micro-batch per group "
            f"at every layout of {base.gpus:,} GPUs: at least {math.lcm(*EQUAL_R)} groups "
            f"(r up to {max(EQUAL_R)}) x {MICROBATCH_TOKENS.value:,} tokens = "
            f"{math.lcm(*EQUAL_R) * MICROBATCH_TOKENS.value:,} tokens a step"
        )
    return free, capped


def main(argv: list[str]) -> None:
    del argv
    settings = _settings(QUICK.value, REPLICAS.value, SEED.value)
    names = _parts()
    free, capped = _batches(settings)
    out = cli.output_dir("out", OUT.value)
    start = time.time()
    gpus = settings.gpus[-1]
    endurance_r = (2, 3, 4)
    parts: dict[str, list[dict]] = {}
    steps = [
        (
            "overhead",
            overhead_rows,
            lambda rows: _figures.overhead(rows, out, settings.overhead_groups),
        ),
        (
            "endurance",
            lambda s: endurance_rows(s, endurance_r),
            lambda rows: _figures.endurance(rows, out, endurance_r),
        ),
        ("availability", availability_rows, lambda rows: _figures.availability(rows, out, gpus)),
        (
            "time_to_train",
            time_to_train_rows,
            lambda rows: _figures.time_to_train(
                rows, out, [v.label for v in (*VARIANTS, REPLICATION_R2)], settings.work_hours
            ),
        ),
        (
            "reduction",
            lambda s: reduction_rows(parts["time_to_train"]),
            lambda rows: _figures.reduction(rows, out),
        ),
        (
            "sensitivity",
            sensitivity_rows,
            lambda rows: _figures.write_csv(os.path.join(out, "sensitivity.csv"), rows),
        ),
        (
            "domains",
            domain_rows,
            lambda rows: _figures.write_csv(os.path.join(out, "domains.csv"), rows),
        ),
        (
            "headline",
            lambda s: headline_rows(s, free) + headline_rows(s, capped),
            lambda rows: _figures.headline(rows, out, settings.replicas),
        ),
        ("stragglers", straggler_rows, lambda rows: _figures.stragglers(rows, out)),
    ]
    steps = [step for step in steps if step[0] in names]
    for name, compute, draw in tqdm.tqdm(steps, desc="reproduce"):
        parts[name] = compute(settings)
        draw(parts[name])
    minutes = (time.time() - start) / 60
    if len(parts) < len(PART_NAMES):
        print(f"wrote {', '.join(parts)} under {out}/ in {minutes:.1f} min (no summary.md)")
        return
    header = (
        f"Settings: quick={settings.quick}, {settings.replicas} simulated runs per point, "
        f"{settings.work_hours:.0f} h of failure-free work; search r in "
        f"{min(REDUNDANCIES)}..{max(REDUNDANCIES)}, "
        f"m in {{{', '.join(map(str, MICROBATCHES))}}} (SPARe adaptive), "
        f"as experiments/plan.py; micro-batch {free.microbatch_tokens:,} tokens; "
        f"{minutes:.1f} min."
    )
    _figures.summary(out, header, parts, gpus, settings.replicas)
    print(f"wrote {out}/ in {minutes:.1f} min")


if __name__ == "__main__":
    cli.run(main)

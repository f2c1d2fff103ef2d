"""Expected time-to-train per strategy, and the joint optimiser over r, tau and m.

Model (docs/planning.md has the assumptions in full). After each restart all
groups are fresh, so the uptime since the last restart (the age) renews at each
interruption. `renewal.age_model` gives, versus uptime, the expected progress
(rate `E[1/o | k]` averaged over the dead count at each age), overhead and
number of interruptions, for a finite run (a run shorter than the mean time to
interruption M sees only young, little degraded epochs). Checkpoints every
`tau` seconds of running, the rollback to the last completed save at each
interruption (`M - s / (exp(s/M) - 1)` seconds of uptime, exact for Poisson
interruptions, done at the progress rate just before interruptions) and the
restart cost `R(N)` then give the wall time; the interval is optimised
numerically around the Lambert-W optimum of the Poisson model. For
checkpoint/restart (r = 1, exponential) this is exactly the renewal-reward
form `(W / tau) (M + R) (exp((tau + C)/M) - 1)`.

Correlated failure domains (scenario fields `domain_*`): a domain failure of
`domain_groups >= r` consecutive groups interrupts at once (an extra Poisson
source); smaller domains are folded into the per-group failure rate (clustering
ignored: optimistic). Hot re-join uses the stationary occupation of the
birth-death chain (`weights`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable

import numpy as np
from scipy import optimize

from spare_jax import checks, strategies
from spare_jax.analysis import checkpointing, endurance, overhead_model, renewal, weights
from spare_jax.analysis.batch import Batch
from spare_jax.scenario import Scenario

__all__ = [
    "DEFAULT_MICROBATCHES",
    "DEFAULT_REDUNDANCIES",
    "Estimate",
    "Plan",
    "candidate_count",
    "clear_caches",
    "optimise",
    "time_to_train",
]

# The joint optimiser's candidates: redundancy 1..8 and the micro-batch counts
# where they are free (docs/design.md, 9. Time-to-train model).
DEFAULT_REDUNDANCIES: tuple[int, ...] = tuple(range(1, 9))
DEFAULT_MICROBATCHES: tuple[int, ...] = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Closed-form expectations for one strategy and its parameters.

    Attributes:
        time_to_train_s: expected wall time to finish the work.
        availability: uptime / wall time (uptime: wall time not spent restarting).
        effective_ratio: failure-free work / time-to-train.
        overhead_mean: time-weighted mean computation overhead while running.
        interruptions: expected number of interruptions (restarts).
        lost_work_s: expected wall time of running and saving whose progress was
            rolled back (restart time excluded).
        mean_time_to_interruption_s: M, the mean gap between interruptions.
        checkpoint_interval_s: running seconds between two saves.
    """

    time_to_train_s: float
    availability: float
    effective_ratio: float
    overhead_mean: float
    interruptions: float
    lost_work_s: float
    mean_time_to_interruption_s: float
    checkpoint_interval_s: float

    @property
    def time_to_train_days(self) -> float:
        return self.time_to_train_s / 86400.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """The optimiser's choice for one strategy.

    `strategy` and `policy` are as given to `optimise` (the policy matters for
    stacking only); `microbatches` is 1 wherever micro-batches change nothing.
    """

    strategy: str
    policy: str
    redundancy: int
    checkpoint_interval_s: float
    microbatches: int
    estimate: Estimate


def _kind(strategy: str, redundancy: int, policy: str) -> str:
    """The canonical strategy the model evaluates ("dp" whenever r = 1), policy checked."""
    kind = strategies.canonical(strategy)
    strategies.check_policy(policy, exact=True)
    if kind == "dp" and redundancy != 1:
        raise ValueError(f"{strategy} has redundancy 1, got {redundancy}")
    return "dp" if redundancy == 1 else kind


def _check_scenario(scenario: Scenario) -> Scenario:
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    return scenario.validate()


@functools.lru_cache(maxsize=512)
def _epoch(scenario: Scenario, kind: str, policy: str, r: int, m: int) -> renewal.AgeModel:
    """The age model (progress, overhead, interruptions versus uptime) of one strategy."""
    g = scenario.groups
    mtbf = scenario.group_mtbf_s
    nu = 0.0  # extra interruption rate from whole-domain failures
    if scenario.domain_groups > 0 and scenario.domain_failure_fraction > 0:
        if scenario.domain_groups >= r:
            nu = scenario.domain_failure_fraction * g / mtbf
        else:
            mtbf = mtbf / (1.0 + scenario.domain_failure_fraction * scenario.domain_groups)
    n_k = endurance.log_survival_curve(kind, g, r).size
    o, inv = overhead_model.overhead_moments(kind, g, r, m, np.arange(n_k), policy=policy)
    o = np.where(np.isfinite(o), o, float(np.nanmax(o)) if np.any(np.isfinite(o)) else 1.0)
    inv = np.where(np.isfinite(inv), inv, 1.0 / o)
    horizon = scenario.work_hours * 3600.0 * float(o.max()) * 4.0
    if scenario.repair == "hot" and kind != "dp":
        # Hot re-join: stationary occupation of the birth-death chain (exponential law).
        occ = weights.time_in_state(kind, g, r, mtbf, mttr_s=scenario.mttr_hours * 3600.0)
        gap = 1.0 / (1.0 / float(occ.sum()) + nu)
        o, inv = o[: occ.size], inv[: occ.size]
        o_mean = float(np.sum(occ * o) / occ.sum())
        rate = float(np.sum(occ * inv) / occ.sum())
        surv = np.exp(endurance.log_survival_curve(kind, g, r))[: occ.size]
        hazard = occ * (g - np.arange(occ.size)) * (1.0 - np.append(surv[1:] / surv[:-1], 0.0))
        rate_end = float(np.sum(hazard * inv) / hazard.sum())
        t = np.array([0.0, 1.0])
        return renewal.AgeModel(t, t * rate, t * o_mean, t / gap, gap, rate, o_mean, rate_end)
    return renewal.age_model(
        kind,
        g,
        r,
        mtbf,
        o,
        horizon_s=horizon,
        law=scenario.failure_law,
        weibull_shape=scenario.weibull_shape,
        extra_rate=nu,
        inverse=inv,
    )


def _wall(
    model: renewal.AgeModel, work: float, tau: float, c_block: float, extra: float, restart: float
) -> tuple[float, float, float, float]:
    """(wall, uptime, interruptions, lost uptime) to finish `work` seconds of progress.

    Uptime U solves (progress(U) - N(U) (l + extra) rate_end) tau / s = work: a
    fraction tau / s of the uptime computes; each interruption rolls back the
    l + extra seconds since the last completed save, done at the progress rate
    just before interruptions. l = M - s / (exp(s/M) - 1) is the expected uptime
    since the last save at an interruption (exact for Poisson interruptions).
    """
    gap = model.mean_gap
    s = tau + c_block
    x = s / gap
    if x > 700.0:
        return math.inf, math.inf, math.inf, math.inf
    lost = gap - s / np.expm1(x) if x > 1e-9 else 0.5 * s
    per = lost + extra

    def short(u: float) -> float:
        prog, _, n = model.at(u)
        return (prog - n * per * model.rate_at_interruption) * tau / s - work

    hi = max(work * s / tau, 1.0)
    for _ in range(200):
        if short(hi) >= 0.0:
            break
        hi *= 2.0
    else:
        return math.inf, math.inf, math.inf, math.inf
    u = float(optimize.brentq(short, 0.0, hi, xtol=1e-9, rtol=1e-13))
    n = model.at(u)[2]
    return u + n * restart, u, n, n * per


def time_to_train(
    scenario: Scenario,
    strategy: str,
    *,
    redundancy: int = 1,
    checkpoint_interval_s: float | None = None,
    microbatches: int = 8,
    policy: str = "adaptive",
) -> Estimate:
    """Expected time-to-train and its companions for one strategy.

    Args:
        scenario: the cluster, failure law and costs.
        strategy: a strategy name of `spare_jax.strategies` ("dp", alias
            "checkpoint_restart", has r = 1; "replication"; "spare").
        redundancy: r.
        checkpoint_interval_s: running seconds between saves (inf: never); None
            picks the model's optimum (numerical, started from the Lambert-W
            optimum `checkpointing.exact_optimum` for Poisson interruptions).
        microbatches: m per shard (SPARe adaptive; ignored by the other strategies).
        policy: "adaptive" or "fixed" (SPARe only).

    Returns:
        An `Estimate`.

    Raises:
        ValueError: naming a bad argument.
    """
    _check_scenario(scenario)
    r = checks.integer("redundancy", redundancy, low=1)
    m = checks.integer("microbatches", microbatches, low=1)
    kind = _kind(strategy, r, policy)
    endurance.check(kind, scenario.groups, r)
    if checkpoint_interval_s is not None:
        checks.number(
            "checkpoint_interval_s", checkpoint_interval_s, low=0.0, low_open=True, allow_inf=True
        )
    m = m if (kind == "spare" and policy == "adaptive") else 1
    overhead_model.check_size(kind, r, m, policy)
    model = _epoch(scenario, kind, policy, r, m)
    work = scenario.work_hours * 3600.0 * (1.0 + scenario.microbatch_overhead * (m - 1))
    c_block = (
        scenario.checkpoint_async_stall_s if scenario.checkpoint_async else scenario.checkpoint_s
    )
    extra = scenario.checkpoint_s if scenario.checkpoint_async else 0.0  # in-flight save lost
    restart = scenario.restart_seconds()
    if checkpoint_interval_s is None:
        tau = _best_interval(model, work, c_block, extra, restart)
    else:
        tau = float(checkpoint_interval_s)
    wall, up, n_int, lost = _wall(model, work, tau, c_block, extra, restart)
    if not math.isfinite(wall):
        return Estimate(
            math.inf, 0.0, 0.0, model.rate_overhead, math.inf, math.inf, model.mean_gap, tau
        )
    return Estimate(
        time_to_train_s=wall,
        availability=up / wall,
        effective_ratio=scenario.work_hours * 3600.0 / wall,
        overhead_mean=model.at(up)[1] / up,
        interruptions=n_int,
        lost_work_s=lost,
        mean_time_to_interruption_s=model.mean_gap,
        checkpoint_interval_s=tau,
    )


def _best_interval(
    model: renewal.AgeModel, work: float, c_block: float, extra: float, restart: float
) -> float:
    """Interval minimising the wall time: bounded search around the Poisson optimum."""
    if c_block == 0.0:
        return 1e-3 * model.mean_gap  # free saves: checkpoint (almost) continuously
    guess = checkpointing.exact_optimum(c_block, model.mean_gap)

    def cost(log_tau: float) -> float:
        return _wall(model, work, math.exp(log_tau), c_block, extra, restart)[0]

    res = optimize.minimize_scalar(
        cost,
        bounds=(math.log(guess) - 3.0, math.log(guess) + 3.0),
        method="bounded",
        options={"xatol": 1e-3},
    )
    best = math.exp(res.x) if cost(res.x) <= cost(math.log(guess)) else guess
    return float(best)


def _candidates(
    scenario: Scenario,
    strategy: str,
    policy: str,
    redundancies: Iterable[int],
    microbatches: Iterable[int],
    batch: Batch | None = None,
) -> list[tuple[int, int]]:
    """The (r, m) pairs `optimise` evaluates, every candidate checked first.

    r > G, and r not dividing G for replication, are skipped; so is an m whose
    global batch `G * m * b` exceeds `batch`'s cap. Any other bad candidate, a
    cap below one micro-batch per group, or a cap no listed m fits raises
    ValueError before anything is computed.
    """
    _check_scenario(scenario)
    kind = strategies.canonical(strategy)
    strategies.check_policy(policy, exact=True)
    rs = [checks.integer("redundancies", r, low=1) for r in redundancies]
    ms = [checks.integer("microbatches", m, low=1) for m in microbatches]
    if not rs or not ms:
        raise ValueError("redundancies and microbatches must each list at least one value")
    g = scenario.groups
    if batch is not None:
        if not isinstance(batch, Batch):
            raise ValueError(f"batch must be a Batch, got {type(batch).__name__}")
        batch.check_groups(g)
        fit = batch.fits(g, ms)
        if kind == "spare" and policy == "adaptive" and not fit.any():
            raise ValueError(
                f"no micro-batch count in {ms} fits max_global_batch_tokens="
                f"{batch.max_global_batch_tokens:,} at {g:,} groups and "
                f"{batch.microbatch_tokens:,} tokens a micro-batch "
                f"(m <= {batch.max_microbatches(g)})"
            )
        ms = [m for m, ok in zip(ms, fit.tolist(), strict=True) if ok]
    if kind == "dp":
        return [(1, 1)]
    out = []
    for r in rs:
        if r > g or (kind == "replication" and g % r):
            continue
        endurance.check(kind, g, r)
        for m in ms if (kind == "spare" and policy == "adaptive" and r > 1) else (1,):
            overhead_model.check_size(kind, r, m, policy)
            out.append((r, m))
    return out


def optimise(
    scenario: Scenario,
    strategy: str,
    *,
    policy: str = "adaptive",
    redundancies: Iterable[int] = DEFAULT_REDUNDANCIES,
    microbatches: Iterable[int] = DEFAULT_MICROBATCHES,
    progress: Callable[[], object] | None = None,
    batch: Batch | None = None,
) -> Plan:
    """Minimise expected time-to-train over redundancy, checkpoint interval and m.

    The interval is optimal in closed form for each (r, m); r and m are searched
    exhaustively (a handful of values; each evaluation is cached per scenario).
    Micro-batches are free only for SPARe adaptive (their fixed per-micro-batch
    cost is `scenario.microbatch_overhead`); the others report m = 1.

    Args:
        scenario: the scenario.
        strategy: a strategy name of `spare_jax.strategies`.
        policy: "adaptive" or "fixed" (SPARe).
        redundancies: candidate r values, integers >= 1 (r > G, or r not
            dividing G for replication, are skipped).
        microbatches: candidate m values, integers >= 1 (SPARe adaptive).
        progress: optional callable invoked once per candidate (e.g. a tqdm update).
        batch: the micro-batch size and a cap on the global batch `G * m * b`
            (`analysis.Batch`); the search keeps to m whose batch fits. None:
            no cap.

    Returns:
        The best `Plan`.

    Raises:
        ValueError: a bad argument or candidate, a cap below one micro-batch per
            group, or no feasible candidate.
    """
    redundancies, microbatches = tuple(redundancies), tuple(microbatches)
    candidates = _candidates(scenario, strategy, policy, redundancies, microbatches, batch)
    best: Plan | None = None
    for r, m in candidates:
        est = time_to_train(scenario, strategy, redundancy=r, microbatches=m, policy=policy)
        if progress is not None:
            progress()
        if best is None or est.time_to_train_s < best.estimate.time_to_train_s:
            best = Plan(strategy, policy, r, est.checkpoint_interval_s, m, est)
    if best is None:
        raise ValueError(
            f"no feasible redundancy for {strategy} among {list(redundancies)} "
            f"at G={scenario.groups}"
        )
    return best


def candidate_count(
    scenario: Scenario,
    strategy: str,
    *,
    policy: str = "adaptive",
    redundancies: Iterable[int] = DEFAULT_REDUNDANCIES,
    microbatches: Iterable[int] = DEFAULT_MICROBATCHES,
    batch: Batch | None = None,
) -> int:
    """Number of (r, m) evaluations `optimise` will make (for progress bars).

    Checks every candidate as `optimise` does, so a caller can refuse a bad
    search before any work.
    """
    return len(_candidates(scenario, strategy, policy, redundancies, microbatches, batch))


def clear_caches() -> None:
    """Forget every cached table (survival curves, overhead tables, age models)."""
    endurance._curve.cache_clear()
    overhead_model._adaptive_table.cache_clear()
    renewal._band.cache_clear()
    _epoch.cache_clear()

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

import numpy as np
from scipy import optimize

from spare_jax.analysis import checkpointing, endurance, overhead_model, renewal, weights
from spare_jax.scenario import Scenario

__all__ = ["TTT_STRATEGIES", "Estimate", "Plan", "optimise", "time_to_train"]

TTT_STRATEGIES = ("checkpoint_restart", "replication", "spare")

# The joint optimiser's candidates (issue 4: "over redundancy (1..8), checkpoint
# interval, and micro-batches where free").
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
    """The optimiser's choice for one strategy (policy is "replication"/"dp" for the baselines)."""

    strategy: str
    policy: str
    redundancy: int
    checkpoint_interval_s: float
    microbatches: int
    estimate: Estimate


def _strategy(strategy: str, redundancy: int, policy: str) -> tuple[str, str]:
    if strategy not in TTT_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(TTT_STRATEGIES)}, got {strategy!r}")
    if strategy == "checkpoint_restart":
        if redundancy != 1:
            raise ValueError(f"checkpoint_restart has redundancy 1, got {redundancy}")
        return "dp", "dp"
    if strategy == "replication":
        return ("dp", "dp") if redundancy == 1 else ("replication", "replication")
    if policy not in ("adaptive", "fixed"):
        raise ValueError(f"policy must be 'adaptive' or 'fixed', got {policy!r}")
    return ("dp", "dp") if redundancy == 1 else ("spare", policy)


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
    o, inv = overhead_model.overhead_moments(policy, g, r, m, np.arange(n_k))
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

    def done(u: float) -> float:
        prog, _, n = model.at(u)
        return (prog - n * per * model.rate_at_interruption) * tau / s

    hi = max(work * s / tau, 1.0)
    for _ in range(200):
        if done(hi) >= work:
            break
        hi *= 2.0
    else:
        return math.inf, math.inf, math.inf, math.inf
    lo = 0.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if done(mid) >= work:
            hi = mid
        else:
            lo = mid
        if hi - lo < 1e-9 * hi:
            break
    u = hi
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
        scenario: the cluster, failure law and costs (validated here).
        strategy: "checkpoint_restart" (r = 1), "replication" or "spare".
        redundancy: r.
        checkpoint_interval_s: running seconds between saves; None picks the
            model's optimum (numerical, started from the Lambert-W optimum
            `checkpointing.exact_optimum` for Poisson interruptions).
        microbatches: m per shard (SPARe adaptive; ignored by the other strategies).
        policy: "adaptive" or "fixed" (SPARe only).

    Returns:
        An `Estimate`.
    """
    scenario.validate()
    if (
        isinstance(redundancy, bool)
        or not isinstance(redundancy, (int, np.integer))
        or redundancy < 1
    ):
        raise ValueError(f"redundancy must be a positive integer, got {redundancy!r}")
    if (
        isinstance(microbatches, bool)
        or not isinstance(microbatches, (int, np.integer))
        or microbatches < 1
    ):
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    kind, pol = _strategy(strategy, int(redundancy), policy)
    r, g = int(redundancy), scenario.groups
    if r > g:
        raise ValueError(f"redundancy r={r} must not exceed groups G={g}")
    if kind == "replication" and g % r:
        raise ValueError(f"replication needs G divisible by r: G={g}, r={r}")
    m = int(microbatches) if pol == "adaptive" else 1
    model = _epoch(scenario, kind, pol, r, m)
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
        if not tau > 0:
            raise ValueError(f"checkpoint_interval_s must be > 0, got {checkpoint_interval_s!r}")
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
    cost = lambda log_tau: _wall(model, work, math.exp(log_tau), c_block, extra, restart)[0]
    res = optimize.minimize_scalar(
        cost,
        bounds=(math.log(guess) - 3.0, math.log(guess) + 3.0),
        method="bounded",
        options={"xatol": 1e-3},
    )
    best = math.exp(res.x) if cost(res.x) <= cost(math.log(guess)) else guess
    return float(best)


def _candidates(scenario: Scenario, strategy: str, policy: str, redundancies, microbatches):
    g = scenario.groups
    if strategy == "checkpoint_restart":
        yield 1, 1
        return
    for r in redundancies:
        r = int(r)
        if r < 1 or r > g or (strategy == "replication" and g % r):
            continue
        ms = microbatches if (strategy == "spare" and policy == "adaptive" and r > 1) else (1,)
        for m in ms:
            yield r, int(m)


def optimise(
    scenario: Scenario,
    strategy: str,
    *,
    policy: str = "adaptive",
    redundancies=DEFAULT_REDUNDANCIES,
    microbatches=DEFAULT_MICROBATCHES,
    progress=None,
) -> Plan:
    """Minimise expected time-to-train over redundancy, checkpoint interval and m.

    The interval is optimal in closed form for each (r, m); r and m are searched
    exhaustively (a handful of values; each evaluation is cached per scenario).
    Micro-batches are free only for SPARe adaptive (their fixed per-micro-batch
    cost is `scenario.microbatch_overhead`); the others report m = 1.

    Args:
        scenario: the scenario.
        strategy: "checkpoint_restart", "replication" or "spare".
        policy: "adaptive" or "fixed" (SPARe).
        redundancies: candidate r values (r > G, or r not dividing G for
            replication, are skipped).
        microbatches: candidate m values (SPARe adaptive).
        progress: optional callable invoked once per candidate (e.g. a tqdm update).

    Returns:
        The best `Plan`.
    """
    _strategy(strategy, 1, policy)
    best: Plan | None = None
    for r, m in _candidates(scenario, strategy, policy, tuple(redundancies), tuple(microbatches)):
        est = time_to_train(scenario, strategy, redundancy=r, microbatches=m, policy=policy)
        if progress is not None:
            progress()
        if best is None or est.time_to_train_s < best.estimate.time_to_train_s:
            pol = (
                policy
                if strategy == "spare"
                else ("dp" if strategy == "checkpoint_restart" else "replication")
            )
            best = Plan(strategy, pol, r, est.checkpoint_interval_s, m, est)
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
    redundancies=DEFAULT_REDUNDANCIES,
    microbatches=DEFAULT_MICROBATCHES,
) -> int:
    """Number of (r, m) evaluations `optimise` will make (for progress bars)."""
    return sum(
        1 for _ in _candidates(scenario, strategy, policy, tuple(redundancies), tuple(microbatches))
    )

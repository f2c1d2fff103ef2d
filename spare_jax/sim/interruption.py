"""Monte Carlo failures and time to the first interruption, without repair.

These are the simulation counterparts of `analysis.endurable_failures` and
`analysis.mean_time_to_interruption`. Each trial draws every group's death
value at once and applies `failures.interruption_threshold` (min over shards of
the max over holders); trials are processed in chunks of bounded memory.
"""

from __future__ import annotations

import math

import numpy as np

from spare_jax import checks, strategies
from spare_jax.analysis.endurance import CONVENTIONS
from spare_jax.placement import Placement
from spare_jax.scenario import FAILURE_LAWS, WEIBULL_SHAPES
from spare_jax.sim.failures import RandomFailures, draw_lifetimes, interruption_threshold
from spare_jax.sim.overheads import Overheads

__all__ = ["epoch_overhead", "failures_to_interruption", "ratio_mean", "time_to_interruption"]

_CHUNK_ELEMENTS = 2_000_000
# Per-trial arrays hold G numbers; 10^7 groups is 80 MB a row (chunks bound the rest).
_MAX_GROUPS = 10_000_000


def _chunks(trials: int, width: int) -> list[int]:
    size = max(1, _CHUNK_ELEMENTS // max(width, 1))
    return [min(size, trials - start) for start in range(0, trials, size)]


def _setup(strategy: str, groups: int, redundancy: int, trials: int, seed: int) -> Placement:
    """The placement of a Monte Carlo run, every argument checked."""
    groups = checks.integer("groups", groups, low=1)
    if groups > _MAX_GROUPS:
        raise ValueError(
            f"groups must be <= {_MAX_GROUPS:,} (every trial holds G numbers), got {groups:,}"
        )
    checks.integer("trials", trials, low=1)
    checks.integer("seed", seed, low=0)
    return strategies.placement(strategy, groups, redundancy)


def _check_law(law: str, weibull_shape: float) -> None:
    checks.choice("law", law, FAILURE_LAWS)
    checks.number("weibull_shape", weibull_shape, low=WEIBULL_SHAPES[0], high=WEIBULL_SHAPES[1])


def failures_to_interruption(
    strategy: str,
    groups: int,
    redundancy: int,
    *,
    trials: int,
    seed: int = 0,
    convention: str = "live",
) -> np.ndarray:
    """Number of failures up to and including the one that interrupts the run.

    No repair: dead groups stay dead. The count F of a trial is the index of the
    interrupting failure, so P(F > f) = P(no interruption after f failures) and
    E[F] = sum over f >= 0 of P(no interruption after f failures): the
    quantity docs/design.md (6. Endurable failures) and
    `analysis.endurable_failures` call the endurable failures (G=60, r=2
    stacking: 7.372).

    Args:
        strategy: a strategy name of `spare_jax.strategies` ("spare": cyclic stacking).
        groups: G.
        redundancy: r (1 for "dp"; G divisible by r for "replication").
        trials: number of independent trials.
        seed: seed of the random generator.
        convention: "live": each failure strikes a uniformly random live group
            (the death order is a uniform random permutation, drawn as the
            ranks of iid uniforms). "any": each failure strikes a uniformly
            random group among all G, possibly one already dead (then nothing
            changes but the failure still counts), as in Casanova et al. 2012;
            between the i-th and (i+1)-th death the failures are geometric with
            success probability (G - i) / G.

    Returns:
        int64 [trials] failures to interruption.
    """
    checks.choice("convention", convention, CONVENTIONS)
    p = _setup(strategy, groups, redundancy, trials, seed)
    rng = np.random.default_rng(seed)
    out = []
    for size in _chunks(trials, groups):
        u = rng.random((size, groups))
        threshold = interruption_threshold(p, u)
        out.append(np.count_nonzero(u <= threshold[:, None], axis=1))
    deaths = np.concatenate(out).astype(np.int64)
    if convention == "live":
        return deaths
    return _any_convention(rng, deaths, groups)


def _any_convention(rng: np.random.Generator, deaths: np.ndarray, groups: int) -> np.ndarray:
    """Failures (dead groups included) needed to see `deaths` distinct groups die."""
    top = int(deaths.max())
    success = (groups - np.arange(top)) / groups
    out = np.empty_like(deaths)
    start = 0
    for size in _chunks(deaths.size, top):
        draws = rng.geometric(success, size=(size, top))
        keep = np.arange(top)[None, :] < deaths[start : start + size, None]
        out[start : start + size] = np.where(keep, draws, 0).sum(axis=1)
        start += size
    return out


def time_to_interruption(
    strategy: str,
    groups: int,
    redundancy: int,
    group_mtbf_s: float,
    *,
    trials: int,
    seed: int = 0,
    law: str = "exponential",
    weibull_shape: float = 0.7,
) -> np.ndarray:
    """Seconds until the first interruption, every group starting new, no repair.

    Each group's time to failure is exponential or Weibull with mean
    `group_mtbf_s`; the interruption time is the min over shards of the max
    failure time of the shard's holders (no event loop).

    Args:
        strategy: a strategy name of `spare_jax.strategies`.
        groups: G.
        redundancy: r.
        group_mtbf_s: mean time to failure of one group, seconds.
        trials: number of independent trials.
        seed: seed of the random generator.
        law: "exponential" or "weibull".
        weibull_shape: Weibull shape parameter (law "weibull").

    Returns:
        float [trials] times to interruption, seconds.
    """
    checks.number("group_mtbf_s", group_mtbf_s, low=0.0, low_open=True)
    _check_law(law, weibull_shape)
    p = _setup(strategy, groups, redundancy, trials, seed)
    rng = np.random.default_rng(seed)
    out = []
    for size in _chunks(trials, groups):
        life = draw_lifetimes(rng, law, group_mtbf_s, weibull_shape, (size, groups))
        out.append(interruption_threshold(p, life))
    return np.concatenate(out)


def epoch_overhead(
    strategy: str,
    groups: int,
    redundancy: int,
    microbatches: int = 8,
    *,
    policy: str = "adaptive",
    trials: int,
    seed: int = 0,
    law: str = "exponential",
    weibull_shape: float = 0.7,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Computation overhead over epochs, each from a fresh start to the first interruption.

    Group lifetimes are iid (mean 1: the time scale cancels); after each failure
    the overhead is recomputed from the live set (`incremental.LoadTracker`:
    exact optimal max load for stacking, fixed order with policy "fixed", r for
    replication, 1 for data parallelism). The time-weighted mean overhead while
    running, as a renewal-reward average, is `integral.sum() / length.sum()`
    (a ratio of sums, not the mean of per-epoch ratios).

    Returns:
        (integral of the overhead over the epoch, epoch length, worst overhead),
        float [trials] each.
    """
    p = _setup(strategy, groups, redundancy, trials, seed)
    microbatches = checks.integer("microbatches", microbatches, low=1, high=2**31 - 1)
    strategies.check_policy(policy, exact=True)
    _check_law(law, weibull_shape)
    rng = np.random.default_rng(seed)
    tracker = Overheads(p, microbatches, policy)
    integral, length, top = np.empty(trials), np.empty(trials), np.empty(trials)
    for i in range(trials):
        seg = RandomFailures(p, 1.0, law=law, weibull_shape=weibull_shape, rng=rng).segment(
            0.0, math.inf
        )
        count = seg.event_times.size - 1
        over = tracker.after_events(seg, count)
        bounds = np.concatenate([[0.0], seg.event_times])
        integral[i] = np.dot(np.diff(bounds), over)
        length[i] = seg.interruption
        top[i] = over.max()
    return integral, length, top


def ratio_mean(numerator: np.ndarray, denominator: np.ndarray) -> tuple[float, float]:
    """Ratio-of-sums estimate and its delta-method standard error.

    Args:
        numerator: float [n], n >= 1.
        denominator: float [n], the same shape, with a non-zero sum.
    """
    numerator, denominator = np.asarray(numerator, float), np.asarray(denominator, float)
    if numerator.ndim != 1 or numerator.shape != denominator.shape or numerator.size == 0:
        raise ValueError(
            f"numerator and denominator must be non-empty 1-D arrays of one shape, got "
            f"{numerator.shape} and {denominator.shape}"
        )
    n = numerator.size
    ratio = float(numerator.sum() / denominator.sum())
    resid = numerator - ratio * denominator
    se = float(np.sqrt(np.sum(resid**2) / max(n - 1, 1) / n) / denominator.mean())
    return ratio, se

"""Finite-horizon renewal model of a run: progress and interruptions versus uptime.

Every restart replaces the failed groups, so the *age* (uptime since the last
restart) renews at each interruption; checkpoints do not reset it. At age a,
with no interruption yet, the dead count K(a) is Binomial(G, F(a)) restricted
to the good dead sets (F the group failure CDF; the failure order is a uniform
permutation independent of the sorted times), so

    S_X(a)   = P(epoch longer than a)  = sum_k Bin(k; G, F(a)) P(k),
    psi_f(a) = E[f(K(a)); X > a]       = sum_k Bin(k; G, F(a)) P(k) f(k),

with P(k) the survival after k failures (`endurance`). For any per-age reward
(progress rate 1/o, overhead o, or 1 for the interruption count) the expected
total over uptime T solves the renewal equation

    m(T) = int_0^T psi(a) da + int_0^T m(T - s) dF_X(s),    F_X = 1 - S_X,

solved on a grid of `n` ages (trapezoid in the convolution), and continued
linearly with the stationary rates (renewal theorem) beyond ~30 mean epochs.
A run much shorter than the mean time to interruption thus mostly sees young,
little-degraded epochs, which the stationary (renewal-reward) average misses.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from scipy import integrate, special

from spare_jax import checks
from spare_jax.analysis import endurance
from spare_jax.scenario import FAILURE_LAWS, weibull_scale

__all__ = ["AgeModel", "age_model"]


@dataclasses.dataclass(frozen=True)
class AgeModel:
    """Cumulative expectations on an uptime grid `t` (seconds).

    Attributes:
        t: uptime grid, t[0] = 0.
        progress: E[integral of 1/o over uptime] (work seconds done, ignoring rollbacks).
        overhead: E[integral of o over uptime].
        interruptions: renewal function, E[number of interruptions by uptime t].
        mean_gap: M, the mean epoch length.
        rate_progress: stationary progress per uptime second (for t beyond the grid).
        rate_overhead: stationary mean overhead (for t beyond the grid).
        rate_at_interruption: mean progress rate just before an interruption (the
            rate at which the work rolled back had been done).
    """

    t: np.ndarray
    progress: np.ndarray
    overhead: np.ndarray
    interruptions: np.ndarray
    mean_gap: float
    rate_progress: float
    rate_overhead: float
    rate_at_interruption: float

    def at(self, uptime: float) -> tuple[float, float, float]:
        """(progress, overhead integral, interruptions) at `uptime`, extrapolated linearly."""
        if not uptime >= 0.0:
            raise ValueError(f"uptime must be >= 0, got {uptime!r}")
        end = self.t[-1]
        if uptime <= end:
            return (
                float(np.interp(uptime, self.t, self.progress)),
                float(np.interp(uptime, self.t, self.overhead)),
                float(np.interp(uptime, self.t, self.interruptions)),
            )
        extra = uptime - end
        return (
            float(self.progress[-1] + extra * self.rate_progress),
            float(self.overhead[-1] + extra * self.rate_overhead),
            float(self.interruptions[-1] + extra / self.mean_gap),
        )


def _cdf(law: str, mean: float, shape: float, a: np.ndarray) -> np.ndarray:
    if law == "exponential":
        return -np.expm1(-a / mean)
    return -np.expm1(-((a / weibull_scale(mean, shape)) ** shape))


def _inverse_cdf(law: str, mean: float, shape: float, u: float) -> float:
    y = -math.log1p(-min(u, 1.0 - 1e-16))
    if law == "exponential":
        return mean * y
    return weibull_scale(mean, shape) * y ** (1.0 / shape)


@functools.lru_cache(maxsize=8)
def _band(
    kind: str,
    groups: int,
    redundancy: int,
    group_mtbf_s: float,
    law: str,
    shape: float,
    extra_rate: float,
    n_ages: int,
) -> tuple[np.ndarray, list[tuple[slice, np.ndarray, np.ndarray]]]:
    """Ages, and per chunk of ages the weights Bin(k; G, F(a)) P(k) e^(-extra a) with their k.

    The ages stop where G F(a) passes the end of the survival curve (P < 1e-30 beyond).
    The binomial log-pmf is built from one table of log C(G, k) shared by every
    chunk: `scipy.stats.binom.logpmf` recomputes three gammaln values per
    (age, k) pair and makes a cold optimisation about 15% slower.
    """
    surv = np.exp(endurance.log_survival_curve(kind, groups, redundancy))
    n_k = surv.size
    idx = np.arange(n_k)
    log_choose = (
        special.gammaln(groups + 1) - special.gammaln(idx + 1) - special.gammaln(groups - idx + 1)
    )
    reach = (n_k + 6.0 * math.sqrt(n_k) + 6.0) / groups
    a_end = _inverse_cdf(law, group_mtbf_s, shape, reach)
    if extra_rate > 0:  # whole-domain failures end epochs sooner: resolve their e^(-nu a) decay
        a_end = min(a_end, 40.0 / extra_rate)
    if reach > 0.5:
        # Few groups: the bound above nears or passes F = 1 and stretches the grid
        # over dozens of MTBFs, far beyond any epoch. Stop where the epoch
        # survival S_X(a) falls below 1e-13 instead, so the grid resolves epochs.
        probe = np.geomspace(a_end * 1e-4, a_end, 400)
        q = np.clip(_cdf(law, group_mtbf_s, shape, probe), 1e-300, 1.0 - 1e-16)[:, None]
        log_pmf = log_choose + idx * np.log(q) + (groups - idx) * np.log1p(-q)
        s_x = np.exp(log_pmf) @ surv * np.exp(-extra_rate * probe)
        below = np.flatnonzero(s_x < 1e-13)
        if below.size:
            a_end = float(probe[below[0]])
    ages = np.linspace(0.0, a_end, n_ages)
    q = _cdf(law, group_mtbf_s, shape, ages)
    chunks = []
    for lo in range(0, n_ages, 50):
        sl = slice(lo, min(lo + 50, n_ages))
        qc = q[sl]
        mean = groups * qc
        half = int(8.0 * math.sqrt(max(float(mean.max()), 1.0)) + 20)
        start = np.clip(np.floor(mean).astype(np.int64) - half, 0, max(n_k - 1, 0))
        k = start[:, None] + np.arange(2 * half + 1)[None, :]
        inside = k < n_k
        kk = np.where(inside, k, 0)
        qq = np.clip(qc, 1e-300, 1.0 - 1e-16)[:, None]
        log_pmf = log_choose[kk] + kk * np.log(qq) + (groups - kk) * np.log1p(-qq)
        w = (
            np.where(inside, np.exp(log_pmf) * surv[kk], 0.0)
            * np.exp(-extra_rate * ages[sl])[:, None]
        )
        zero = qc == 0.0
        w[zero] = 0.0
        w[zero, 0] = surv[0]
        chunks.append((sl, kk, w))
    return ages, chunks


def _fit(values: np.ndarray, size: int) -> np.ndarray:
    """Truncate or pad (with the last value) to `size`."""
    values = values[:size]
    return (
        np.concatenate([values, np.full(size - values.size, values[-1])])
        if values.size < size
        else values
    )


def _renewal(psi_cum: np.ndarray, d_f: np.ndarray) -> np.ndarray:
    """Solve m_i = Psi_i + sum_j dF_j (m_{i-j} + m_{i-j+1}) / 2 on the grid."""
    n = psi_cum.size
    m = np.zeros(n)
    m[0] = psi_cum[0]
    half = 0.5 * d_f
    for i in range(1, n):
        j = np.arange(2, i + 1)
        s = psi_cum[i] + half[1] * m[i - 1]
        if i >= 2:
            s += np.dot(half[j], m[i - j] + m[i - j + 1])
        m[i] = s / (1.0 - half[1])
    return m


def age_model(
    kind: str,
    groups: int,
    redundancy: int,
    group_mtbf_s: float,
    overhead: np.ndarray,
    *,
    horizon_s: float,
    law: str = "exponential",
    weibull_shape: float = 1.0,
    extra_rate: float = 0.0,
    points: int = 400,
    inverse: np.ndarray | None = None,
) -> AgeModel:
    """Build the `AgeModel` for one strategy.

    Args:
        kind: a strategy name of `spare_jax.strategies`.
        groups: G.
        redundancy: r.
        group_mtbf_s: mean time to failure of one group.
        overhead: o(k) for k = 0 .. (length of the survival curve) - 1.
        horizon_s: the largest uptime of interest (the grid covers
            min(horizon, 30 M); beyond it the model continues linearly).
        law: "exponential" or "weibull".
        weibull_shape: Weibull shape.
        extra_rate: an extra Poisson interruption rate (whole-domain failures).
        points: grid size.
        inverse: E[1/o | k] (the progress rate; default 1 / overhead).
    """
    kind, groups, redundancy = endurance.check(kind, groups, redundancy)
    checks.number("group_mtbf_s", group_mtbf_s, low=0.0, low_open=True)
    checks.number("horizon_s", horizon_s, low=0.0, low_open=True, allow_inf=True)
    checks.choice("law", law, FAILURE_LAWS)
    checks.number("extra_rate", extra_rate, low=0.0)
    points = checks.integer("points", points, low=2, high=100_000)
    surv = np.exp(endurance.log_survival_curve(kind, groups, redundancy))
    o = _fit(np.asarray(overhead, dtype=float), surv.size)
    inv = 1.0 / o if inverse is None else _fit(np.asarray(inverse, dtype=float), surv.size)
    if kind == "dp" and law == "exponential":  # exactly Poisson: closed form
        gap = 1.0 / (groups / group_mtbf_s + extra_rate)
        t = np.array([0.0, 1.0])
        return AgeModel(t, t * inv[0], t * o[0], t / gap, gap, inv[0], o[0], inv[0])
    ages, chunks = _band(
        kind,
        groups,
        redundancy,
        float(group_mtbf_s),
        law,
        float(weibull_shape),
        float(extra_rate),
        2 * points + 1,
    )
    s_x, psi_r, psi_o = (np.zeros(ages.size) for _ in range(3))
    for sl, kk, w in chunks:
        s_x[sl] = w.sum(axis=1)
        psi_r[sl] = np.sum(w * inv[kk], axis=1)
        psi_o[sl] = np.sum(w * o[kk], axis=1)
    da = ages[1] - ages[0]

    def trap(y: np.ndarray) -> np.ndarray:
        return integrate.cumulative_trapezoid(y, dx=da, initial=0.0)

    gap = float(trap(s_x)[-1])
    rate_r = float(trap(psi_r)[-1]) / gap
    rate_o = float(trap(psi_o)[-1]) / gap
    # Renewal grid over uptime.
    t_end = min(horizon_s, 30.0 * gap)
    t = np.linspace(0.0, t_end, points + 1)
    f_x = 1.0 - np.interp(t, ages, s_x, right=0.0)
    d_f = np.concatenate([[0.0], np.diff(f_x)])
    cum_r = np.interp(t, ages, trap(psi_r), right=trap(psi_r)[-1])
    cum_o = np.interp(t, ages, trap(psi_o), right=trap(psi_o)[-1])
    progress = _renewal(cum_r, d_f)
    over = _renewal(cum_o, d_f)
    count = _renewal(f_x, d_f)
    # The state just before the interruption has k dead with probability P(k) - P(k+1).
    last = surv - np.append(surv[1:], 0.0)
    rate_end = float(np.sum(last * inv) / last.sum())
    return AgeModel(t, progress, over, count, gap, rate_r, rate_o, rate_end)

"""Time spent with k dead groups between two restarts (the renewal epoch).

After each restart every group is fresh, so interruptions form a renewal
process. Within an epoch the dead count k climbs 0, 1, 2, ... until the
interruption; `time_in_state[k]` is the expected time spent with exactly k dead
groups (and no interruption). Its sum is the mean time to interruption M, and
`time_in_state / M` weights any per-k quantity (the computation overhead) into
its time average while running.

* exponential, no repair: `P(k) / ((G - k) lambda)`;
* Weibull, no repair: `integral_0^inf Binomial(k; G, F(t)) P(k) dt`, F the
    Weibull CDF (the failure order is a uniform permutation independent of the
    sorted times);
* exponential with hot re-join (each dead group returns after an exponential
    MTTR): a birth-death chain on k, killed at rate (G-k) lambda (1 - P(k+1)/P(k)),
    solved exactly for the expected occupation times from k = 0. It assumes the
    dead set given k is a uniformly random good k-subset (exact without repair).

`mean_time_to_interruption` is the sum of these occupation times.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import linalg

from spare_jax import checks
from spare_jax.analysis import endurance
from spare_jax.scenario import FAILURE_LAWS, WEIBULL_SHAPES, weibull_scale

__all__ = ["mean_time_to_interruption", "time_in_state"]


def time_in_state(
    strategy: str,
    groups: int,
    redundancy: int,
    group_mtbf_s: float,
    *,
    law: str = "exponential",
    weibull_shape: float = 1.0,
    mttr_s: float | None = None,
) -> np.ndarray:
    """Expected seconds spent with k = 0, 1, ... dead groups before the interruption.

    Args:
        strategy: a strategy name of `spare_jax.strategies`.
        groups: G.
        redundancy: r.
        group_mtbf_s: mean time to failure of one group.
        law: "exponential" or "weibull".
        weibull_shape: Weibull shape (law "weibull"), in `scenario.WEIBULL_SHAPES`.
        mttr_s: hot re-join after an exponential repair time of this mean (None: no
            repair until the restart). Exponential law only.

    Returns:
        float array, one entry per k.
    """
    checks.number("group_mtbf_s", group_mtbf_s, low=0.0, low_open=True)
    checks.choice("law", law, FAILURE_LAWS)
    if law == "weibull":
        checks.number("weibull_shape", weibull_shape, low=WEIBULL_SHAPES[0], high=WEIBULL_SHAPES[1])
        if mttr_s is not None:
            raise ValueError("hot re-join (mttr_s) is modelled for exponential failures only")
    if mttr_s is not None:
        checks.number("mttr_s", mttr_s, low=0.0, low_open=True)
    surv = np.exp(endurance.log_survival_curve(strategy, groups, redundancy))
    k = np.arange(surv.size)
    rate = 1.0 / group_mtbf_s
    if law == "weibull":
        scale = weibull_scale(group_mtbf_s, weibull_shape)
        return _weibull(surv, int(groups), scale, float(weibull_shape))
    if mttr_s is None:
        return surv / ((groups - k) * rate)
    return _hot(surv, int(groups), rate, 1.0 / mttr_s)


def mean_time_to_interruption(
    strategy: str,
    groups: int,
    redundancy: int,
    group_mtbf_s: float,
    *,
    law: str = "exponential",
    weibull_shape: float = 1.0,
) -> float:
    """Mean time from a fresh start to the first interruption, no repair.

    Exponential: E[sum_{i<F} 1 / ((G - i) lambda)] = sum_k P(k) / ((G - k) lambda).
    Weibull (mean `group_mtbf_s`, shape `weibull_shape`): the order in which
    groups fail is a uniform permutation independent of the sorted failure
    times, so MTTI = integral over t of E[P(K_t)], K_t ~ Binomial(G, F(t)) the
    number of groups failed by t. Both are `time_in_state(...).sum()`.
    """
    occupation = time_in_state(
        strategy, groups, redundancy, group_mtbf_s, law=law, weibull_shape=weibull_shape
    )
    return float(occupation.sum())


def _weibull(surv: np.ndarray, groups: int, scale: float, shape: float) -> np.ndarray:
    """Occupation times by quadrature in u = F(t) over the binomial mixture."""
    k = np.arange(surv.size)

    # t(u) = scale * (-log(1-u))^(1/shape); dt = scale/shape * (-log(1-u))^(1/shape-1)/(1-u) du.
    # Integrate Binomial(k; G, u) dt over u per k with Gauss-Legendre nodes in a window
    # around u = k/G (the binomial pmf is negligible elsewhere).
    x, w = np.polynomial.legendre.leggauss(64)
    sd = np.sqrt(np.maximum(k, 1.0)) / groups
    lo = np.clip(k / groups - 12 * sd - 1.0 / groups, 0.0, 1.0)
    hi = np.clip(k / groups + 12 * sd + 40.0 / groups, 0.0, 1.0 - 1e-15)
    u = lo[:, None] + (hi - lo)[:, None] * (x[None, :] + 1.0) / 2.0
    jac = (hi - lo)[:, None] / 2.0
    u = np.clip(u, 1e-300, 1.0 - 1e-15)
    y = -np.log1p(-u)
    dtdu = scale / shape * y ** (1.0 / shape - 1.0) / (1.0 - u)
    # Imported here: scipy.stats adds ~0.3 s to every import of the analysis (and so to
    # the start of experiments/plan.py), and only the Weibull law needs it.
    from scipy import stats

    pmf = np.exp(stats.binom.logpmf(k[:, None], groups, u))
    out = np.sum(pmf * dtdu * jac * w[None, :], axis=1)
    # k = 0 has an integrable singularity at u = 0 when shape < 1: integrate exactly,
    # int_0^inf (1 - F(t))^G dt = scale * Gamma(1 + 1/shape) / G^(1/shape).
    out[0] = scale * math.gamma(1.0 + 1.0 / shape) / groups ** (1.0 / shape)
    return surv * out


def _hot(surv: np.ndarray, groups: int, lam: float, mu: float) -> np.ndarray:
    """Expected occupation times of a killed birth-death chain started at k = 0."""
    n = surv.size
    k = np.arange(n)
    ok = np.append(surv[1:] / np.maximum(surv[:-1], 1e-300), 0.0)
    up = (groups - k) * lam * ok  # failure that leaves the job running
    down = k * mu  # hot re-join
    out_rate = (groups - k) * lam + down  # every event leaves state k
    # Occupation times tau solve tau_j out_j = [j==0] + tau_{j-1} up_{j-1} + tau_{j+1} down_{j+1}.
    ab = np.zeros((3, n))
    ab[0, 1:] = -down[1:]
    ab[1, :] = out_rate
    ab[2, :-1] = -up[:-1]
    rhs = np.zeros(n)
    rhs[0] = 1.0
    return linalg.solve_banded((1, 1), ab, rhs)

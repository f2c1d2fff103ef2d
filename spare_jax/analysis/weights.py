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
"""

from __future__ import annotations

import math

import numpy as np
from scipy import linalg, special

from spare_jax.analysis import endurance

__all__ = ["time_in_state"]


def _weibull_scale(mean: float, shape: float) -> float:
    return mean / math.gamma(1.0 + 1.0 / shape)


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
        strategy: "spare", "replication", "dp" or "checkpoint_restart".
        groups: G.
        redundancy: r.
        group_mtbf_s: mean time to failure of one group.
        law: "exponential" or "weibull".
        weibull_shape: Weibull shape (law "weibull").
        mttr_s: hot re-join after an exponential repair time of this mean (None: no
            repair until the restart). Exponential law only.

    Returns:
        float array, one entry per k.
    """
    if not group_mtbf_s > 0:
        raise ValueError(f"group_mtbf_s must be > 0, got {group_mtbf_s!r}")
    surv = np.exp(endurance.log_survival_curve(strategy, groups, redundancy))
    k = np.arange(surv.size)
    rate = 1.0 / group_mtbf_s
    if law == "exponential" and mttr_s is None:
        return surv / ((groups - k) * rate)
    if law == "exponential":
        if not mttr_s > 0:
            raise ValueError(f"mttr_s must be > 0, got {mttr_s!r}")
        return _hot(surv, groups, rate, 1.0 / mttr_s)
    if law != "weibull":
        raise ValueError(f"law must be 'exponential' or 'weibull', got {law!r}")
    if not weibull_shape > 0:
        raise ValueError(f"weibull_shape must be > 0, got {weibull_shape!r}")
    if mttr_s is not None:
        raise ValueError("hot re-join is modelled for exponential failures only")
    return _weibull(surv, groups, _weibull_scale(group_mtbf_s, weibull_shape), weibull_shape)


def _weibull(surv: np.ndarray, groups: int, scale: float, shape: float) -> np.ndarray:
    """Occupation times by quadrature in u = F(t) over the binomial mixture."""
    k = np.arange(surv.size)

    # t(u) = scale * (-log(1-u))^(1/shape); dt = scale/shape * (-log(1-u))^(1/shape-1)/(1-u) du.
    # Integrate Binomial(k; G, u) dt over u per k with Gauss-Legendre nodes in a window
    # around u = k/G (the binomial pmf is negligible elsewhere).
    x, w = np.polynomial.legendre.leggauss(64)
    out = np.empty(surv.size)
    sd = np.sqrt(np.maximum(k, 1.0)) / groups
    lo = np.clip(k / groups - 12 * sd - 1.0 / groups, 0.0, 1.0)
    hi = np.clip(k / groups + 12 * sd + 40.0 / groups, 0.0, 1.0 - 1e-15)
    u = lo[:, None] + (hi - lo)[:, None] * (x[None, :] + 1.0) / 2.0
    jac = (hi - lo)[:, None] / 2.0
    u = np.clip(u, 1e-300, 1.0 - 1e-15)
    y = -np.log1p(-u)
    dtdu = scale / shape * y ** (1.0 / shape - 1.0) / (1.0 - u)
    logpmf = (
        (special.gammaln(groups + 1) - special.gammaln(k + 1) - special.gammaln(groups - k + 1))[
            :, None
        ]
        + k[:, None] * np.log(u)
        + (groups - k)[:, None] * np.log1p(-u)
    )
    out = np.sum(np.exp(logpmf) * dtdu * jac * w[None, :], axis=1)
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

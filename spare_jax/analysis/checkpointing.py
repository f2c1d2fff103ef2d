"""Checkpoint intervals (Young, Daly) and the exact renewal form for exponential interruptions.

Notation: `C` checkpoint save cost, `M` mean time between interruptions of the
strategy (not the raw failure MTBF), `R` restart cost, `tau` running time
between two saves.

With interruptions arriving as a Poisson process of mean gap M, restarts
immune to failures (scenario rule 3) and a segment of `s = tau + C` wall
seconds repeated until it completes, the expected wall time of one segment is

    E[segment] = (M + R) (exp(s / M) - 1),

and `(exp(s / M) - 1)` interruptions are expected per segment. The interval
minimising `E[segment] / tau` solves `(1 - tau/M) exp((tau + C)/M) = 1`:

    tau* = M (1 + W0(-exp(-1 - C/M))),

W0 the principal Lambert W branch. Young's `sqrt(2 C M)` and Daly's
higher-order form are its small-C/M expansions (Daly 2006 includes failures
during restart, which only scales the cost by exp(R/M), not the optimum).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from spare_jax import checks

__all__ = ["daly", "exact_optimum", "segment_cost", "young"]


def _check(C: float, M: float) -> None:
    checks.number("checkpoint cost C", C, low=0.0)
    checks.number("mean time between interruptions M", M, low=0.0, low_open=True)


def young(C: float, M: float) -> float:
    """Young (CACM 1974): tau = sqrt(2 C M)."""
    _check(C, M)
    return math.sqrt(2.0 * C * M)


def daly(C: float, M: float) -> float:
    """Daly (FGCS 2006): sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M."""
    _check(C, M)
    if C >= 2.0 * M:
        return float(M)
    x = C / (2.0 * M)
    return math.sqrt(2.0 * C * M) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - C


def exact_optimum(C: float, M: float) -> float:
    """tau minimising (exp((tau + C)/M) - 1) / tau: M (1 + W0(-exp(-1 - C/M)))."""
    _check(C, M)
    if C == 0.0:
        return 0.0
    arg = -math.exp(-1.0 - C / M)
    if arg < -1.0 / math.e + 1e-12:  # C/M tiny: W0 near -1, use the series
        return young(C, M) * (1.0 + math.sqrt(C / (2.0 * M)) / 3.0)
    return float(M * (1.0 + special.lambertw(arg, 0).real))


def segment_cost(tau: float, C: float, M: float, R: float) -> tuple[float, float]:
    """(expected wall seconds per segment, expected interruptions per segment).

    A segment is `tau` running seconds plus a `C`-second save, repeated from the
    last checkpoint after every interruption (each costing `R`).
    """
    _check(C, M)
    checks.number("tau", tau, low=0.0, low_open=True, allow_inf=True)
    checks.number("restart cost R", R, low=0.0)
    s = tau + C
    if s / M > 700.0:
        return math.inf, math.inf
    n = float(np.expm1(s / M))
    return (M + R) * n, n

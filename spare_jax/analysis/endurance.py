"""Endurable failures and mean time to interruption, exact and asymptotic.

Failures strike groups one at a time. Under the "live" convention of
docs/design.md (6. Endurable failures) each failure hits a live group chosen
uniformly at random, so after `f` failures the dead set is a uniformly random
`f`-subset of the `G` groups and

    P(f) = P(no interruption after f failures) = good f-subsets / C(G, f).

Good subsets are the ones with no uncovered shard:

* cyclic stacking (any ring placement: cyclic, strided with one ring,
    domain-aware): no `r` consecutive dead groups around the ring;
* replication: no set of `r` groups entirely dead;
* plain data parallelism (r = 1): no dead group at all.

The interruption count `F` (the interrupting failure included) has
`E[F] = sum_{f >= 0} P(f)`.

How `P(f)` is computed exactly without overflow or cancellation (G up to
600,000 and beyond): give every group an independent "dead" mark with
probability `p` and weight `z` per dead group. The weighted count of good
circular configurations is a trace of a transfer-matrix power
(`trace T(z)^G`, T the r x r matrix of the current dead-run length) for
stacking and a plain power `((1-p+pz)^r - (pz)^r)^(G/r)` for replication. Its
coefficient of `z^f` is `good(f) (1-p)^(G-f) p^f`. We read the coefficients
off a discrete Fourier transform of the generating function on the unit
circle, normalised by its value at z = 1 (computed in log space through the
eigenvalues, so `G log(mu)` never overflows). Choosing `p` so that the tilted,
conditioned distribution of the dead count is centred on the window of `f`
being read keeps every coefficient within a few orders of magnitude of the
maximum, so the relative accuracy does not depend on the size of `P(f)` (it may be
1e-200): about 1e-10 at G = 1,000 and 1e-8 at G = 600,000 (the G log(mu)
products carry G times the round-off), checked against exact integer and
closed-form (r = 2) values in the tests. Windows of about 8 standard deviations tile `f` from 0
until `P(f)` drops below 1e-30.

Under the replication-literature convention ("any"; Casanova et al. 2012) a
failure may strike an already dead group; then it changes nothing but is
counted. From k distinct dead groups a new one is hit after a geometric number
of failures of mean G / (G - k), so `E[F_any] = sum_k P(k) G / (G - k)`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import optimize, special

from spare_jax import checks, strategies

__all__ = [
    "CONVENTIONS",
    "MAX_GROUPS",
    "MAX_REDUNDANCY",
    "check",
    "endurable_failures",
    "endurable_failures_asymptotic",
    "log_survival_curve",
    "survival",
]

CONVENTIONS: tuple[str, ...] = ("live", "any")
# Sizes the closed forms are evaluated for. The survival curve costs about 8 s at
# 10^7 groups and r = 8; its transfer matrices are r x r, and the fixed-order
# overhead builds one curve per j < r: at r = 64 one evaluation takes minutes.
MAX_GROUPS = 10_000_000
MAX_REDUNDANCY = 32
# "any" convention: the survival DP costs max(failures) x survivable dead counts.
_MAX_ANY_WORK = 10**9
_LOG_FLOOR = -30.0 * math.log(10.0)  # stop once P(f) < 1e-30
# Log-odds bracket of the tilt; beyond 30 the dead mark rounds to 1 in double precision.
_TILT_BRACKET = (-60.0, 30.0)


def check(strategy: str, groups: int, redundancy: int) -> tuple[str, int, int]:
    """Validate a (strategy, G, r) configuration; return (kind, G, r).

    `kind` is the canonical strategy ("spare", "replication" or "dp"; any
    strategy with r = 1 is "dp").

    Raises:
        ValueError: naming the bad argument and the rule it breaks.
    """
    kind = strategies.canonical(strategy)
    groups = checks.integer("groups", groups, low=1)
    if groups > MAX_GROUPS:
        raise ValueError(
            f"groups must be <= {MAX_GROUPS:,} for the closed forms (the survival curve "
            f"takes seconds at 10^7 groups, minutes beyond), got {groups:,}"
        )
    r = checks.integer("redundancy", redundancy, low=1)
    if r > MAX_REDUNDANCY:
        raise ValueError(
            f"redundancy must be <= {MAX_REDUNDANCY} for the closed forms (r x r transfer "
            f"matrices; one evaluation takes minutes at r = 64), got {r}"
        )
    if r > groups:
        raise ValueError(f"redundancy r={r} must not exceed groups G={groups}")
    if kind == "dp" and r != 1:
        raise ValueError(f"{strategy} has redundancy 1, got {r}")
    if kind == "replication" and groups % r:
        raise ValueError(f"replication needs G divisible by r: G={groups}, r={r}")
    return ("dp" if r == 1 else kind), groups, r


def max_good(kind: str, groups: int, r: int) -> int:
    """Largest number of dead groups that can leave every shard covered."""
    if kind == "dp":
        return 0
    if kind == "replication":
        return groups // r * (r - 1)
    return groups - -(-groups // r)


def _log_binom(n: int, k: np.ndarray) -> np.ndarray:
    """log C(n, k) through betaln.

    Not `scipy.stats.binom.logpmf`: it sums three gammaln values of size
    n log n (about 1e7 at n = 600,000), whose cancellation costs ~1e-9 of
    relative accuracy in P(f); betaln keeps it near 1e-12.
    """
    return -math.log(n + 1) - special.betaln(n - k + 1, k + 1)


def _log_generating(
    kind: str, groups: int, r: int, p: float, theta: np.ndarray
) -> np.ndarray | tuple[np.ndarray, float]:
    """log of the tilted generating function at z = exp(i theta), minus its value at z = 1.

    Returns complex log-values `L(theta) - L(0)` for replication; for stacking, the
    per-eigenvalue terms `G (log mu_j(theta) - log mu_1(0))` ([K, r], or [K, 1]
    when only the dominant root matters) and the normaliser `G log mu_1(0)`.
    """
    a, b = 1.0 - p, p
    z = np.exp(1j * theta)
    if kind == "replication":
        h = (a + b * z) ** r - (b * z) ** r
        h0 = (a + b) ** r - b**r
        return (groups // r) * (np.log(h) - math.log(h0))
    # Stacking: state = length of the current dead run (0..r-1); eigenvalues mu solve
    # mu^r = a (mu^(r-1) + (bz) mu^(r-2) + ... + (bz)^(r-1)).
    idx = np.arange(r - 1)
    t0 = np.zeros((r, r))
    t0[:, 0] = a
    t0[idx, idx + 1] = b
    eig0 = np.sort(np.abs(np.linalg.eigvals(t0)))[::-1]
    perron = float(eig0[0])
    second = float(eig0[1]) if r > 1 else 0.0
    if groups * math.log(max(second, 1e-300) / perron) > -120.0:
        # Small G: every eigenvalue matters (exact trace).
        t = np.zeros((theta.shape[0], r, r), dtype=np.complex128)
        t[:, :, 0] = a
        t[:, idx, idx + 1] = (b * z)[:, None]
        mu = np.linalg.eigvals(t)
    else:
        # Large G: only the dominant root counts; Newton from its continuation a + bz.
        coef = [np.ones_like(z)] + [-a * (b * z) ** j for j in range(r)]
        mu = a + b * z
        for _ in range(60):
            g = np.zeros_like(z)
            dg = np.zeros_like(z)
            for c in coef:
                dg = dg * mu + g
                g = g * mu + c
            step = g / dg
            mu = mu - step
            if np.max(np.abs(step)) < 1e-15:
                break
        bad = ~np.isfinite(mu) | (np.abs(mu) > perron * (1.0 + 1e-9)) | ~(np.abs(g) < 1e-10)
        if np.any(bad):  # Newton strayed: take the largest eigenvalue there
            t = np.zeros((int(bad.sum()), r, r), dtype=np.complex128)
            t[:, :, 0] = a
            t[:, idx, idx + 1] = (b * z[bad])[:, None]
            ev = np.linalg.eigvals(t)
            mu[bad] = ev[np.arange(ev.shape[0]), np.argmax(np.abs(ev), axis=1)]
        mu = mu[:, None]
        if theta[0] == 0.0:  # normalise by the same computation's root at z = 1
            perron = float(mu[0, 0].real)
    with np.errstate(divide="ignore"):
        return groups * (np.log(mu.astype(np.complex128)) - math.log(perron)), groups * math.log(
            perron
        )


def _window(kind: str, groups: int, r: int, lo: int, hi: int, p: float) -> np.ndarray:
    """Exact log P(f) for f in [lo, hi], read off the generating function tilted by p."""
    f_top = max_good(kind, groups, r)
    sigma = math.sqrt(groups * p * (1.0 - p)) + 1.0
    need = int((hi - lo) + 20 * sigma + 64)
    size = 1 << max(6, need.bit_length())
    if size > f_top:  # the whole polynomial fits: no aliasing at all
        size = 1 << max(6, (f_top + 1).bit_length())
    theta = 2.0 * np.pi * np.arange(size) / size
    if kind == "replication":
        log_g = _log_generating(kind, groups, r, p, theta)
        vals = np.exp(log_g)
        log_norm = (groups // r) * math.log(1.0 - p**r)
    else:
        log_terms, log_norm = _log_generating(kind, groups, r, p, theta)
        vals = np.exp(log_terms).sum(axis=1)
    coeff = np.fft.fft(vals).real / size
    f = np.arange(lo, hi + 1)
    c = coeff[f % size]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = np.where(c > 0, np.log(np.where(c > 0, c, 1.0)), -np.inf)
    log_p = (
        log_c + log_norm - (groups - f) * math.log1p(-p) - f * math.log(p) - _log_binom(groups, f)
    )
    return np.minimum(log_p, 0.0)


def site_mean(kind: str, r: int, x: float) -> float:
    """Mean dead fraction per group at dead-odds e^x, conditioned on no interruption (G -> inf)."""
    p = 1.0 / (1.0 + math.exp(-x))
    if kind == "replication":
        return (p - p**r) / (1.0 - p**r)
    a, b = 1.0 - p, p
    # Perron root of g(mu) = mu^r - a sum_j b^j mu^(r-1-j) (its only positive root,
    # <= 1), by Newton from mu = 1; then d log mu / d log b by implicit differentiation.
    mu = 1.0
    for _ in range(100):
        g = mu**r - a * sum(b**j * mu ** (r - 1 - j) for j in range(r))
        dg = r * mu ** (r - 1) - a * sum(
            (r - 1 - j) * b**j * mu ** (r - 2 - j) for j in range(r - 1)
        )
        step = g / dg
        mu -= step
        if abs(step) < 1e-15 * mu:
            break
    dg_dlogb = -a * sum(j * b**j * mu ** (r - 1 - j) for j in range(r))
    dg_dmu = r * mu ** (r - 1) - a * sum(
        (r - 1 - j) * b**j * mu ** (r - 2 - j) for j in range(r - 1)
    )
    return float(-dg_dlogb / dg_dmu / mu)


def _tilt(kind: str, groups: int, r: int, centre: float) -> tuple[float, float]:
    """Tilt p whose conditioned dead count has mean `centre`, and that count's std. dev."""
    target = max(centre, 0.25) / groups
    lo, hi = _TILT_BRACKET

    def gap(x: float) -> float:
        return site_mean(kind, r, x) - target

    # Near the densest good configuration no finite tilt reaches `target`: take the top.
    x = hi if gap(hi) <= 0.0 else optimize.brentq(gap, lo, hi, xtol=1e-6)
    var = groups * (site_mean(kind, r, x + 1e-4) - site_mean(kind, r, x - 1e-4)) / 2e-4
    return 1.0 / (1.0 + math.exp(-x)), math.sqrt(max(var, 0.0)) + 1.0


def log_survival_curve(strategy: str, groups: int, redundancy: int) -> np.ndarray:
    """log P(no interruption after f failures), f = 0, 1, ... until P < 1e-30 ("live").

    The array is read-only and cached per (canonical strategy, G, r); P(f) beyond
    its end is below 1e-30 (or exactly 0 past the largest survivable dead count).
    """
    return _curve(*check(strategy, groups, redundancy))


@functools.lru_cache(maxsize=256)
def _curve(kind: str, groups: int, r: int) -> np.ndarray:
    if kind == "dp":
        out = np.zeros(1)
        out.setflags(write=False)
        return out
    f_top = max_good(kind, groups, r)
    pieces: list[np.ndarray] = []
    lo = 0
    while lo <= f_top:
        _, sigma = _tilt(kind, groups, r, lo + 0.5)
        hi = min(int(lo + 8.0 * sigma + 8), f_top)
        p, _ = _tilt(kind, groups, r, 0.5 * (lo + hi))
        log_p = _window(kind, groups, r, lo, hi, p)
        # Fewer than r dead groups never interrupt (no shard loses all r holders).
        log_p[: max(0, min(r - lo, log_p.size))] = 0.0
        # P(f) is non-increasing in f: enforce against round-off at the edges.
        log_p = np.minimum.accumulate(log_p)
        if pieces:
            log_p = np.minimum(log_p, pieces[-1][-1])
        below = np.flatnonzero(log_p < _LOG_FLOOR)
        if below.size:
            pieces.append(log_p[: below[0]])
            break
        pieces.append(log_p)
        lo = hi + 1
    out = np.concatenate(pieces)
    out.setflags(write=False)
    return out


def _any_survival(curve: np.ndarray, groups: int, failures: np.ndarray) -> np.ndarray:
    """P(no interruption after n failures that may strike dead groups), by a DP on k."""
    n_max = int(failures.max(initial=0))
    surv = np.exp(curve)
    k = np.arange(surv.size)
    step_ok = np.append(surv[1:] / np.maximum(surv[:-1], 1e-300), 0.0)
    stay = k / groups
    move = (groups - k) / groups * step_ok
    q = np.zeros(surv.size)
    q[0] = 1.0
    out = np.empty(n_max + 1)
    out[0] = 1.0
    for n in range(1, n_max + 1):
        new = q * stay
        new[1:] += (q * move)[:-1]
        q = new
        out[n] = q.sum()
    return out[failures]


def _failure_counts(failures: object) -> np.ndarray:
    f = np.asarray(failures)
    if f.dtype == bool or not np.issubdtype(f.dtype, np.integer) or np.any(f < 0):
        raise ValueError(f"failures must be non-negative integers, got {failures!r}")
    return f


def survival(
    strategy: str, groups: int, redundancy: int, failures, *, convention: str = "live"
) -> np.ndarray:
    """P(no interruption after `failures` failures).

    Args:
        strategy: a strategy name of `spare_jax.strategies` ("spare" is cyclic stacking).
        groups: G.
        redundancy: r.
        failures: an int or int array of failure counts.
        convention: "live" (each failure strikes a live group uniformly,
            docs/design.md section 6) or "any" (a failure may strike a dead
            group; the replication literature's convention).

    Returns:
        Array of probabilities, the shape of `failures`.
    """
    checks.choice("convention", convention, CONVENTIONS)
    f = _failure_counts(failures)
    curve = log_survival_curve(strategy, groups, redundancy)
    if convention == "live":
        inside = f < curve.size
        return np.where(inside, np.exp(curve[np.where(inside, f, 0)]), 0.0)
    work = int(f.max(initial=0)) * curve.size
    if work > _MAX_ANY_WORK:
        raise ValueError(
            f"failures must be <= {_MAX_ANY_WORK // curve.size:,} here under 'any' (its dynamic "
            f"programme costs max(failures) x {curve.size:,} survivable dead counts), "
            f"got {int(f.max()):,}"
        )
    return _any_survival(curve, int(groups), f)


def endurable_failures(
    strategy: str, groups: int, redundancy: int, *, convention: str = "live"
) -> float:
    """Exact mean number of failures to interruption, the interrupting one included.

    Under "any" the count also includes failures that struck already dead groups
    (Casanova et al.'s mean number of failures to interruption).
    """
    checks.choice("convention", convention, CONVENTIONS)
    surv = np.exp(log_survival_curve(strategy, groups, redundancy))
    if convention == "live":
        return float(surv.sum())
    k = np.arange(surv.size)
    return float(np.sum(surv * groups / (groups - k)))


def endurable_failures_asymptotic(strategy: str, groups: int, redundancy: int) -> float:
    """Large-G form: Gamma(1+1/r) G^(1-1/r), times r^(1/r) for replication ("live").

    From P(f) ~ exp(-lambda(f)), lambda = expected number of fatal patterns
    (f^r / G^(r-1) for stacking, f^r / (r G^(r-1)) for replication). Relative
    error is O(G^(-1/r)); docs/overhead_model.md tabulates it.
    """
    kind, groups, r = check(strategy, groups, redundancy)
    if kind == "dp":
        return 1.0
    base = math.gamma(1.0 + 1.0 / r) * groups ** (1.0 - 1.0 / r)
    return base * (r ** (1.0 / r) if kind == "replication" else 1.0)

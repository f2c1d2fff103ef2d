"""Expected computation overhead with k dead groups (cyclic stacking, replication, DP).

The overhead is `max load / m` (docs/design.md, 2. Vocabulary and 7. Computation
overhead). For cyclic stacking with
k dead groups, chosen uniformly among the dead sets that do not interrupt the
run, docs/overhead_model.md derives:

* fixed order: `L / m = 1 + longest dead run`, so, exactly,
    `E[o | k] = 1 + sum_{j=1}^{r-1} (1 - S_j(k) / S_r(k))`, where `S_j(k)` is the
    probability that a uniform k-subset of the ring has no j consecutive dead
    groups (`endurance.log_survival_curve` with redundancy j);
* adaptive reordering: from the Hall bound,
    `L* / m = 1 + max(g_k, V) / m`, `g_k = ceil(m k / (G - k))` (the global
    term) and `V = max over ring windows W of ceil(m (d_W - r + 1) / h_W)` with
    `d_W` dead and `h_W` live groups in W. `V >= v` exactly when the walk that
    adds `+m` per dead and `-(v - 1)` per live group has a window sum above
    `m (r - 1)`, i.e. when a reflected (Lindley) walk exceeds `m (r - 1)`. Dead
    groups are modelled as independent marks with the tilt p whose conditioned
    mean is k (as in `endurance`); then `P(V < v | no interruption) ~
    (rho_v / rho_inf)^G` with `rho` the Perron roots of the killed walks. The
    roots depend on (r, m, p) only, so they are tabulated once per (r, m).
* replication: r; data parallelism: 1 (only k = 0 survives).

`adaptive_max_load` evaluates the Hall bound exactly for one dead set (the
tests check it against `spare_jax.reorder.max_load` and use it for Monte
Carlo); its kernel `window_load` also serves the simulator's hot re-join.
"""

from __future__ import annotations

import functools

import numpy as np

from spare_jax import checks, strategies
from spare_jax.analysis import endurance

__all__ = [
    "MAX_WALK_STATES",
    "adaptive_max_load",
    "check_size",
    "overhead",
    "overhead_moments",
    "window_load",
]

_GRID_X = np.arange(-16.0, 2.51, 0.5)  # log-odds of the per-group dead mark
# The adaptive model's walk has m (r - 1) states and its tables cost O(states^2)
# per iteration: 256 states take about 3 s, 1024 over a minute.
MAX_WALK_STATES = 256
_WINDOW_ELEMENTS = 1 << 20  # window_load's working set per block of window lengths


def window_load(dead: np.ndarray, groups: int, redundancy: int, microbatches: int) -> int:
    """Largest Hall term over ring windows that start and end at dead groups.

    A window of `span` ring positions holding `d` dead groups covers the
    `span - r + 1` shards whose holders all lie in it, so it forces a load of
    ceil(m (span - r + 1) / (span - d)). For d >= r this decreases with the
    span at fixed d, so the largest terms come from windows bounded by dead
    groups: the pairs (i, i + t) of the sorted dead positions, t >= r - 1
    (windows with d < r force at most m). O(k^2) over the k dead groups,
    vectorised in blocks of bounded memory; no argument checks (the callers
    check), so that the simulator's hot re-join can call it per event.

    Args:
        dead: sorted, distinct dead group ids in [0, G).
        groups: G.
        redundancy: r.
        microbatches: m.

    Returns:
        max(m, the largest window term).

    Raises:
        ValueError: r ring-consecutive dead groups (an interruption).
    """
    k, g, r, m = dead.size, groups, redundancy, microbatches
    best = m
    block = max(1, _WINDOW_ELEMENTS // max(k, 1))
    cols = np.arange(k)
    for t0 in range(r - 1, k, block):
        t = np.arange(t0, min(t0 + block, k))[:, None]
        span = (dead[(cols[None, :] + t) % k] - dead[None, :]) % g + 1
        live = span - t - 1
        if np.any(live <= 0):
            raise ValueError(f"interruption: {r} ring-consecutive dead groups")
        best = max(best, int(np.max(-(-m * (span - r + 1) // live))))
    return best


def adaptive_max_load(groups: int, redundancy: int, microbatches: int, dead: np.ndarray) -> int:
    """Exact optimal max load L* for cyclic stacking (one ring) with the given dead groups.

    L* = max(ceil(G m / live), window terms): the Hall bound of docs/design.md
    section 4, which the optimal assignment attains.

    Args:
        groups: G.
        redundancy: r.
        microbatches: m.
        dead: ids of the dead groups, integers in [0, G) (repeats count once).

    Raises:
        ValueError: a bad argument, or a dead set that interrupts the run
            (r ring-consecutive dead groups, or every group dead).
    """
    _, g, r = endurance.check("spare", groups, redundancy)
    m = checks.integer("microbatches", microbatches, low=1, high=2**31 - 1)
    ids = np.asarray(dead)
    if ids.size and (ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"dead must hold integer group ids, got dtype {ids.dtype}")
    if ids.ndim > 1:
        raise ValueError(f"dead must be a 1-D list of group ids, got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= g):
        raise ValueError(f"dead group ids must lie in [0, {g}), got {ids.min()}..{ids.max()}")
    pos = np.unique(ids.astype(np.int64))
    k = pos.size
    if k == 0:
        return m
    if k == g:
        raise ValueError("interruption: every group is dead")
    return max(-(-g * m // (g - k)), window_load(pos, g, r, m))


def _walk_rates(redundancy: int, microbatches: int, p: np.ndarray) -> np.ndarray:
    """log(rho_v / rho_inf) for v = 2..m(r-1), at dead-mark probabilities p.

    Returns [len(v), len(p)] (<= 0). State s in 0..M, M = m(r-1): the reflected
    walk max(0, s + step); dead adds m (killed above M), live subtracts v - 1
    (v - 1 >= M: live resets to 0, the no-interruption walk, rho_inf). Power
    iteration on the quasi-stationary distribution from s = 0; each (v, p)
    stops once log rho moves by less than 1e-11 + 1e-5 |log(rho_v / rho_inf)|
    per iteration (enough for G |.| to be right to 1e-3 when it matters), or
    once |log(rho_v / rho_inf)| > 0.05 is settled to 1% (then P(V < v) <
    exp(-50) for G >= 1000: the model targets G >= 1000).
    """
    m, r = microbatches, redundancy
    big = m * (r - 1)
    n_s = big + 1
    ww, pi = np.meshgrid(np.arange(1, big + 1), np.arange(p.size), indexing="ij")
    ww, pi = ww.ravel(), pi.ravel()
    log_rho = np.zeros(ww.size)
    ref_rows = ww == big
    active = np.arange(ww.size)
    x = np.zeros((ww.size, n_s))
    x[:, 0] = 1.0
    t_idx = np.arange(n_s)
    prev = np.zeros(ww.size)
    for it in range(20000):
        w, pp = ww[active][:, None], p[pi[active]][:, None]
        xa = x[active]
        y = np.zeros_like(xa)
        y[:, m:] = pp * xa[:, : n_s - m]
        src = t_idx[None, :] + w
        ok = (src <= big) & (t_idx[None, :] >= 1)
        live = np.where(ok, np.take_along_axis(xa, np.where(ok, src, 0), axis=1), 0.0)
        live[:, 0] = np.take_along_axis(np.cumsum(xa, axis=1), w, axis=1)[:, 0]
        y += (1.0 - pp) * live
        total = y.sum(axis=1)
        x[active] = y / total[:, None]
        log_rho[active] = np.log(total)
        if it % 16 == 15:
            ref = np.zeros(p.size)
            ref[pi[ref_rows]] = log_rho[ref_rows]
            phi = log_rho[active] - ref[pi[active]]
            moved = np.abs(log_rho[active] - prev[active])
            done = moved < (1e-11 + 1e-5 * np.abs(phi)) * 16
            # |phi| > 0.05: P(V < v) < exp(-50) for every G >= 1000; a rough value suffices.
            done |= (np.abs(phi) > 0.05) & (moved < 0.01 * np.abs(phi))
            # the reference rows stay until every row of their p is done
            keep = ~done | (ww[active] == big)
            finished_p = np.setdiff1d(np.arange(p.size), pi[active][~done & (ww[active] != big)])
            keep &= ~((ww[active] == big) & np.isin(pi[active], finished_p) & done)
            prev[active] = log_rho[active]
            active = active[keep]
            if active.size == 0:
                break
    ref = np.zeros(p.size)
    ref[pi[ref_rows]] = log_rho[ref_rows]
    out = (log_rho - ref[pi]).reshape(big, p.size)
    return np.minimum(out[:-1], 0.0)


@functools.lru_cache(maxsize=128)
def _adaptive_table(
    redundancy: int, microbatches: int, x_max: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid log-odds, conditioned dead fraction, log(-log(rho_v/rho_inf)) [v, grid]).

    The grid stops at log-odds `x_max`: 0 covers every k with non-negligible
    probability for G >= ~10^4; 2.5 (slower: the walks mix slowly when dense)
    is used only when a query needs denser dead sets.
    """
    grid = _GRID_X[_GRID_X <= x_max + 1e-9]
    p = 1.0 / (1.0 + np.exp(-grid))
    frac = np.array([endurance.site_mean("spare", redundancy, x) for x in grid])
    rates = _walk_rates(redundancy, microbatches, p)
    with np.errstate(divide="ignore"):
        log_neg = np.log(np.maximum(-rates, 1e-300))
    return grid, frac, log_neg


def _adaptive(groups: int, r: int, m: int, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E[o | k], E[1/o | k]) for adaptive reordering."""
    kf = k.astype(float)
    g_term = -(-m * k // np.maximum(groups - k, 1))
    out = np.where(k == 0, 1.0, 1.0 + g_term / m)
    if r == 1 or m * (r - 1) < 2:
        return out, 1.0 / out
    grid, frac, log_neg = _adaptive_table(r, m, 0.0)
    if kf.max(initial=0.0) / groups > frac[-1]:
        grid, frac, log_neg = _adaptive_table(r, m, float(_GRID_X[-1]))
    q = np.log(np.clip(kf / groups, frac[0], frac[-1]))
    x = np.interp(q, np.log(frac), grid)
    v = np.arange(2, m * (r - 1) + 1)
    # P(V >= v) per (v, k), from the tabulated rates interpolated in log-odds.
    rate = -np.exp(np.array([np.interp(x, grid, row) for row in log_neg]))
    p_ge = -np.expm1(groups * rate)
    p_ge = np.where((v[:, None] > g_term[None, :]) & (k[None, :] >= r), p_ge, 0.0)
    # E[f(max(g, V))] = f(g) + sum_{v > g} P(V >= v) (f(v) - f(v - 1)),
    # f(v) = 1 + v/m or its inverse.
    mean = out + p_ge.sum(axis=0) / m
    step_inv = 1.0 / (1.0 + v / m) - 1.0 / (1.0 + (v - 1) / m)
    inverse = 1.0 / out + np.sum(p_ge * step_inv[:, None], axis=0)
    return np.where(k == 0, 1.0, mean), np.where(k == 0, 1.0, inverse)


def _fixed(groups: int, r: int, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E[o | k], E[1/o | k]) for fixed order: o = 1 + longest dead run."""
    top = endurance.log_survival_curve("spare", groups, r)
    kk = np.minimum(k, top.size - 1)
    # P(longest run >= j | no run >= r) = 1 - S_j / S_r, j = 1 .. r-1.
    tail = np.ones((r + 1,) + k.shape)
    tail[r] = 0.0
    for j in range(1, r):
        if j == 1:
            s_j = np.where(kk == 0, 0.0, -np.inf)
        else:
            curve = endurance.log_survival_curve("spare", groups, j)
            s_j = np.where(kk < curve.size, curve[np.minimum(kk, curve.size - 1)], -np.inf)
        tail[j] = 1.0 - np.exp(s_j - top[kk])
    j = np.arange(1, r + 1)[:, None]
    mean = 1.0 + tail[1:r].sum(axis=0)
    inverse = 1.0 + np.sum(tail[1:] * (1.0 / (1.0 + j) - 1.0 / j), axis=0)
    return mean, inverse


def check_size(kind: str, redundancy: int, microbatches: int, policy: str) -> int:
    """Check the policy and that (r, m) is within the model's limits; return m.

    Args:
        kind: a canonical strategy ("spare", "replication" or "dp").
        redundancy: r (already checked).
        microbatches: m.
        policy: "adaptive" or "fixed".
    """
    strategies.check_policy(policy, exact=True)
    m = checks.integer("microbatches", microbatches, low=1)
    if kind == "spare" and policy == "adaptive" and m * (redundancy - 1) > MAX_WALK_STATES:
        raise ValueError(
            f"microbatches * (redundancy - 1) must be <= {MAX_WALK_STATES} for the adaptive "
            f"overhead model (its walk has that many states; at 1024 its tables take over "
            f"a minute), got {m} * {redundancy - 1}"
        )
    return m


def _dead_counts(dead: object) -> np.ndarray:
    k = np.asarray(dead)
    if k.dtype == bool or not np.issubdtype(k.dtype, np.integer) or np.any(k < 0):
        raise ValueError(f"dead must be non-negative integers, got {dead!r}")
    return k


def overhead_moments(
    strategy: str,
    groups: int,
    redundancy: int,
    microbatches: int,
    dead,
    *,
    policy: str = "adaptive",
) -> tuple[np.ndarray, np.ndarray]:
    """(E[o | k], E[1/o | k]) for k = `dead`, flattened; the second drives progress (rate 1/o).

    Arguments as for `overhead`.
    """
    kind, g, r = endurance.check(strategy, groups, redundancy)
    m = check_size(kind, r, microbatches, policy)
    k = np.atleast_1d(_dead_counts(dead)).astype(np.int64).ravel()
    possible = k <= endurance.max_good(kind, g, r)
    kk = np.where(possible, k, 0)
    if kind == "dp":
        mean = np.ones(k.shape)
        inverse = mean
    elif kind == "replication":
        mean = np.full(k.shape, float(r))
        inverse = 1.0 / mean
    elif policy == "fixed":
        mean, inverse = _fixed(g, r, kk)
    else:
        mean, inverse = _adaptive(g, r, m, kk)
    return np.where(possible, mean, np.nan), np.where(possible, inverse, np.nan)


def overhead(
    strategy: str,
    groups: int,
    redundancy: int,
    microbatches: int,
    dead,
    *,
    policy: str = "adaptive",
) -> np.ndarray | float:
    """Expected computation overhead (max load / m) given `dead` dead groups and no interruption.

    Args:
        strategy: a strategy name of `spare_jax.strategies`: "spare" (cyclic
            stacking), "replication" (overhead r) or "dp" (1).
        groups: G.
        redundancy: r.
        microbatches: m per shard (stacking with adaptive reordering).
        dead: number of dead groups, an int or int array (vectorised).
        policy: "adaptive" (optimal reordering) or "fixed" (stack order), for stacking.

    Returns:
        float (or array of the shape of `dead`); NaN where `dead` groups cannot
        be dead without an interruption.
    """
    k = _dead_counts(dead)
    mean, _ = overhead_moments(strategy, groups, redundancy, microbatches, k, policy=policy)
    return float(mean[0]) if k.ndim == 0 else mean.reshape(k.shape)

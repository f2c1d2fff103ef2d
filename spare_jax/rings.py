"""The O(G) solver for ring placements (cyclic, strided, domain-aware stacking).

A ring placement holds shard ``i`` on groups ``i, i+1, ..., i+r-1`` of its
ring (in ring order), so a live set's best maximum load and its assignment
follow from prefix sums, with no flow network:

* the optimum is the Hall bound over contiguous shard intervals of each ring
  (docs/design.md, section 4), found by bisection on the load with a
  prefix-minimum test (`hall_feasible`, `optimal_load`);
* a load is reached by a sweep against the ring direction in which each group
  takes, first-in first-out, the work its upper neighbours could not finish,
  then its own shard, up to the load. The carried work obeys a Lindley
  recursion ``c = max(0, c_prev + m - cap)``; two laps of a cumulative sum give
  its periodic solution (`carry`), and the sweep is feasible iff the carry
  never exceeds ``(r - 1) * m`` (older work would be past its last holder).

`spare_jax.reorder` drives these for equal speeds and for per-group
capacities (stragglers); `spare_jax.incremental` reuses the carry.
"""

from __future__ import annotations

import numpy as np

from spare_jax.placement import Placement

__all__ = [
    "carry",
    "carry_caps",
    "hall_feasible",
    "load_bounds",
    "longest_dead_run",
    "optimal_load",
    "sweep",
    "sweep_caps",
]


def longest_dead_run(alive2d: np.ndarray) -> int:
    """Longest circular run of dead positions over all rings."""
    n = alive2d.shape[1]
    twice = np.concatenate([alive2d, alive2d], axis=1)
    idx = np.arange(2 * n)
    last_live = np.maximum.accumulate(np.where(twice, idx, -1), axis=1)
    return int(min((idx - last_live).max(initial=0), n)) if n else 0


def hall_feasible(alive2d: np.ndarray, r: int, m: int, load: int) -> bool:
    """True iff every contiguous shard interval of every ring fits under `load`.

    Interval [a, b] of ring positions (unrolled over two laps) is held by groups
    [a - r + 1, b]; the test m (b - a + 1) <= load * live[a - r + 1, b] is
    m (b + 1) - load * PA[b + r] <= m a - load * PA[a] with PA the prefix count
    of live groups on the unrolled ring. Longer unrolled intervals are implied by
    shorter ones plus the whole-ring test.
    """
    n = alive2d.shape[1]
    a = alive2d.astype(np.int64)
    if np.any(n * m > load * a.sum(axis=1)):
        return False
    unrolled = (
        np.concatenate([a[:, n - (r - 1) :], a, a], axis=1)
        if r > 1
        else np.concatenate([a, a], axis=1)
    )
    prefix = np.concatenate([np.zeros((a.shape[0], 1), np.int64), np.cumsum(unrolled, axis=1)], 1)
    b = np.arange(2 * n)
    u = m * (b + 1) - load * prefix[:, b + r]
    v = m * np.arange(n) - load * prefix[:, :n]
    best_start = np.minimum.accumulate(v, axis=1)
    return bool(np.all(u <= best_start[:, np.minimum(b, n - 1)]))


def load_bounds(alive2d: np.ndarray, m: int) -> tuple[int, int]:
    n = alive2d.shape[1]
    live = alive2d.sum(axis=1)
    lower = max(m, int(np.max(-(-n * m // live))))
    upper = m * (1 + longest_dead_run(alive2d))
    return lower, max(lower, upper)


def optimal_load(alive2d: np.ndarray, r: int, m: int, start: int | None = None) -> int:
    """Smallest feasible load; `start`, a known lower bound, is tried first and galloped up."""
    lo, hi = load_bounds(alive2d, m)
    if start is not None and lo < start < hi:
        step = 1
        lo = start
        while lo + step - 1 < hi and not hall_feasible(alive2d, r, m, lo + step - 1):
            lo, step = lo + step, 2 * step
        hi = min(hi, lo + step - 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if hall_feasible(alive2d, r, m, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def carry(alive2d: np.ndarray, m: int, load: int) -> np.ndarray:
    """Periodic carry after each group, in sweep order (positions n-1 down to 0).

    Returns int [rings, n + 1]: column 0 is the carry entering the lap.
    """
    return carry_caps(np.where(alive2d, load, 0), m)


def carry_caps(cap2d: np.ndarray, m: int) -> np.ndarray:
    """`carry` with a capacity per group: int [rings, n] in ring order (0 = dead)."""
    n = cap2d.shape[1]
    cap = cap2d[:, ::-1].astype(np.int64)
    step = m - np.concatenate([cap, cap], axis=1)
    total = np.cumsum(step, axis=1)
    carry = total - np.minimum.accumulate(np.minimum(total, 0), axis=1)
    return carry[:, n - 1 :]


def sweep(p: Placement, alive: np.ndarray, m: int, load: int):
    return sweep_caps(p, np.where(alive, load, 0), m, load)


def sweep_caps(p: Placement, caps: np.ndarray, m: int, load: int | None = None):
    """The sweep's assignment under int [G] capacities `caps` (0 = dead).

    `load` is the width of the work table; None takes the largest load.
    """
    rings = p.rings
    n_rings, n = rings.shape
    r = p.redundancy
    carry = carry_caps(caps[rings], m)
    if carry.max() > (r - 1) * m:
        raise AssertionError(f"sweep infeasible at the optimal capacities (load {load}): bug")
    c_in = carry[:, :1]
    sweep = np.arange(n)
    taken = c_in + (sweep + 1) * m - carry[:, 1:]
    start = np.concatenate([np.zeros((n_rings, 1), np.int64), taken[:, :-1]], axis=1)
    take = taken - start
    if load is None:
        load = int(take.max())
    k = np.arange(load)
    valid = k[None, None, :] < take[:, :, None]
    unit = start[:, :, None] + take[:, :, None] - 1 - k[None, None, :]
    lap_unit = (unit - c_in[:, :, None]) % (n * m)
    shard_sweep = lap_unit // m
    micro = m - 1 - lap_unit % m
    stack_pos = (sweep[None, :, None] - shard_sweep) % n
    if np.any(stack_pos[valid] >= r):
        raise AssertionError("sweep assigned work beyond its holders: bug")
    group = rings[:, ::-1]
    shard = np.take_along_axis(group, shard_sweep.reshape(n_rings, -1), axis=1).reshape(
        shard_sweep.shape
    )
    work = np.full((p.groups, load, 2), -1, dtype=np.int32)
    work[group.ravel(), :, 0] = np.where(valid, stack_pos, -1).reshape(-1, load)
    work[group.ravel(), :, 1] = np.where(valid, micro, -1).reshape(-1, load)
    owner = np.full((p.shards, m), -1, dtype=np.int64)
    owner_group = np.broadcast_to(group[:, :, None], valid.shape)
    owner[shard[valid], micro[valid]] = owner_group[valid]
    loads = np.zeros(p.groups, dtype=np.int64)
    loads[group.ravel()] = take.ravel()
    return owner, loads, work

"""Adaptive reordering: give every (shard, micro-batch) of a step to one live holder.

When groups die, their shards' micro-batches must be computed by surviving
holders. SPMD steps wait for the busiest group, so the cost of a step is the
maximum load `L` (micro-batches computed by one group). `assign` returns the
assignment that minimises `L` exactly (policy "adaptive"), or the fixed-order
baseline that hands each shard whole to its first live holder (policy "fixed").

Ring placements (cyclic, strided, domain-aware stacking) are solved in O(G)
vectorised passes per candidate load (`spare_jax.rings`: the Hall bound over
contiguous shard intervals, and a sweep whose carried work obeys a Lindley
recursion).

Other placements go through max-flow (scipy's csgraph, imported on first use:
a worker that never needs it starts without SciPy) with a bisection on the
load. Replication is special: every live member computes its set's shard.
For a live set that shrinks one failure at a time, `spare_jax.incremental`
updates the maximum load in microseconds instead of re-solving.

`assign_by_speed` and `makespan` generalise the adaptive assignment to groups
of different speeds (stragglers): group g gets at most floor(T * s_g)
micro-batches and the makespan T is minimised over the candidates k / s_g, by
the same carry test (ring placements) or max-flow (others) with per-group
capacities. Equal speeds give `assign`'s loads; speed 0 is a dead group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from spare_jax import checks, rings, strategies
from spare_jax.placement import Placement

__all__ = [
    "Assignment",
    "Interruption",
    "alive_mask",
    "assign",
    "assign_by_speed",
    "makespan",
    "max_load",
    "uncovered",
]


class Interruption(Exception):
    """Some shard has no live holder: the step cannot be completed exactly."""

    def __init__(self, uncovered_shards: np.ndarray):
        self.uncovered = np.asarray(uncovered_shards, dtype=np.int64)
        shown = ", ".join(str(s) for s in self.uncovered[:10])
        more = f" (+{self.uncovered.size - 10} more)" if self.uncovered.size > 10 else ""
        super().__init__(
            f"interruption: {self.uncovered.size} shard(s) have no live holder: {shown}{more}"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Assignment:
    """One step's work: who computes which micro-batch, in which order.

    Attributes:
        placement: the placement solved.
        alive: bool [G] live mask.
        microbatches: m, micro-batches per failure-free group.
        policy: "adaptive" or "fixed".
        owner: int [S, shard_units * m] group whose computation of each micro-batch
            counts toward the gradient.
        loads: int [G] micro-batches each group computes (replication's redundant
            copies included).
        max_load: the step's cost in micro-batches, `loads.max()`.
        work: int32 [G, max_load, 2] each group's slots in walking order as
            (stack position, micro-batch within that shard); -1 marks empty slots.
        counted: bool [G, max_load] whether a slot's gradient counts (False for
            empty slots and for replication's redundant copies).
    """

    placement: Placement
    alive: np.ndarray
    microbatches: int
    policy: str
    owner: np.ndarray
    loads: np.ndarray
    max_load: int
    work: np.ndarray
    counted: np.ndarray

    @property
    def overhead(self) -> float:
        """Computation overhead: max load over the failure-free load m."""
        return self.max_load / self.microbatches


def alive_mask(groups: int, dead: Iterable[int] = ()) -> np.ndarray:
    """Bool [groups] mask with `dead` group ids set False.

    Raises:
        ValueError: `groups` is not a positive integer, or a dead id is not an
            integer in [0, groups).
    """
    groups = checks.integer("groups", groups, low=1)
    ids = list(dead)
    for g in ids:
        checks.integer("dead group id", g, low=0, high=groups - 1)
    mask = np.ones(groups, dtype=bool)
    mask[np.asarray(ids, dtype=np.int64)] = False
    return mask


def _check(placement: Placement, alive: np.ndarray, microbatches: int, policy: str) -> np.ndarray:
    alive = checks.bool_mask("alive", alive, placement.groups)
    checks.integer("microbatches", microbatches, low=1)
    strategies.check_policy(policy, exact=True)
    return alive


def uncovered(placement: Placement, alive: np.ndarray) -> np.ndarray:
    """Shard ids with no live holder (empty when the step can run)."""
    alive = checks.bool_mask("alive", alive, placement.groups)
    return np.flatnonzero(~alive[placement.holders_table].any(axis=1))


def _raise_if_interrupted(placement: Placement, alive: np.ndarray) -> None:
    missing = uncovered(placement, alive)
    if missing.size:
        raise Interruption(missing)


# ---------------------------------------------------------------- any placement


def _first_live_holder(p: Placement, alive: np.ndarray) -> np.ndarray:
    live = alive[p.holders_table]
    return p.holders_table[np.arange(p.shards), np.argmax(live, axis=1)]


def _flow_graph(p: Placement, alive: np.ndarray, units: int, load: int):
    return _flow_graph_caps(p, alive, units, np.where(alive, load, 0))


def _flow_graph_caps(p: Placement, alive: np.ndarray, units: int, caps: np.ndarray):
    """Max-flow source -> shard -> live holder -> sink, with int [G] sink capacities."""
    s, g = p.shards, p.groups
    src, sink = 0, s + g + 1
    shard_ids = np.repeat(np.arange(s), p.redundancy)
    holders = p.holders_table.ravel()
    keep = alive[holders]
    rows = np.concatenate([np.zeros(s, np.int64), 1 + shard_ids[keep], 1 + s + np.arange(g)])
    cols = np.concatenate([1 + np.arange(s), 1 + s + holders[keep], np.full(g, sink)])
    edge_caps = np.concatenate(
        [np.full(s, units), np.full(keep.sum(), units), np.where(alive, caps, 0)]
    ).astype(np.int32)
    import scipy.sparse.csgraph

    graph = scipy.sparse.csr_array((edge_caps, (rows, cols)), shape=(sink + 1, sink + 1))
    return scipy.sparse.csgraph.maximum_flow(graph, src, sink, method="dinic")


def _flow_optimal_load(p: Placement, alive: np.ndarray, m: int):
    units = p.shard_units * m
    total = p.shards * units
    first = _first_live_holder(p, alive)
    lo = max(m, -(-total // int(alive.sum())))
    hi = max(lo, int(np.bincount(first, minlength=p.groups).max()) * units)
    best = None
    while lo < hi:
        mid = (lo + hi) // 2
        result = _flow_graph(p, alive, units, mid)
        if result.flow_value == total:
            hi, best = mid, result
        else:
            lo = mid + 1
    if best is None:
        best = _flow_graph(p, alive, units, lo)
    return lo, best


def _owner_from_flow(p: Placement, flow) -> np.ndarray:
    import scipy.sparse

    s = p.shards
    f = scipy.sparse.coo_array(flow.flow)
    edge = (f.row >= 1) & (f.row <= s) & (f.col > s) & (f.col <= s + p.groups) & (f.data > 0)
    shard, group, amount = f.row[edge] - 1, f.col[edge] - 1 - s, f.data[edge]
    order = np.lexsort((group, shard))
    owners = np.repeat(group[order], amount[order])
    return owners.reshape(s, -1)


def _work_from_owner(p: Placement, alive: np.ndarray, owner: np.ndarray):
    """Loads, slots and counted flags from an owner table; slots in stack order."""
    s, units = owner.shape
    shard = np.repeat(np.arange(s), units)
    micro = np.tile(np.arange(units), s)
    counted_owner = owner.ravel()
    if p.duplicate_work:
        holders = p.holders_table[shard]
        live = alive[holders]
        shard, micro = np.repeat(shard, live.sum(1)), np.repeat(micro, live.sum(1))
        group = holders[live]
        counted = group == np.repeat(counted_owner, live.sum(1))
    else:
        group, counted = counted_owner, np.ones(counted_owner.shape, bool)
    hit = p.holders_table[shard] == group[:, None]
    position = p.holder_positions[shard, np.argmax(hit, axis=1)]
    order = np.argsort((group * p.depth + position) * units + micro, kind="stable")
    group, position, micro, counted = group[order], position[order], micro[order], counted[order]
    loads = np.bincount(group, minlength=p.groups)
    top = int(loads.max())
    starts = np.concatenate([[0], np.cumsum(loads)[:-1]])
    slot = np.arange(group.size) - starts[group]
    work = np.full((p.groups, top, 2), -1, dtype=np.int32)
    work[group, slot, 0] = position
    work[group, slot, 1] = micro
    flags = np.zeros((p.groups, top), dtype=bool)
    flags[group, slot] = counted
    return loads, work, flags


# ---------------------------------------------------------------- public API


def max_load(
    placement: Placement, alive: np.ndarray, microbatches: int = 1, policy: str = "adaptive"
) -> int:
    """The step's maximum load in micro-batches, without building the assignment.

    Raises:
        Interruption: some shard has no live holder.
    """
    alive = _check(placement, alive, microbatches, policy)
    _raise_if_interrupted(placement, alive)
    m = int(microbatches)
    units = placement.shard_units * m
    if placement.duplicate_work:
        return units
    if policy == "fixed":
        first = _first_live_holder(placement, alive)
        return int(np.bincount(first, minlength=placement.groups).max()) * units
    if placement.rings is not None:
        return rings.optimal_load(alive[placement.rings], placement.redundancy, m)
    return _flow_optimal_load(placement, alive, m)[0]


def assign(
    placement: Placement, alive: np.ndarray, microbatches: int = 1, policy: str = "adaptive"
) -> Assignment:
    """Assign every (shard, micro-batch) to exactly one live holder.

    Args:
        placement: who holds which shard.
        alive: bool [G] live mask.
        microbatches: m, micro-batches per shard in failure-free units.
        policy: "adaptive" minimises the maximum load exactly; "fixed" gives each
            shard whole to its first live holder in stack order.

    Raises:
        Interruption: some shard has no live holder (never a partial assignment).
    """
    alive = _check(placement, alive, microbatches, policy)
    _raise_if_interrupted(placement, alive)
    m = int(microbatches)
    units = placement.shard_units * m
    if placement.duplicate_work or policy == "fixed":
        owner = np.repeat(_first_live_holder(placement, alive)[:, None], units, axis=1)
        loads, work, counted = _work_from_owner(placement, alive, owner)
    elif placement.rings is not None:
        load = rings.optimal_load(alive[placement.rings], placement.redundancy, m)
        owner, loads, work = rings.sweep(placement, alive, m, load)
        counted = work[:, :, 0] >= 0
    else:
        _, flow = _flow_optimal_load(placement, alive, m)
        owner = _owner_from_flow(placement, flow)
        loads, work, counted = _work_from_owner(placement, alive, owner)
    alive = alive.copy()
    for array in (owner, loads, work, counted, alive):
        array.setflags(write=False)
    return Assignment(placement, alive, m, policy, owner, loads, int(loads.max()), work, counted)


# ---------------------------------------------------------------- speed-aware assignment

# Slack added to T * s_g before flooring, so that T = k / s_g gives group g exactly k
# micro-batches despite rounding.
_SPEED_TOL = 1e-9
# The makespan search lists the candidates k / s left in its bracket once they are this few.
_MAX_LISTED = 1 << 16


def _check_speeds(placement: Placement, speeds: object, microbatches: int) -> np.ndarray:
    """`speeds` as float64 [G], or ValueError naming what is wrong."""
    checks.integer("microbatches", microbatches, low=1)
    g = placement.groups
    values = np.asarray(speeds)
    if values.dtype == bool or not (
        np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)
    ):
        raise ValueError(
            f"speeds must be a real-valued array of shape ({g},), got {values.dtype} {values.shape}"
        )
    if values.shape != (g,):
        raise ValueError(f"speeds must have shape ({g},), one per group; got {values.shape}")
    values = values.astype(np.float64)
    bad = ~np.isfinite(values)
    if bad.any():
        first = int(np.argmax(bad))
        raise ValueError(f"speeds must be finite; group {first} has speed {values[first]}")
    if (values < 0).any():
        first = int(np.argmax(values < 0))
        raise ValueError(
            f"speeds must be >= 0 (0 marks a dead group); group {first} has speed {values[first]:g}"
        )
    return values


def _speed_caps(speeds: np.ndarray, t: float, limit: int) -> np.ndarray:
    """Capacities floor(t * s + tolerance) of groups of speeds `speeds`, at most `limit`."""
    return np.floor(np.minimum(t * speeds + _SPEED_TOL, limit)).astype(np.int64)


def _snap(rates: np.ndarray, t: float, limit: int) -> float:
    """The largest candidate k / s (s in `rates`) not above the caps of `t`.

    Its caps are at least those of `t`, so it is feasible whenever `t` is.
    """
    return float(np.max(_speed_caps(rates, t, limit) / rates))


def _count_between(rates: np.ndarray, limit: int, lo: float, hi: float) -> float:
    """How many k / s lie strictly between `lo` and `hi` (s in `rates`, k in 1..limit), with
    repeats, up to rounding at the ends."""
    first = np.maximum(np.floor(lo * rates) + 1.0, 1.0)
    last = np.minimum(np.ceil(hi * rates) - 1.0, float(limit))
    return float(np.maximum(last - first + 1.0, 0.0).sum())


def _list_between(rates: np.ndarray, limit: int, lo: float, hi: float) -> np.ndarray:
    """Sorted distinct k / s strictly between `lo` and `hi` (s in `rates`, k in 1..limit)."""
    below = np.floor(lo * rates)
    above = np.ceil(hi * rates)
    first = np.maximum(below + 1.0, 1.0)
    count = np.maximum(np.minimum(above - 1.0, float(limit)) - first + 1.0, 0.0).astype(np.int64)
    ends = np.cumsum(count)
    k = np.repeat(first, count) + (np.arange(int(ends[-1])) - np.repeat(ends - count, count))
    # The ends, rounded the other way, may still fall strictly inside.
    edges = np.concatenate([below, above])
    edge_rates = np.concatenate([rates, rates])
    keep = (edges >= 1) & (edges <= limit)
    values = np.concatenate([k / np.repeat(rates, count), edges[keep] / edge_rates[keep]])
    return np.unique(values[(values > lo) & (values < hi)])


def _smallest_makespan(feasible, rates: np.ndarray, limit: int, lo: float, hi: float) -> float:
    """Smallest candidate k / s (s in `rates`, k in 1..limit) at which `feasible` holds.

    `hi` is a feasible candidate and no candidate at or below `lo` is feasible.
    While the bracket holds more than `_MAX_LISTED` candidates, bisect on T as a
    float (a feasible midpoint snaps down to a candidate); then list the rest
    and bisect over them.
    """
    while _count_between(rates, limit, lo, hi) > _MAX_LISTED:
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if not feasible(mid):
            lo = mid
            continue
        snapped = _snap(rates, mid, limit)
        if snapped >= hi:  # the bracket is within the tolerance: list what is left
            break
        hi = snapped
    listed = _list_between(rates, limit, lo, hi)
    a, b = 0, listed.size
    while a < b:
        mid = (a + b) // 2
        if feasible(float(listed[mid])):
            b = mid
        else:
            a = mid + 1
    return float(listed[a]) if a < listed.size else hi


def _speed_optimum(p: Placement, speeds: np.ndarray, m: int) -> float:
    """The optimal makespan; every shard must have a live holder."""
    alive = speeds > 0
    live = speeds[alive]
    units = p.shard_units * m
    if p.duplicate_work:
        return float(units / live.min())
    limit = p.depth * units
    total = p.shards * units
    # Upper bound: each shard whole to its first live holder (a feasible candidate).
    fixed = np.bincount(_first_live_holder(p, alive), minlength=p.groups)[alive] * units
    hi = float(np.max(fixed / live))
    if not np.isfinite(hi):
        raise ValueError("speeds span too wide a range: a makespan overflows a float")
    # Lower bound: below it the capacities add up to less than the work.
    lo = max(0.0, (total - live.size * _SPEED_TOL) / float(live.sum())) * (1.0 - 1e-9)
    if p.rings is not None:
        speed2d = speeds[p.rings]
        n, r = p.rings.shape[1], p.redundancy

        def feasible(t: float) -> bool:
            cap2d = _speed_caps(speed2d, t, limit)
            if np.any(cap2d.sum(axis=1) < n * m):
                return False
            return bool(rings.carry_caps(cap2d, m).max() <= (r - 1) * m)

    else:

        def feasible(t: float) -> bool:
            caps = _speed_caps(speeds, t, limit)
            return _flow_graph_caps(p, alive, units, caps).flow_value == total

    return _smallest_makespan(feasible, np.unique(live), limit, lo, hi)


def makespan(placement: Placement, speeds: np.ndarray, microbatches: int = 1) -> float:
    """The step's optimal makespan with groups of different speeds.

    Args:
        placement: who holds which shard.
        speeds: float [G] relative throughput of each group (1 = nominal, 0 = dead).
        microbatches: m, micro-batches per shard in failure-free units.

    Returns:
        min over exact assignments of max_g load_g / speeds[g], in units of one
        micro-batch at nominal speed; one of the values k / speeds[g].

    Raises:
        ValueError: `speeds` is not G finite values >= 0, or `microbatches` < 1.
        Interruption: some shard has no holder of speed > 0.
    """
    speeds = _check_speeds(placement, speeds, microbatches)
    _raise_if_interrupted(placement, speeds > 0)
    return _speed_optimum(placement, speeds, int(microbatches))


def assign_by_speed(placement: Placement, speeds: np.ndarray, microbatches: int = 1) -> Assignment:
    """Assign every (shard, micro-batch) to one holder of speed > 0, minimising the makespan.

    Group g computes at most floor(T * speeds[g]) micro-batches (up to a 1e-9
    tolerance) at the optimal makespan T = `makespan(...)`, so
    max_g loads[g] / speeds[g] == T. Equal speeds give the loads of
    `assign(placement, speeds > 0, microbatches)`; a speed of 0 is a dead group.
    Replication ignores speeds beyond that: every live member computes its set's
    shard, and the makespan is r m over the slowest live speed.

    The returned `Assignment` has policy "adaptive" and `alive == (speeds > 0)`.

    Raises:
        ValueError: `speeds` is not G finite values >= 0, or `microbatches` < 1.
        Interruption: some shard has no holder of speed > 0.
    """
    speeds = _check_speeds(placement, speeds, microbatches)
    alive = speeds > 0
    _raise_if_interrupted(placement, alive)
    m = int(microbatches)
    t = _speed_optimum(placement, speeds, m)
    units = placement.shard_units * m
    if placement.duplicate_work:
        owner = np.repeat(_first_live_holder(placement, alive)[:, None], units, axis=1)
        loads, work, counted = _work_from_owner(placement, alive, owner)
    else:
        caps = _speed_caps(speeds, t, placement.depth * units)
        if placement.rings is not None:
            owner, loads, work = rings.sweep_caps(placement, caps, m)
            counted = work[:, :, 0] >= 0
        else:
            flow = _flow_graph_caps(placement, alive, units, caps)
            if flow.flow_value != placement.shards * units:
                raise AssertionError(f"max-flow infeasible at the optimal makespan {t}: bug")
            owner = _owner_from_flow(placement, flow)
            loads, work, counted = _work_from_owner(placement, alive, owner)
    for array in (owner, loads, work, counted, alive):
        array.setflags(write=False)
    return Assignment(
        placement, alive, m, "adaptive", owner, loads, int(loads.max()), work, counted
    )

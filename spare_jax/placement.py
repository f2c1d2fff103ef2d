"""Placements: which data-parallel groups hold which data shards.

A placement fixes, for every group, its *stack*: the shards whose data it loads
each step, in stack order (position 0 is the shard it computes when nobody has
failed). Inverting the stacks gives each shard's *holders* in priority order:
the group holding the shard at stack position 0 first, then position 1, ...

Stacking placements (cyclic, strided, domain-aware) are all *ring* placements:
along some ordering of the groups (a ring), the group at ring position p holds
the shards of ring positions p, p+1, ..., p+r-1, with shard ids equal to group
ids. Several disjoint rings are allowed (one per data-axis coordinate in the
mesh). `reorder` solves ring placements with a vectorised interval algorithm;
any other placement goes through max-flow.

Replication is the other kind: G/r disjoint sets of r groups, every member of a
set holding the set's single shard, which is r times larger than a stacking
shard (so the global batch is the same). Every live member computes the whole
shard: that is what replication costs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from spare_jax import checks

__all__ = [
    "Placement",
    "cyclic",
    "data_parallel",
    "domain_aware",
    "from_stacks",
    "replication",
    "strided",
]


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Who holds which shard.

    Attributes:
        kind: "cyclic", "strided", "domain_aware", "replication", "data_parallel"
            or "custom".
        groups: number of groups G.
        redundancy: r, the number of groups holding each shard.
        stacks: int [G, depth] shard ids of each group in stack order (depth is r
            for stacking, 1 for replication).
        holders_table: int [S, r] group ids of each shard in priority order.
        holder_positions: int [S, r] the stack position at which
            `holders_table[s, k]` holds shard s.
        shard_units: micro-batches per shard, in units of the failure-free
            per-group micro-batch count m (1 for stacking, r for replication).
        duplicate_work: True for replication: every live holder computes the whole
            shard, not a share of it.
        rings: int [n_rings, ring_len] group ids in ring order for ring placements,
            else None.
    """

    kind: str
    groups: int
    redundancy: int
    stacks: np.ndarray
    holders_table: np.ndarray
    holder_positions: np.ndarray
    shard_units: int = 1
    duplicate_work: bool = False
    rings: np.ndarray | None = None

    @property
    def shards(self) -> int:
        """Number of shards S (G for stacking, G / r for replication)."""
        return int(self.holders_table.shape[0])

    @property
    def depth(self) -> int:
        """Stack depth: shards loaded per group."""
        return int(self.stacks.shape[1])

    def holders(self, shard: int) -> np.ndarray:
        """The r group ids holding `shard`, in priority order."""
        _check_index("shard", shard, self.shards)
        return self.holders_table[shard]

    def stack(self, group: int) -> np.ndarray:
        """The shard ids `group` holds, in stack order."""
        _check_index("group", group, self.groups)
        return self.stacks[group]

    def __repr__(self) -> str:
        ring = "" if self.rings is None else f", rings={self.rings.shape[0]}x{self.rings.shape[1]}"
        return f"Placement({self.kind}, groups={self.groups}, redundancy={self.redundancy}{ring})"


def _check_index(name: str, value: int, bound: int) -> None:
    if not isinstance(value, numbers.Integral) or not 0 <= value < bound:
        raise IndexError(f"{name} must be an integer in [0, {bound}), got {value!r}")


def _check_sizes(groups: object, redundancy: object) -> tuple[int, int]:
    g = checks.integer("groups", groups, low=1)
    r = checks.integer("redundancy", redundancy, low=1)
    if r > g:
        raise ValueError(
            f"redundancy r={r} must not exceed groups G={g} (a shard needs r distinct holders)"
        )
    return g, r


def _invert(stacks: np.ndarray, shards: int, redundancy: int) -> tuple[np.ndarray, np.ndarray]:
    """Holders of each shard, ordered by stack position then group id."""
    groups, depth = stacks.shape
    shard = stacks.ravel()
    group = np.repeat(np.arange(groups), depth)
    position = np.tile(np.arange(depth), groups)
    counts = np.bincount(shard, minlength=shards)
    if counts.shape[0] != shards or np.any(counts != redundancy):
        bad = int(np.flatnonzero(counts != redundancy)[0])
        raise ValueError(
            f"every shard must be held by exactly redundancy={redundancy} groups; "
            f"shard {bad} is held by {int(counts[bad])}"
        )
    order = np.lexsort((group, position, shard))
    return group[order].reshape(shards, redundancy), position[order].reshape(shards, redundancy)


def _ring_placement(kind: str, rings: np.ndarray, redundancy: int) -> Placement:
    """Group rings[i, p] holds shards rings[i, p], rings[i, p+1], ... (mod ring length)."""
    n_rings, ring_len = rings.shape
    groups = n_rings * ring_len
    offsets = (np.arange(ring_len)[:, None] + np.arange(redundancy)[None, :]) % ring_len
    stacks = np.empty((groups, redundancy), dtype=np.int64)
    stacks[rings.ravel()] = rings[:, offsets].reshape(groups, redundancy)
    holders, positions = _invert(stacks, groups, redundancy)
    return Placement(
        kind,
        groups,
        redundancy,
        _readonly(stacks),
        _readonly(holders),
        _readonly(positions),
        rings=_readonly(rings.astype(np.int64)),
    )


def cyclic(groups: int, redundancy: int, ring_size: int | None = None) -> Placement:
    """Cyclic stacking: group i holds shards i, i+1, ..., i+r-1 within its ring.

    Args:
        groups: G.
        redundancy: r.
        ring_size: groups per ring (consecutive ids); default one ring of all G.
            In the mesh, a ring is the redundancy axis at one data coordinate.
    """
    g, r = _check_sizes(groups, redundancy)
    n = g if ring_size is None else checks.integer("ring_size", ring_size, low=1)
    if g % n:
        raise ValueError(f"ring_size={n} must divide groups G={g}")
    if r > n:
        raise ValueError(f"redundancy r={r} must not exceed ring_size={n}")
    return _ring_placement("cyclic", np.arange(g).reshape(g // n, n), r)


def _default_stride(groups: int, redundancy: int) -> int:
    """Largest stride <= G/r coprime with G: holders evenly spread, one ring."""
    for s in range(max(groups // redundancy, 1), 0, -1):
        if math.gcd(s, groups) == 1:
            return s
    return 1


def strided(groups: int, redundancy: int, stride: int | None = None) -> Placement:
    """Strided stacking: group i holds shards i, i+s, ..., i+(r-1)s (mod G).

    A shard's holders are s apart, so with s near G/r they sit in different
    racks or pods. The default stride is the largest s <= G/r coprime with G,
    which keeps a single ring.
    """
    g, r = _check_sizes(groups, redundancy)
    s = _default_stride(g, r) if stride is None else checks.integer("stride", stride, low=1)
    d = math.gcd(s, g)
    if g // d < r:
        raise ValueError(
            f"stride={s} gives rings of G/gcd(G, s)={g // d} groups, fewer than redundancy r={r}"
        )
    rings = (np.arange(d)[:, None] + s * np.arange(g // d)[None, :]) % g
    return _ring_placement("strided", rings, r)


def domain_aware(domains: np.ndarray | list[int], redundancy: int) -> Placement:
    """Stacking whose every shard has its r holders in r distinct failure domains.

    Args:
        domains: domain id (rack, switch, pod) of each group.
        redundancy: r.

    The groups are laid on one ring so that any r consecutive ring positions
    fall in distinct domains. That is possible exactly when no domain has more
    than floor(G / r) groups: sort groups by domain (largest domains first),
    fill a matrix of floor(G/r) rows column by column, read it row by row.
    """
    dom = np.asarray(domains)
    if dom.ndim != 1 or dom.size == 0 or not np.issubdtype(dom.dtype, np.integer):
        raise ValueError(f"domains must be a non-empty 1-D integer array, got {domains!r}")
    g, r = _check_sizes(dom.size, redundancy)
    ids, inverse, sizes = np.unique(dom, return_inverse=True, return_counts=True)
    rows = g // r
    if sizes.max() > rows:
        worst = int(np.argmax(sizes))
        raise ValueError(
            f"domain {ids[worst]} has {sizes[worst]} of G={g} groups; with redundancy r={r} "
            f"a domain may hold at most floor(G/r)={rows} groups for every shard's holders "
            "to fall in distinct domains"
        )
    order = np.lexsort((np.arange(g), inverse, -sizes[inverse]))
    cols = -(-g // rows)
    grid = np.full(rows * cols, -1, dtype=np.int64)
    grid[:g] = order
    ring = grid.reshape(cols, rows).T.ravel()
    ring = ring[ring >= 0]
    placement = _ring_placement("domain_aware", ring[None, :], r)
    holder_domains = dom[placement.holders_table]
    assert all(len(set(row)) == r for row in holder_domains.tolist()), "domain layout bug"
    return placement


def replication(groups: int, redundancy: int) -> Placement:
    """Traditional replication: G/r disjoint sets of r consecutive groups.

    Every member of set k holds shard k, which carries r micro-batch units per
    failure-free unit so the global batch is unchanged; all live members compute
    it in full.
    """
    g, r = _check_sizes(groups, redundancy)
    if g % r:
        raise ValueError(f"replication needs G divisible by r: G={g}, r={r}")
    stacks = (np.arange(g) // r)[:, None]
    holders = np.arange(g).reshape(g // r, r)
    positions = np.zeros_like(holders)
    return Placement(
        "replication",
        g,
        r,
        _readonly(stacks),
        _readonly(holders),
        _readonly(positions),
        shard_units=r,
        duplicate_work=True,
    )


def data_parallel(groups: int) -> Placement:
    """Plain data parallelism: r = 1, each group holds only its own shard."""
    p = cyclic(groups, 1)
    return dataclasses.replace(p, kind="data_parallel")


def from_stacks(stacks: np.ndarray, redundancy: int | None = None) -> Placement:
    """Any stacking placement from an explicit [G, r] table of shard ids (S = G)."""
    st = np.asarray(stacks)
    if st.ndim != 2 or not np.issubdtype(st.dtype, np.integer):
        raise ValueError(f"stacks must be a 2-D integer array [groups, r], got shape {st.shape}")
    g, r = _check_sizes(st.shape[0], st.shape[1] if redundancy is None else redundancy)
    if st.min() < 0 or st.max() >= g:
        raise ValueError(f"shard ids must lie in [0, {g})")
    if any(len(set(row)) != len(row) for row in st.tolist()):
        raise ValueError("a group's stack must not hold the same shard twice")
    holders, positions = _invert(st.astype(np.int64), g, r)
    return Placement(
        "custom", g, r, _readonly(st.astype(np.int64)), _readonly(holders), _readonly(positions)
    )

"""A step's slot table: which local micro-batch each group computes in each slot.

Owns the one encoding of a step's work that the data plane runs on, and the
layout it indexes:

* **Units.** A step's global batch is ``G * m`` units (micro-batches of the
  failure-free per-group size). Shard ``s`` of a placement, with
  ``shard_units * m`` micro-batches, covers units ``s * shard_units * m + j``.
* **Stacks.** Group ``g``'s local input is its stack: its ``depth`` shards in
  stack order, flattened to the local index ``position * shard_units * m + j``
  (`local_index`). `unit_ids` maps every local index back to its unit, so the
  data pipeline and the step agree by construction.
* **Slots.** `Slots` says, per group and slot, which local index to compute
  (``-1``: none) and whether its gradient counts. Each group walks its own
  slots, up to its last filled one (at most ``n_slots``, the busiest load):
  with equal speeds a lighter group only waits sooner at the cross-group sum;
  a slow group given fewer micro-batches (`for_speeds`) finishes sooner.

`for_live_set` is the whole failure path from a live mask to a table:
`spare_jax.reorder` assigns every micro-batch to one live holder (raising
`reorder.Interruption` when a shard has none), and `from_assignment` encodes
it. `drop_and_renormalise` builds the inexact elastic baseline's table.
"""

from __future__ import annotations

import collections
from typing import Any

import flax.struct
import numpy as np

from spare_jax import checks, reorder, strategies
from spare_jax import mesh as mesh_lib
from spare_jax.placement import Placement

__all__ = [
    "Slots",
    "drop_and_renormalise",
    "for_live_set",
    "for_speeds",
    "from_assignment",
    "local_index",
    "stack_size",
    "unit_ids",
]


def stack_size(placement: Placement, microbatches: int) -> int:
    """Local micro-batches per group: ``depth * shard_units * m`` (``r * m`` when stacking)."""
    return placement.depth * placement.shard_units * microbatches


def local_index(
    placement: Placement, microbatches: int, position: np.ndarray, micro: np.ndarray
) -> np.ndarray:
    """Local index of micro-batch ``micro`` of the shard at stack ``position`` (-1 stays -1)."""
    per_shard = placement.shard_units * microbatches
    return np.where(position >= 0, position * per_shard + micro, -1).astype(np.int32)


def unit_ids(placement: Placement, microbatches: int) -> np.ndarray:
    """Global unit of every local micro-batch of every group: int[G, stack_size]."""
    per_shard = placement.shard_units * microbatches
    j = np.arange(per_shard)
    units = placement.stacks[:, :, None] * per_shard + j[None, None, :]
    return units.reshape(placement.groups, -1)


@flax.struct.dataclass
class Slots:
    """One step's work as arrays (host numpy or device), passed to the step as one argument.

    Attributes:
        index: int32[G, L] local micro-batch of each slot, -1 for an empty slot.
        weight: float32[G, L] 1 where the slot's gradient counts (0 for empty
            slots and for replication's redundant copies).
        alive: float32[G] live mask: a dead group's sum is multiplied by 0.
        denom: float32 scalar divisor of the gradient sum: ``G * m`` units for
            an exact step, never the live count.
        n_slots: int32 scalar, the busiest group's load (<= L): no group walks more.
    """

    index: np.ndarray
    weight: np.ndarray
    alive: np.ndarray
    denom: np.ndarray
    n_slots: np.ndarray

    @property
    def max_load(self) -> int:
        """The busiest group's micro-batch count (host int)."""
        return int(self.n_slots)

    @property
    def width(self) -> int:
        """L, the slots the arrays hold (>= max_load once padded)."""
        return int(self.index.shape[1])

    def pad(self, bound: int) -> Slots:
        """The same table with empty slots appended up to ``bound`` (the compiled width)."""
        extra = checks.integer("bound", bound, low=1) - self.width
        if extra < 0:
            raise ValueError(f"bound must be >= the table's width {self.width}, got {bound}")
        return self.replace(
            index=np.pad(self.index, ((0, 0), (0, extra)), constant_values=-1),
            weight=np.pad(self.weight, ((0, 0), (0, extra))),
        )


def from_assignment(assignment: reorder.Assignment) -> Slots:
    """Encode a reorder assignment (exact: ``denom`` is the failure-free unit count)."""
    p, m = assignment.placement, assignment.microbatches
    work = np.asarray(assignment.work)
    return Slots(
        index=local_index(p, m, work[..., 0], work[..., 1]),
        weight=np.asarray(assignment.counted, np.float32),
        alive=np.asarray(assignment.alive, np.float32),
        denom=np.float32(p.shards * p.shard_units * m),
        n_slots=np.int32(assignment.max_load),
    )


def drop_and_renormalise(placement: Placement, alive: np.ndarray, microbatches: int) -> Slots:
    """INEXACT baseline (what elastic systems do): drop dead groups' data, average the rest.

    Every live group does its failure-free work (stack position 0, counted once
    per shard by the shard's first holder); the sum is divided by the number
    of micro-batches actually computed.

    Raises:
        reorder.Interruption: when no group is alive (nothing left to average).
    """
    alive = checks.bool_mask("alive", alive, placement.groups)
    per_group = placement.shard_units * microbatches
    if not alive.any():
        raise reorder.Interruption(np.arange(placement.shards))
    first_holder = np.zeros(placement.groups, bool)
    first_holder[placement.holders_table[:, 0]] = True
    counts = first_holder & alive
    index = np.where(alive[:, None], np.arange(per_group, dtype=np.int32)[None, :], -1)
    weight = np.repeat(counts[:, None], per_group, axis=1).astype(np.float32)
    return Slots(
        index=index.astype(np.int32),
        weight=weight,
        alive=alive.astype(np.float32),
        denom=np.float32(weight.sum()),
        n_slots=np.int32(per_group),
    )


def for_live_set(placement: Placement, alive: np.ndarray, microbatches: int, policy: str) -> Slots:
    """The slot table of a live set under ``policy`` (adaptive, fixed or drop).

    Raises:
        reorder.Interruption: some shard has no live holder (for ``drop``: nobody is alive).
    """
    strategies.check_policy(policy)
    if policy == "drop":
        return drop_and_renormalise(placement, alive, microbatches)
    return from_assignment(reorder.assign(placement, alive, microbatches, policy))


def for_speeds(placement: Placement, speeds: np.ndarray, microbatches: int) -> Slots:
    """The slot table of the fastest exact step at these relative group speeds.

    `reorder.assign_by_speed`: a group of speed 0 is dead, a slow group is
    given fewer micro-batches and walks only those (`step.group_gradients`).

    Raises:
        reorder.Interruption: some shard has no holder of speed > 0.
    """
    return from_assignment(reorder.assign_by_speed(placement, speeds, microbatches))


class Tables:
    """Placed slot tables by live set (and speeds), the newest `size` kept: a live set seen
    before is new arrays from this cache, never a new program.

    ``rows``: the groups of the mesh the tables are placed on (a survivors' mesh holds
    some); ``group`` and ``rep``: the shardings of per-group rows and of scalars.
    """

    def __init__(
        self,
        placement: Placement,
        microbatches: int,
        policy: str,
        rows: np.ndarray,
        group: Any,
        rep: Any,
        size: int = 64,
    ):
        self.placement, self.microbatches, self.policy = placement, microbatches, policy
        self.rows, self._group, self._rep, self.size = rows, group, rep, size
        self._cache: collections.OrderedDict[bytes, tuple[Slots, int, np.ndarray]] = (
            collections.OrderedDict()
        )

    def get(
        self, alive: np.ndarray, speeds: np.ndarray | None, bound: int
    ) -> tuple[Slots, int, np.ndarray, int]:
        """The placed table of ``alive`` (and ``speeds``), its max load, each group's walked
        slots (up to its last filled one), and the slot bound, raised to the table's width
        for a new table that needs more slots than ``bound``.

        Raises:
            reorder.Interruption: some shard has no live holder.
            ValueError: ``alive`` marks live a group that has no devices on this mesh.
        """
        key = alive.tobytes() + (b"" if speeds is None else speeds.tobytes())
        if key in self._cache:
            self._cache.move_to_end(key)
            return (*self._cache[key], bound)
        if alive[np.setdiff1d(np.arange(alive.size), self.rows)].any():
            raise ValueError("alive marks a group live that has no devices on this mesh")
        host = (
            for_live_set(self.placement, alive, self.microbatches, self.policy)
            if speeds is None
            else for_speeds(self.placement, speeds, self.microbatches)
        )
        bound = max(bound, host.width)
        padded = host.pad(bound)
        placed = Slots(
            index=mesh_lib.put(padded.index[self.rows], self._group, own=False),
            weight=mesh_lib.put(padded.weight[self.rows], self._group, own=False),
            alive=mesh_lib.put(padded.alive[self.rows], self._group, own=False),
            denom=mesh_lib.put(padded.denom, self._rep, own=False),
            n_slots=mesh_lib.put(padded.n_slots, self._rep, own=False),
        )
        filled = np.where(padded.index >= 0, np.arange(1, padded.width + 1), 0)
        walked = filled.max(axis=1).astype(np.int32)
        self._cache[key] = (placed, padded.max_load, walked)
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return placed, padded.max_load, walked, bound

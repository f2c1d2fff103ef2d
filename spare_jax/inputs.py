"""A step's input: the rows each process loads, and their placement as the step's stacks.

``batches``, the user's input function, comes in two forms:

* **global**: ``batches(t)`` returns the failure-free global batch of step ``t``
  (``G * m * b`` rows; micro-batch ``(g, j)`` is rows ``[(g*m + j) b, (g*m + j + 1) b)``),
  the same on every process. Simple, and every process reads all of it.
* **per unit**: ``batches(t, units)`` returns only the rows this process needs:
  for each unit id in ``units.ids`` (a unit is one micro-batch of the global
  batch, numbered as above), the rows ``units.rows(b)`` of that unit, as leaves
  shaped ``[len(units.ids), rows, ...]``. A process asks for the units of the
  groups it holds (each group's stack of ``r`` shards) and, when the step splits
  a micro-batch's rows over inner axes (``batch_axes``), only its part of them:
  ``r * m * b / parts`` rows per held group instead of ``G * m * b``. The rows
  must be a pure function of ``(t, unit, row)``, as a per-host loader (a memmap,
  a sharded dataset, a Grain sampler keyed by step and unit) gives them.

A failure needs no new data (every group's stack already holds its ``r``
shards); a rollback or a resume asks for the same units of the same step
again. `load` places either form with `jax.make_array_from_process_local_data`
(per unit) or a callback over the global batch (global form).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["GlobalStacks", "Layout", "Units", "layout", "load", "rows_in", "takes_units"]


@dataclasses.dataclass(frozen=True)
class Units:
    """What a per-unit ``batches(t, units)`` is asked for.

    Attributes:
        step: the step ``t``.
        ids: sorted unit ids (int64): unit ``u`` is micro-batch ``u % m`` of
            shard-unit ``u // m``, rows ``[u*b, (u+1)*b)`` of the global batch.
        part, count, parts: this process needs parts ``[part, part + count)`` of
            ``parts`` equal row ranges of each unit (all of it when
            ``count == parts``).
    """

    step: int
    ids: np.ndarray
    part: int = 0
    count: int = 1
    parts: int = 1

    def rows(self, b: int) -> slice:
        """The rows of a ``b``-row unit this process needs."""
        if b % self.parts:
            raise ValueError(
                f"a micro-batch of {b} rows does not split into {self.parts} equal parts "
                "over the step's batch axes"
            )
        size = b // self.parts
        return slice(self.part * size, (self.part + self.count) * size)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which stacks, units and row parts one process holds of a step's input.

    Attributes:
        groups: the mesh rows (positions in ``step.rows``) this process holds.
        ids: the unit ids of those groups' stacks, sorted and unique.
        index: int[len(groups), S]: position in ``ids`` of every stack entry.
        part, count, parts: as in `Units`.
    """

    groups: np.ndarray
    ids: np.ndarray
    index: np.ndarray
    part: int
    count: int
    parts: int


def takes_units(batches: Callable[..., Any]) -> bool:
    """Whether ``batches`` is the per-unit form (it takes ``t`` and ``units``)."""
    try:
        params = inspect.signature(batches).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) >= 2


def _span(slices: list[slice], size: int) -> tuple[int, int]:
    """``(start, stop)`` covering these slices of an axis of ``size``."""
    ranges = [s.indices(size)[:2] for s in slices]
    return min(a for a, _ in ranges), max(b for _, b in ranges)


def layout(step: Any) -> Layout:
    """This process's share of ``step``'s input (a `spare_jax.train_step.SpareStep`).

    Raises:
        ValueError: a process holds parts of several groups (its devices must
            hold whole groups, or lie inside one group).
    """
    units = step._unit_ids  # int[rows, S]
    rows, stack = units.shape
    parts = int(np.prod([step.mesh.shape[a] for a in step.batch_axes], dtype=np.int64))
    index_map = step.stack_sharding.addressable_devices_indices_map((rows, stack, parts))
    group_slices = [ix[0] for ix in index_map.values()]
    part_slices = [ix[2] for ix in index_map.values()]
    held = sorted(
        {g for s in group_slices for g in range(*s.indices(rows)[:2])},
    )
    lo, hi = _span(part_slices, parts)
    if len(held) > 1 and (lo, hi) != (0, parts):
        raise ValueError(
            f"process {jax.process_index()} holds part of the devices of groups {held}: a "
            "process's devices must hold whole groups or lie inside one group (devices per "
            "process a divisor or a multiple of the devices per group)"
        )
    groups = np.asarray(held, np.int64)
    ids, inverse = np.unique(units[groups], return_inverse=True)
    return Layout(groups, ids, inverse.reshape(len(groups), stack), lo, hi - lo, parts)


def rows_in(batch: Any) -> int:
    """Rows of a global batch (its leaves' leading axis)."""
    leaves = jax.tree.leaves(batch)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _check_units(data: Any, lay: Layout) -> int:
    """The rows per unit a per-unit batch holds, after checking its shape."""
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise ValueError("batches(t, units) must return at least one array")
    shapes = {tuple(np.shape(x)[:2]) for x in leaves}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(
            "batches(t, units) must return leaves shaped [len(units.ids), rows, ...] alike, "
            f"got leading shapes {sorted(shapes)}"
        )
    ((k, rows),) = shapes
    if k != lay.ids.size:
        raise ValueError(
            f"batches(t, units) returned {k} units, but {lay.ids.size} were asked for "
            "(one entry per id in units.ids, in that order)"
        )
    return rows


def load(step: Any, batches: Callable[..., Any], t: int) -> tuple[Any, int]:
    """Step ``t``'s stacks for ``step`` from ``batches`` (either form), and the rows read.

    Raises:
        ValueError: the batch has the wrong shape (named).
    """
    if not takes_units(batches):
        batch = batches(t)
        return step.stacks(batch), rows_in(batch)
    lay = layout(step)
    data = batches(t, Units(int(t), lay.ids.copy(), lay.part, lay.count, lay.parts))
    rows = _check_units(data, lay)
    global_rows = rows * lay.parts // lay.count
    if rows * lay.parts % lay.count:
        raise ValueError(f"{rows} rows per unit do not split into the step's {lay.parts} parts")
    shape0 = (int(step.rows.size), lay.index.shape[1], global_rows)

    def place(x: Any) -> jax.Array:
        local = np.asarray(x)[lay.index]  # [held groups, S, rows, ...]
        shape = (*shape0, *local.shape[3:])
        return jax.make_array_from_process_local_data(step.stack_sharding, local, shape)

    return jax.tree.map(place, data), rows * lay.ids.size


class GlobalStacks:
    """The failure-free global batch laid out as every mesh group's stack, placed on the
    group axis (the global form of ``batches``).

    ``units``: micro-batches in the global batch (``G * m``); ``unit_ids``: int[groups of
    this mesh, stack], the unit at each stack position; ``sharding``: the stacks'.
    """

    def __init__(self, units: int, unit_ids: np.ndarray, sharding: Any):
        self.units, self.unit_ids, self.sharding = units, unit_ids, sharding
        self._gathers: dict[int, Callable[..., Any]] = {}  # device batches, by rows

    def rows_per_unit(self, batch: Any) -> int:
        """b, the rows of one micro-batch, after checking the batch's shape."""
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("batch must hold at least one array")
        sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
        if len(sizes) != 1 or -1 in sizes:
            raise ValueError(f"batch leaves must share one leading (row) axis, got sizes {sizes}")
        (n,) = sizes
        if n < self.units or n % self.units:
            raise ValueError(
                f"batch must have G*m*b rows (a positive multiple of G*m = {self.units}), got {n}"
            )
        return n // self.units

    def __call__(self, batch: Any) -> Any:
        rows = self.rows_per_unit(batch)
        ids = self.unit_ids

        def stack(x: Any) -> jax.Array:
            rest = tuple(np.shape(x)[1:])
            shape = (ids.shape[0], ids.shape[1], rows, *rest)
            if isinstance(x, jax.Array):
                return self._gather(x, rows)
            host = np.asarray(x).reshape(-1, rows, *rest)
            return jax.make_array_from_callback(
                shape,
                self.sharding,
                lambda index: host[ids[index[0]]][(slice(None), *index[1:])],
            )

        return jax.tree.map(stack, batch)

    def _gather(self, x: jax.Array, rows: int) -> jax.Array:
        """A device batch laid out as stacks on device (one compiled gather per row count)."""
        if rows not in self._gathers:
            ids = self.unit_ids
            self._gathers[rows] = jax.jit(
                lambda v: v.reshape(-1, rows, *v.shape[1:])[ids],
                out_shardings=self.sharding,
            )
        return self._gathers[rows](x)

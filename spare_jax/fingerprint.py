"""The batch contract, checked: every holder of a micro-batch computes on the same rows.

``batches(t)`` must be the same global batch on every process. Each shard of
a step has ``r`` holders, often on different processes, and each process fills
its own groups' stacks (`SpareStep.stacks`) from what it was given: a process
that feeds other rows trains without a word until a failure hands its rows to
a survivor. This module compares what the holders really hold.

* `fingerprints`: one ``uint32`` per (mesh group, stack position), computed on
  device from the placed stacks array the step consumes (leaves ``[G, S, b,
  ...]`` split over the group axes), and gathered to every process (``G * S``
  numbers). A fingerprint is a weighted sum of the bits modulo 2**32 with odd
  weights, so two copies that differ in a single element never agree, and it
  is integer arithmetic: every layout and reduction order gives the same value.
* `disagreements`: the micro-batches whose holders' fingerprints differ.
* `check`: raises `errors.BatchMismatch` (one line: the step, the processes)
  when there is any. Every process holds the same numbers, so every process
  reaches the same verdict at the same step.
* `precompile`: the program for stacks of a given shape and layout (a
  survivors' mesh), compiled ahead, so that the check after a recovery does
  not compile (one small program per mesh otherwise).

The trainer checks at the first step of every job (a start or a resume) and
after each recovery and re-join, before the step runs: a wrong update is never
applied, so never checkpointed. A lone process fills every stack from one
batch, so its holders agree by construction: it does not check.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import compile_cache, errors

__all__ = [
    "check",
    "disagreements",
    "fingerprints",
    "forget",
    "mismatch_message",
    "precompile",
    "row_processes",
]

_GOLDEN = 0x9E3779B1  # odd multipliers spread the weights over all 32 bits
_OFFSET = 0x632BE5AB


def _words(x: jax.Array) -> jax.Array:
    """``x`` ([G, S, ...]) as uint32 words [G, S, n], bit for bit."""
    g, s = x.shape[:2]
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size in (4, 8):  # a 64-bit value gives two words
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
        w = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    return w.reshape(g, s, -1)


def _leaf(x: jax.Array, salt: int) -> jax.Array:
    words = _words(x)
    n = words.shape[-1]
    i = jnp.arange(n, dtype=jnp.uint32) + jnp.uint32(salt * n)
    weights = (i * jnp.uint32(_GOLDEN) + jnp.uint32(_OFFSET)) | jnp.uint32(1)
    return jnp.sum(words * weights, axis=-1, dtype=jnp.uint32)


@functools.cache
def _program(mesh: Mesh) -> Any:
    """The fingerprint program whose result every device of ``mesh`` holds."""

    def run(stacks: Any) -> jax.Array:
        leaves = jax.tree.leaves(stacks)
        return sum((_leaf(x, k) for k, x in enumerate(leaves)), jnp.uint32(0))

    return jax.jit(run, out_shardings=NamedSharding(mesh, PartitionSpec()))


_EXECUTABLES: dict[Any, Any] = {}  # compiled programs by the stacks' structure and layout


def _executable(stacks: Any) -> Any:
    """The compiled program for stacks shaped and placed like these (arrays or shapes)."""
    leaves, tree = jax.tree.flatten(stacks)
    if not leaves:
        raise ValueError("stacks must hold at least one array")
    sharding = leaves[0].sharding
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"stacks must be placed on a mesh (NamedSharding), got {sharding!r}")
    key = (tree, tuple((x.shape, np.dtype(x.dtype), x.sharding) for x in leaves))
    if key not in _EXECUTABLES:
        abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        lowered = _program(sharding.mesh).lower(jax.tree.unflatten(tree, abstract))
        devices = list(sharding.mesh.devices.flat)  # a relaunch or replacement loads it
        _EXECUTABLES[key] = compile_cache.compile_lowered(lowered, devices)
    return _EXECUTABLES[key]


def forget() -> None:
    """Drop every program kept here: after a backend reset they belong to the dropped
    client and would keep it alive, with its collectives' threads and connections."""
    _program.cache_clear()
    _EXECUTABLES.clear()


def precompile(stacks: Any) -> None:
    """Compile the program for stacks like these (``jax.ShapeDtypeStruct`` s with shardings)."""
    _executable(stacks)


def fingerprints(stacks: Any) -> np.ndarray:
    """uint32[G, S]: the fingerprint of each mesh group's stack position, on every process.

    Args:
        stacks: a pytree of global arrays ``[G, S, b, ...]`` on one mesh (`SpareStep.stacks`).
    """
    try:
        out = _executable(stacks)(stacks)
    except ValueError as err:  # an AOT executable reports a failed collective as ValueError
        if str(err).startswith(("UNKNOWN:", "INTERNAL:", "DEADLINE_EXCEEDED:", "ABORTED:")):
            raise jax.errors.JaxRuntimeError(str(err)) from None
        raise
    return np.asarray(out.addressable_shards[0].data, np.uint32)


def row_processes(mesh: Mesh) -> list[list[int]]:
    """The processes holding each mesh group's devices (group axes first, in mesh order)."""
    rows = int(np.prod(mesh.devices.shape[:2]))
    flat = mesh.devices.reshape(rows, -1)
    return [sorted({int(d.process_index) for d in row}) for row in flat]


def disagreements(fps: np.ndarray, unit_ids: np.ndarray) -> dict[int, list[list[int]]]:
    """``{unit: [[rows with one value], [rows with another], ...]}`` for each unit whose
    holders differ (rows index ``fps``; ``unit_ids[row, position]`` names each unit)."""
    fps, unit_ids = np.asarray(fps), np.asarray(unit_ids)
    if fps.shape != unit_ids.shape:
        raise ValueError(f"fingerprints {fps.shape} and unit ids {unit_ids.shape} differ in shape")
    out: dict[int, list[list[int]]] = {}
    for unit in np.unique(unit_ids):
        rows, _ = np.nonzero(unit_ids == unit)
        values = fps[unit_ids == unit]
        if np.unique(values).size > 1:
            out[int(unit)] = [sorted(set(rows[values == v].tolist())) for v in np.unique(values)]
    return out


def mismatch_message(
    step: int, found: dict[int, list[list[int]]], processes: list[list[int]], units: int
) -> str:
    """One line: the step, the processes whose copies differ, and the first micro-batch."""
    procs = lambda rows: sorted({p for r in rows for p in processes[r]})
    involved = sorted({p for sides in found.values() for rows in sides for p in procs(rows)})
    unit, sides = next(iter(found.items()))
    copies = "; ".join(f"process(es) {procs(rows)} hold one copy" for rows in sides)
    return (
        f"step {step}: the batch differs across processes {involved}: {len(found)} of {units} "
        f"micro-batch(es) differ between their holders (micro-batch {unit}: {copies}); "
        "batches(t) must return the same global batch on every process"
    )


def check(stacks: Any, unit_ids: np.ndarray, step: int) -> None:
    """Raise `errors.BatchMismatch` unless every micro-batch's holders hold the same rows.

    Args:
        stacks: the placed stacks the step is about to consume (`SpareStep.stacks`).
        unit_ids: int[G, S], the unit at each stack position (``SpareStep._unit_ids``).
        step: the step, for the message.
    """
    fps = fingerprints(stacks)
    found = disagreements(fps, unit_ids)
    if found:
        mesh = jax.tree.leaves(stacks)[0].sharding.mesh
        units = int(np.unique(unit_ids).size)
        raise errors.BatchMismatch(mismatch_message(step, found, row_processes(mesh), units))

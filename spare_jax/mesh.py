"""The device mesh of the data plane, its group layout and its sharding rules.

This module owns three things and nothing else:

1. The mesh. Axes are ``("data", "redundancy", "model")``. A **group** (one
   model replica, the unit of failure) is one ``(data, redundancy)`` coordinate
   and spans every device along ``model``: with mesh shape ``(D, R, M)`` there are
   ``G = D * R`` groups of ``M`` devices each.
2. The group numbering. Group id ``g = data_index * R + redundancy_index``. This is
   exactly the row-major order in which ``PartitionSpec(("data", "redundancy"))``
   splits a leading axis of length ``G``, so an array ``[G, ...]`` with that spec
   puts row ``g`` on group ``g``, and no index shuffling is needed anywhere.
3. The SPARe ring on the mesh (`ring_size`). The redundancy axis is
   the ring: at each data coordinate, the ``R`` groups along ``redundancy`` form one
   cyclic-stacking ring, so group ``(d, k)`` stacks the shards of ``(d, k)``,
   ``(d, k+1)``, ..., ``(d, k+r-1)`` (mod ``R``). Laid across racks, a whole-rack
   failure then costs each ring one member. When ``R < r`` a ring along the
   redundancy axis is too short to hold ``r`` copies, so the whole machine
   becomes one ring of all ``G`` groups in group-id order (with ``D = 1`` the two
   coincide). Replication uses sets of ``r`` consecutive group ids (consecutive
   redundancy coordinates when ``r`` divides ``R``), every member holding the set's
   one shard; plain data parallelism is ``r = 1``.

Logical axis names used by the model and the data are turned into mesh
``PartitionSpec`` s by the small `RULES` table: parameters and optimizer state are
replicated over data/redundancy and sharded over ``model`` on their MLP-hidden
and attention-head dimensions; per-group inputs are split over the groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
    "AXES",
    "GROUP_AXES",
    "RULES",
    "group_coords",
    "group_sharding",
    "logical_spec",
    "make_mesh",
    "num_groups",
    "replicated",
    "ring_size",
]

AXES: tuple[str, str, str] = ("data", "redundancy", "model")
GROUP_AXES: tuple[str, str] = ("data", "redundancy")

# Logical name -> mesh axis (None: replicated).
RULES: dict[str, str | tuple[str, ...] | None] = {
    "groups": GROUP_AXES,
    "vocab": None,
    "embed": None,
    "seq": None,
    "mlp": "model",
    "heads": "model",
    "head_dim": None,
}


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, redundancy, model)`` mesh with automatic sharding propagation.

    Args:
        shape: ``(data, redundancy, model)`` sizes; their product must not exceed the
            number of devices (the first ``prod(shape)`` devices are used).
        devices: devices to use; default ``jax.devices()``.

    Returns:
        The mesh.

    Raises:
        ValueError: on a malformed shape or too few devices.
    """
    dims = tuple(int(s) for s in shape)
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(
            f"mesh shape must be three positive sizes (data, redundancy, model), got {shape!r}"
        )
    devs = list(jax.devices() if devices is None else devices)
    need = int(np.prod(dims))
    if need > len(devs):
        raise ValueError(
            f"mesh {dims} needs {need} devices but only {len(devs)} are available "
            '(on CPU, jax.config.update("jax_num_cpu_devices", N) before JAX starts)'
        )
    # (process, id) order: group g owns devices g*M .. (g+1)*M - 1, so in a
    # multi-process job a process with a multiple of M devices holds whole groups.
    devs = sorted(devs, key=lambda d: (d.process_index, d.id))[:need]
    return Mesh(np.array(devs).reshape(dims), AXES, axis_types=(AxisType.Auto,) * 3)


def num_groups(mesh: Mesh) -> int:
    """``G = data * redundancy``."""
    return int(mesh.shape["data"] * mesh.shape["redundancy"])


def group_coords(group: int, mesh: Mesh) -> tuple[int, int]:
    """``(data_index, redundancy_index)`` of a group id."""
    if not 0 <= group < num_groups(mesh):
        raise IndexError(f"group must lie in [0, {num_groups(mesh)}), got {group}")
    return divmod(int(group), int(mesh.shape["redundancy"]))


def logical_spec(names: Sequence[str | None]) -> PartitionSpec:
    """PartitionSpec of an array whose dimensions carry these logical names."""
    axes = []
    for name in names:
        if name is not None and name not in RULES:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        axes.append(None if name is None else RULES[name])
    return PartitionSpec(*axes)


def group_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of an array whose leading axis is the group axis (length G)."""
    return NamedSharding(mesh, logical_spec(["groups"]))


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding."""
    return NamedSharding(mesh, PartitionSpec())


def ring_size(mesh: Mesh, redundancy: int) -> int | None:
    """Groups per SPARe ring on this mesh: the redundancy axis, or None for one ring of all.

    A ring along the redundancy axis needs at least ``r`` members to give a
    shard ``r`` distinct holders; when it has fewer, the whole machine is one
    ring in group-id order (with ``data = 1`` the two coincide).
    """
    ring = int(mesh.shape["redundancy"])
    return ring if ring >= redundancy else None

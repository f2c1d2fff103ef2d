"""The device mesh of the data plane, its group layout and its sharding rules.

This module owns three things and nothing else:

1. The mesh. Its first two axes, ``data`` and ``redundancy``, are the **group
   axes**, reserved: a **group** (one model replica, the unit of failure) is one
   ``(data, redundancy)`` coordinate. Every axis after them is **inner**: it lies
   inside a group, and its name is the user's (``model``, ``fsdp``, ``tensor``,
   ``sequence``, ...). This is HSDP: data parallelism across groups, any layout
   inside one. With sizes ``(D, R, *inner)`` there are ``G = D * R`` groups of
   ``prod(inner)`` devices each. Devices are laid out in (slice, process, id)
   order, so a group owns a contiguous run of them: in a multi-process job a
   group is one host's devices, several hosts' (a group spanning processes), or
   a process holds several whole groups (the hybrid layout, ICI inside a group
   and DCN across groups on TPU slices).
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

Logical axis names used by the demo LM are turned into mesh ``PartitionSpec`` s by
the small `RULES` table (MLP-hidden and attention-head dimensions over ``model``);
a user's own model names mesh axes in its ``PartitionSpec`` s directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from spare_jax import checks

__all__ = [
    "AXES",
    "GROUP_AXES",
    "RULES",
    "check_batch_axes",
    "check_param_spec",
    "devices_per_group",
    "group_coords",
    "group_devices",
    "group_sharding",
    "inner_axes",
    "logical_spec",
    "make_mesh",
    "num_groups",
    "owning",
    "parse_axes",
    "put",
    "replicated",
    "ring_size",
    "shaped",
]

AXES: tuple[str, str, str] = ("data", "redundancy", "model")  # the three-number form's names
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

MeshShape = Sequence[int] | Mapping[str, int] | Sequence[tuple[str, int]] | str


def parse_axes(shape: MeshShape) -> tuple[tuple[str, int], ...]:
    """``((name, size), ...)`` with the group axes first, from any accepted mesh shape.

    Accepted: three sizes ``(data, redundancy, model)``; a mapping or pairs of
    axis names to sizes; or text ``"data:1,redundancy:4,fsdp:2"``. The group
    axes may be left out (size 1); inner axes keep the order given.

    Raises:
        ValueError: a malformed shape, a repeated axis, a size below 1.
    """
    if isinstance(shape, str):
        pairs = []
        for item in (x.strip() for x in shape.split(",") if x.strip()):
            name, sep, size = item.partition(":")
            if not sep or not name.strip() or not size.strip().lstrip("-").isdigit():
                raise ValueError(
                    f"mesh {shape!r}: each axis is NAME:SIZE, e.g. data:1,redundancy:4,fsdp:2"
                )
            pairs.append((name.strip(), int(size)))
    elif isinstance(shape, Mapping):
        pairs = [(str(k), v) for k, v in shape.items()]
    else:
        items = list(shape)
        if items and all(isinstance(x, tuple | list) and len(x) == 2 for x in items):
            pairs = [(str(k), v) for k, v in items]
        elif len(items) == 3 and all(np.ndim(x) == 0 for x in items):
            pairs = list(zip(AXES, items, strict=True))
        else:
            raise ValueError(
                "mesh shape must be three positive sizes (data, redundancy, model) or "
                f"named axes such as data:1,redundancy:4,fsdp:2; got {shape!r}"
            )
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"mesh shape names an axis twice: {names}")
    for name, size in pairs:
        if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")
    sizes = dict(pairs)
    inner = tuple((n, int(s)) for n, s in pairs if n not in GROUP_AXES)
    group = tuple((n, int(sizes.get(n, 1))) for n in GROUP_AXES)
    return group + (inner or (("model", 1),))


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of the two group axes and any inner axes, with automatic sharding propagation.

    Args:
        shape: ``(data, redundancy, model)`` sizes, or named axes (`parse_axes`):
            ``{"data": 1, "redundancy": 4, "fsdp": 2}`` or ``"data:1,redundancy:4,fsdp:2"``.
            The product of the sizes must not exceed the number of devices (the
            first ``prod(sizes)`` devices in (slice, process, id) order are used).
        devices: devices to use; default ``jax.devices()``.

    Returns:
        The mesh; its axes are ``("data", "redundancy", *inner)``.

    Raises:
        ValueError: on a malformed shape or too few devices.
    """
    axes = parse_axes(shape)
    names = tuple(n for n, _ in axes)
    dims = tuple(s for _, s in axes)
    devs = list(jax.devices() if devices is None else devices)
    need = int(np.prod(dims))
    if need > len(devs):
        raise ValueError(
            f"mesh {dict(axes)} needs {need} devices but only {len(devs)} are available "
            '(on CPU, jax.config.update("jax_num_cpu_devices", N) before JAX starts)'
        )
    # Group g owns devices g*M .. (g+1)*M - 1 of this order (M = prod(inner)): a
    # group is one host's devices, or spans consecutive hosts, never interleaved.
    order = lambda d: (getattr(d, "slice_index", 0) or 0, d.process_index, d.id)
    devs = sorted(devs, key=order)[:need]
    return Mesh(np.array(devs).reshape(dims), names, axis_types=(AxisType.Auto,) * len(names))


def inner_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes inside a group (every axis but ``data`` and ``redundancy``)."""
    return tuple(a for a in mesh.axis_names if a not in GROUP_AXES)


def devices_per_group(mesh: Mesh) -> int:
    """Devices of one group: the product of the inner axes' sizes."""
    return int(np.prod([mesh.shape[a] for a in inner_axes(mesh)], dtype=np.int64))


def group_devices(mesh: Mesh) -> dict[int, list[jax.Device]]:
    """Each group's devices, in mesh order."""
    flat = np.asarray(mesh.devices).reshape(num_groups(mesh), -1)
    return {g: list(row) for g, row in enumerate(flat)}


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


def _spec_axes(spec: PartitionSpec) -> list[tuple[int, tuple[str, ...]]]:
    """``(dimension, mesh axes)`` of each sharded dimension of a spec."""
    return [
        (dim, part if isinstance(part, tuple) else (part,))
        for dim, part in enumerate(spec)
        if part is not None
    ]


def check_param_spec(name: str, spec: Any, shape: tuple[int, ...], mesh: Mesh) -> None:
    """A parameter's spec may use any inner axis of the mesh, once, on a dimension it divides.

    Raises:
        ValueError: naming the leaf and what is wrong with its spec.
    """
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"param_specs{name} must be a PartitionSpec, got {spec!r}")
    if len(spec) > len(shape):
        raise ValueError(
            f"param_specs{name} = {spec} has more entries than the leaf's shape {shape}"
        )
    inner = inner_axes(mesh)
    seen: list[str] = []
    for dim, axes in _spec_axes(spec):
        for axis in axes:
            if axis in GROUP_AXES:
                raise ValueError(
                    f"param_specs{name} = {spec} names the group axis {axis!r}: parameters are "
                    f"replicated over groups; shard them over the inner axes {list(inner)}"
                )
            if axis not in inner:
                raise ValueError(
                    f"param_specs{name} = {spec} names {axis!r}, not an axis of the mesh "
                    f"(inner axes: {list(inner)})"
                )
        seen += axes
        size = int(np.prod([mesh.shape[a] for a in axes]))
        if shape[dim] % size:
            raise ValueError(
                f"param_specs{name} = {spec}: dimension {dim} of size {shape[dim]} does not "
                f"divide over {'x'.join(axes)} = {size} devices"
            )
    if len(set(seen)) != len(seen):
        raise ValueError(f"param_specs{name} = {spec} uses a mesh axis twice")


def check_batch_axes(batch_axes: Any, mesh: Mesh) -> tuple[str, ...]:
    """The inner axes a micro-batch's rows are split over (FSDP-style), checked."""
    axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    inner = inner_axes(mesh)
    for axis in axes:
        if axis in GROUP_AXES or axis not in inner:
            raise ValueError(
                f"batch_axes must name inner axes of the mesh {list(inner)}, got {axis!r} "
                "(the group axes split the batch into stacks already)"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"batch_axes names an axis twice: {axes}")
    return axes


def shaped(params: Any) -> Any:
    """Parameters given as a function of no arguments: the shapes it returns (no compute).

    Raises:
        ValueError: the function takes arguments, or does not trace to arrays.
    """
    if not callable(params):
        return params
    checks.no_arguments("params", params)
    try:
        return jax.eval_shape(params)
    except TypeError as err:  # e.g. it returns something that is not an array
        raise ValueError(f"params(): {str(err).splitlines()[0]}") from err


def put(value: Any, sharding: NamedSharding, *, own: bool = True) -> jax.Array:
    """A fresh placed copy; host values go through a callback so each process sends its shards.

    Device arrays are copied first: `device_put` reuses the source buffer for
    one of the destination shards (even with ``may_alias=False``), and the
    step donates its state, which would delete the caller's array. ``own``:
    never borrow host memory (`owning`), for what a step donates; a value only
    read (the step's slot tables) may skip that check.
    """
    if isinstance(value, jax.Array) and (
        sharding.is_fully_addressable or not value.is_fully_addressable
    ):
        return jax.device_put(value.copy(), sharding)
    host = np.asarray(value)
    placed = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return owning(placed, [host]) if own else placed


def owning(x: jax.Array, hosts: Sequence[np.ndarray]) -> jax.Array:
    """``x``, placed from the host arrays ``hosts``, with device buffers of its own.

    On CPU, placing an aligned host array may borrow its memory instead of
    copying it. A step cannot donate a borrowed buffer: it allocates its
    output beside it, one more copy of the state at the first step after a
    restore or a re-join. Borrowed shards are copied once, on the devices;
    where placing copied already (an accelerator), nothing is.
    """
    spans = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in hosts if h.nbytes]
    try:
        pointers = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
    except (RuntimeError, NotImplementedError):  # a backend that does not say: keep it
        return x
    if not any(lo <= p < hi for p in pointers for lo, hi in spans):
        return x
    # shard by shard: a copy of a global array is a compiled program per shape and
    # layout when the array spans processes, and after a backend reset none is cached
    copies = [jax.device_put(s.data, s.device, may_alias=False) for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)

"""One group's copy of the state to other groups, over the devices (re-join, restore).

A group-replicated state is the same on every group, shard for shard: the
device at inner coordinate ``c`` of any group holds the same pieces of every
leaf. To give a group the state, each device of one live **source** group
streams its pieces, as bytes, to the device at the same inner coordinate of
every receiving group. The stream is cut into fixed chunks of
``chunk_bytes`` per device; one small program, compiled once per transfer
mesh, moves chunks between rows point to point (``ppermute``), as raw
bytes, so every bit of every dtype arrives as sent. Two schedules
(`pipelined` picks the one with fewer chunk-times): a **chain**, where the
rows stand in a line from the source and each collective passes every row's
last chunk one row along (``chunks + rows - 2`` collectives: a large state
streams at about one link's rate, whatever the group count), and
**doubling**, where each chunk reaches every row in ``ceil(log2(rows))``
rounds (a small state to many rows).

Why this shape:

* memory stays proportional to a process's own shards: a sender reads its
  host copy piece by piece, a receiver fills one buffer per device of its
  own pieces; nobody builds a replica it does not hold;
* every collective moves one chunk, so each ends well inside the CPU
  collective timeout (seconds) whatever the state's size, and a transfer's
  time grows with its bytes, not its leaf count;
* the bytes go device to device (Gloo between CPU processes, NCCL on GPU),
  not through the coordination service, whose messages stop near 2 GiB.

`move` is the whole transfer, as the trainer calls it. Its parts: `layout`
(pure), `send_and_receive` (runs the chunks; every process of the transfer
mesh calls it, in step) and `assemble` (a receiver's buffers into arrays
with the state's shardings). Measured in ``benchmarks/state.py``;
docs/checkpointing.md, "Moving the state".
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import math
import mmap
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import compile_cache
from spare_jax import mesh as mesh_lib

__all__ = [
    "CHUNK_BYTES",
    "SCHEDULES",
    "Held",
    "Layout",
    "Moved",
    "Piece",
    "Transfer",
    "assemble",
    "layout",
    "move",
    "pipelined",
    "send_and_receive",
]

CHUNK_BYTES = 8 << 20  # per device and collective (benchmarks/state.py --chunk_mb tries others)
SCHEDULES = ("auto", "chain", "doubling")
_ALIGN = 64  # pieces lie this far apart: a receiver views each in place, never unaligned
_OFF_PAGE = 16  # a receiver's stream starts this far past a page (`host_bytes`)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One leaf's shard as it sits in a device's byte stream."""

    leaf: int
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """What each inner coordinate's stream carries, and where a receiver finds each piece.

    A piece that several devices of one group hold (a leaf replicated over an
    inner axis) travels once, in the stream of one of them, when all of them
    sit on the same process in every row; a receiver places it on the others
    from that stream.
    """

    pieces: dict[int, list[Piece]]  # inner coordinate -> the pieces its stream carries
    find: dict[tuple[int, int], tuple[int, Piece]]  # (leaf, coordinate) -> (carrier, piece)
    grid: np.ndarray  # device ids, [row, inner coordinate]; a row is a group
    chunk_bytes: int
    chunks: int
    at: dict[int, tuple[int, int]]  # device id -> (row, inner coordinate)

    @property
    def stream_bytes(self) -> int:
        """The bytes each device's stream holds: the longest stream, padding included."""
        return self.chunks * self.chunk_bytes

    @property
    def payload_bytes(self) -> int:
        """The bytes of state one group receives (its distinct pieces)."""
        return sum(p.nbytes for stream in self.pieces.values() for p in stream)

    def where(self, device_id: int) -> tuple[int, int]:
        """(row, inner coordinate) of a device of the transfer mesh."""
        return self.at[device_id]


def layout(
    mesh: Mesh,
    abstract: Sequence[Any],
    specs: Sequence[PartitionSpec],
    chunk_bytes: int = CHUNK_BYTES,
) -> Layout:
    """The byte streams of a group-replicated state with these leaves on ``mesh``.

    ``abstract`` holds shapes and dtypes (arrays or ``ShapeDtypeStruct``);
    ``specs`` the leaves' specs, which name inner axes only. The same on
    every process: every one derives the chunk count from it.
    """
    if chunk_bytes <= 0 or chunk_bytes % 4:
        raise ValueError(f"chunk_bytes={chunk_bytes}: a positive multiple of 4")
    devices = mesh.devices.reshape(mesh.devices.shape[0] * mesh.devices.shape[1], -1)
    grid = np.vectorize(lambda d: d.id, otypes=[int])(devices)
    # coordinates may share a piece only where one process holds both in every row
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
    home = {c: tuple(procs[:, c]) for c in range(grid.shape[1])}
    pieces: dict[int, list[Piece]] = {c: [] for c in home}
    find: dict[tuple[int, int], tuple[int, Piece]] = {}
    ends = dict.fromkeys(home, 0)
    for i, (leaf, spec) in enumerate(zip(abstract, specs, strict=True)):
        indices = NamedSharding(mesh, spec).devices_indices_map(tuple(leaf.shape))
        dtype = np.dtype(leaf.dtype)
        carried: dict[tuple[Any, ...], tuple[int, Piece]] = {}
        for c in sorted(home, key=lambda c: ends[c]):  # the shortest stream takes a piece
            index = indices[devices[0, c]]
            key = (home[c], *((s.start, s.stop) for s in index))
            if key not in carried:
                sizes = zip(index, leaf.shape, strict=True)
                shape = tuple(len(range(*s.indices(n))) for s, n in sizes)
                piece = Piece(i, index, shape, dtype, -(-ends[c] // _ALIGN) * _ALIGN)
                pieces[c].append(piece)
                ends[c] = piece.offset + piece.nbytes
                carried[key] = (c, piece)
            find[i, c] = carried[key]
    chunks = max(-(-e // chunk_bytes) for e in ends.values())
    at = {int(d): (r, c) for (r, c), d in np.ndenumerate(grid)}
    return Layout(pieces, find, grid, chunk_bytes, chunks, at)


class Held:
    """A sender's leaf as the shards its process holds, read by a piece's index.

    A process of a group spanning several holds no whole leaf, and needs
    none: its devices stream only the pieces at their own inner coordinates,
    which are its own shards. ``shards`` maps each shard's index, as
    ``(start, stop, step)`` per dimension, to its data (`multihost.own_shards`).
    """

    def __init__(self, shards: dict[tuple, np.ndarray], shape: Sequence[int]):
        self.shape = tuple(shape)
        self._by = {self._key([slice(*k) for k in key]): v for key, v in shards.items()}

    def _key(self, index: Sequence[slice]) -> tuple:
        return tuple(s.indices(n) for s, n in zip(index, self.shape, strict=True))

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        try:
            return self._by[self._key(index)]
        except KeyError:
            raise ValueError(f"this process holds no shard at {index} of a {self.shape} leaf")

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._by.values())


def host_bytes(nbytes: int, *, borrowable: bool) -> np.ndarray:
    """A zeroed uint8 buffer of ``nbytes`` in ordinary private pages, for a transfer's bytes.

    Not a NumPy array, which asks the kernel for transparent huge pages from
    4 MiB up: the transfer ran faster in ordinary pages (measured end to end
    together with the placement below, by the benchmarks named at the end).

    ``borrowable``: start on a page boundary, so that placing it on a CPU
    device borrows it (a sender's chunk, read where it is). Otherwise start
    16 bytes past one, so that placing a piece copies it at once (a
    receiver's stream) instead of borrowing it and copying it again on the
    device (`mesh.owning`: a borrowed buffer cannot be donated). Pieces sit
    64 bytes apart (``_ALIGN``), so every one stays aligned for any dtype of
    up to 16 bytes. What the two choices gave a re-join together:
    ``benchmarks/state.py`` and ``benchmarks/rejoin_state.py``
    (docs/checkpointing.md, "Moving the state").
    """
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # nothing to map, or no way to
        return np.zeros(nbytes, np.uint8)
    skip = 0 if borrowable else _OFF_PAGE
    pages = mmap.mmap(-1, nbytes + skip, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(pages, np.uint8, count=nbytes, offset=skip)


def _stream(pieces: Sequence[Piece], host: Sequence[Any], chunk_bytes: int):
    """A sender's chunks for one device: its pieces' bytes in order, zero padding between.

    Each chunk is a new buffer: placing it may borrow it (CPU) or finish
    copying it after the call returns, so none is written once yielded.
    """
    fresh = functools.partial(host_bytes, chunk_bytes, borrowable=True)
    buf, pos = fresh(), 0
    for p in pieces:
        src = np.ascontiguousarray(host[p.leaf][p.index]).reshape(-1).view(np.uint8)
        at = p.offset - pos  # where it starts, relative to the current chunk
        while at >= chunk_bytes:
            yield buf
            buf, at, pos = fresh(), at - chunk_bytes, pos + chunk_bytes
        done = 0
        while done < src.size:
            n = min(src.size - done, chunk_bytes - at)
            buf[at : at + n] = src[done : done + n]
            done, at = done + n, at + n
            if at == chunk_bytes:
                yield buf
                buf, at, pos = fresh(), 0, pos + chunk_bytes
    while True:  # the padding after the last piece, up to the common chunk count
        yield buf
        buf = fresh()


def _rounds(rows: int, source_row: int) -> list[list[tuple[int, int]]]:
    """Doubling: in each round every row that has the chunk sends it to one that has not."""
    holders, waiting, rounds = [source_row], [r for r in range(rows) if r != source_row], []
    while waiting:
        pairs = list(zip(holders, waiting, strict=False))
        rounds.append(pairs)
        holders, waiting = holders + [b for _, b in pairs], waiting[len(pairs) :]
    return rounds


def _chain(rows: int, source_row: int) -> list[int]:
    """The rows in the order a pipelined transfer passes the chunks along: the source first."""
    return [source_row, *(r for r in range(rows) if r != source_row)]


def pipelined(chunks: int, rows: int) -> bool:
    """Whether passing chunks along a chain beats doubling each chunk, in chunk-times.

    Doubling sends each chunk through ``ceil(log2 rows)`` rounds, one chunk
    after another: ``chunks x rounds``. The chain moves every chunk one link
    per collective, all links at once: ``chunks + rows - 2`` collectives. Many
    chunks (a large state) take the chain; a small state to many groups takes
    the doubling.
    """
    return rows > 2 and chunks + rows - 2 < chunks * math.ceil(math.log2(rows))


def _program(mesh: Mesh, source_row: int, chain: bool) -> tuple[Any, NamedSharding]:
    """One collective of the transfer: a chunk doubled from the source row to every row in
    ceil(log2(rows)) point-to-point rounds, or (``chain``) every row's chunk one row along."""
    inner = mesh_lib.inner_axes(mesh)
    spec = PartitionSpec(mesh_lib.GROUP_AXES, inner or None, None)
    rows = mesh.devices.shape[0] * mesh.devices.shape[1]

    def double(x: jax.Array) -> jax.Array:
        row = jax.lax.axis_index(mesh_lib.GROUP_AXES)
        for pairs in _rounds(rows, source_row):
            got = jax.lax.ppermute(x, mesh_lib.GROUP_AXES, pairs)
            x = jnp.where(jnp.isin(row, jnp.array([b for _, b in pairs])), got, x)
        return x

    def along(x: jax.Array) -> jax.Array:
        order = _chain(rows, source_row)
        return jax.lax.ppermute(x, mesh_lib.GROUP_AXES, list(itertools.pairwise(order)))

    sharding = NamedSharding(mesh, spec)
    program = jax.shard_map(along if chain else double, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(program, out_shardings=sharding), sharding


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer as a process saw it: a group's bytes of state, seconds, chunks."""

    bytes: int
    seconds: float
    compile_s: float
    chunks: int

    @property
    def rate(self) -> float:
        """Bytes of state per second into each receiving group."""
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def send_and_receive(
    mesh: Mesh,
    plan: Layout,
    source_row: int,
    host: Sequence[Any] | None,
    schedule: str = "auto",
    scope: str | None = None,
) -> tuple[dict[int, np.ndarray], Transfer]:
    """Run the transfer; every process with a device on ``mesh`` calls it.

    A process of the source row passes its host copy of the leaves
    (``host``: whole arrays, or its own shards of each as `Held`) and gets
    ``{}``; a receiver passes ``None`` and gets each of its devices' stream
    (device id -> bytes). Rows other than the source
    send zeros. ``schedule``: ``auto`` (`pipelined` decides), ``chain`` or
    ``doubling``; every process passes the same. ``scope``: where the
    program is kept to load untraced (`compile_cache.compile_scoped`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: one of {SCHEDULES}")
    words = plan.chunk_bytes // 4
    shape = (*plan.grid.shape, words)
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    senders = [d for d in mine if plan.where(d.id)[0] == source_row]
    if senders and host is None:
        raise ValueError("this process holds the source group: pass its host copy")
    streams = {
        d.id: _stream(plan.pieces[plan.where(d.id)[1]], host, plan.chunk_bytes) for d in senders
    }
    received = {
        d.id: host_bytes(plan.stream_bytes, borrowable=False) for d in mine if d not in senders
    }
    rows = plan.grid.shape[0]
    chain = pipelined(plan.chunks, rows) if schedule == "auto" else schedule == "chain"
    # a receiver gets chunk k at collective k + lag: 0 when doubling, its place
    # in the chain less one when chained
    order = _chain(rows, source_row)
    lag = {d.id: order.index(plan.where(d.id)[0]) - 1 if chain else 0 for d in mine}
    collectives = plan.chunks + (rows - 2 if chain else 0)
    start = time.perf_counter()
    program, sharding = _program(mesh, source_row, chain)
    arg = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    compiled = compile_cache.compile_scoped(
        scope,
        f"broadcast/{source_row}/{'chain' if chain else 'doubling'}",
        arg,
        list(mesh.devices.flat),
        lambda: program.lower(arg),
    )
    compile_s = time.perf_counter() - start
    nothing = {d.id: jax.device_put(np.zeros((1, 1, words), np.int32), d) for d in mine}

    def keep(k: int, out: jax.Array) -> None:
        for shard in out.addressable_shards:
            d = shard.device.id
            chunk = k - lag[d]
            if d in received and 0 <= chunk < plan.chunks:
                at = chunk * plan.chunk_bytes
                data = np.asarray(shard.data).reshape(-1).view(np.uint8)
                received[d][at : at + plan.chunk_bytes] = data

    held = dict(nothing)  # a receiver's input: what it got last (chained), passed on as is
    pending = None  # collective k runs while k - 1 is read back and k + 1 is packed
    for k in range(collectives):
        blocks = [
            jax.device_put(next(streams[d.id]).view(np.int32).reshape(1, 1, words), d)
            if d.id in streams
            else held[d.id]
            for d in mine
        ]
        out = compiled(jax.make_array_from_single_device_arrays(shape, sharding, blocks))
        if chain:
            held = {sh.device.id: sh.data for sh in out.addressable_shards}
        if pending is not None:
            keep(*pending)
        pending = (k, out)
    if pending is not None:
        keep(*pending)
        pending[1].block_until_ready()
    seconds = time.perf_counter() - start - compile_s
    return received, Transfer(plan.payload_bytes, seconds, compile_s, plan.chunks)


def assemble(
    plan: Layout,
    received: dict[int, np.ndarray],
    abstract: Sequence[Any],
    shardings: Sequence[NamedSharding],
) -> list[jax.Array]:
    """A receiver's leaves, on ``shardings`` (the live mesh's), from its devices' streams.

    The devices must be the transfer's (same ids, same inner coordinates).
    Each piece is a view into its stream, placed on its device; the leaves
    are ready when this returns, so the streams can go before the next
    program runs (placing copies in the background: else the streams, their
    copies and the step's buffers would be alive at once). Once a leaf is
    placed, the pages of each stream that no later leaf reads go back to the
    system (`_release`), so a receiver holds about one state, not its bytes
    and its arrays both, and its new arrays reuse the pages just freed.
    """
    wanted = []  # wanted[i]: the (stream, piece) each of leaf i's devices reads
    for i, sharding in enumerate(shardings):
        wanted.append([])
        for device in sharding.addressable_devices:
            row, coord = plan.where(device.id)
            carrier, piece = plan.find[i, coord]
            wanted[i].append((int(plan.grid[row, carrier]), piece))
    unread = []  # unread[i]: per stream, the first byte that a leaf after i reads
    first = {stream: data.nbytes for stream, data in received.items()}
    for pieces in reversed(wanted):
        unread.insert(0, dict(first))
        for stream, piece in pieces:
            first[stream] = min(first[stream], piece.offset)
    leaves, freed = [], dict.fromkeys(received, 0)
    for i, (leaf, sharding) in enumerate(zip(abstract, shardings, strict=True)):
        parts = []
        for device, (stream, piece) in zip(sharding.addressable_devices, wanted[i], strict=True):
            raw = received[stream][piece.offset : piece.offset + piece.nbytes]
            parts.append(jax.device_put(raw.view(piece.dtype).reshape(piece.shape), device))
        placed = jax.make_array_from_single_device_arrays(tuple(leaf.shape), sharding, parts)
        leaves.append(jax.block_until_ready(mesh_lib.owning(placed, list(received.values()))))
        for stream, data in received.items():
            freed[stream] = _release(data, freed[stream], unread[i][stream])
    return leaves


def _release(data: np.ndarray, start: int, upto: int) -> int:
    """Give the whole pages of ``data`` (a `host_bytes` buffer) from mapping offset ``start``
    (a page boundary) to before byte ``upto`` of ``data`` back to the system; reading them
    again gives zeros. Returns where the next release starts. Other buffers: nothing."""
    pages = getattr(data.base, "obj", data.base)  # NumPy keeps a memoryview of the mapping
    skip = len(pages) - data.nbytes if isinstance(pages, mmap.mmap) else -1
    if skip not in (0, _OFF_PAGE) or not hasattr(mmap, "MADV_DONTNEED"):
        return start
    end = (skip + upto) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        pages.madvise(mmap.MADV_DONTNEED, start, end - start)
    return max(start, end)


@dataclasses.dataclass(frozen=True)
class Moved:
    """A transfer as one process saw it."""

    bytes: int  # the state's bytes each receiving group got (the same on every process)
    transfer: Transfer | None  # None: this process has no device on the transfer mesh
    leaves: list[jax.Array] | None  # a receiver's leaves, on the abstract leaves' shardings


def move(
    mesh: Mesh,
    source_row: int,
    abstract: Sequence[Any],
    host: Sequence[Any] | None,
    chunk_bytes: int = CHUNK_BYTES,
    schedule: str = "auto",
    scope: str | None = None,
) -> Moved:
    """Send the source row's state to the other rows of ``mesh``: the whole transfer.

    ``abstract`` leaves carry the shardings the receivers' arrays go on (of a
    mesh over the same devices, or more); the source row's processes pass
    their host copy (whole leaves, or their own shards as `Held`). Any
    process may call it: one with no device on ``mesh`` only learns the byte
    count.
    """
    specs = [a.sharding.spec for a in abstract]
    plan = layout(mesh, abstract, specs, chunk_bytes)
    if jax.process_index() not in {d.process_index for d in mesh.devices.flat}:
        return Moved(plan.payload_bytes, None, None)
    received, transfer = send_and_receive(mesh, plan, source_row, host, schedule, scope)
    shardings = [a.sharding for a in abstract]
    leaves = assemble(plan, received, abstract, shardings) if received else None
    del received
    _release_freed_memory()
    return Moved(plan.payload_bytes, transfer, leaves)


def _release_freed_memory() -> None:
    """Hand the transfer's freed chunks back to the system.

    glibc keeps freed blocks below its mmap threshold (which grows to 32 MB)
    in the process's heaps: without this, a sender's 8 MB chunks stayed in
    its resident memory after the transfer, 0.4-0.75 of a 512 MB state above
    its peers' peak for the rest of the run. Elsewhere (not glibc) there is
    nothing to do.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass

"""`spare_jax.broadcast`: one group's state to other groups over the devices, bit for bit.

One process, 8 simulated devices as 4 groups of 2: the source row's devices
send, the others receive, exactly as between processes (the multi-process
path is `test_rejoin.py`'s and ``benchmarks/state.py``'s).
"""

from __future__ import annotations

import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spare_jax import broadcast, multihost
from spare_jax import mesh as mesh_lib


def _mesh():
    return mesh_lib.make_mesh((1, 4, 2), jax.devices()[:8])


def _leaves(rng: np.random.Generator):
    """Every kind of leaf a state holds: sharded, replicated, 0-d, empty, odd dtypes and bits."""
    odd = np.array([-0.0, np.nan, np.inf, -np.inf], np.float32)
    odd_bits = odd.view(np.uint32).copy()
    odd_bits[1] |= 0x1234  # a NaN with a payload: only a byte copy keeps it
    return [
        (rng.normal(size=(6, 8)).astype(np.float32), P(None, "model")),
        (rng.normal(size=(10,)).astype(ml_dtypes.bfloat16), P("model")),
        (np.array(rng.integers(1 << 30), np.int32), P()),
        (rng.integers(0, 2, size=(5,)).astype(bool), P()),
        (odd_bits.view(np.float32), P()),
        (np.zeros((0, 4), np.float32), P()),
        (rng.integers(0, 255, size=(3, 7)).astype(np.uint8), P()),
    ]


def _run(
    source_group: int,
    receivers: list[int],
    chunk_bytes: int,
    seed: int = 0,
    schedule: str = "auto",
    held: bool = False,
):
    """``held``: the source sends from its own shards only (`broadcast.Held`), as a process
    of a group spanning several does, not from whole host arrays."""
    mesh = _mesh()
    by_group = multihost.group_devices(mesh)
    groups = sorted({source_group, *receivers})
    moving = multihost.survivors_mesh(by_group, groups, mesh)
    pairs = _leaves(np.random.default_rng(seed))
    leaves, specs = [x for x, _ in pairs], [s for _, s in pairs]
    plan = broadcast.layout(moving, leaves, specs, chunk_bytes)
    host = [_held(x, s, mesh, by_group[source_group]) for x, s in pairs] if held else leaves
    received, transfer = broadcast.send_and_receive(
        moving, plan, groups.index(source_group), host, schedule
    )
    target = multihost.survivors_mesh(by_group, receivers, mesh)
    shardings = [NamedSharding(target, s) for s in specs]
    out = broadcast.assemble(plan, received, leaves, shardings)
    return leaves, out, plan, transfer


def _held(x: np.ndarray, spec, mesh, devices) -> broadcast.Held:
    """The shards of ``x`` (placed on ``mesh``) that ``devices`` hold, and nothing else."""
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    mine = [s for s in placed.addressable_shards if s.device in devices]
    shards = {tuple((i.start, i.stop, i.step) for i in s.index): np.asarray(s.data) for s in mine}
    return broadcast.Held(shards, x.shape)


@settings(max_examples=12, deadline=None)
@given(
    source=st.integers(0, 3),
    others=st.sets(st.integers(0, 3), min_size=1, max_size=3),
    words=st.integers(1, 64),
)
def test_every_receiving_group_gets_every_bit_of_every_leaf(source, others, words):
    receivers = sorted(others - {source}) or [(source + 1) % 4]
    leaves, out, plan, transfer = _run(source, receivers, chunk_bytes=4 * words)
    assert transfer.chunks == plan.chunks >= 1
    for want, got in zip(leaves, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()


def test_a_piece_that_two_devices_of_a_group_hold_travels_once():
    mesh = _mesh()
    x = np.ones((1000,), np.float32)
    plan = broadcast.layout(mesh, [x, x, x], [P("model"), P(), P()], chunk_bytes=1024)
    assert plan.payload_bytes == 3 * x.nbytes  # not 5: each replicated leaf once
    streams = [sum(p.nbytes for p in plan.pieces[c]) for c in plan.pieces]
    assert streams == [6000, 6000]  # half of the sharded one each, a replicated one each
    assert {plan.find[1, 0][0], plan.find[1, 1][0]} == {plan.find[1, 0][0]}  # one carrier


def test_the_rounds_reach_every_row_from_rows_that_hold_the_chunk():
    for rows in range(1, 20):
        for source in range(rows):
            holders = {source}
            for pairs in broadcast._rounds(rows, source):
                assert all(a in holders and b not in holders for a, b in pairs)
                assert len({b for _, b in pairs}) == len(pairs)
                holders |= {b for _, b in pairs}
            assert holders == set(range(rows))
            assert len(broadcast._rounds(rows, source)) == int(np.ceil(np.log2(rows)))
            chain = broadcast._chain(rows, source)
            assert chain[0] == source and sorted(chain) == list(range(rows))


@given(chunks=st.integers(1, 10_000), rows=st.integers(1, 2_000))
def test_the_chain_is_taken_where_it_needs_fewer_chunk_times(chunks, rows):
    rounds = int(np.ceil(np.log2(rows))) if rows > 1 else 0
    chained = broadcast.pipelined(chunks, rows)
    assert chained == (rows > 2 and chunks + rows - 2 < chunks * rounds)
    if rows <= 2 or chunks == 1:
        assert not chained  # one link, or one chunk: doubling is as fast or faster


@pytest.mark.parametrize("schedule", ["auto", "chain", "doubling"])
@pytest.mark.parametrize("chunk_bytes", [16, 1 << 20], ids=["many chunks", "one chunk"])
def test_every_schedule_delivers_every_bit_to_three_groups(chunk_bytes, schedule):
    leaves, out, plan, transfer = _run(2, [0, 1, 3], chunk_bytes, schedule=schedule)
    assert transfer.chunks == plan.chunks
    assert broadcast.pipelined(plan.chunks, 4) is (plan.chunks > 2)  # auto: chain for many
    for want, got in zip(leaves, out, strict=True):
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()


def test_bad_input_says_what_is_wrong():
    mesh = _mesh()
    with pytest.raises(ValueError, match="multiple of 4"):
        broadcast.layout(mesh, [np.ones(3, np.float32)], [P()], chunk_bytes=6)
    plan = broadcast.layout(mesh, [np.ones(3, np.float32)], [P()], chunk_bytes=64)
    with pytest.raises(ValueError, match="host copy"):
        broadcast.send_and_receive(mesh, plan, 0, None)
    with pytest.raises(ValueError, match="one of"):
        broadcast.send_and_receive(mesh, plan, 0, [np.ones(3, np.float32)], "ring")


@pytest.mark.parametrize("schedule", ["chain", "doubling"])
def test_a_source_holding_only_its_own_shards_sends_every_bit(schedule):
    """A spanning group's process holds no whole leaf: streamed from its shards alone."""
    leaves, out, _, _ = _run(1, [0, 2, 3], 64, seed=3, schedule=schedule, held=True)
    for want, got in zip(leaves, out, strict=True):
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()


def test_held_shards_are_only_those_of_the_devices_given():
    mesh = _mesh()
    x = np.arange(48, dtype=np.float32).reshape(6, 8)
    one = multihost.group_devices(mesh)[0][:1]  # one device: half of a ("model") leaf
    held = _held(x, P(None, "model"), mesh, one)
    assert held.nbytes == x.nbytes // 2
    np.testing.assert_array_equal(held[(slice(None), slice(0, 4))], x[:, :4])
    np.testing.assert_array_equal(held[(slice(0, 6), slice(0, 4, 1))], x[:, :4])  # same index
    with pytest.raises(ValueError, match="holds no shard"):
        held[(slice(None), slice(4, 8))]


def _vm_flags(address: int) -> list[str] | None:
    """The kernel's VmFlags of the mapping holding ``address`` (None: no /proc here)."""
    try:
        lines = pathlib.Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_transfer_buffers_are_zeroed_ordinary_pages_placed_as_the_transfer_needs():
    """A sender's chunk starts on a page, so placing it borrows it; a receiver's stream
    starts off one, so placing a piece copies it at once; neither asks for huge pages."""
    size = 8 << 20  # past NumPy's 4 MiB threshold for asking for huge pages
    chunk = broadcast.host_bytes(size, borrowable=True)
    stream = broadcast.host_bytes(size, borrowable=False)
    for buf in (chunk, stream):
        assert buf.dtype == np.uint8 and buf.shape == (size,) and buf.flags.writeable
        assert not buf.any()
    assert chunk.ctypes.data % 4096 == 0
    assert stream.ctypes.data % 64 == 16  # every piece (64 bytes apart) 16 past a 64 boundary
    device = jax.devices()[0]
    piece = stream[64 : 64 + 4096].view(np.float32)
    piece[:] = 1.5
    placed = jax.device_put(piece, device)
    assert placed.unsafe_buffer_pointer() != piece.ctypes.data  # a copy, nothing to redo
    piece[:] = 0  # the stream is reused or freed after placing: the copy stays
    np.testing.assert_array_equal(np.asarray(placed), np.full(1024, 1.5, np.float32))
    if jax.default_backend() == "cpu":
        held = jax.device_put(chunk[:4096].view(np.int32), device)
        assert held.unsafe_buffer_pointer() == chunk.ctypes.data  # read where it is
    assert broadcast.host_bytes(0, borrowable=False).size == 0
    assert broadcast.host_bytes(0, borrowable=True).size == 0
    inside = 1 << 20  # NumPy asks from the first page boundary on: look well inside
    for buf in (chunk, stream):
        flags = _vm_flags(buf.ctypes.data + inside)
        if flags is None:
            pytest.skip("no /proc/self/smaps here")
        assert "hg" not in flags  # no MADV_HUGEPAGE


def test_a_receiver_gives_back_each_leafs_bytes_once_it_is_placed(monkeypatch):
    """Assembling leaf by leaf, a receiver returns the pages no later leaf reads: it holds
    about one state, not its bytes and its arrays both; every leaf still arrives exact."""
    mesh = _mesh()
    by_group = multihost.group_devices(mesh)
    moving = multihost.survivors_mesh(by_group, [0, 1], mesh)
    rng = np.random.default_rng(3)
    leaves = [(rng.random((256, 256), np.float32) + 1).astype(np.float32) for _ in range(4)]
    specs = [P(None, "model"), P(), P("model"), P()]
    plan = broadcast.layout(moving, leaves, specs, chunk_bytes=64 << 10)
    received, _ = broadcast.send_and_receive(moving, plan, 0, leaves)
    released = []
    release = broadcast._release
    monkeypatch.setattr(
        broadcast, "_release", lambda data, *at: released.append(release(data, *at)) or released[-1]
    )
    target = multihost.survivors_mesh(by_group, [1], mesh)
    out = broadcast.assemble(plan, received, leaves, [NamedSharding(target, s) for s in specs])
    for want, got in zip(leaves, out, strict=True):
        for shard in got.addressable_shards:
            assert np.asarray(shard.data).tobytes() == want[shard.index].tobytes()
    per_leaf = np.array(released).reshape(len(leaves), len(received))
    assert (per_leaf[0] > 0).all() and (np.diff(per_leaf, axis=0) >= 0).all(), per_leaf
    for stream in received.values():  # three of four leaves' pages are back: zeros
        assert not stream[: stream.nbytes // 2].any() and stream[-4096:].any()

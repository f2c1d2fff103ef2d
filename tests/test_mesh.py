"""Mesh axes, group numbering, sharding rules and placements on the mesh."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from spare_jax import mesh as mesh_lib
from spare_jax import strategies


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1), (1, 4, 2)])
def test_group_id_is_data_major_and_spans_the_model_axis(shape):
    mesh = mesh_lib.make_mesh(shape)
    groups = mesh_lib.num_groups(mesh)
    assert groups == shape[0] * shape[1]
    assert mesh.axis_names == mesh_lib.AXES
    x = jax.device_put(np.arange(groups), mesh_lib.group_sharding(mesh))
    devices = np.asarray(mesh.devices)
    for g in range(groups):
        d, r = mesh_lib.group_coords(g, mesh)
        assert g == d * shape[1] + r
        for dev in devices[d, r, :]:  # every device of the group along "model" holds row g
            shard = next(s for s in x.addressable_shards if s.device == dev)
            assert np.asarray(shard.data).tolist() == [g]


def test_make_mesh_rejects_bad_shapes():
    with pytest.raises(ValueError, match="needs 16 devices"):
        mesh_lib.make_mesh((4, 2, 2))
    with pytest.raises(ValueError, match="three positive"):
        mesh_lib.make_mesh((2, 2))
    with pytest.raises(IndexError):
        mesh_lib.group_coords(4, mesh_lib.make_mesh((2, 2, 2)))


def test_logical_rules():
    assert mesh_lib.logical_spec(["embed", "mlp"]) == PartitionSpec(None, "model")
    assert mesh_lib.logical_spec(["heads", "head_dim", "embed"]) == PartitionSpec(
        "model", None, None
    )
    assert mesh_lib.logical_spec(["groups"]) == PartitionSpec(("data", "redundancy"))
    with pytest.raises(KeyError):
        mesh_lib.logical_spec(["nonsense"])


def test_rings_on_the_mesh():
    """The SPARe ring is the redundancy axis, or the whole machine when that axis is below r."""
    mesh = mesh_lib.make_mesh((2, 2, 2))
    assert mesh_lib.ring_size(mesh, 2) == 2
    assert mesh_lib.ring_size(mesh, 3) is None
    rings = strategies.placement("spare", 4, 2, ring_size=mesh_lib.ring_size(mesh, 2))
    # One ring per data coordinate, along the redundancy axis.
    assert rings.rings.tolist() == [[0, 1], [2, 3]]
    assert rings.stacks.tolist() == [[0, 1], [1, 0], [2, 3], [3, 2]]
    whole = strategies.placement("spare", 4, 3, ring_size=mesh_lib.ring_size(mesh, 3))
    assert whole.rings.tolist() == [[0, 1, 2, 3]]
    rep = strategies.placement("replication", 4, 2)
    assert rep.stacks.ravel().tolist() == [0, 0, 1, 1] and rep.shard_units == 2
    dp = strategies.placement("dp", 4, 1)
    assert dp.redundancy == 1 and dp.stacks.ravel().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("flags", [(True,), (False,), (True, False), (False, True, True)])
def test_agree_gives_one_vote_per_flag(flags):
    """`multihost.agree` takes each flag's maximum over the mesh's devices: in one process
    every device carries this process's flags, so the votes are the flags, in order."""
    from spare_jax import multihost

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    votes = multihost.agree(mesh, *flags)
    assert votes.shape == (len(flags),)
    assert np.asarray(votes).tolist() == [int(f) for f in flags]


def _page_aligned(shape: tuple[int, ...]) -> np.ndarray:
    """A host array that starts on a page: one that CPU placement can borrow, not copy."""
    n = int(np.prod(shape))
    raw = np.empty(n + 1024, np.float32)
    start = (-raw.ctypes.data % 4096) // 4
    host = raw[start : start + n].reshape(shape)
    host[...] = np.arange(n, dtype=np.float32).reshape(shape)
    return host


def _pointers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


@pytest.mark.parametrize("spec", [(), ("fsdp",), ("redundancy", "fsdp")])
@pytest.mark.parametrize("place", ["put", "from_local", "from_shards"])
def test_state_placed_from_the_host_owns_its_buffers_so_a_step_can_donate_them(place, spec):
    """Every path that puts host arrays back on the devices (initial parameters, a replica
    checkpoint's restore, the shards kept across a backend reset) gives arrays whose
    buffers are their own: the donating step then writes its output over its input instead
    of allocating one more state beside a borrowed host buffer."""
    from spare_jax import multihost

    mesh = jax.make_mesh((2, 4), ("redundancy", "fsdp"))
    sharding = jax.sharding.NamedSharding(mesh, PartitionSpec(*spec))
    host = _page_aligned((64, 256))
    hosts = [host]
    if place == "put":
        x = mesh_lib.put(host, sharding)
    elif place == "from_local":
        (x,) = multihost.from_local([host], [sharding])
    else:
        shards = multihost.own_shards(mesh_lib.put(host, sharding))
        for key, shard in shards.items():  # each kept shard on a page of its own
            shards[key] = _page_aligned(shard.shape)
            shards[key][...] = shard
        hosts = list(shards.values())
        like = jax.ShapeDtypeStruct(host.shape, host.dtype, sharding=sharding)
        x = multihost.from_shards(shards, like)
    spans = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in hosts]
    assert not any(lo <= p < hi for p in _pointers(x) for lo, hi in spans)
    np.testing.assert_array_equal(np.asarray(x), np.arange(64 * 256).reshape(64, 256))
    before = _pointers(x)
    out = jax.jit(lambda a: a * 2 + 1, donate_argnums=0, out_shardings=sharding)(x)
    assert x.is_deleted() and _pointers(out) == before  # written in place

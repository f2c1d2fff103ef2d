"""Placing a state that spans processes from host shards: owned buffers, no program compiled.

After a backend reset (a re-join, rebuilt collectives) every process puts its
own shards back on the devices (`multihost.from_shards`). CPU placement may
borrow an aligned host buffer, which a donating step cannot reuse, so
`mesh.owning` copies such shards. A copy of a global array that spans
processes is a compiled program per shape and layout, and a new backend has
none cached: one compile per leaf at every re-join. Copied shard by shard, it
is a transfer. Checked across two real processes, as only there does the
array span processes.
"""

from __future__ import annotations

import pytest
from launching import run_script_pair

pytestmark = pytest.mark.slow

# One process of two, two CPU devices each: its shards of three leaves on
# pages of their own (so that placing them borrows), placed again.
WORKER = r"""
import sys
import jax
import numpy as np
from jax import monitoring
from jax.sharding import NamedSharding, PartitionSpec as P

port, me = int(sys.argv[1]), int(sys.argv[2])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", 2, me)
from spare_jax import multihost

compiles = []
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None
)


def page_aligned(shard):
    raw = np.empty(shard.size + 1024, shard.dtype)
    start = (-raw.ctypes.data % 4096) // shard.dtype.itemsize
    out = raw[start : start + shard.size].reshape(shard.shape)
    out[...] = shard
    return out


mesh = jax.make_mesh((2, 2), ("redundancy", "fsdp"), devices=jax.devices())
leaves = []
for shape, spec in (((64, 256), P("fsdp")), ((128, 8), P(None, "fsdp")), ((512,), P())):
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    like = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
    x = jax.make_array_from_callback(shape, like.sharding, lambda index: full[index])
    shards = {k: page_aligned(v) for k, v in multihost.own_shards(x).items()}
    leaves.append((full, like, shards))

key = lambda index: tuple((s.start, s.stop, s.step) for s in index)  # as own_shards keys them
borrowed = 0
for full, like, shards in leaves:
    raw = jax.make_array_from_callback(like.shape, like.sharding, lambda i: shards[key(i)])
    spans = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in shards.values()]
    pointers = [s.data.unsafe_buffer_pointer() for s in raw.addressable_shards]
    borrowed += any(lo <= p < hi for p in pointers for lo, hi in spans)
    del raw

before = len(compiles)
placed = [multihost.from_shards(shards, like) for _, like, shards in leaves]
jax.block_until_ready(placed)
compiled = len(compiles) - before

owned = exact = True
for (full, like, shards), x in zip(leaves, placed):
    spans = [(h.ctypes.data, h.ctypes.data + h.nbytes) for h in shards.values()]
    for s in x.addressable_shards:
        p = s.data.unsafe_buffer_pointer()
        owned &= not any(lo <= p < hi for lo, hi in spans)
        exact &= bool(np.array_equal(np.asarray(s.data), full[s.index]))
print(f"borrowed {borrowed} compiled {compiled} owned {owned} exact {exact}", flush=True)
"""


def test_shards_placed_again_across_processes_are_owned_without_compiling():
    outputs = run_script_pair(WORKER, [[], []], devices=2)
    for me, (code, out) in enumerate(outputs):
        assert code == 0, f"process {me}:\n{out[-2000:]}"
        # placing the aligned shards as they are borrows them (else nothing is checked),
        # and the placement that owns its buffers compiles nothing
        assert "borrowed 3 compiled 0 owned True exact True" in out, out[-2000:]

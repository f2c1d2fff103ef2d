"""JAX's own behaviour that the library relies on, checked across two real processes.

A compile cache that processes share mixes programs compiled in one process
with the same programs loaded from their serialized bytes in another (JAX's
cache writes from process 0 while the others may still be compiling, and
`spare_jax.compile_cache` loads a process's programs from its own store where
a peer compiled them afresh). The two must run a collective together. JAX
0.12.1 hangs in that case on CPU: its runtime pairs a collective's processes
by a launch id drawn from the program's fingerprint, and a loaded copy has
another fingerprint than the compiled program (README, "Tested versions",
also for the launch count that rules out a re-join on 0.12.1). This test and
tests/test_rejoin.py are the checks to run before admitting a new JAX.
"""

from __future__ import annotations

import pytest
from launching import run_script_pair

pytestmark = pytest.mark.slow

# One process of two: a permute between their devices, run from the program as
# compiled (`load` 0) or from it serialized and loaded again (`load` 1).
WORKER = r"""
import sys
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding, PartitionSpec as P

port, me, load = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", 2, me)
mesh = jax.make_mesh((2,), ("x",), devices=jax.devices())
swap = lambda a: jax.lax.ppermute(a, "x", [(0, 1), (1, 0)]) * 2
program = jax.jit(jax.shard_map(swap, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
sharding = NamedSharding(mesh, P("x"))
compiled = program.lower(jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=sharding)).compile()
if load:
    compiled = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
x = jax.make_array_from_callback((2, 3), sharding, lambda _: np.full((1, 3), me + 1, np.float32))
out = compiled(x)
print("received", float(np.asarray(out.addressable_shards[0].data).ravel()[0]), flush=True)
"""


@pytest.mark.parametrize(
    "loads", [(0, 0), (1, 1), (0, 1)], ids=["both_compiled", "both_loaded", "one_of_each"]
)
def test_a_compiled_and_a_loaded_copy_of_one_program_run_a_collective_together(loads):
    outputs = run_script_pair(WORKER, [[str(load)] for load in loads], devices=1)
    for me, (code, out) in enumerate(outputs):
        assert code == 0, f"process {me} (loaded: {bool(loads[me])}):\n{out[-2000:]}"
        # each receives its peer's value (the peer's index + 1), doubled
        assert f"received {2.0 * (2 - me)}" in out, out[-2000:]

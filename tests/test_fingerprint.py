"""The batch contract's check (`spare_jax.fingerprint`), in one process on 8 simulated devices.

Stacks built by `SpareStep.stacks` from one batch agree; stacks in which one
holder's copy of a micro-batch differs (as when processes feed different
rows) are found, named by step and process, and raise `errors.BatchMismatch`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import regression

import spare_jax
from spare_jax import errors, fingerprint

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _step():
    mesh = spare_jax.make_mesh((1, 4, 2))
    return spare_jax.make_train_step(
        regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2
    )


def _tampered(step, batch, group: int, position: int):
    """``step.stacks(batch)`` except that ``group``'s copy at stack ``position`` is changed."""
    good = step.stacks(batch)

    def leaf(x):
        host = np.asarray(jax.device_get(x)).copy()
        host[group, position].flat[0] += 1  # one element of one copy
        return jax.make_array_from_callback(host.shape, x.sharding, lambda index: host[index])

    return jax.tree.map(leaf, good)


def test_the_holders_of_every_micro_batch_agree_on_a_consistent_batch():
    step = _step()
    stacks = step.stacks(regression.batches(3))
    fps = fingerprint.fingerprints(stacks)
    assert fps.shape == step._unit_ids.shape and fps.dtype == np.uint32
    assert not fingerprint.disagreements(fps, step._unit_ids)
    fingerprint.check(stacks, step._unit_ids, 3)  # no error
    # Each unit has r = 2 holders, and different units have different fingerprints.
    assert len(np.unique(fps)) == len(np.unique(step._unit_ids))


def test_one_element_of_one_copy_is_found_and_named_by_step_and_process():
    step = _step()
    batch = regression.batches(0)
    stacks = _tampered(step, batch, group=2, position=1)  # group 2's copy of a neighbour's shard
    unit = int(step._unit_ids[2, 1])
    found = fingerprint.disagreements(fingerprint.fingerprints(stacks), step._unit_ids)
    holders = sorted(int(g) for g in np.nonzero(step._unit_ids == unit)[0])
    assert list(found) == [unit] and sorted(g for side in found[unit] for g in side) == holders
    with pytest.raises(errors.BatchMismatch) as err:
        fingerprint.check(stacks, step._unit_ids, 7)
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 7: ")
    assert f"micro-batch {unit}" in message and "processes [0]" in message  # one process here
    assert err.value.exit_status == errors.EXIT_BATCH_MISMATCH
    assert err.value.exit_status not in (0, 1, errors.EXIT_RELAUNCH)


def test_the_processes_named_are_those_of_the_groups_that_differ():
    # As if each group were a process: the message names the holders' processes.
    found = {5: [[1], [2]]}
    message = fingerprint.mismatch_message(0, found, [[0], [1], [2], [3]], 8)
    assert "across processes [1, 2]" in message and "1 of 8" in message


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.uint16, jnp.bool_]
)
def test_every_dtype_is_fingerprinted_bit_for_bit_whatever_the_layout(dtype):
    mesh = spare_jax.make_mesh((1, 4, 2))
    rng = np.random.default_rng(0)
    host = (rng.normal(size=(4, 2, 4, 5)) * 50).astype(np.float32)
    x = jnp.asarray(host).astype(dtype)
    on_groups = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "redundancy")))
    )
    by_rows = jax.device_put(
        x,
        jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(("data", "redundancy"), None, "model")
        ),
    )
    a = fingerprint.fingerprints({"x": on_groups})
    b = fingerprint.fingerprints({"x": by_rows})
    np.testing.assert_array_equal(a, b)  # integer sums: every layout gives the same numbers
    changed = np.asarray(x).copy()
    flat = changed.reshape(-1)
    flat[7] = flat[8] if flat[7] != flat[8] else ~flat[7] if dtype == jnp.bool_ else flat[7] + 1
    c = fingerprint.fingerprints({"x": jax.device_put(changed, on_groups.sharding)})
    assert (a != c).sum() == 1 and a[0, 0] != c[0, 0]  # element 7 lies in group 0, position 0


def test_a_precompiled_layout_is_not_compiled_again():
    step = _step()
    survivors = step.on_mesh(spare_jax.make_mesh((1, 3, 2), jax.devices()[:6]), np.array([0, 1, 3]))
    stacks = survivors.stacks(regression.batches(0))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), stacks
    )
    fingerprint.precompile(abstract)
    compiled = len(fingerprint._EXECUTABLES)
    fps = fingerprint.fingerprints(stacks)
    assert len(fingerprint._EXECUTABLES) == compiled and fps.shape == (3, 4)
    assert not fingerprint.disagreements(fps, survivors._unit_ids)


def test_the_program_is_compiled_through_the_process_s_own_store(monkeypatch):
    """A relaunched or replacement process loads the check's program from its own store
    (`compile_cache.compile_lowered`) instead of compiling it again."""
    step = _step()
    survivors = step.on_mesh(spare_jax.make_mesh((1, 2, 2), jax.devices()[:4]), np.array([0, 2]))
    stacks = survivors.stacks(regression.batches(0))
    real = fingerprint.compile_cache.compile_lowered
    seen = []

    def spy(lowered, devices):
        seen.append([d.id for d in devices])
        return real(lowered, devices)

    monkeypatch.setattr(fingerprint.compile_cache, "compile_lowered", spy)
    fps = fingerprint.fingerprints(stacks)
    assert seen == [[d.id for d in survivors.mesh.devices.flat]]
    assert fps.shape == (2, 4) and not fingerprint.disagreements(fps, survivors._unit_ids)


def test_forget_drops_every_program_kept_and_the_check_compiles_again():
    step = _step()
    stacks = step.stacks(regression.batches(1))
    before = fingerprint.fingerprints(stacks)
    assert fingerprint._EXECUTABLES and fingerprint._program.cache_info().currsize
    fingerprint.forget()
    assert not fingerprint._EXECUTABLES and fingerprint._program.cache_info().currsize == 0
    np.testing.assert_array_equal(fingerprint.fingerprints(stacks), before)


def test_a_dropped_backend_is_collected_once_its_programs_are_forgotten():
    """A kept program holds its backend's client: at a re-join's reset (`rejoin.reset_backend`)
    the survivors forget them, so that the dropped client goes, with its collectives'
    threads and connections. In a process of its own: the reset here would invalidate
    every other test's arrays."""
    script = (
        "import gc, weakref, sys, jax\n"
        "sys.path.insert(0, 'experiments')\n"
        "import regression, spare_jax\n"
        "from spare_jax import fingerprint, jax_internals\n"
        "mesh = spare_jax.make_mesh((1, 4, 2))\n"
        "step = spare_jax.make_train_step(\n"
        "    regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2)\n"
        "fingerprint.fingerprints(step.stacks(regression.batches(0)))\n"
        "old = weakref.ref(jax.devices()[0].client)\n"
        "del mesh, step\n"
        "fingerprint.forget()\n"
        "jax_internals.clear_backends()\n"
        "gc.collect()\n"
        "print('gone' if old() is None else 'alive')\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.strip() == "gone", out.stderr[-2000:]

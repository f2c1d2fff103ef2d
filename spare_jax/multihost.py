"""Real process failures: survivors of a dead process finish the step and go on.

Everything else in the data plane masks *simulated* failures inside one
program. Here a failure is a process that is gone: its devices disappear, its
collectives never complete. This module owns what it takes to survive that
with JAX's own machinery (``jax.distributed`` and its coordination service):

* **Start-up** (`initialize`). Recoverability is switched on before
  ``jax.distributed.initialize``, so the coordination service reports a dead
  process instead of taking every process down with it; a short heartbeat
  timeout bounds detection. On CPU a collective with a dead peer is not
  cancelled, so `collective_timeout_flag` must reach ``XLA_FLAGS`` before the
  backend starts (GPU collectives are cancelled by the runtime). The service
  can live outside the workers (`serve`, used by ``experiments/launch.py``),
  so that any worker, process 0 included, may die.
* **Layout** (`global_mesh`, `groups_of_processes`). Groups map whole onto
  processes: a process's devices hold one or more complete groups, so a dead
  process takes whole groups with it and every survivor still holds a full
  replica of the (group-replicated) train state.
* **Detection and recovery** (`Executor`). Each step runs inside
  ``multihost_utils.live_devices``; a membership change raises
  ``ProcessFailureError`` on every survivor at once. The survivors then build
  a mesh over their own devices, re-wrap the state from the buffers they
  already hold (nothing moves; the step does not donate them), rebuild the
  step for the original placement restricted to the live groups
  (`SpareStep.on_mesh`), and hand all of it back as `ProcessLost`: the trainer
  marks the groups dead and retries the same step.
* **Checkpoints** (`local_view`, `from_local`). A process saves and restores
  its own replica as host arrays, so a save never waits on a barrier with a
  dead process (one process, the lowest live one, writes).

The service and client-only start-up use JAX internals (``jax._src.distributed``,
``jaxlib._jax``) that the public API does not expose yet; they are confined to
`serve` and `_connect`. A killed process cannot re-join the same job on CPU
(gloo's rendezvous keys carry no incarnation); re-join happens at a relaunch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental.multihost_utils import ProcessFailureError, live_devices
from jax.sharding import Mesh, NamedSharding

from spare_jax import checks
from spare_jax import mesh as mesh_lib
from spare_jax import train_step as step_lib

__all__ = [
    "RELAUNCH_EXIT",
    "Executor",
    "ProcessLost",
    "collective_timeout_flag",
    "from_local",
    "global_mesh",
    "groups_of_processes",
    "initialize",
    "local_view",
    "serve",
]

RELAUNCH_EXIT = 75  # a worker's exit status asking its launcher for a fresh job (a rollback)


def collective_timeout_flag(seconds: int) -> str:
    """The ``XLA_FLAGS`` entry making a CPU collective with a dead peer fail after ``seconds``."""
    return f"--xla_cpu_collective_timeout_seconds={checks.integer('seconds', seconds, low=1)}"


def serve(port: int, processes: int, heartbeat_s: int, shutdown_s: int = 5) -> Any:
    """Host the coordination service here (a launcher that computes nothing), recoverable.

    Returns the service object; call its ``shutdown()`` at the end.
    """
    from jaxlib import _jax

    return _jax.get_distributed_runtime_service(
        f"[::]:{checks.integer('port', port, low=1, high=65535)}",
        checks.integer("processes", processes, low=1),
        heartbeat_timeout=checks.integer("heartbeat_s", heartbeat_s, low=1),
        shutdown_timeout=shutdown_s,
        recoverable=True,
    )


def _connect(address: str, processes: int, process_id: int, heartbeat_s: int) -> None:
    """``jax.distributed.initialize`` as a client only: the service runs elsewhere (`serve`)."""
    from jax._src import distributed
    from jaxlib import _jax

    state = distributed.global_state
    if state.client is not None:
        raise RuntimeError("jax.distributed is already initialised")
    state.coordinator_address, state.process_id, state.num_processes = (
        address,
        process_id,
        processes,
    )
    state.client = _jax.get_distributed_runtime_client(
        address,
        process_id,
        init_timeout=120,
        shutdown_timeout=5,
        heartbeat_timeout=heartbeat_s,
        use_compression=True,
    )
    state.client.connect()
    state.initialize_preemption_sync_manager()
    state.partition_index = None


def initialize(
    *,
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    heartbeat_s: int,
    external_service: bool = False,
) -> None:
    """Join the job with recoverable failures; before any JAX computation.

    With no address (``None``), JAX detects the cluster (SLURM and the like).
    With ``external_service`` the coordination service is already running
    elsewhere (`serve`) and this process only connects to it.
    """
    jax.config.update("jax_enable_recoverability", True)
    if external_service:
        if coordinator_address is None or num_processes is None or process_id is None:
            raise ValueError("an external service needs an address, a process count and an id")
        _connect(coordinator_address, num_processes, process_id, heartbeat_s)
        return
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=5,
    )


def global_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(data, redundancy, model)`` mesh with devices in (process, id) order.

    Group ``g`` then owns devices ``g*M .. (g+1)*M - 1`` of that order, so when
    each process has a multiple of ``M`` devices, its groups are whole.
    """
    dims = tuple(int(s) for s in shape)
    devs = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    if len(dims) != 3 or int(np.prod(dims)) != len(devs):
        raise ValueError(f"mesh {dims} must use all {len(devs)} devices of the job")
    return Mesh(np.array(devs).reshape(dims), mesh_lib.AXES)


def groups_of_processes(mesh: Mesh) -> np.ndarray:
    """int[G]: the process holding each group (ValueError if a group spans two processes)."""
    groups = mesh_lib.num_groups(mesh)
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(groups, -1)
    if np.any(procs != procs[:, :1]):
        bad = int(np.flatnonzero(np.any(procs != procs[:, :1], axis=1))[0])
        raise ValueError(
            f"group {bad} spans processes {sorted(set(procs[bad].tolist()))}: each process "
            "must hold whole groups (devices per process a multiple of the model axis)"
        )
    return procs[:, 0]


def _group_devices(mesh: Mesh) -> dict[int, list[jax.Device]]:
    flat = mesh.devices.reshape(mesh_lib.num_groups(mesh), -1)
    return {g: list(row) for g, row in enumerate(flat)}


def survivors_mesh(devices: dict[int, list[jax.Device]], live: Sequence[int]) -> Mesh:
    """A ``(1, len(live), M)`` mesh over the devices of the live groups, in group order."""
    rows = [devices[g] for g in sorted(live)]
    return Mesh(np.array(rows)[None], mesh_lib.AXES)


def _rewrap(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The same global value on another mesh, from this process's own buffers (no transfer)."""
    local = {s.device: s.data for s in x.addressable_shards}
    buffers = [local[d] for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, buffers)


def reshard(state: Any, shardings: Any) -> Any:
    """Re-wrap a group-replicated state onto new shardings over a subset of its devices."""
    return jax.tree.map(_rewrap, state, shardings)


def _on(mesh: Mesh, shardings: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def _host_copy(x: jax.Array) -> np.ndarray:
    """This process's full copy of a group-replicated array, assembled from its own shards."""
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def local_view(state: Any) -> Any:
    """What this process checkpoints: its own replica, on the host.

    Orbax saves only global arrays in a multi-process job, and a global save
    waits on every process; a process's replica as host arrays is saved (and
    restored) by that process alone. One process: the state itself.
    """
    if jax.process_count() == 1:
        return state
    return jax.tree.map(_host_copy, state)


def local_abstract(abstract: Any) -> Any:
    """A restore target in `local_view`'s layout."""
    if jax.process_count() == 1:
        return abstract
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)


def from_local(local: Any, shardings: Any) -> Any:
    """The global state from every process's host replica (the inverse of `local_view`)."""
    if jax.process_count() == 1:
        return local
    place = lambda h, s: jax.make_array_from_callback(h.shape, s, lambda index: h[index])
    return jax.tree.map(place, local, shardings)


class ProcessLost(Exception):
    """Processes died during a step; the survivors' new step and state are ready.

    Attributes:
        processes: the dead process ids.
        groups: the groups they held.
        step: the `SpareStep` over the survivors' mesh, compiled.
        state: the train state re-wrapped onto it.
        detected: wall-clock time of the detection.
        rebuild_s: seconds to build the new mesh and re-wrap the state.
        compile_s: seconds to compile the step for it (0 when precompiled).
    """

    def __init__(self, processes, groups, step, state, detected, rebuild_s, compile_s):
        self.processes, self.groups = sorted(processes), sorted(groups)
        self.step, self.state, self.detected = step, state, detected
        self.rebuild_s, self.compile_s = rebuild_s, compile_s
        super().__init__(f"processes {self.processes} (groups {self.groups}) died")


class Executor:
    """Runs one step under ``live_devices`` and turns a lost process into `ProcessLost`.

    Args:
        step: the step in force (replaced by the one in each `ProcessLost`).
        stall_at: step index at which this process stops inside the step and
            waits to be killed: how the launcher kills a worker mid-step.
        on_stall: called when the stall begins (the launcher's cue to kill).
        precompile: before the first step, compile the step for every mesh
            that one more process failure would leave (one compile per other
            process, at start-up), so that a recovery need not compile.
    """

    def __init__(self, step, *, stall_at=None, on_stall=None, precompile=False):
        self.step, self.stall_at, self.on_stall = step, stall_at, on_stall
        self.index = 0
        self._devices = list(step.mesh.devices.flat)
        self._owners = groups_of_processes(step.mesh)
        self._by_group = _group_devices(step.mesh)
        self._precompile = precompile
        self._ready: dict[tuple[int, ...], step_lib.SpareStep] = {}

    @property
    def live_groups(self) -> list[int]:
        return [int(g) for g in self.step.rows]

    def _survivors(self, live: Sequence[int], state: Any) -> tuple[step_lib.SpareStep, Any]:
        mesh = survivors_mesh(self._by_group, live)
        step = self._ready.get(tuple(live)) or self.step.on_mesh(mesh, np.asarray(live))
        shardings = _on(step.mesh, jax.tree.map(lambda x: x.sharding, state))
        return step, shardings

    def _precompile_all(self, state: Any, stacks: Any) -> None:
        """Compile the survivors' step for each single process failure."""
        me = jax.process_index()
        for proc in sorted(set(self._owners[self.live_groups].tolist()) - {me}):
            live = [g for g in self.live_groups if self._owners[g] != proc]
            step, shardings = self._survivors(live, state)
            abstract = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings
            )
            step.precompile(abstract, stacks)
            self._ready[tuple(live)] = step

    def __call__(self, state: Any, stacks: Any, table: Any) -> tuple[Any, dict]:
        if self._precompile:
            self._precompile = False
            self._precompile_all(state, stacks)
        try:
            with live_devices(self._devices):
                if self.stall_at is not None and self.index == self.stall_at:
                    self.stall_at = None
                    if self.on_stall:
                        self.on_stall()
                    time.sleep(3600.0)  # the launcher kills this process now
                out = self.step.run(state, stacks, table)
                jax.block_until_ready(out)
        except ProcessFailureError as err:
            detected = time.time()
            dead_procs = sorted({d.process_index for d in err.failed_devices})
            dead_groups = [g for g in self.live_groups if self._owners[g] in dead_procs]
            live = [g for g in self.live_groups if g not in dead_groups]
            step, shardings = self._survivors(live, state)
            new_state = reshard(state, shardings)
            self._devices = list(step.mesh.devices.flat)
            rebuilt = time.time()
            compile_s = 0.0 if step.slot_bound in step._aot else step.precompile(new_state, stacks)
            self.step, self._ready = step, {}
            raise ProcessLost(
                dead_procs, dead_groups, step, new_state, detected, rebuilt - detected, compile_s
            ) from None
        return out


def kill_time(workdir: str, process: int) -> float | None:
    """When the launcher killed ``process`` (it leaves the time in the work directory), if known."""
    path = os.path.join(workdir, "launch", f"killed-{process}")
    try:
        with open(path, encoding="utf-8") as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return None

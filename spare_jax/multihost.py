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
  can live outside the workers (`serve`, used by ``python -m spare_jax.launch``),
  so that any worker, process 0 included, may die.
* **Layout** (`global_mesh`, `group_processes`). A group is a contiguous run
  of devices: one host's, several hosts' (a group spanning processes, HSDP
  across hosts), or one of several whole groups on a host. A dead process
  takes every group it has a device in; the other processes of such a group
  leave the job (`EXIT_GROUP_LOST`). A process holding whole groups keeps a
  full replica of the (group-replicated) train state; one inside a spanning
  group holds its shards of one.
* **Recovery pieces** (`survivors_mesh`, `reshard`). `spare_jax.trainer.Trainer`
  runs each step inside ``multihost_utils.live_devices``; a membership
  change raises ``ProcessFailureError`` on every survivor at once. The
  survivors then build a mesh over their own devices and re-wrap the state
  from the buffers they already hold (nothing moves; the step does not
  donate them).
* **Checkpoints** (`local_view`, `from_local`). A process saves and restores
  its own replica as host arrays, so a save never waits on a barrier with a
  dead process (one process, the lowest live one, writes).

* **The job's environment** (`initialize_job`, behind ``spare_jax.initialize``).
  A launcher (``python -m spare_jax.launch``) tells each worker where the
  service is, its index and the count through ``SPARE_JAX_*`` variables
  (`ENV`); a worker declared dead that wakes up (a stall past the heartbeat)
  leaves with one line and `EXIT_DECLARED_DEAD` instead of a fatal error. A
  warm spare (``--spares``) waits there, its imports done, until the launcher
  gives it a dead worker's place.

The service, client-only start-up and the started-backend check use JAX
internals that the public API does not expose yet; they live in
`spare_jax.jax_internals`, which checks them at import. A replacement joins
the running job through `spare_jax.rejoin` (hot re-join).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spare_jax import checks, domains, errors, exiting, jax_internals, rejoin, runlog
from spare_jax import mesh as mesh_lib
from spare_jax.job_env import ENV

__all__ = [
    "ENV",
    "EXIT_DECLARED_DEAD",
    "EXIT_GROUP_LOST",
    "GPU_RECOVERY_ENV",
    "GPU_RECOVERY_FLAGS",
    "collective_timeout_flag",
    "from_local",
    "from_shards",
    "global_mesh",
    "group_processes",
    "groups_touching",
    "host_copy",
    "initialize",
    "initialize_job",
    "leave",
    "local_view",
    "on_mesh",
    "own_shards",
    "reshard",
    "serve",
    "survivors_mesh",
    "with_flags",
]

leave = exiting.leave  # re-exported: leave the job with a bound

# What a launcher tells each worker (torchrun's RANK and WORLD_SIZE, in our names).
EXIT_DECLARED_DEAD = 76  # a worker the job declared dead (a stall past the heartbeat) woke up
EXIT_GROUP_LOST = errors.EXIT_GROUP_LOST  # a worker whose group lost another process leaves
DEFAULT_HEARTBEAT_S = 10
DEFAULT_COLLECTIVE_TIMEOUT_S = 10


# JAX's fault-tolerance guide (docs.jax.dev, "Fault Tolerant Distributed JAX"): on
# GPU an NCCL error must not end the process, and a collective whose peer died must
# be abortable (non-blocking communicators, aborted on a failure the service reports).
GPU_RECOVERY_FLAGS = (
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
GPU_RECOVERY_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}


def with_flags(xla_flags: str, flags: list[str]) -> str:
    """``xla_flags`` with each of ``flags`` added unless the user already set that flag."""
    given = {f.split("=", 1)[0] for f in xla_flags.split()}
    extra = [f for f in flags if f.split("=", 1)[0] not in given]
    return " ".join([*xla_flags.split(), *extra])


def collective_timeout_flag(seconds: int) -> str:
    """The ``XLA_FLAGS`` entry making a CPU collective with a dead peer fail after ``seconds``."""
    return f"--xla_cpu_collective_timeout_seconds={checks.integer('seconds', seconds, low=1)}"


def serve(port: int, processes: int, heartbeat_s: int, shutdown_s: int = 5) -> Any:
    """Host the coordination service here (a launcher that computes nothing), recoverable.

    Returns the service object; call its ``shutdown()`` at the end.
    """
    return jax_internals.start_service(
        f"[::]:{checks.integer('port', port, low=1, high=65535)}",
        checks.integer("processes", processes, low=1),
        heartbeat_s=checks.integer("heartbeat_s", heartbeat_s, low=1),
        shutdown_s=shutdown_s,
    )


def _declared_dead(*_: Any) -> None:
    """The service has declared this process dead (it stalled past the heartbeat): leave."""
    sys.stderr.write(
        "spare-jax: this process was declared dead by the job (no heartbeat within the "
        "timeout: stopped or stalled); the others went on without it; leaving\n"
    )
    sys.stderr.flush()
    os._exit(EXIT_DECLARED_DEAD)


def _connect(address: str, processes: int, process_id: int, heartbeat_s: int) -> None:
    """``jax.distributed.initialize`` as a client only: the service runs elsewhere (`serve`)."""
    jax_internals.connect_client(
        address,
        processes,
        process_id,
        heartbeat_s=heartbeat_s,
        on_declared_dead=_declared_dead,
        init_timeout_s=120,
        shutdown_timeout_s=5,
    )


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


def _env_int(name: str) -> int | None:
    value = os.environ.get(ENV[name])
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV[name]}={value!r} is not an integer") from None


def _exit_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's exit paths still kill us
        pass
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def initialize_job(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_s: int | None = None,
    collective_timeout_s: int | None = None,
    local_devices: int | None = None,
) -> bool:
    """Join the multi-process job this process belongs to, if any; True when it did.

    Each argument not given is read from the launcher's variables (`ENV`);
    with no coordinator anywhere this is a lone process and nothing happens
    (beyond ``local_devices`` simulated CPU devices when given). Must run before
    JAX starts a backend: the device count and the CPU collective timeout are
    fixed then.

    Raises:
        RuntimeError: JAX has already started a backend.
        ValueError: inconsistent settings (named).
    """
    if jax_internals.backends_started():
        raise RuntimeError(
            "spare_jax.initialize() must run before any JAX computation or device query"
        )
    if os.environ.get(ENV["spare"]):
        _take_a_place()
    given = {  # a keyword that contradicts the launcher's variable would split the job
        "coordinator": ("coordinator_address", coordinator_address),
        "num_processes": ("num_processes", num_processes),
        "process_id": ("process_id", process_id),
        "devices": ("local_devices", local_devices),
    }
    for key, (name, value) in given.items():
        theirs = os.environ.get(ENV[key]) or None
        if value is not None and theirs is not None and str(value) != theirs:
            raise ValueError(
                f"spare_jax.initialize({name}={value!r}) contradicts the launcher's "
                f"{ENV[key]}={theirs}: leave {name} out under python -m spare_jax.launch"
            )
    address = coordinator_address or os.environ.get(ENV["coordinator"]) or None
    count = num_processes if num_processes is not None else _env_int("num_processes")
    index = process_id if process_id is not None else _env_int("process_id")
    if address is not None and index is None and "SLURM_PROCID" in os.environ:
        index = int(os.environ["SLURM_PROCID"])  # one srun step: SLURM numbers the tasks
        if count is None:
            count = int(os.environ.get("SLURM_STEP_NUM_TASKS", os.environ["SLURM_NTASKS"]))
    devices = local_devices if local_devices is not None else _env_int("devices")
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", checks.integer("local_devices", devices, low=1))
    if address is None and count is None and index is None:
        exiting.install_handlers(joined=False)
        return False
    if None in (address, count, index):
        raise ValueError(
            "a multi-process job needs a coordinator address, a process count and a process id "
            f"(got {address!r}, {count!r}, {index!r})"
        )
    checks.integer("num_processes", count, low=1)
    checks.integer("process_id", index, low=0, high=count - 1)
    heartbeat = heartbeat_s or _env_int("heartbeat_s") or DEFAULT_HEARTBEAT_S
    timeout = (
        collective_timeout_s or _env_int("collective_timeout_s") or DEFAULT_COLLECTIVE_TIMEOUT_S
    )
    flags = [collective_timeout_flag(timeout), *GPU_RECOVERY_FLAGS]  # each backend reads its own
    os.environ["XLA_FLAGS"] = with_flags(os.environ.get("XLA_FLAGS", ""), flags)
    for name, value in GPU_RECOVERY_ENV.items():
        os.environ.setdefault(name, value)
    if os.environ.get(ENV["exit_with_parent"]) == "1":
        _exit_with_parent()
    external = os.environ.get(ENV["coordinator"]) == address  # a launcher hosts the service
    initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=index,
        heartbeat_s=checks.integer("heartbeat_s", heartbeat, low=1),
        external_service=external,
    )
    if os.environ.get(ENV["replacement"]):
        rejoin.prepare_backend(index)
    exiting.install_handlers(joined=True)
    runlog.emit("hello", process=index, pid=os.getpid(), host=socket.gethostname())
    return True


def _take_a_place() -> None:
    """A warm spare: wait here, Python and the script's imports done, for a dead worker's place.

    The launcher writes one JSON line on stdin, the variables of the worker it
    replaces (its process id among them); the end of stdin (the launcher gone or
    the attempt over) ends the spare.
    """
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    os.environ.pop(ENV["spare"], None)
    os.environ.update({str(k): str(v) for k, v in json.loads(line).items()})


def global_mesh(shape: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over every device of the job (`spare_jax.mesh.make_mesh`'s order and shapes)."""
    devs = list(jax.devices() if devices is None else devices)
    mesh = mesh_lib.make_mesh(shape, devs)
    if mesh.devices.size != len(devs):
        raise ValueError(f"mesh {dict(mesh.shape)} must use all {len(devs)} devices of the job")
    return mesh


def group_processes(mesh: Mesh) -> np.ndarray:
    """int[G, M]: the process of each of every group's ``M`` devices.

    A group may span processes (its devices on several hosts) and a process
    may hold several whole groups; a process holding parts of two groups is
    refused (ValueError): its loss would take two groups for one host.
    """
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(
        mesh_lib.num_groups(mesh), -1
    )
    for p in np.unique(procs):
        held = np.flatnonzero((procs == p).any(axis=1))
        whole = (procs[held] == p).all(axis=1)
        if held.size > 1 and not whole.all():
            raise ValueError(
                f"process {int(p)} holds part of the devices of groups {held.tolist()}: a "
                "process's devices must hold whole groups or lie inside one group (devices "
                "per process a divisor or a multiple of the devices per group)"
            )
    return procs


def groups_touching(procs: np.ndarray, processes: Any) -> np.ndarray:
    """The groups with a device on any of ``processes`` (a lost process loses all of them)."""
    return np.flatnonzero(np.isin(procs, list(processes)).any(axis=1))


def group_devices(mesh: Mesh) -> dict[int, list[jax.Device]]:
    return mesh_lib.group_devices(mesh)


def agree(mesh: Mesh, *flags: bool) -> jax.Array:
    """Whether any process of ``mesh`` says each of ``flags`` (every one of them calls this
    with as many): one value per flag.

    One tiny collective over the mesh's devices: each device carries its
    process's flags, the program takes the maximum of each. Processes that
    decide on their own (a checkpoint interval fed by their own timings, a
    background write that ends at its own time) agree this way.
    """
    flat = NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    mine = np.array([int(f) for f in flags], np.int32)
    votes = jax.make_array_from_callback(
        (mesh.devices.size, len(flags)), flat, lambda index: mine[None, :]
    )
    return _max_vote(votes)


@jax.jit
def _max_vote(votes: jax.Array) -> jax.Array:
    return votes.max(axis=0)


def survivors_mesh(devices: dict[int, list[jax.Device]], live: Sequence[int], like: Mesh) -> Mesh:
    """A ``(1, len(live), *inner)`` mesh over the live groups' devices, in group order.

    The inner axes (names and sizes) are ``like``'s: every group keeps its layout.
    """
    inner = mesh_lib.inner_axes(like)
    shape = (1, len(live), *(like.shape[a] for a in inner))
    rows = np.array([devices[g] for g in sorted(live)]).reshape(shape)
    return Mesh(rows, (*mesh_lib.GROUP_AXES, *inner))


def reshard(state: Any, shardings: Any) -> Any:
    """Re-wrap a group-replicated state onto new shardings over a subset of its devices."""
    return jax.tree.map(domains.view, state, shardings)


def on_mesh(mesh: Mesh, shardings: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def host_copy(x: jax.Array) -> np.ndarray:
    """This process's full copy of a group-replicated array, assembled from its own shards.

    Each distinct shard is copied off its device once, however many of this
    process's groups hold a replica of it.
    """
    out = np.empty(x.shape, x.dtype)
    copied: set[tuple] = set()
    for shard in x.addressable_shards:
        key = _index_key(shard.index)
        if key not in copied:
            copied.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def own_shards(x: jax.Array) -> dict[tuple, np.ndarray]:
    """This process's distinct shards of ``x`` on the host, by index: no more than it holds."""
    out: dict[tuple, np.ndarray] = {}
    for shard in x.addressable_shards:
        out.setdefault(_index_key(shard.index), np.asarray(shard.data))
    return out


def from_shards(shards: dict[tuple, np.ndarray], like: jax.ShapeDtypeStruct) -> jax.Array:
    """The global array ``like`` from every process's `own_shards` (its inverse)."""
    placed = jax.make_array_from_callback(
        like.shape, like.sharding, lambda index: shards[_index_key(index)]
    )
    return mesh_lib.owning(placed, list(shards.values()))


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def local_view(state: Any) -> Any:
    """What this process checkpoints: its own replica, on the host.

    Orbax saves only global arrays in a multi-process job, and a global save
    waits on every process; a process's replica as host arrays is saved (and
    restored) by that process alone. One process: the state itself.
    """
    if jax.process_count() == 1:
        return state
    return jax.tree.map(host_copy, state)


def from_local(local: Any, shardings: Any) -> Any:
    """The global state from every process's host replica (the inverse of `local_view`)."""
    return jax.tree.map(mesh_lib.put, local, shardings)  # each process its shards, owned


def kill_time(process: int) -> float | None:
    """When the launcher's fault injector killed ``process`` (it leaves the time), if known."""
    launch_dir = os.environ.get(ENV["launch_dir"])
    if not launch_dir:
        return None
    path = os.path.join(launch_dir, f"killed-{process}")
    try:
        with open(path, encoding="utf-8") as f:
            return float(f.read().strip())
    except (OSError, ValueError):
        return None

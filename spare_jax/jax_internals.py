"""The parts of JAX that are not public API, in one place, checked once at import.

Multi-process jobs need a few things JAX has no public API for (the public
ones are used everywhere else: ``jax.distributed``, ``multihost_utils``):

* a coordination service hosted by a launcher that computes nothing, and a
  worker that connects to it as a client only (``jaxlib._jax``'s factories,
  and ``jax._src.distributed.global_state``, which the rest of JAX reads);
* the job's key-value store and barriers (that state's client);
* whether a backend has started (``jax._src.xla_bridge``);
* for hot re-join: dropping the backend (``jax.extend.backend.clear_backends``,
  an unstable API), the cache of the last live set that
  ``multihost_utils.live_devices`` keeps, and the names XLA's CPU collectives
  give their key-value entries (`GLOO_KEYS`, `TOPOLOGY_KEY`);
* and Orbax's: the timeout of its barriers between processes (a module
  constant, 300 s, that no option sets), which a sharded save scales with
  its bytes so that a process lost in the save holds the others only that
  long (`orbax_barrier_timeout`); and its caches keyed by sharding, emptied
  when a backend is dropped (`forget_orbax_shardings`).

Importing this module checks that every name and keyword used here exists,
and raises `UnsupportedJax` (one line: the JAX version and what it lacks)
otherwise, so a JAX release that drops one fails at start-up rather than
midway through a job. The key names are strings inside XLA that no import can
see; the re-join tests (``tests/test_rejoin.py``) hold them on each tested JAX.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import multihost_utils

__all__ = [
    "GLOO_KEYS",
    "TOPOLOGY_KEY",
    "UnsupportedJax",
    "backends_started",
    "check",
    "clear_backends",
    "client",
    "connect_client",
    "forget_live_devices",
    "forget_orbax_shardings",
    "live_devices_cache",
    "orbax_barrier_timeout",
    "start_service",
]

GLOO_KEYS = "cpu:gloo/"  # the CPU collectives' rendezvous keys, named by device ids only
TOPOLOGY_KEY = "cpu:global_topology/cpu"  # process 0 sets it whenever its backend starts

# Orbax's caches keyed by sharding (functools.lru_cache, 4,096 entries each).
_ORBAX_SERIALIZATION = "orbax.checkpoint._src.serialization"
_ORBAX_SHARDING_CACHES = (
    (f"{_ORBAX_SERIALIZATION}.replica_slices", "_sharding_num_replicas.cache_clear"),
    (f"{_ORBAX_SERIALIZATION}.jax_array_handlers", "_is_replicated_sharding.cache_clear"),
)

# (module, attribute path) of each name used below.
_NAMES: tuple[tuple[str, str], ...] = (
    ("jaxlib._jax", "get_distributed_runtime_service"),
    ("jaxlib._jax", "get_distributed_runtime_client"),
    ("jaxlib._jax", "DistributedRuntimeClient.connect"),
    ("jaxlib._jax", "DistributedRuntimeClient.wait_at_barrier"),
    ("jaxlib._jax", "DistributedRuntimeClient.key_value_set"),
    ("jaxlib._jax", "DistributedRuntimeClient.key_value_set_bytes"),
    ("jaxlib._jax", "DistributedRuntimeClient.blocking_key_value_get"),
    ("jaxlib._jax", "DistributedRuntimeClient.blocking_key_value_get_bytes"),
    ("jaxlib._jax", "DistributedRuntimeClient.key_value_delete"),
    ("jax._src.distributed", "global_state.client"),
    ("jax._src.distributed", "global_state.coordinator_address"),
    ("jax._src.distributed", "global_state.process_id"),
    ("jax._src.distributed", "global_state.num_processes"),
    ("jax._src.distributed", "global_state.partition_index"),
    ("jax._src.distributed", "global_state.initialize_preemption_sync_manager"),
    ("jax._src.xla_bridge", "backends_are_initialized"),
    ("jax.extend.backend", "clear_backends"),
    ("jax.experimental.multihost_utils", "live_devices.devices"),
    ("orbax.checkpoint._src.multihost.multihost", "_DEFAULT_BARRIER_TIMEOUT"),
    *_ORBAX_SHARDING_CACHES,
)

# The keywords passed to jaxlib's factories (a renamed one would be a TypeError in a job).
_KEYWORDS: dict[str, tuple[str, ...]] = {
    "get_distributed_runtime_service": ("heartbeat_timeout", "shutdown_timeout", "recoverable"),
    "get_distributed_runtime_client": (
        "init_timeout",
        "shutdown_timeout",
        "heartbeat_timeout",
        "missed_heartbeat_callback",
        "use_compression",
    ),
}


class UnsupportedJax(ImportError):
    """The installed JAX lacks an internal that spare_jax uses (its message is one line)."""


def _versions() -> str:
    """'JAX x (jaxlib y, Orbax z)': what the error names, so a report says which release lacks
    what."""
    found = []
    for name in ("jaxlib", "orbax.checkpoint"):
        try:
            found.append(getattr(importlib.import_module(name), "__version__", "unknown"))
        except ImportError:
            found.append("missing")
    return f"JAX {jax.__version__} (jaxlib {found[0]}, Orbax {found[1]})"


def _fail(missing: str) -> UnsupportedJax:
    """The one-line error for a missing internal (``missing`` names it)."""
    return UnsupportedJax(
        f"spare_jax cannot run on {_versions()}: it has no {missing}; install a JAX "
        "release listed under 'Tested versions' in spare_jax's README"
    )


def _lookup(module: str, path: str) -> Any:
    """``module.path`` (dotted), or `UnsupportedJax` naming the first missing part."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        raise _fail(f"module {module}") from None
    done = module
    for part in path.split("."):
        done = f"{done}.{part}"
        if not hasattr(obj, part):
            raise _fail(done)
        obj = getattr(obj, part)
    return obj


def _parameters(fn: Callable[..., Any]) -> set[str] | None:
    """The parameter names a compiled function's signature line declares (None: it has none)."""
    doc = getattr(fn, "__doc__", None) or ""
    first = doc.splitlines()[0] if doc else ""
    match = re.match(r"\s*(?:def\s+)?\w+\((.*)\)", first)
    if match is None or "**" in match.group(1):  # no signature, or any keyword goes
        return None
    return set(re.findall(r"(\w+)\s*:", match.group(1)))


def check() -> None:
    """Raise `UnsupportedJax` unless every internal name and keyword used here exists."""
    for module, path in _NAMES:
        _lookup(module, path)
    for name, keywords in _KEYWORDS.items():
        declared = _parameters(_lookup("jaxlib._jax", name))
        if declared is None:  # no signature to read: the names above are all we can check
            continue
        for keyword in keywords:
            if keyword not in declared:
                raise _fail(f"keyword {keyword!r} in jaxlib._jax.{name}")


check()
_jax = importlib.import_module("jaxlib._jax")
_distributed = importlib.import_module("jax._src.distributed")
_xla_bridge = importlib.import_module("jax._src.xla_bridge")
_backend = importlib.import_module("jax.extend.backend")
_orbax_multihost = importlib.import_module("orbax.checkpoint._src.multihost.multihost")


def backends_started() -> bool:
    """Whether JAX has started a backend (device counts and XLA flags are fixed from then)."""
    return bool(_xla_bridge.backends_are_initialized())


def start_service(bind_address: str, processes: int, *, heartbeat_s: int, shutdown_s: int) -> Any:
    """A recoverable coordination service on ``bind_address``; its ``shutdown()`` stops it."""
    return _jax.get_distributed_runtime_service(
        bind_address,
        processes,
        heartbeat_timeout=heartbeat_s,
        shutdown_timeout=shutdown_s,
        recoverable=True,
    )


def connect_client(
    address: str,
    processes: int,
    process_id: int,
    *,
    heartbeat_s: int,
    on_declared_dead: Callable[..., None],
    init_timeout_s: int = 120,
    shutdown_timeout_s: int = 5,
) -> None:
    """What ``jax.distributed.initialize`` does for a process other than 0: connect, no service.

    JAX's own functions (``live_devices``, preemption sync, shutdown) then find
    the client where they look for it. ``on_declared_dead`` runs when the
    service declares this process dead.
    """
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed is already initialised")
    state = _distributed.global_state
    state.coordinator_address = address
    state.process_id = process_id
    state.num_processes = processes
    state.client = _jax.get_distributed_runtime_client(
        address,
        process_id,
        init_timeout=init_timeout_s,
        shutdown_timeout=shutdown_timeout_s,
        heartbeat_timeout=heartbeat_s,
        missed_heartbeat_callback=on_declared_dead,
        use_compression=True,
    )
    state.client.connect()
    state.initialize_preemption_sync_manager()
    state.partition_index = None


def client() -> Any | None:
    """The job's coordination-service client (key-value store, barriers); None outside a job."""
    return _distributed.global_state.client


def clear_backends() -> None:
    """Drop every backend: its devices, arrays and compiled functions become invalid."""
    _backend.clear_backends()


def live_devices_cache() -> dict[Any, Any]:
    """device -> incarnation of the live set ``live_devices`` last saw ({} before its first)."""
    return dict(getattr(multihost_utils.live_devices, "devices", None) or {})


def forget_live_devices() -> None:
    """Make ``live_devices`` query the live set afresh (its cache holds a dropped backend's)."""
    multihost_utils.live_devices.devices = None


def forget_orbax_shardings() -> None:
    """Empty Orbax's caches keyed by sharding. After a backend reset they hold the dropped
    backend's devices, and so its client, with its threads and its connections to every peer."""
    for module, path in _ORBAX_SHARDING_CACHES:
        _lookup(module, path)()


@contextlib.contextmanager
def orbax_barrier_timeout(seconds: int) -> Iterator[None]:
    """Orbax's barriers between processes time out after ``seconds`` inside the block.

    The coordination service does not fail a barrier whose participant died
    (the job's tasks are recoverable), so a death during a save would hold
    every survivor for Orbax's fixed 300 s; a timeout fails the barrier on
    every survivor at once, and the save is dropped (`spare_jax.saving`).
    """
    was = _orbax_multihost._DEFAULT_BARRIER_TIMEOUT
    _orbax_multihost._DEFAULT_BARRIER_TIMEOUT = max(int(seconds), 1)
    try:
        yield
    finally:
        _orbax_multihost._DEFAULT_BARRIER_TIMEOUT = was

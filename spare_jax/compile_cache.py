"""JAX's persistent compilation cache: switched on for a directory, and its hits counted.

A relaunched job (after a process loss, a preemption or a rerun) builds the
same programs again. With the cache on, each process looks every program up
on disk before compiling it and loads it when it is there, so a relaunch or a
resume skips most of its compiles. `spare_jax.fit` turns it on, under
``WORKDIR/compile_cache`` unless told otherwise.

JAX's cache settings are process-wide configuration: `enable` changes them for
every later compile in the process, and `snapshot` / `restore` (or `enabled`,
which pairs them) give them back. The counts come from the events JAX records
through `jax.monitoring` (public API); the other JAX calls are
``reset_cache`` (``jax.experimental.compilation_cache``) and
``jax.experimental.serialize_executable``.

Which programs JAX's cache can serve (JAX 0.10): every process reads it, but
only the process whose ``jax.distributed`` id is 0 writes it, and on CPU the
key holds the program's device assignment. So every process of a
multi-process job keeps the programs of its failure domain itself
(`compile_lowered`): a relaunched process or a replacement loads them. A
re-join also keeps them under a scope (`compile_scoped`), to load them
without tracing the model. docs/library.md says what that means for a
relaunched job and a re-join.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = [
    "Snapshot",
    "compile_lowered",
    "compile_scoped",
    "configured",
    "counts",
    "enable",
    "enabled",
    "restore",
    "retrieval_seconds",
    "snapshot",
]

# The configuration options enable() sets (jax/_src/config.py).
_DIR = "jax_compilation_cache_dir"
_MIN_COMPILE_S = "jax_persistent_cache_min_compile_time_secs"  # JAX's default: 1 s
_MIN_ENTRY_BYTES = "jax_persistent_cache_min_entry_size_bytes"  # -1: no minimum, no override

# The events JAX records (jax/_src/compiler.py, jax/_src/compilation_cache.py).
_LOOKUP = "/jax/compilation_cache/compile_requests_use_cache"  # each compile that asks the cache
_HIT = "/jax/compilation_cache/cache_hits"  # ... and found its program there
_WRITE = "/jax/compilation_cache/cache_misses"  # recorded only when an entry is written
_RETRIEVAL_S = "/jax/compilation_cache/cache_retrieval_time_sec"  # a hit's read and load
_UNTRACED = "untraced"  # ours: hits of `compile_scoped`, loaded without tracing the program


class _Counter:
    """The cache events of this process since the last `reset`.

    JAX keeps a listener for the life of the process, so the listeners are
    registered once and bound to this one object, which holds the counts and
    the lock that guards them (compiles may run on several threads).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registered = False
        self._counts = {_LOOKUP: 0, _HIT: 0, _WRITE: 0, _UNTRACED: 0}
        self._retrieval_s = 0.0
        self._here = threading.local()  # JAX's hits on each thread, never reset

    def register(self) -> None:
        with self._lock:
            if self._registered:
                return
            self._registered = True
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def reset(self) -> None:
        with self._lock:
            self._counts = dict.fromkeys(self._counts, 0)
            self._retrieval_s = 0.0

    def _event(self, event: str, **kwargs: str | int) -> None:
        del kwargs
        if event == _HIT:  # JAX records it on the thread that compiles
            self._here.hits = self.hits_here() + 1
        # JAX records a lookup even with no directory set (nothing to find): not one of ours.
        if event in self._counts and (event != _LOOKUP or configured() is not None):
            with self._lock:
                self._counts[event] += 1

    def _duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        del kwargs
        if event == _RETRIEVAL_S:
            with self._lock:
                self._retrieval_s += float(duration_secs)

    def own(self, *, hit: bool, seconds: float = 0.0, untraced: bool = False) -> None:
        """A lookup in this process's own store (`compile_lowered`, `compile_scoped`):
        counted as JAX's are; ``untraced``: a hit of `compile_scoped`, loaded untraced."""
        with self._lock:
            if hit:
                self._counts[_LOOKUP] += 1
                self._counts[_HIT] += 1
                self._counts[_UNTRACED] += untraced
                self._retrieval_s += seconds
            else:  # the compile that follows records JAX's own lookup
                self._counts[_WRITE] += 1

    def hits_here(self) -> int:
        """JAX's cache hits on this thread since the process started (`reset` leaves them)."""
        return getattr(self._here, "hits", 0)

    def counts(self) -> dict[str, int]:
        with self._lock:
            hits, lookups = self._counts[_HIT], self._counts[_LOOKUP]
            return {
                "cache_hits": hits,
                "cache_misses": lookups - hits,
                "cache_writes": self._counts[_WRITE],
                "untraced": self._counts[_UNTRACED],
            }

    def retrieval_seconds(self) -> float:
        with self._lock:
            return self._retrieval_s


_COUNTER = _Counter()
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """JAX's cache settings at one moment (`snapshot`), to put back with `restore`."""

    directory: str | None
    min_compile_time_secs: float
    min_entry_size_bytes: int


def configured() -> str | None:
    """The directory JAX's persistent cache uses now (None: no cache).

    Set by `enable`, by ``jax.config.update("jax_compilation_cache_dir", ...)``
    or by the ``JAX_COMPILATION_CACHE_DIR`` environment variable.
    """
    return getattr(jax.config, _DIR) or None


def snapshot() -> Snapshot:
    """The cache settings in force, for `restore`."""
    return Snapshot(
        configured(), getattr(jax.config, _MIN_COMPILE_S), getattr(jax.config, _MIN_ENTRY_BYTES)
    )


def _set_directory(directory: str | None) -> None:
    """Point JAX at ``directory``, reopening its cache if that changes the directory.

    JAX opens its cache once, at the first compile after a directory is set,
    and keeps that one: a new directory takes effect only after a reset.
    """
    if configured() == directory:
        return
    jax.config.update(_DIR, directory)
    _jax_cache.reset_cache()


def restore(saved: Snapshot) -> None:
    """Put back the settings of ``saved`` (the counts go on)."""
    _set_directory(saved.directory)
    jax.config.update(_MIN_COMPILE_S, saved.min_compile_time_secs)
    jax.config.update(_MIN_ENTRY_BYTES, saved.min_entry_size_bytes)


def enable(directory: str | os.PathLike[str]) -> str:
    """Cache every program this process compiles from now on in ``directory``.

    Creates the directory, points JAX at it, and lowers JAX's thresholds so
    that every program is written (by default JAX skips a program that
    compiled in under a second, which on CPU is most of them). Calling it
    again with the same directory changes nothing but the counts, which
    start from zero at every call.

    Returns:
        The directory, as an absolute path.

    Raises:
        ValueError: ``directory`` exists and is not a directory.
    """
    path = os.path.abspath(os.fspath(directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"compile cache {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    _COUNTER.register()
    _set_directory(path)
    jax.config.update(_MIN_COMPILE_S, 0.0)
    jax.config.update(_MIN_ENTRY_BYTES, -1)
    _COUNTER.reset()
    return path


@contextlib.contextmanager
def enabled(directory: str | os.PathLike[str]) -> Iterator[str]:
    """`enable` ``directory`` for the ``with`` block, then `restore` the settings before it."""
    saved = snapshot()
    try:
        yield enable(directory)
    finally:
        restore(saved)


def counts() -> dict[str, int]:
    """This process's cache lookups since the last `enable`.

    ``cache_hits``: programs loaded from the cache instead of compiled;
    ``cache_misses``: programs looked up, not found, and compiled;
    ``cache_writes``: entries this process wrote (only process 0 writes any);
    ``untraced``: of the hits, programs `compile_scoped` loaded without tracing them.
    """
    return _COUNTER.counts()


def retrieval_seconds() -> float:
    """Seconds spent reading and loading the hits counted by `counts`."""
    return _COUNTER.retrieval_seconds()


# This process's own entries for the programs JAX's cache does not keep for it
# (`compile_lowered`), under the cache directory, one folder per process id.
_OWN = "process-{index}"


def _own_key(lowered: jax.stages.Lowered, devices: Sequence[jax.Device]) -> str:
    """What the compiled program depends on: the program, its devices, the job's shape, JAX."""
    backend = devices[0].client
    h = hashlib.sha256()
    for part in (
        jax.__version__,
        backend.platform,
        backend.platform_version,
        f"{jax.process_count()} {jax.device_count()}",
        " ".join(f"{d.id}:{d.process_index}" for d in devices),
        lowered.as_text(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_lowered(lowered: jax.stages.Lowered, devices: Sequence[jax.Device]) -> Any:
    """``lowered.compile()``, loaded from this process's own entry when it has one.

    JAX's cache writes only from process 0 (see the module's docstring), so
    every other process compiled its programs again at each relaunch and a
    replacement compiled all of them. With a cache directory configured, in a
    multi-process job, every process keeps the programs it compiles through
    here in ``DIR/process-<id>/`` (serialized executables keyed by the
    program text, its ``devices`` in order, the job's shape and JAX's
    version), and a later process with the same id loads them. Process 0
    keeps its own too: `compile_scoped` needs the bytes of a program as it
    was compiled, and one that JAX's cache loaded does not serialize whole
    again (on CPU the copy lacks its kernels: "Function ... not found" when
    run). A lone process and runs without a cache directory compile as JAX
    does. A damaged or stale entry is removed, and replaced when the program
    is compiled whole. Loads and writes count in `counts` like JAX's own.
    """
    return _own(lowered, devices)[0]


def _own(lowered: jax.stages.Lowered, devices: Sequence[jax.Device]) -> tuple[Any, bytes | None]:
    """`compile_lowered`, and the program's serialized bytes when they are known whole."""
    directory = configured()
    if directory is None or jax.process_count() == 1:
        return lowered.compile(), None
    path = os.path.join(
        directory, _OWN.format(index=jax.process_index()), _own_key(lowered, devices)
    )
    payload = _read(path)
    if payload is not None:
        trees = (_in_tree(lowered), lowered.out_tree)
        compiled = _load(path, payload, trees, devices, "compile cache entry")
        if compiled is not None:
            return compiled, payload
    compiled, data = _fresh(lowered)
    if data is not None:
        try:
            _write(path, data)
        except OSError as err:
            log.warning("compile cache entry %s not written: %s", path, err)
        else:
            _COUNTER.own(hit=False)
    return compiled, data


def _fresh(lowered: jax.stages.Lowered) -> tuple[Any, bytes | None]:
    """``lowered.compile()`` and its serialized bytes; None for bytes when JAX's cache
    loaded it (a loaded program does not serialize whole) or it does not serialize."""
    _COUNTER.register()
    # counted on this thread only: a reset, or another thread's hit or load, never hides one
    before = _COUNTER.hits_here()
    compiled = lowered.compile()
    if _COUNTER.hits_here() != before:
        return compiled, None
    try:
        return compiled, serialize_executable.serialize(compiled)[0]
    except Exception as err:  # noqa: BLE001 - e.g. a host callback does not pickle: not kept
        log.warning("a compiled program is not kept: %s", err)
        return compiled, None


def _write(path: str, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a reader never sees part of it)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _load(
    path: str,
    payload: bytes,
    trees: tuple[Any, Any] | None,
    devices: Sequence[jax.Device],
    what: str,
) -> Any | None:
    """The executable an entry holds, on ``devices``; None (the entry removed) if it does not load.

    ``trees``: the program's argument and result trees, or None when the entry
    carries them itself (a scoped one: pickled with the bytes, the program untraced).
    """
    start = time.perf_counter()
    try:
        data, in_tree, out_tree = pickle.loads(payload) if trees is None else (payload, *trees)
        compiled = serialize_executable.deserialize_and_load(
            data, in_tree, out_tree, backend=devices[0].client, execution_devices=list(devices)
        )
    except Exception as err:  # noqa: BLE001 - any failure: compile instead
        log.warning("%s %s does not load (%s): compiling", what, path, err)
        with contextlib.suppress(OSError):  # replaced once the program is compiled whole
            os.remove(path)
        return None
    _COUNTER.own(hit=True, seconds=time.perf_counter() - start, untraced=trees is None)
    return compiled


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


# Programs kept under a scope (`compile_scoped`): DIR/process-<id>/scoped/<scope>/<key>.
_SCOPED = "scoped"
_SCOPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def _signature_key(scope: str, name: str, args: Any, devices: Sequence[jax.Device]) -> str:
    """What a scoped program is looked up by: its name, its arguments' shapes, dtypes and
    placements, its devices, the job's shape and JAX (never its code: the scope stands for it)."""
    leaves, tree = jax.tree.flatten(args)
    h = hashlib.sha256()
    backend = devices[0].client
    parts = [scope, name, jax.__version__, backend.platform, backend.platform_version]
    parts += [f"{jax.process_count()} {jax.device_count()}", str(tree)]
    parts.append(" ".join(f"{d.id}:{d.process_index}" for d in devices))
    for x in leaves:
        sharding = x.sharding
        placed = repr(sharding)
        if hasattr(sharding, "mesh"):
            placed += " " + " ".join(str(d.id) for d in sharding.mesh.devices.flat)
        parts.append(f"{x.shape} {x.dtype} {getattr(x, 'weak_type', False)} {placed}")
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_scoped(
    scope: str | None,
    name: str,
    args: Any,
    devices: Sequence[jax.Device],
    lower: Callable[[], jax.stages.Lowered],
) -> Any:
    """The program ``lower`` builds, loaded without tracing it when ``scope`` holds it.

    Tracing and lowering a model's step takes longer than loading its
    compiled program (docs/multihost.md, "Programs loaded untraced"), and a
    re-join's survivors (their backend reset) and its replacement pay it
    again for programs their process slot already compiled. Under a scope,
    each process keeps what it compiles keyed by ``name`` and the abstract
    ``args`` (shapes, dtypes, shardings) on ``devices`` instead of by the
    program's text, and a later lookup with the same key in the same scope
    loads it untraced. So a scope must stand for everything else the program
    depends on (the user's functions, the optimizer): `spare_jax.rejoin`
    makes one per job and process slot, which a replacement inherits from
    the process it replaces. A scope is one folder name (letters, digits,
    ``-``, ``_``); anything else raises ValueError before any file is
    touched. With no scope or no cache directory this is `compile_lowered`
    on ``lower()``. Hits and writes count in `counts`.
    """
    if scope is not None and not _SCOPE_NAME.fullmatch(scope):
        # it names a folder whose siblings are deleted: never one outside the store
        raise ValueError(
            f"scope={scope!r}: one folder name of letters, digits, '-' and '_' "
            "(at most 128), such as rejoin.program_scope() draws"
        )
    directory = configured()
    if scope is None or directory is None:
        return compile_lowered(lower(), devices)
    folder = os.path.join(directory, _OWN.format(index=jax.process_index()), _SCOPED, scope)
    path = os.path.join(folder, _signature_key(scope, name, args, devices))
    payload = _read(path)
    if payload is not None:
        compiled = _load(path, payload, None, devices, "scoped program")
        if compiled is not None:
            return compiled
    lowered = lower()
    compiled, data = _own(lowered, devices)
    if data is None:  # not known whole: traced again at the next lookup
        return compiled
    try:
        if not os.path.isdir(folder):  # a new scope: the slot's older ones serve no process
            parent = os.path.dirname(folder)
            for old in os.listdir(parent) if os.path.isdir(parent) else []:
                shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
        _write(path, pickle.dumps((data, _in_tree(lowered), lowered.out_tree)))
    except Exception as err:  # noqa: BLE001 - e.g. a tree that does not pickle: not kept
        log.warning("scoped program %s not written: %s", path, err)
    return compiled


def _in_tree(lowered: jax.stages.Lowered) -> Any:
    """The tree of a compiled program's argument descriptions (as `serialize` returns it)."""
    return jax.tree.structure(lowered.args_info)

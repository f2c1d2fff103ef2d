"""How a checkpoint's state lies on disk: one process's replica, or sharded arrays.

* `missing_files`: whether a checkpoint directory holds every file of either
  layout, and `KeepIntact`, the retention that counts only such checkpoints.
* `ReplicaHandler`: an Orbax item handler for one process's full replica
  of the state, as host arrays in one ``replica.npz``. The writer of a
  multi-process job whose groups lie whole on processes saves this way by
  default (`spare_jax.checkpoint`).
* `sharded_handler`: Orbax's own sharded arrays, written by every live
  process from its devices (sharded checkpoints; groups spanning processes),
  with the writing of each replicated array split over `replica_split`
  replicas, so that no process copies a whole replica to its host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import zipfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = [
    "REPLICA_FILE",
    "SPLIT_SHARE",
    "KeepIntact",
    "ReplicaHandler",
    "ReplicaRestore",
    "ReplicaSave",
    "barrier_timed_out",
    "missing_files",
    "on_disk_bytes",
    "read_step",
    "replica_split",
    "save_wait_s",
    "shard_table",
    "sharded_handler",
]

REPLICA_FILE = "replica.npz"
SPLIT_SHARE = 0.9  # sharded saves: split the writing so that this share of the bytes splits
# A sharded save's barrier timeout (`save_wait_s`), our choices: the base is many times the
# spread with which a healthy save's processes reach its barriers (the slow tests save every
# few steps, 4 processes on 2 cores, and never time out); the rate is below every checkpoint
# write rate `benchmarks/checkpoint.py` measured (183 MB/s and up, docs/checkpointing.md).
SAVE_WAIT_BASE_S = 15.0
SAVE_WAIT_RATE = 50e6


# Every file a complete checkpoint holds: the common ones, then the state's in
# either layout (Orbax's sharded arrays, or one process's replica).
_REQUIRED = ("_CHECKPOINT_METADATA", "meta/metadata")
_STATE_LAYOUTS = (("state/_METADATA", "state/manifest.ocdbt"), ("state/" + REPLICA_FILE,))


def _file_problem(path: str, name: str) -> str | None:
    try:
        if os.path.getsize(os.path.join(path, name)) == 0:
            return f"{name} is empty"
    except OSError:
        return f"{name} is missing"
    return None


def missing_files(path: str) -> str | None:
    """Why the checkpoint directory ``path`` is incomplete, or None when its files are all there.

    Checks that each file of a complete checkpoint exists and is not empty,
    that a replica archive is whole (its index is read) and that the JSON
    record parses and carries the parameter checksum; cheap enough to ask
    before every retention decision.
    """
    for name in _REQUIRED:
        if (problem := _file_problem(path, name)) is not None:
            return problem
    problems = [[_file_problem(path, n) for n in layout] for layout in _STATE_LAYOUTS]
    complete = [layout for layout, ps in zip(_STATE_LAYOUTS, problems, strict=True) if not any(ps)]
    if not complete:
        started = [p for ps in problems for p in ps if p and "empty" in p]
        return started[0] if started else "state/ holds no array data"
    if complete[0] == _STATE_LAYOUTS[1]:
        try:
            with zipfile.ZipFile(os.path.join(path, "state", REPLICA_FILE)) as archive:
                archive.namelist()
        except (OSError, zipfile.BadZipFile) as err:
            return f"state/{REPLICA_FILE} is damaged ({type(err).__name__})"
    try:
        with open(os.path.join(path, "meta", "metadata"), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as err:
        return f"meta/metadata does not parse ({type(err).__name__})"
    if not isinstance(record, dict) or "param_checksum" not in record:
        return "meta/metadata has no parameter checksum"
    return None


def on_disk_bytes(path: str) -> int:
    """The bytes of every file under ``path`` (a checkpoint's size on disk)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


@dataclasses.dataclass(frozen=True)
class KeepIntact:
    """Orbax preservation policy: the newest ``n`` complete checkpoints, and nothing counted else.

    Orbax asks when a save starts, counting the save in flight. Counting only
    checkpoints whose files are all there on disk means that a save that fails
    (or a committed directory with no data) never pushes a good checkpoint out:
    the newest ``n`` that restore stay (the one in flight comes on top, and
    `Checkpointer` lets the oldest go once the new one is confirmed).
    Incomplete ones are left for `Checkpointer.restore_latest` to set aside
    with a message.
    """

    directory: str
    n: int

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        del context
        keep, counted = [True] * len(checkpoints), 0
        for i in range(len(checkpoints) - 1, -1, -1):
            if missing_files(os.path.join(self.directory, str(checkpoints[i].step))) is None:
                counted += 1
                keep[i] = counted <= self.n
        return keep


class ReplicaHandler(ocp.AsyncCheckpointHandler):
    """Orbax item handler for one process's full replica of the state, as host arrays.

    In a multi-process job one process (the lowest live one) writes the
    state, and it may be any process: Orbax's own serializers write host
    arrays from process 0 only and refuse host-local device arrays. This
    handler writes the replica as one ``replica.npz`` (each leaf's raw bytes,
    with its dtype and shape in an index) in the background, and reads it
    back into the target's structure, checking every shape and dtype.
    """

    async def async_save(self, directory: Any, args: ReplicaSave) -> list[Any]:
        leaves = [np.asarray(x) for x in jax.tree.leaves(args.state)]
        target = os.path.join(os.fspath(directory), REPLICA_FILE)
        return [ocp.future.CommitFutureAwaitingContractedSignals(_write_replica(target, leaves))]

    def save(self, directory: Any, args: ReplicaSave) -> None:
        for f in asyncio.run(self.async_save(directory, args)):
            f.result()

    def restore(self, directory: Any, args: ReplicaRestore) -> Any:
        leaves, treedef = jax.tree.flatten(args.target)
        with np.load(os.path.join(os.fspath(directory), REPLICA_FILE), allow_pickle=False) as z:
            index = json.loads(bytes(z["index"]).decode())
            if len(index) != len(leaves):
                raise ValueError(f"the replica holds {len(index)} arrays, the state {len(leaves)}")
            out = []
            for i, (leaf, (dtype, shape)) in enumerate(zip(leaves, index, strict=True)):
                if tuple(shape) != tuple(leaf.shape) or np.dtype(dtype) != np.dtype(leaf.dtype):
                    raise ValueError(
                        f"array {i} is {dtype}{tuple(shape)}, the state wants "
                        f"{np.dtype(leaf.dtype)}{tuple(leaf.shape)}"
                    )
                out.append(z[f"a{i}"].view(np.dtype(dtype)).reshape(shape))
        return jax.tree.unflatten(treedef, out)


async def _write_replica(path: str, leaves: list[np.ndarray]) -> None:
    await asyncio.to_thread(_write_replica_now, path, leaves)


def _write_replica_now(path: str, leaves: list[np.ndarray]) -> None:
    index = json.dumps([[str(x.dtype), list(x.shape)] for x in leaves]).encode()
    arrays = {
        f"a{i}": np.ascontiguousarray(x).reshape(-1).view(np.uint8) for i, x in enumerate(leaves)
    }
    with open(path, "wb") as f:
        np.savez(f, index=np.frombuffer(index, np.uint8), **arrays)
        f.flush()
        os.fsync(f.fileno())


@ocp.args.register_with_handler(ReplicaHandler, for_save=True)
@dataclasses.dataclass
class ReplicaSave(ocp.args.CheckpointArgs):
    """Save ``state``, a pytree of host arrays (this process's replica)."""

    state: Any


@ocp.args.register_with_handler(ReplicaHandler, for_restore=True)
@dataclasses.dataclass
class ReplicaRestore(ocp.args.CheckpointArgs):
    """Restore into the structure, shapes and dtypes of ``target`` (host arrays)."""

    target: Any


def replica_split(shards: Sequence[tuple[tuple[int, ...], int, int]], groups: int) -> int:
    """The most replicas a sharded save splits each array's writing over: most bytes split.

    Orbax's replica-parallel save cuts each array's shard along an axis that
    the number of its replicas divides; an array with no such axis is written
    by one replica alone. With 1,000 groups and dimensions that are powers of
    two, nothing would split. Orbax can be told to split over at most ``c``
    replicas: this is the largest ``c`` under which the arrays holding at
    least `SPLIT_SHARE` of the bytes split (``min(replicas, c)`` divides an
    axis of the shard, or the array has one replica: its holder writes it).

    ``shards``: each array's shard shape, bytes and replicas inside one group
    (its replicas are those times ``groups``, the live groups).
    """
    if not shards:
        return 1
    nbytes = np.array([n for _, n, _ in shards], np.float64)
    replicas = np.array([groups * m for _, _, m in shards], np.int64)
    top = int(replicas.max())
    if top <= 1 or nbytes.sum() == 0:
        return 1
    counts = np.arange(2, top + 1)
    k = np.minimum(replicas[:, None], counts[None, :])  # [array, count]: replicas it splits over
    good = nbytes @ _splits(shards, k) >= SPLIT_SHARE * nbytes.sum()
    return int(counts[good].max()) if good.any() else 1


def _splits(shards: Sequence[tuple[tuple[int, ...], int, int]], k: np.ndarray) -> np.ndarray:
    """Whether each array's writing splits over ``k`` replicas (its row of ``k``; any
    trailing axes): ``k`` divides an axis of its shard, or ``k`` is 1."""
    splits = k == 1
    shape = (-1,) + (1,) * (k.ndim - 1)
    for axis in range(max(len(s) for s, _, _ in shards)):
        dims = np.array([s[axis] if axis < len(s) else -1 for s, _, _ in shards]).reshape(shape)
        splits |= (dims % k == 0) & (dims > 0)
    return splits


def save_wait_s(
    shards: Sequence[tuple[tuple[int, ...], int, int]], groups: int, cap: int | None = None
) -> float:
    """How long a sharded save's barriers wait for a process: `SAVE_WAIT_BASE_S` plus the
    most one process may write (bounded as if it held every distinct shard of an array)
    at `SAVE_WAIT_RATE` bytes a second.

    The coordination service does not fail a barrier whose participant died,
    so this bounds what a death in the middle of a save costs the survivors
    (`spare_jax.saving`), and it grows with the bytes so that a healthy slow
    write is not taken for one. ``cap``: the save's `replica_split`, when known.
    """
    if not shards:
        return SAVE_WAIT_BASE_S
    cap = replica_split(shards, groups) if cap is None else cap
    nbytes = np.array([n for _, n, _ in shards], np.float64)
    k = np.minimum(np.array([groups * m for _, _, m in shards], np.int64), cap)
    over = np.where(_splits(shards, k), k, 1)
    return SAVE_WAIT_BASE_S + float((nbytes / over).sum()) / SAVE_WAIT_RATE


def shard_table(abstract_state: Any, groups: int) -> list[tuple[tuple[int, ...], int, int]]:
    """What `replica_split` takes, per leaf of a state over ``groups`` groups: its shard's
    shape, its bytes, and how many devices of a group hold each shard."""

    def row(a: jax.ShapeDtypeStruct) -> tuple[tuple[int, ...], int, int]:
        shard = a.sharding.shard_shape(a.shape)
        distinct = max(math.prod(a.shape), 1) // max(math.prod(shard), 1)
        per_group = max(len(a.sharding.device_set) // (distinct * groups), 1)
        return tuple(shard), a.size * a.dtype.itemsize, per_group

    return [row(a) for a in jax.tree.leaves(abstract_state)]


def sharded_handler(multiprocessing: Any, primary: int, cap: int) -> ocp.PyTreeCheckpointHandler:
    """Orbax's sharded arrays, every live process writing its part, split over ``cap`` replicas.

    ``primary``: the live process that writes the metadata and commits (Orbax's
    default array handler names process 0, even after it died).
    """
    arrays = ocp.type_handlers.ArrayHandler(
        primary_host=primary, max_replicas_for_replica_parallel=cap
    )
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, arrays),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (np.number, ocp.type_handlers.ScalarHandler()),
        (int, ocp.type_handlers.ScalarHandler()),
        (float, ocp.type_handlers.ScalarHandler()),
    )
    return ocp.PyTreeCheckpointHandler(
        multiprocessing_options=multiprocessing, type_handler_registry=registry
    )


def barrier_timed_out(err: BaseException) -> bool:
    """Whether a failed save ran out of time at one of Orbax's barriers between processes
    (a process that should have reached it is gone), rather than failing to write."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, TimeoutError) or "DEADLINE_EXCEEDED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_step(
    path: str, abstract_state: Any, host_target: Any, multiprocessing: Any | None
) -> tuple[Any, dict, bool]:
    """The state and JSON record of the committed checkpoint at ``path``, in either layout.

    Read with the item handlers directly (not a manager's, which are one
    layout's): a checkpoint written by a multi-process job resumes in a lone
    process and the other way round. ``multiprocessing`` None: this process
    reads it alone, onto its host (``host_target``), waiting on no other;
    otherwise with those options onto ``abstract_state``'s shardings. The flag
    returned says the state is on the host (to be placed).
    """
    with open(os.path.join(path, "meta", "metadata"), encoding="utf-8") as f:
        meta = json.load(f)
    state_dir = epath.Path(path) / "state"
    if (state_dir / REPLICA_FILE).exists():
        return ReplicaHandler().restore(state_dir, ReplicaRestore(host_target)), meta, True
    local = multiprocessing is None
    if local:
        me = jax.process_index()
        multiprocessing = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing)
    try:
        target = host_target if local else abstract_state
        state = handler.restore(state_dir, args=ocp.args.StandardRestore(target))
    finally:
        handler.close()
    return state, meta, local

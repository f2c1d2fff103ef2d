"""Orbax checkpoints of the train state, and a restore that skips junk.

`Checkpointer` is an Orbax ``CheckpointManager`` with asynchronous saves of
the train state plus a JSON record of everything else needed to continue
exactly (the live set, the failure process's progress, the re-join clock, a
parameter checksum). Orbax decides when to save through the run's
`spare_jax.interval.Interval` (its ``save_decision_policy`` hook; the
interval comes from the analytical model) and keeps the latest few through
our `KeepIntact` preservation policy. `restore_latest` walks the steps from
the newest, moves a checkpoint that fails to restore (a killed save, a
truncated file, a foreign directory, a checksum mismatch) aside into
``corrupt/`` with a warning naming it, and returns the newest good one.

A committed checkpoint is trusted only once its files are all there
(`missing_files`): a save is reported complete only then (a failed save
raises `StorageError`, naming a full disk when that is the cause), and the
retention policy (`KeepIntact`) counts only such checkpoints, so a failed or
empty save never pushes a good one out. Whichever process writes, Orbax's
handlers are told it is the primary host: without that, a writer other than
process 0 commits directories that hold no data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from spare_jax import checks, digest, errors, jax_internals, layouts, multihost, runlog
from spare_jax.digest import param_checksum  # also here: the record's checksum
from spare_jax.interval import Interval, IntervalModel  # also here: Checkpointer takes one
from spare_jax.layouts import (
    KeepIntact,
    ReplicaHandler,
    ReplicaSave,
    missing_files,
    replica_split,
)

__all__ = [
    "Checkpointer",
    "Interval",
    "IntervalModel",
    "KeepIntact",
    "NoUsableCheckpoint",
    "Restored",
    "Saved",
    "StorageError",
    "host_replica",
    "missing_files",
    "param_checksum",
    "replica_split",
]

log = logging.getLogger(__name__)


class NoUsableCheckpoint(errors.FitError):
    """Checkpoints exist but none of them restores."""

    exit_status = errors.EXIT_BAD_INPUT


StorageError = errors.StorageError  # a checkpoint could not be written


@dataclasses.dataclass(frozen=True)
class Saved:
    """A save that completed with every file in place: its step, stall and write seconds."""

    step: int
    stall_s: float
    write_s: float


def host_replica(state: Any) -> tuple[Any, dict[str, Any]]:
    """What a multi-process job's writer saves: its replica's host copy, and the record's checks.

    The digest and the parameter checksum are computed where the arrays lie
    (on device), before the copy, so neither uploads the copy again.
    """
    checks = {
        "state_digest": digest.state_digest(state),
        "param_checksum": digest.param_checksum(state.params),
    }
    return jax.tree.map(multihost.host_copy, state), checks


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint: its step, the train state and the JSON record saved with it."""

    step: int
    state: Any
    meta: dict[str, Any]
    restore_s: float


class Checkpointer:
    """Async Orbax checkpoints of the train state and its JSON record under ``directory``."""

    def __init__(
        self,
        directory: str,
        policy: Interval,
        *,
        keep: int = 3,
        use_async: bool = True,
        writer: bool = True,
        process_local: bool = False,
        group: tuple[int, set[int]] | None = None,
        shards: Sequence[tuple[tuple[int, ...], int, int]] = (),
        replicas: int = 1,
    ):
        self.directory = os.path.abspath(directory)
        # (primary, live processes): every one of them writes its part of the global
        # state (sharded checkpoints; groups spanning processes); the primary commits.
        self.group = (int(group[0]), frozenset(group[1])) if group is not None else None
        self._scope = "spare-m0"
        # Sharded saves: each array's shard shape, bytes and replicas in a group; the live
        # groups (`layouts.replica_split`).
        self._shards, self._replicas = list(shards), int(replicas)
        self.policy = policy
        self.keep = checks.integer("keep", keep, low=1)
        self.use_async = use_async
        self.process_local = process_local
        self._pending: tuple[int, float, float] | None = None  # step, start, stall
        self._unreported: list[Saved] = []
        self.last_save_s: float | None = None
        self.wait_s = layouts.SAVE_WAIT_BASE_S  # sharded saves: their barriers' timeout
        # Sharded saves: Orbax's barriers time out after `wait_s` while the manager is
        # open, in the background write too (`jax_internals.orbax_barrier_timeout`).
        self._barriers = contextlib.ExitStack()
        self._manager = self._open(writer)

    def _open(self, writer: bool) -> ocp.CheckpointManager | None:
        """The Orbax manager; None for a process of a multi-process job that does not write.

        A non-writer never lists the directory: Orbax's listing reads each
        step's metadata, and the writer may be setting one aside meanwhile.

        ``process_local``: this process saves and restores its own replica
        (`ReplicaHandler`) and never waits on a barrier with the others (one
        of them may be dead).
        The item handlers get the same options: they decide on their own who
        writes the files, and without being told they leave it to process 0.
        """
        me = jax.process_index()
        if self.process_local:
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=me, active_processes={me}
            )
        elif self.group is not None:  # a barrier scope per membership: none waits on the dead
            primary, active = self.group
            multiprocessing = ocp.options.MultiprocessingOptions(
                primary_host=primary,
                active_processes=set(active),
                barrier_sync_key_prefix=self._scope,
            )
        else:
            multiprocessing = ocp.options.MultiprocessingOptions()
        self.writer = writer
        self._multiprocessing = multiprocessing
        self._whole: dict[int, bool] = {}  # `_counted`
        if not writer and self.process_local:
            return None
        local_dirs = self.process_local or self.group is not None
        # A process lost in a sharded save holds the others at its barriers for this long.
        if self.group is not None:
            cap = layouts.replica_split(self._shards, self._replicas)
            self.wait_s = layouts.save_wait_s(self._shards, self._replicas, cap)
            runlog.emit("save_barriers", wait_s=round(self.wait_s, 3))  # the launcher allows it
            self._barriers.enter_context(
                jax_internals.orbax_barrier_timeout(math.ceil(self.wait_s))
            )
        waits = {"timeout_secs": math.ceil(self.wait_s)} if self.group is not None else {}
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=self.policy,
            preservation_policy=KeepIntact(self.directory, self.keep),
            enable_async_checkpointing=self.use_async,
            cleanup_tmp_directories=writer and self.moves_files(writer),
            read_only=not writer,
            multiprocessing_options=multiprocessing,
            create=not local_dirs,  # Orbax leaves the directory to us then
            # Asynchronous directory creation signals through keys in the job's
            # key-value store, numbered per process: a new writer would find the
            # keys of the dead one and wait on signals nobody sends.
            async_options=ocp.options.AsyncOptions(
                create_directories_asynchronously=not local_dirs, **waits
            ),
        )
        if local_dirs and writer:
            os.makedirs(self.directory, exist_ok=True)
        if self.process_local:
            state = ReplicaHandler()
        elif self.group is None:
            state = ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing)
        else:
            state = layouts.sharded_handler(multiprocessing, self.group[0], cap)
        handlers = {
            "state": state,
            "meta": ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing),
        }
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def moves_files(self, writer: bool | None = None) -> bool:
        """Whether this process cleans up and sets damaged checkpoints aside (one process does)."""
        writer = self.writer if writer is None else writer
        return writer and (self.group is None or self.group[0] == jax.process_index())

    def regroup(self, primary: int, active: set[int], when: str, replicas: int = 1) -> None:
        """The live processes changed: save with these from now on, in a new barrier scope.

        The scope is named by ``when`` (the same on every one of them, e.g. the
        attempt and step) and the set itself, so that a process that joins the
        job later names it as the others do. ``replicas``: the live groups. A save
        still in flight finishes first, or is dropped if a process was lost in it.
        """
        self._settle()
        self.close()
        self._replicas = int(replicas)
        self.group, self.process_local = (int(primary), frozenset(active)), False
        self._scope = f"spare-{when}-{zlib.crc32(repr(sorted(active)).encode()):08x}"
        self._manager = self._open(True)

    def become_writer(self) -> None:
        """Take over saving (the previous writer's process died)."""
        if not self.writer:
            self.close()
            self._manager = self._open(True)

    def steps(self) -> list[int]:
        """Steps on disk, oldest first (a process that does not write sees none)."""
        return [] if self._manager is None else list(self._manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        *,
        force: bool = False,
        started: float | None = None,
    ) -> float | None:
        """Start a save if the policy says so (or ``force``); return the blocking stall (s) or None.

        The save is complete once `poll` or `wait` reports it. ``started``: when
        the caller began the stall (``time.perf_counter``), e.g. before copying
        the state off the devices; default now. A ``state_digest`` or ``param_checksum``
        in ``meta`` (computed where the arrays lay) is kept; otherwise computed here.

        Raises:
            StorageError: the previous save failed, or this one could not start
                for lack of space.
        """
        if not (force or self.due(step)):
            return None
        self._report(self._finish_pending())  # Orbax waits for the previous save: check it
        start = time.perf_counter() if started is None else started
        if not self.writer or (force and step in self._manager.all_steps()):
            return None
        for seen in self._manager.all_steps() if self.group is not None else []:
            self._counted(seen)  # before this save's end, when the primary may delete one
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ReplicaSave(state)
                    if self.process_local
                    else ocp.args.StandardSave(state)
                    if self.group is None
                    else ocp.args.PyTreeSave(state),
                    meta=ocp.args.JsonSave(
                        {
                            **meta,
                            "param_checksum": meta["param_checksum"]
                            if "param_checksum" in meta
                            else digest.param_checksum(state.params),
                            "state_digest": meta.get("state_digest") or digest.state_digest(state),
                        }
                    ),
                ),
                force=force,
            )
        except Exception as err:
            if self._disk_full():
                raise self._storage_error(step, f"{type(err).__name__}") from None
            raise
        if not saved:
            return None
        stall = time.perf_counter() - start
        self._pending = (step, start, stall)
        return stall

    def in_flight(self) -> bool:
        """Whether a save started and has not been reported complete (or dropped) yet."""
        return self._pending is not None

    def writing(self) -> bool:
        """Whether this process's part of the save in flight is still being written."""
        return self._pending is not None and self._manager.is_saving_in_progress()

    def due(self, step: int) -> bool:
        """Whether Orbax's policy would save ``step`` (ask before building what to save)."""
        return self._manager is not None and self.writer and self._manager.should_save(step)

    def poll(self) -> list[Saved]:
        """The saves completed with all their files since last asked (each reported once).

        Raises:
            StorageError: a save ended without writing the whole checkpoint.
        """
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self._report(self._finish_pending())
        done, self._unreported = self._unreported, []
        return done

    def wait(self) -> list[Saved]:
        """Block until the save in flight has completed; report as `poll` does."""
        self._settle()
        done, self._unreported = self._unreported, []
        return done

    def _settle(self) -> None:
        """Let the save in flight finish; keep its report for `poll` or `wait`."""
        if self._pending is None and self._manager is not None:
            self._manager.wait_until_finished()
        self._report(self._finish_pending())

    def _report(self, saved: Saved | None) -> None:
        if saved is not None:
            self._unreported.append(saved)

    def _finish_pending(self) -> Saved | None:
        if self._pending is None:
            return None
        step, start, stall = self._pending
        self._pending = None
        try:
            self._manager.wait_until_finished()
        except Exception as err:  # noqa: BLE001 - Orbax re-raises whatever the writer hit
            if self.group is not None and layouts.barrier_timed_out(err) and not self._disk_full():
                # A process lost in the save never reached its barriers: the step's
                # live-set check takes the loss; this save is dropped on every survivor.
                runlog.notice(f"the save of step {step} was dropped: a process was lost in it")
                return None
            reason = " ".join(str(err).split())[:200] or type(err).__name__
            raise self._storage_error(step, f"{type(err).__name__}: {reason}") from None
        self.last_save_s = time.perf_counter() - start
        why = missing_files(os.path.join(self.directory, str(step)))
        if why is not None:
            raise self._storage_error(step, why)
        # Orbax kept the older ones while this save was unconfirmed: now it is.
        self._whole[step] = True
        intact = [s for s in self.steps() if self._counted(s)]
        for old in intact[: -self.keep]:
            self._manager.delete(old)
        return Saved(step, stall, self.last_save_s)

    def _disk_full(self) -> bool:
        """Whether the file system holding the checkpoints has no room for another one."""
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return False
        intact = [s for s in self.steps() if self._intact(s)]
        need = (
            layouts.on_disk_bytes(os.path.join(self.directory, str(intact[-1])))
            if intact
            else 1 << 20
        )
        return free < max(need, 1 << 16)

    def _counted(self, step: int) -> bool:
        """Whether ``step`` counts among the ``keep`` checkpoints kept.

        Sharded saves: as first seen by this manager, at the latest when a save
        starts (every live process is then past the last delete's barrier, and
        none deletes until the save ends). Every live process decides which to
        let go (Orbax's delete has a barrier), while the primary may be deleting
        one already: a fresh look at the disk would differ between them.
        """
        if self.group is None:
            return self._intact(step)
        if step not in self._whole:
            self._whole[step] = self._intact(step)
        return self._whole[step]

    def _intact(self, step: int) -> bool:
        return missing_files(os.path.join(self.directory, str(step))) is None

    def _storage_error(self, step: int, why: str) -> StorageError:
        intact = [s for s in self.steps() if s != step and self._intact(s)]
        kept = f"checkpoint {intact[-1]} is the newest intact one" if intact else "none is intact"
        if self._disk_full():
            usage = shutil.disk_usage(self.directory)
            return StorageError(
                f"the disk holding {self.directory} is full ({usage.free / 2**20:.1f} MiB free "
                f"of {usage.total / 2**20:.1f} MiB): the save of step {step} failed; {kept} "
                "(kept); free some space and rerun the same command to resume",
                disk_full=True,
            )
        return StorageError(
            f"the save of step {step} to {self.directory} did not complete ({why}); {kept}",
            disk_full=False,
        )

    def _quarantine(self, step: int, error: BaseException) -> None:
        reason = " ".join(str(error).split())[:200]
        if not self.moves_files():  # only the writer moves files (and says so); the others skip
            log.info("skipping checkpoint %d: %s: %s", step, type(error).__name__, reason)
            return
        source = os.path.join(self.directory, str(step))
        target = os.path.join(self.directory, "corrupt", f"{step}-{int(time.time())}")
        runlog.notice(
            f"skipping checkpoint {source}: {type(error).__name__}: {reason} (moved to {target})"
        )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)

    def restore_latest(self, abstract_state: Any, *, place: bool = True) -> Restored | None:
        """The newest checkpoint that restores and checks out; None when there is none at all.

        ``abstract_state``: shapes, dtypes and shardings of the state (its
        `SpareStep.abstract_state`). Either layout restores: a replica (written
        by one process of a multi-process job) is read on the host and placed;
        sharded arrays are read as host arrays in a multi-process job (no
        process waits on another) and onto their shardings in a lone one.
        ``place=False`` leaves a state read on the host there (the caller
        places it: `spare_jax.saving` sends it to the other groups).

        Raises:
            NoUsableCheckpoint: checkpoints exist but every one of them failed.
        """
        if self._manager is None:
            raise RuntimeError("only the writer reads checkpoints in a multi-process job")
        self._settle()
        self._manager.reload()
        tried = 0
        host_target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_state)
        shardings = jax.tree.map(lambda a: a.sharding, abstract_state)
        for step in sorted(self._manager.all_steps(), reverse=True):
            tried += 1
            start = time.perf_counter()
            try:
                local = self.process_local or not place
                state, meta, host = layouts.read_step(
                    os.path.join(self.directory, str(step)),
                    abstract_state,
                    host_target,
                    None if local else self._multiprocessing,
                )
                if "state_digest" in meta:  # every bit of every array: the stronger check
                    digest.check_digest(state, meta["state_digest"])
                else:
                    got, want = digest.param_checksum(state.params), meta["param_checksum"]
                    if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
                        raise ValueError(
                            f"parameter checksum {got!r} differs from the saved {want!r}"
                        )
            except Exception as error:  # noqa: BLE001 - any failure means: not this one
                self._quarantine(step, error)
                continue
            self._manager.reload()
            if host and place:
                state = multihost.from_local(state, shardings)
            return Restored(step, state, meta, time.perf_counter() - start)
        self._manager.reload()
        if tried:
            raise NoUsableCheckpoint(
                f"none of the {tried} checkpoint(s) in {self.directory} restores "
                f"(moved to {os.path.join(self.directory, 'corrupt')})"
            )
        return None

    def close(self) -> None:
        try:
            if self._manager is not None:
                try:
                    self._manager.close()
                except Exception as err:
                    if self.group is None or not layouts.barrier_timed_out(err):
                        raise
                    # The background write of a save that a lost process had a part in
                    # (dropped already): Orbax raises its error once; closing again ends.
                    log.info("closing past a dropped save: %s", " ".join(str(err).split()))
                    self._manager.close()
        finally:
            self._barriers.close()

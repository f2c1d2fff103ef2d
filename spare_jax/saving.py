"""The run's checkpoints, as the loop sees them: `Saving`, a part of `spare_jax.trainer.Trainer`.

Orbax's policy (`checkpoint.Interval`) decides when; `Saving._save` builds
what is saved (a process's own replica, or every live process's shards when
groups span processes), and notes each completed save so that the interval
model is re-derived from measured stalls. A preemption notice and a
non-finite loss end the run with the last good state saved.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from spare_jax import broadcast, errors, jax_internals, layouts, multihost, reorder, runlog
from spare_jax import checkpoint as ckpt_lib

__all__ = ["Saving"]

_RESTORE_WAIT_S = 1800.0  # the others wait while the writer reads, checks and sets aside


class Saving:
    """Saves, restores, rollback, preemption: mixed into `Trainer`."""

    def _checkpointer(self, workdir: str, keep: int, writer: bool) -> ckpt_lib.Checkpointer:
        """The run's checkpoints: one writer's replica, or every live process's part."""
        shared = self.shared_saves and not self.replacement
        return ckpt_lib.Checkpointer(
            os.path.join(workdir, "checkpoints"),
            self.interval,
            keep=keep,
            writer=writer or shared,
            # A replacement opens no checkpoints until it is in the save group (`_regrow`).
            process_local=self.multi and not shared,
            group=(self.writer_process, self.members) if shared else None,
            shards=layouts.shard_table(self.global_abstract, self.step.groups),
            replicas=self.step.groups,
        )

    def _regroup_saves(self) -> None:
        """The live processes changed: every one of them saves with the others from now on.

        A save in flight finishes first (one whose blocking part failed may still
        be writing in the background); if a lost process had a part in it, its
        barriers hold the survivors until they time out (`Checkpointer.wait_s`,
        twice: the write's and the commit's), and it is dropped. The launcher
        allows that wait while they say they are in a save.
        """
        self._at("checkpoint")
        self.ckpt.regroup(
            self.writer_process,
            self.members,
            f"{self.attempt}-{self.t}",
            replicas=len(self.live_groups),
        )

    def _restore(self) -> ckpt_lib.Restored | None:
        """The latest good checkpoint, placed; read from disk once per job where it can be.

        Multi-process with whole groups per process: only the writer reads it
        (and sets damaged ones aside); it tells the others which step it took
        through the key-value store (a few kB), and its group sends the state
        to every group on another process over the devices
        (`spare_jax.broadcast`). Groups spanning processes read their shards.
        """
        if not self.multi or self.spanning:
            return self.ckpt.restore_latest(self.global_abstract)
        start = time.perf_counter()
        self._restores += 1
        key = f"spare_jax/restore/{self._restores}"
        client = jax_internals.client()
        restored = None
        if self._is_writer():
            try:
                restored = self.ckpt.restore_latest(self.global_abstract, place=False)
            except ckpt_lib.NoUsableCheckpoint as err:
                client.key_value_set(key, json.dumps({"error": str(err)}))
                raise
            told = None if restored is None else {"step": restored.step, "meta": restored.meta}
            client.key_value_set(key, json.dumps({"restored": told}))
        else:
            wait_ms = int(_RESTORE_WAIT_S * 1000)
            said = json.loads(client.blocking_key_value_get(key, wait_ms))
            if "error" in said:
                raise ckpt_lib.NoUsableCheckpoint(said["error"])
            told = said["restored"]
        if told is None:
            return None
        state = self._spread(restored.state if restored is not None else None)
        return ckpt_lib.Restored(told["step"], state, told["meta"], time.perf_counter() - start)

    def _spread(self, host: Any | None) -> Any:
        """The writer's host state onto every group: its own by placing, the others' by sending."""
        abstract = jax.tree.leaves(self.global_abstract)
        mine = multihost.groups_touching(self.owners, [self.writer_process])
        others = [g for g in range(len(self.owners)) if g not in set(mine.tolist())]
        groups = sorted({int(mine.min()), *others})
        mesh = multihost.survivors_mesh(self._by_group, groups, self._template.mesh)
        leaves = None if host is None else jax.tree.leaves(host)
        moved = broadcast.move(
            mesh, groups.index(int(mine.min())), abstract, leaves, scope=self._scope
        )
        placed = (
            moved.leaves
            if leaves is None
            else multihost.from_local(leaves, [a.sharding for a in abstract])
        )
        return jax.tree.unflatten(jax.tree.structure(self.global_abstract), placed)

    def _save(self, *, force: bool = False) -> None:
        """Let Orbax's policy decide on step ``t`` (or force it); note finished saves."""
        # A shared save ends on every process at the same step (its end has barriers).
        ended = self._agreed_end if self.shared_saves else True
        for saved in self.ckpt.poll() if ended else []:
            self._note(saved)
        due = self._agreed_save if self.shared_saves else self.ckpt.due(self.t)
        self._agreed_save = self._agreed_end = False
        if not (force or due):  # most steps: nothing to build or copy
            return
        if self.multi and not self.shared_saves and not self.ckpt.writer:
            return  # the writer saves its replica; no copy here to throw away
        self._at("checkpoint")
        # Orbax waits for the previous save before starting this one anyway: put it on
        # record first, so that a kill during this save cannot lose its event.
        for saved in self.ckpt.wait():
            self._note(saved)
        local = self.multi and not self.shared_saves  # one process's whole replica, on its host
        began = time.perf_counter()  # the stall counts the copy off the devices
        if local:
            state, checks = ckpt_lib.host_replica(self.state)
            meta = {**self._meta(), **checks}
        else:
            meta, state = self._meta(), self.step.global_state(self.state)
        if self.shared_saves:
            stall = self._save_together(state, force or due)
        else:
            stall = self.ckpt.save(self.t, state, meta, force=force or due, started=began)
        if stall is not None:
            self.interval.stalls.append(stall)

    def _save_together(self, state: Any, force: bool) -> float | None:
        """Every live process saves its shards (sharded checkpoints, groups spanning
        processes), in one live-set block.

        The block holds the save's blocking part (the copy off the devices and
        Orbax's barriers before the write); the write runs in the background.
        A process lost in the blocking part leaves the others at one of Orbax's
        barriers until its timeout (`Checkpointer.wait_s`, which grows with the
        bytes); then every survivor's barrier fails and the block reports the
        loss to all of them at once: the save is dropped (the previous
        checkpoint stays the newest complete one) and the survivors take over
        as after a loss in a step. A loss during the background write is taken
        by the next step's block, and the save dropped when the survivors
        regroup (`_regroup_saves`).
        """
        started = time.time()
        try:
            with live_devices(self._all):
                return self.ckpt.save(self.t, state, self._meta(), force=force)
        except ProcessFailureError as err:
            runlog.notice(f"the save of step {self.t} was dropped: a process was lost in it")
            self._lose(err, started)
        except jax.errors.JaxRuntimeError as err:
            runlog.notice(
                f"the save of step {self.t} was dropped: a collective failed "
                f"({str(err).splitlines()[0][:160]})"
            )
            self._resync = True
        return None

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint records beyond the arrays, to go on from step ``t`` exactly."""
        return {
            "step": self.t,
            "attempt": self.attempt,
            "liveness": self.failures.state_dict(),
            "interval": self.interval.as_dict(),
        }

    def _note(self, saved: ckpt_lib.Saved) -> None:
        """A save completed with all its files: on record, and the interval re-derived."""
        self.log.event(
            "checkpoint",
            step=saved.step,
            save_s=round(saved.stall_s, 6),
            write_s=round(saved.write_s, 6),
        )
        self.interval.saves.append(saved.write_s)
        first = not self.interval.figures  # the first derivation is logged even if unchanged
        if self.interval.update(self.step_times) or (first and self.interval.figures):
            self._log_interval()

    def _log_interval(self) -> None:
        f = self.interval.figures
        capped = (
            f"the ceiling ({f['ceiling_by']}: {f['ceiling_s']:.3f} s of work) under "
            if self.interval.source == "ceiling"
            else ""
        )
        runlog.notice(
            f"checkpoint interval {self.interval.steps} steps: {capped}the model's optimum "
            f"{f['interval_s']:.3f} s for step {f['step_s']:.4f} s, save stall "
            f"{f['save_stall_s']:.4f} s, save {f['save_s']:.4f} s, restore {f['restore_s']:.4f} s, "
            f"group MTBF {f['group_mtbf_s']:.2f} s (MTTI {f['mtti_s']:.2f} s)"
        )

    def _wait_for_saves(self) -> None:
        self._at("checkpoint")
        for saved in self.ckpt.wait():
            self._note(saved)

    def _preempted(self) -> bool:
        """Whether to stop here for a preemption notice (SIGTERM), every process at the same step.

        In a multi-process job JAX's preemption service (part of its
        coordination service) hears the SIGTERM on any process and makes all
        of them agree on the step to stop at; a lone process has `preemption`.
        """
        if self.multi:
            try:
                return multihost_utils.reached_preemption_sync_point(self.t)
            except RuntimeError:  # JAX's preemption service is off
                return False
        return self.preemption is not None and self.preemption.requested

    def _stop_for_preemption(self) -> None:
        """Save the state at the step reached, then stop with `errors.Preempted`."""
        start = time.time()
        self._save(force=True)
        self._wait_for_saves()
        self.log.event("preempted", step=self.t, save_s=round(time.time() - start, 6))
        raise errors.Preempted(
            f"preempted at step {self.t}: its state is saved in {self.ckpt.directory}; rerun the "
            "same command to resume from it"
        )

    def _non_finite(self, record: dict[str, Any]) -> None:
        """Save the last good state (the step kept it) and stop."""
        record["loss"] = record["grad_norm"] = None
        self.log.write(record)
        self._save(force=True)
        self._wait_for_saves()
        raise errors.NonFiniteLoss(
            f"the loss became non-finite at step {self.t}; the state before it is saved as "
            f"checkpoint {self.t} in {self.ckpt.directory}"
        )

    def _note_relaunch(self, to: int) -> None:
        """The launcher started this job after an interruption: put the relaunch on record."""
        started = os.environ.get(multihost.ENV["relaunched_at"])
        if not started:
            return
        runlog.emit("resumed", step=to)
        steps = [r["step"] for r in self.log.previous if "event" not in r and "step" in r]
        reached = max(steps) + 1 if steps else to
        self.log.event(
            "relaunch",
            to_step=to,
            lost_steps=max(reached - to, 0),
            relaunch_s=round(time.time() - float(started), 6),
            attempt=self.attempt,
            rolled_back=True,
        )
        # its first step puts the whole way back on record (`relaunch_step`)
        self.recovering = {"origin": float(started), "resumed": time.time(), "relaunch": 1.0}

    def rollback(self, err: reorder.Interruption) -> None:
        """Restore the latest complete checkpoint (or a fresh state), replace the failed groups."""
        uncovered = np.asarray(err.uncovered).tolist()
        if self.lost_processes:
            self._wait_for_saves()
            raise errors.Relaunch(
                f"interrupted at step {self.t} after the loss of process(es) "
                f"{self.lost_processes}: shard(s) {uncovered} have no live holder; "
                "a fresh job rolls back"
            )
        self.rollbacks += 1
        if self.rollbacks > self.max_rollbacks:
            raise errors.TooManyRollbacks(
                f"rolled back {self.rollbacks - 1} times (max_rollbacks); "
                "the failure rate leaves no time between interruptions"
            )
        self.attempt += 1
        start = time.perf_counter()
        self.state = None  # the interrupted state goes; its buffers with it
        self._wait_for_saves()
        self._at("restore")
        restored = self._restore()
        self.state, to = (
            (self.step.init(self.params0), 0)
            if restored is None
            else (restored.state, restored.step)
        )
        restore_s = time.perf_counter() - start
        self.interval.restore_s = restore_s
        dead = np.flatnonzero(~self.failures.alive).tolist()
        self.failures.replace_all()
        self.log.event(
            "rollback",
            from_step=self.t,
            to_step=to,
            lost_steps=self.t - to,
            restore_s=round(restore_s, 6),
            uncovered=uncovered,
            dead=dead,
            attempt=self.attempt,
        )
        runlog.notice(
            f"interrupted at step {self.t}: shard(s) {uncovered} have no live holder (dead "
            f"groups {dead}); rolled back to step {to} with every failed group replaced"
        )
        self.t = to

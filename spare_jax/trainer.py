"""The owner of one fault-tolerant run: `Trainer`, the loop `spare_jax.fit` drives.

One object holds everything a failure touches: the live set
(`liveness.Failures`), the step in force (it alone swaps it when a process
is lost), the writer role, the checkpoint interval (`checkpoint.Interval`,
which is Orbax's save decision), the checkpoints, rollback, resume and the run
log. A failure travels one way:

* **simulated** (a schedule or a rate): `Failures.advance` changes the live
  mask before a step; `SpareStep.table` turns it into the step's slot table;
  the step runs, exact. When a shard has no live holder `reorder.Interruption`
  comes back instead, and the trainer rolls back to the latest complete
  checkpoint with every failed group replaced.
* **a real process loss** (multi-process jobs): each step runs inside
  ``multihost_utils.live_devices``; a dead process surfaces there as
  ``ProcessFailureError`` on every survivor at once. `Trainer._lose` marks
  its groups failed, builds the survivors' mesh and step (precompiled at
  start-up with ``precompile_failures``), re-wraps the state from the
  survivors' own buffers, hands the writer role on if the writer died, and
  the same step is retried. A dead process cannot re-join this job, so an
  interruption after one raises `errors.Relaunch`: the launcher starts a fresh
  job, which resumes from the latest checkpoint (the rollback).

Every step is exact and ``batches(t)`` is a pure function of ``t``, so the
parameters at the end equal those of a run that never failed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.multihost_utils import ProcessFailureError, live_devices
from jax.sharding import Mesh, NamedSharding

from spare_jax import checkpoint as ckpt_lib
from spare_jax import (
    domains,
    errors,
    fingerprint,
    inputs,
    liveness,
    multihost,
    rejoin,
    reorder,
    runlog,
)
from spare_jax import mesh as mesh_lib
from spare_jax import train_step as step_lib

__all__ = ["Trainer", "host_scalar"]

_TRANSIENT_RETRIES = 3


def host_scalar(x: jax.Array) -> Any:
    """A replicated scalar's value, read from this process's first shard."""
    return np.asarray(x.addressable_shards[0].data).item()


def interval_model(
    step: step_lib.SpareStep, failures: liveness.Failures, steps: int, gpu_mtbf_hours: float
) -> ckpt_lib.IntervalModel:
    """The analytical model of a run's checkpoint interval."""
    kind = {"replication": "replication", "data_parallel": "dp"}.get(step.placement.kind, "spare")
    return ckpt_lib.IntervalModel(
        strategy=kind,
        redundancy=step.placement.redundancy,
        microbatches=step.microbatches,
        policy=step.policy,
        groups=step.groups,
        devices_per_group=mesh_lib.devices_per_group(step.mesh),
        steps=steps,
        failure_rate=failures.total_rate,
        gpu_mtbf_hours=gpu_mtbf_hours,
        repair_steps=failures.repair_steps,
    )


def _host(x: Any) -> Any:
    """A host copy of an array a backend reset would invalidate (NumPy passes through)."""
    return multihost.host_copy(x) if isinstance(x, jax.Array) else x


class Trainer:
    """One attempt at a run: its state, its books, and the handling of each kind of failure.

    Args:
        step: the SPARe step (`spare_jax.make_train_step`) over the whole job's mesh.
        params: the initial parameters (any pytree of NumPy or JAX arrays).
        batches: ``batches(t)``, the failure-free global batch of step ``t``; pure in ``t``.
        workdir: ``metrics.jsonl``, ``summary.json`` and ``checkpoints/`` live here.
        steps: the run's length.
        failures: the simulated failure process (its state is checkpointed).
        checkpoint_steps: 0 for the analytical model's interval, N > 0 to pin it.
        keep: complete checkpoints kept.
        warmup_steps: steps timed before the first (calibration) save.
        max_rollbacks: give up past this many rollbacks.
        gpu_mtbf_hours: the failure rate the interval model assumes when none is configured.
        precompile_failures: multi-process: compile at start-up the step each single
            process failure would leave, so that a recovery does not compile.
        on_step: called with each per-step record.
        fault_hook: called with ``t`` at the start of each step, inside its
            membership scope (`spare_jax.testing`).
    """

    def __init__(
        self,
        step: step_lib.SpareStep,
        params: Any,
        batches: Callable[[int], Any],
        workdir: str,
        *,
        steps: int,
        failures: liveness.Failures,
        checkpoint_steps: int = 0,
        keep: int = 3,
        warmup_steps: int = 3,
        max_rollbacks: int = 100,
        gpu_mtbf_hours: float = 5.1e4,
        precompile_failures: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        fault_hook: Callable[[int], None] | None = None,
    ):
        self.multi = jax.process_count() > 1
        if self.multi:  # a process with no device on the mesh would wait for nothing
            holders = {d.process_index for d in step.mesh.devices.flat}
            idle = sorted(set(range(jax.process_count())) - holders)
            if idle:
                raise ValueError(
                    f"the mesh leaves process(es) {idle} without devices: build it over every "
                    "process's devices (spare_jax.make_mesh), each holding whole groups"
                )
        self._template = step  # what a re-join rebuilds the step from, on any mesh
        if self.multi:  # split by failure domain: a loss elsewhere never recompiles ours
            step = step.on_mesh(step.mesh, step.rows, domain=self._split_for(step.mesh))
        self.step, self.params0, self.batches = step, params, batches
        self.workdir, self.total, self.failures = workdir, steps, failures
        self.warmup, self.max_rollbacks = warmup_steps, max_rollbacks
        self.on_step, self.fault_hook = on_step, fault_hook
        model = None if checkpoint_steps else interval_model(step, failures, steps, gpu_mtbf_hours)
        calibrate = frozenset() if checkpoint_steps else frozenset({min(warmup_steps + 1, steps)})
        self.interval = ckpt_lib.Interval(
            total=steps, model=model, pinned=checkpoint_steps, extra=calibrate
        )
        # int[G, M]: the process of each device of each group (a group may span processes).
        self.owners = multihost.group_processes(step.mesh) if self.multi else None
        # Groups spanning processes: no process holds a whole replica, so checkpoints
        # are written by every live process (Orbax multi-process) at agreed steps.
        self.spanning = self.multi and bool((self.owners != self.owners[:, :1]).any())
        self._agreed_save = False  # spanning: the job's vote to save after this step
        self._by_group = multihost.group_devices(step.mesh)
        self._all = list(step.mesh.devices.flat)  # the job's devices: membership is checked on all
        # The whole job's layout by device id: a re-join rebuilds it on a new backend.
        self._ids = np.vectorize(lambda d: d.id)(step.mesh.devices)
        self._axes = step.mesh.axis_names
        self._ready: dict[tuple[int, ...], step_lib.SpareStep] = {}
        self._precompile = precompile_failures and self.multi
        self.replacement = self.multi and rejoin.is_replacement()
        self.members = set(range(jax.process_count()))  # processes whose groups are on the mesh
        self.writer_process = int(self.owners.min()) if self.multi else 0
        writer = self._is_writer() and not self.replacement
        self.log = runlog.RunLog(workdir, writer=writer)
        self.ckpt = ckpt_lib.Checkpointer(
            os.path.join(workdir, "checkpoints"),
            self.interval,
            keep=keep,
            writer=writer or self.spanning,
            process_local=self.multi and not self.spanning,
            group=(self.writer_process, self.members) if self.spanning else None,
            # Spanning: a save in flight has barriers with every live process; one lost
            # in it would hold the survivors for Orbax's barrier timeout. Saves finish
            # between steps instead.
            use_async=not self.spanning,
        )
        self.attempt = self.log.next_attempt
        self.global_abstract = step.abstract_state(params)
        self.step_times: list[float] = []
        self.rollbacks = 0
        self.state: Any = None
        self.t = 0
        self.last_loss = math.nan
        self.recovering: dict[str, float] | None = None
        self.lost_processes: list[int] = []
        self._last_emit = 0.0
        self.preemption: Any = None  # set by `spare_jax.fit` in a lone process
        self._resync = False
        self._transient = 0  # failed collectives in a row with every process alive
        self._warm: set[tuple[int, int]] = set()  # (step, slot bound) pairs run once: compiled
        self.joining: dict[str, Any] | None = None  # a re-join waiting for its first step
        self._check_input = True  # the batch contract, at a job's first step (`_check_batch`)
        self.input_rows = 0  # rows this process read from `batches`, every (re)load included
        self._next: tuple[Any, int, Any, int] | None = None  # a prefetched step's input

    def _split_for(self, full: Mesh) -> domains.Split:
        """This process's failure domain's programs, over ``full``'s devices (the job's mesh)."""
        rows = domains.domain_of(multihost.group_processes(full), jax.process_index())
        mesh = multihost.survivors_mesh(multihost.group_devices(full), rows, full)
        t = self._template
        return domains.Split(t.loss_fn, t.tx, mesh, rows, t.accum_dtype)

    def compiled(self) -> dict[str, int]:
        """Programs this process compiled for its step, by kind (the split step's three)."""
        split = self.step.domain if self.step is not None else None
        counts = dict(split.compiles) if split is not None else {}
        return {**counts, "step": self.step.compiles if self.step is not None else 0}

    # ------------------------------------------------------------------ roles

    @property
    def live_groups(self) -> list[int]:
        return [int(g) for g in self.step.rows]

    def _is_writer(self) -> bool:
        """One process writes the books: the lowest live one when the last writer died.

        A replacement that re-joins does not take the role back.
        """
        return not self.multi or jax.process_index() == self.writer_process

    # ------------------------------------------------------------ checkpoints

    def _restore(self) -> ckpt_lib.Restored | None:
        return self.ckpt.restore_latest(self.global_abstract)

    def _save(self, *, force: bool = False) -> None:
        """Let Orbax's policy decide on step ``t`` (or force it); note finished saves."""
        for saved in self.ckpt.poll():
            self._note(saved)
        due = self._agreed_save if self.spanning else self.ckpt.due(self.t)
        self._agreed_save = False
        if not (force or due):  # most steps: nothing to build or copy
            return
        self._at("checkpoint")
        # Orbax waits for the previous save before starting this one anyway: put it on
        # record first, so that a kill during this save cannot lose its event.
        for saved in self.ckpt.wait():
            self._note(saved)
        local = self.multi and not self.spanning  # one process's whole replica, on its host
        state = multihost.local_view(self.state) if local else self.state
        if self.spanning:
            stall = self._save_together(state, force or due)
        else:
            stall = self.ckpt.save(self.t, state, self._meta(), force=force or due)
        if stall is not None:
            self.interval.stalls.append(stall)

    def _save_together(self, state: Any, force: bool) -> float | None:
        """Groups spanning processes: every live process saves its shards, in one live-set block.

        A process lost during the save makes every survivor see it at once: the
        save is dropped (the previous checkpoint stays the newest complete one)
        and the survivors take over as after a loss in a step.
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
        if self.interval.update(self.step_times):
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

    # ----------------------------------------------------------------- phases

    def start(self) -> None:
        """Resume from the latest good checkpoint, or start fresh at step 0.

        A replacement for a dead process instead joins the running job and
        takes the state from a live peer (`_join`).
        """
        if self.replacement:
            self._join()
            return
        self._at("restore")
        restored = self._restore()
        if restored is None:
            self.state, self.t = self.step.init(self.params0), 0
            self._note_relaunch(0)  # a relaunch before the first checkpoint starts over
            return
        self.state, self.t = restored.state, restored.step
        self.failures.load_state_dict(restored.meta["liveness"])
        for r in self.log.previous:  # schedule entries fired after that save stay fired
            if r.get("event") == "failure":
                self.failures.fired.update((int(r["step"]), int(g)) for g in r["scheduled"])
        self.interval.load(restored.meta.get("interval", {}))
        self.interval.restore_s = restored.restore_s
        self.log.event(
            "resume",
            step=restored.step,
            restore_s=round(restored.restore_s, 6),
            attempt=self.attempt,
        )
        self._note_relaunch(restored.step)
        runlog.notice(f"resumed from checkpoint {restored.step} (attempt {self.attempt})")

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

    def _wait_for_saves(self) -> None:
        self._at("checkpoint")
        for saved in self.ckpt.wait():
            self._note(saved)

    # ---------------------------------------------------------- process loss

    def _survivors(self, live: Sequence[int]) -> step_lib.SpareStep:
        ready = self._ready.get(tuple(live))
        if ready is not None:
            return ready
        mesh = multihost.survivors_mesh(self._by_group, live, self._template.mesh)
        return self.step.on_mesh(mesh, np.asarray(live))

    def _precompile_all(self, stacks: Any) -> None:
        """Compile the survivors' step for each single process failure (at start-up)."""
        self._at("compile")
        me = jax.process_index()
        shardings = jax.tree.map(lambda x: x.sharding, self.state)
        mine = set(multihost.groups_touching(self.owners, [me]).tolist())
        for proc in sorted(set(np.unique(self.owners[self.live_groups]).tolist()) - {me}):
            live = [g for g in self.live_groups if proc not in self.owners[g]]
            if mine.isdisjoint(live):
                continue  # that loss takes this process's group too: it would leave
            step = self._survivors(live)
            abstract = jax.tree.map(
                lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                self.state,
                multihost.on_mesh(step.mesh, shardings),
            )
            step.precompile(abstract, stacks)  # only the shapes after the group axis count
            self._ready[tuple(live)] = step
        if not self.step.compiled():  # the job's own step too: no compile inside the first step
            self.step.precompile(self.state, stacks)
        self._resync = True  # compiles end at different times: meet before the first collective

    def _lose(self, err: ProcessFailureError, started: float) -> None:
        """Survivors take over: the dead groups failed, the new step and state, the books."""
        detected = time.time()
        dead_procs = sorted({d.process_index for d in err.failed_devices})
        # The launcher first: it kills what is left of them and knows the others
        # are recovering (compiling the step below can take longer than a heartbeat).
        runlog.emit("dead", processes=dead_procs, step=self.t)
        self._at("compile")  # rebuilding and compiling the survivors' step: busy
        lost = set(multihost.groups_touching(self.owners, dead_procs).tolist())
        dead_groups = [g for g in self.live_groups if g in lost]
        live = [g for g in self.live_groups if g not in dead_groups]
        # The other processes of a dead group leave: they hold no live group.
        leaving = sorted({int(p) for p in np.unique(self.owners[dead_groups])} - set(dead_procs))
        if jax.process_index() in leaving:
            self._leave_group(dead_procs, dead_groups)
        # The leavers stay in the live-set check until the job declares them dead:
        # then every survivor sees them go in the same block (`_left`).
        if not dead_groups:  # processes that left with their group, already masked
            self._left(dead_procs)
            return
        step = self._survivors(live)
        shardings = multihost.on_mesh(step.mesh, jax.tree.map(lambda x: x.sharding, self.state))
        self.state = multihost.reshard(self.state, shardings)
        rebuilt = time.time()
        stacks, rows = inputs.load(step, self.batches, self.t)  # the same units: no new data
        self.input_rows += rows
        self._next = (step, self.t, stacks, rows)
        before = self.compiled()
        compile_s = 0.0 if step.compiled() else step.precompile(self.state, stacks)
        self.step, self._ready = step, {}
        recompiled = {k: n - before.get(k, 0) for k, n in self.compiled().items()}
        self.lost_processes = sorted({*self.lost_processes, *dead_procs, *leaving})
        self.members -= {*dead_procs, *leaving}
        self.failures.fail(dead_groups, self.t, repair=False)  # no devices to re-join with
        killed = [multihost.kill_time(p) for p in dead_procs]
        origin = max([started, *[k for k in killed if k is not None]])
        if self.writer_process in {*dead_procs, *leaving}:
            self.writer_process = int(self.owners[self.live_groups].min())
        if self.spanning:  # every live process takes part in a save: a new group of them
            self.ckpt.regroup(self.writer_process, self.members)
        if self._is_writer():
            self.log.become_writer()
            self.ckpt.become_writer()
        self.log.event(
            "process_failure",
            process=dead_procs,
            groups=dead_groups,
            step=self.t,
            detect_s=round(detected - origin, 6),
            rebuild_s=round(rebuilt - detected, 6),
            compile_s=round(compile_s, 6),
            compiled={k: n for k, n in recompiled.items() if n},
        )
        runlog.notice(
            f"process(es) {dead_procs} (groups {dead_groups}) declared dead during step "
            f"{self.t}; {len(live)} live group(s) go on"
        )
        self.recovering = {"origin": origin, "detected": detected, "resumed": time.time()}
        self._resync = True
        self._check_input = True

    def _left(self, procs: list[int]) -> None:
        """Processes whose groups were already masked are gone: the books only, no new step."""
        self.members -= set(procs)
        self.lost_processes = sorted({*self.lost_processes, *procs})
        if self.writer_process in procs:
            self.writer_process = int(self.owners[self.live_groups].min())
        if self.spanning:
            self.ckpt.regroup(self.writer_process, self.members)
        if self._is_writer():
            self.log.become_writer()
            self.ckpt.become_writer()
        runlog.notice(f"process(es) {procs} left the job with their group (already masked)")
        self._resync = True

    def _leave_group(self, dead_procs: list[int], dead_groups: list[int]) -> None:
        """This process's group lost another of its processes: leave the job (it goes on)."""
        runlog.emit("group_lost", process=jax.process_index(), groups=dead_groups, step=self.t)
        err = errors.GroupLost(
            f"process(es) {dead_procs} died during step {self.t}, and with them group(s) "
            f"{dead_groups}, which this process belongs to; the job goes on without it"
        )
        # At once, without JAX's shutdown (which would wait on the survivors): the job
        # declares this process dead one heartbeat later, on every survivor alike.
        sys.stderr.write(f"spare-jax: {err}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(err.exit_status)

    # ------------------------------------------------------------------ re-join

    def _record(self) -> dict[str, Any]:
        """What a newcomer needs beyond the arrays: a checkpoint's record and the job's books."""
        return {
            **self._meta(),
            "rows": self.live_groups,
            "lost_processes": self.lost_processes,
            "writer": self.writer_process,
            "rollbacks": self.rollbacks,
        }

    def _admit(self, epoch: rejoin.Epoch) -> None:
        """Survivors: hand the state to the newcomers of ``epoch`` and grow the mesh back.

        Every survivor holds a full replica: each keeps its own on the host
        across the backend reset; the writer also publishes it for the
        newcomers. Step ``t`` runs next, with every group of the newcomers live.
        """
        if self.spanning:  # no process holds a replica to hand over (yet): start afresh
            raise errors.Relaunch(
                f"process(es) {epoch.joiners} came back at step {self.t}, but a group spanning "
                "processes cannot take a replacement in a running job; a fresh job resumes"
            )
        start = time.time()
        self._wait_for_saves()
        leaves, treedef = jax.tree.flatten(multihost.local_view(self.state))
        specs = jax.tree.map(lambda x: x.sharding.spec, self.state)
        self.params0 = jax.tree.map(_host, self.params0)
        rows, sent = self.live_groups, 0
        if self._is_writer():
            data = rejoin.pack(leaves, self._record())
            rejoin.send(epoch, data)
            sent = len(data)
        self.state, self.step, self._ready = None, None, {}
        rejoin.reset_backend(epoch, fresh=False)
        self._regrow(epoch, rows, jax.tree.unflatten(treedef, leaves), specs)
        rejoin.done(epoch)
        self._joined(epoch, start, sent)

    def _join(self) -> None:
        """A replacement: wait for the survivors to see us, take a live peer's state, go on."""
        with live_devices(self._all):
            pass  # the first block every process sees us in: the survivors stop there too
        me = jax.process_index()
        epoch = rejoin.Epoch(rejoin.live_incarnations(), [me])
        start = time.time()
        self._at("join")
        rejoin.announce(epoch)
        rejoin.reset_backend(epoch, fresh=True)
        data = rejoin.receive(epoch)
        leaves, meta = rejoin.unpack(data)
        abstract = self.global_abstract
        state = jax.tree.unflatten(jax.tree.structure(abstract), leaves)
        specs = jax.tree.map(lambda a: a.sharding.spec, abstract)
        self.t, self.attempt = int(meta["step"]), int(meta["attempt"])
        self.failures.load_state_dict(meta["liveness"])
        self.interval.load(meta["interval"])
        self.lost_processes = [int(p) for p in meta["lost_processes"]]
        self.writer_process, self.rollbacks = int(meta["writer"]), int(meta["rollbacks"])
        self.members = {p for p in epoch.processes if p != me}
        self._regrow(epoch, [int(g) for g in meta["rows"]], state, specs)
        rejoin.done(epoch)
        self._joined(epoch, start, len(data))
        runlog.notice(f"joined the running job at step {self.t} with the state of a live peer")

    def _regrow(self, epoch: rejoin.Epoch, rows: list[int], host_state: Any, specs: Any) -> None:
        """The mesh over every live group (the newcomers' again), on this backend's devices."""
        by_id = {d.id: d for d in jax.devices()}
        full = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(self._ids), self._axes)
        self._all = list(full.devices.flat)
        self._by_group = multihost.group_devices(full)
        back = [int(g) for g in multihost.groups_touching(self.owners, epoch.joiners)]
        live = sorted({*rows, *back})
        groups = np.arange(len(self.owners))
        self.global_abstract = self._template.on_mesh(full, groups).abstract_state(self.params0)
        self.step = self._template.on_mesh(
            multihost.survivors_mesh(self._by_group, live, self._template.mesh),
            np.asarray(live),
            domain=self._split_for(full),  # a new backend: its programs are new too
        )
        shardings = jax.tree.map(lambda sp: NamedSharding(self.step.mesh, sp), specs)
        self.state = multihost.from_local(host_state, shardings)
        self.members |= set(epoch.joiners)
        self.lost_processes = [p for p in self.lost_processes if p not in epoch.joiners]
        self.failures.alive[back] = True
        self._rejoined = back

    def _joined(self, epoch: rejoin.Epoch, start: float, nbytes: int) -> None:
        """Every process has its state: compile the step for the grown mesh, note the re-join."""
        placed = time.time()
        self._check_input = True
        stacks, rows = inputs.load(self.step, self.batches, self.t)
        self.input_rows += rows
        self._next = (self.step, self.t, stacks, rows)
        self._at("compile")
        compile_s = self.step.precompile(self.state, stacks)
        self.joining = {
            "process": epoch.joiners,
            "groups": self._rejoined,
            "step": self.t,
            "started": rejoin.start_times(epoch) if self._is_writer() else {},
            "transfer_s": round(placed - start, 6),
            "compile_s": round(compile_s, 6),
            "bytes": nbytes,
        }
        if self.replacement:
            runlog.emit("joined", step=self.t)

    def _note_rejoin(self) -> None:
        """After the first step with the newcomers: the re-join on record (the writer's)."""
        if self.joining is None:
            return
        joining, self.joining = self.joining, None
        if not self._is_writer():
            return
        started = joining.pop("started")
        now = time.time()
        joining["join_s"] = round(now - min(started.values()), 6) if started else None
        self.log.event("rejoin", **joining)
        runlog.notice(
            f"process(es) {joining['process']} re-joined at step {joining['step']} "
            f"(groups {joining['groups']} live again, {joining['bytes']} bytes from a peer)"
        )

    # ------------------------------------------------------------------- step

    def _newcomers(self, live: Sequence[jax.Device]) -> list[int]:
        """Processes this block's live set shows that are not on our mesh (a re-join)."""
        return sorted({d.process_index for d in live} - self.members)

    @staticmethod
    def _epoch(joiners: list[int]) -> rejoin.Epoch | None:
        """The re-join, named by the live set every process holds after the block."""
        return rejoin.Epoch(rejoin.live_incarnations(), joiners) if joiners else None

    def _check_batch(self, stacks: Any) -> None:
        """Multi-process, at a job's first step and after a recovery or re-join: every
        holder of a micro-batch got the same rows, or `errors.BatchMismatch` (`fingerprint`).
        """
        if not self._check_input:
            return
        fingerprint.check(stacks, self.step._unit_ids, self.t)
        self._check_input = False
        for step in self._ready.values():  # the survivors' steps are compiled: their check too
            fingerprint.precompile(
                jax.tree.map(
                    lambda x, st=step: jax.ShapeDtypeStruct(
                        (st.rows.size, *x.shape[1:]), x.dtype, sharding=st.stack_sharding
                    ),
                    stacks,
                )
            )

    def _at(self, phase: str) -> None:
        """Tell a launcher where this worker is in step ``t`` (`runlog.at`): its watch evicts
        a worker that stopped while its peers wait for it, never a busy one."""
        recent = self.step_times[-20:]
        runlog.at(self.t, phase, step_s=float(np.median(recent)) if recent else None)

    def _execute(self, table: Any, load: int) -> dict[str, Any] | rejoin.Epoch:
        """Run step ``t`` and return its record, or the re-join that comes first.

        Raises ``ProcessFailureError`` when a process died. Membership is
        checked over every device of the job, so that a replacement shows up
        at the same block on every process.
        """
        t0 = time.perf_counter()
        self._at("data")
        stacks, rows = self._input(self.t)
        if self._precompile:
            self._precompile = False
            self._precompile_all(stacks)
        if self._resync:  # survivors recover at their own pace: start the retry together
            self._at("sync")
            with live_devices(self._all) as live:
                joiners = self._newcomers(live)
            self._resync = False
            if joiners:
                return self._epoch(joiners)
        t1 = time.perf_counter()
        if self.multi:
            if self._check_input:  # compiled before the block, whose entry lines processes up
                fingerprint.precompile(stacks)
            fresh = (id(self.step), self.step.slot_bound) not in self._warm
            self._at("compile" if fresh else "step")  # a first run compiles: busy, not stuck
            if not self.step.compiled():  # before the block: peers compile at their own pace,
                self.step.precompile(self.state, stacks)  # the block's entry waits for all
            with live_devices(self._all) as live:
                joiners = self._newcomers(live)
                if not joiners:
                    self._check_batch(stacks)
                    if self.fault_hook is not None:
                        self.fault_hook(self.t)
                    # Only the reduction crosses groups: a peer lost in it leaves every
                    # survivor's state as it was (it is donated to the update alone).
                    try:
                        sums = self.step.reduce(self.state, stacks, table)
                        if self.spanning:  # the next save, agreed by every live process
                            vote = multihost.agree(self.step.mesh, self.ckpt.due(self.t + 1))
                        if fresh:  # compiled; the update compiles next, at its own pace:
                            self._at("step")  # meet before the next step's collectives
                            self._warm.add((id(self.step), self.step.slot_bound))
                            self._resync = True
                        self._prefetch(self.t + 1)
                        jax.block_until_ready(sums)
                        if self.spanning:
                            self._agreed_save = bool(host_scalar(vote))
                    finally:  # done or failed, it waits for its peers in the live-set check
                        self._at("sync")
            if joiners:
                return self._epoch(joiners)
            state, metrics = self._update(sums, table)
        else:
            if self.fault_hook is not None:
                self.fault_hook(self.t)
            state, metrics = self.step.run(self.state, stacks, table)
            self._prefetch(self.t + 1)  # the next step's input is read while this one runs
        self.state = state
        metrics = {k: host_scalar(v) if isinstance(v, jax.Array) else v for k, v in metrics.items()}
        t2 = time.perf_counter()
        if self.t > 0:  # step 0 compiles
            self.step_times.append(t2 - t0)
        self.last_loss = float(metrics["loss"])
        return {
            "step": self.t,
            "loss": self.last_loss,
            "live_groups": int(self.failures.alive.sum()),
            "max_load": load,
            "step_time_s": round(t2 - t1, 6),
            "data_time_s": round(t1 - t0, 6),
            "attempt": self.attempt,
            "overhead": load / self.step.microbatches,
            "grad_norm": float(metrics["grad_norm"]),
            "compiles": sum(self.compiled().values()),
            "exact": self.step.policy != "drop",
            "input_rows": rows,
        }

    def _update(self, sums: tuple[Any, ...], table: Any) -> tuple[Any, dict[str, Any]]:
        """Apply a completed reduction to this process's replica (multi-process jobs).

        No other group takes part in the update; a non-finite sum is not applied.
        """
        grad_sum, loss_sum, finite = sums
        if not host_scalar(finite):
            return self.state, {"loss": math.nan, "grad_norm": math.nan, "finite": False}
        try:
            state, metrics = self.step.update(self.state, grad_sum, loss_sum, table)
            jax.block_until_ready(state)
        except jax.errors.JaxRuntimeError as err:  # the state was donated: it is gone
            raise errors.Relaunch(
                f"step {self.t}: the optimizer update failed after the reduction "
                f"({str(err).splitlines()[0][:160]}); a fresh job resumes from the checkpoint"
            ) from None
        return state, {**metrics, "finite": True}

    def _input(self, t: int) -> tuple[Any, int]:
        """Step ``t``'s stacks for the step in force and the rows this process read for them."""
        ready, self._next = self._next, None
        if ready is not None and ready[0] is self.step and ready[1] == t:
            return ready[2], ready[3]
        stacks, rows = inputs.load(self.step, self.batches, t)
        self.input_rows += rows
        return stacks, rows

    def _prefetch(self, t: int) -> None:
        """Read step ``t``'s input ahead (while the device runs the step before it)."""
        if t < self.total:
            stacks, rows = inputs.load(self.step, self.batches, t)
            self.input_rows += rows
            self._next = (self.step, t, stacks, rows)

    def loop(self) -> None:
        """Train from step ``t`` to the end through every failure."""
        retry = False
        while self.t < self.total:
            if not retry:
                change = self.failures.advance(self.t)
                if change.rejoined:
                    self.log.event("rejoin", step=self.t, groups=list(change.rejoined))
                if change.failed:
                    self.log.event(
                        "failure",
                        step=self.t,
                        groups=list(change.failed),
                        scheduled=list(change.scheduled),
                    )
            retry = False
            try:
                table, load = self.step.table(self.failures.alive.copy())
            except reorder.Interruption as err:
                self.rollback(err)
                continue
            started = time.time()
            try:
                record = self._execute(table, load)
            except ProcessFailureError as err:
                self._lose(err, started)
                retry = True
                continue
            except jax.errors.JaxRuntimeError as err:
                # Every process alive, yet a collective failed (a peer slower than the
                # CPU collective timeout): all of them saw it; retry the same step.
                if not self.multi or self._transient >= _TRANSIENT_RETRIES:
                    raise
                self._transient += 1
                runlog.notice(
                    f"step {self.t}: a collective failed with every process alive "
                    f"({str(err).splitlines()[0][:160]}); retrying the step"
                )
                self._resync = True
                retry = True
                continue
            self._transient = 0
            if isinstance(record, rejoin.Epoch):  # step t waits for the newcomers
                self._admit(record)
                retry = True
                continue
            if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
                self._non_finite(record)
            self.log.write(record)
            self._recovered()
            self._note_rejoin()
            if self.on_step is not None:
                self.on_step(record)
            self.t += 1
            now = time.time()
            if now - self._last_emit >= 1.0:  # progress, for a launcher's hang watch
                self._last_emit = now
                runlog.emit("progress", step=self.t)
            if self._preempted() and self.t < self.total:
                self._stop_for_preemption()
            self._save()

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

    def _recovered(self) -> None:
        if self.recovering is None:
            return
        now = time.time()
        self.log.event(
            "recovered",
            step=self.t,
            live_groups=int(self.failures.alive.sum()),
            recovery_s=round(now - self.recovering["origin"], 6),
            since_detection_s=round(now - self.recovering["detected"], 6),
            first_step_s=round(now - self.recovering["resumed"], 6),
            rolled_back=False,
        )
        self.recovering = None

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

    def finish(self) -> dict[str, Any]:
        """Wait for saves, make sure the last step is saved, write the summary."""
        self._wait_for_saves()
        if self.total not in self.ckpt.steps():
            self._save(force=True)
            self._wait_for_saves()
        records = self.log.records() if self.log.writer else []
        last = {r["step"]: r for r in records if "event" not in r and "step" in r}
        final_loss = last.get(self.total - 1, {}).get("loss")
        if final_loss is None and math.isfinite(self.last_loss):
            final_loss = self.last_loss
        summary = {
            "final_step": int(host_scalar(self.state.step)),
            "final_loss": final_loss,
            "param_checksum": ckpt_lib.param_checksum(self.state.params),
            "checkpoint_interval_steps": int(self.interval.steps),
            "checkpoint_interval_source": self.interval.source,
            "checkpoint_interval_figures": self.interval.figures,
            "rollbacks": sum(1 for r in records if r.get("event") in ("rollback", "relaunch")),
            "attempts": 1 + max((r.get("attempt", 0) for r in records), default=0),
            "lost_processes": self.lost_processes,
            "live_groups": int(self.failures.alive.sum()),
            "live_group_ids": np.flatnonzero(self.failures.alive).tolist(),
            "goodput": runlog.goodput(records, self.step.microbatches),
            "input_rows": self.input_rows,
            "input_rows_per_step": max((r.get("input_rows", 0) for r in last.values()), default=0),
        }
        self.log.write_summary(summary)
        return summary

    def params(self) -> Any:
        """The current parameters as host NumPy arrays (this process's full replica).

        With groups spanning processes no process holds one: the live processes
        gather it (every one of them calls this at the end of `fit`).
        """
        if self.spanning:
            return multihost_utils.process_allgather(self.state.params, tiled=True)
        return jax.tree.map(multihost.host_copy, self.state.params)

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            self.log.close()

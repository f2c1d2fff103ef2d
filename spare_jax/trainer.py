"""The owner of one fault-tolerant run: `Trainer`, the loop `spare_jax.fit` drives.

One object holds everything a failure touches: the live set
(`liveness.Failures`), the step in force (it alone swaps it when a process
is lost), the writer role, the checkpoint interval (`checkpoint.Interval`,
which is Orbax's save decision), the checkpoints, rollback, resume and the run
log. Its parts by concern, each in its own module: the loop and the step
(here), saves, restores and rollback (`spare_jax.saving`), a process loss
(`spare_jax.recovery`), re-join (`spare_jax.admission`) and slow groups
(`spare_jax.balancing`). A failure travels
one way:

* **simulated** (a schedule or a rate): `Failures.advance` changes the live
  mask before a step; `SpareStep.table` turns it into the step's slot table;
  the step runs, exact. When a shard has no live holder `reorder.Interruption`
  comes back instead, and the trainer rolls back to the latest complete
  checkpoint with every failed group replaced.
* **a real process loss** (multi-process jobs): each step runs inside
  ``multihost_utils.live_devices``; a dead process surfaces there as
  ``ProcessFailureError`` on every survivor at once. `Trainer._lose` marks
  its groups failed, builds the survivors' mesh and step (split by failure
  domain: only the small cross-group program compiles), re-wraps the state
  from the survivors' own buffers, hands the writer role on if the writer
  died, and the same step is retried. An interruption after a loss raises
  `errors.Relaunch`: the launcher starts a fresh job, which resumes from the
  latest checkpoint (the rollback).

Every step is exact and ``batches(t)`` is a pure function of ``t``, so the
parameters at the end equal those of a run that never failed.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.experimental.multihost_utils import ProcessFailureError, live_devices

from spare_jax import checkpoint as ckpt_lib
from spare_jax import (
    compile_cache,
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
from spare_jax.admission import Admission
from spare_jax.balancing import Balancing, SpeedTracker
from spare_jax.recovery import ProcessLoss
from spare_jax.saving import Saving

__all__ = ["Trainer", "host_scalar"]


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


class Trainer(Saving, ProcessLoss, Admission, Balancing):
    """One attempt at a run: its state, its books, and the handling of each kind of failure.

    Args:
        step: the SPARe step (`spare_jax.make_train_step`) over the whole job's mesh.
        params: the initial parameters, or a function that builds them (`SpareStep.init`).
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
        sharded_checkpoints: multi-process: every live process writes its part of
            each checkpoint (groups spanning processes always do); False, with whole
            groups per process: one writer saves its whole replica.
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
        balance: bool = False,
        sharded_checkpoints: bool = True,
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
        self.spanning = self.multi and bool((self.owners != self.owners[:, :1]).any())
        # Every live process writes its part of each checkpoint at agreed steps (Orbax);
        # one writer's replica only on request, and never with groups spanning processes.
        self.shared_saves = self.spanning or (self.multi and sharded_checkpoints)
        if self.spanning and not sharded_checkpoints and jax.process_index() == 0:
            runlog.notice(
                "sharded_checkpoints=False is not taken: groups spanning processes leave no "
                "process a whole replica to write, so every live process writes its part"
            )
        # Shared saves' votes (the next save is due; the last one ended everywhere); restores.
        self._agreed_save, self._agreed_end, self._restores = False, False, 0
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
        self.global_abstract = step.abstract_state(params)
        self.ckpt = self._checkpointer(workdir, keep, writer)
        self.attempt = self.log.next_attempt
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
        # The slot bounds each step has run once (compiled). Keyed by the step object, not
        # its id(): a step rebuilt after a re-join can get a freed step's id, and a
        # process that took it for warm would skip the meeting its peers wait in.
        self._warm: weakref.WeakKeyDictionary[step_lib.SpareStep, set[int]] = (
            weakref.WeakKeyDictionary()
        )
        self.joining: dict[str, Any] | None = None  # a re-join waiting for its first step
        self._check_input = True  # the batch contract, at a job's first step (`_check_batch`)
        self.input_rows = 0  # rows this process read from `batches`, every (re)load included
        # Input read for step t (and t + 1, prefetched), kept until step t is done: a retry
        # on the same step reads nothing again. Keyed by t: (the step it is laid out for, ...).
        self._held: dict[int, tuple[Any, Any, int]] = {}
        self._tracker = SpeedTracker(step.groups) if balance and self.multi else None
        self._speeds, self._window, self._balanced_for = None, [0.0, 0.0], self.step
        self._waited, self._prefetch_s, self._barrier_s = None, 0.0, 0.0

    # ------------------------------------------------------------------ roles

    @property
    def live_groups(self) -> list[int]:
        return [int(g) for g in self.step.rows]

    def _is_writer(self) -> bool:
        """One process writes the books: the lowest live one when the last writer died.

        A replacement that re-joins does not take the role back.
        """
        return not self.multi or jax.process_index() == self.writer_process

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

    # ------------------------------------------------------------------- step

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
            fresh = self.step.slot_bound not in self._warm.get(self.step, ())
            if not self.step.compiled():  # before the block: peers compile at their own pace,
                self._at("compile")  # busy, not stuck; the block's entry waits for all
                self.step.precompile(self.state, stacks)
            self._at("step")  # a wait from here on is a wait on the peers, never a compile
            with self._barrier_timed(live_devices(self._all)) as live:
                joiners = self._newcomers(live)
                if not joiners:
                    self._check_batch(stacks)
                    if self.fault_hook is not None:
                        self.fault_hook(self.t)
                    # Only the reduction crosses groups: a peer lost in it leaves every
                    # survivor's state as it was (it is donated to the update alone).
                    try:
                        timed = self._tracker is not None  # balancing: own compute time
                        sums = self.step.reduce(self.state, stacks, table, timed=timed)
                        if self.shared_saves:  # the next save, and the last one's end, agreed
                            vote = multihost.agree(
                                self.step.mesh, self.ckpt.due(self.t + 1), self.ckpt.writing()
                            )
                        if fresh:  # the update runs first next, at its own pace:
                            self._warm.setdefault(self.step, set()).add(self.step.slot_bound)
                            self._resync = True
                        self._prefetch(self.t + 1)
                        jax.block_until_ready(sums)
                        self._balance(fresh)
                        if self.shared_saves:
                            due, writing = np.asarray(vote.addressable_shards[0].data).tolist()
                            self._agreed_save = bool(due)
                            self._agreed_end = self.ckpt.in_flight() and not writing
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
        self._busy(t2 - t1)
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
            "cache_hits": compile_cache.counts()["cache_hits"],
            "exact": self.step.policy != "drop",
            "input_rows": rows,
        }

    def _input(self, t: int) -> tuple[Any, int]:
        """Step ``t``'s stacks for the step in force and the rows that make them up.

        Read from ``batches`` only when no input laid out for this step is held
        (a retry on the same step, or a prefetch, reads nothing again).
        """
        held = self._held.get(t)
        if held is not None and held[0] is self.step:
            return held[1], held[2]
        stacks, rows = inputs.load(self.step, self.batches, t)
        self.input_rows += rows
        ahead = self._held.get(t + 1)
        self._held = {t: (self.step, stacks, rows)}
        if ahead is not None and ahead[0] is self.step:
            self._held[t + 1] = ahead
        return stacks, rows

    def _prefetch(self, t: int) -> None:
        """Read step ``t``'s input ahead (while the device runs the step before it)."""
        held, self._prefetch_s = self._held.get(t), 0.0
        if t < self.total and (held is None or held[0] is not self.step):
            start = time.perf_counter()
            stacks, rows = inputs.load(self.step, self.batches, t)
            self._prefetch_s = time.perf_counter() - start
            self.input_rows += rows
            self._held[t] = (self.step, stacks, rows)

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
                table, load = self._table()
            except reorder.Interruption as err:
                self.rollback(err)
                continue
            started, failed = time.time(), ""
            try:
                record = self._execute(table, load)
            except ProcessFailureError as err:
                self._lose(err, started)
                retry = True
                continue
            except jax.errors.JaxRuntimeError as err:  # every process alive
                if not self.multi:
                    raise
                failed = str(err).splitlines()[0][:160] or type(err).__name__
            if failed:  # out of the handler, whose traceback holds the failed step's arrays
                self._collective_failed(failed)
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
            self._held.pop(self.t, None)
            self.t += 1
            now = time.time()
            if now - self._last_emit >= 1.0:  # progress, for a launcher's hang watch
                self._last_emit = now
                runlog.emit("progress", step=self.t)
            if self._preempted() and self.t < self.total:
                self._stop_for_preemption()
            self._save()

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
            state = self.step.global_state(self.state)
            return multihost_utils.process_allgather(state.params, tiled=True)
        return jax.tree.map(multihost.host_copy, self.state.params)

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            self.log.close()

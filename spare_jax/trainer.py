"""The training loop through failures, rollbacks, re-joins and real process losses.

A failure travels one way. `liveness.Failures` changes the live mask before a
step; `SpareStep.table` turns the mask into the step's slot table (through
`reorder`, cached per live set); the step runs. When the failures leave a
shard with no live holder, `reorder.Interruption` comes back instead of a
table and the loop rolls back: it restores the latest complete checkpoint
(step 0 if there is none), replaces every failed group and carries on. Every
step is exact and the data is a pure function of the step, so the parameters
at the end equal those of a run that never failed.

With real processes (`spare_jax.multihost`), a dead process surfaces as
`multihost.ProcessLost` from the step: its groups are marked failed, the
survivors' new step and state replace the old ones, and the same step is
retried. A dead process cannot re-join this job, so an interruption after one
ends the job with `Relaunch`; its launcher starts a fresh job, which resumes
from the latest checkpoint (the rollback).

The loop keeps the run's books: `checkpoint.Checkpointer` saves at the
interval `checkpoint.IntervalModel` derives from measured figures;
`runlog.RunLog` appends every step and event to ``metrics.jsonl`` and writes
``summary.json``. Rerunning in the same work directory resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from spare_jax import checkpoint as ckpt_lib
from spare_jax import liveness, multihost, reorder, runlog, strategies
from spare_jax.experiment import Run

__all__ = ["NonFiniteLoss", "Relaunch", "TooManyRollbacks", "host_scalar", "train"]

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """The loss or gradient became NaN or infinite (the state was kept as before that step)."""


class TooManyRollbacks(RuntimeError):
    """The run rolled back more often than ``checkpoint.max_rollbacks`` allows."""


class Relaunch(RuntimeError):
    """An interruption after a real process loss: only a fresh job can roll back."""


def host_scalar(x: jax.Array) -> Any:
    """A replicated scalar's value, read from this process's first shard."""
    return np.asarray(x.addressable_shards[0].data).item()


@dataclasses.dataclass
class _Interval:
    """The checkpoint interval in force, where it came from, and the measurements behind it."""

    model: ckpt_lib.IntervalModel
    pinned: int
    steps: int = 0
    source: str = "model"
    figures: dict[str, float] = dataclasses.field(default_factory=dict)
    stalls: list[float] = dataclasses.field(default_factory=list)
    saves: list[float] = dataclasses.field(default_factory=list)
    restore_s: float | None = None

    def __post_init__(self) -> None:
        if self.pinned:
            self.steps, self.source = self.pinned, "flag"

    def update(self, step_times: list[float]) -> bool:
        """Re-derive the interval from the medians measured so far; True when it changed."""
        if self.pinned or not step_times or not self.stalls:
            return False
        # The first save also pays Orbax's one-time start-up: leave it out once
        # there are others.
        stalls = self.stalls[1:] or self.stalls
        saves = self.saves[1:] or self.saves
        stall = statistics.median(stalls)
        save = statistics.median(saves) if saves else stall
        restore = self.restore_s if self.restore_s is not None else save
        step = statistics.median(step_times)
        steps, self.figures = self.model.interval(step, stall, save, restore)
        changed = steps != self.steps
        self.steps = steps
        return changed

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "source": self.source, "figures": self.figures}


def interval_model(run: Run, failures: liveness.Failures) -> ckpt_lib.IntervalModel:
    """The analytical model of this run's checkpoint interval."""
    config = run.config
    return ckpt_lib.IntervalModel(
        strategy=strategies.canonical(config.strategy),
        redundancy=run.step.placement.redundancy,
        microbatches=run.step.microbatches,
        policy=config.policy,
        groups=run.groups,
        devices_per_group=int(run.step.mesh.shape["model"]),
        steps=int(config.steps),
        failure_rate=failures.total_rate,
        gpu_mtbf_hours=float(config.checkpoint.gpu_mtbf_hours),
        repair_steps=failures.repair_steps,
    )


class _Loop:
    """One attempt at the run: its state, books, and the handling of each kind of failure."""

    def __init__(self, run, failures, workdir, checkpoint_steps, on_step, executor):
        config = run.config
        self.run, self.failures, self.on_step, self.executor = run, failures, on_step, executor
        self.workdir = workdir
        self.total = int(config.steps)
        self.warmup = int(config.checkpoint.warmup_steps)
        self.max_rollbacks = int(config.checkpoint.max_rollbacks)
        self.interval = _Interval(interval_model(run, failures), checkpoint_steps)
        calibrate = set() if checkpoint_steps else {min(self.warmup + 1, self.total)}
        self.policy = ckpt_lib.IntervalPolicy(
            interval=self.interval.steps or self.total, extra=frozenset(calibrate | {self.total})
        )
        self.multi = executor is not None and jax.process_count() > 1
        writer = self._is_writer()
        self.records = runlog.RunLog(workdir, writer=writer)
        self.ckpt = ckpt_lib.Checkpointer(
            os.path.join(workdir, "checkpoints"),
            self.policy,
            keep=int(config.checkpoint.keep),
            writer=writer,
            process_local=self.multi,
        )
        self.attempt = self.records.next_attempt
        self.global_abstract = run.step.abstract_state(run.params)
        self.step_times: list[float] = []
        self.rollbacks = 0
        self.state: Any = None
        self.t = 0
        self.last_loss = math.nan
        self.recovering: dict[str, Any] | None = None

    # ---------------------------------------------------------------- roles

    def _is_writer(self) -> bool:
        """One process writes the books: the lowest process that still holds a live group."""
        if jax.process_count() == 1:
            return True
        owners = multihost.groups_of_processes(self.run.step.mesh)
        return jax.process_index() == int(owners.min())

    def _restore(self) -> ckpt_lib.Restored | None:
        target = multihost.local_abstract(self.global_abstract)
        restored = self.ckpt.restore_latest(target)
        if restored is None or not self.multi:
            return restored
        shardings = jax.tree.map(lambda a: a.sharding, self.global_abstract)
        state = multihost.from_local(restored.state, shardings)
        return dataclasses.replace(restored, state=state)

    def _save(self, step: int, *, force: bool = False) -> float | None:
        state = multihost.local_view(self.state) if self.multi else self.state
        meta = {
            "step": step,
            "attempt": self.attempt,
            "liveness": self.failures.state_dict(),
            "interval": self.interval.as_dict(),
        }
        return self.ckpt.save(step, state, meta, force=force)

    # ---------------------------------------------------------------- phases

    def start(self) -> None:
        """Resume from the latest good checkpoint, or start fresh at step 0."""
        restored = self._restore()
        if restored is None:
            self.state, self.t = self.run.fresh_state(), 0
        else:
            self.state, self.t = restored.state, restored.step
            self.failures.load_state_dict(restored.meta["liveness"])
            for r in self.records.previous:  # schedule entries fired after that save stay fired
                if r.get("event") == "failure":
                    self.failures.fired.update((int(r["step"]), int(g)) for g in r["scheduled"])
            saved = restored.meta.get("interval", {})
            if not self.interval.pinned and saved.get("steps"):
                self.interval.steps, self.interval.figures = saved["steps"], saved["figures"]
            self.interval.restore_s = restored.restore_s
            self.records.event(
                "resume",
                step=restored.step,
                restore_s=round(restored.restore_s, 6),
                attempt=self.attempt,
            )
            log.info("resumed from checkpoint %d (attempt %d)", restored.step, self.attempt)
        self.policy.interval = self.interval.steps or self.total

    def rollback(self, err: reorder.Interruption) -> None:
        """Restore the latest complete checkpoint (or a fresh state), replace the failed groups."""
        if self.multi and len(self.run.step.rows) < self.run.groups:
            self.ckpt.wait()
            raise Relaunch(
                f"interrupted at step {self.t} after a process loss: shard(s) "
                f"{np.asarray(err.uncovered).tolist()} have no live holder; relaunch to roll back"
            )
        self.rollbacks += 1
        if self.rollbacks > self.max_rollbacks:
            raise TooManyRollbacks(
                f"rolled back {self.rollbacks - 1} times (checkpoint.max_rollbacks); "
                "the failure rate leaves no time between interruptions"
            )
        self.attempt += 1
        start = time.perf_counter()
        self.state = None  # the interrupted state goes; its buffers with it
        restored = self._restore()
        self.state, to = (
            (self.run.fresh_state(), 0) if restored is None else (restored.state, restored.step)
        )
        restore_s = time.perf_counter() - start
        self.interval.restore_s = restore_s
        dead = np.flatnonzero(~self.failures.alive).tolist()
        self.failures.replace_all()
        self.records.event(
            "rollback",
            from_step=self.t,
            to_step=to,
            lost_steps=self.t - to,
            restore_s=round(restore_s, 6),
            uncovered=np.asarray(err.uncovered).tolist(),
            dead=dead,
            attempt=self.attempt,
        )
        log.warning(
            "interrupted at step %d: shard(s) %s have no live holder (dead groups %s); "
            "rolled back to step %d with every failed group replaced",
            self.t,
            np.asarray(err.uncovered).tolist(),
            dead,
            to,
        )
        self.t = to

    def process_lost(self, lost: multihost.ProcessLost, started: float) -> None:
        """Survivors take over: the new step and state, the dead groups marked failed."""
        self.run.step, self.state = lost.step, lost.state
        self.failures.fail(lost.groups, self.t)
        killed = [multihost.kill_time(self.workdir, p) for p in lost.processes]
        origin = max([started, *[k for k in killed if k is not None]])
        if self._is_writer():
            self.records.become_writer()
            self.ckpt.become_writer()
        self.records.event(
            "process_failure",
            process=lost.processes,
            groups=lost.groups,
            step=self.t,
            detect_s=round(lost.detected - origin, 6),
            rebuild_s=round(lost.rebuild_s, 6),
            compile_s=round(lost.compile_s, 6),
        )
        self.recovering = {"origin": origin, "detected": lost.detected, "resumed": time.time()}
        log.warning("process(es) %s died during step %d; %s", lost.processes, self.t, lost)

    def execute(self, table: Any, load: int) -> dict[str, Any]:
        """Run step ``t`` and return its record (raises `multihost.ProcessLost`)."""
        t0 = time.perf_counter()
        stacks = self.run.step.stacks(self.run.batch(self.t))
        t1 = time.perf_counter()
        if self.executor is not None:
            self.executor.index = self.t
            self.state, metrics = self.executor(self.state, stacks, table)
        else:
            self.state, metrics = self.run.step.run(self.state, stacks, table)
        metrics = {k: host_scalar(v) for k, v in metrics.items()}
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
            "overhead": load / self.run.step.microbatches,
            "grad_norm": float(metrics["grad_norm"]),
            "compiles": self.run.step.compiles,
            "exact": self.run.step.policy != "drop",
        }

    def checkpoint(self) -> None:
        """Note finished saves, let Orbax's policy decide on this one, re-derive the interval."""
        self._note_saves()
        stall = self._save(self.t)
        if stall is not None:
            self.interval.stalls.append(stall)
            self.records.event("checkpoint", step=self.t, save_s=round(stall, 6))
        if self.t == self.warmup + 1 and self.interval.update(self.step_times):
            self._log_interval()

    def _note_saves(self) -> None:
        done = self.ckpt.poll()
        if done is not None:
            self.interval.saves.append(done[1])
            if self.interval.update(self.step_times):
                self._log_interval()

    def _log_interval(self) -> None:
        self.policy.interval = self.interval.steps
        f = self.interval.figures
        log.info(
            "checkpoint interval %d steps: the model's optimum %.3f s for step %.4f s, save "
            "stall %.4f s, save %.4f s, restore %.4f s, group MTBF %.2f s (MTTI %.2f s)",
            self.interval.steps,
            f["interval_s"],
            f["step_s"],
            f["save_stall_s"],
            f["save_s"],
            f["restore_s"],
            f["group_mtbf_s"],
            f["mtti_s"],
        )

    def loop(self) -> None:
        retry = False
        while self.t < self.total:
            if not retry:
                change = self.failures.advance(self.t)
                if change.rejoined:
                    self.records.event("rejoin", step=self.t, groups=list(change.rejoined))
                if change.failed:
                    self.records.event(
                        "failure",
                        step=self.t,
                        groups=list(change.failed),
                        scheduled=list(change.scheduled),
                    )
            retry = False
            try:
                table, load = self.run.step.table(self.failures.alive.copy())
            except reorder.Interruption as err:
                self.rollback(err)
                continue
            started = time.time()
            try:
                record = self.execute(table, load)
            except multihost.ProcessLost as lost:
                self.process_lost(lost, started)
                retry = True
                continue
            if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
                self.non_finite(record)
            self.records.write(record)
            if self.recovering is not None:
                now = time.time()
                self.records.event(
                    "recovered",
                    step=self.t,
                    live_groups=int(self.failures.alive.sum()),
                    recovery_s=round(now - self.recovering["origin"], 6),
                    since_detection_s=round(now - self.recovering["detected"], 6),
                    first_step_s=round(now - self.recovering["resumed"], 6),
                    rolled_back=False,
                )
                self.recovering = None
            if self.on_step:
                self.on_step(record)
            self.t += 1
            self.checkpoint()

    def non_finite(self, record: dict[str, Any]) -> None:
        """Save the last good state (the step kept it) and stop."""
        record["loss"] = record["grad_norm"] = None
        self.records.write(record)
        self._save(self.t, force=True)
        self.ckpt.wait()
        raise NonFiniteLoss(
            f"the loss became non-finite at step {self.t}; the state before it is saved as "
            f"checkpoint {self.t} in {self.ckpt.directory}"
        )

    def finish(self) -> dict[str, Any]:
        """Wait for saves, make sure the last step is saved, write the summary."""
        self.ckpt.wait()
        self._note_saves()
        if self.total not in self.ckpt.steps():
            self._save(self.total, force=True)
            self.ckpt.wait()
        records = self.records.records() if self.records.writer else []
        last = {r["step"]: r for r in records if "event" not in r and "step" in r}
        final_loss = last.get(self.total - 1, {}).get("loss")
        if final_loss is None and math.isfinite(self.last_loss):
            final_loss = self.last_loss
        summary = {
            "final_step": int(host_scalar(self.state.step)),
            "final_loss": final_loss,
            "param_checksum": ckpt_lib.param_checksum(self.state.params),
            "checkpoint_interval_steps": int(self.interval.steps or self.policy.interval),
            "checkpoint_interval_source": self.interval.source,
            "checkpoint_interval_figures": self.interval.figures,
            "rollbacks": sum(1 for r in records if r.get("event") in ("rollback", "relaunch")),
            "attempts": 1 + max((r.get("attempt", 0) for r in records), default=0),
            "goodput": runlog.goodput(records, self.run.step.microbatches),
        }
        self.records.write_summary(summary)
        return summary

    def close(self) -> None:
        self.ckpt.close()
        self.records.close()


def train(
    run: Run,
    failures: liveness.Failures,
    workdir: str,
    *,
    checkpoint_steps: int = 0,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    executor: multihost.Executor | None = None,
) -> dict[str, Any]:
    """Train ``config.steps`` steps through ``failures``; resume if ``workdir`` holds the run.

    Args:
        run: the built run (`spare_jax.experiment.setup`).
        failures: the failure process (its state is restored on resume).
        workdir: output directory: ``metrics.jsonl``, ``summary.json``, ``checkpoints/``.
        checkpoint_steps: 0 for the analytical model's interval, N > 0 to pin it.
        on_step: called with each per-step record (progress display).
        executor: runs each step under ``live_devices`` (multi-process jobs).

    Returns:
        The summary written to ``summary.json``.

    Raises:
        NonFiniteLoss: the loss became non-finite (the last good state is saved first).
        TooManyRollbacks: more rollbacks than ``checkpoint.max_rollbacks``.
        Relaunch: an interruption after a real process loss (multi-process only).
        checkpoint.NoUsableCheckpoint: checkpoints exist and none restores.
    """
    loop = _Loop(run, failures, workdir, checkpoint_steps, on_step, executor)
    try:
        loop.start()
        loop.loop()
        return loop.finish()
    finally:
        loop.close()

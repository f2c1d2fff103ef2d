"""Orbax checkpoints at the interval our analytical model chooses, and a restore that skips junk.

Owns two things:

* `IntervalModel`: the checkpoint interval in steps. It is not a hand-set
  number: the run is described as a `spare_jax.scenario.Scenario` (its groups,
  strategy, redundancy and micro-batches; the **measured** step time, save
  stall, save duration and restore time; the configured failure rate) and
  `spare_jax.analysis.time_to_train` gives the interval that minimises the
  expected time-to-train, converted to steps. It is re-derived whenever the
  measurements move (after warm-up, after each save).
* `Checkpointer`: an Orbax ``CheckpointManager`` with asynchronous saves of the
  train state plus a JSON record of everything else needed to continue exactly
  (the live set, the failure process's progress, the re-join clock, a
  parameter checksum). Orbax decides when to save through our
  `IntervalPolicy` (its ``save_decision_policy`` hook) and keeps the latest
  few through its ``LatestN`` preservation policy. `restore_latest` walks the
  steps from the newest, moves a checkpoint that fails to restore (a killed
  save, a truncated file, a foreign directory, a checksum mismatch) aside
  into ``corrupt/`` with a warning naming it, and returns the newest good one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from spare_jax import analysis, checks, strategies
from spare_jax.scenario import Scenario

__all__ = [
    "Checkpointer",
    "IntervalModel",
    "IntervalPolicy",
    "NoUsableCheckpoint",
    "Restored",
    "param_checksum",
]

log = logging.getLogger(__name__)


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist but none of them restores."""


@jax.jit
def _leaf_sums(params: Any) -> jax.Array:
    return jnp.stack([jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(params)])


def param_checksum(params: Any) -> float:
    """Sum of squares of every parameter, added up in float64 (a fingerprint of the model).

    Each leaf's sum is computed on device in float32 (one compiled program) and
    the per-leaf sums are added on the host in float64.
    """
    sums = _leaf_sums(params)
    return float(np.asarray(sums.addressable_shards[0].data, np.float64).sum())


@dataclasses.dataclass(frozen=True)
class IntervalModel:
    """The run as a scenario of the analytical model, and the interval it implies.

    Attributes:
        strategy: data-plane strategy (``spare``, ``replication`` or ``dp``).
        redundancy: r.
        microbatches: m.
        policy: ``adaptive`` or ``fixed`` (``drop`` is modelled as adaptive).
        groups: G.
        devices_per_group: devices (GPUs) per group.
        steps: the run's length in steps (the interval never exceeds it).
        failure_rate: failures per group per step; 0 uses ``gpu_mtbf_hours``.
        gpu_mtbf_hours: per-device MTBF when no rate is configured.
        repair_steps: hot re-join after this many steps (0: at rollbacks only).
    """

    strategy: str
    redundancy: int
    microbatches: int
    policy: str
    groups: int
    devices_per_group: int
    steps: int
    failure_rate: float
    gpu_mtbf_hours: float
    repair_steps: int = 0

    def scenario(self, step_s: float, stall_s: float, save_s: float, restore_s: float) -> Scenario:
        """The run as a `Scenario`, from measured seconds per step, save stall, save and restore."""
        step_s = checks.number("step_s", step_s, low=0.0, low_open=True)
        if self.failure_rate > 0:
            gpu_mtbf_h = step_s / self.failure_rate * self.devices_per_group / 3600.0
        else:
            gpu_mtbf_h = self.gpu_mtbf_hours
        return Scenario(
            gpus=self.groups * self.devices_per_group,
            gpus_per_group=self.devices_per_group,
            gpu_mtbf_hours=gpu_mtbf_h,
            work_hours=self.steps * step_s / 3600.0,
            checkpoint_s=max(save_s, stall_s),
            checkpoint_async=True,
            checkpoint_async_stall_s=stall_s,
            restart_s_ref=restore_s,
            restart_ref_gpus=self.groups * self.devices_per_group,
            restart_exponent=0.0,
            repair="hot" if self.repair_steps else "restart",
            mttr_hours=max(self.repair_steps, 1) * step_s / 3600.0,
        ).validate()

    def interval(
        self, step_s: float, stall_s: float, save_s: float, restore_s: float
    ) -> tuple[int, dict[str, float]]:
        """The optimal interval in steps, and the figures it came from."""
        scenario = self.scenario(step_s, stall_s, save_s, restore_s)
        policy = "adaptive" if self.policy == "drop" else self.policy
        kind = strategies.canonical(self.strategy)
        estimate = analysis.time_to_train(
            scenario,
            kind,
            redundancy=self.redundancy if kind != "dp" else 1,
            microbatches=self.microbatches,
            policy=policy,
        )
        tau = estimate.checkpoint_interval_s
        if not math.isfinite(estimate.time_to_train_s):
            # No interval finishes the run in the model (saves outlast the mean time
            # to interruption): the renewal optimum of the save cost alone is the
            # best the model can say.
            tau = analysis.exact_optimum(stall_s, estimate.mean_time_to_interruption_s)
        steps = self.steps if not math.isfinite(tau) else round(tau / step_s)
        figures = {
            "step_s": step_s,
            "save_stall_s": stall_s,
            "save_s": save_s,
            "restore_s": restore_s,
            "group_mtbf_s": scenario.group_mtbf_s,
            "mtti_s": estimate.mean_time_to_interruption_s,
            "interval_s": tau,
        }
        return min(max(steps, 1), self.steps), figures


@dataclasses.dataclass
class IntervalPolicy:
    """Orbax save decision: save once ``interval`` steps have passed since the last save.

    ``interval`` is mutable: the trainer re-derives it from `IntervalModel` as
    the measurements move. ``extra`` names steps that are always saved (the
    calibration save after warm-up, the last step).
    """

    interval: int
    extra: frozenset[int] = frozenset()

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        del context
        if step.step in self.extra:
            return True
        last = previous_steps[-1].step if previous_steps else 0
        return step.step - last >= self.interval


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
        policy: IntervalPolicy,
        *,
        keep: int = 3,
        use_async: bool = True,
        writer: bool = True,
        process_local: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        self.policy = policy
        self.keep = checks.integer("keep", keep, low=1)
        self.use_async = use_async
        self.process_local = process_local
        self._pending: tuple[int, float] | None = None
        self.last_save_s: float | None = None
        self._manager = self._open(writer)

    def _open(self, writer: bool) -> ocp.CheckpointManager:
        """The Orbax manager; read-only for a process that does not write.

        ``process_local``: this process saves and restores its own replica and
        never waits on a barrier with the others (one of them may be dead).
        """
        me = jax.process_index()
        multiprocessing = (
            ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
            if self.process_local
            else ocp.options.MultiprocessingOptions()
        )
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=self.policy,
            preservation_policy=checkpoint_managers.LatestN(self.keep),
            enable_async_checkpointing=self.use_async,
            cleanup_tmp_directories=writer,
            read_only=not writer,
            multiprocessing_options=multiprocessing,
            create=not self.process_local,  # Orbax leaves the directory to us then
        )
        if self.process_local and writer:
            os.makedirs(self.directory, exist_ok=True)
        self.writer = writer
        return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def become_writer(self) -> None:
        """Take over saving (the previous writer's process died)."""
        if not self.writer:
            self._manager.close()
            self._manager = self._open(True)

    def steps(self) -> list[int]:
        """Steps on disk, oldest first."""
        return list(self._manager.all_steps())

    def save(
        self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False
    ) -> float | None:
        """Save if the policy says so (or ``force``); return the blocking stall (s) or None."""
        if not self.writer:
            return None
        start = time.perf_counter()
        if force and step in self._manager.all_steps():
            return None
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({**meta, "param_checksum": param_checksum(state.params)}),
            ),
            force=force,
        )
        if not saved:
            return None
        stall = time.perf_counter() - start
        self._pending = (step, start)
        return stall

    def poll(self) -> tuple[int, float] | None:
        """``(step, seconds)`` of the last save once it has completed (reported once), else None."""
        if self._pending is None or self._manager.is_saving_in_progress():
            return None
        step, start = self._pending
        self._pending = None
        self.last_save_s = time.perf_counter() - start
        return step, self.last_save_s

    def wait(self) -> None:
        """Block until every save in flight has completed."""
        self._manager.wait_until_finished()

    def _quarantine(self, step: int, error: BaseException) -> None:
        if not self.writer:  # only the writer moves files; the others just skip it
            log.warning("skipping checkpoint %d: %s", step, type(error).__name__)
            return
        source = os.path.join(self.directory, str(step))
        target = os.path.join(self.directory, "corrupt", f"{step}-{int(time.time())}")
        reason = " ".join(str(error).split())[:200]
        log.warning(
            "skipping checkpoint %s: %s: %s (moved to %s)",
            source,
            type(error).__name__,
            reason,
            target,
        )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that restores and checks out; None when there is none at all.

        Raises:
            NoUsableCheckpoint: checkpoints exist but every one of them failed.
        """
        self.wait()
        self._manager.reload()
        tried = 0
        for step in sorted(self._manager.all_steps(), reverse=True):
            tried += 1
            start = time.perf_counter()
            try:
                out = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                meta = dict(out["meta"])
                got, want = param_checksum(out["state"].params), meta["param_checksum"]
                if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
                    raise ValueError(f"parameter checksum {got!r} differs from the saved {want!r}")
            except Exception as error:  # noqa: BLE001 - any failure means: not this one
                self._quarantine(step, error)
                continue
            self._manager.reload()
            return Restored(step, out["state"], meta, time.perf_counter() - start)
        self._manager.reload()
        if tried:
            raise NoUsableCheckpoint(
                f"none of the {tried} checkpoint(s) in {self.directory} restores "
                f"(moved to {os.path.join(self.directory, 'corrupt')})"
            )
        return None

    def close(self) -> None:
        self._manager.close()

"""The checkpoint interval: how many steps between saves, from the analytical model.

* `IntervalModel`: the run described as a `spare_jax.scenario.Scenario` (its
  groups, strategy, redundancy and micro-batches; the **measured** step time,
  save stall, save duration and restore time; the configured failure rate),
  and the interval that `spare_jax.analysis.time_to_train` finds best for it,
  in steps. It is re-derived whenever the measurements move (after warm-up,
  after each save).
* `Interval`: the interval in force, the one copy of it. It is Orbax's save
  decision (`spare_jax.checkpoint.Checkpointer` hands it to the manager),
  fed with the measurements and carried through each checkpoint. It caps
  the model's optimum with a ceiling (`Interval.ceiling`): the model covers
  hardware failures only, and a preemption without notice, a killed launcher
  or a Ctrl-C loses the work since the last save too.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from spare_jax import checks, strategies
from spare_jax.scenario import Scenario

__all__ = ["RUN_FRACTION", "STALL_SHARE", "UNMODELLED_MTBI_S", "Interval", "IntervalModel"]

# The interval's ceiling (`Interval.ceiling`; sources in docs/checkpointing.md).
# Mean time between the interruptions the failure model leaves out: Llama 3's
# pre-training had 47 planned interruptions (maintenance, operators) in 54 days.
UNMODELLED_MTBI_S = 54 * 24 * 3600 / 47
RUN_FRACTION = 0.1  # at most a tenth of the run's work between saves
STALL_SHARE = 0.05  # the ceiling never makes save stalls more than 5% of the time


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
        # Here, not at the top: the model (and SciPy under it) is needed only once a
        # run has measured its steps, never on a worker's way to its first step.
        from spare_jax import analysis

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
class Interval:
    """The checkpoint interval in force: Orbax's save decision, its source and its figures.

    The one copy of the interval. Orbax asks `should_save` (this object is the
    manager's ``save_decision_policy``); the run feeds it measurements
    (`stalls`, `saves`, `restore_s`) and calls `update`, which re-derives the
    interval from `IntervalModel`; `as_dict`/`load` carry it through a
    checkpoint, so a resumed run starts from the interval it had.

    Attributes:
        total: the run's length in steps (always saved; the interval never exceeds it).
        model: the analytical model (None: the interval stays ``pinned``).
        pinned: a fixed interval in steps (0: the model decides).
        extra: steps that are always saved (the calibration save after warm-up).
        steps: the interval in force.
        source: ``"model"`` (the model's optimum), ``"ceiling"`` (the ceiling was
            lower; ``figures["ceiling_by"]`` names its bound) or ``"pinned"``.
        figures: the measurements and results the interval came from.
    """

    total: int
    model: IntervalModel | None = None
    pinned: int = 0
    extra: frozenset[int] = frozenset()
    steps: int = 0
    source: str = "model"
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    stalls: list[float] = dataclasses.field(default_factory=list)
    saves: list[float] = dataclasses.field(default_factory=list)
    restore_s: float | None = None

    def __post_init__(self) -> None:
        checks.integer("total", self.total, low=1)
        checks.integer("pinned", self.pinned, low=0)
        if self.pinned or self.model is None:
            self.steps, self.source = self.pinned or self.total, "pinned"
        elif not self.steps:
            self.steps = self.total  # until the first measurements

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        """Orbax's question: save ``step``? (every ``steps`` since the last save, and ``extra``)."""
        del context
        if step.step in self.extra or step.step == self.total:
            return True
        last = previous_steps[-1].step if previous_steps else 0
        return step.step - last >= self.steps

    def update(self, step_times: Sequence[float]) -> bool:
        """Re-derive the interval from the medians measured so far; True when it changed."""
        if self.pinned or self.model is None or not step_times or not self.stalls:
            return False
        # The first save also pays Orbax's one-time start-up: leave it out once
        # there are others.
        stalls = self.stalls[1:] or self.stalls
        saves = self.saves[1:] or self.saves
        stall = statistics.median(stalls)
        save = statistics.median(saves) if saves else stall
        restore = self.restore_s if self.restore_s is not None else save
        step_s = statistics.median(step_times)
        optimum, figures = self.model.interval(step_s, stall, save, restore)
        longest = max(saves) if saves else save  # the ceiling allows for the slowest save
        ceiling, ceiling_s, by = self.ceiling(
            step_s, stall, longest, calibrated=len(self.stalls) > 1
        )
        steps = min(optimum, ceiling)
        self.source = "model" if optimum <= ceiling else "ceiling"
        self.figures = {
            **figures,
            "model_steps": optimum,
            "ceiling_steps": ceiling,
            "ceiling_s": ceiling_s,
            "ceiling_by": by,
        }
        changed = steps != self.steps
        self.steps = steps
        return changed

    def ceiling(
        self, step_s: float, stall_s: float, save_s: float, *, calibrated: bool = True
    ) -> tuple[int, float, str]:
        """The most steps between saves, the work at risk it allows (s), and the bound that set it.

        The work at risk (from the newest complete save to a kill) is the least
        of ``"unmodelled"`` (Young's interval ``sqrt(2 * stall *
        UNMODELLED_MTBI_S)`` for the interruptions the model leaves out) and
        ``"run_fraction"`` (``RUN_FRACTION`` of the run's work), never below
        ``"save_cost"`` (an interval of ``stall / STALL_SHARE``, and of one
        save's duration). A save is complete ``save_s`` after it starts, so the
        interval is the work at risk less one save. ``calibrated`` False (only
        the first save measured, its stall inflated by Orbax's start-up): the
        floor is one save's duration alone.
        """
        bounds = {
            "unmodelled": math.sqrt(2.0 * stall_s * UNMODELLED_MTBI_S),
            "run_fraction": RUN_FRACTION * self.total * step_s,
        }
        by = min(bounds, key=bounds.__getitem__)
        seconds = bounds[by]
        floor = save_s + max(stall_s / STALL_SHARE if calibrated else 0.0, save_s)
        if floor > seconds:
            by, seconds = "save_cost", floor
        steps = min(max(int((seconds - save_s) // step_s), 1), self.total)
        return steps, seconds, by

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "source": self.source, "figures": self.figures}

    def load(self, saved: dict[str, Any]) -> None:
        """Continue from the interval a checkpoint recorded (unless pinned)."""
        if not self.pinned and self.model is not None and saved.get("steps"):
            self.steps, self.figures = int(saved["steps"]), dict(saved.get("figures", {}))
            self.source = str(saved.get("source", self.source))

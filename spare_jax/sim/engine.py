"""The run engine: one training run, segment by segment, under `Scenario`'s rules.

A run is a sequence of *segments*, each a stretch of running that starts with
every group alive (at the start, or after a restart) and ends at the first
interruption or at the end of training. For a segment the engine

1. asks the failure process for the segment's failure events up to the first
     interruption (`failures.RandomFailures` draws every group's failure time at
     once and finds the interruption as a min over shards of a max over
     holders; `failures.TraceFailures` replays a trace);
2. walks only those events, in time order, to get the overhead after each one
     (`incremental.LoadTracker` for stacking: the exact optimal max load under a
     shrinking live set; r for replication; 1 for data parallelism); the
     tracker also confirms the interruption (the reorder core must raise
     `reorder.Interruption` on the interrupting event, and only there);
3. integrates progress over the piecewise-constant overhead and the periodic
     checkpoint pattern arithmetically (`Checkpointing`), never step by step:
     the end of training, the last completed save and the lost work are closed
     expressions of the segment's breakpoints.

With `Scenario.repair == "hot"` the live set also grows between restarts;
`hot.HotRepair` then walks failures and re-joins with a heap and returns the
same (breakpoints, overheads, interruption) triple to step 3.

Backends: `simulate` is this fast vectorised backend; `simgrid.simulate` is
the SimGrid backend (docs/validation.md). A backend needs only to satisfy
the `Backend` protocol below, i.e. to map (scenario, strategy, parameters,
seed) to a `RunResult`; `simulate_many` takes any such callable through its
`backend` argument, so a second backend can be compared with this one field
by field, as tests/test_sim_validation.py compares this one with the analysis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np
import tqdm

from spare_jax import checks, strategies
from spare_jax.scenario import Scenario
from spare_jax.sim.failures import RandomFailures, TraceFailures
from spare_jax.sim.hot import HotRepair
from spare_jax.sim.overheads import Overheads

__all__ = ["Backend", "Checkpointing", "RunResult", "simulate"]


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcome of one simulated training run.

    Attributes:
        time_to_train_s: wall time until the progress reaches the work.
        availability: uptime / wall time (uptime: wall time not spent restarting).
        effective_ratio: failure-free work / time-to-train.
        overhead_mean: computation overhead averaged over running time.
        overhead_max: largest computation overhead seen.
        interruptions: number of interruptions (= restarts).
        lost_work_s: wall seconds of running and saving whose progress was rolled
            back (from the end of the last completed save's stall to the
            interruption; restarts excluded), as `analysis.Estimate` counts it.
        lost_progress_s: progress rolled back, seconds of failure-free work.
        failures: failure events that killed at least one live group.
        checkpoints: completed checkpoint saves.
    """

    time_to_train_s: float
    availability: float
    effective_ratio: float
    overhead_mean: float
    overhead_max: float
    interruptions: int
    lost_work_s: float
    lost_progress_s: float
    failures: int
    checkpoints: int


class Backend(Protocol):
    """Anything that simulates one run (`simulate` here, `simgrid.simulate`)."""

    def __call__(
        self,
        scenario: Scenario,
        strategy: str,
        *,
        redundancy: int,
        checkpoint_interval_s: float,
        microbatches: int,
        policy: str,
        seed: int,
        **kwargs: object,
    ) -> RunResult: ...


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """The periodic save pattern of one segment, in seconds since its start.

    A save starts after every `interval_s` of computing; it stalls progress for
    `stall_s` (the whole save `save_s` when blocking) and counts once complete,
    `save_s` after it started. Save k >= 1 starts at `k * period - stall_s`,
    where `period = interval_s + stall_s`, and records the progress made by then.
    """

    interval_s: float
    stall_s: float
    save_s: float

    def __post_init__(self) -> None:
        checks.number("interval_s", self.interval_s, low=0.0, low_open=True, allow_inf=True)
        checks.number("save_s", self.save_s, low=0.0)
        checks.number("stall_s", self.stall_s, low=0.0, high=self.save_s)

    @classmethod
    def from_scenario(cls, scenario: Scenario, interval_s: float) -> Checkpointing:
        """The save pattern of `scenario` every `interval_s` seconds of computing (inf: never)."""
        checks.number("checkpoint_interval_s", interval_s, low=0.0, low_open=True, allow_inf=True)
        stall = (
            scenario.checkpoint_async_stall_s
            if scenario.checkpoint_async
            else scenario.checkpoint_s
        )
        return cls(
            float(interval_s),
            float(min(stall, scenario.checkpoint_s)),
            float(scenario.checkpoint_s),
        )

    @property
    def period(self) -> float:
        return self.interval_s + self.stall_s

    def compute_time(self, s: np.ndarray) -> np.ndarray:
        """Seconds spent computing (not stalled) in [0, s]."""
        s = np.asarray(s, dtype=float)
        if math.isinf(self.interval_s):
            return s.copy()
        with np.errstate(invalid="ignore"):
            full = np.floor(s / self.period)
            out = full * self.interval_s + np.minimum(s - full * self.period, self.interval_s)
        return np.where(np.isinf(s), np.inf, out)

    def time_of_compute(self, x: float) -> float:
        """Earliest time by which `x > 0` seconds of computing are done."""
        if math.isinf(self.interval_s):
            return x
        n = math.ceil(x / self.interval_s) - 1
        return n * self.period + (x - n * self.interval_s)

    def completed(self, s: float) -> int:
        """Saves completed by time `s`."""
        if math.isinf(self.interval_s) or math.isinf(s):
            return 0
        return max(0, math.floor((s + self.stall_s - self.save_s) / self.period))

    def save_start(self, k: int) -> float:
        """Start of save k (k >= 1); 0 for k = 0, the segment start."""
        return 0.0 if k == 0 else k * self.period - self.stall_s


@dataclasses.dataclass
class Totals:
    """Running sums of one run (wall, restart and running seconds, counts)."""

    wall_s: float = 0.0
    restart_s: float = 0.0
    running_s: float = 0.0
    overhead_integral: float = 0.0
    overhead_max: float = 1.0
    interruptions: int = 0
    lost_work_s: float = 0.0
    lost_progress_s: float = 0.0
    failures: int = 0
    checkpoints: int = 0


def play_segment(
    changes: np.ndarray,
    overheads: np.ndarray,
    t_int: float,
    failure_times: np.ndarray,
    remaining: float,
    ckpt: Checkpointing,
    totals: Totals,
    cost: float = 1.0,
) -> float:
    """Play one segment arithmetically; return the progress kept (inf if training finished).

    Args:
        changes: float [J] sorted times (since the segment start) at which the
            overhead changes, all before `t_int`.
        overheads: float [J + 1] overhead before the first change, then after each.
        t_int: time of the interruption (inf: none within the horizon).
        failure_times: sorted times of the failure events (counted up to the end).
        remaining: work left, seconds of failure-free compute.
        ckpt: the checkpoint pattern.
        totals: run totals, updated in place.
        cost: fixed step-time factor on top of the overhead (the micro-batch
            cost `1 + microbatch_overhead * (m - 1)`); progress accrues at
            `1 / (overhead * cost)`.
    """
    bounds = np.concatenate([[0.0], changes, [t_int]])
    comp = ckpt.compute_time(bounds)
    with np.errstate(invalid="ignore"):
        gain = np.diff(comp) / (overheads * cost)
    progress = np.concatenate([[0.0], np.cumsum(gain)])
    progress[np.isnan(progress)] = np.inf

    if progress[-1] >= remaining:  # training ends in this segment
        j = int(np.searchsorted(progress, remaining, side="left")) - 1
        x = comp[j] + (remaining - progress[j]) * overheads[j] * cost
        end = ckpt.time_of_compute(x)
        finished = True
    else:
        end = t_int
        finished = False

    j_end = max(0, int(np.searchsorted(bounds, end, side="left")) - 1)
    spans = np.minimum(np.diff(bounds), np.maximum(end - bounds[:-1], 0.0))
    spans = np.where(np.isfinite(spans), spans, 0.0)
    totals.overhead_integral += float(np.dot(spans[: j_end + 1], overheads[: j_end + 1]))
    totals.overhead_max = max(totals.overhead_max, float(overheads[: j_end + 1].max()))
    totals.running_s += end
    totals.wall_s += end
    totals.failures += int(np.searchsorted(failure_times, end, side="right"))
    saves = ckpt.completed(end)
    totals.checkpoints += saves
    if finished:
        return math.inf

    def progress_at(s: float) -> float:
        k = max(0, int(np.searchsorted(bounds, s, side="right")) - 1)
        return float(progress[k] + (ckpt.compute_time(s) - comp[k]) / (overheads[k] * cost))

    kept = progress_at(ckpt.save_start(saves)) if saves else 0.0
    totals.lost_progress_s += float(progress[-1]) - kept
    totals.lost_work_s += end - saves * ckpt.period if saves else end
    totals.interruptions += 1
    return kept


def _horizon(ckpt: Checkpointing, remaining: float, max_overhead: float) -> float:
    """A time by which the segment surely finishes training if uninterrupted."""
    return ckpt.time_of_compute(remaining * max_overhead) * (1 + 1e-9) + 1.0


def simulate(
    scenario: Scenario,
    strategy: str,
    *,
    redundancy: int = 1,
    checkpoint_interval_s: float,
    microbatches: int = 8,
    policy: str = "adaptive",
    seed: int = 0,
    trace: tuple[np.ndarray, np.ndarray] | None = None,
    progress: bool = False,
    layout: str | None = None,
    max_wall_factor: float = 1e3,
) -> RunResult:
    """Simulate one training run under `scenario`'s rules.

    Args:
        scenario: cluster, failure law and costs; `repair="hot"` plays hot re-join
            (`hot.HotRepair`, an event walk) instead of replace-at-restart.
        strategy: a strategy name of `spare_jax.strategies` ("dp", alias
            "checkpoint_restart", has r = 1; "replication"; "spare").
        redundancy: r.
        checkpoint_interval_s: seconds of computing between saves (inf: never).
        microbatches: m, micro-batches per shard.
        policy: "adaptive" (optimal reordering) or "fixed" (stack order), for "spare".
        seed: seed of the random generator (>= 0).
        trace: optional (time_s, group) failure events, wall-clock seconds since the
            start, replacing the scenario's failure law (and its domains).
        progress: show a progress bar over the work.
        layout: stacking layout for "spare": "cyclic" (default) or "strided".
        max_wall_factor: give up (time_to_train_s = inf) once the wall time
            exceeds this multiple of the work.

    Returns:
        The run's `RunResult`.

    Raises:
        ValueError: naming a bad argument.
    """
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    kind = strategies.canonical(strategy)
    strategies.check_policy(policy, exact=True)
    microbatches = checks.integer("microbatches", microbatches, low=1, high=2**31 - 1)
    seed = checks.integer("seed", seed, low=0)
    checks.number("max_wall_factor", max_wall_factor, low=0.0, low_open=True)
    p = strategies.placement(strategy, scenario.groups, redundancy, layout=layout)
    ckpt = Checkpointing.from_scenario(scenario, checkpoint_interval_s)
    rng = np.random.default_rng(seed)
    overheads = Overheads(p, microbatches, policy)
    restart = scenario.restart_seconds()
    if scenario.repair == "hot":
        if trace is not None:
            raise NotImplementedError("trace replay with hot re-join is not supported")
        process = HotRepair(
            p,
            scenario.group_mtbf_s,
            scenario.mttr_hours * 3600.0,
            microbatches=microbatches,
            policy=policy,
            law=scenario.failure_law,
            weibull_shape=scenario.weibull_shape,
            domain_groups=scenario.domain_groups,
            domain_failure_fraction=scenario.domain_failure_fraction,
            rng=rng,
        )
        play = process.play
    else:
        if trace is None:
            process = RandomFailures(
                p,
                scenario.group_mtbf_s,
                law=scenario.failure_law,
                weibull_shape=scenario.weibull_shape,
                domain_groups=scenario.domain_groups,
                domain_failure_fraction=scenario.domain_failure_fraction,
                rng=rng,
            )
        else:
            if len(trace) != 2:
                raise ValueError("trace must be a pair (times_s, groups)")
            process = TraceFailures(p, *trace, restart_s=restart)

        def play(clock: float, horizon: float) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
            seg = process.segment(clock, horizon)
            count = seg.event_times.size - (0 if math.isinf(seg.interruption) else 1)
            return (
                seg.event_times[:count],
                overheads.after_events(seg, count),
                seg.interruption,
                seg.event_times,
            )

    max_overhead = float(p.redundancy)
    extra_microbatches = microbatches - 1 if kind == "spare" and policy == "adaptive" else 0
    cost = 1.0 + scenario.microbatch_overhead * extra_microbatches
    work = scenario.work_hours * 3600.0
    totals = Totals()
    done = 0.0
    clock = 0.0  # running clock (restarts excluded)
    bar = tqdm.tqdm(
        total=work / 3600.0, unit="h", desc=f"sim {strategy}", disable=not progress, leave=False
    )
    while True:
        remaining = work - done
        changes, levels, t_int, failures = play(
            clock, _horizon(ckpt, remaining, max_overhead * cost)
        )
        kept = play_segment(changes, levels, t_int, failures, remaining, ckpt, totals, cost)
        if math.isinf(kept):
            bar.update(remaining / 3600.0)
            break
        process.restart(clock + t_int)
        clock += t_int
        totals.wall_s += restart
        totals.restart_s += restart
        done += kept
        bar.update(kept / 3600.0)
        if totals.wall_s > max_wall_factor * work:
            break
    bar.close()
    finished = math.isinf(kept)
    wall = totals.wall_s if finished else math.inf
    return RunResult(
        time_to_train_s=float(wall),
        availability=float((totals.wall_s - totals.restart_s) / totals.wall_s),
        effective_ratio=float(work / wall),
        overhead_mean=float(totals.overhead_integral / max(totals.running_s, 1e-300)),
        overhead_max=float(totals.overhead_max),
        interruptions=totals.interruptions,
        lost_work_s=float(totals.lost_work_s),
        lost_progress_s=float(totals.lost_progress_s),
        failures=totals.failures,
        checkpoints=totals.checkpoints,
    )

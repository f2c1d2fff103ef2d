"""SimGrid backend: `Scenario`'s training run played on a simulated cluster and network.

The closed forms and the fast simulator (`engine.simulate`) assume that a step
costs its maximum load and nothing else. This backend plays the same rules on
SimGrid (https://simgrid.org), where a step is simulated work:

* **Platform** (`Cluster`): G group hosts (one group's flop/s each) and a
    storage host on a star or a two-level fat tree, SimGrid's ``CM02`` or
    default ``LV08`` network model.
* **Step** (`Workload`): every live group executes its load of micro-batches
    as flops (`reorder.assign`, recomputed when the live set changes), then the
    live groups all-reduce the gradient (`simgrid_compat.allreduce`: a ring or
    a two-level tree, O(G) messages).
* **Failures**: the trace of `failures.RandomFailures` for the seed that
    `engine.simulate` uses, so the two compare run by run. A failure is
    detected `detection_s` later; a step it overlaps is abandoned then and
    redone under the new assignment. An interruption (a shard without live
    holder, found by `reorder`) costs the detection delay and the restart and
    rolls back to the last checkpoint completed before it; a checkpoint is a
    blocking transfer, from the live groups to the storage host, of
    `checkpoint_s` worth of storage bandwidth.

One driver actor starts every execution and transfer (an actor per group is
about ten times slower at G = 10,000). Steps between two events are identical,
so with `Workload.cache_steps` the driver simulates the first and advances the
clock by whole steps (`cache_steps=False` simulates each; the tests hold the
two to the same result). Runs execute in fresh processes
(`simgrid_compat.run_isolated`), the only place SimGrid is imported, so the
rest of `spare_jax` works without it. docs/validation.md compares the three.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import traceback
from typing import Any

import numpy as np

from spare_jax import checks, reorder, strategies
from spare_jax.scenario import Scenario
from spare_jax.sim import simgrid_compat as compat
from spare_jax.sim.engine import RunResult
from spare_jax.sim.failures import RandomFailures
from spare_jax.sim.simgrid_compat import Cluster

__all__ = [
    "ALLREDUCE",
    "Cluster",
    "Epochs",
    "Run",
    "Workload",
    "epochs",
    "epochs_spec",
    "play",
    "run",
    "run_spec",
    "simulate",
]

ALLREDUCE = ("auto", *compat.ALLREDUCE)
_ENTRY = "spare_jax.sim.simgrid"
_BATCH = 6  # specs per child process


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a step and a failure cost on the cluster.

    Attributes:
        step_compute_s: failure-free compute of one step (m micro-batches); the
            scenario's work is a number of such steps.
        gradient_bytes: bytes each group all-reduces per step.
        allreduce: "ring", "tree" (two-level binary tree: within blocks of
            `Cluster.leaf_size` live groups, then among block leaders), "auto"
            (both simulated once on the full live set, the faster kept) or
            "ring_rounds" (2(n-1) rounds of n messages; small n only).
        detection_s: delay between a failure and its detection.
        cache_steps: advance by whole identical steps (False: simulate each).
        max_steps: stop after this many completed steps (speed probes).
    """

    step_compute_s: float = 1.0
    gradient_bytes: float = 1e8
    allreduce: str = "auto"
    detection_s: float = 0.0
    cache_steps: bool = True
    max_steps: int | None = None

    def validate(self) -> Workload:
        """`self`, or ValueError naming the first bad field."""
        checks.number("step_compute_s", self.step_compute_s, low=0.0, low_open=True)
        checks.number("gradient_bytes", self.gradient_bytes, low=0.0)
        checks.choice("allreduce", self.allreduce, ALLREDUCE)
        checks.number("detection_s", self.detection_s, low=0.0)
        if self.max_steps is not None:
            checks.integer("max_steps", self.max_steps, low=1)
        return self


@dataclasses.dataclass(frozen=True)
class Run:
    """One SimGrid training run: the `RunResult` and what only SimGrid measures.

    Attributes:
        result: the fields every backend returns.
        step_s: the unit of overhead: the failure-free step of plain data
            parallelism (m micro-batches, then the all-reduce), as simulated.
        compute_s: its compute part.
        allreduce: the algorithm used.
        overhead_load: max load / m averaged, like `result.overhead_mean`
            (step time / `step_s`), over the same completed steps.
        epoch_failures: failures of each interrupted segment, the interrupting one included.
        epoch_uptime_s: running seconds from each restart to its interruption.
        steps: completed steps (rolled-back ones included).
        void_steps: steps abandoned because a failure overlapped them.
        void_s: wall seconds of abandoned steps and detection stalls.
        simulated_steps: steps whose executions and transfers SimGrid simulated.
        driver_wall_s: host seconds the driver ran.
        probes: (live groups, max load, step seconds) of every simulated step.
        finished: False when `max_steps` or the wall limit stopped the run.
    """

    result: RunResult
    step_s: float
    compute_s: float
    allreduce: str
    overhead_load: float
    epoch_failures: tuple[int, ...]
    epoch_uptime_s: tuple[float, ...]
    steps: int
    void_steps: int
    void_s: float
    simulated_steps: int
    driver_wall_s: float
    probes: tuple[tuple[int, int, float], ...]
    finished: bool


@dataclasses.dataclass(frozen=True)
class Epochs:
    """Failures and running time to interruption of consecutive segments (no steps simulated)."""

    failures: np.ndarray
    uptime_s: np.ndarray
    driver_wall_s: float


# ---------------------------------------------------------------- the driver


class _Driver:
    """The single actor that plays a run: executions, transfers, failures, saves, restarts."""

    def __init__(self, spec: dict, hosts: list, storage: Any):
        self.s, self.sc, self.w = spec, spec["scenario"], spec["workload"]
        self.hosts, self.storage, self.block = hosts, storage, spec["cluster"].leaf_size
        self.p = strategies.placement(
            spec["strategy"], self.sc.groups, spec["redundancy"], layout=spec["layout"]
        )
        self.m, self.policy = spec["microbatches"], spec["policy"]
        adaptive = strategies.canonical(spec["strategy"]) == "spare" and self.policy == "adaptive"
        cost = 1.0 + self.sc.microbatch_overhead * (self.m - 1) if adaptive else 1.0
        self.mb_s = self.w.step_compute_s / self.m * cost  # one micro-batch, seconds
        self.mb_flops = spec["cluster"].group_flops * self.mb_s
        self.out: dict = {}

    def __call__(self) -> None:
        try:
            self.out = self.epochs() if self.s["mode"] == "epochs" else self.train()
            self.out["completed"] = True
        except BaseException:  # noqa: BLE001 - an exception escaping an actor aborts SimGrid
            self.out = {"error": traceback.format_exc()}

    def _failures(self) -> RandomFailures:
        sc = self.sc
        return RandomFailures(
            self.p,
            sc.group_mtbf_s,
            law=sc.failure_law,
            weibull_shape=sc.weibull_shape,
            domain_groups=sc.domain_groups,
            domain_failure_fraction=sc.domain_failure_fraction,
            rng=np.random.default_rng(self.s["seed"]),
        )

    @staticmethod
    def _same(found: float, expected: float) -> None:
        if not math.isclose(found, expected, rel_tol=1e-9, abs_tol=1e-6):
            raise AssertionError(
                f"reorder interrupts at {found} s, the failure trace at {expected} s"
            )

    def epochs(self) -> dict:
        """Failures and uptime of consecutive segments; the job's steps are not played."""
        process, clock, fails, ups = self._failures(), 0.0, [], []
        pause = self.w.detection_s + self.sc.restart_seconds()
        t_wall = time.perf_counter()
        for _ in range(self.s["epochs"]):
            seg = process.segment(clock, math.inf)
            start, alive = compat.now(), np.ones(self.p.groups, bool)
            ends = np.cumsum(seg.event_sizes).tolist()
            for j, t in enumerate(seg.event_times.tolist()):
                compat.sleep_until(start + t)
                alive[seg.groups[ends[j] - seg.event_sizes[j] : ends[j]]] = False
                if reorder.uncovered(self.p, alive).size:
                    break
            t_int = compat.now() - start
            self._same(t_int, seg.interruption)
            fails.append(j + 1)
            ups.append(t_int)
            compat.sleep_until(compat.now() + pause)
            clock += seg.interruption
            process.restart(clock)
        wall = time.perf_counter() - t_wall
        return {"run": Epochs(np.asarray(fails, np.int64), np.asarray(ups), wall)}

    # ---- the live set, one step, one save

    def _reset(self, full: tuple) -> None:
        """Every group alive: the failure-free assignment and step."""
        self.alive[:] = True
        self.live, self.loads, self.load, self.plan = full
        self.d = self.d0 if self.w.cache_steps else None
        self.last_d, self.d_save = self.d0, self.save_full

    def _reassign(self) -> None:
        a = reorder.assign(self.p, self.alive, microbatches=self.m, policy=self.policy)
        self.live, self.loads, self.load = np.flatnonzero(self.alive), a.loads, a.max_load
        self.d = self.plan = self.d_save = None

    def _simulate_step(self, deadline: float) -> float:
        """Executions then the all-reduce from now: the end time, or inf if cut at `deadline`."""
        if self.plan is None:  # per live set: (host, flops) of each execution, transfer phases
            hosts = self.hosts
            work = [(hosts[g], self.loads[g] * self.mb_flops) for g in self.live.tolist()]
            phases = compat.allreduce(self.kind, self.live, self.w.gradient_bytes, self.block)
            phases = [[(hosts[a], hosts[b], x) for a, b, x in phase] for phase in phases]
            self.plan = ([(h, f) for h, f in work if f > 0], phases)
        work, phases = self.plan
        if not compat.wait_all([compat.execute(h, f) for h, f in work], [], deadline):
            return math.inf
        for phase in phases:
            if not compat.wait_all([], [compat.transfer(a, b, x) for a, b, x in phase], deadline):
                return math.inf
        self.simulated += 1
        return compat.now()

    def _detect(self) -> bool:
        """Apply every failure detected by now; True if one interrupts the run."""
        while self.k < len(self.ev) and self.ev[self.k] + self.w.detection_s <= compat.now():
            self.alive[self.seg.groups[self.ev_lo[self.k] : self.ev_hi[self.k]]] = False
            self.k += 1
            self.dirty = True
            if reorder.uncovered(self.p, self.alive).size:
                self._same(self.ev[self.k - 1] - self.start, self.seg.interruption)
                return True
        return False

    def _next_failure(self) -> float:
        return self.ev[self.k] if self.k < len(self.ev) else math.inf

    def _step(self) -> bool:
        """One step from now: True if it completes; False if a failure voids it."""
        t0, t_f = compat.now(), self._next_failure()
        if self.d is not None:
            end = t0 + self.d
        else:
            end = self._simulate_step(t_f + self.w.detection_s)
            if math.isfinite(end):
                self.last_d = end - t0
                self.d = self.last_d if self.w.cache_steps else None
                self.probes.append((int(self.live.size), int(self.load), self.last_d))
        if end <= t_f:
            compat.sleep_until(end)
            return True
        compat.sleep_until(t_f + self.w.detection_s)  # the job hangs until the detection
        self.void_steps += 1
        self.void_s += compat.now() - t0
        return False

    def _advance(self, work: int) -> None:
        """Whole identical steps up to the next event, or one step."""
        if self.d is None:
            self._one_step()
            return
        now, t_f = compat.now(), self._next_failure()
        k = min(work - self.progress, (self.w.max_steps or math.inf) - self.steps)
        if math.isfinite(t_f):
            k = min(k, math.floor((t_f - now) / self.d))
        if math.isfinite(self.s["interval"]):
            k = min(k, max(1, math.ceil((self._due() - now) / self.d)))
        if k < 1:
            self._one_step()
            return
        compat.sleep_until(now + k * self.d)
        self._count(int(k))

    def _one_step(self) -> None:
        if self._step():
            self._count(1)

    def _count(self, k: int) -> None:
        d = self.last_d
        self.progress += k
        self.steps += k
        self.busy += k * d
        self.over += k * d * d / self.d_ref
        self.over_load += k * d * self.load / self.m
        self.over_max = max(self.over_max, d / self.d_ref)

    def _due(self) -> float:
        return self.last_save_end + self.s["interval"] * (1 - 1e-12)

    def _save(self) -> bool:
        """A blocking save from now; False if an interruption is detected during it."""
        t_s, comms = compat.now(), None
        if self.d_save is None:
            share = self.sc.checkpoint_s * self.s["cluster"].storage_bandwidth_Bps / self.live.size
            comms = [
                compat.transfer(self.hosts[g], self.storage, share) for g in self.live.tolist()
            ]
        end = math.inf if comms else t_s + self.d_save
        while True:  # failures detected during the save change the live set, not the save
            det = self._next_failure() + self.w.detection_s
            if comms is None and end <= det:
                compat.sleep_until(end)
                break
            if comms is None:
                compat.sleep_until(det)
            elif compat.wait_all([], comms, det, cancel_late=False):
                break
            if self._detect():
                compat.cancel(comms or [])
                return False
        if self.w.cache_steps and self.d_save is None:
            self.d_save = compat.now() - t_s
            if self.live.size == self.p.groups:
                self.save_full = self.d_save
        self.saves.append((compat.now(), self.progress))
        self.last_save_end = compat.now()
        return True

    # ---- the run

    def _segment(self, work: int) -> bool:
        """Play from a restart to the end of the work or an interruption; True if interrupted."""
        while True:
            if self._detect():
                return True
            if self.dirty:
                self._reassign()
                self.dirty = False
            if self.progress >= work or (self.w.max_steps and self.steps >= self.w.max_steps):
                return False
            if compat.now() - self.wall0 > self.s["max_wall_factor"] * self.work_s:
                return False
            if compat.now() >= self._due():
                if not self._save():
                    return True
            else:
                self._advance(work)

    def train(self) -> dict:
        """Play the run to the end of the work; the dict becomes a `Run`."""
        sc, w = self.sc, self.w
        work = max(1, round(sc.work_hours * 3600.0 / w.step_compute_s))
        self.work_s = work * w.step_compute_s
        self.alive = np.ones(self.p.groups, bool)
        self.simulated, self.probes, self.save_full = 0, [], None
        self._reassign()
        self.kind = "ring" if w.allreduce == "auto" else w.allreduce
        if w.allreduce == "auto":  # both once on the full live set; keep the faster
            tried = {}
            for kind in ("ring", "tree"):
                self.kind, self.plan, t0 = kind, None, compat.now()
                tried[kind] = self._simulate_step(math.inf) - t0
            self.kind = min(tried, key=tried.get)
        self.plan, t0 = None, compat.now()
        self.d0 = self._simulate_step(math.inf) - t0
        self.d_ref, full = self.d0, (self.live, self.loads, self.load, self.plan)
        if self.load != self.m:  # replication: time plain data parallelism's step too
            self.loads, self.plan, t0 = np.full(self.p.groups, self.m), None, compat.now()
            self.d_ref = self._simulate_step(math.inf) - t0
        self.simulated = self.steps = self.progress = self.void_steps = 0
        self.interruptions = self.failures = self.checkpoints = self.lost_steps = 0
        self.busy = self.over = self.over_load = self.void_s = self.restart_s = 0.0
        self.lost_work, self.over_max, epoch_f, epoch_t = 0.0, 1.0, [], []
        process, clock = self._failures(), 0.0
        self.wall0, t_wall = compat.now(), time.perf_counter()
        while True:
            self.seg = seg = process.segment(clock, math.inf)
            self.start = compat.now()
            self.ev = (self.start + seg.event_times).tolist()
            self.ev_hi = np.cumsum(seg.event_sizes).tolist()
            self.ev_lo = [hi - n for hi, n in zip(self.ev_hi, seg.event_sizes.tolist())]
            self.k, self.dirty, self.saves = 0, False, []
            self.last_save_end, base = self.start, self.progress
            self._reset(full)
            if not self._segment(work):
                self.failures += int(np.searchsorted(self.ev, compat.now(), side="right"))
                self.checkpoints += len(self.saves)
                break
            t_int = self.ev[self.k - 1]
            kept = [(end, p) for end, p in self.saves if end <= t_int]  # saves done before it
            end_kept, progress_kept = kept[-1] if kept else (self.start, base)
            self.checkpoints += len(kept)
            self.lost_work += t_int - end_kept
            self.lost_steps += self.progress - progress_kept
            self.progress = progress_kept
            self.failures += self.k
            self.interruptions += 1
            epoch_f.append(self.k)
            epoch_t.append(t_int - self.start)
            compat.sleep_until(compat.now() + sc.restart_seconds())
            self.restart_s += compat.now() - t_int
            clock += seg.interruption
            process.restart(clock)
        wall = compat.now() - self.wall0
        finished = self.progress >= work
        ttt = wall if finished else math.inf
        result = RunResult(
            time_to_train_s=float(ttt),
            availability=float((wall - self.restart_s) / wall) if wall > 0 else 1.0,
            effective_ratio=float(self.work_s / ttt),
            overhead_mean=float(self.over / self.busy) if self.busy else 1.0,
            overhead_max=float(self.over_max),
            interruptions=self.interruptions,
            lost_work_s=float(self.lost_work),
            lost_progress_s=float(self.lost_steps * w.step_compute_s),
            failures=self.failures,
            checkpoints=self.checkpoints,
        )
        run = Run(
            result,
            self.d_ref,
            self.m * self.mb_s,
            self.kind,
            float(self.over_load / self.busy) if self.busy else 1.0,
            tuple(epoch_f),
            tuple(epoch_t),
            self.steps,
            self.void_steps,
            self.void_s,
            self.simulated,
            time.perf_counter() - t_wall,
            tuple(self.probes),
            finished,
        )
        return {"run": run}


# ---------------------------------------------------------------- public API


def _child(specs: list[dict]) -> dict:
    """Entry of the child process (`simgrid_compat.run_isolated`): specs on one fresh engine."""
    cl, groups = specs[0]["cluster"], specs[0]["scenario"].groups
    drivers = [functools.partial(_Driver, spec) for spec in specs]
    return {"runs": [out["run"] for out in compat.play(cl, groups, drivers)]}


def _spec(scenario: Scenario, strategy: str, redundancy: int, seed: int, layout: str) -> dict:
    if not isinstance(scenario, Scenario):
        raise ValueError(f"scenario must be a Scenario, got {type(scenario).__name__}")
    if scenario.repair != "restart":
        raise NotImplementedError("the SimGrid backend replaces failed groups at restarts only")
    if scenario.checkpoint_async:
        raise NotImplementedError("the SimGrid backend models blocking checkpoints only")
    strategies.placement(strategy, scenario.groups, redundancy, layout=layout)  # checks them
    return {
        "scenario": scenario,
        "strategy": strategy,
        "redundancy": int(redundancy),
        "seed": checks.integer("seed", seed, low=0),
        "layout": layout,
    }


def run_spec(
    scenario: Scenario,
    strategy: str,
    *,
    redundancy: int = 1,
    checkpoint_interval_s: float,
    microbatches: int = 8,
    policy: str = "adaptive",
    seed: int = 0,
    layout: str = "cyclic",
    cluster: Cluster | None = None,
    workload: Workload | None = None,
    max_wall_factor: float = 1e3,
) -> dict:
    """The checked arguments of one training run, for `play`."""
    interval = checks.number(
        "checkpoint_interval_s", checkpoint_interval_s, low=0.0, low_open=True, allow_inf=True
    )
    return _spec(scenario, strategy, redundancy, seed, layout) | {
        "mode": "train",
        "microbatches": checks.integer("microbatches", microbatches, low=1),
        "policy": strategies.check_policy(policy, exact=True),
        "cluster": (cluster or Cluster()).validate(),
        "workload": (workload or Workload()).validate(),
        "interval": interval,
        "max_wall_factor": checks.number("max_wall_factor", max_wall_factor, low=1.0),
    }


def epochs_spec(
    scenario: Scenario,
    strategy: str,
    *,
    redundancy: int = 1,
    epochs: int,
    seed: int = 0,
    layout: str = "cyclic",
    detection_s: float = 0.0,
    cluster: Cluster | None = None,
) -> dict:
    """The checked arguments of an `epochs` run, for `play` (`cluster` only groups runs)."""
    return _spec(scenario, strategy, redundancy, seed, layout) | {
        "mode": "epochs",
        "microbatches": 1,
        "policy": "adaptive",
        "cluster": (cluster or Cluster()).validate(),
        "workload": Workload(detection_s=detection_s).validate(),
        "epochs": checks.integer("epochs", epochs, low=1),
    }


def play(specs: list[dict], processes: int = 1) -> list[Run | Epochs]:
    """Play `run_spec` / `epochs_spec` payloads, `processes` fresh processes at a time.

    Specs of one platform (cluster and G) share a process, at most `_BATCH` per
    process, in a grouping that does not depend on `processes` (results do not).

    Raises:
        simgrid_compat.SimGridMissing: SimGrid is not installed (the message says how to).
        simgrid_compat.SimGridError: a simulation failed or did not complete.
    """
    by_platform: dict = {}
    for i, spec in enumerate(specs):
        by_platform.setdefault((spec["cluster"], spec["scenario"].groups), []).append(i)
    batches = [
        ids[j : j + _BATCH] for ids in by_platform.values() for j in range(0, len(ids), _BATCH)
    ]
    batches.sort(key=lambda ids: -specs[ids[0]]["scenario"].groups * len(ids))  # big ones first
    outs = compat.run_many(f"{_ENTRY}:_child", [[specs[i] for i in b] for b in batches], processes)
    runs: list = [None] * len(specs)
    for ids, out in zip(batches, outs, strict=True):
        for i, one in zip(ids, out["runs"], strict=True):
            runs[i] = one
    return runs


def run(scenario: Scenario, strategy: str, **kwargs: Any) -> Run:
    """One SimGrid training run under `scenario`'s rules (keyword arguments of `run_spec`).

    The failure trace is `engine.simulate`'s for the same seed. Its running
    clock excludes restarts and the detection of interruptions, so give
    `engine.simulate` a restart cost of `restart_seconds() + detection_s` to
    compare the two run by run.
    """
    return play([run_spec(scenario, strategy, **kwargs)])[0]


def simulate(scenario: Scenario, strategy: str, **kwargs: Any) -> RunResult:
    """The `engine.Backend` seam: `run(...).result`."""
    return run(scenario, strategy, **kwargs).result


def epochs(scenario: Scenario, strategy: str, **kwargs: Any) -> Epochs:
    """Failures and uptime to interruption of consecutive segments, on SimGrid's clock.

    The job's steps are not simulated: failures strike at the trace's times,
    `reorder` finds each interruption and the restart replaces the dead
    groups. Both quantities depend on the trace and the placement only, so
    this reaches the sample sizes endurable failures and the mean time to
    interruption need; `run` measures the same per segment with the steps.
    """
    return play([epochs_spec(scenario, strategy, **kwargs)])[0]

"""The training loop through failures: schedules, live sets, metrics.

Owns: failure schedules (explicit ``step:group`` lists or a per-step random
rate), the loop that turns each step's live set into a slot plan (via
`spare_jax.reorder`, recomputed only when the live set changes), runs the
jitted step, and writes ``WORKDIR/metrics.jsonl``, one JSON object per step with
``step``, ``loss``, ``live_groups``, ``max_load``, ``step_time_s`` (a contract
for external checks) plus ``overhead``, ``compiles`` and ``exact``.

Failures reach the data plane only as the live mask. Failed groups stay dead.
When a failure leaves a shard with no live holder the loop stops with
`TrainingInterrupted` (rollback comes with checkpointing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable

import jax
import ml_collections
import numpy as np

from spare_jax import data as data_lib
from spare_jax import mesh as mesh_lib
from spare_jax import model as model_lib
from spare_jax import reorder
from spare_jax import train_step as step_lib
from spare_jax.placement import Placement

__all__ = [
    "POLICIES",
    "STRATEGIES",
    "FailureSchedule",
    "RunSetup",
    "TrainingInterrupted",
    "parse_failures",
    "plan_for",
    "setup",
    "train",
]

STRATEGIES = ("spare", "replication", "dp")
POLICIES = ("adaptive", "fixed", "drop")

log = logging.getLogger(__name__)


class TrainingInterrupted(RuntimeError):
    """A shard lost all its live holders; the step cannot be completed exactly."""

    def __init__(self, step: int, uncovered: Iterable[int], dead: Iterable[int]):
        self.step = int(step)
        self.uncovered = sorted(int(s) for s in uncovered)
        self.dead = sorted(int(g) for g in dead)
        super().__init__(
            f"interrupted at step {self.step}: shard(s) {self.uncovered} have no live holder "
            f"(dead groups {self.dead}); an exact step is impossible, roll back to a checkpoint"
        )


def parse_failures(spec: str, groups: int, steps: int) -> dict[int, list[int]]:
    """Parse ``"step:group,step:group,..."`` into ``{step: [groups]}``.

    Raises:
        ValueError: with a message naming the bad entry.
    """
    out: dict[int, list[int]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"bad failure {item!r}: expected step:group with integers, e.g. 3:1")
        step, group = int(parts[0]), int(parts[1])
        if not 0 <= step < steps:
            raise ValueError(f"failure {item!r}: step must lie in [0, {steps})")
        if not 0 <= group < groups:
            raise ValueError(f"failure {item!r}: group must lie in [0, {groups}) for this mesh")
        out.setdefault(step, []).append(group)
    return out


@dataclasses.dataclass
class FailureSchedule:
    """Which groups fail at each step: explicit, or each live group with probability ``rate``."""

    explicit: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"failure_rate must lie in [0, 1], got {self.rate}")
        self._rng = np.random.default_rng(np.random.SeedSequence([self.seed, 7]))

    def failing(self, step: int, alive: np.ndarray) -> list[int]:
        """Groups that fail just before ``step`` runs (call once per step, in order)."""
        failed = set(self.explicit.get(step, []))
        if self.rate > 0 and step > 0:
            draws = self._rng.random(alive.shape[0]) < self.rate
            failed |= set(np.flatnonzero(draws & alive).tolist())
        return sorted(failed)


@dataclasses.dataclass
class RunSetup:
    """Everything the loop needs, built once from a config."""

    mesh: jax.sharding.Mesh
    placement: Placement
    source: data_lib.TokenSource
    step_fn: step_lib.TrainStep
    state: step_lib.TrainState
    microbatches: int
    policy: str


def _source(config: ml_collections.ConfigDict) -> data_lib.TokenSource:
    m = config.model
    if config.data.kind == "markov":
        return data_lib.MarkovSource(
            m.vocab, m.seq_len, config.batch, seed=config.seed, branching=config.data.branching
        )
    if config.data.kind == "file":
        if not config.data.path:
            raise ValueError(
                "config.data.path must name a uint16 .bin token file when data.kind='file'"
            )
        return data_lib.TokenFileSource(
            config.data.path, m.vocab, m.seq_len, config.batch, seed=config.seed
        )
    raise ValueError(f"config.data.kind must be 'markov' or 'file', got {config.data.kind!r}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming the first bad setting."""
    if config.strategy not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {', '.join(STRATEGIES)}, got {config.strategy!r}"
        )
    if config.policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
    if len(config.mesh) != 3 or min(int(a) for a in config.mesh) < 1:
        raise ValueError(
            f"mesh must be three positive sizes (data, redundancy, model), got {config.mesh}"
        )
    for name in ("redundancy", "microbatches", "steps", "batch"):
        if int(config[name]) < 1:
            raise ValueError(f"{name} must be >= 1, got {config[name]}")
    model_lib.ModelConfig(**config.model).validate()
    if config.model.heads % config.mesh[2] and config.mesh[2] > 1:
        log.warning(
            "model axis %d does not divide heads %d: XLA will pad",
            config.mesh[2],
            config.model.heads,
        )


def setup(config: ml_collections.ConfigDict) -> RunSetup:
    """Mesh, placement, data, model state and the jitted step for a config."""
    validate(config)
    mesh = mesh_lib.make_mesh(tuple(config.mesh))
    placement = mesh_lib.placement_for(config.strategy, mesh, int(config.redundancy))
    m = int(config.microbatches)
    cfg = model_lib.ModelConfig(**config.model)
    tx = step_lib.make_optimizer(
        config.learning_rate,
        config.warmup_steps,
        config.steps,
        config.weight_decay,
        config.clip_norm,
    )
    graphdef, state, shardings = step_lib.init_state(cfg, tx, mesh, config.seed)
    stack = placement.depth * placement.shard_units * m
    bound = int(config.slot_bound) or stack
    step_fn = step_lib.TrainStep(mesh, graphdef, tx, shardings, slot_bound=bound)
    return RunSetup(mesh, placement, _source(config), step_fn, state, m, config.policy)


def plan_for(run: RunSetup, alive: np.ndarray) -> step_lib.SlotPlan:
    """The slot plan of a live set under the run's policy (raises reorder.Interruption)."""
    if run.policy == "drop":
        return step_lib.drop_and_renormalise_plan(run.placement, alive, run.microbatches)
    return step_lib.plan_from_assignment(
        reorder.assign(run.placement, alive, run.microbatches, run.policy)
    )


def _plan_or_interrupt(run: RunSetup, alive: np.ndarray, step: int) -> step_lib.SlotPlan:
    try:
        return plan_for(run, alive)
    except reorder.Interruption as err:
        raise TrainingInterrupted(step, err.uncovered, np.flatnonzero(~alive)) from None
    except ValueError:
        if not alive.any():  # the drop baseline never interrupts until nobody is left
            everything = range(run.placement.shards)
            raise TrainingInterrupted(step, everything, range(alive.size)) from None
        raise


def train(
    run: RunSetup,
    steps: int,
    failures: FailureSchedule,
    workdir: str | None = None,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train ``steps`` steps through ``failures``; return the per-step metrics.

    Raises:
        TrainingInterrupted: when a failure leaves a shard uncovered (the metrics
            of the completed steps are already written).
    """
    groups = run.placement.groups
    alive = np.ones(groups, bool)
    records: list[dict] = []
    plan, plan_key = None, None
    with contextlib.ExitStack() as stack:
        sink = None
        if workdir:
            os.makedirs(workdir, exist_ok=True)
            sink = stack.enter_context(open(os.path.join(workdir, "metrics.jsonl"), "w"))
        for step in range(steps):
            for g in failures.failing(step, alive):
                alive[g] = False
            if plan_key != alive.tobytes():
                plan = _plan_or_interrupt(run, alive, step)
                plan_key = alive.tobytes()
            t0 = time.perf_counter()
            tokens = run.step_fn.put_tokens(
                data_lib.stack_inputs(run.source, run.placement, run.microbatches, step)
            )
            device_plan = run.step_fn.put_plan(plan)
            t1 = time.perf_counter()
            with jax.transfer_guard("disallow"):
                run.state, metrics = run.step_fn(run.state, tokens, device_plan)
            metrics = jax.device_get(metrics)
            t2 = time.perf_counter()
            record = {
                "step": step,
                "loss": float(metrics["loss"]),
                "live_groups": int(alive.sum()),
                "max_load": int(plan.max_load),
                "step_time_s": round(t2 - t1, 6),
                "data_time_s": round(t1 - t0, 6),
                "overhead": plan.max_load / run.microbatches,
                "grad_norm": float(metrics["grad_norm"]),
                "compiles": run.step_fn.compiles,
                "exact": plan.exact,
            }
            records.append(record)
            if sink:
                sink.write(json.dumps(record) + "\n")
                sink.flush()
            if on_step:
                on_step(record)
    return records

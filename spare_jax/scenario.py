"""Scenario: the cluster, its failures and its costs, shared by `analysis` and `sim`.

A scenario fixes the rules of the world that both the closed-form model
(`spare_jax.analysis`) and the discrete-event simulator (`spare_jax.sim`)
describe; the simulator plays them exactly, the model approximates them. This
module also owns the failure-law vocabulary (`FAILURE_LAWS`, `REPAIRS`) and the
Weibull scale of a given mean, so that both tools parameterise a law alike.

Rules of the world (one training run):

1. `groups = gpus // gpus_per_group` groups. Each group fails independently;
      its time to failure is exponential with mean `gpu_mtbf_hours /
      gpus_per_group`, or Weibull with that mean and shape `weibull_shape`.
      Optionally, each failure domain (`domain_groups` consecutive groups) also
      fails as a whole at rate `domain_failure_fraction` times the rate of single
      group failures in it.
2. Dead groups stay dead until the next restart (`repair="restart"`), or come
      back after `mttr_hours` without a global restart (`repair="hot"`).
3. The run is *interrupted* when some shard has no live holder (checked with
      `spare_jax.reorder`). An interruption loses the progress made since the last
      completed checkpoint, costs `restart_seconds()` of wall time (no failures are
      counted during it), and replaces every failed group.
4. Progress: the job needs `work_hours` of failure-free compute. While running
      with computation overhead `o(live set)` (max load / m for SPARe, r for
      replication, 1 for plain data parallelism), progress accrues at `1 / o` per
      wall-clock second.
5. Checkpoints: a save starts every `checkpoint_interval` seconds of running
      since the last save or restart and takes `checkpoint_s`. A blocking save
      makes no progress; an async save (`checkpoint_async=True`) keeps training
      and stalls only `checkpoint_async_stall_s`. A save counts once complete.
6. Time-to-train is the wall time until the progress reaches `work_hours`.

Every field is checked when a `Scenario` is built (finite, in range, known
names), so the library and the binaries refuse the same values with the same
message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from spare_jax import checks

__all__ = ["FAILURE_LAWS", "MAX_GROUPS", "REPAIRS", "WEIBULL_SHAPES", "Scenario", "weibull_scale"]

FAILURE_LAWS: tuple[str, ...] = ("exponential", "weibull")
REPAIRS: tuple[str, ...] = ("restart", "hot")
# The largest cluster the tools are sized for: at 10^6 groups a whole plan
# (experiments/plan.py) takes about 25 s on 2 cores; at 10^7 groups one
# time-to-train evaluation alone takes about 30 s, and the plan several minutes.
MAX_GROUPS = 1_000_000
# Weibull shapes the tools evaluate (gamma(1 + 1/shape) overflows below about 0.006).
WEIBULL_SHAPES: tuple[float, float] = (0.1, 10.0)


def weibull_scale(mean: float, shape: float) -> float:
    """Weibull scale parameter giving mean `mean` at shape `shape`."""
    return mean / math.gamma(1.0 + 1.0 / shape)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Cluster, failure law and costs. Defaults: 600k GPUs, sourced below.

    Sources are those of docs/design.md, section 12 (Parameter sources).
    """

    # The SPARe paper's largest scale is 600k GPUs (Lee et al., arXiv 2603.00357);
    # 8 GPUs per group (one 8-GPU node per replica group).
    gpus: int = 600_000
    gpus_per_group: int = 8
    # Derived from "The Llama 3 Herd of Models" (Meta, 2024): 16,384 GPUs x 1,296 h
    # / 419 unexpected interruptions ~ 5.1e4 GPU-hours.
    gpu_mtbf_hours: float = 5.1e4
    # "exponential" or "weibull". Weibull shape 0.7 is the commonly quoted value
    # from Schroeder & Gibson, DSN 2006 (unverified).
    failure_law: str = "exponential"
    weibull_shape: float = 0.7
    # Failure domains: 0 disables. Proxy: switch/cable faults were 8.4% of Llama 3
    # interruptions (Llama 3 report); no clean correlated fraction is published.
    domain_groups: int = 0
    domain_failure_fraction: float = 0.0
    # Failure-free compute: one month, the reference run of docs/design.md section 9.
    work_hours: float = 720.0
    # Checkpoint save. 405B + Adam ~6.5 TB at 2 TB/s is ~3 s if ideal (derived from
    # the Llama 3 report); production saves are far slower (checkpoint overhead 12%
    # on average, Meta CPR analysis cited by Gemini, SOSP 2023). We take 60 s and sweep.
    checkpoint_s: float = 60.0
    checkpoint_async: bool = False
    checkpoint_async_stall_s: float = 5.0
    # Restart: ~10 min synchronous restart per failure at ~100k GPUs ("Training LLMs
    # with Fault Tolerant HSDP on 100,000 GPUs", arXiv 2602.00277). Growth with N:
    # the SPARe paper (citing MegaScale 2024, NCCLX 2025) says quadratic or worse by
    # default; we take linear (exponent 1) as the default and sweep 0..2.
    restart_s_ref: float = 600.0
    restart_ref_gpus: int = 100_000
    restart_exponent: float = 1.0
    # Repair policy: "restart" (replace failed groups at each restart) or "hot"
    # (a failed group re-joins after mttr_hours without a global restart).
    repair: str = "restart"
    mttr_hours: float = 4.0
    # Fixed cost of one extra micro-batch per step, as a fraction of the step's
    # compute (0: micro-batches are free, the analysis's default assumption; no
    # published figure for this cost was found, so it is a sweep parameter).
    microbatch_overhead: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Scenario:
        """A `Scenario` from field names and values (a config's `to_dict()`, flags).

        Raises:
            ValueError: an unknown field name, or a value the fields refuse.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"unknown scenario field(s): {', '.join(unknown)}")
        return cls(**values)

    @property
    def groups(self) -> int:
        return self.gpus // self.gpus_per_group

    @property
    def group_mtbf_s(self) -> float:
        """Mean time to failure of one group, seconds."""
        return self.gpu_mtbf_hours * 3600.0 / self.gpus_per_group

    def restart_seconds(self) -> float:
        """Global restart cost R(N) at this scenario's GPU count."""
        return self.restart_s_ref * (self.gpus / self.restart_ref_gpus) ** self.restart_exponent

    def validate(self) -> Scenario:
        """Raise ValueError naming the first bad field; return self when valid.

        Runs when the scenario is built; kept public so callers can re-check.
        """
        for name in ("gpus", "gpus_per_group", "restart_ref_gpus"):
            checks.integer(name, getattr(self, name), low=1)
        checks.integer("domain_groups", self.domain_groups, low=0)
        for name in ("gpu_mtbf_hours", "work_hours", "mttr_hours"):
            checks.number(name, getattr(self, name), low=0.0, low_open=True)
        for name in (
            "checkpoint_s",
            "checkpoint_async_stall_s",
            "restart_s_ref",
            "restart_exponent",
            "domain_failure_fraction",
            "microbatch_overhead",
        ):
            checks.number(name, getattr(self, name), low=0.0)
        lo, hi = WEIBULL_SHAPES
        checks.number("weibull_shape", self.weibull_shape, low=lo, high=hi)
        checks.choice("failure_law", self.failure_law, FAILURE_LAWS)
        checks.choice("repair", self.repair, REPAIRS)
        if not isinstance(self.checkpoint_async, bool):
            raise ValueError(f"checkpoint_async must be a bool, got {self.checkpoint_async!r}")
        if self.gpus % self.gpus_per_group:
            raise ValueError(
                f"gpus={self.gpus} must be a multiple of gpus_per_group={self.gpus_per_group}"
            )
        if self.groups > MAX_GROUPS:
            raise ValueError(
                f"groups (gpus / gpus_per_group) must be <= {MAX_GROUPS:,}, got {self.groups:,}: "
                "the planner and simulator are sized for it (a plan at 10^6 groups takes "
                "about 25 s; at 10^7, minutes)"
            )
        checks.number("group_mtbf_s (gpu_mtbf_hours * 3600 / gpus_per_group)", self.group_mtbf_s)
        try:
            restart = self.restart_seconds()
        except OverflowError:
            restart = math.inf
        checks.number("restart_seconds() (restart_s_ref and its growth to gpus)", restart)
        return self

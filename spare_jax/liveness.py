"""The live set of a training run: scheduled and random failures, hot re-joins, replacement.

Failures reach the data plane only as the live mask this module produces, one
step at a time. Three sources change it:

* a **schedule** of ``step:group`` entries, each firing once: a step that is
  re-executed after a rollback does not fire its entries again;
* **random failures**: before every step after the first, each live group
  fails with probability ``rate``. After a rollback the generator continues
  (it is not rewound, so a rollback does not replay the failures that caused
  it); a run resumed from disk continues from the generator state saved in the
  checkpoint;
* **hot re-join**: with ``repair_steps = K > 0`` a group that failed before
  step ``t`` is live again from step ``t + K``, without a global restart.

At a rollback every failed group is replaced (`replace_all`). `state_dict` /
`load_state_dict` carry everything needed to continue exactly (JSON-ready).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from spare_jax import checks

__all__ = ["Change", "Failures", "parse_schedule"]


def parse_schedule(spec: str, groups: int, steps: int) -> dict[int, list[int]]:
    """Parse ``"step:group,step:group,..."`` into ``{step: [groups]}``.

    Raises:
        ValueError: naming the bad entry and the rule.
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


@dataclasses.dataclass(frozen=True)
class Change:
    """What happened to the live set just before a step.

    Attributes:
        failed: groups that failed (scheduled or random), sorted.
        scheduled: the subset of ``failed`` that came from the schedule.
        rejoined: groups that re-joined, sorted.
    """

    failed: tuple[int, ...] = ()
    scheduled: tuple[int, ...] = ()
    rejoined: tuple[int, ...] = ()


class Failures:
    """Failures and re-joins of one run, and the live set they leave at each step."""

    def __init__(
        self,
        groups: int,
        *,
        schedule: dict[int, list[int]] | None = None,
        rate: float = 0.0,
        repair_steps: int = 0,
        seed: int = 0,
    ):
        self.groups = checks.integer("groups", groups, low=1)
        self.rate = checks.number("failure_rate", rate, low=0.0, high=1.0)
        self.repair_steps = checks.integer("repair_steps", repair_steps, low=0)
        self.schedule = {int(t): sorted(set(gs)) for t, gs in (schedule or {}).items()}
        self.alive = np.ones(self.groups, bool)
        self.fired: set[tuple[int, int]] = set()
        self.rejoin_at: dict[int, int] = {}
        self.rng = np.random.default_rng(np.random.SeedSequence([checks.integer("seed", seed), 7]))

    @property
    def total_rate(self) -> float:
        """Failures per group per step implied by the configuration (for the interval model).

        The random rate when set; otherwise the schedule's entries spread over
        its span; 0 when nothing fails.
        """
        if self.rate > 0:
            return self.rate
        entries = sum(len(gs) for gs in self.schedule.values())
        if not entries:
            return 0.0
        return entries / (self.groups * (max(self.schedule) + 1))

    def advance(self, step: int) -> Change:
        """Apply the re-joins and failures due before ``step``; call once per executed step."""
        back = sorted(g for g, t in self.rejoin_at.items() if t <= step)
        for g in back:
            del self.rejoin_at[g]
            self.alive[g] = True
        due = [g for g in self.schedule.get(step, []) if (step, g) not in self.fired]
        self.fired.update((step, g) for g in due)
        scheduled = [g for g in due if self.alive[g]]
        failed = set(scheduled)
        if self.rate > 0 and step > 0:
            draws = self.rng.random(self.groups) < self.rate
            failed |= set(np.flatnonzero(draws & self.alive).tolist())
        for g in failed:
            self.alive[g] = False
            if self.repair_steps:
                self.rejoin_at[g] = step + self.repair_steps
        return Change(tuple(sorted(failed)), tuple(sorted(scheduled)), tuple(back))

    def fail(self, groups: list[int], step: int, *, repair: bool = True) -> None:
        """Mark groups failed before ``step``.

        ``repair=False`` for the groups of a process that really died: their
        devices are gone, so no re-join is scheduled (and one pending from a
        simulated failure is called off).
        """
        for g in groups:
            self.alive[checks.integer("group", g, low=0, high=self.groups - 1)] = False
            if self.repair_steps and repair:
                self.rejoin_at[g] = step + self.repair_steps
            else:
                self.rejoin_at.pop(g, None)

    def replace_all(self) -> None:
        """A rollback replaces every failed group: all live, no re-join pending."""
        self.alive[:] = True
        self.rejoin_at.clear()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, as JSON-ready values."""
        return {
            "alive": self.alive.tolist(),
            "fired": sorted([t, g] for t, g in self.fired),
            "rejoin_at": {str(g): t for g, t in sorted(self.rejoin_at.items())},
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        alive = np.asarray(state["alive"], bool)
        if alive.shape != (self.groups,):
            raise ValueError(f"saved live set has {alive.size} groups, this run has {self.groups}")
        self.alive = alive
        self.fired = {(int(t), int(g)) for t, g in state["fired"]}
        self.rejoin_at = {int(g): int(t) for g, t in state["rejoin_at"].items()}
        self.rng.bit_generator.state = state["rng"]

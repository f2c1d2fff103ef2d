"""The overhead after each failure event of a segment, from the actual live set.

Between two restarts (no hot re-join) the live set only shrinks, so one
`incremental.LoadTracker` walks a segment's events: the exact optimal max
load for stacking (or the fixed order), r for replication, 1 for plain data
parallelism. The tracker also confirms the failure process's interruption:
the reorder core must raise `reorder.Interruption` on the interrupting event,
and only there. Used by the run engine and by `interruption.epoch_overhead`.
"""

from __future__ import annotations

import numpy as np

from spare_jax import reorder
from spare_jax.incremental import LoadTracker
from spare_jax.placement import Placement
from spare_jax.sim.failures import Segment

__all__ = ["Overheads"]


class Overheads:
    """Overhead after each failure event of a segment (shrinking live set)."""

    def __init__(self, p: Placement, microbatches: int, policy: str):
        self.placement = p
        self.m = microbatches
        self.policy = policy
        self.constant = p.duplicate_work or p.redundancy == 1
        self.base = p.redundancy if p.duplicate_work else 1.0

    def after_events(self, seg: Segment, count: int) -> np.ndarray:
        """float [count + 1]: overhead before any event, then after each of the first `count`."""
        out = np.full(count + 1, float(self.base))
        if self.constant or count == 0:
            return out
        tracker = LoadTracker(self.placement, self.m, self.policy)
        groups = seg.groups
        ends = np.cumsum(seg.event_sizes[:count])
        start = 0
        try:
            for j, end in enumerate(ends.tolist()):
                for g in groups[start:end].tolist():
                    load = tracker.fail(g)
                out[j + 1] = load / self.m
                start = end
        except reorder.Interruption as exc:  # the failure process and reorder disagree
            raise AssertionError(
                f"uncovered shard before the computed interruption: {exc}"
            ) from exc
        if count < seg.event_sizes.size:  # the interrupting event must uncover a shard
            try:
                for g in groups[start : start + seg.event_sizes[count]].tolist():
                    tracker.fail(g)
            except reorder.Interruption:
                return out
            raise AssertionError("the computed interruption leaves every shard covered")
        return out

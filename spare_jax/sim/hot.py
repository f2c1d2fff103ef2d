"""Hot re-join: failed groups come back after a repair time, without a global restart.

With `Scenario.repair == "hot"` the live set no longer only shrinks between
restarts, so the min-over-shards-of-max trick of `failures` does not apply.
This module walks the segment's events (failures and re-joins) in time order
with a heap: a few Python operations per event, never per step or per group.
Each event updates the count of dead holders of the shards the group holds
(interruption when one reaches r) and the overhead of the new live set.

The overhead is exact. For one-ring cyclic stacking under adaptive
reordering it is the Hall bound of docs/design.md (4. Adaptive reordering and
the optimal load) evaluated over the k dead groups only
(`analysis.overhead_model.window_load`, O(k^2), k is small with hot re-join), and
skipped altogether when every two ring-consecutive dead groups are at least
m + 1 apart: then no window beats the global term ceil(G m / live)
(docs/simulator.md gives the argument). Other placements and the fixed
order call `reorder.max_load`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Any

import numpy as np

from spare_jax import checks, reorder
from spare_jax.analysis.overhead_model import window_load
from spare_jax.placement import Placement
from spare_jax.sim.failures import GroupClocks

__all__ = ["HotRepair"]

_FAIL, _DOMAIN, _BACK = 0, 1, 2


class _Load:
    """Overhead of the current live set, with the sparse-dead shortcut."""

    def __init__(self, p: Placement, microbatches: int, policy: str):
        self.p, self.m, self.policy = p, microbatches, policy
        self.alive = np.ones(p.groups, bool)
        self.constant = p.duplicate_work or p.redundancy == 1
        single = (
            p.rings is not None
            and p.rings.shape[0] == 1
            and np.array_equal(p.rings[0], np.arange(p.groups))
        )
        self.shortcut = single and policy == "adaptive" and not self.constant
        self.dead: list[int] = []  # sorted ring positions of dead groups
        self.close = 0  # ring-consecutive dead pairs closer than m + 1

    def _gap_close(self, a: int, b: int) -> int:
        if a == b:
            return 0
        return int((b - a) % self.p.groups < self.m + 1)

    def _neighbours(self, i: int) -> tuple[int, int]:
        n = len(self.dead)
        return self.dead[(i - 1) % n], self.dead[(i + 1) % n]

    def set(self, group: int, alive: bool) -> None:
        self.alive[group] = alive
        if not self.shortcut:
            return
        if not alive:
            bisect.insort(self.dead, group)
            i = self.dead.index(group)
            if len(self.dead) > 1:
                lo, hi = self._neighbours(i)
                self.close += (
                    self._gap_close(lo, group)
                    + self._gap_close(group, hi)
                    - (self._gap_close(lo, hi) if len(self.dead) > 2 else 0)
                )
        else:
            i = self.dead.index(group)
            if len(self.dead) > 1:
                lo, hi = self._neighbours(i)
                self.close -= (
                    self._gap_close(lo, group)
                    + self._gap_close(group, hi)
                    - (self._gap_close(lo, hi) if len(self.dead) > 2 else 0)
                )
            self.dead.pop(i)

    def overhead(self) -> float:
        if self.constant:
            return float(self.p.redundancy) if self.p.duplicate_work else 1.0
        k = len(self.dead) if self.shortcut else int(self.p.groups - self.alive.sum())
        if k == 0:
            return 1.0
        if self.shortcut:
            g, m = self.p.groups, self.m
            load = -(-g * m // (g - k))
            if self.close:
                load = max(load, window_load(np.array(self.dead), g, self.p.redundancy, m))
            return load / m
        return reorder.max_load(self.p, self.alive, self.m, self.policy) / self.m


class HotRepair(GroupClocks):
    """Failure process with hot re-join after `mttr_s`, playing whole segments.

    Groups fail after exponential or Weibull lifetimes (running clock); a dead
    group re-joins `mttr_s` later and draws a fresh lifetime. Domains (as in
    `failures.GroupClocks`) fail as a whole. At a restart every group is
    replaced: dead or repairing groups start fresh, survivors keep their clocks.
    """

    def __init__(
        self,
        p: Placement,
        mean_s: float,
        mttr_s: float,
        *,
        microbatches: int,
        policy: str,
        **kwargs: Any,
    ):
        """Placement, mean lifetime, repair time, load settings and `GroupClocks`'s keywords."""
        checks.number("mttr_s", mttr_s, low=0.0, low_open=True)
        super().__init__(p.groups, mean_s, **kwargs)
        self.p = p
        self.mttr_s = float(mttr_s)
        self.m, self.policy = microbatches, policy

    def play(
        self, start_s: float, horizon_s: float
    ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        """Events from running time `start_s` (all alive) to the interruption or the horizon.

        Returns:
            (change times, overheads [changes + 1], interruption time or inf,
            failure times), times relative to `start_s`.
        """
        p, end = self.p, start_s + horizon_s
        due = np.flatnonzero(self._next <= end)
        heap = list(zip(self._next[due].tolist(), [_FAIL] * due.size, due.tolist(), strict=True))
        if self._domains:
            due = np.flatnonzero(self._domain_next <= end)
            heap += zip(
                self._domain_next[due].tolist(), [_DOMAIN] * due.size, due.tolist(), strict=True
            )
        heapq.heapify(heap)
        load = _Load(p, self.m, self.policy)
        dead_holders = np.zeros(p.shards, np.int64)
        changes, overheads, failures = [], [load.overhead()], []
        while heap:
            t, kind, who = heapq.heappop(heap)
            if t > end:
                break
            if kind == _BACK:
                load.set(who, True)
                dead_holders[p.stacks[who]] -= 1
                life = float(self._draw(1)[0])
                self._next[who] = t + life
                if t + life <= end:
                    heapq.heappush(heap, (t + life, _FAIL, who))
            else:
                if kind == _DOMAIN:
                    victims = np.flatnonzero((self._domain_of == who) & load.alive)
                    self._redraw_domains(who, t)
                    if self._domain_next[who] <= end:
                        heapq.heappush(heap, (self._domain_next[who], _DOMAIN, who))
                else:
                    if not load.alive[who] or self._next[who] != t:
                        continue  # stale: the group died with its domain meanwhile
                    victims = np.array([who])
                if victims.size == 0:
                    continue
                failures.append(t - start_s)
                lost = False
                for g in victims.tolist():
                    load.set(g, False)
                    self._next[g] = math.inf
                    dead_holders[p.stacks[g]] += 1
                    lost |= bool(np.any(dead_holders[p.stacks[g]] >= p.redundancy))
                    heapq.heappush(heap, (t + self.mttr_s, _BACK, g))
                if lost:
                    return (np.array(changes), np.array(overheads), t - start_s, np.array(failures))
            changes.append(t - start_s)
            overheads.append(load.overhead())
        return np.array(changes), np.array(overheads), math.inf, np.array(failures)

    def restart(self, end_s: float) -> None:
        """Replace every group dead or repairing at `end_s`; survivors keep their clocks."""
        fresh = np.flatnonzero(~np.isfinite(self._next) | (self._next <= end_s))
        self._next[fresh] = end_s + self._draw(fresh.size)
        if self._domains:
            self._redraw_domains(np.flatnonzero(self._domain_next <= end_s), end_s)

"""Incremental maximum load as groups die one after another.

Between restarts the live set only shrinks, so simulators and controllers ask
the same question thousands of times: what is the optimal maximum load now
that one more group is dead? `LoadTracker` answers it without re-solving the
whole machine. For ring placements under adaptive reordering it keeps the
periodic carry of the sweep in `reorder` and, after a failure, recomputes the
carry only downstream of the dead group until it merges with the old one
(usually a few dozen positions: the chain of neighbours that absorbs the extra
work). Only when the current load stops being feasible does it bisect again.
Fixed order keeps the longest dead run; replication's load never changes; other
placements fall back to a full solve.
"""

from __future__ import annotations

import numpy as np

from spare_jax import reorder, rings
from spare_jax.placement import Placement

__all__ = ["LoadTracker"]

_FIRST_CHUNK = 64


class LoadTracker:
    """Optimal (or fixed-order) maximum load under a shrinking live set.

    Example:
        tracker = LoadTracker(placement.cyclic(75_000, 4), microbatches=8)
        for group in failing_groups:
            load = tracker.fail(group)  # raises reorder.Interruption when uncovered
    """

    def __init__(
        self,
        placement: Placement,
        microbatches: int = 1,
        policy: str = "adaptive",
        alive: np.ndarray | None = None,
    ):
        self.placement = placement
        self.microbatches = int(microbatches)
        self.policy = policy
        mask = np.ones(placement.groups, bool) if alive is None else np.array(alive, dtype=bool)
        self._alive = mask
        self._load = reorder.max_load(placement, mask, self.microbatches, policy)
        self._ring = placement.rings is not None and not placement.duplicate_work
        if self._ring:
            rings = placement.rings
            self._ring_of = np.empty(placement.groups, np.int64)
            self._pos_of = np.empty(placement.groups, np.int64)
            self._ring_of[rings.ravel()] = np.repeat(np.arange(rings.shape[0]), rings.shape[1])
            self._pos_of[rings.ravel()] = np.tile(np.arange(rings.shape[1]), rings.shape[0])
            self._alive2d = mask[rings]
            if policy == "adaptive":
                self._carry = self._full_carry()

    @property
    def alive(self) -> np.ndarray:
        """Current live mask (a copy)."""
        return self._alive.copy()

    @property
    def max_load(self) -> int:
        return self._load

    def fail(self, group: int) -> int:
        """Mark `group` dead and return the new maximum load.

        Raises:
            reorder.Interruption: a shard lost its last live holder; the tracker is
                left with `group` dead.
            ValueError: `group` is out of range or already dead.
        """
        if not 0 <= group < self.placement.groups:
            raise ValueError(f"group must lie in [0, {self.placement.groups}), got {group}")
        if not self._alive[group]:
            raise ValueError(f"group {group} is already dead")
        self._alive[group] = False
        holders = self.placement.holders_table[self.placement.stacks[group]]
        lost = self.placement.stacks[group][~self._alive[holders].any(axis=1)]
        if lost.size:
            raise reorder.Interruption(lost)
        if not self._ring:
            self._load = reorder.max_load(
                self.placement, self._alive, self.microbatches, self.policy
            )
            return self._load
        ring, pos = self._ring_of[group], self._pos_of[group]
        self._alive2d[ring, pos] = False
        if self.policy == "fixed":
            self._load = max(self._load, self.microbatches * (1 + self._run_through(ring, pos)))
        else:
            self._update_carry(ring, pos)
        return self._load

    def _run_through(self, ring: int, pos: int) -> int:
        """Length of the dead run containing ring position `pos` (below r)."""
        n, r = self._alive2d.shape[1], self.placement.redundancy
        offsets = np.arange(-(r - 1), r)
        dead = ~self._alive2d[ring, (pos + offsets) % n]
        above = np.argmin(dead[r - 1 :]) if not dead[r - 1 :].all() else r
        below = np.argmin(dead[:r][::-1]) if not dead[:r].all() else r
        return int(above + below - 1)

    def _full_carry(self) -> np.ndarray:
        """Periodic carry leaving each ring position downward, int [rings, n]."""
        sweep = rings.carry(self._alive2d, self.microbatches, self._load)[:, 1:]
        return sweep[:, ::-1].copy()

    def _update_carry(self, ring: int, pos: int) -> None:
        m, r = self.microbatches, self.placement.redundancy
        n = self._alive2d.shape[1]
        alive, carry = self._alive2d[ring], self._carry[ring]
        incoming = carry[(pos + 1) % n]
        start, size, done = pos, _FIRST_CHUNK, 0
        while done < n:
            size = min(size, n - done)
            idx = (start - np.arange(size)) % n
            steps = m - np.where(alive[idx], self._load, 0)
            total = np.cumsum(steps)
            new = total - np.minimum(-incoming, np.minimum.accumulate(total))
            if new.max() > (r - 1) * m:
                self._resolve(start=self._load + 1)
                return
            merged = np.flatnonzero(new == carry[idx])
            if merged.size:
                stop = merged[0]
                carry[idx[:stop]] = new[:stop]
                return
            carry[idx] = new
            incoming, start, done, size = new[-1], (start - size) % n, done + size, 2 * size
        self._resolve(start=self._load)

    def _resolve(self, start: int) -> None:
        """Smallest feasible load from `start` up, with its carry.

        A load is feasible iff every ring's live capacity covers its work and
        the periodic sweep carry stays within (r - 1) m (see `reorder`); the
        load rarely grows by more than one per failure, so walking up one at a
        time costs one O(G) sweep per step.
        """
        m, r = self.microbatches, self.placement.redundancy
        n = self._alive2d.shape[1]
        live = self._alive2d.sum(axis=1)
        load = max(start, int(np.max(-(-n * m // live))))
        while True:
            self._load = load
            self._carry = self._full_carry()
            if self._carry.max() <= (r - 1) * m:
                return
            load += 1

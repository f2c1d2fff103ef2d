"""Failure times and the first interruption they cause, vectorised.

Everything here rests on one observation. With no repair, a shard is lost at
the moment its *last* live holder dies, so the run is interrupted at

    t_int = min over shards s of ( max over holders h of s of death_time[h] )

a min of maxes over the placement's holder table: one O(G r) vectorised pass,
no event loop. With death *ranks* (the order in which groups die) in place of
times, the same pass gives the number of failures to interruption. Under the
"live" convention (each failure strikes a uniformly random live group) the
death order is a uniformly random permutation, which iid uniform death times
produce directly, so no sort is needed either.

This module also holds the failure processes the run engine draws from:
`RandomFailures` (exponential or Weibull group lifetimes, optional whole-domain
failures) and `TraceFailures` (a replayed list of failure events). Both keep
one interface, on the *running* clock (restarts excluded):
`segment(start_s, horizon_s)` gives the failure events of the segment that
starts at `start_s` with every group alive, and `restart(end_s)` replaces the
groups dead when that segment is interrupted at `end_s`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from spare_jax import checks
from spare_jax.placement import Placement
from spare_jax.scenario import FAILURE_LAWS, WEIBULL_SHAPES, weibull_scale

__all__ = [
    "GroupClocks",
    "RandomFailures",
    "Segment",
    "TraceFailures",
    "draw_lifetimes",
    "interruption_threshold",
]


def interruption_threshold(p: Placement, death: np.ndarray) -> np.ndarray:
    """Min over shards of the max death value over the shard's holders.

    Args:
        p: the placement.
        death: float or int [..., G] death time (or rank) of every group; any
            leading batch axes are trials.

    Returns:
        [...] the value at which the first shard loses its last holder.
    """
    death = np.asarray(death)
    if death.ndim < 1 or death.shape[-1] != p.groups:
        raise ValueError(f"death must have shape [..., {p.groups}], got {death.shape}")
    r = p.redundancy
    if r == 1:
        return death.min(axis=-1)
    if p.duplicate_work and p.kind == "replication":  # sets of r consecutive groups
        window = death[..., 0::r].copy()
        for k in range(1, r):
            np.maximum(window, death[..., k::r], out=window)
        return window.min(axis=-1)
    if p.rings is not None:
        rings = p.rings
        single = rings.shape[0] == 1 and np.array_equal(rings[0], np.arange(p.groups))
        ring_death = death[..., None, :] if single else death[..., rings]
        n = ring_death.shape[-1]
        # Shard at ring position j is held by positions j-r+1 .. j (mod n).
        padded = np.concatenate([ring_death[..., n - (r - 1) :], ring_death], axis=-1)
        window = padded[..., r - 1 :].copy()
        for k in range(1, r):
            np.maximum(window, padded[..., r - 1 - k : r - 1 - k + n], out=window)
        return window.min(axis=(-2, -1))
    holders = p.holders_table
    window = death[..., holders[:, 0]].copy()
    for k in range(1, r):
        np.maximum(window, death[..., holders[:, k]], out=window)
    return window.min(axis=-1)


def draw_lifetimes(
    rng: np.random.Generator, law: str, mean: float, shape: float, size: int | tuple[int, ...]
) -> np.ndarray:
    """Iid group lifetimes (seconds) with the given mean.

    Args:
        rng: random generator.
        law: "exponential" or "weibull".
        mean: mean lifetime, seconds.
        shape: Weibull shape (ignored for the exponential law).
        size: output shape.
    """
    checks.number("mean", mean, low=0.0, low_open=True)
    if law == "exponential":
        return rng.exponential(mean, size)
    checks.choice("law", law, FAILURE_LAWS)
    return weibull_scale(mean, shape) * rng.weibull(shape, size)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Failure events of one stretch of running between two restarts.

    Times are seconds of running since the segment start (restarts excluded).

    Attributes:
        event_times: float [K] sorted times of the failure events up to the end
            of the segment (the interrupting event included, if any).
        event_sizes: int [K] live groups each event kills (a domain failure
            kills several at once).
        groups: int [sum(event_sizes)] the groups killed, event by event.
        interruption: time of the interrupting event, or inf if none happens
            before the horizon asked for.
    """

    event_times: np.ndarray
    event_sizes: np.ndarray
    groups: np.ndarray
    interruption: float


def _segment_from_deaths(
    death: np.ndarray, cause: np.ndarray, t_int: float, horizon: float
) -> Segment:
    """Events up to min(t_int, horizon) from per-group death times and causes.

    `cause` labels what killed each group (groups sharing a label and a time
    died in one event, e.g. one domain failure).
    """
    end = min(t_int, horizon)
    hit = np.flatnonzero(death <= end)
    order = np.lexsort((hit, cause[hit], death[hit]))
    groups = hit[order]
    times, labels = death[groups], cause[groups]
    if groups.size:
        new = np.ones(groups.size, bool)
        new[1:] = (times[1:] != times[:-1]) | (labels[1:] != labels[:-1])
        starts = np.flatnonzero(new)
        sizes = np.diff(np.append(starts, groups.size))
        event_times = times[starts]
    else:
        sizes = np.zeros(0, np.int64)
        event_times = np.zeros(0)
    return Segment(event_times, sizes, groups, t_int if t_int <= horizon else math.inf)


class GroupClocks:
    """The running-clock time of every group's next failure, and of every domain's.

    Lifetimes are exponential or Weibull of mean `mean_s`. Domain `d` (groups
    `d*domain_groups .. (d+1)*domain_groups - 1`) fails as a whole after an
    exponential time of rate `domain_failure_fraction * (groups in d) / mean_s`.
    The state both failure processes with a random law share (`RandomFailures`
    here, `hot.HotRepair`).
    """

    def __init__(
        self,
        groups: int,
        mean_s: float,
        *,
        law: str = "exponential",
        weibull_shape: float = 0.7,
        domain_groups: int = 0,
        domain_failure_fraction: float = 0.0,
        rng: np.random.Generator | None = None,
    ):
        checks.number("mean_s", mean_s, low=0.0, low_open=True)
        checks.choice("law", law, FAILURE_LAWS)
        checks.number("weibull_shape", weibull_shape, low=WEIBULL_SHAPES[0], high=WEIBULL_SHAPES[1])
        checks.integer("domain_groups", domain_groups, low=0)
        checks.number("domain_failure_fraction", domain_failure_fraction, low=0.0)
        self.groups = groups
        self.mean_s = float(mean_s)
        self.law = law
        self.shape = float(weibull_shape)
        self.rng = np.random.default_rng() if rng is None else rng
        self._next = self._draw(groups)
        self._domains = domain_groups > 0 and domain_failure_fraction > 0
        if self._domains:
            self._domain_of = np.arange(groups) // int(domain_groups)
            sizes = np.bincount(self._domain_of)
            self._domain_mean = self.mean_s / (domain_failure_fraction * sizes)
            self._domain_next = self.rng.exponential(self._domain_mean)

    def _draw(self, size: int) -> np.ndarray:
        return draw_lifetimes(self.rng, self.law, self.mean_s, self.shape, size)

    def _redraw_domains(self, fired: np.ndarray, now_s: float) -> None:
        """Domains `fired` fail next an exponential time after `now_s`."""
        self._domain_next[fired] = now_s + self.rng.exponential(self._domain_mean[fired])


class RandomFailures(GroupClocks):
    """Exponential or Weibull group lifetimes, plus optional whole-domain failures.

    The clock is the *running* clock: restarts do not age anything. Every group
    keeps an absolute time of its next failure; a group killed in a segment is
    replaced at the restart that ends it and draws a fresh lifetime from that
    moment; survivors keep theirs (exact for Weibull ageing, and equivalent to
    redrawing for the memoryless exponential). Domains as in `GroupClocks`.
    """

    def __init__(self, placement: Placement, mean_s: float, **kwargs: Any):
        """`placement`, the mean lifetime and `GroupClocks`'s keyword arguments."""
        super().__init__(placement.groups, mean_s, **kwargs)
        self.placement = placement

    def segment(self, start_s: float, horizon_s: float) -> Segment:
        """Events from running time `start_s` (all groups alive) up to the interruption.

        Args:
            start_s: running-clock time at which the segment starts.
            horizon_s: only events within this many seconds are needed.
        """
        death = self._next - start_s
        cause = np.full(self.groups, -1, np.int64)
        if self._domains:
            domain_death = self._domain_next[self._domain_of] - start_s
            by_domain = domain_death < death
            death = np.where(by_domain, domain_death, death)
            cause = np.where(by_domain, self._domain_of, -1)
        t_int = float(interruption_threshold(self.placement, death))
        return _segment_from_deaths(death, cause, t_int, horizon_s)

    def restart(self, end_s: float) -> None:
        """Replace every group dead at running time `end_s`, the interruption."""
        dead = np.flatnonzero(self._next <= end_s)
        if self._domains:
            fired = np.flatnonzero(self._domain_next <= end_s)
            if fired.size:
                dead = np.union1d(dead, np.flatnonzero(np.isin(self._domain_of, fired)))
                self._redraw_domains(fired, end_s)
        self._next[dead] = end_s + self._draw(dead.size)


class TraceFailures:
    """A replayed list of failure events: (wall-clock time, group).

    Times are wall-clock seconds since the run start; each restart costs
    `restart_s` of wall time, so a segment starting at running time `start_s`
    after n restarts starts at wall time `start_s + n restart_s`. An event
    during a restart is dropped (the restart replaces every failed group
    anyway); an event on a group already dead in the current segment changes
    nothing and is not counted. After the last event nothing fails.
    """

    def __init__(
        self, placement: Placement, times_s: np.ndarray, groups: np.ndarray, *, restart_s: float
    ):
        times = np.asarray(times_s)
        group_ids = np.asarray(groups)
        if times.ndim != 1 or group_ids.shape != times.shape:
            raise ValueError(
                f"trace times and groups must be 1-D arrays of equal length, got shapes "
                f"{times.shape} and {group_ids.shape}"
            )
        if times.size and (times.dtype == bool or not np.issubdtype(times.dtype, np.number)):
            raise ValueError(f"trace times must be numbers, got dtype {times.dtype}")
        if group_ids.size and (
            group_ids.dtype == bool or not np.issubdtype(group_ids.dtype, np.integer)
        ):
            raise ValueError(f"trace groups must be integer ids, got dtype {group_ids.dtype}")
        times = times.astype(float)
        if not np.all(np.isfinite(times)) or np.any(times < 0):
            raise ValueError("trace times must be finite and >= 0")
        if group_ids.size and (group_ids.min() < 0 or group_ids.max() >= placement.groups):
            raise ValueError(f"trace group ids must lie in [0, {placement.groups})")
        order = np.argsort(times, kind="stable")
        self.placement = placement
        self.times = times[order]
        self.group_ids = group_ids.astype(np.int64)[order]
        self.restart_s = checks.number("restart_s", restart_s, low=0.0)
        self._restarts = 0

    def segment(self, start_s: float, horizon_s: float) -> Segment:
        """Events of the segment starting at running time `start_s` (all groups alive)."""
        wall_s = start_s + self._restarts * self.restart_s
        first = np.searchsorted(self.times, wall_s, side="left")
        last = np.searchsorted(self.times, wall_s + horizon_s, side="right")
        death = np.full(self.placement.groups, math.inf)
        np.minimum.at(death, self.group_ids[first:last], self.times[first:last] - wall_s)
        t_int = float(interruption_threshold(self.placement, death))
        cause = np.full(self.placement.groups, -1, np.int64)
        cause[np.isfinite(death)] = np.flatnonzero(np.isfinite(death))
        return _segment_from_deaths(death, cause, t_int, horizon_s)

    def restart(self, end_s: float) -> None:
        """Count the restart (it shifts the wall clock); the trace decides who fails next."""
        del end_s  # the trace is indexed by wall time, which only the restart count shifts
        self._restarts += 1

"""Stragglers absorbed by SPARe's redundancy: `Balancing`, a part of `spare_jax.trainer.Trainer`.

A slow group (a throttled GPU, a noisy neighbour) makes every synchronous
step wait for it. SPARe gives every shard ``r`` holders, so a slow group is
treated as a group that is partly alive: the speed-aware assignment
(`reorder.assign_by_speed`) moves some of its micro-batches to the
neighbours that hold the same shards, each micro-batch still computed once
(the gradient stays exact), and a group walks only the slots it was given.

In a multi-process job (``fit(..., balance=True)``):

1. Each process times its own part of every step: the step's seconds less
   the time it waited for its peers, in the cross-group reduction (from its
   gradients being ready, `SpareStep.reduce` with ``timed=True``, to the sums
   being ready, less the next step's input read meanwhile) and at the exit
   of the step's live-set block (a barrier of the live processes). Its throughput is
   the slots its busiest group walked over those seconds, summed over a
   window of `SpeedTracker.window` steps. A fixed cost per step (the update,
   host work) is thus counted at the process's own pace: a worker slowed as
   a whole is given fewer micro-batches until the own times are even, which
   is what the step waits for.
2. At the end of each window the live processes share their throughputs in
   one tiny collective (`share`, inside the step's live-set block), so every
   process holds the same figures.
3. `SpeedTracker` smooths them and decides, the same way on every process,
   whether the speed-aware table shortens the step by more than
   ``threshold`` against the table in force (no change on noise). A
   ``straggler`` event names the slowest group, its relative speed and the
   new max load; ``balanced`` says equal speeds are back.

Speeds are relative (the fastest live group is 1) and rounded to
``quantum``. Any change of the live set (a loss, a re-join) starts the
tracker afresh on every process, with equal speeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spare_jax import checks, errors, multihost, reorder
from spare_jax.placement import Placement

__all__ = ["Balancing", "SpeedTracker", "share"]


@dataclasses.dataclass
class SpeedTracker:
    """Smoothed group throughputs and the speeds the step should assume (pure, host-side).

    Attributes:
        groups: G.
        window: steps between shares.
        smoothing: weight of the newest share in the running mean.
        threshold: adopt new speeds only when the predicted step is shorter by
            more than this fraction.
        quantum: speeds are rounded to multiples of this (and floored at it).
    """

    groups: int
    window: int = 5
    smoothing: float = 0.5
    threshold: float = 0.15
    quantum: float = 1 / 16
    rates: np.ndarray | None = None  # slots per second per group; nan: never measured

    def __post_init__(self) -> None:
        checks.integer("groups", self.groups, low=1)
        checks.integer("window", self.window, low=1)
        for name in ("smoothing", "threshold", "quantum"):
            value = getattr(self, name)
            if not (isinstance(value, float | int) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")

    def observe(self, rates: np.ndarray) -> None:
        """Fold in one share: ``rates[g]`` slots per second, 0 where group g has no figure."""
        new = np.where(np.asarray(rates, np.float64) > 0, rates, np.nan)
        if new.shape != (self.groups,):
            raise ValueError(f"rates must have shape ({self.groups},), got {new.shape}")
        if self.rates is None:
            self.rates = new
            return
        mixed = (1 - self.smoothing) * self.rates + self.smoothing * new
        self.rates = np.where(np.isnan(new), self.rates, np.where(np.isnan(self.rates), new, mixed))

    def relative(self, alive: np.ndarray) -> np.ndarray | None:
        """Rounded relative speeds (fastest live group 1, unmeasured 1, dead 0); None: no data."""
        if self.rates is None:
            return None
        live = np.asarray(alive, bool) & np.isfinite(self.rates)
        if not live.any():
            return None
        speeds = np.where(live, self.rates / self.rates[live].max(), 1.0)
        speeds = np.maximum(np.round(speeds / self.quantum) * self.quantum, self.quantum)
        return np.where(alive, speeds, 0.0)

    def choose(
        self,
        placement: Placement,
        alive: np.ndarray,
        microbatches: int,
        walked: np.ndarray,
        current: np.ndarray | None,
    ) -> np.ndarray | None:
        """The speeds the next steps should assume (None: equal), given the table in force.

        ``walked``: each group's slots in the table in force. The measured
        speeds replace ``current`` when the speed-aware makespan beats the
        table in force, at the measured speeds, by more than ``threshold``.
        """
        speeds = self.relative(alive)
        if speeds is None:
            return current
        busy = np.asarray(alive, bool) & (walked > 0)
        if not busy.any():
            return current
        now = float(np.max(walked[busy] / speeds[busy]))
        best = reorder.makespan(placement, speeds, microbatches)
        if best >= (1 - self.threshold) * now:
            return current
        return None if np.all(speeds[np.asarray(alive, bool)] == 1.0) else speeds


@jax.jit
def _max_rows(rows: jax.Array) -> jax.Array:
    return rows.max(axis=0)


def share(mesh: Mesh, mine: np.ndarray) -> np.ndarray:
    """Every process's figures, merged: the maximum over the mesh's processes of ``mine``.

    Each process passes a vector with its own groups' entries (0 elsewhere);
    every process of ``mesh`` calls this at the same step. One tiny collective.
    """
    values = np.asarray(mine, np.float32)
    flat = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
    rows = jax.make_array_from_callback(
        (mesh.devices.size, values.size), flat, lambda index: values[None, :]
    )
    merged = _max_rows(rows)
    return np.asarray(merged.addressable_shards[0].data, np.float64)


class Balancing:
    """Speed-aware tables for a multi-process `Trainer` (its state: the attributes below).

    Reads ``self.step``, ``self.failures``, ``self.t``, ``self.log`` and
    ``self._prefetch_s`` (the seconds of the latest input read); keeps
    ``_tracker`` (None: balancing off), ``_speeds``, ``_window`` (slots and
    own seconds this process measured since the last share), ``_barrier_s``
    (how long the latest live-set block's exit waited), ``_waited`` (the
    current step's wait for its peers; None: not to be counted) and
    ``_balanced_for`` (the step the tracker's figures belong to).
    """

    def _table(self) -> tuple[Any, int]:
        """The step's slot table for the live set, at the speeds in force."""
        if self._tracker is not None and self._balanced_for is not self.step:
            # A new live set (a loss, a re-join): every process starts afresh, alike.
            self._tracker = dataclasses.replace(self._tracker, rates=None)
            self._speeds, self._window, self._balanced_for = None, [0.0, 0.0], self.step
            self._waited = None
        return self.step.table(self.failures.alive.copy(), self._speeds)

    @contextlib.contextmanager
    def _barrier_timed(self, block: Any) -> Iterator[Any]:
        """``block`` (the step's live-set block), keeping how long its exit waited for peers."""
        with block as live:
            yield live
            start = time.perf_counter()
        self._barrier_s = time.perf_counter() - start

    def _balance(self, fresh: bool) -> None:
        """After step ``t``'s reduction (inside the live-set block): its wait, and a share."""
        if self._tracker is None or self.step.domain is None:
            return
        ready = self.step.computed_at
        if fresh or ready is None:
            self._waited = None
        else:
            self._waited = max(time.perf_counter() - ready - self._prefetch_s, 0.0)
        if (self.t + 1) % self._tracker.window:
            return
        mine = np.zeros(self.step.groups)
        if self._window[1] > 0:
            mine[self.step.domain.rows] = self._window[0] / self._window[1]
        self._window = [0.0, 0.0]
        self._tracker.observe(share(self.step.mesh, mine))
        alive = self.failures.alive.copy()
        walked = self.step.walked.copy()
        speeds = self._tracker.choose(
            self.step.placement, alive, self.step.microbatches, walked, self._speeds
        )
        if speeds is self._speeds:
            return
        self._speeds, self._waited = speeds, None  # step t ran the old table: not counted
        if speeds is None:
            self.log.event("balanced", step=self.t + 1)
            return
        _, load = self.step.table(alive, speeds)
        slow = int(np.argmin(np.where(alive, speeds, math.inf)))
        self.log.event(
            "straggler",
            step=self.t + 1,
            group=slow,
            speed=float(speeds[slow]),
            speeds=[round(float(s), 4) for s in speeds],
            max_load=int(load),
            walked_before=walked.tolist(),
            walked_after=self.step.walked.tolist(),
        )

    def _busy(self, step_s: float) -> None:
        """Step ``t`` took ``step_s``: add its own part (less its waits) to the window."""
        if self._tracker is None or self._waited is None or self.step.domain is None:
            return
        busiest = int(self.step.walked[self.step.domain.rows].max())
        own = step_s - self._waited - self._barrier_s
        if busiest > 0 and own > 0:
            self._window[0] += busiest
            self._window[1] += own
        self._waited = None

    def _update(self, sums: tuple[Any, ...], table: Any) -> tuple[Any, dict[str, Any]]:
        """Apply a completed reduction to this process's replica (multi-process jobs).

        No other group takes part in the update; a non-finite sum is not applied.
        """
        grad_sum, loss_sum, finite = sums
        if not bool(np.asarray(finite.addressable_shards[0].data)):
            return self.state, {"loss": math.nan, "grad_norm": math.nan, "finite": False}
        try:
            state, metrics = self.step.update(self.state, grad_sum, loss_sum, table)
            jax.block_until_ready(state)
        except jax.errors.JaxRuntimeError as err:  # the state was donated: it is gone
            if self.spanning:  # a collective in the group failed: the group is lost, not the job
                self._leave_group(
                    multihost.groups_touching(self.owners, [jax.process_index()]).tolist(),
                    f"the optimizer update of step {self.t} failed inside the group "
                    f"({str(err).splitlines()[0][:160]}), whose state it took",
                )
            raise errors.Relaunch(
                f"step {self.t}: the optimizer update failed after the reduction "
                f"({str(err).splitlines()[0][:160]}); a fresh job resumes from the checkpoint"
            ) from None
        return state, {**metrics, "finite": True}

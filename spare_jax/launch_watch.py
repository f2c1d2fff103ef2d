"""What the launcher makes of its workers' reports: hung workers, deaths and repeated crashes.

Pure bookkeeping, no processes: `spare_jax.launch` feeds it the lines and
exit statuses it sees and acts on the answers.

* `Watch` evicts a worker that stopped while alive. Each worker reports where
  it is (`spare_jax.runlog.at`): in step ``t`` building its batch (``data``),
  running the step with its peers (``step``), agreeing on the live set after a
  failed collective or after its part of the step (``sync``), or busy
  (checkpoint, restore, compile, join, finish). A worker is stuck when another
  has waited inside a step (``step`` or ``sync``) for longer than the bound
  while it has stood still, not busy, at the rearmost position of all (an
  earlier step, the same step not yet entered, or not yet left): its peers
  cannot finish that step without it. The bound is
  ``max(floor_s, steps x the median step time)`` the workers report; for a
  worker inside the step, at least the CPU collective timeout after a typical
  step plus 5 s (`Watch.inside`): a peer that left a collective on an error
  (a dead process's) leaves the others waiting in it until it times out, and
  they then reach the live-set check by themselves. A
  busy worker is making progress and is never evicted; a worker whose peers
  all stand still too (every process in the same place) is not told apart
  from a slow step, and is left to the launcher's ``--hang_timeout_s``.
* `Tail` keeps, from a worker's output, the first and last exception lines
  of its Python tracebacks, for its death line.
* `death_line` says why a worker died, in one line; `Signature` is what two
  deaths of the same worker must share to count as the same failure.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import statistics
from collections.abc import Iterable

from spare_jax.runlog import BUSY_PHASES, STEP_PHASES

__all__ = ["Position", "Signature", "Tail", "Watch", "death_line", "status_name"]

_RANK = {phase: i for i, phase in enumerate(STEP_PHASES)}
_WAITING = ("step", "sync")
_REPORT_S = 5.0  # a worker freed from a collective says so within this (a loaded machine)
_WHERE = {
    "data": "building the batch of step {}",
    "step": "inside step {}",
    "sync": "agreeing on the live set after step {}",
}


@dataclasses.dataclass
class Position:
    """Where a worker said it is, and since when (the launcher's clock)."""

    step: int
    phase: str
    since: float
    step_s: float = 0.0

    @property
    def busy(self) -> bool:
        return self.phase in BUSY_PHASES

    @property
    def key(self) -> tuple[int, int]:
        return self.step, _RANK.get(self.phase, -1)


class Watch:
    """The workers' positions and the eviction rule (see the module docstring).

    Args:
        floor_s: the bound's floor in seconds; 0 turns eviction off.
        steps: the bound in median steps, when that is longer.
        collective_s: the CPU collective timeout: how long a worker may wait
            inside a collective that a peer has left.
    """

    def __init__(self, floor_s: float, steps: float = 10.0, collective_s: float = 0.0):
        self.floor_s, self.steps = float(floor_s), float(steps)
        self.collective_s = float(collective_s)
        self.positions: dict[int, Position] = {}

    def seen(self, index: int, step: int, phase: str, step_s: float, now: float) -> None:
        """A worker's report: a new position restarts its clock."""
        old = self.positions.get(index)
        if old is not None and (old.step, old.phase) == (step, phase):
            old.step_s = step_s or old.step_s
            return
        self.positions[index] = Position(int(step), phase, now, float(step_s or 0.0))

    def forget(self, index: int) -> None:
        """A worker gone (dead, evicted, finished): it neither waits nor holds anyone up."""
        self.positions.pop(index, None)

    def _typical(self) -> float:
        times = [p.step_s for p in self.positions.values() if p.step_s > 0]
        return statistics.median(times) if times else 0.0

    def bound(self) -> float:
        """Seconds a worker may stand still behind peers waiting for it."""
        return max(self.floor_s, self.steps * self._typical())

    def inside(self) -> float:
        """Seconds a worker may stand still inside the step: the bound, or its collective's
        timeout after a typical step's compute (plus 5 s to report), when that is longer."""
        return max(self.bound(), self.collective_s + self._typical() + _REPORT_S)

    def stuck(self, now: float, live: Iterable[int]) -> list[tuple[int, str]]:
        """Workers to evict now, each with the reason in words; [] when eviction is off."""
        if self.floor_s <= 0:
            return []
        bound = self.bound()
        mine = {i: self.positions[i] for i in live if i in self.positions}
        waiting = [p for p in mine.values() if p.phase in _WAITING and now - p.since >= bound]
        if not waiting:
            return []
        front = max(waiting, key=lambda p: p.key)
        # Only the rearmost: a worker waiting in the step behind a hung one is held up too.
        rear = min((p.key for p in mine.values() if not p.busy), default=front.key)
        out = []
        for i, p in sorted(mine.items()):
            own = self.inside() if p.phase == "step" else bound
            if p.busy or p.key != rear or rear >= front.key or now - p.since < own:
                continue
            where = _WHERE.get(p.phase, "at step {} (" + p.phase + ")").format(p.step)
            reason = (
                f"no progress for {now - p.since:.0f} s {where} while its peers waited for it "
                f"in step {front.step} for {now - front.since:.0f} s (bound {own:.0f} s)"
            )
            out.append((i, reason))
        return out


# The last line of a Python traceback ("ValueError: ...", "jax.errors.X: ...").
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure))(: .*)?$")
_TRACEBACK = "Traceback (most recent call last):"
_COLLECTIVE = re.compile(r"Gloo|NCCL|collective|DEADLINE_EXCEEDED|UNAVAILABLE", re.IGNORECASE)


class Tail:
    """The error lines of one worker's output: the first and the last exception line."""

    def __init__(self) -> None:
        self.in_traceback = False
        self.first = ""
        self.last = ""

    def feed(self, line: str) -> None:
        text = line.rstrip()
        if text.startswith(_TRACEBACK):
            self.in_traceback = True
            return
        if not self.in_traceback or not text or text[0].isspace():
            return
        if _EXCEPTION.match(text):
            self.in_traceback = False
            self.last = text[:300]
            self.first = self.first or self.last


def status_name(code: int) -> str:
    """``status 1`` or ``SIGSEGV`` (a negative Popen status is the signal that ended it)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def death_line(index: int, code: int, cause: str, error: str, log_path: str) -> str:
    """One line: the worker, how it ended, why when known, its last error, its full log."""
    how = f"killed by {status_name(code)}" if code < 0 else f"exited with {status_name(code)}"
    parts = [f"worker {index} {how}"]
    if cause:
        parts.append(cause)
    if error:
        parts.append(error)
    return f"{'; '.join(parts)}; log: {log_path}"


@dataclasses.dataclass(frozen=True)
class Signature:
    """A worker's death as far as telling a repeat goes: its status, error and step."""

    code: int
    error: str
    step: int  # the last step it reported entering; -1 before its first

    def same_as(self, other: Signature | None) -> bool:
        """The same failure: the same status and error line, at the same step (or both before
        the first)."""
        if other is None or (self.code, self.error) != (other.code, other.error):
            return False
        if _COLLECTIVE.search(self.error):  # a peer slow or gone: the machines, not the script
            return False
        return self.step == other.step

"""A run's records: ``metrics.jsonl`` (append-only) and ``summary.json``, and the goodput.

``WORKDIR/metrics.jsonl`` holds one JSON object per line and is only ever
appended to: a rerun, a resume or a rollback adds records, never removes one.
Per-step records carry ``step``, ``loss``, ``live_groups``, ``max_load``,
``step_time_s`` and ``attempt`` (0, then +1 at each resume or rollback: a
reader keeps the last record of each step). Event records carry an ``event``
key: ``checkpoint`` (``step``, ``save_s`` the stall, ``write_s`` until all
its files were written), ``failure`` (``step``, ``groups``), ``rejoin``
(``step``, ``groups``), ``rollback`` (``from_step``, ``to_step``,
``lost_steps``, ``restore_s``), ``resume`` (``step``), ``preempted``
(``step``, ``save_s``), and, with real processes, ``process_failure``
(``process``, ``groups``, ``detect_s``, ``rebuild_s``, ``compile_s``),
``recovered`` (``recovery_s`` from the loss to the first step without it)
and ``relaunch`` (``to_step``, ``lost_steps``, ``relaunch_s``).

Two kinds of line leave a worker for its launcher: `notice` (stderr, for
the person running the job: a fall-back past a damaged checkpoint, a process
declared dead) and `emit` (stdout, one JSON object the launcher acts on:
``hello``, ``dead``, ``progress``, ``resumed``, ``kill_point``, and ``at``: where
the worker is, set by `at` and sent by a reporter thread, which the launcher
uses to evict a worker that stopped while its peers wait for it).

Files are opened without following symbolic links, so a record is never
written outside the work directory, and ``summary.json`` is replaced
atomically.

`goodput` derives the time budget from the records alone, so it survives a
killed process: the last record of each step is useful work (split into
compute at the failure-free load and reordering overhead beyond it), every
earlier record of the same step is lost work, and the checkpoint, rollback,
resume, recovered and relaunch events give the stalls and the recovery time.
"""

from __future__ import annotations

import atexit
import collections
import errno
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from spare_jax import errors

__all__ = ["EVENT", "NOTICE", "RunLog", "at", "emit", "goodput", "notice", "read_records"]

_HELD = 64  # step records a non-writer keeps, to fill in after a dead writer
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)


def _storage_error(path: str, err: OSError) -> errors.StorageError:
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    where = os.path.dirname(os.path.abspath(path))
    if full:
        return errors.StorageError(
            f"the disk holding {where} is full: cannot append to {path} ({err.strerror}); "
            "the newest intact checkpoint is kept; free some space and rerun the same command "
            "to resume",
            disk_full=True,
        )
    return errors.StorageError(f"cannot write {path}: {err.strerror}", disk_full=False)


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file (empty if it does not exist; a torn last line is skipped)."""
    if not os.path.lexists(path):
        return []
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; refusing to read through it")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
    return records


class RunLog:
    """Appends records to ``WORKDIR/metrics.jsonl`` and writes ``WORKDIR/summary.json``."""

    def __init__(self, workdir: str, *, writer: bool = True):
        self.workdir = workdir
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.summary_path = os.path.join(workdir, "summary.json")
        self.previous = read_records(self.metrics_path)
        self._fd: int | None = None
        self._held: collections.deque[dict[str, Any]] = collections.deque(maxlen=_HELD)
        if writer:
            self.become_writer()

    @property
    def writer(self) -> bool:
        """Whether this process writes (one process of a multi-process job does)."""
        return self._fd is not None

    def become_writer(self) -> None:
        """Open the metrics file for appending (once; a no-op for the writer).

        A process taking over from a dead writer first appends the step records
        it holds that the dead one never wrote (it may have died between a
        step and its record), so that no step goes missing.
        """
        if self._fd is not None:
            return
        missing = self._unwritten()
        try:
            self._fd = os.open(self.metrics_path, _FLAGS, 0o644)
            with open(self.metrics_path, "rb") as f:  # a line cut short by a kill ends here
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        os.write(self._fd, b"\n")
        except OSError as err:
            raise _storage_error(self.metrics_path, err) from None
        for record in missing:
            self.write(record)
        self._held.clear()

    def _unwritten(self) -> list[dict[str, Any]]:
        """Held step records of this run that are not on file, in order."""
        if not self._held:
            return []
        on_file = {
            (r["step"], r.get("attempt"))
            for r in read_records(self.metrics_path)
            if "event" not in r and "step" in r
        }
        return [r for r in self._held if (r["step"], r.get("attempt")) not in on_file]

    @property
    def next_attempt(self) -> int:
        """0 for a new run, else one more than the last attempt on record."""
        attempts = [r["attempt"] for r in self.previous if "attempt" in r]
        return max(attempts) + 1 if attempts else 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (one line, handed to the OS at once); only the writer writes.

        Raises:
            errors.StorageError: the line could not be written (a full disk named as such).
        """
        if self._fd is None:
            if "event" not in record and "step" in record:
                self._held.append(record)  # in case this process has to take over
            return
        try:
            os.write(self._fd, (json.dumps(record, allow_nan=False) + "\n").encode())
        except OSError as err:
            raise _storage_error(self.metrics_path, err) from None

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        """Append an event record ``{"event": name, ...}`` and return it."""
        record = {"event": name, **fields}
        self.write(record)
        return record

    def records(self) -> list[dict[str, Any]]:
        """Every record on file, this run's included."""
        return read_records(self.metrics_path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Replace ``summary.json`` atomically (a temporary file in the work directory)."""
        if self._fd is None:
            return
        tmp = os.path.join(self.workdir, f".summary.json.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2, allow_nan=False)
                f.write("\n")
            os.replace(tmp, self.summary_path)
        except OSError as err:
            raise _storage_error(self.summary_path, err) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def goodput(records: Iterable[dict[str, Any]], microbatches: int) -> dict[str, float]:
    """Seconds spent in useful compute, reordering, checkpoint stalls, recovery and lost work.

    Args:
        records: a run's metrics records, in file order.
        microbatches: m, the failure-free load; time beyond it is reordering overhead.

    Returns:
        ``useful_s``, ``reordering_s``, ``checkpoint_s``, ``recovery_s``, ``lost_s``
        and their sum ``total_s``.
    """
    records = list(records)
    relaunched = {r.get("attempt") for r in records if r.get("event") == "relaunch"}
    last: dict[int, dict[str, Any]] = {}
    lost = checkpoint = recovery = 0.0
    for r in records:
        event = r.get("event")
        if event is None and "step" in r:
            if r["step"] in last:
                lost += last[r["step"]]["step_time_s"]
            last[r["step"]] = r
        elif event == "checkpoint":
            checkpoint += r.get("save_s", 0.0)
        elif event == "rollback" or (event == "resume" and r.get("attempt") not in relaunched):
            recovery += r.get("restore_s", 0.0)
        elif event == "recovered":
            recovery += r["recovery_s"]
        elif event == "relaunch":  # its time includes the new job's restore
            recovery += r["relaunch_s"]
    useful = reordering = 0.0
    for r in last.values():
        share = min(1.0, microbatches / max(r["max_load"], 1))
        useful += r["step_time_s"] * share
        reordering += r["step_time_s"] * (1.0 - share)
    out = {
        "useful_s": useful,
        "reordering_s": reordering,
        "checkpoint_s": checkpoint,
        "recovery_s": recovery,
        "lost_s": lost,
    }
    out = {k: round(v, 6) if math.isfinite(v) else 0.0 for k, v in out.items()}
    out["total_s"] = round(sum(out.values()), 6)
    return out


NOTICE = "spare-jax: "  # a line for the person running the job (a launcher relays it)
EVENT = "spare-jax-event: "  # a line for the launcher: one JSON object


def notice(message: str) -> None:
    """Tell the person running the job, on one stderr line that a launcher relays."""
    sys.stderr.write(f"{NOTICE}{' '.join(message.split())}\n")
    sys.stderr.flush()


_EMIT_LOCK = threading.Lock()


def emit(kind: str, **fields: Any) -> None:
    """Tell the launcher (when there is one) something it acts on: one JSON line on stdout."""
    if os.environ.get("SPARE_JAX_LAUNCH_DIR"):
        line = f"{EVENT}{json.dumps({'kind': kind, **fields})}\n"
        with _EMIT_LOCK:  # the position reporter writes from its own thread
            sys.stdout.write(line)
            sys.stdout.flush()


# Where a worker is, for the launcher's watch on hung workers (`spare_jax.launch_watch`).
# Within step t: building its batch, running it with the peers, agreeing on the live set
# after a failed collective. The busy phases are progress: a worker in one is never evicted.
STEP_PHASES = ("data", "step", "sync")
BUSY_PHASES = ("checkpoint", "restore", "compile", "join", "finish")
_REPORT_S = 0.5  # how often the reporter looks at the position
# A busy phase is said again this often: a compile or a restore of a large model takes
# minutes, and the launcher's no-progress watches count what it hears as progress.
_BUSY_REPEAT_S = 10.0


class _Position:
    """The position the main thread last set and the one the launcher last heard of."""

    def __init__(self) -> None:
        self.now: tuple[int, str] | None = None
        self.step_s = 0.0
        self.sent: tuple[int, str] | None = None
        self.sent_s = 0.0  # time.monotonic() of the last send
        self.thread: threading.Thread | None = None


_POSITION = _Position()


def at(step: int, phase: str, *, step_s: float | None = None) -> None:
    """Say where this worker is: step ``step``, ``phase`` (`STEP_PHASES` or `BUSY_PHASES`).

    Cheap (no I/O) for the step phases: a reporter thread sends a change
    within half a second, so a worker that stops anywhere is seen where it
    stopped, even when its main thread never returns. A busy phase is sent at
    once, before the long work starts. ``step_s``: the typical step time so far.
    """
    if not os.environ.get("SPARE_JAX_LAUNCH_DIR"):
        return
    if step_s is not None:
        _POSITION.step_s = step_s
    _POSITION.now = (int(step), phase)
    if phase in BUSY_PHASES:
        _send()
    if _POSITION.thread is None:
        _POSITION.thread = threading.Thread(target=_report, name="spare-jax-position", daemon=True)
        _POSITION.thread.start()
        atexit.register(_send)  # a worker that fails says where, however soon after a change


def _send(again: bool = False) -> None:
    now = _POSITION.now
    if now is None or (now == _POSITION.sent and not again):
        return
    _POSITION.sent, _POSITION.sent_s = now, time.monotonic()
    emit("at", step=now[0], phase=now[1], step_s=round(_POSITION.step_s, 6))


def evict_marker(launch_dir: str, host: str, pid: int) -> str:
    """The file by which a launcher on another node evicts a worker (SLURM: no pid to kill)."""
    return os.path.join(launch_dir, f"evict-{host}-{pid}")


def _report() -> None:
    """The reporter thread: send the position whenever it changed, a busy one every
    `_BUSY_REPEAT_S` too; leave when evicted."""
    marker = evict_marker(
        os.environ.get("SPARE_JAX_LAUNCH_DIR", ""), socket.gethostname(), os.getpid()
    )
    while True:
        time.sleep(_REPORT_S)
        now = _POSITION.now
        busy = now is not None and now[1] in BUSY_PHASES
        _send(again=busy and time.monotonic() - _POSITION.sent_s >= _BUSY_REPEAT_S)
        if os.path.exists(marker):  # the launcher evicted us and cannot reach our pid
            os.kill(os.getpid(), signal.SIGKILL)

"""Warm spares: workers started ahead of need, each waiting to take a dead worker's place.

A replacement started from nothing spends seconds on Python and on the
script's imports (JAX among them) before it can join. A spare has done that
already: it runs the user's command up to ``spare_jax.initialize()`` and waits
there on stdin (`spare_jax.multihost.initialize_job`). When the launcher
replaces a dead worker (``--replace_after_s``), it hands the spare that
worker's variables (its process id, the re-join's number, the start time) as
one JSON line; the spare joins the running job as the replacement would, and
the pool starts a new spare behind it. Until it is given a place, a spare's
output goes to ``spare-<n>.log`` in the launch directory; from then on, to the
worker's own log. The local scheduler only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any

from spare_jax import multihost
from spare_jax.launch_worker import Worker, popen, say

__all__ = ["Spare", "Spares"]


@dataclasses.dataclass
class Spare:
    """One waiting process; ``worker`` once it has taken a dead worker's place."""

    number: int
    proc: subprocess.Popen
    log_path: str
    worker: Worker | None = None
    watcher: threading.Thread | None = None


class Spares:
    """Keep ``count`` spares waiting; `take` gives one a dead worker's place."""

    def __init__(
        self,
        count: int,
        command: Sequence[str],
        env: dict[str, str],
        log_dir: str,
        on_line: Callable[[Worker, str, dict[int, Any]], None],
        on_closed: Callable[[dict[int, Any]], None],
    ):
        self.count, self.command, self.log_dir = count, list(command), log_dir
        self.env = {**env, multihost.ENV["spare"]: "1"}
        self._on_line, self._on_closed = on_line, on_closed
        self._waiting: list[Spare] = []
        self._started = 0
        self._lock = threading.Lock()
        self.fill()

    def fill(self) -> None:
        """Start spares until ``count`` are waiting (a dead one is replaced)."""
        with self._lock:
            self._waiting = [s for s in self._waiting if s.proc.poll() is None]
            while len(self._waiting) < self.count:
                self._started += 1
                path = os.path.join(self.log_dir, f"spare-{self._started}.log")
                spare = Spare(self._started, popen(self.command, self.env, stdin=True), path)
                spare.watcher = threading.Thread(target=self._watch, args=(spare,), daemon=True)
                spare.watcher.start()
                self._waiting.append(spare)

    def take(self, worker: Worker, env: dict[str, str]) -> bool:
        """Give a waiting spare ``worker``'s place, with these variables; False if none waits."""
        with self._lock:
            alive = [s for s in self._waiting if s.proc.poll() is None]
            if not alive:
                return False
            spare = alive[0]
            self._waiting = alive[1:]
        worker.proc, worker.watcher, spare.worker = spare.proc, spare.watcher, worker
        try:
            spare.proc.stdin.write(json.dumps(env) + "\n")
            spare.proc.stdin.close()
        except OSError:  # it died meanwhile: the worker reads as gone, and is replaced again
            pass
        say(f"spare {spare.number} takes worker {worker.index}'s place")
        self.fill()
        return True

    def kill(self) -> None:
        """SIGKILL every spare still waiting (those that took a place are workers now)."""
        with self._lock:
            waiting, self._waiting, self.count = self._waiting, [], 0
        for spare in waiting:
            try:
                spare.proc.send_signal(signal.SIGKILL)
            except (ProcessLookupError, OSError):
                pass
        for spare in waiting:
            try:
                spare.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _watch(self, spare: Spare) -> None:
        """A spare's output: its own log while it waits, then its worker's (events acted on)."""
        logs: dict[int, Any] = {}
        own = None
        for line in spare.proc.stdout:
            if spare.worker is not None:
                self._on_line(spare.worker, line, logs)
                continue
            try:
                own = own or open(spare.log_path, "a", encoding="utf-8")  # noqa: SIM115
                own.write(line)
                own.flush()
            except OSError:
                pass
        if own is not None:
            own.close()
        self._on_closed(logs)
        if spare.worker is None and self.count:  # not killed by us: it never waited
            spare.proc.wait()
            with self._lock:
                self.count = 0  # no more: the next would do the same
            say(
                f"spare {spare.number} ended (status {spare.proc.returncode}) before it was "
                f"needed; log: {spare.log_path}; no more spares: a replacement starts afresh "
                "(does the script call spare_jax.initialize() first?)"
            )

"""A launched job's settings and its workers: what the launcher knows of each process.

`Options` are the launcher's flags; a `Worker` is one process (here, or a
task of an ``srun`` step) with its log, its exit status, whether the job lost
it on purpose or declared it dead, and what its output said last.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from spare_jax import errors, multihost, runlog
from spare_jax import launch_watch as watch_lib

__all__ = ["NOT_A_VERDICT", "Options", "Worker", "free_port", "popen", "say"]

# Statuses that are not a worker's verdict on the run: done, try again, a
# crash (1 or a signal), a worker the job had already declared dead. Any other
# positive status is a verdict, also from a worker declared dead as it left (a
# writer that found the disk full exits 5 and its peers miss it at once).
NOT_A_VERDICT = {
    0,
    1,
    errors.EXIT_RELAUNCH,
    errors.EXIT_PREEMPTED,
    multihost.EXIT_DECLARED_DEAD,
    errors.EXIT_GROUP_LOST,  # its group lost another process: masked with the group
}


@dataclasses.dataclass(frozen=True)
class Options:
    """How to run the job (the flags, for callers that are not this module's main)."""

    processes: int
    devices_per_process: int | None = None
    kills: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> step
    max_relaunches: int = 10
    hang_timeout_s: float = 300.0
    heartbeat_s: int = 3
    collective_timeout_s: int = 2
    grace_s: float = 30.0
    verdict_s: float = 10.0  # after one worker's verdict, the others' time to reach it and say so
    log_dir: str = ""  # "": the job's own (`spare_jax.launch.default_launch_dir`)
    preempt_s: float = 60.0  # after SIGTERM, how long the workers have to save and leave
    scheduler: str = "local"  # "local": K processes here; "slurm": one srun step of K tasks
    srun_args: tuple[str, ...] = ()  # more srun options (e.g. --gpus-per-task=1)
    replace_after_s: float | None = None  # start a replacement this long after a loss (re-join)
    spares: int = 0  # warm spares kept waiting for a replacement's place (local scheduler)
    evict_after_s: float = 30.0  # the eviction bound's floor (0: no eviction)
    evict_steps: float = 10.0  # the eviction bound in median steps, when longer


def free_port() -> int:
    """A TCP port free on this machine now (for a new coordination service)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def say(message: str) -> None:
    sys.stderr.write(f"launch: {message}\n")
    sys.stderr.flush()


@dataclasses.dataclass
class Worker:
    """One worker process and what the launcher knows of it.

    Locally the launcher holds its process; under SLURM the worker is a task
    of one ``srun`` step: its pid comes from its ``hello`` event and its exit
    status from srun's report.
    """

    index: int
    log_path: str
    proc: subprocess.Popen | None = None
    pid: int | None = None
    host: str = ""
    exit_code: int | None = None
    said_status: int | None = None  # the status it said it exits with (its ``exit`` event)
    finished: bool = False  # it said its training completed (its ``finished`` event)
    injected: bool = False  # killed by the fault injector
    declared_dead: bool = False  # the job went on without it
    last_line: str = ""
    said_line: str = ""  # the line it exited with (its ``exit`` event), whatever came after
    replaces_step: int = -1  # a replacement: "dead" events up to this step were its forerunner's
    dead_step: int = -1  # the step during which the job declared it dead
    gone_at: float | None = None  # when the launcher saw it gone after it was declared dead
    evicted: str = ""  # why the launcher evicted it (it stopped while its peers waited)
    reached: int = -1  # the last step it said it entered (-1: none yet)
    save_wait_s: float = 0.0  # how long its sharded saves' barriers wait for a lost peer
    told: bool = False  # its death line is out
    stopped: bool = False  # killed by the launcher ending the attempt
    tail: watch_lib.Tail = dataclasses.field(default_factory=watch_lib.Tail)
    watcher: threading.Thread | None = None  # the thread reading its output (local workers)
    srun: bool = False  # a SLURM replacement: ``proc`` is its own srun step, read for its output

    @property
    def code(self) -> int | None:
        if self.proc is None or self.srun:  # srun's report gives a task's status
            return self.exit_code
        return self.proc.poll()

    @property
    def lost(self) -> bool:
        """Gone on purpose or declared dead: its exit status says nothing about the run."""
        return self.injected or self.declared_dead

    @property
    def left_alone(self) -> bool:
        """Gone on its own: finished, or dead and not yet declared so. One that left because
        its group died is not (the others may still be rebuilding without that group)."""
        code = self.code
        return code is not None and not self.lost and code != errors.EXIT_GROUP_LOST

    @property
    def failed(self) -> bool:
        """Ended with a crash: status 1 (an uncaught exception) or a signal."""
        code = self.code
        return code is not None and (code == 1 or code < 0)

    def signature(self) -> watch_lib.Signature:
        """What a repeat of this death must share (`launch_watch.Signature`)."""
        return watch_lib.Signature(int(self.code or 0), self.tail.last, self.reached)

    def send(self, sig: int) -> None:
        """Signal it, if it runs and can be reached (a SLURM task on this node, by pid).

        A SIGKILL for a task on another node goes through a file in the launch
        directory (shared storage), which the task's position reporter
        watches (`spare_jax.runlog.evict_marker`).
        """
        if self.code is not None:
            return
        try:
            if self.proc is not None and not self.srun:
                self.proc.send_signal(sig)
            elif self.pid is not None and self.host == socket.gethostname():
                os.kill(self.pid, sig)
            elif self.pid is not None and sig == signal.SIGKILL:
                marker = runlog.evict_marker(os.path.dirname(self.log_path), self.host, self.pid)
                with open(marker, "w", encoding="utf-8") as f:
                    f.write(f"{time.time()}\n")
        except (ProcessLookupError, OSError):
            pass


def popen(command: Sequence[str], env: dict[str, str], stdin: bool = False) -> subprocess.Popen:
    """A child whose output (stdout and stderr, as text lines) the launcher reads.

    ``stdin``: a pipe the launcher writes to (a warm spare's assignment).
    """
    return subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
    )

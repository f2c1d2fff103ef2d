"""Run any worker command as a K-process job that survives the loss of its processes.

    python -m spare_jax.launch --processes=4 --devices_per_process=2 -- python my_train.py ARGS
    python -m spare_jax.launch --processes=4 --kill=6:2 --launch_dir=runs/mine/launch -- \\
        python my_train.py --workdir=runs/mine

Like torchrun, for JAX and SPARe: it starts the command K times, each worker
knowing its index and the count (``SPARE_JAX_PROCESS_ID``,
``SPARE_JAX_NUM_PROCESSES``) and where the coordination service is, which
`spare_jax.initialize` reads. The launcher hosts the service itself, so any
worker, process 0 included, may die. In the workers, `spare_jax.fit` notices a
lost process and the survivors finish the step without it; the launcher kills
at once a worker the job has declared dead (a hung one included), and a job
whose survivors finish is complete. A worker that exits with the relaunch
status (75: an interruption no survivor can mask) makes the launcher start a
fresh job of all K workers on a new port, which rolls back to the latest
checkpoint. ``--kill=STEP:PROCESS`` is the fault injector (`spare_jax.testing`):
that worker stops inside that step and the launcher SIGKILLs it there; each
kill fires once.

Writes only under ``--launch_dir``: each worker's output (``worker-<i>.log``,
appended) and the injector's kill times. The lines that matter (a worker
declared dead, a fall-back past a damaged checkpoint, a rollback, an error)
are relayed to the launcher's stderr. Exit status: 0 the job completed; 2 bad
flags; 3 gave up after ``--max_relaunches``; 130 Ctrl-C; 143 preempted (a
SIGTERM to the launcher is passed on to every worker, which save the state at
the step they reached and leave; a rerun resumes from it); otherwise a
worker's own verdict (spare_jax.errors: 4 non-finite loss, 5 a
checkpoint could not be written, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from spare_jax import cli, errors, multihost, runlog

__all__ = ["Options", "launch", "parse_kills"]

EXIT_GAVE_UP = errors.EXIT_ROLLBACKS
SCHEDULERS = ("local", "slurm")
# Statuses that are not a worker's verdict on the run: done, try again, a
# crash (1 or a signal), a worker the job had already declared dead. Any other
# positive status is a verdict, also from a worker declared dead as it left (a
# writer that found the disk full exits 5 and its peers miss it at once).
_NOT_A_VERDICT = {
    0,
    1,
    errors.EXIT_RELAUNCH,
    errors.EXIT_PREEMPTED,
    multihost.EXIT_DECLARED_DEAD,
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
    log_dir: str = "runs/launch"
    preempt_s: float = 60.0  # after SIGTERM, how long the workers have to save and leave
    scheduler: str = "local"  # "local": K processes here; "slurm": one srun step of K tasks
    srun_args: tuple[str, ...] = ()  # more srun options (e.g. --gpus-per-task=1)
    replace_after_s: float | None = None  # start a replacement this long after a loss (re-join)


def parse_kills(specs: Sequence[str], processes: int) -> dict[int, int]:
    """``{process: step}`` from ``STEP:PROCESS`` entries (ValueError naming a bad one)."""
    out: dict[int, int] = {}
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--kill={spec!r}: expected STEP:PROCESS with integers, e.g. 5:1")
        step, proc = int(parts[0]), int(parts[1])
        if proc >= processes:
            raise ValueError(f"--kill={spec!r}: process must lie in [0, {processes})")
        if proc in out:
            raise ValueError(f"--kill={spec!r}: process {proc} is killed once only")
        out[proc] = step
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _say(message: str) -> None:
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
    injected: bool = False  # killed by the fault injector
    declared_dead: bool = False  # the job went on without it
    last_line: str = ""
    replaces_step: int = -1  # a replacement: "dead" events up to this step were its forerunner's
    dead_step: int = -1  # the step during which the job declared it dead
    gone_at: float | None = None  # when the launcher saw it gone after it was declared dead

    @property
    def code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else self.exit_code

    @property
    def lost(self) -> bool:
        """Gone on purpose or declared dead: its exit status says nothing about the run."""
        return self.injected or self.declared_dead

    def send(self, sig: int) -> None:
        """Signal it, if it runs and can be reached (a SLURM task on this node, by pid)."""
        if self.code is not None:
            return
        try:
            if self.proc is not None:
                self.proc.send_signal(sig)
            elif self.pid is not None and self.host == socket.gethostname():
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


# srun's own report of a task that did not exit 0 (a range when several did the same)
_SRUN_TASK = re.compile(r"srun: error: \S+: tasks? ([\d,\-]+): (.*)$")
_SRUN_SIGNALS = {"Killed": -9, "Terminated": -15, "Aborted": -6, "Segmentation fault": -11}


def _popen(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """A child whose output (stdout and stderr, as text lines) the launcher reads."""
    return subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
    )


def _task_ids(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class Job:
    """One attempt: a coordination service and K workers, watched until they all leave."""

    def __init__(self, command: Sequence[str], options: Options, env: dict):
        self.options, self.k = options, options.processes
        self.port = _free_port()
        self.service = multihost.serve(self.port, self.k, options.heartbeat_s)
        self.progress = time.time()
        self.progress_at = 0.0  # when the last progress event came
        self.gaps: list[float] = []  # seconds between progress events (about a step, or 1 s)
        self.resumed = False
        self.preempted_at: float | None = None
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._watchers: list[threading.Thread] = []
        self.srun: subprocess.Popen | None = None
        host = "localhost" if options.scheduler == "local" else _coordinator_host()
        job_env = {
            **env,
            multihost.ENV["coordinator"]: f"{host}:{self.port}",
            multihost.ENV["num_processes"]: str(self.k),
        }
        logs = [os.path.join(options.log_dir, f"worker-{i}.log") for i in range(self.k)]
        self.workers = [Worker(i, logs[i]) for i in range(self.k)]
        self.command, self.job_env = list(command), job_env
        self.replacements = 0
        self.injected: set[int] = set()  # indices whose --kill fired (a replacement's included)
        if options.scheduler == "slurm":
            self.srun = _popen([*_srun(self.k, options), *command], job_env)
            self._start(self._watch_srun)
            return
        for worker in self.workers:
            self._spawn(worker, {})

    def _spawn(self, worker: Worker, extra: dict[str, str]) -> None:
        env = {**self.job_env, multihost.ENV["process_id"]: str(worker.index), **extra}
        env[multihost.ENV["started_at"]] = repr(time.time())
        worker.proc = _popen(self.command, env)
        self._start(self._watch, worker)

    def _replace_due(self, now: float) -> None:
        """Start a replacement for each worker gone ``replace_after_s`` since the job lost it.

        Only while the run goes on (nobody finished); the replacement joins the
        running job (`spare_jax.rejoin`) with the same process id.
        """
        if any(w.code == 0 for w in self.workers):
            return
        for i, w in enumerate(self.workers):
            if not (w.declared_dead and w.code is not None):
                continue
            if w.gone_at is None:
                w.gone_at = now
            if now - w.gone_at < self.options.replace_after_s:
                continue
            new = Worker(i, w.log_path, replaces_step=w.dead_step)
            kills = self.job_env.get(multihost.ENV["kills"], "")
            mine = [k for k in kills.split(",") if k and not k.startswith(f"{i}=")]
            self.workers[i] = new
            self.replacements += 1
            _say(
                f"starting a replacement for worker {i} (declared dead during step "
                f"{w.dead_step}): it joins the running job"
            )
            self._spawn(
                new,
                {
                    multihost.ENV["replacement"]: str(self.replacements),
                    multihost.ENV["kills"]: ",".join(mine),
                },
            )

    def _start(self, target, *args) -> None:
        watcher = threading.Thread(target=target, args=args, daemon=True)
        watcher.start()
        self._watchers.append(watcher)

    # ---------------------------------------------------------------- output

    def _watch(self, worker: Worker) -> None:
        """Copy a worker's output to its log, acting on its events and relaying its notices.

        The pipe is always drained, even when the log cannot be written (a
        full disk): a worker must never block on its own output.
        """
        logs: dict[int, Any] = {}
        for line in worker.proc.stdout:
            self._line(worker, line, logs)
        self._close_logs(logs)

    def _watch_srun(self) -> None:
        """The same for every task of the srun step (``--label``: each line says whose it is)."""
        logs: dict[int, Any] = {}
        for line in self.srun.stdout:
            label, sep, rest = line.partition(": ")
            if sep and label.strip().isdigit() and int(label) < self.k:
                self._line(self.workers[int(label)], rest, logs)
                continue
            report = _SRUN_TASK.search(line.strip())
            if report:
                status = report.group(2)
                exited = re.match(r"Exited with exit code (\d+)", status)
                code = int(exited.group(1)) if exited else _SRUN_SIGNALS.get(status, -9)
                for i in _task_ids(report.group(1)):
                    if i < self.k:
                        self.workers[i].exit_code = code
        self.srun.wait()
        for w in self.workers:  # srun names only the tasks that did not exit 0
            if w.exit_code is None:
                w.exit_code = 0 if self.srun.returncode == 0 or not w.lost else -9
        self._close_logs(logs)

    def _line(self, worker: Worker, line: str, logs: dict[int, Any]) -> None:
        log = logs.get(worker.index, False)
        if log is False:
            log = logs[worker.index] = self._open_log(worker)
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as err:
                _say(f"cannot write {worker.log_path} ({err.strerror}): no more of its log")
                logs[worker.index] = None
        if line.startswith(runlog.EVENT):
            self._on_event(worker, line[len(runlog.EVENT) :])
        elif line.startswith(runlog.NOTICE):
            self._relay(worker, line[len(runlog.NOTICE) :].strip())
        elif line.strip():
            worker.last_line = line.strip()

    @staticmethod
    def _open_log(worker: Worker) -> Any:
        try:
            return open(worker.log_path, "a", encoding="utf-8")
        except OSError as err:
            _say(f"cannot write {worker.log_path} ({err.strerror}): its output is not kept")
            return None

    @staticmethod
    def _close_logs(logs: dict[int, Any]) -> None:
        for log in logs.values():
            if log:
                try:
                    log.close()
                except OSError:
                    pass

    def _relay(self, worker: Worker, message: str) -> None:
        worker.last_line = message
        with self._lock:  # survivors say the same thing: once is enough
            if message in self._said:
                return
            self._said.add(message)
        _say(f"[worker {worker.index}] {message}")

    def _on_event(self, worker: Worker, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError:
            return
        kind = event.get("kind")
        now = time.time()
        if kind == "progress" and self.progress_at:
            self.gaps.append(now - self.progress_at)
        self.progress = now
        if kind == "progress":
            self.progress_at = now
        if kind == "kill_point":  # the fault injector: the worker kills itself now
            worker.injected = True
            self.injected.add(worker.index)
        elif kind == "hello":
            worker.pid, worker.host = event.get("pid"), event.get("host", "")
        elif kind == "dead":
            step = int(event.get("step", -1))
            for p in event.get("processes", []):
                w = self.workers[p] if 0 <= p < self.k else None
                if w is None or w.declared_dead or step <= w.replaces_step:
                    continue  # a survivor's report of a loss already acted on
                w.declared_dead, w.dead_step = True, step
                w.send(signal.SIGKILL)  # hung or stopped: it goes now
        elif kind == "resumed":
            self.resumed = True

    # ------------------------------------------------------------------ wait

    def preempt(self) -> None:
        """Pass a preemption notice on: SIGTERM to every worker (they save and leave)."""
        if self.preempted_at is None:
            self.preempted_at = time.time()
            if self.srun is not None and self.srun.poll() is None:
                self.srun.send_signal(signal.SIGTERM)  # srun passes it on to every task
            for w in self.workers:
                w.send(signal.SIGTERM)

    def wait(self, stop: threading.Event | None = None) -> str:
        """Block until the job is over: ``complete``, ``verdict``, ``relaunch``, ``hung``
        or ``preempted`` (``stop`` is set when a SIGTERM reaches the launcher)."""
        first_exit = None
        while True:
            if stop is not None and stop.is_set():
                self.preempt()
            if self.options.replace_after_s is not None and self.preempted_at is None:
                self._replace_due(time.time())
            codes = [w.code for w in self.workers]
            if self.preempted_at is None and errors.EXIT_PREEMPTED in codes:
                self.preempted_at = time.time()  # the scheduler told the workers directly
            if self.preempted_at is not None:
                if all(c is not None for c in codes):
                    return "preempted"
                if time.time() - self.preempted_at > self.options.preempt_s:
                    _say(
                        f"workers still running {self.options.preempt_s:.0f} s after the "
                        "preemption notice: killed"
                    )
                    self.kill()
                    return "preempted"
                time.sleep(0.05)
                continue
            if any(c is not None and c not in _NOT_A_VERDICT and c > 0 for c in codes):
                self.kill()
                return "verdict"
            running = [w for w in self.workers if w.code is None]
            done = [w for w in self.workers if w.code == 0 and not w.lost]
            if not running:
                return "complete" if done else "relaunch"
            now = time.time()
            # Workers gone on their own: finished, or dead and not yet declared so (then
            # the count restarts once the job declares it dead and goes on).
            left = [w for w in self.workers if w.code is not None and not w.lost]
            if not left:
                first_exit = None
            elif first_exit is None:
                first_exit = now
            if first_exit is not None and now - first_exit > self.options.grace_s:
                for w in running:
                    _say(
                        f"worker {w.index} still running {self.options.grace_s:.0f} s after "
                        "another left: killed"
                    )
                self.kill()
                return "complete" if done else "relaunch"
            if self._stuck_after_a_loss(now):
                _say(
                    "a worker died and the others have made no progress since: they cannot "
                    "rebuild without it (a loss during their recovery); relaunching"
                )
                self.kill()
                return "relaunch"
            if now - self.progress > self.options.hang_timeout_s:
                _say(
                    f"no worker made progress for {self.options.hang_timeout_s:.0f} s: "
                    "the job counts as hung"
                )
                self.kill()
                return "hung"
            time.sleep(0.05)

    def _stuck_after_a_loss(self, now: float) -> bool:
        """A worker died (not declared dead by the job) and nobody has made progress since.

        Survivors see a loss within the heartbeat and the collective timeouts
        and then make progress again; a death while they rebuild their
        collectives can leave them waiting on it for good. Allowed: four
        heartbeats plus three typical steps.
        """
        died = [w for w in self.workers if w.code is not None and w.code < 0 and not w.lost]
        if not died or any(w.code == 0 for w in self.workers):
            return False
        gaps = sorted(self.gaps[-20:])
        step_s = gaps[len(gaps) // 2] if gaps else 1.0
        return now - self.progress > 4 * self.options.heartbeat_s + 3 * step_s

    def verdict(self) -> tuple[int, str]:
        """The first worker verdict: its status and its last line."""
        for w in self.workers:
            c = w.code
            if c is not None and c not in _NOT_A_VERDICT and c > 0:
                return c, w.last_line
        return 1, ""

    def kill(self) -> None:
        """SIGKILL every worker still running (JAX catches SIGTERM) and stop the service."""
        for w in self.workers:
            w.send(signal.SIGKILL)
        if self.srun is not None and self.srun.poll() is None:
            step = os.environ.get("SLURM_JOB_ID")
            if step:  # every task of our steps, wherever it runs
                subprocess.run(
                    ["scancel", "--signal=KILL", step], capture_output=True, timeout=30, check=False
                )
            self.srun.kill()
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        if self.srun is not None:
            try:
                self.srun.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for watcher in self._watchers:  # their last lines (a kill point, a notice) count
            watcher.join(timeout=5)
        if self.service is not None:
            self.service.shutdown()
            self.service = None


def _coordinator_host() -> str:
    """Where the tasks reach this launcher: localhost when the allocation is this node alone."""
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    me = socket.gethostname()
    return "localhost" if nodes in ("", me, me.split(".")[0]) else me


def _srun(tasks: int, options: Options) -> list[str]:
    """One srun step of ``tasks`` workers that keeps running when one of them dies."""
    return [
        "srun",
        f"--ntasks={tasks}",
        "--kill-on-bad-exit=0",
        "--label",
        "--unbuffered",
        "--export=ALL",
        *options.srun_args,
    ]


def check_scheduler(options: Options) -> None:
    """ValueError naming what is missing for ``options.scheduler``."""
    if options.scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler must be one of {', '.join(SCHEDULERS)}")
    if options.scheduler == "slurm" and options.replace_after_s is not None:
        raise ValueError(
            "--replace_after_s needs --scheduler=local: a running srun step cannot gain a task "
            "(on SLURM a dead task comes back at the next relaunch)"
        )
    if options.scheduler == "slurm":
        if shutil.which("srun") is None:
            raise ValueError("--scheduler=slurm needs srun on PATH (SLURM's client)")
        if "SLURM_JOB_ID" not in os.environ:
            raise ValueError(
                "--scheduler=slurm runs inside an allocation: salloc -n K ... or an sbatch script"
            )


def launch(command: Sequence[str], options: Options) -> int:
    """Run ``command`` as a job of ``options.processes`` workers until it completes; its status."""
    if not command:
        raise ValueError("give the worker command after --, e.g. -- python my_train.py")
    os.makedirs(options.log_dir, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        multihost.ENV["heartbeat_s"]: str(options.heartbeat_s),
        multihost.ENV["collective_timeout_s"]: str(options.collective_timeout_s),
        multihost.ENV["launch_dir"]: os.path.abspath(options.log_dir),
        multihost.ENV["exit_with_parent"]: "1",
    }
    if options.devices_per_process:
        env[multihost.ENV["devices"]] = str(options.devices_per_process)
    # K workers share this machine's cores: one compute thread each keeps them
    # from starving each other (and their heartbeats).
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
    check_scheduler(options)
    kills = dict(options.kills)
    relaunches = 0
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    while True:
        if kills:
            env[multihost.ENV["kills"]] = ",".join(f"{p}={t}" for p, t in sorted(kills.items()))
        else:
            env.pop(multihost.ENV["kills"], None)
        job = Job(command, options, env)
        try:
            outcome = job.wait(stop)
        finally:
            job.kill()
        if outcome == "preempted":
            _say(
                "preempted: the workers saved the state at the step they reached; rerun the "
                "same command to resume"
            )
            return errors.EXIT_PREEMPTED
        kills = {p: s for p, s in kills.items() if p not in job.injected}
        if job.resumed:
            env.pop(multihost.ENV["relaunched_at"], None)
        if outcome == "complete":
            return 0
        if outcome == "verdict":
            code, line = job.verdict()
            _say(f"worker exited with status {code}: {line}" if line else f"status {code}")
            return code
        relaunches += 1
        if relaunches > options.max_relaunches:
            _say(f"gave up after {options.max_relaunches} relaunches")
            return EXIT_GAVE_UP
        env.setdefault(multihost.ENV["relaunched_at"], str(time.time()))
        _say(
            f"relaunching all {options.processes} workers (relaunch {relaunches}): they roll "
            "back to the latest checkpoint"
        )


def _define_flags() -> dict[str, flags.FlagHolder]:
    """The launcher's flags, defined only when it runs as a program (callers have their own)."""
    _PROCESSES = flags.DEFINE_integer("processes", 4, "Worker processes K.", lower_bound=1)
    _DEVICES = flags.DEFINE_integer(
        "devices_per_process",
        None,
        "CPU devices each worker simulates (SPARE_JAX_DEVICES_PER_PROCESS); unset: the platform's.",
        lower_bound=1,
    )
    _KILL = flags.DEFINE_multi_string(
        "kill", [], "STEP:PROCESS: SIGKILL that worker in the middle of that step (repeatable)."
    )
    _MAX_RELAUNCHES = flags.DEFINE_integer(
        "max_relaunches", 10, "Give up (exit 3) after this many relaunches.", lower_bound=0
    )
    _HANG_S = flags.DEFINE_float(
        "hang_timeout_s",
        300.0,
        "A job in which no worker makes progress for this long counts as hung: killed, relaunched.",
        lower_bound=1.0,
    )
    _HEARTBEAT_S = flags.DEFINE_integer(
        "heartbeat_s",
        3,
        "Seconds without a heartbeat before a worker counts as dead.",
        lower_bound=1,
    )
    _COLLECTIVE_TIMEOUT_S = flags.DEFINE_integer(
        "collective_timeout_s",
        2,
        "CPU only: seconds before a collective with a dead peer fails.",
        lower_bound=1,
    )
    _GRACE_S = flags.DEFINE_float(
        "grace_s",
        30.0,
        "Once a worker has finished, the others have this long to follow before they are killed.",
        lower_bound=0.0,
    )
    _LOG_DIR = flags.DEFINE_string(
        "launch_dir", "runs/launch", "Worker logs and the launcher's files."
    )
    _SCHEDULER = flags.DEFINE_enum(
        "scheduler",
        "local",
        list(SCHEDULERS),
        "local: start the K workers on this machine; slurm: start them as one srun step of the "
        "allocation this runs in (salloc or sbatch), a new step for each relaunch.",
    )
    _SRUN_ARG = flags.DEFINE_multi_string(
        "srun_arg",
        [],
        "--scheduler=slurm: one more srun option (repeatable), e.g. --gpus-per-task=1",
    )
    _PREEMPT_S = flags.DEFINE_float(
        "preempt_s",
        60.0,
        "After a preemption notice (SIGTERM), how long the workers have to save and leave.",
        lower_bound=1.0,
    )
    _REPLACE_S = flags.DEFINE_float(
        "replace_after_s",
        None,
        "Start a replacement for a worker this long after the job declared it dead; it joins "
        "the running job with a live peer's state (hot re-join). Unset: it comes back at the "
        "next relaunch.",
        lower_bound=0.0,
    )
    _SERVE = flags.DEFINE_integer(
        "serve_port",
        None,
        "Only host the coordination service on this port for --processes workers started "
        "elsewhere, until killed (then every worker may die).",
        lower_bound=1,
        upper_bound=65535,
    )
    return {
        "_PROCESSES": _PROCESSES,
        "_DEVICES": _DEVICES,
        "_KILL": _KILL,
        "_MAX_RELAUNCHES": _MAX_RELAUNCHES,
        "_HANG_S": _HANG_S,
        "_HEARTBEAT_S": _HEARTBEAT_S,
        "_COLLECTIVE_TIMEOUT_S": _COLLECTIVE_TIMEOUT_S,
        "_GRACE_S": _GRACE_S,
        "_LOG_DIR": _LOG_DIR,
        "_SERVE": _SERVE,
        "_SCHEDULER": _SCHEDULER,
        "_SRUN_ARG": _SRUN_ARG,
        "_PREEMPT_S": _PREEMPT_S,
        "_REPLACE_S": _REPLACE_S,
    }


def _serve_only(port: int, processes: int, heartbeat_s: int) -> None:
    """Host the recoverable coordination service until this process is killed."""
    service = multihost.serve(port, processes, heartbeat_s)
    print(
        f"coordination service on port {port} for {processes} processes, heartbeat {heartbeat_s} s",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    finally:
        service.shutdown()


def main(argv: list[str], f: dict[str, flags.FlagHolder]) -> None:
    if f["_SERVE"].value is not None:
        _serve_only(f["_SERVE"].value, f["_PROCESSES"].value, f["_HEARTBEAT_S"].value)
        return
    command = argv[1:]
    if not command:
        raise app.UsageError("give the worker command after --, e.g. -- python my_train.py")
    try:
        kills = parse_kills(f["_KILL"].value, f["_PROCESSES"].value)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    options = Options(
        processes=f["_PROCESSES"].value,
        devices_per_process=f["_DEVICES"].value,
        kills=kills,
        max_relaunches=f["_MAX_RELAUNCHES"].value,
        hang_timeout_s=f["_HANG_S"].value,
        heartbeat_s=f["_HEARTBEAT_S"].value,
        collective_timeout_s=f["_COLLECTIVE_TIMEOUT_S"].value,
        grace_s=f["_GRACE_S"].value,
        log_dir=f["_LOG_DIR"].value,
        preempt_s=f["_PREEMPT_S"].value,
        scheduler=f["_SCHEDULER"].value,
        srun_args=tuple(f["_SRUN_ARG"].value),
        replace_after_s=f["_REPLACE_S"].value,
    )
    try:
        check_scheduler(options)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    options = dataclasses.replace(options, log_dir=cli.output_dir("launch_dir", options.log_dir))
    sys.exit(launch(command, options))


def run() -> None:
    """The console entry point: arguments after ``--`` are the worker command."""
    holders = _define_flags()
    cli.run(lambda argv: main(argv, holders), allow_args=True)


if __name__ == "__main__":
    run()

"""Run a multi-process training job on this machine; kill workers on cue; relaunch to roll back.

    python experiments/launch.py --processes=4 --kill=20:2 --workdir=runs/mp
    python experiments/launch.py --processes=4 --kill=5:1 --kill=5:2 \\
        --config=configs/lm_tiny.py:smoke --workdir=runs/mp2

A stand-in for a cluster's launcher (SLURM, Kubernetes), so that tests can
kill real processes: it starts ``--processes`` workers of
``experiments/train.py`` (every train.py flag passes through, ``--workdir``
included), each owning whole groups, and hosts the JAX coordination service
itself, so any worker may die, process 0 included. ``--kill=STEP:PROCESS``
SIGKILLs that worker in the middle of that step (the worker stops inside the
step and the launcher kills it there). The survivors detect the loss, take
the dead groups' work and go on without a restart. When the failures
interrupt (a shard with no live holder), the survivors stop and the launcher
starts a fresh job of all ``--processes`` workers on a new port: it restores
the latest complete checkpoint (a rollback). Each kill fires once.

Writes under ``--workdir``: train.py's ``metrics.jsonl`` (plus ``relaunch``
events), ``summary.json`` and ``checkpoints/``, and ``launch/`` with every
worker's log. Exit status: 0 when the run completes; 2 bad flags; 3 too many
relaunches; otherwise a worker's own status (4: non-finite loss).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import train  # experiments/ is on sys.path: defines every train.py flag here too
from absl import app, flags

from spare_jax import cli, multihost
from spare_jax.runlog import read_records

_PROCESSES = flags.DEFINE_integer("processes", 4, "Worker processes K.", lower_bound=1)
_DEVICES_PER_PROCESS = flags.DEFINE_integer(
    "devices_per_process", None, "CPU devices per worker (default: mesh size / K).", lower_bound=1
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
    "A job that records nothing for this long counts as hung: killed and relaunched.",
    lower_bound=1.0,
)
_SERVE = flags.DEFINE_integer(
    "serve_port",
    None,
    "Only host the coordination service on this port for --processes workers started "
    "elsewhere (a cluster's launcher), until killed; then every worker may die.",
    lower_bound=1,
    upper_bound=65535,
)
_GRACE_S = 5.0  # after the first worker leaves, the others have this long to follow
# Worker settings for a job on one machine, unless given: a dead worker is seen
# within seconds. (train.py's own defaults, 10 s, suit real clusters.)
LOCAL_WORKER_FLAGS = {"heartbeat_s": 3, "collective_timeout_s": 2}

OWN_FLAGS = (
    "processes",
    "devices_per_process",
    "kill",
    "max_relaunches",
    "hang_timeout_s",
    "serve_port",
)


@dataclasses.dataclass
class Worker:
    """One worker process and what the launcher knows of it."""

    index: int
    proc: subprocess.Popen
    log_path: str
    killed: bool = False
    last_error: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _kills(specs: list[str], processes: int, steps: int) -> dict[int, int]:
    """``{process: step}`` from ``STEP:PROCESS`` entries (UsageError naming a bad one)."""
    out: dict[int, int] = {}
    for spec in specs:
        parts = spec.split(":")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise app.UsageError(f"--kill={spec!r}: expected STEP:PROCESS with integers, e.g. 5:1")
        step, proc = int(parts[0]), int(parts[1])
        if proc >= processes:
            raise app.UsageError(f"--kill={spec!r}: process must lie in [0, {processes})")
        if step >= steps:
            raise app.UsageError(f"--kill={spec!r}: step must lie in [0, steps={steps})")
        if proc in out:
            raise app.UsageError(f"--kill={spec!r}: process {proc} is killed once only")
        out[proc] = step
    return out


def _passthrough(argv: list[str]) -> list[str]:
    """The command-line arguments meant for train.py (every one but the launcher's own)."""
    out, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        name = arg.lstrip("-").split("=", 1)[0]
        if name in OWN_FLAGS or (name.startswith("no") and name[2:] in OWN_FLAGS):
            skip = "=" not in arg and name in OWN_FLAGS  # its value is the next argument
            continue
        out.append(arg)
    return out


class Job:
    """One attempt: a coordination service and K workers, watched until they all leave."""

    def __init__(self, launch_dir: str, args: list[str], k: int, dpp: int, kills: dict[int, int]):
        self.launch_dir, self.k = launch_dir, k
        self.port = _free_port()
        heartbeat = (
            train._HEARTBEAT_S.value
            if flags.FLAGS["heartbeat_s"].present
            else LOCAL_WORKER_FLAGS["heartbeat_s"]
        )
        self.service = multihost.serve(self.port, k, heartbeat)
        self.workers: list[Worker] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The worker sets its own device count and collective timeout. K workers
        # share this machine's cores: one compute thread each keeps them from
        # starving each other (and the heartbeats) while they compile.
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
        for i in range(k):
            cmd = [
                sys.executable,
                train.__file__,
                *args,
                f"--coordinator_address=localhost:{self.port}",
                f"--num_processes={k}",
                f"--process_id={i}",
                "--external_service",
                "--exit_with_parent",
                f"--host_devices={dpp}",
            ]
            if i in kills:
                cmd.append(f"--stall_at_step={kills[i]}")
            log_path = os.path.join(launch_dir, f"worker-{i}.log")
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            worker = Worker(i, proc, log_path)
            self.workers.append(worker)
            threading.Thread(target=self._watch, args=(worker,), daemon=True).start()

    def _watch(self, worker: Worker) -> None:
        """Copy a worker's output to its log; SIGKILL it when it reports its kill point."""
        with open(worker.log_path, "a", encoding="utf-8") as log:
            for line in worker.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(train.KILL_POINT):
                    now = time.time()
                    worker.proc.kill()
                    worker.killed = True
                    path = os.path.join(self.launch_dir, f"killed-{worker.index}")
                    with open(path, "w", encoding="utf-8") as f:
                        f.write(f"{now}\n")
                elif line.strip():
                    worker.last_error = line.strip()

    def wait(self, metrics_path: str, hang_s: float, pending: Relaunch | None) -> list[Worker]:
        """Block until every worker has left (or the job hangs, then kill it); return them.

        ``pending``: the relaunch that started this job, recorded once it resumes.
        """
        first_exit = None
        while True:
            if pending is not None and pending.note():
                pending = None
            alive = [w for w in self.workers if w.proc.poll() is None]
            if not alive:
                return self.workers
            now = time.time()
            left = [w for w in self.workers if w.proc.poll() is not None and not w.killed]
            if first_exit is None and left:
                first_exit = now
            stale = now - _mtime(metrics_path)
            if stale > hang_s or (first_exit is not None and now - first_exit > _GRACE_S + hang_s):
                self.kill()
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every worker still running (JAX catches SIGTERM) and stop the service."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.service is not None:
            self.service.shutdown()
            self.service = None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()


def _last_step(records: list[dict]) -> int:
    steps = [r["step"] for r in records if "event" not in r and "step" in r]
    return max(steps) + 1 if steps else 0


def _append(path: str, record: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclasses.dataclass
class Relaunch:
    """A relaunch not yet on record: it is, once the new job has restored its state."""

    metrics: str
    seen: int  # records on file when the interrupted job ended
    interrupted_at: int
    started: float

    noted: bool = False

    def note(self) -> bool:
        """Append the ``relaunch`` event (once) if the new job has resumed; True once done."""
        if self.noted:
            return True
        records = read_records(self.metrics)[self.seen :]
        resumed = [r for r in records if r.get("event") == "resume" or "loss" in r]
        if not resumed:
            return False
        to = resumed[0]["step"]
        _append(
            self.metrics,
            {
                "event": "relaunch",
                "to_step": to,
                "lost_steps": max(self.interrupted_at - to, 0),
                "relaunch_s": round(time.time() - self.started, 6),
                "attempt": resumed[0].get("attempt"),
                "rolled_back": True,
            },
        )
        self.noted = True
        return True


def _serve_only(port: int, processes: int) -> None:
    """Host the recoverable coordination service until this process is killed."""
    heartbeat = train._HEARTBEAT_S.value
    service = multihost.serve(port, processes, heartbeat)
    print(
        f"coordination service on port {port} for {processes} processes, heartbeat {heartbeat} s",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    finally:
        service.shutdown()


def main(argv: list[str]) -> None:
    if _SERVE.value is not None:
        _serve_only(_SERVE.value, _PROCESSES.value)
        return
    config = train._config()
    for name, flag in (("steps", train._STEPS), ("seed", train._SEED)):
        if flag.value is not None:
            config[name] = flag.value
    mesh = [int(x) for x in config.mesh]
    devices = mesh[0] * mesh[1] * mesh[2]
    k = _PROCESSES.value
    dpp = _DEVICES_PER_PROCESS.value or (devices // k if devices % k == 0 else 0)
    if dpp * k != devices:
        raise app.UsageError(
            f"--processes={k} x --devices_per_process must equal the mesh's "
            f"{devices} devices {tuple(mesh)}"
        )
    if dpp % mesh[2]:
        raise app.UsageError(
            f"each process's {dpp} devices must hold whole groups of "
            f"{mesh[2]} (model axis): a group never spans two processes"
        )
    kills = _kills(_KILL.value, k, int(config.steps))
    workdir = train._workdir(train._WORKDIR.value)
    launch_dir = os.path.join(workdir, "launch")
    os.makedirs(launch_dir, exist_ok=True)
    metrics = os.path.join(workdir, "metrics.jsonl")
    del argv  # absl leaves only the program name; the flags are read from sys.argv
    args = _passthrough(sys.argv)
    for name, value in LOCAL_WORKER_FLAGS.items():
        if not flags.FLAGS[name].present:
            args.append(f"--{name}={value}")
    relaunches = 0
    pending: Relaunch | None = None
    while True:
        before = len(read_records(metrics))
        job = Job(launch_dir, args, k, dpp, kills)
        try:
            workers = job.wait(metrics, _HANG_S.value, pending)
        finally:
            job.kill()
        if pending is not None and pending.note():
            pending = None
        fired = {w.index for w in workers if w.killed}
        kills = {p: s for p, s in kills.items() if p not in fired}  # each kill fires once
        codes = {w.index: w.proc.returncode for w in workers if not w.killed}
        if codes and all(c == 0 for c in codes.values()):
            break
        bad = [c for c in codes.values() if c not in (0, multihost.RELAUNCH_EXIT) and c > 0]
        if bad and bad[0] != 1:  # a worker's own verdict (bad input, non-finite loss)
            sys.stderr.write(next(w.last_error for w in workers if w.proc.returncode == bad[0]))
            sys.stderr.write("\n")
            sys.exit(bad[0])
        relaunches += 1
        if relaunches > _MAX_RELAUNCHES.value:
            sys.stderr.write(f"launch.py: gave up after {_MAX_RELAUNCHES.value} relaunches\n")
            sys.exit(train.EXIT_ROLLBACKS)
        if pending is None:  # a job that failed before resuming continues the same relaunch
            records = read_records(metrics)
            pending = Relaunch(metrics, len(records), _last_step(records[before:]), time.time())
    summary_path = os.path.join(workdir, "summary.json")
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    print(
        f"done: step {summary['final_step']}, final loss {summary['final_loss']:.4f}, "
        f"relaunches {relaunches}, checksum {summary['param_checksum']:.10g}; {summary_path}"
    )


if __name__ == "__main__":
    cli.run(main)

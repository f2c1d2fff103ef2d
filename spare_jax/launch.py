"""Run any worker command as a K-process job that survives the loss of its processes.

    python -m spare_jax.launch --processes=4 --devices_per_process=2 -- python my_train.py ARGS
    python -m spare_jax.launch --processes=4 --kill=6:2 -- python my_train.py --workdir=runs/mine

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

A worker that stops while alive (a data loader blocked on a hung file system,
a stuck kernel; its heartbeat goes on) is evicted: each worker says where it
is (`spare_jax.runlog.at`), and one that stands still behind peers that have
waited for it longer than max(``--evict_after_s``, ``--evict_steps`` median
steps) is SIGKILLed and masked like a killed one, without a relaunch (a worker
inside the step is first given ``--collective_timeout_s``: it may be waiting
in a collective that a peer left on a dead process's error); a worker
checkpointing, restoring or compiling is never evicted
(`spare_jax.launch_watch`). A worker that crashes the same way in two attempts
in a row (a bug in the script) stops the job instead of relaunching it again.

Writes only under ``--launch_dir``, by default the job's own
(`default_launch_dir`: ``WORKDIR/launch`` for a command with ``--workdir=``,
else a fresh ``runs/launch-<time>-<pid>``): each worker's output
(``worker-<i>.log``, appended) and the injector's kill times. The lines that
matter (a worker declared dead, a fall-back past a damaged checkpoint, a
rollback, an error) are relayed to the launcher's stderr, and every death gets
one line: the worker, its status or signal, its last exception line, its log.
Exit status: 0 the job completed; 1 a worker crashed and the job did not mask
it, or crashed the same way twice; 2 bad flags; 3 gave up after
``--max_relaunches``; 130 Ctrl-C; 143 preempted (a
SIGTERM to the launcher is passed on to every worker, which save the state at
the step they reached and leave; a rerun resumes from it); otherwise a
worker's own verdict (spare_jax.errors: 4 non-finite loss, 5 a
checkpoint could not be written, ...).
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence

from absl import app, flags

from spare_jax import cli, errors, multihost
from spare_jax.launch_job import Job, Options, say
from spare_jax.launch_watch import Signature

__all__ = ["Options", "default_launch_dir", "launch", "parse_kills"]

EXIT_GAVE_UP = errors.EXIT_ROLLBACKS
EXIT_FAILED = 1  # a worker crashed and the job could not mask it, or crashed the same way twice
SCHEDULERS = ("local", "slurm")
# Flags of a worker command that name its work directory (the job's launch directory goes there).
WORKDIR_FLAGS = ("workdir", "work_dir", "out", "out_dir", "output_dir", "outdir", "logdir")


def default_launch_dir(command: Sequence[str], now: float | None = None) -> str:
    """The job's own launch directory: ``WORKDIR/launch`` when the command names its work
    directory (``--workdir=...``, ``--out=...``), else a fresh ``runs/launch-<time>-<pid>``."""
    args = list(command)
    for i, arg in enumerate(args):
        name, eq, value = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name not in WORKDIR_FLAGS:
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
            value = args[i + 1]
        if value:
            return os.path.join(value, "launch")
    stamp = datetime.datetime.fromtimestamp(time.time() if now is None else now)
    return os.path.join("runs", f"launch-{stamp:%Y%m%d-%H%M%S}-{os.getpid()}")


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


def check_scheduler(options: Options) -> None:
    """ValueError naming what is missing for ``options.scheduler``."""
    if options.scheduler not in SCHEDULERS:
        raise ValueError(f"--scheduler must be one of {', '.join(SCHEDULERS)}")
    if options.spares and options.replace_after_s is None:
        raise ValueError("--spares needs --replace_after_s: a spare takes a replacement's place")
    if options.spares and options.scheduler != "local":
        raise ValueError(
            "--spares needs --scheduler=local (under SLURM a replacement is a step of its own)"
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
    if not options.log_dir:
        options = dataclasses.replace(options, log_dir=default_launch_dir(command))
    os.makedirs(options.log_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(options.log_dir, "evict-*")):
        os.remove(stale)  # an earlier run's eviction marks: never this run's workers
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
    before: dict[int, Signature] = {}  # the last attempt's unmasked crashes
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
            say(
                "preempted: the workers saved the state at the step they reached; rerun the "
                "same command to resume"
            )
            return errors.EXIT_PREEMPTED
        kills = {p: s for p, s in kills.items() if p not in job.injected}
        if job.resumed:
            env.pop(multihost.ENV["relaunched_at"], None)
        if outcome == "complete":
            return 0
        if outcome == "failed":
            return EXIT_FAILED
        if outcome == "verdict":
            code, line = job.verdict()
            say(f"worker exited with status {code}: {line}" if line else f"status {code}")
            return code
        crashes = job.signatures()
        again = sorted(i for i, sig in crashes.items() if sig.same_as(before.get(i)))
        if again:
            i = again[0]
            step = crashes[i].step
            where = f"at step {step}" if step >= 0 else "before its first step"
            say(
                f"worker {i} failed the same way in two attempts in a row, {where} "
                f"({crashes[i].error or 'no error line'}): an error in the worker's command, "
                f"not a node failure; stopping (its log: {job.workers[i].log_path})"
            )
            return EXIT_FAILED
        before = crashes
        relaunches += 1
        if relaunches > options.max_relaunches:
            say(f"gave up after {options.max_relaunches} relaunches")
            return EXIT_GAVE_UP
        env.setdefault(multihost.ENV["relaunched_at"], str(time.time()))
        say(
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
        "CPU only: seconds before a collective with a dead peer fails (a worker inside a step "
        "is not evicted before this has passed).",
        lower_bound=1,
    )
    _GRACE_S = flags.DEFINE_float(
        "grace_s",
        30.0,
        "Once a worker has finished, the others have this long to follow before they are killed.",
        lower_bound=0.0,
    )
    _LOG_DIR = flags.DEFINE_string(
        "launch_dir",
        "",
        "Worker logs and the launcher's files. Unset: the job's own, WORKDIR/launch when the "
        "command has a --workdir= (or --out=, --output_dir=) argument, else a fresh "
        "runs/launch-<date>-<time>-<pid>.",
    )
    _EVICT_S = flags.DEFINE_float(
        "evict_after_s",
        30.0,
        "Evict (SIGKILL, masked like a death) a worker that has stood still, not checkpointing, "
        "restoring or compiling, while its peers waited in a step for it this long, or "
        "--evict_steps median steps when longer. 0: never.",
        lower_bound=0.0,
    )
    _EVICT_STEPS = flags.DEFINE_float(
        "evict_steps",
        10.0,
        "The eviction bound in median step times, when longer than --evict_after_s.",
        lower_bound=1.0,
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
    _SPARES = flags.DEFINE_integer(
        "spares",
        0,
        "With --replace_after_s: keep this many warm spares, started with the job and waiting "
        "with the script's imports done, so that a replacement skips starting Python and JAX.",
        lower_bound=0,
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
        "_EVICT_S": _EVICT_S,
        "_EVICT_STEPS": _EVICT_STEPS,
        "_SERVE": _SERVE,
        "_SCHEDULER": _SCHEDULER,
        "_SRUN_ARG": _SRUN_ARG,
        "_PREEMPT_S": _PREEMPT_S,
        "_REPLACE_S": _REPLACE_S,
        "_SPARES": _SPARES,
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
        log_dir=f["_LOG_DIR"].value or default_launch_dir(command),
        preempt_s=f["_PREEMPT_S"].value,
        scheduler=f["_SCHEDULER"].value,
        srun_args=tuple(f["_SRUN_ARG"].value),
        replace_after_s=f["_REPLACE_S"].value,
        spares=f["_SPARES"].value,
        evict_after_s=f["_EVICT_S"].value,
        evict_steps=f["_EVICT_STEPS"].value,
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

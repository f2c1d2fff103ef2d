"""`fit`: all of SPARe's fault tolerance around any model's train step.

    spare_jax.initialize()                    # first: joins a launched job, else nothing
    step = spare_jax.make_train_step(loss_fn, optax.adamw(1e-3), mesh, redundancy=2)
    result = spare_jax.fit(step, params, batches, steps=1000, workdir="runs/mine")
    result.params, result.summary

``batches(t)`` returns the failure-free global batch of step ``t`` and must be
a pure function of ``t``: a rollback or a resume asks for the same steps
again. `fit` checkpoints with Orbax at the interval the analytical model finds
optimal (or every ``checkpoint_steps``), masks failed groups exactly, rolls
back when a shard has no live holder, resumes from ``workdir`` when rerun,
and, in a multi-process job, lets the survivors of a dead process finish the
step without it. Compiled programs go to JAX's persistent compilation cache
(``WORKDIR/compile_cache``), so a rerun or a relaunch loads them. See
`spare_jax.trainer.Trainer` for the way a failure takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from absl import logging as absl_logging

from spare_jax import checks, inputs, liveness, runlog, testing
from spare_jax import compile_cache as cache_lib
from spare_jax import train_step as step_lib
from spare_jax.job_env import ENV
from spare_jax.trainer import Trainer

__all__ = ["FitResult", "fit"]


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns.

    Attributes:
        params: the final parameters, a pytree of host NumPy arrays (on every
            surviving process of a multi-process job).
        summary: the dict written to ``WORKDIR/summary.json`` (by the writer; its
            ``input_rows`` are the writer's own).
        input_rows: the rows this process read from ``batches`` over the run
            (reloads after a rollback or a recovery included).
    """

    params: Any
    summary: dict[str, Any]
    writer: bool = True  # whether this process wrote the run's books (one process does)
    input_rows: int = 0


def _failures(
    failures: Any, groups: int, steps: int, rate: float, repair_steps: int, seed: int
) -> liveness.Failures:
    if isinstance(failures, liveness.Failures):
        if failures.groups != groups:
            raise ValueError(f"failures has {failures.groups} groups, the step has {groups}")
        return failures
    if failures is None or isinstance(failures, str):
        schedule = liveness.parse_schedule(failures or "", groups, steps)
    elif isinstance(failures, dict):
        schedule = liveness.parse_schedule(
            ",".join(f"{t}:{g}" for t, gs in failures.items() for g in gs), groups, steps
        )
    else:
        raise ValueError(
            "failures must be None, 'STEP:GROUP,...', {step: [groups]} or a liveness.Failures, "
            f"got {type(failures).__name__}"
        )
    return liveness.Failures(
        groups, schedule=schedule, rate=rate, repair_steps=repair_steps, seed=seed
    )


class _Notice:
    requested = False


@contextlib.contextmanager
def _preemption_notice():
    """A lone process hears SIGTERM as a preemption notice while `fit` runs.

    (In a multi-process job JAX's own preemption service hears it.) Only from
    the main thread, and only when nobody else handles SIGTERM.
    """
    notice = _Notice()
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield notice
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield notice
        return

    def heard(signum, frame):
        del signum, frame
        notice.requested = True

    signal.signal(signal.SIGTERM, heard)
    try:
        yield notice
    finally:
        signal.signal(signal.SIGTERM, previous)


def _workdir(path: str) -> str:
    if not isinstance(path, str | os.PathLike) or not str(path):
        raise ValueError(f"workdir must be a directory path, got {path!r}")
    path = os.fspath(path)
    if os.path.islink(path):
        raise ValueError(f"workdir {path} is a symbolic link; refusing to write through it")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"workdir {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    return path


def _cache_setting(value: Any) -> str | bool | None:
    """``compile_cache`` checked: a directory, None (the default place) or False (off)."""
    if value is None or value is True:
        return None
    if value is False:
        return False
    if isinstance(value, str | os.PathLike) and str(value):
        return os.fspath(value)
    raise ValueError(
        f"compile_cache must be a directory, None (the default place) or False (off), got {value!r}"
    )


@contextlib.contextmanager
def _compile_cache(setting: str | bool | None, workdir: str) -> Iterator[None]:
    """JAX's persistent compilation cache on for the run, then JAX's settings as they were.

    ``setting`` from `_cache_setting`. The default place is the directory JAX
    is already configured with (``JAX_COMPILATION_CACHE_DIR``, say), else
    ``WORKDIR/compile_cache``.
    """
    if setting is False:
        yield
        return
    directory = setting or cache_lib.configured()
    if directory is None:
        directory = os.path.join(workdir, "compile_cache")
        if os.path.islink(directory):
            raise ValueError(f"{directory} is a symbolic link; refusing to write through it")
    with cache_lib.enabled(directory) as path:
        try:
            yield
        finally:
            seen = cache_lib.counts()
            absl_logging.info(
                "compile cache %s: %d programs loaded (%d untraced), %d compiled",
                path,
                seen["cache_hits"],
                seen["untraced"],
                seen["cache_misses"],
            )


def _check_first_batch(step: step_lib.SpareStep, batches: Callable[..., Any]) -> int:
    """Step 0's input has the shape the step needs (ValueError naming it); the rows read.

    Runs before any file is created or opened (the workdir may hold a run to resume).
    """
    return inputs.load(step, batches, 0)[1]


def _quiet_orbax() -> None:
    """Keep Orbax's per-save INFO lines out of the run's log (its warnings stay)."""
    handler = absl_logging.get_absl_handler()
    if not any(isinstance(f, _NoOrbaxInfo) for f in handler.filters):
        handler.addFilter(_NoOrbaxInfo())


class _NoOrbaxInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "orbax" not in record.pathname


def fit(
    step: step_lib.SpareStep,
    params: Any,
    batches: Callable[..., Any],
    *,
    steps: int,
    workdir: str,
    failures: Any = None,
    checkpoint_steps: int | None = None,
    failure_rate: float = 0.0,
    repair_steps: int = 0,
    seed: int = 0,
    gpu_mtbf_hours: float = 5.1e4,
    max_rollbacks: int = 100,
    keep: int = 3,
    warmup_steps: int = 3,
    precompile_failures: bool = False,
    balance: bool = False,
    sharded_checkpoints: bool | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    compile_cache: str | None | bool = None,
) -> FitResult:
    """Train ``steps`` steps of ``step`` from ``params`` through every failure; resume if rerun.

    Args:
        step: from `spare_jax.make_train_step`, over the whole job's mesh.
        params: the initial parameters (any pytree of NumPy or JAX arrays), or
            a function of no arguments that builds them. `fit` runs the
            function as one program whose outputs are born in their shards
            (no process holds a whole parameter), and only when it starts
            afresh: a resumed job, a relaunch or a replacement traces it for
            the shapes alone. The form for a model larger than one device, and
            the quicker re-join.
        batches: the input, a pure function of the step (`spare_jax.inputs`):
            ``batches(t)`` -> the failure-free global batch of step ``t`` (``G * m * b``
            rows, the same on every process), or ``batches(t, units)`` -> only the
            rows of the units this process holds (leaves ``[len(units.ids),
            rows, ...]``: each unit's ``units.rows(b)``), as a per-host loader reads them.
        steps: training steps.
        workdir: ``metrics.jsonl`` (appended), ``summary.json``, ``checkpoints/``.
        failures: simulated group failures for tests and demos: ``"STEP:GROUP,..."``,
            ``{step: [groups]}`` or a `spare_jax.liveness.Failures`; each fires once.
        checkpoint_steps: None for the interval the analytical model finds
            optimal from the measured step time, save stall, save and restore
            times and the failure rate; N to save every N steps.
        failure_rate: per-step failure probability of each live group (simulated).
        repair_steps: a simulated failed group re-joins after this many steps
            (0: at the next rollback).
        seed: seed of the random failures.
        gpu_mtbf_hours: per-device MTBF the interval model assumes when no
            failures are configured (default: Llama 3's 51,000 h, see docs/design.md).
        max_rollbacks: raise `errors.TooManyRollbacks` past this many.
        keep: complete checkpoints kept on disk.
        warmup_steps: steps timed before the first (calibration) save.
        precompile_failures: multi-process: compile at start-up the step each
            single process failure would leave (a recovery then compiles nothing).
        balance: multi-process: measure each failure domain's compute speed and,
            when it pays, give slow groups fewer micro-batches (exact; a
            ``straggler`` event says so; `spare_jax.balancing`). Off by default.
        sharded_checkpoints: multi-process: every live process writes its
            part of each checkpoint from its devices (Orbax, replica-parallel:
            about 1/G of the state each; the write in the background). None
            (the default) or True: so. False, with whole groups per process:
            one writer copies its whole replica to its host and writes it
            (docs/checkpointing.md, "Who writes"). Groups spanning processes
            always save sharded.
        on_step: called with each step's record (the ``metrics.jsonl`` fields).
        compile_cache: where JAX's persistent compilation cache keeps the
            compiled programs, so that a rerun or a relaunched job loads them
            instead of compiling them again. None (or True): the directory JAX
            is already configured with (``JAX_COMPILATION_CACHE_DIR``), else
            ``WORKDIR/compile_cache``; a path: that directory; False: `fit`
            turns on no cache. JAX's cache settings are process-wide: `fit`
            sets them before its first compile and puts them back when it
            returns (`spare_jax.compile_cache`).

    Returns:
        `FitResult`: the final parameters (host NumPy) and the summary.

    Raises:
        ValueError: bad arguments (named), before any work.
        spare_jax.errors.FitError: the run cannot go on; its ``exit_status``
            says why (errors.py lists them). Under `spare_jax.initialize` an
            uncaught one exits the process with that status and one line.
    """
    _quiet_orbax()
    if os.environ.get(ENV["spare"]):  # never given a place: it would train alone, beside the job
        raise RuntimeError(
            "this process is a launcher's warm spare (--spares), which waits in "
            "spare_jax.initialize(); call spare_jax.initialize() first in the script"
        )
    if not isinstance(step, step_lib.SpareStep):
        raise ValueError(f"step must come from spare_jax.make_train_step, got {type(step)!r}")
    if not callable(batches):
        raise ValueError("batches must be a function of the step index: batches(t) -> batch")
    steps = checks.integer("steps", steps, low=1)
    pinned = (
        0
        if checkpoint_steps is None
        else checks.integer("checkpoint_steps", checkpoint_steps, low=1)
    )
    schedule = _failures(failures, step.groups, steps, failure_rate, repair_steps, seed)
    keep = checks.integer("keep", keep, low=1)
    warmup_steps = checks.integer("warmup_steps", warmup_steps, low=1)
    max_rollbacks = checks.integer("max_rollbacks", max_rollbacks, low=0)
    gpu_mtbf_hours = checks.number("gpu_mtbf_hours", gpu_mtbf_hours, low=0.0, low_open=True)
    cache = _cache_setting(compile_cache)
    if callable(params):
        checks.no_arguments("params", params)
    if balance and jax.process_count() == 1:
        runlog.notice(
            "balance=True is off in a one-process job: one program runs all of its groups, "
            "so their speeds cannot be timed apart (it needs a job of several processes)"
        )
    if sharded_checkpoints and jax.process_count() == 1:
        runlog.notice(
            "sharded_checkpoints=True changes nothing in a one-process job: its one process "
            "writes every checkpoint already (it is for jobs of several processes)"
        )
    first_rows = _check_first_batch(step, batches)  # every argument checked: now the files
    workdir = _workdir(workdir)
    with _compile_cache(cache, workdir):  # before the trainer compiles anything
        trainer = Trainer(
            step,
            params,
            batches,
            workdir,
            steps=steps,
            failures=schedule,
            checkpoint_steps=pinned,
            keep=keep,
            warmup_steps=warmup_steps,
            max_rollbacks=max_rollbacks,
            gpu_mtbf_hours=gpu_mtbf_hours,
            precompile_failures=bool(precompile_failures),
            balance=bool(balance),
            sharded_checkpoints=sharded_checkpoints is not False,
            on_step=on_step,
            fault_hook=testing.fault_hook_from_env(),
        )
        trainer.input_rows += first_rows
        with _preemption_notice() as notice:
            trainer.preemption = notice
            try:
                trainer.start()
                trainer.loop()
                summary = trainer.finish()
                runlog.emit("finished", step=trainer.t)
                return FitResult(trainer.params(), summary, trainer.log.writer, trainer.input_rows)
            finally:
                trainer.close()

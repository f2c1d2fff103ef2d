"""Train the Flax LM through group failures with SPARe, replication or plain DP.

    python experiments/train.py --workdir=runs/demo --failures=40:1,90:3
    python experiments/train.py --config=configs/lm_tiny.py:smoke --strategy=replication
    python experiments/train.py --failure_rate=0.01 --repair_steps=10 --config.model.layers=4

Flags override the config file's fields of the same name. Outputs, all under
``--workdir``: ``metrics.jsonl`` (appended to, one JSON object per step or
event), ``summary.json`` (written at the end) and ``checkpoints/`` (Orbax).
Rerunning the same command with the same ``--workdir`` resumes from the latest
complete checkpoint. An interruption (a shard with no live holder) rolls back
to the latest checkpoint and replaces the failed groups; the run goes on.

Multi-process jobs (one process per host, or several on one machine through
``experiments/launch.py``): ``--coordinator_address --num_processes
--process_id`` (or ``--distributed`` to let JAX detect SLURM and the like).
Groups map whole onto processes; when a process dies the survivors finish the
step without it (docs/multihost.md).

Exit status: 0 done; 2 bad flags, config or work directory, or checkpoints that
all fail to restore; 3 gave up after ``checkpoint.max_rollbacks`` rollbacks; 4
the loss became non-finite (the state before that step is saved first); 75 an
interruption after a process loss (the launcher relaunches the job, which
rolls back); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import ctypes
import logging as std_logging
import os
import signal
import sys
import threading

import jax
from absl import flags, logging
from tqdm import tqdm

from spare_jax import checkpoint, cli, experiment, liveness, multihost, strategies, trainer

_DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "lm_tiny.py"
)
_CONFIG = cli.config_file_flag(
    "config",
    os.path.normpath(_DEFAULT_CONFIG),
    "Training config file (and variant: configs/lm_tiny.py:smoke).",
)
_STRATEGY = flags.DEFINE_enum(
    "strategy", None, list(strategies.STRATEGIES), "Placement (default: config)."
)
_REDUNDANCY = flags.DEFINE_integer("redundancy", None, "Redundancy r (dp is r = 1).", lower_bound=1)
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", None, "Micro-batches per group m.", lower_bound=1
)
_POLICY = flags.DEFINE_enum(
    "policy",
    None,
    list(strategies.POLICIES),
    "adaptive (optimal reordering), fixed (stack order) or drop (INEXACT baseline).",
)
_FAILURES = flags.DEFINE_string(
    "failures", "", "Scheduled failures step:group,step:group,... (each fires once)."
)
_FAILURE_RATE = flags.DEFINE_float(
    "failure_rate",
    0.0,
    "Per-step failure probability of each live group.",
    lower_bound=0.0,
    upper_bound=1.0,
)
_REPAIR_STEPS = flags.DEFINE_integer(
    "repair_steps",
    0,
    "A failed group re-joins this many steps after it failed (0: only at a rollback).",
    lower_bound=0,
)
_CHECKPOINT_STEPS = flags.DEFINE_integer(
    "checkpoint_steps",
    0,
    "Checkpoint interval in steps; 0: the analytical model's optimum for this run.",
    lower_bound=0,
)
_SEED = flags.DEFINE_integer(
    "seed", None, "Seed of the model, data and random failures (default: config).", lower_bound=0
)
_STEPS = flags.DEFINE_integer("steps", None, "Training steps (default: config).", lower_bound=1)
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/train", "Output directory (metrics.jsonl, summary.json, checkpoints/)."
)
_COMPILATION_CACHE = flags.DEFINE_bool(
    "compilation_cache",
    True,
    "Keep compiled steps in WORKDIR/jax_cache, so a resume or relaunch skips compiling.",
)
_HOST_DEVICES = flags.DEFINE_integer(
    "host_devices",
    8,
    "Simulated CPU devices of this process (CPU only).",
    lower_bound=1,
    upper_bound=4096,
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of the JAX coordination service (multi-process)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Processes in the job (multi-process).", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's id in [0, num_processes).", lower_bound=0
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-process job whose cluster JAX detects (SLURM, ...)."
)
_EXTERNAL_SERVICE = flags.DEFINE_bool(
    "external_service",
    False,
    "The coordination service runs outside the workers (experiments/launch.py hosts it).",
)
_HEARTBEAT_S = flags.DEFINE_integer(
    "heartbeat_s",
    10,
    "Seconds without a heartbeat before a process counts as dead.",
    lower_bound=2,
)
_COLLECTIVE_TIMEOUT_S = flags.DEFINE_integer(
    "collective_timeout_s",
    10,
    "CPU only: seconds before a collective with a dead peer fails (GPU ones are cancelled).",
    lower_bound=1,
)
_EXIT_WITH_PARENT = flags.DEFINE_bool(
    "exit_with_parent",
    False,
    "Linux: the kernel kills this process when the process that started it dies "
    "(experiments/launch.py sets it, so no worker outlives its launcher).",
)
_PRECOMPILE = flags.DEFINE_bool(
    "precompile_failures",
    False,
    "Multi-process: at start-up, compile the step for every mesh one more process failure "
    "would leave, so that a recovery does not compile.",
)
_STALL_AT_STEP = flags.DEFINE_integer(
    "stall_at_step",
    None,
    "Testing hook of experiments/launch.py --kill: stop inside this step and wait to be killed.",
    lower_bound=0,
)

EXIT_ROLLBACKS = 3
EXIT_NON_FINITE = 4
KILL_POINT = "spare-jax: stalled in step"  # the line experiments/launch.py waits for


def _config() -> object:
    try:
        config = _CONFIG.value
        config.get("steps")  # a config file that failed to load raises on first access
        return config
    except (OSError, AttributeError, KeyError, ValueError) as error:
        cli.fail(f"cannot load --config: {cli.one_line(error)}")


def _workdir(path: str) -> str:
    """The work directory, created and checked before any work (one line and exit 2 if bad)."""
    return cli.output_dir("workdir", path)


def _quiet_libraries() -> None:
    """Keep Orbax's per-save lines and JAX's backend probing out of the run's log."""
    handler = logging.get_absl_handler()
    handler.addFilter(lambda record: "orbax" not in record.pathname)
    handler.addFilter(lambda record: "xla_bridge" not in record.pathname)


def _exit_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's exit paths still kill us
        pass
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _multi_process() -> bool:
    return bool(
        _DISTRIBUTED.value
        or _COORDINATOR.value
        or _NUM_PROCESSES.value is not None
        or _PROCESS_ID.value is not None
    )


def _start_jax(config: object) -> tuple[object, multihost.Executor | None]:
    """Start JAX (alone, or joined to a multi-process job) and build the run on its devices."""
    jax.config.update("jax_num_cpu_devices", _HOST_DEVICES.value)
    if _COMPILATION_CACHE.value and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(_WORKDIR.value, "jax_cache"))
    if not _multi_process():
        return experiment.setup(config), None
    if not _DISTRIBUTED.value and None in (
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
    ):
        cli.fail("give --coordinator_address, --num_processes and --process_id together")
    if _PROCESS_ID.value is not None and _PROCESS_ID.value >= (_NUM_PROCESSES.value or 1):
        cli.fail(f"--process_id must lie in [0, {_NUM_PROCESSES.value})")
    timeout = multihost.collective_timeout_flag(_COLLECTIVE_TIMEOUT_S.value)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {timeout}".strip()
    multihost.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
        heartbeat_s=_HEARTBEAT_S.value,
        external_service=_EXTERNAL_SERVICE.value,
    )
    try:
        mesh = multihost.global_mesh(tuple(config.mesh))
        multihost.groups_of_processes(mesh)
    except ValueError as err:
        cli.fail(str(err))
    run = experiment.setup(config, mesh, donate=False)

    def stalled() -> None:
        print(f"{KILL_POINT} {_STALL_AT_STEP.value}", flush=True)

    return run, multihost.Executor(
        run.step,
        stall_at=_STALL_AT_STEP.value,
        on_stall=stalled,
        precompile=_PRECOMPILE.value,
    )


def _finish_multi_process(code: int) -> None:
    """Leave the job without waiting on dead peers (bounded), then exit with ``code``."""
    done = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    done.start()
    done.join(15.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    del argv
    if _EXIT_WITH_PARENT.value:
        _exit_with_parent()
    _quiet_libraries()
    config = _config()
    for name, flag in (
        ("strategy", _STRATEGY),
        ("redundancy", _REDUNDANCY),
        ("microbatches", _MICROBATCHES),
        ("policy", _POLICY),
        ("seed", _SEED),
        ("steps", _STEPS),
    ):
        if flag.value is not None:
            config[name] = flag.value
    if _FAILURES.value and _FAILURE_RATE.value:
        cli.fail("give either --failures or --failure_rate, not both")
    try:
        experiment.validate(config)
        groups = int(config.mesh[0]) * int(config.mesh[1])
        schedule = liveness.parse_schedule(_FAILURES.value, groups, config.steps)
        failures = liveness.Failures(
            groups,
            schedule=schedule,
            rate=_FAILURE_RATE.value,
            repair_steps=_REPAIR_STEPS.value,
            seed=config.seed,
        )
        if _STALL_AT_STEP.value is not None and _STALL_AT_STEP.value >= config.steps:
            raise ValueError(f"--stall_at_step must be < steps={config.steps}")
        workdir = _workdir(_WORKDIR.value)  # checked before any work, created once all is valid
        run, executor = _start_jax(config)
    except ValueError as err:
        cli.fail(str(err))
    logging.info(
        "mesh %s, %s, G=%d groups, r=%d, m=%d, policy %s, slot bound %d",
        dict(run.step.mesh.shape),
        run.step.placement,
        run.groups,
        run.step.placement.redundancy,
        run.step.microbatches,
        config.policy,
        run.step.slot_bound,
    )
    if config.policy == "drop":
        logging.warning("policy=drop is the INEXACT drop-and-renormalise baseline")
    code = _train(run, failures, workdir, config, executor)
    if executor is not None:
        _finish_multi_process(code)
    sys.exit(code)


def _train(run, failures, workdir, config, executor) -> int:
    """Train with a progress bar; the exit status."""
    prog = os.path.basename(sys.argv[0])
    bar = tqdm(
        total=config.steps,
        desc="train",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=executor is not None,
    )

    class _ClearBar(std_logging.Filter):
        """Let a log line through on a line of its own, not after the progress bar."""

        def filter(self, record: std_logging.LogRecord) -> bool:
            bar.clear()
            return True

    logging.get_absl_handler().addFilter(_ClearBar())

    def on_step(record: dict) -> None:
        bar.n = record["step"] + 1
        bar.set_postfix(
            loss=f"{record['loss']:.3f}", live=record["live_groups"], load=record["max_load"]
        )
        if record["step"] % config.log_every == 0 or record["step"] == config.steps - 1:
            logging.info(
                "step %d loss %.4f live_groups %d max_load %d step_time_s %.4f",
                record["step"],
                record["loss"],
                record["live_groups"],
                record["max_load"],
                record["step_time_s"],
            )
        bar.refresh()

    try:
        summary = trainer.train(
            run,
            failures,
            workdir,
            checkpoint_steps=_CHECKPOINT_STEPS.value,
            on_step=on_step,
            executor=executor,
        )
    except checkpoint.NoUsableCheckpoint as err:
        bar.close()
        sys.stderr.write(f"{prog}: error: {err}\n")
        return cli.USAGE_EXIT
    except trainer.TooManyRollbacks as err:
        bar.close()
        sys.stderr.write(f"{prog}: {err}\n")
        return EXIT_ROLLBACKS
    except trainer.NonFiniteLoss as err:
        bar.close()
        sys.stderr.write(f"{prog}: {err}\n")
        return EXIT_NON_FINITE
    except trainer.Relaunch as err:
        bar.close()
        sys.stderr.write(f"{prog}: {err}\n")
        return multihost.RELAUNCH_EXIT
    bar.close()
    if executor is not None and jax.process_index() != min(
        int(p) for p in multihost.groups_of_processes(run.step.mesh)
    ):
        return 0  # one process (the writer) reports
    g = summary["goodput"]
    print(
        f"done: step {summary['final_step']}, final loss {summary['final_loss']:.4f}, "
        f"rollbacks {summary['rollbacks']}, checkpoint every "
        f"{summary['checkpoint_interval_steps']} steps ({summary['checkpoint_interval_source']}); "
        f"goodput {g['useful_s'] / max(g['total_s'], 1e-12):.1%} of {g['total_s']:.2f} s; "
        f"{os.path.join(workdir, 'summary.json')}"
    )
    return 0


if __name__ == "__main__":
    cli.run(main)

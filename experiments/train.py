"""Train the Flax LM through group failures with SPARe, replication or plain DP.

    python experiments/train.py --workdir=runs/demo --failures=40:1,90:3
    python experiments/train.py --config=configs/lm_tiny.py:smoke --strategy=replication
    python experiments/train.py --failure_rate=0.01 --repair_steps=10 --config.model.layers=4

Flags override the config file's fields of the same name. Outputs, all under
``--workdir``: ``metrics.jsonl`` (appended to, one JSON object per step or
event), ``summary.json`` (written at the end), ``checkpoints/`` (Orbax) and
``params-<process>.npz`` (each surviving process's final parameters, keyed by
their path in the parameter tree).
Rerunning the same command with the same ``--workdir`` resumes from the latest
complete checkpoint. An interruption (a shard with no live holder) rolls back
to the latest checkpoint and replaces the failed groups; the run goes on.

The training is `spare_jax.fit` on the LM of ``experiments/lm`` (this binary
is one client of it). Multi-process jobs: under ``python -m spare_jax.launch``
(or ``experiments/launch.py``) nothing more is needed; on a cluster,
``--coordinator_address --num_processes --process_id`` (or ``--distributed``
to let JAX detect SLURM and the like). Groups map whole onto processes; when
a process dies the survivors finish the step without it (docs/multihost.md).

Exit status (spare_jax.errors): 0 done; 2 bad flags, config or work
directory, or checkpoints that all fail to restore; 3 gave up after
``checkpoint.max_rollbacks`` rollbacks; 4 the loss became non-finite (the
state before that step is saved first); 5 a checkpoint could not be written
(a full disk: the newest intact checkpoint is kept); 75 an interruption after
a process loss (the launcher relaunches the job, which rolls back); 130
interrupted (Ctrl-C); 143 preempted (SIGTERM: the state at the step reached
is saved first, and a rerun resumes from it).
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

import jax
import numpy as np
from absl import flags, logging
from lm import setup as experiment
from tqdm import tqdm

import spare_jax
from spare_jax import cli, errors, liveness, multihost, strategies

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
    None,
    "Checkpoint interval in steps; 0: the analytical model's optimum for this run "
    "(default: config checkpoint.steps).",
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
_HEARTBEAT_S = flags.DEFINE_integer(
    "heartbeat_s",
    None,
    "Seconds without a heartbeat before a process counts as dead (default: the launcher's, "
    "else 10).",
    lower_bound=2,
)
_COLLECTIVE_TIMEOUT_S = flags.DEFINE_integer(
    "collective_timeout_s",
    None,
    "CPU only: seconds before a collective with a dead peer fails (GPU ones are cancelled; "
    "default: the launcher's, else 10).",
    lower_bound=1,
)
_PRECOMPILE = flags.DEFINE_bool(
    "precompile_failures",
    False,
    "Multi-process: at start-up, compile the step for every mesh one more process failure "
    "would leave, so that a recovery does not compile.",
)
_BALANCE = flags.DEFINE_bool(
    "balance",
    False,
    "Multi-process: measure each process's groups' speed and give slow groups fewer "
    "micro-batches when that shortens the step (exact; a straggler event says so).",
)
_SHARDED_CHECKPOINTS = flags.DEFINE_bool(
    "sharded_checkpoints",
    None,
    "Multi-process: every live process writes its part of each checkpoint from its devices "
    "(about 1/G each; the default). --nosharded_checkpoints: one writer saves its whole "
    "replica from its host (whole groups per process only).",
)


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


def _start_jax() -> bool:
    """Start JAX alone or joined to its multi-process job; True when joined."""
    launched = multihost.ENV["num_processes"] in os.environ
    if _COMPILATION_CACHE.value and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(_WORKDIR.value, "jax_cache"))
    if _DISTRIBUTED.value:  # JAX detects the cluster (SLURM and the like)
        jax.config.update("jax_num_cpu_devices", _HOST_DEVICES.value)
        multihost.initialize(
            coordinator_address=None,
            num_processes=None,
            process_id=None,
            heartbeat_s=_HEARTBEAT_S.value or multihost.DEFAULT_HEARTBEAT_S,
        )
        return True
    explicit = (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if any(v is not None for v in explicit) and None in explicit:
        cli.fail("give --coordinator_address, --num_processes and --process_id together")
    if _PROCESS_ID.value is not None and _PROCESS_ID.value >= _NUM_PROCESSES.value:
        cli.fail(f"--process_id must lie in [0, {_NUM_PROCESSES.value})")
    return spare_jax.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
        heartbeat_s=_HEARTBEAT_S.value,
        collective_timeout_s=_COLLECTIVE_TIMEOUT_S.value,
        local_devices=None if launched else _HOST_DEVICES.value,
    )


def main(argv: list[str]) -> None:
    del argv
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
    if _CHECKPOINT_STEPS.value is not None:  # one source: the flag overrides the config
        config.checkpoint.steps = _CHECKPOINT_STEPS.value
    if _FAILURES.value and _FAILURE_RATE.value:
        cli.fail("give either --failures or --failure_rate, not both")
    try:
        experiment.validate(config)
        axes = dict(experiment.mesh_axes(config))
        groups = axes["data"] * axes["redundancy"]
        schedule = liveness.parse_schedule(_FAILURES.value, groups, config.steps)
        failures = liveness.Failures(
            groups,
            schedule=schedule,
            rate=_FAILURE_RATE.value,
            repair_steps=_REPAIR_STEPS.value,
            seed=config.seed,
        )
        workdir = _workdir(_WORKDIR.value)  # checked before any work, created once all is valid
        joined = _start_jax()
        mesh = spare_jax.make_mesh(experiment.mesh_axes(config))
        if joined:
            multihost.group_processes(mesh)  # no process may hold parts of two groups
        run = experiment.setup(config, mesh)
    except (ValueError, RuntimeError) as err:
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
    sys.exit(_train(run, failures, workdir, config, joined))


def _save_params(workdir: str, params: object) -> None:
    """This process's final parameters, ``WORKDIR/params-<process>.npz``, keyed by tree path."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    path = os.path.join(workdir, f"params-{jax.process_index()}.npz")
    np.savez(path, **{jax.tree_util.keystr(k): v for k, v in leaves})


def _train(run, failures, workdir, config, joined) -> int:
    """Train with a progress bar; the exit status."""
    prog = os.path.basename(sys.argv[0])
    bar = tqdm(
        total=config.steps,
        desc="train",
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=joined,
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

    ck = config.checkpoint
    try:
        result = spare_jax.fit(
            run.step,
            run.init,  # built in its shards, and only when the job starts afresh
            run.batch,
            steps=int(config.steps),
            workdir=workdir,
            failures=failures,
            checkpoint_steps=int(ck.steps) or None,
            gpu_mtbf_hours=float(ck.gpu_mtbf_hours),
            max_rollbacks=int(ck.max_rollbacks),
            keep=int(ck.keep),
            warmup_steps=int(ck.warmup_steps),
            precompile_failures=_PRECOMPILE.value,
            balance=_BALANCE.value,
            sharded_checkpoints=_SHARDED_CHECKPOINTS.value,
            on_step=on_step,
            compile_cache=None if _COMPILATION_CACHE.value else False,  # set in _start_jax
        )
    except errors.FitError as err:
        bar.close()
        label = "error: " if err.exit_status == errors.EXIT_BAD_INPUT else ""
        sys.stderr.write(f"{prog}: {label}{err}\n")
        return err.exit_status
    bar.close()
    _save_params(workdir, result.params)
    if not result.writer:
        return 0  # one process (the writer) reports
    summary = result.summary
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

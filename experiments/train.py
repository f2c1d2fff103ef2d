"""Train the Flax LM through group failures with SPARe, replication or plain DP.

    python experiments/train.py --workdir=runs/demo --failures=40:1,90:2
    python experiments/train.py --config=configs/lm_tiny.py:smoke --strategy=replication
    python experiments/train.py --failure_rate=0.01 --seed=3 --config.model.layers=4

Flags override the config file's fields of the same name. Writes
WORKDIR/metrics.jsonl (one JSON object per step). Exit status: 0 done, 2 bad
flags, 3 interrupted (a shard lost every live holder; rollback needs
checkpointing). On CPU, ``--host_devices`` simulated devices are created (it
must be read before JAX starts, so it is taken from the command line early).
"""

from __future__ import annotations

import os
import sys


def _early_host_devices(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg.startswith("--host_devices="):
            value = arg.split("=", 1)[1]
        elif arg == "--host_devices" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        return int(value) if value.isdigit() else 8
    return 8


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
        f"{_early_host_devices(sys.argv)}"
    ).strip()

from absl import flags, logging
from ml_collections import config_flags
from tqdm import tqdm

from spare_jax import cli, trainer

_DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "lm_tiny.py"
)
try:  # --config.x=... overrides of the default file are resolved right here
    _CONFIG = config_flags.DEFINE_config_file(
        "config",
        default=os.path.normpath(_DEFAULT_CONFIG),
        help_string="Training config file.",
        lock_config=True,
    )
except (AttributeError, KeyError, TypeError, ValueError) as _err:
    cli.fail(f"bad --config override: no config field {str(_err).strip(chr(34))}")
_STRATEGY = flags.DEFINE_enum(
    "strategy", None, list(trainer.STRATEGIES), "Placement (default: config)."
)
_REDUNDANCY = flags.DEFINE_integer(
    "redundancy", None, "Redundancy r (ignored for dp).", lower_bound=1
)
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", None, "Micro-batches per shard m.", lower_bound=1
)
_POLICY = flags.DEFINE_enum(
    "policy",
    None,
    list(trainer.POLICIES),
    "adaptive (optimal reordering), fixed (stack order) or drop (INEXACT baseline).",
)
_FAILURES = flags.DEFINE_string(
    "failures", "", "Explicit schedule step:group,step:group,... (groups stay dead)."
)
_FAILURE_RATE = flags.DEFINE_float(
    "failure_rate",
    0.0,
    "Per-step failure probability of each live group.",
    lower_bound=0.0,
    upper_bound=1.0,
)
_SEED = flags.DEFINE_integer(
    "seed", None, "Seed of the model, data and random failures (default: config)."
)
_STEPS = flags.DEFINE_integer("steps", None, "Training steps (default: config).", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "runs/train", "Output directory for metrics.jsonl.")
flags.DEFINE_integer(
    "host_devices", 8, "Simulated CPU devices (read before JAX starts).", lower_bound=1
)

INTERRUPTED_EXIT = 3


def _config() -> object:
    try:
        config = _CONFIG.value
        config.get("steps")  # a config file that failed to load raises on first access
        return config
    except (OSError, AttributeError, KeyError, ValueError) as error:
        cli.fail(f"cannot load --config: {cli.one_line(error)}")


def main(argv: list[str]) -> None:
    del argv
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
        trainer.validate(config)
        groups = int(config.mesh[0]) * int(config.mesh[1])
        explicit = trainer.parse_failures(_FAILURES.value, groups, config.steps)
        schedule = trainer.FailureSchedule(explicit, _FAILURE_RATE.value, config.seed)
        run = trainer.setup(config)
    except ValueError as err:
        cli.fail(str(err))
    logging.info(
        "mesh %s, %s, G=%d groups, r=%d, m=%d, policy %s, slot bound %d",
        dict(run.mesh.shape),
        run.placement,
        run.placement.groups,
        run.placement.redundancy,
        run.microbatches,
        config.policy,
        run.step_fn.slot_bound,
    )
    if config.policy == "drop":
        logging.warning("policy=drop is the INEXACT drop-and-renormalise baseline")
    bar = tqdm(total=config.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)

    def on_step(record: dict) -> None:
        bar.update(1)
        bar.set_postfix(
            loss=f"{record['loss']:.3f}", live=record["live_groups"], load=record["max_load"]
        )
        if record["step"] % config.log_every == 0 or record["step"] == config.steps - 1:
            bar.clear()  # keep the log line and the progress bar on separate lines
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
        records = trainer.train(run, config.steps, schedule, _WORKDIR.value, on_step)
    except trainer.TrainingInterrupted as err:
        bar.close()
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: {err}\n")
        sys.exit(INTERRUPTED_EXIT)
    bar.close()
    last = records[-1]
    print(
        f"done: {len(records)} steps, final loss {last['loss']:.4f}, "
        f"live groups {last['live_groups']}, "
        f"compiles {last['compiles']}; metrics in {os.path.join(_WORKDIR.value, 'metrics.jsonl')}"
    )


if __name__ == "__main__":
    cli.run(main)

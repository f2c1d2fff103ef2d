"""The LM's training as a multi-process job on this machine: `spare_jax.launch` around train.py.

    python experiments/launch.py --processes=4 --kill=20:2 --workdir=runs/mp
    python experiments/launch.py --processes=4 --kill=5:1 --kill=5:2 \\
        --config=configs/lm_tiny.py:smoke --workdir=runs/mp2

A thin wrapper: every train.py flag passes through (``--workdir`` included);
it works out each worker's devices from the config's mesh and runs
``python -m spare_jax.launch --launch_dir=WORKDIR/launch -- python
experiments/train.py ...``. ``--kill=STEP:PROCESS`` SIGKILLs that worker in the
middle of that step; the survivors take the dead groups' work and go on; an
interruption relaunches the job, which rolls back. Any other command (your own
training script) runs the same way under ``python -m spare_jax.launch``.

Writes under ``--workdir``: train.py's ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``, and ``launch/`` with every worker's log. Exit status: that
of `spare_jax.launch` (0 complete, 2 bad flags, 3 too many relaunches, 143
preempted, else a worker's verdict, e.g. 4 non-finite loss, 5 a checkpoint
could not be written).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import train  # experiments/ is on sys.path: defines every train.py flag here too
from absl import app, flags
from lm import setup as experiment

from spare_jax import cli, launch

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
    "A job in which no worker makes progress for this long counts as hung: killed, relaunched.",
    lower_bound=1.0,
)
_REPLACE_S = flags.DEFINE_float(
    "replace_after_s",
    None,
    "Start a replacement for a worker this long after the job declared it dead: it joins the "
    "running job with a live peer's state (hot re-join). Unset: back at the next relaunch.",
    lower_bound=0.0,
)
_SPARES = flags.DEFINE_integer(
    "spares",
    0,
    "With --replace_after_s: warm spares kept waiting with their imports done, so that a "
    "replacement skips starting Python and JAX (python -m spare_jax.launch --help).",
    lower_bound=0,
)
_EVICT_S = flags.DEFINE_float(
    "evict_after_s",
    30.0,
    "Evict a worker that stands still while its peers wait for it this long (or 10 median "
    "steps when longer); 0: never (python -m spare_jax.launch --help).",
    lower_bound=0.0,
)
OWN_FLAGS = (
    "evict_after_s",
    "processes",
    "devices_per_process",
    "kill",
    "max_relaunches",
    "hang_timeout_s",
    "replace_after_s",
    "spares",
)
# The launcher's timeouts for a job on one machine (a dead worker is seen in seconds).
LOCAL = {"heartbeat_s": 3, "collective_timeout_s": 2}


def _passthrough(argv: list[str]) -> list[str]:
    """The command-line arguments meant for train.py (every one but the wrapper's own)."""
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


def main(argv: list[str]) -> None:
    del argv  # absl leaves only the program name; the flags are read from sys.argv
    config = train._config()
    for name, flag in (("steps", train._STEPS), ("seed", train._SEED)):
        if flag.value is not None:
            config[name] = flag.value
    try:
        axes = experiment.mesh_axes(config)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    sizes = [size for _, size in axes]
    devices, per_group = int(np.prod(sizes)), int(np.prod(sizes[2:]))
    k = _PROCESSES.value
    dpp = _DEVICES_PER_PROCESS.value or (devices // k if devices % k == 0 else 0)
    if dpp * k != devices:
        raise app.UsageError(
            f"--processes={k} x --devices_per_process must equal the mesh's "
            f"{devices} devices {dict(axes)}"
        )
    if dpp % per_group and per_group % dpp:
        raise app.UsageError(
            f"each process's {dpp} devices would hold parts of two groups of {per_group}: "
            "devices per process must divide a group's devices or be a multiple of them"
        )
    try:
        kills = launch.parse_kills(_KILL.value, k)
    except ValueError as err:
        raise app.UsageError(str(err)) from None
    for proc, step in kills.items():
        if step >= int(config.steps):
            raise app.UsageError(
                f"--kill={step}:{proc}: step must lie in [0, steps={config.steps})"
            )
    workdir = train._workdir(train._WORKDIR.value)
    timeouts = {
        name: getattr(train, f"_{name.upper()}").value or value for name, value in LOCAL.items()
    }
    options = launch.Options(
        processes=k,
        devices_per_process=dpp,
        kills=kills,
        max_relaunches=_MAX_RELAUNCHES.value,
        hang_timeout_s=_HANG_S.value,
        heartbeat_s=timeouts["heartbeat_s"],
        collective_timeout_s=timeouts["collective_timeout_s"],
        log_dir=os.path.join(workdir, "launch"),
        replace_after_s=_REPLACE_S.value,
        spares=_SPARES.value,
        evict_after_s=_EVICT_S.value,
    )
    command = [sys.executable, train.__file__, *_passthrough(sys.argv)]
    code = launch.launch(command, options)
    if code:
        sys.exit(code)
    summary_path = os.path.join(workdir, "summary.json")
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    print(
        f"done: step {summary['final_step']}, final loss {summary['final_loss']:.4f}, "
        f"rollbacks {summary['rollbacks']}, lost processes {summary['lost_processes']}, "
        f"checksum {summary['param_checksum']:.10g}; {summary_path}"
    )


if __name__ == "__main__":
    cli.run(main)

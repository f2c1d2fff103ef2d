"""A user script whose data loader misbehaves on cue: faults a test makes by creating files.

    python tests/cued_worker.py --workdir=runs/x --steps=30 --checkpoint_steps=5

The model, optimizer and batches are ``experiments/regression.py``'s (so the
tests' `jax.grad` reference holds); only the loader differs. Before building
each batch, worker ``p`` looks for cue files in ``WORKDIR/cues/``:

* ``hang-<p>``: the loader blocks for good (a hung network file system), its
  heartbeat alive;
* ``raise-<p>``: the loader raises ``OSError`` once (the cue is removed first);
* ``slow-save-<p>`` (seconds inside): this worker's next checkpoint save
  takes that much longer (a slow disk);
* ``slow-compile-<p>`` (seconds inside): this worker's next ahead-of-time
  compile takes that much longer (a slow compiler, a cold cache).

``--rows`` makes every batch the wrong size (a bug in the user's script: every
worker raises); ``--local_devices`` passes ``local_devices`` to
``spare_jax.initialize`` (a contradiction of the launcher's devices).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import jax
import numpy as np
import regression
from absl import flags

import spare_jax
from spare_jax import checkpoint, cli
from spare_jax import train_step as step_lib

_ROWS = flags.DEFINE_integer("rows", None, "Rows of every batch (default: the right number).")
_LOCAL = flags.DEFINE_integer("local_devices", None, "Passed to spare_jax.initialize.")
_PRECOMPILE = flags.DEFINE_bool("precompile_failures", False, "Passed to spare_jax.fit.")


def _cue(workdir: str, name: str) -> pathlib.Path:
    return pathlib.Path(workdir) / "cues" / f"{name}-{jax.process_index()}"


def _seconds(path: pathlib.Path) -> float:
    """The seconds a one-shot cue asks for (0 without one); the cue is used up."""
    try:
        seconds = float(path.read_text().strip() or 0)
        path.unlink()
    except (OSError, ValueError):
        return 0.0
    print(f"cue: {path.name}: {seconds:.0f} s longer", flush=True)
    return seconds


def _loader(workdir: str, rows: int | None):
    """``regression.batches`` behind a loader that hangs or raises on cue."""

    def batches(t: int) -> dict[str, np.ndarray]:
        hang, fail = _cue(workdir, "hang"), _cue(workdir, "raise")
        if hang.exists():
            print(f"loader: step {t}: blocked on {hang}", flush=True)
            while True:  # a read that never returns; other threads run on
                time.sleep(1.0)
        if fail.exists():
            fail.unlink()
            raise OSError(5, f"Input/output error reading shard {t} (cued by {fail.name})")
        return regression.batches(t) if rows is None else regression.batches(t, rows)

    return batches


def _slow(workdir: str) -> None:
    """Checkpoint saves and compiles that take longer on cue (a slow disk, a slow compiler)."""
    save, precompile = checkpoint.Checkpointer.save, step_lib.SpareStep.precompile

    def slow_save(self, *args, **kwargs):
        time.sleep(_seconds(_cue(workdir, "slow-save")))
        return save(self, *args, **kwargs)

    def slow_precompile(self, *args, **kwargs):
        time.sleep(_seconds(_cue(workdir, "slow-compile")))
        return precompile(self, *args, **kwargs)

    checkpoint.Checkpointer.save = slow_save
    step_lib.SpareStep.precompile = slow_precompile


def main(argv: list[str]) -> None:
    del argv
    workdir = cli.output_dir("workdir", regression._WORKDIR.value)
    print(f"workdir: {workdir}", flush=True)
    local = {} if _LOCAL.value is None else {"local_devices": _LOCAL.value}
    if not spare_jax.initialize(**local):
        jax.config.update("jax_num_cpu_devices", 8)
    _slow(workdir)
    mesh = spare_jax.make_mesh((1, 4, 2))
    step = spare_jax.make_train_step(
        regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2
    )
    result = spare_jax.fit(
        step,
        regression.init_params(),
        _loader(workdir, _ROWS.value),
        steps=regression._STEPS.value,
        workdir=workdir,
        checkpoint_steps=regression._CHECKPOINT_STEPS.value or None,
        precompile_failures=_PRECOMPILE.value,
    )
    np.savez(os.path.join(workdir, f"params-{jax.process_index()}.npz"), **result.params)
    print(f"done: step {result.summary['final_step']}", flush=True)


if __name__ == "__main__":
    cli.run(main)

"""A model that is not ours, trained through failures by `spare_jax.fit`: the user-script example.

    python experiments/regression.py --workdir=runs/reg --failures=3:1,6:2
    python -m spare_jax.launch --processes=4 --devices_per_process=2 -- \\
        python experiments/regression.py --workdir=runs/reg4

A two-layer MLP written as a plain dict of arrays, a squared loss, AdamW, a
mesh of 4 groups of 2 devices (r = 2, m = 2), and batches that are a pure
function of the step. Everything fault-tolerant comes from three calls:
`spare_jax.initialize`, `spare_jax.make_train_step`, `spare_jax.fit`. At the
end each process writes its parameters to ``WORKDIR/params-<process>.npz``
(the tests compare them, leaf by leaf, to a single-device `jax.grad` run).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import spare_jax
from spare_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", "runs/regression", "Output directory.")
_STEPS = flags.DEFINE_integer("steps", 12, "Training steps.", lower_bound=1)
_FAILURES = flags.DEFINE_string("failures", "", "Simulated failures STEP:GROUP,...")
_CHECKPOINT_STEPS = flags.DEFINE_integer(
    "checkpoint_steps", 0, "Checkpoint interval; 0: the analytical model's.", lower_bound=0
)
_MESH = flags.DEFINE_list(
    "mesh", ["1", "4", "2"], "Mesh sizes (data, redundancy, model): 4 groups of 2 devices."
)
ROWS = 4  # rows of one micro-batch
MICROBATCHES = 2


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(8, 16)) / np.sqrt(8)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": (rng.normal(size=(16, 1)) / 4).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def batches(t: int, rows: int = 4 * MICROBATCHES * ROWS) -> dict[str, np.ndarray]:
    # rows = G * m * b: 4 groups (the default mesh; any mesh with 4 groups takes these batches)
    """The failure-free global batch of step t: the same for every process and every retry."""
    rng = np.random.default_rng([1234, t])
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)}


OPTIMIZER = optax.adamw(1e-2)


def main(argv: list[str]) -> None:
    del argv
    workdir = cli.output_dir("workdir", _WORKDIR.value)
    if not spare_jax.initialize():  # a lone process: simulate the mesh's devices on CPU
        jax.config.update("jax_num_cpu_devices", 8)

    shape = tuple(int(x) for x in _MESH.value)
    if len(shape) != 3 or shape[0] * shape[1] != 4:
        raise app.UsageError(
            f"--mesh must have 3 sizes with 4 groups (data x redundancy), got {shape}"
        )
    mesh = spare_jax.make_mesh(shape)
    step = spare_jax.make_train_step(
        loss_fn, OPTIMIZER, mesh, redundancy=2, microbatches=MICROBATCHES
    )
    result = spare_jax.fit(
        step,
        init_params(),
        batches,
        steps=_STEPS.value,
        workdir=workdir,
        failures=_FAILURES.value or None,
        checkpoint_steps=_CHECKPOINT_STEPS.value or None,
    )
    path = os.path.join(workdir, f"params-{jax.process_index()}.npz")
    np.savez(path, **result.params)
    print(f"done: step {result.summary['final_step']}, loss {result.summary['final_loss']:.6f}")


if __name__ == "__main__":
    cli.run(main)

"""A model that is not ours, trained through failures by `spare_jax.fit`: the user-script example.

    python experiments/regression.py --workdir=runs/reg --failures=3:1,6:2
    python -m spare_jax.launch --processes=4 --devices_per_process=2 -- \\
        python experiments/regression.py --workdir=runs/reg4
    python -m spare_jax.launch --processes=8 --devices_per_process=1 -- \\
        python experiments/regression.py --workdir=runs/hsdp \\
        --mesh=data:1,redundancy:4,fsdp:2 --input=units

A two-layer MLP written as a plain dict of arrays (given to `fit` as the
function that builds it), a squared loss, AdamW, a
mesh of 4 groups of 2 devices (r = 2, m = 2), and batches that are a pure
function of the step. ``--mesh`` takes the three sizes ``data,redundancy,model``
(parameters replicated in a group) or named axes: the first inner axis shards
the parameters and the micro-batches' rows FSDP-style, a second one shards the
hidden layer tensor-style. ``--input=units`` reads only the rows of the groups
each process holds (``batches(t, units)``, `spare_jax.inputs`); ``global``
builds the whole global batch on every process. The last line says how many
rows this process read. ``--balance`` gives groups measured to be slow fewer
micro-batches (multi-process). ``--compile_cache`` places JAX's persistent
compilation cache (default ``WORKDIR/compile_cache``; ``off``: none).
Everything fault-tolerant comes from three calls:
`spare_jax.initialize`, `spare_jax.make_train_step`, `spare_jax.fit`. At the
end each process writes its parameters to ``WORKDIR/params-<process>.npz``
(the tests compare them, leaf by leaf, to a single-device `jax.grad` run).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import spare_jax
from spare_jax import cli, inputs
from spare_jax import mesh as mesh_lib

_WORKDIR = flags.DEFINE_string("workdir", "runs/regression", "Output directory.")
_STEPS = flags.DEFINE_integer("steps", 12, "Training steps.", lower_bound=1)
_FAILURES = flags.DEFINE_string("failures", "", "Simulated failures STEP:GROUP,...")
_CHECKPOINT_STEPS = flags.DEFINE_integer(
    "checkpoint_steps", 0, "Checkpoint interval; 0: the analytical model's.", lower_bound=0
)
_MESH = flags.DEFINE_list(
    "mesh",
    ["1", "4", "2"],
    "Mesh: sizes data,redundancy,model, or named axes such as data:1,redundancy:4,fsdp:2 "
    "(2 or more groups; the global batch has 8 rows per group).",
)
_INPUT = flags.DEFINE_enum(
    "input", "global", ["global", "units"], "batches(t) on every process, or per-unit rows."
)
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    "",
    "JAX's persistent compilation cache: a directory; '' for fit's default "
    "(WORKDIR/compile_cache); 'off' for none.",
)
_BALANCE = flags.DEFINE_bool(
    "balance",
    False,
    "Multi-process: give groups measured to be slow fewer micro-batches (spare_jax.balancing).",
)
_SHARDED_CHECKPOINTS = flags.DEFINE_bool(
    "sharded_checkpoints",
    None,
    "Multi-process: every live process writes its part of each checkpoint from its devices "
    "(about 1/G each; the default). --nosharded_checkpoints: one writer saves its whole "
    "replica from its host (whole groups per process only).",
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


def initial_params() -> dict[str, jax.Array]:
    """`init_params` in the form `fit` takes at scale: a function of no arguments, which
    it runs as one program born in the parameters' shards, and only when the job starts
    afresh (a resumed job or a replacement takes the state, never builds it)."""
    return jax.tree.map(jnp.asarray, init_params())


def loss_fn(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def unit_rows(t: int, unit: int) -> dict[str, np.ndarray]:
    """The ``ROWS`` rows of micro-batch ``unit`` of step ``t``: a pure function of both."""
    x = np.random.default_rng([1234, t, unit]).normal(size=(ROWS, 8)).astype(np.float32)
    return {"x": x, "y": np.sin(x.sum(1, keepdims=True)).astype(np.float32)}


def batches(t: int, rows: int = 4 * MICROBATCHES * ROWS) -> dict[str, np.ndarray]:
    # rows = G * m * b: 4 groups (the default mesh; any mesh with 4 groups takes these batches)
    """The failure-free global batch of step t: the same for every process and every retry."""
    units = [unit_rows(t, u) for u in range(rows // ROWS)]
    return {k: np.concatenate([u[k] for u in units]) for k in ("x", "y")}


def unit_batches(t: int, units: inputs.Units) -> dict[str, np.ndarray]:
    """Only the rows this process needs: ``units.rows(ROWS)`` of each unit it asks for."""
    part = units.rows(ROWS)
    rows = [unit_rows(t, int(u)) for u in units.ids]
    return {k: np.stack([r[k][part] for r in rows]) for k in ("x", "y")}


def layout(mesh: jax.sharding.Mesh) -> tuple[dict[str, jax.P] | None, tuple[str, ...]]:
    """Parameter specs and batch axes: FSDP over the first inner axis, tensor over a second."""
    inner = tuple(a for a in mesh.axis_names[2:])
    if mesh.axis_names == ("data", "redundancy", "model"):
        return None, ()  # the three-number form: replicated in a group, as before
    fsdp, tensor = inner[0], (inner[1] if len(inner) > 1 else None)
    specs = {
        "w1": jax.P(fsdp, tensor),
        "b1": jax.P(tensor),
        "w2": jax.P((tensor, fsdp) if tensor else fsdp, None),
        "b2": jax.P(),
    }
    return specs, (fsdp,)


OPTIMIZER = optax.adamw(1e-2)


def main(argv: list[str]) -> None:
    del argv
    workdir = cli.output_dir("workdir", _WORKDIR.value)
    compile_cache: str | bool | None = None  # '': fit's default place
    if _COMPILE_CACHE.value == "off":
        compile_cache = False
    elif _COMPILE_CACHE.value:
        compile_cache = cli.output_dir("compile_cache", _COMPILE_CACHE.value)
    if not spare_jax.initialize():  # a lone process: simulate the mesh's devices on CPU
        jax.config.update("jax_num_cpu_devices", 8)

    text = ",".join(_MESH.value)
    try:
        shape = text if ":" in text else tuple(int(x) for x in _MESH.value)
        axes = dict(mesh_lib.parse_axes(shape))
    except ValueError as err:
        raise app.UsageError(f"--mesh: {err}") from None
    groups = axes["data"] * axes["redundancy"]
    if groups < 2:
        raise app.UsageError(f"--mesh must have 2 or more groups (data x redundancy), got {text}")
    try:
        mesh = spare_jax.make_mesh(shape)
        specs, batch_axes = layout(mesh)
        step = spare_jax.make_train_step(
            loss_fn,
            OPTIMIZER,
            mesh,
            redundancy=2,
            microbatches=MICROBATCHES,
            param_specs=specs,
            batch_axes=batch_axes,
        )
        step.state_shardings(init_params())  # the specs against the parameters' shapes
    except ValueError as err:
        raise app.UsageError(f"--mesh: {err}") from None
    result = spare_jax.fit(
        step,
        initial_params,
        functools.partial(batches, rows=groups * MICROBATCHES * ROWS)
        if _INPUT.value == "global"
        else unit_batches,
        steps=_STEPS.value,
        workdir=workdir,
        failures=_FAILURES.value or None,
        checkpoint_steps=_CHECKPOINT_STEPS.value or None,
        compile_cache=compile_cache,
        balance=_BALANCE.value,
        sharded_checkpoints=_SHARDED_CHECKPOINTS.value,
    )
    path = os.path.join(workdir, f"params-{jax.process_index()}.npz")
    np.savez(path, **result.params)
    summary = result.summary
    print(
        f"done: step {summary['final_step']}, loss {summary['final_loss']:.6f}, "
        f"rows loaded {result.input_rows}"
    )


if __name__ == "__main__":
    cli.run(main)

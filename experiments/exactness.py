"""What "exact" means over a long run: dead groups against a failure-free run, fp32 and fp64.

    python experiments/exactness.py --dtype=float32 --steps=6000
    python experiments/exactness.py --dtype=float64 --steps=6000

``experiments/regression.py``'s model (4 groups of 2 CPU devices, r = 2, m =
2, AdamW) trained three ways over the same batches, step by step in one
process: SPARe's step with ``--dead`` groups dead from step 0 (their shards
computed by the survivors), the same step failure-free, and a plain
single-device `jax.grad` + optax loop. Printed at a few steps: the largest
absolute difference over every parameter between the runs, and the
parameters' largest magnitude. Every step of the three sums the same
gradients in a different order, so they differ by round-off, and AdamW
carries a difference from one step to the next: in float32 it grows with the
run, in float64 it stays near 1e-15. Prints a table (``--json``: one object).
"""

from __future__ import annotations

import json

import regression  # experiments/ is on sys.path when this file runs as a script
from absl import app, flags

import spare_jax
from spare_jax import cli, reorder

FLAGS = flags.FLAGS
FLAGS.set_default("steps", 6000)  # regression.py's --steps: the run's length
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "float64"], "Parameters and data.")
_DEAD = flags.DEFINE_list("dead", ["1", "3"], "Groups dead from step 0 (of 4).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")


def _report_at(steps: int) -> list[int]:
    marks = [m for m in (10, 100, 1000, 3000) if m < steps]
    return [*marks, steps]


def main(argv: list[str]) -> None:
    del argv
    dead = [int(g) for g in _DEAD.value]
    if any(not 0 <= g < 4 for g in dead) or len(set(dead)) != len(dead):
        raise app.UsageError(f"--dead must name distinct groups in 0..3, got {_DEAD.value}")
    import jax  # after the flags: the dtype decides x64 before JAX starts

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_x64", _DTYPE.value == "float64")
    import numpy as np
    import optax

    dtype = np.dtype(_DTYPE.value)
    cast = lambda tree: jax.tree.map(lambda x: np.asarray(x, dtype), tree)
    mesh = spare_jax.make_mesh((1, 4, 2))
    step = spare_jax.make_train_step(
        regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2
    )
    alive = np.ones(4, bool)
    alive[dead] = False
    try:
        step.table(alive)
    except reorder.Interruption as err:  # a shard with no live holder: no exact step exists
        raise app.UsageError(f"--dead {dead} leaves a shard with no live holder: {err}") from None
    params = cast(regression.init_params())
    masked, clean = step.init(params), step.init(params)
    dev = jax.devices()[0]
    ref = jax.device_put(params, dev)
    opt = regression.OPTIMIZER.init(ref)
    grad = jax.jit(jax.grad(regression.loss_fn))
    host = lambda tree: {k: np.asarray(jax.device_get(v), np.float64) for k, v in tree.items()}
    gap = lambda a, b: max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    rows = []
    marks = set(_report_at(FLAGS.steps))
    for t in range(FLAGS.steps):
        batch = cast(regression.batches(t))
        masked, _ = step(masked, batch, alive)
        clean, _ = step(clean, batch, np.ones(4, bool))
        updates, opt = regression.OPTIMIZER.update(grad(ref, jax.device_put(batch, dev)), opt, ref)
        ref = optax.apply_updates(ref, updates)
        if t + 1 in marks:
            m, c, r = host(masked.params), host(clean.params), host(ref)
            rows.append(
                {
                    "step": t + 1,
                    "dead_vs_failure_free": gap(m, c),
                    "dead_vs_jax_grad": gap(m, r),
                    "failure_free_vs_jax_grad": gap(c, r),
                    "max_abs_param": max(float(np.max(np.abs(v))) for v in r.values()),
                }
            )
    result = {"dtype": _DTYPE.value, "dead_groups": dead, "rows": rows}
    if _JSON.value:
        print(json.dumps(result))
        return
    print(f"{_DTYPE.value}, groups {dead} dead from step 0: largest |difference| of any parameter")
    print("step    dead vs failure-free  dead vs jax.grad  failure-free vs jax.grad  max |param|")
    for r in rows:
        print(
            f"{r['step']:<7d} {r['dead_vs_failure_free']:<21.2e} {r['dead_vs_jax_grad']:<17.2e} "
            f"{r['failure_free_vs_jax_grad']:<25.2e} {r['max_abs_param']:.3g}"
        )


if __name__ == "__main__":
    cli.run(main)

"""spare_jax: SPARe (Stacked Parallelism with Adaptive Reordering) in JAX.

The library entry point is two functions, loaded on first use so that the
analysis and the simulator do not import JAX:

    mesh = spare_jax.make_mesh((1, 4, 2))            # (data, redundancy, model)
    step = spare_jax.make_train_step(loss_fn, optax.adamw(1e-3), mesh, redundancy=2)

Modules. The SPARe core: `strategies` (names and the placement each builds),
`placement` (who holds which shard), `reorder` (optimal assignment of work to
survivors), `incremental` (per-failure load updates). The model of a cluster:
`scenario`, `analysis` (closed forms, time-to-train, optimiser), `sim`
(discrete-event simulator). The data plane: `mesh`, `slots` (a step's slot
table), `train_step` (the step and `make_train_step`), `model`, `data`,
`liveness` (failures and re-joins of a run), `checkpoint` (Orbax at the
model's interval), `runlog` (metrics and summary files), `trainer` (the loop),
`multihost` (real process failures). `checks` and `cli` hold argument checks
and the binaries' command-line plumbing.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["make_mesh", "make_train_step"]


def __getattr__(name: str) -> Any:
    if name == "make_mesh":
        from spare_jax.mesh import make_mesh

        return make_mesh
    if name == "make_train_step":
        from spare_jax.train_step import make_train_step

        return make_train_step
    raise AttributeError(f"module 'spare_jax' has no attribute {name!r}")

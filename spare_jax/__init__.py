"""spare_jax: SPARe (Stacked Parallelism with Adaptive Reordering) in JAX.

The library entry points, loaded on first use so that the analysis and the
simulator do not import JAX:

    spare_jax.initialize()                           # joins a launched job, else nothing
    mesh = spare_jax.make_mesh((1, 4, 2))            # (data, redundancy, model)
    step = spare_jax.make_train_step(loss_fn, optax.adamw(1e-3), mesh, redundancy=2)
    result = spare_jax.fit(step, params, batches, steps=1000, workdir="runs/mine")

and ``python -m spare_jax.launch --processes=K -- CMD`` to run any worker
command as a K-process job that survives the loss of any of its processes.

Modules. The SPARe core: `strategies` (names and the placement each builds),
`placement` (who holds which shard), `reorder` (optimal assignment of work to
survivors), `incremental` (per-failure load updates). The model of a cluster:
`scenario`, `analysis` (closed forms, time-to-train, optimiser), `sim`
(discrete-event simulator). The data plane: `mesh`, `slots` (a step's slot
table), `train_step` (the step and `make_train_step`), `inputs` (what each process
reads: the global batch or only its own units' rows). Fault tolerance:
`fitting` (`fit`), `trainer` (the one owner of a run; its parts `saving`, `recovery`,
`admission`, `balancing` (slow groups given fewer micro-batches)), `domains` (the
multi-process step split by failure domain),
`broadcast` (one group's state to others over the devices, for a re-join),
`compile_cache` (JAX's persistent compilation cache), `liveness` (simulated failures and
re-joins), `checkpoint` (Orbax at the model's interval), `digest` (a checkpoint's
per-array digest), `runlog` (metrics,
summary, notices), `multihost` (real process failures), `errors` (exit
statuses), `launch` (the launcher), `testing` (the fault injector), `jax_internals`
(the JAX private names used, checked at import). `checks`
and `cli` hold argument checks and the binaries' command-line plumbing.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["FitError", "FitResult", "fit", "initialize", "make_mesh", "make_train_step"]


def initialize(**overrides: Any) -> bool:
    """Join the multi-process job this process was launched into; a no-op in a lone process.

    Call first, before any JAX computation. Under ``python -m spare_jax.launch``
    it reads the coordinator, the process id and count and the timeouts from
    the ``SPARE_JAX_*`` variables and joins with recoverable failures on.
    Keywords (``coordinator_address``, ``num_processes``, ``process_id``,
    ``heartbeat_s``, ``collective_timeout_s``, ``local_devices``) override them;
    one that contradicts a launcher's job (``local_devices=8`` where it gives
    each worker 2) is refused with a ValueError naming both.
    Returns True when this process joined a multi-process job.
    """
    from spare_jax.multihost import initialize_job

    return initialize_job(**overrides)


def __getattr__(name: str) -> Any:
    if name == "make_mesh":
        from spare_jax.mesh import make_mesh

        return make_mesh
    if name == "make_train_step":
        from spare_jax.train_step import make_train_step

        return make_train_step
    if name in ("fit", "FitResult"):
        from spare_jax import fitting

        return getattr(fitting, name)
    if name == "FitError":
        from spare_jax.errors import FitError

        return FitError
    raise AttributeError(f"module 'spare_jax' has no attribute {name!r}")

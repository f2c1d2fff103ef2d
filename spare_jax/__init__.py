"""spare_jax: SPARe (Stacked Parallelism with Adaptive Reordering) in JAX.

Modules: `placement` (who holds which shard), `reorder` (optimal assignment of
work to survivors), `scenario`, `analysis` (closed forms, time-to-train,
optimiser), `sim` (discrete-event simulator); the JAX data plane in `mesh`,
`model`, `data`, `train_step`.
"""

__version__ = "0.1.0"

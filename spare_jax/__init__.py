"""spare_jax: SPARe (Stacked Parallelism with Adaptive Reordering) in JAX.

The SPARe core: `placement` (who holds which shard), `reorder` (optimal
assignment of work to survivors), `incremental` (per-failure load updates).
The model of a cluster: `scenario`, `analysis` (closed forms, time-to-train,
optimiser), `sim` (discrete-event simulator). The JAX data plane: `mesh`,
`model`, `data`, `train_step`, `trainer`. `cli` holds the binaries' shared
command-line plumbing.
"""

__version__ = "0.1.0"

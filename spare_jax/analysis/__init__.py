"""Closed forms for SPARe, replication and checkpoint/restart; time-to-train and its optimiser.

Public API (docs/design.md sections 6-9): `survival`, `endurable_failures`,
`endurable_failures_asymptotic`, `mean_time_to_interruption`, `overhead`,
`adaptive_max_load`, `young`, `daly`, `exact_optimum`, `time_to_train` ->
`Estimate`, `optimise` -> `Plan`; `DEFAULT_REDUNDANCIES` and
`DEFAULT_MICROBATCHES`, the joint optimiser's search (experiments/plan.py's
flag defaults; experiments/reproduce.py uses them); `Batch` (a micro-batch's
tokens and a cap on the global batch `G * m * b`, `optimise(..., batch=...)`),
`DEFAULT_MICROBATCH_TOKENS`, `REFERENCE_BATCH_TOKENS` and `capped_groups` (the
group count a cap allows); `clear_caches`.
Strategy and policy names are those of `spare_jax.strategies`.
"""

from spare_jax.analysis.batch import (
    DEFAULT_MICROBATCH_TOKENS,
    REFERENCE_BATCH_TOKENS,
    Batch,
    capped_groups,
)
from spare_jax.analysis.checkpointing import daly, exact_optimum, young
from spare_jax.analysis.endurance import (
    endurable_failures,
    endurable_failures_asymptotic,
    survival,
)
from spare_jax.analysis.overhead_model import adaptive_max_load, overhead
from spare_jax.analysis.planner import (
    DEFAULT_MICROBATCHES,
    DEFAULT_REDUNDANCIES,
    Estimate,
    Plan,
    clear_caches,
    optimise,
    time_to_train,
)
from spare_jax.analysis.weights import mean_time_to_interruption

__all__ = [
    "DEFAULT_MICROBATCHES",
    "DEFAULT_MICROBATCH_TOKENS",
    "DEFAULT_REDUNDANCIES",
    "REFERENCE_BATCH_TOKENS",
    "Batch",
    "Estimate",
    "Plan",
    "adaptive_max_load",
    "capped_groups",
    "clear_caches",
    "daly",
    "endurable_failures",
    "endurable_failures_asymptotic",
    "exact_optimum",
    "mean_time_to_interruption",
    "optimise",
    "overhead",
    "survival",
    "time_to_train",
    "young",
]

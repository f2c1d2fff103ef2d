"""Closed forms for SPARe, replication and checkpoint/restart; time-to-train and its optimiser.

Public API (DESIGN.md sections 3-4): `survival`, `endurable_failures`,
`endurable_failures_asymptotic`, `mean_time_to_interruption`, `overhead`,
`young`, `daly`, `time_to_train` -> `Estimate`, `optimise` -> `Plan`;
`DEFAULT_REDUNDANCIES` and `DEFAULT_MICROBATCHES`, the joint optimiser's
search (experiments/plan.py's flag defaults; experiments/reproduce.py uses them).
"""

from spare_jax.analysis.checkpointing import daly, exact_optimum, young
from spare_jax.analysis.endurance import (
    STRATEGIES,
    endurable_failures,
    endurable_failures_asymptotic,
    mean_time_to_interruption,
    survival,
)
from spare_jax.analysis.overhead_model import adaptive_max_load, overhead
from spare_jax.analysis.planner import (
    DEFAULT_MICROBATCHES,
    DEFAULT_REDUNDANCIES,
    TTT_STRATEGIES,
    Estimate,
    Plan,
    optimise,
    time_to_train,
)

__all__ = [
    "DEFAULT_MICROBATCHES",
    "DEFAULT_REDUNDANCIES",
    "STRATEGIES",
    "TTT_STRATEGIES",
    "Estimate",
    "Plan",
    "adaptive_max_load",
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

"""`spare_jax.sim`: the fast discrete-event simulator of a training run under failures.

Modules:
    failures: failure laws (exponential, Weibull, failure domains, replayed
        traces) and the vectorised interruption test (min over shards of the
        max over holders of the death times).
    overheads: the overhead after each failure event of a segment.
    interruption: Monte Carlo without repair: failures and time to the first
        interruption, overhead over an epoch (`failures_to_interruption`,
        `time_to_interruption`, `epoch_overhead`).
    hot: hot re-join (`Scenario.repair == "hot"`), an event walk per segment.
    engine: one training run, segment by segment (`simulate`, `RunResult`), and
        the `Backend` protocol that every one-run simulator satisfies.
    batch: many runs over a process pool (`simulate_many`, `Summary`).
    simgrid: the SimGrid backend (`run`, `simulate`, `epochs`): the same rules on a
        simulated cluster and network (docs/validation.md); SimGrid is imported only
        in the child process of a simulation.
    simgrid_compat: SimGrid's Python API across versions, the platform, collectives
        as transfers, isolated processes.

See docs/simulator.md for the rules played and the validation against
`spare_jax.analysis`.
"""

from spare_jax.sim.batch import Summary, simulate_many
from spare_jax.sim.engine import Backend, Checkpointing, RunResult, simulate
from spare_jax.sim.failures import (
    RandomFailures,
    Segment,
    TraceFailures,
    draw_lifetimes,
    interruption_threshold,
)
from spare_jax.sim.interruption import (
    epoch_overhead,
    failures_to_interruption,
    ratio_mean,
    time_to_interruption,
)

__all__ = [
    "Backend",
    "Checkpointing",
    "RandomFailures",
    "RunResult",
    "Segment",
    "Summary",
    "TraceFailures",
    "draw_lifetimes",
    "epoch_overhead",
    "failures_to_interruption",
    "interruption_threshold",
    "ratio_mean",
    "simulate",
    "simulate_many",
    "time_to_interruption",
]

"""Many independent runs: means and standard errors, over a process pool."""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import os
from collections.abc import Callable

import numpy as np
import tqdm

from spare_jax.scenario import Scenario
from spare_jax.sim.engine import RunResult, simulate

__all__ = ["Summary", "simulate_many"]

FIELDS = tuple(f.name for f in dataclasses.fields(RunResult))


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean and standard error of every `RunResult` field over replicas.

    Attributes:
        replicas: number of runs.
        mean: field name -> mean over runs.
        stderr: field name -> standard error of the mean (sample std / sqrt(n)).
        results: the individual runs.
    """

    replicas: int
    mean: dict[str, float]
    stderr: dict[str, float]
    results: tuple[RunResult, ...]

    def __getattr__(self, name: str) -> float:
        if name in FIELDS:
            return self.mean[name]
        raise AttributeError(name)

    @classmethod
    def of(cls, results: list[RunResult]) -> Summary:
        n = len(results)
        table = {
            name: np.array([getattr(r, name) for r in results], dtype=float) for name in FIELDS
        }
        mean = {name: float(v.mean()) for name, v in table.items()}
        err = {
            name: float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
            for name, v in table.items()
        }
        return cls(n, mean, err, tuple(results))


def _one(
    seed: int, backend: Callable[..., RunResult], scenario: Scenario, strategy: str, kwargs: dict
) -> RunResult:
    return backend(scenario, strategy, seed=seed, **kwargs)


def simulate_many(
    scenario: Scenario,
    strategy: str,
    *,
    replicas: int = 100,
    seed: int = 0,
    processes: int | None = None,
    progress: bool = True,
    backend: Callable[..., RunResult] = simulate,
    **kwargs: object,
) -> Summary:
    """Run `replicas` independent simulations and summarise them.

    Args:
        scenario: the scenario.
        strategy: as for `simulate`.
        replicas: number of runs.
        seed: base seed; run i gets an independent stream spawned from it.
        processes: worker processes (default: min(2, CPUs)); 1 runs in-process.
        progress: show a progress bar over the runs.
        backend: the one-run simulator (`simulate`, or another `engine.Backend`).
        **kwargs: passed to the backend (redundancy, checkpoint_interval_s, ...).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    seeds = [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(replicas)]
    workers = min(2, os.cpu_count() or 1) if processes is None else int(processes)
    job = functools.partial(
        _one, backend=backend, scenario=scenario, strategy=strategy, kwargs=kwargs
    )
    bar = dict(total=replicas, desc=f"{strategy} x{replicas}", disable=not progress, leave=False)
    if workers <= 1 or replicas == 1:
        results = [job(s) for s in tqdm.tqdm(seeds, **bar)]
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ctx.Pool(workers) as pool:
            results = list(tqdm.tqdm(pool.imap(job, seeds), **bar))
    return Summary.of(results)

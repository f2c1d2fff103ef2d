"""Many independent runs: means and standard errors, over a process pool.

Workers ignore SIGINT: a Ctrl-C reaches the parent alone, which stops the pool
(no traceback from each worker) and lets the caller report the interruption.
SIGINT stays blocked while the workers start, so none can catch it before it
ignores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator

import numpy as np
import tqdm

from spare_jax import checks
from spare_jax.scenario import Scenario
from spare_jax.sim.engine import RunResult, simulate

__all__ = ["Summary", "simulate_many"]

FIELDS = tuple(f.name for f in dataclasses.fields(RunResult))
# Replicas per call: each run of a large scenario takes about a second.
MAX_REPLICAS = 100_000


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


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Hold SIGINT back (POSIX) while worker processes are forked; deliver it afterwards."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
    replicas = checks.integer("replicas", replicas, low=1, high=MAX_REPLICAS)
    seed = checks.integer("seed", seed, low=0)
    if processes is not None:
        checks.integer("processes", processes, low=1)
    seeds = [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(replicas)]
    workers = min(2, os.cpu_count() or 1) if processes is None else int(processes)
    job = functools.partial(
        _one, backend=backend, scenario=scenario, strategy=strategy, kwargs=kwargs
    )
    bar = {
        "total": replicas,
        "desc": f"{strategy} x{replicas}",
        "disable": not progress,
        "leave": False,
    }
    if workers <= 1 or replicas == 1:
        results = [job(s) for s in tqdm.tqdm(seeds, **bar)]
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with _sigint_blocked():
            pool = ctx.Pool(workers, initializer=_ignore_sigint)
        with pool:
            results = list(tqdm.tqdm(pool.imap(job, seeds), **bar))
    return Summary.of(results)

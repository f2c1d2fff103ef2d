"""A user script with a per-host loader that breaks the batch contract, for tests.

    python tests/own_rows_worker.py --workdir=runs/x --steps=30 [--own_rows_from=STEP]

``experiments/regression.py`` with one change: ``batches(t)`` has the global
shape but each process fills only the rows of its own groups' micro-batches
and leaves the rest zero (4 groups, one per process under the launcher's
default test layout), from step ``--own_rows_from`` on. The holders of a
shard then disagree: the batch contract's check must stop the job at its
first step, or, when the loader goes wrong later, at the first step after a
recovery (before it, each shard's counted copy is its own group's: the
updates are still right).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))

import jax
import numpy as np
import regression
from absl import flags

from spare_jax import cli

_FROM = flags.DEFINE_integer("own_rows_from", 0, "First step whose batch has only own rows.")

_global = regression.batches


def own_rows(t: int, **kwargs: int) -> dict[str, np.ndarray]:
    """Step ``t``'s batch with only this process's share of the rows filled."""
    batch = _global(t, **kwargs)
    if t < _FROM.value:
        return batch
    rows = len(batch["x"])
    share = rows // jax.process_count()
    me = jax.process_index()
    mine = np.zeros(rows, bool)
    mine[me * share : (me + 1) * share] = True
    return {k: np.where(mine[:, None], v, 0).astype(v.dtype) for k, v in batch.items()}


regression.batches = own_rows

if __name__ == "__main__":
    cli.run(regression.main)

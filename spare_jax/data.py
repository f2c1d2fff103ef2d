"""Token sources and the stacked per-group input of one training step.

Owns: the deterministic token sources (`MarkovSource`, a synthetic learnable
stream, and `TokenFileSource`, uint16 ``.bin`` files read through ``np.memmap``)
and `stack_inputs`, which lays out every group's stack for a step.

**Units.** Each step's global batch is ``G * m`` *units*: micro-batches of the
failure-free per-group size (``batch`` sequences of ``seq_len + 1`` tokens). Unit
``u`` of step ``t`` is a pure function of ``(seed, t, u)``, so any group that
computes it sees identical data. A placement's shard ``s`` with ``units * m``
micro-batches (units = ``placement.shard_units``: 1 for stacking, r for
replication) covers units ``s * units * m + j``. Stacking, replication and plain
data parallelism therefore train on the *same* global batch every step, which
makes their losses directly comparable.

**Stacks.** A group's local input is its stack: ``depth`` shards of
``units * m`` micro-batches, flattened to one local index
``position * units * m + j``; that is ``r * m`` micro-batches for stacking and
replication alike (``m`` for plain data parallelism).
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np

from spare_jax.placement import Placement

__all__ = [
    "MarkovSource",
    "TokenFileSource",
    "TokenSource",
    "stack_bytes",
    "stack_inputs",
    "unit_ids",
]


class TokenSource(Protocol):
    """A deterministic supplier of micro-batches."""

    vocab: int
    seq_len: int
    batch: int

    def unit(self, step: int, unit: int) -> np.ndarray:
        """Micro-batch ``unit`` of ``step``: int32[batch, seq_len + 1]."""


def _rng(seed: int, step: int, unit: int, salt: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([salt, seed, step, unit]))


class MarkovSource:
    """Synthetic learnable token stream: a fixed sparse random Markov chain.

    Every token has ``branching`` possible successors (drawn once from the seed)
    with fixed probabilities, so the best achievable loss is the chain's entropy
    rate (about ``log(branching)`` nats or less) while a model that only learns token
    frequencies stays near the unigram entropy (about ``log(vocab)``).
    """

    def __init__(self, vocab: int, seq_len: int, batch: int, seed: int = 0, branching: int = 3):
        if vocab < 2 or seq_len < 1 or batch < 1 or not 1 <= branching <= vocab:
            raise ValueError(
                f"bad MarkovSource sizes: vocab={vocab}, seq_len={seq_len}, batch={batch}, "
                f"branching={branching}"
            )
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed
        table_rng = _rng(seed, 0, 0, salt=1)
        self.successors = np.stack(
            [table_rng.choice(vocab, branching, replace=False) for _ in range(vocab)]
        )
        weights = 0.5 ** np.arange(branching)
        self.probs = weights / weights.sum()

    def unit(self, step: int, unit: int) -> np.ndarray:
        rng = _rng(self.seed, step, unit, salt=2)
        out = np.empty((self.batch, self.seq_len + 1), np.int32)
        out[:, 0] = rng.integers(0, self.vocab, self.batch)
        choices = rng.choice(len(self.probs), size=(self.batch, self.seq_len), p=self.probs)
        for t in range(self.seq_len):
            out[:, t + 1] = self.successors[out[:, t], choices[:, t]]
        return out

    def stationary(self) -> np.ndarray:
        """Stationary token distribution of the chain (power iteration)."""
        trans = np.zeros((self.vocab, self.vocab))
        np.add.at(trans, (np.arange(self.vocab)[:, None], self.successors), self.probs[None, :])
        pi = np.full(self.vocab, 1.0 / self.vocab)
        for _ in range(2000):
            pi = pi @ trans
        return pi / pi.sum()

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the stationary token distribution: a unigram model's loss."""
        pi = self.stationary()
        pi = pi[pi > 0]
        return float(-(pi * np.log(pi)).sum())

    def entropy_rate(self) -> float:
        """The chain's entropy rate (nats/token): the best achievable loss."""
        return float(-(self.probs * np.log(self.probs)).sum())


class TokenFileSource:
    """Real text: a flat uint16 token file (the common ``.bin`` format) via ``np.memmap``.

    Each sequence of a unit starts at an offset drawn from ``(seed, step, unit)``.
    """

    def __init__(
        self, path: str | os.PathLike, vocab: int, seq_len: int, batch: int, seed: int = 0
    ):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if self.tokens.size < seq_len + 2:
            raise ValueError(
                f"{path} holds {self.tokens.size} tokens, fewer than seq_len + 2 = {seq_len + 2}"
            )
        self.vocab, self.seq_len, self.batch, self.seed = vocab, seq_len, batch, seed

    def unit(self, step: int, unit: int) -> np.ndarray:
        rng = _rng(self.seed, step, unit, salt=3)
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, self.batch)
        window = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        out = np.asarray(self.tokens[window], dtype=np.int32)
        if out.max(initial=0) >= self.vocab:
            raise ValueError(f"token id {int(out.max())} in the file is >= vocab={self.vocab}")
        return out


def unit_ids(placement: Placement, microbatches: int) -> np.ndarray:
    """Global unit id of every local micro-batch of every group: int[G, depth * units * m]."""
    per_shard = placement.shard_units * microbatches
    j = np.arange(per_shard)
    return (placement.stacks[:, :, None] * per_shard + j[None, None, :]).reshape(
        placement.groups, -1
    )


def stack_inputs(
    source: TokenSource, placement: Placement, microbatches: int, step: int
) -> np.ndarray:
    """Every group's stack for ``step``: int32[G, depth * units * m, batch, seq_len + 1].

    Each of the ``G * m`` distinct units is generated once and copied into the
    stacks of its r holders.
    """
    ids = unit_ids(placement, microbatches)
    unique, inverse = np.unique(ids, return_inverse=True)
    units = np.stack([source.unit(step, int(u)) for u in unique])
    return units[inverse.reshape(ids.shape)]


def stack_bytes(
    placement: Placement, microbatches: int, batch: int, seq_len: int
) -> dict[str, int]:
    """Host/device bytes of one step's input: stacked vs. one copy of the global batch."""
    per_unit = batch * (seq_len + 1) * np.dtype(np.int32).itemsize
    stacked = placement.groups * placement.depth * placement.shard_units * microbatches * per_unit
    single = placement.shards * placement.shard_units * microbatches * per_unit
    return {
        "stacked": int(stacked),
        "global_batch": int(single),
        "extra": int(stacked - single),
        "factor": math.ceil(stacked / single),
    }

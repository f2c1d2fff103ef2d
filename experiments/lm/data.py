"""Token sources and the global batch of one training step.

Owns: the deterministic token sources (`MarkovSource`, a synthetic learnable
stream, and `TokenFileSource`, uint16 ``.bin`` files read through ``np.memmap``),
`global_batch`, and `stack_bytes`, the memory cost of stacking.

**Units.** Each step's global batch is ``G * m`` *units*: micro-batches of the
failure-free per-group size (``batch`` sequences of ``seq_len + 1`` tokens). Unit
``u`` of step ``t`` is a pure function of ``(seed, t, u)``, so any group that
computes it sees identical data, and a step re-executed after a rollback or a
restart sees the same data. Stacking, replication and plain data parallelism
train on the *same* global batch every step (which groups hold which units is
`spare_jax.slots`'s business), so their losses are directly comparable.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np

from spare_jax.placement import Placement

__all__ = ["MarkovSource", "TokenFileSource", "TokenSource", "global_batch", "stack_bytes"]


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


def global_batch(source: TokenSource, units: int, step: int) -> np.ndarray:
    """The failure-free global batch of ``step``: int32[units * batch, seq_len + 1].

    Unit ``u`` is rows ``[u * batch, (u + 1) * batch)``, the layout
    `spare_jax.make_train_step` expects (unit ``g * m + j`` is group ``g``'s
    micro-batch ``j``).
    """
    return np.concatenate([source.unit(step, u) for u in range(units)])


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

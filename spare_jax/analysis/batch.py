"""The global batch a plan implies, and a cap on it.

Every strategy trains on the same failure-free global batch (docs/design.md,
2. Vocabulary): `G` shards of `m` micro-batches of `b` tokens, so a step reads
`G * m * b` tokens (replication has `G / r` shards, each `r` times larger: the
same total). The closed-form model counts compute only: it takes the work as
fixed whatever the batch, so a larger `m` is free in time-to-train
(`Scenario.microbatch_overhead` aside) but not in batch. `Batch` states the
micro-batch and an optional cap; `optimise(..., batch=...)` keeps to the cap.

Defaults (docs/planning.md, "The batch"): one micro-batch is one sequence of
8,192 tokens, Llama 3 405B's pre-training sequence length; the reference cap
is its largest global batch, 16M tokens a step (2,048 such sequences). Both
from "The Llama 3 Herd of Models" (Meta, 2024, arXiv 2407.21783), section
3.4.1 and Table 4.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from numpy.typing import ArrayLike

from spare_jax import checks

__all__ = [
    "DEFAULT_MICROBATCH_TOKENS",
    "MAX_MICROBATCH_TOKENS",
    "REFERENCE_BATCH_TOKENS",
    "Batch",
    "capped_groups",
    "short_count",
]

# One 8,192-token sequence per micro-batch (Llama 3 report, section 3.4.1).
DEFAULT_MICROBATCH_TOKENS = 8_192
# Llama 3 405B's largest global batch, 16M tokens a step (Llama 3 report, section
# 3.4.1 and Table 4): 2,048 sequences of 8,192 tokens.
REFERENCE_BATCH_TOKENS = 16 * 2**20
# 2^30 tokens in one micro-batch is far beyond any accelerator's memory; the bound
# also keeps G * m * b within int64 at the largest G and m the planner accepts.
MAX_MICROBATCH_TOKENS = 2**30
_MAX_CAP_TOKENS = 2**62


@dataclasses.dataclass(frozen=True)
class Batch:
    """A micro-batch's size and an optional cap on the global batch (tokens a step).

    Attributes:
        microbatch_tokens: tokens in one micro-batch, `b`.
        sequence_tokens: tokens in one sequence; None: one sequence per micro-batch.
            A micro-batch holds whole sequences.
        max_global_batch_tokens: the largest global batch allowed, `G * m * b`
            tokens a step; None: no cap.
    """

    microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    sequence_tokens: int | None = None
    max_global_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        b = checks.integer(
            "microbatch_tokens", self.microbatch_tokens, low=1, high=MAX_MICROBATCH_TOKENS
        )
        if self.sequence_tokens is not None:
            s = checks.integer("sequence_tokens", self.sequence_tokens, low=1, high=b)
            if b % s:
                raise ValueError(
                    f"microbatch_tokens={b:,} must be a whole number of sequences of "
                    f"sequence_tokens={s:,}"
                )
        if self.max_global_batch_tokens is not None:
            checks.integer(
                "max_global_batch_tokens",
                self.max_global_batch_tokens,
                low=1,
                high=_MAX_CAP_TOKENS,
            )

    @property
    def sequence_length(self) -> int:
        """Tokens in one sequence."""
        return self.sequence_tokens or self.microbatch_tokens

    @property
    def microbatch_sequences(self) -> int:
        """Sequences in one micro-batch."""
        return self.microbatch_tokens // self.sequence_length

    def global_tokens(self, groups: ArrayLike, microbatches: ArrayLike) -> np.ndarray:
        """`G * m * b`: tokens a step reads (broadcast over arrays of G and m)."""
        g, m = np.asarray(groups, dtype=np.int64), np.asarray(microbatches, dtype=np.int64)
        return g * m * np.int64(self.microbatch_tokens)

    def global_sequences(self, groups: ArrayLike, microbatches: ArrayLike) -> np.ndarray:
        """`G * m * b` in sequences."""
        g, m = np.asarray(groups, dtype=np.int64), np.asarray(microbatches, dtype=np.int64)
        return g * m * np.int64(self.microbatch_sequences)

    def fits(self, groups: ArrayLike, microbatches: ArrayLike) -> np.ndarray:
        """Whether `G * m * b` is within the cap (always, without one)."""
        tokens = self.global_tokens(groups, microbatches)
        if self.max_global_batch_tokens is None:
            return np.ones(tokens.shape, dtype=bool)
        return tokens <= self.max_global_batch_tokens

    def max_microbatches(self, groups: int) -> int | None:
        """The largest m whose batch fits at G groups (0: none does); None without a cap."""
        if self.max_global_batch_tokens is None:
            return None
        return int(self.max_global_batch_tokens // (int(groups) * self.microbatch_tokens))

    def check_groups(self, groups: int) -> None:
        """ValueError unless one micro-batch per group (m = 1) fits under the cap."""
        if self.max_microbatches(groups) == 0:
            cap = int(self.max_global_batch_tokens or 0)
            most = cap // self.microbatch_tokens
            raise ValueError(
                f"max_global_batch_tokens={cap:,} is below one micro-batch per group: "
                f"{int(groups):,} groups x {self.microbatch_tokens:,} tokens = "
                f"{int(groups) * self.microbatch_tokens:,} tokens a step (the cap admits at "
                f"most {most:,} groups: larger groups, or smaller micro-batches)"
            )


def capped_groups(
    gpus: int, gpus_per_group: int, limit: ArrayLike, multiple_of: int = 1
) -> np.ndarray:
    """The largest group count `G <= limit` that splits `gpus` into whole base groups.

    A group of the result spans `gpus / G` GPUs, a whole number of base groups of
    `gpus_per_group` GPUs (so G divides `gpus / gpus_per_group`); G is also a
    multiple of `multiple_of` (replication at r needs r to divide G).

    Args:
        gpus: N.
        gpus_per_group: the smallest group (a node, say).
        limit: the most groups allowed, per entry (e.g. cap // (m * b)).
        multiple_of: G must be a multiple of it.

    Returns:
        An int64 array shaped like `limit`: G per entry, 0 where none fits.
    """
    n = checks.integer("gpus", gpus, low=1)
    g0 = checks.integer("gpus_per_group", gpus_per_group, low=1)
    step = checks.integer("multiple_of", multiple_of, low=1)
    if n % g0:
        raise ValueError(f"gpus={n} must be a multiple of gpus_per_group={g0}")
    base = n // g0
    candidates = np.arange(1, base + 1, dtype=np.int64)
    candidates = candidates[(base % candidates == 0) & (candidates % step == 0)]
    lim = np.asarray(limit, dtype=np.int64)
    if candidates.size == 0:
        return np.zeros(lim.shape, dtype=np.int64)
    index = np.searchsorted(candidates, lim, side="right") - 1
    return np.where(index >= 0, candidates[np.maximum(index, 0)], 0).astype(np.int64)


def short_count(value: float) -> str:
    """A count in three significant figures with a k, M, B or T suffix (1.2M, 9.83B)."""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"

"""The global batch a plan implies and the cap on it (spare_jax.analysis.batch)."""

from __future__ import annotations

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from spare_jax import analysis
from spare_jax.scenario import Scenario

SMALL = Scenario(gpus=96_000, work_hours=48.0)  # 12,000 groups of 8; SPARe beats r = 1 here


def test_global_batch_is_groups_times_microbatches_times_tokens():
    batch = analysis.Batch(microbatch_tokens=16_384, sequence_tokens=4_096)
    groups, ms = np.array([[1_250], [75_000]]), np.array([1, 2, 4, 8, 16])
    tokens = batch.global_tokens(groups, ms)
    assert tokens.shape == (2, 5)
    for i, g in enumerate((1_250, 75_000)):
        for j, m in enumerate((1, 2, 4, 8, 16)):
            assert tokens[i, j] == g * m * 16_384
            assert batch.global_sequences(g, m) == g * m * 4
    # int64 holds the largest batch the bounds allow (10^6 groups, 2^30-token micro-batches).
    big = analysis.Batch(microbatch_tokens=2**30).global_tokens(10**6, 1_000)
    assert int(big) == 10**9 * 2**30


def test_defaults_are_one_llama3_sequence_and_no_cap():
    batch = analysis.Batch()
    assert batch.microbatch_tokens == analysis.DEFAULT_MICROBATCH_TOKENS == 8_192
    assert batch.microbatch_sequences == 1 and batch.max_global_batch_tokens is None
    assert batch.max_microbatches(75_000) is None and bool(batch.fits(75_000, 10**6))
    assert analysis.REFERENCE_BATCH_TOKENS == 2_048 * 8_192


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"microbatch_tokens": -8_192}, "microbatch_tokens must be >= 1"),
        ({"microbatch_tokens": 0}, "microbatch_tokens must be >= 1"),
        ({"microbatch_tokens": 2**31}, "microbatch_tokens must be <="),
        ({"microbatch_tokens": 8_192.0}, "microbatch_tokens must be an integer"),
        ({"sequence_tokens": 0}, "sequence_tokens must be >= 1"),
        ({"sequence_tokens": 3_000}, "whole number of sequences"),
        ({"sequence_tokens": 16_384}, "sequence_tokens must be <="),
        ({"max_global_batch_tokens": -1}, "max_global_batch_tokens must be >= 1"),
        ({"max_global_batch_tokens": 0}, "max_global_batch_tokens must be >= 1"),
    ],
)
def test_bad_batches_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        analysis.Batch(**kwargs)


def test_cap_below_one_microbatch_per_group_names_the_groups_it_admits():
    batch = analysis.Batch(max_global_batch_tokens=analysis.REFERENCE_BATCH_TOKENS)
    assert batch.max_microbatches(2_048) == 1 and batch.max_microbatches(2_049) == 0
    batch.check_groups(2_048)
    with pytest.raises(ValueError, match="below one micro-batch per group") as info:
        batch.check_groups(75_000)
    assert "at most 2,048 groups" in str(info.value) and "614,400,000" in str(info.value)
    with pytest.raises(ValueError, match="below one micro-batch per group"):
        analysis.optimise(Scenario(), "replication", batch=batch)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    base=st.sampled_from([1, 7, 12, 360, 1_250, 75_000]),
    per=st.sampled_from([1, 8]),
    limits=st.lists(st.integers(-5, 80_000), min_size=1, max_size=6),
    step=st.sampled_from([1, 2, 8]),
)
def test_capped_groups_is_the_largest_admissible_divisor(base, per, limits, step):
    got = analysis.capped_groups(base * per, per, limits, multiple_of=step)
    for lim, g in zip(limits, got.tolist(), strict=True):
        admissible = [d for d in range(1, base + 1) if base % d == 0 and d % step == 0]
        want = max([d for d in admissible if d <= lim], default=0)
        assert g == want


def test_cap_keeps_the_search_to_microbatches_that_fit():
    """The cap bites (uncapped, the optimum takes more micro-batches than it allows)."""
    rs = {"redundancies": (1, 4, 8)}  # a short search keeps the test fast
    free = analysis.optimise(SMALL, "spare", **rs)
    cap = SMALL.groups * 2 * 8_192  # m <= 2
    batch = analysis.Batch(max_global_batch_tokens=cap)
    assert free.microbatches > batch.max_microbatches(SMALL.groups) == 2
    capped = analysis.optimise(SMALL, "spare", batch=batch, **rs)
    # The same as a search narrowed by hand to the m that fit.
    narrowed = analysis.optimise(SMALL, "spare", microbatches=(1, 2), **rs)
    assert (capped.redundancy, capped.microbatches) == (narrowed.redundancy, narrowed.microbatches)
    assert capped.estimate.time_to_train_s == narrowed.estimate.time_to_train_s
    assert bool(batch.fits(SMALL.groups, capped.microbatches))
    # Strategies without micro-batches (m = 1) are unaffected by a cap m = 1 fits.
    assert analysis.optimise(SMALL, "replication", batch=batch, **rs) == analysis.optimise(
        SMALL, "replication", **rs
    )
    with pytest.raises(ValueError, match="no micro-batch count in"):
        analysis.optimise(SMALL, "spare", microbatches=(4, 8), batch=batch, **rs)
    assert analysis.planner.candidate_count(SMALL, "spare", batch=batch, **rs) == 1 + 2 * 2

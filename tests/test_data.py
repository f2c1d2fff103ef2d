"""Token sources are pure functions of (seed, step, unit); the global batch lays units in order."""

import numpy as np
import pytest
from lm import data as data_lib

from spare_jax import placement as placement_lib


def test_markov_source_is_deterministic_and_learnable():
    a = data_lib.MarkovSource(64, 16, 4, seed=3)
    b = data_lib.MarkovSource(64, 16, 4, seed=3)
    np.testing.assert_array_equal(a.unit(5, 7), b.unit(5, 7))
    assert not np.array_equal(a.unit(5, 7), a.unit(5, 8))
    assert not np.array_equal(a.unit(5, 7), a.unit(6, 7))
    x = a.unit(0, 0)
    assert x.shape == (4, 17) and x.dtype == np.int32 and x.min() >= 0 and x.max() < 64
    # every transition is one of the token's few successors
    assert all(x[i, t + 1] in a.successors[x[i, t]] for i in range(4) for t in range(16))
    assert a.entropy_rate() < 0.5 * a.unigram_entropy()


def test_global_batch_is_the_units_in_order():
    source = data_lib.MarkovSource(16, 4, 2, seed=0)
    batch = data_lib.global_batch(source, 6, step=4)
    assert batch.shape == (12, 5)
    for u in range(6):
        np.testing.assert_array_equal(batch[2 * u : 2 * u + 2], source.unit(4, u))


def test_token_file_source(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    src = data_lib.TokenFileSource(path, vocab=1000, seq_len=8, batch=3, seed=1)
    x = src.unit(2, 5)
    assert x.shape == (3, 9)
    np.testing.assert_array_equal(np.diff(x, axis=1), 1)  # contiguous windows of the file
    np.testing.assert_array_equal(x, data_lib.TokenFileSource(path, 1000, 8, 3, seed=1).unit(2, 5))
    with pytest.raises(ValueError, match=">= vocab"):
        data_lib.TokenFileSource(path, vocab=10, seq_len=8, batch=3).unit(0, 0)


def test_stack_bytes():
    p = placement_lib.cyclic(8, 3)
    b = data_lib.stack_bytes(p, microbatches=2, batch=4, seq_len=31)
    assert b["stacked"] == 3 * b["global_batch"] and b["factor"] == 3
    assert data_lib.stack_bytes(placement_lib.data_parallel(8), 2, 4, 31)["extra"] == 0

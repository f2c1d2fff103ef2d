"""Token sources are pure functions of (seed, step, unit); stacks hold the right shards."""

import numpy as np
import pytest

from spare_jax import data as data_lib
from spare_jax import placement as placement_lib
from spare_jax import strategies


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


@pytest.mark.parametrize(
    "kind,r", [("cyclic", 2), ("cyclic", 3), ("replication", 2), ("data_parallel", 1)]
)
def test_stacks_cover_the_same_global_batch(kind, r):
    p = strategies.placement(kind, 6, r)
    m = 2
    source = data_lib.MarkovSource(16, 4, 2, seed=0)
    ids = data_lib.unit_ids(p, m)
    assert ids.shape == (6, p.depth * p.shard_units * m)
    assert set(ids.ravel().tolist()) == set(range(6 * m))  # the same G*m units for every strategy
    stacks = data_lib.stack_inputs(source, p, m, step=4)
    for g in range(6):
        for j, u in enumerate(ids[g]):
            np.testing.assert_array_equal(stacks[g, j], source.unit(4, int(u)))


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

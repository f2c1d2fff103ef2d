"""Computation overhead model (spare_jax.analysis.overhead) against exact loads and Monte Carlo."""

from __future__ import annotations

import math

import chex
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from spare_jax import analysis, placement, reorder


def _good_dead_sets(
    rng: np.random.Generator, groups: int, r: int, k: int, n: int
) -> list[np.ndarray]:
    """n uniform k-subsets of the ring with no r consecutive dead groups (rejection)."""
    out = []
    while len(out) < n:
        dead = np.sort(rng.choice(groups, k, replace=False))
        mask = np.zeros(groups, bool)
        mask[dead] = True
        ring = np.concatenate([mask, mask[: r - 1]]).astype(int)
        if np.convolve(ring, np.ones(r, int), "valid").max() < r:
            out.append(dead)
    return out


def test_exact_load_matches_reorder():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        groups = int(rng.integers(6, 60))
        r = int(rng.integers(2, 5))
        m = int(rng.choice([1, 2, 3, 8]))
        dead = rng.choice(groups, int(rng.integers(0, groups // 2 + 1)), replace=False)
        alive = reorder.alive_mask(groups, dead)
        try:
            want = reorder.max_load(placement.cyclic(groups, r), alive, m)
        except reorder.Interruption:
            with pytest.raises(ValueError):
                analysis.adaptive_max_load(groups, r, m, dead)
            continue
        assert analysis.adaptive_max_load(groups, r, m, dead) == want
        checked += 1
    assert checked > 100


def test_design_facts():
    g = 10_000
    # m = 1: 2 as soon as a group is dead; sparse failures with m > 1: 1 + 1/m.
    assert analysis.overhead("spare", g, 3, 1, 1) == pytest.approx(2.0)
    assert analysis.overhead("spare", g, 3, 8, 1) == pytest.approx(1.125)
    assert analysis.overhead("spare", g, 3, 8, 0) == 1.0
    assert analysis.overhead("spare", g, 3, 8, 1, policy="fixed") == pytest.approx(2.0)
    assert analysis.overhead("replication", g, 4, 8, 100) == 4.0
    assert analysis.overhead("dp", g, 1, 8, 0) == 1.0
    assert math.isnan(analysis.overhead("dp", g, 1, 8, 1))
    # fixed order climbs to r; adaptive stays below it and rises with k.
    k = np.array([10, 100, 400, 800])
    fixed = analysis.overhead("spare", g, 4, 8, k, policy="fixed")
    adaptive = analysis.overhead("spare", g, 4, 8, k)
    assert np.all(np.diff(fixed) > 0) and fixed[-1] <= 4.0
    assert np.all(np.diff(adaptive) >= 0) and np.all(adaptive < fixed)


def test_fixed_order_two_dead_closed_form():
    """k = 2 on a ring of G: P(adjacent) = 2 / (G - 1) when r >= 3."""
    g = 50
    want = 1.0 + 1.0 + 2.0 / (g - 1)
    assert analysis.overhead("spare", g, 3, 1, 2, policy="fixed") == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(
    "groups, r, m", [(1_000, 2, 8), (1_000, 3, 8), (2_000, 4, 4), (1_000, 3, 1)]
)
def test_adaptive_monte_carlo(groups, r, m):
    """Within 3% (plus 4 standard errors) of the exact loads of random good dead sets."""
    rng = np.random.default_rng(groups + 10 * r + m)
    mean_f = analysis.endurable_failures("spare", groups, r)
    for frac in (0.3, 1.0):
        k = max(r, int(frac * mean_f))
        sets = _good_dead_sets(rng, groups, r, k, 150)
        mc = np.array([analysis.adaptive_max_load(groups, r, m, d) / m for d in sets])
        model = analysis.overhead("spare", groups, r, m, k)
        err = abs(model - mc.mean())
        assert err < 0.03 * mc.mean() + 4 * mc.std() / math.sqrt(mc.size), (k, model, mc.mean())


@pytest.mark.parametrize("groups, r", [(500, 3), (1_000, 4)])
def test_fixed_monte_carlo(groups, r):
    rng = np.random.default_rng(groups + r)
    k = int(analysis.endurable_failures("spare", groups, r) / 4)
    sets = _good_dead_sets(rng, groups, r, k, 300)
    runs = []
    for d in sets:
        alive = reorder.alive_mask(groups, d)
        runs.append(reorder.max_load(placement.cyclic(groups, r), alive, 1, policy="fixed"))
    mc = np.array(runs, float)
    model = analysis.overhead("spare", groups, r, 1, k, policy="fixed")
    assert 1.0 < model < r
    assert abs(model - mc.mean()) < 4 * mc.std() / math.sqrt(mc.size) + 5e-3


def test_vectorised():
    k = np.arange(0, 50)
    out = analysis.overhead("spare", 5_000, 3, 8, k)
    chex.assert_shape(out, k.shape)
    scalar = [analysis.overhead("spare", 5_000, 3, 8, int(i)) for i in k]
    np.testing.assert_allclose(out, scalar, rtol=1e-12)
    grid = analysis.overhead("spare", 5_000, 3, 8, k.reshape(5, 10))
    chex.assert_shape(grid, (5, 10))
    np.testing.assert_array_equal(grid.ravel(), out)


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        (("bogus", 100, 2, 1, 0), {}, "strategy"),
        (("spare", 100, 2, 1, 0), {"policy": "replication"}, "policy"),
        (("spare", 100, 2, 1, 0), {"policy": "drop"}, "policy"),
        (("spare", 100, 2, 0, 0), {}, "microbatches"),
        (("spare", 100, 2, 2.0, 0), {}, "microbatches"),
        (("spare", 100, 2, 1, -1), {}, "dead"),
        (("spare", 100, 2, 1, 1.5), {}, "dead"),
        (("spare", 100, 2.7, 1, 0), {}, "redundancy"),
        (("spare", 100, 101, 1, 0), {}, "redundancy"),
        (("spare", 0, 1, 1, 0), {}, "groups"),
        (("spare", 10**8, 2, 1, 0), {}, "groups"),
        (("spare", 1_000, 33, 1, 0), {}, "redundancy"),
        (("spare", 1_000, 8, 64, 0), {}, "microbatches"),
        (("replication", 100, 3, 1, 0), {}, "divisible"),
    ],
)
def test_overhead_rejects_bad_arguments(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        analysis.overhead(*args, **kwargs)


@pytest.mark.parametrize(
    "args, name",
    [
        ((10, 2, 1, [10]), "dead group ids"),
        ((10, 2, 1, [-1]), "dead group ids"),
        ((10, 2, 1, [1.0]), "integer"),
        ((10, 2, 1, [[1, 2]]), "1-D"),
        ((10, 2, 0, [1]), "microbatches"),
        ((10, 11, 1, [1]), "redundancy"),
        ((0, 1, 1, []), "groups"),
        ((10, 2, 1, [1, 2]), "interruption"),
        ((3, 2, 1, [0, 1, 2]), "interruption"),
    ],
)
def test_adaptive_max_load_rejects_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        analysis.adaptive_max_load(*args)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    groups=st.integers(2, 40),
    r=st.integers(2, 5),
    m=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_adaptive_max_load_bounds(groups, r, m, seed):
    """m <= L* <= r m on any non-interrupting dead set, and L* >= ceil(G m / live)."""
    hypothesis.assume(r <= groups)
    rng = np.random.default_rng(seed)
    dead = rng.choice(groups, int(rng.integers(0, groups)), replace=False)
    try:
        load = analysis.adaptive_max_load(groups, r, m, dead)
    except ValueError:
        assert reorder.uncovered(placement.cyclic(groups, r), reorder.alive_mask(groups, dead)).size
        return
    live = groups - np.unique(dead).size
    assert max(m, -(-groups * m // live)) <= load <= r * m

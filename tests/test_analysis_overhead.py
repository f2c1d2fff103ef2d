"""Computation overhead model (spare_jax.analysis.overhead) against exact loads and Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest

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
    assert analysis.overhead("adaptive", g, 3, 1, 1) == pytest.approx(2.0)
    assert analysis.overhead("adaptive", g, 3, 8, 1) == pytest.approx(1.125)
    assert analysis.overhead("adaptive", g, 3, 8, 0) == 1.0
    assert analysis.overhead("fixed", g, 3, 8, 1) == pytest.approx(2.0)
    assert analysis.overhead("replication", g, 4, 8, 100) == 4.0
    assert analysis.overhead("dp", g, 1, 8, 0) == 1.0
    assert math.isnan(analysis.overhead("dp", g, 1, 8, 1))
    # fixed order climbs to r; adaptive stays below it and rises with k.
    k = np.array([10, 100, 400, 800])
    fixed = analysis.overhead("fixed", g, 4, 8, k)
    adaptive = analysis.overhead("adaptive", g, 4, 8, k)
    assert np.all(np.diff(fixed) > 0) and fixed[-1] <= 4.0
    assert np.all(np.diff(adaptive) >= 0) and np.all(adaptive < fixed)


def test_fixed_order_two_dead_closed_form():
    """k = 2 on a ring of G: P(adjacent) = 2 / (G - 1) when r >= 3."""
    g = 50
    want = 1.0 + 1.0 + 2.0 / (g - 1)
    assert analysis.overhead("fixed", g, 3, 1, 2) == pytest.approx(want, rel=1e-9)


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
        model = analysis.overhead("adaptive", groups, r, m, k)
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
    model = analysis.overhead("fixed", groups, r, 1, k)
    assert 1.0 < model < r
    assert abs(model - mc.mean()) < 4 * mc.std() / math.sqrt(mc.size) + 5e-3


def test_vectorised_and_validated():
    k = np.arange(0, 50)
    out = analysis.overhead("adaptive", 5_000, 3, 8, k)
    assert out.shape == k.shape
    assert np.allclose(out, [analysis.overhead("adaptive", 5_000, 3, 8, int(i)) for i in k])
    with pytest.raises(ValueError):
        analysis.overhead("bogus", 100, 2, 1, 0)
    with pytest.raises(ValueError):
        analysis.overhead("adaptive", 100, 2, 0, 0)
    with pytest.raises(ValueError):
        analysis.overhead("adaptive", 100, 2, 1, -1)

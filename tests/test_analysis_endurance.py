"""Survival, endurable failures and mean time to interruption (spare_jax.analysis)."""

from __future__ import annotations

import fractions
import itertools
import math

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from spare_jax import analysis
from spare_jax.analysis import endurance, weights


def _exact_stacking(groups: int, r: int, f: int) -> float:
    """docs/design.md section 6, exactly: G/(G-f) [x^f] (1+...+x^(r-1))^(G-f) / C(G, f)."""
    n = groups - f
    poly = [1]
    for _ in range(n):
        new = [0] * min(len(poly) + r - 1, f + 1)
        for i, c in enumerate(poly):
            for j in range(r):
                if i + j <= f:
                    new[i + j] += c
        poly = new
    coeff = poly[f] if f < len(poly) else 0
    return float(fractions.Fraction(groups * coeff, n * math.comb(groups, f)))


def _brute(strategy: str, groups: int, r: int, f: int) -> float:
    """Enumerate every dead set of size f."""
    good = 0
    for dead in itertools.combinations(range(groups), f):
        mask = np.zeros(groups, bool)
        mask[list(dead)] = True
        if strategy == "replication":
            ok = not mask.reshape(-1, r).all(axis=1).any()
        else:
            ring = np.concatenate([mask, mask[: r - 1]])
            ok = not any(ring[i : i + r].all() for i in range(groups))
        good += ok
    return good / math.comb(groups, f)


def _miller(groups: int, r: int, f_max: int) -> np.ndarray:
    """Independent float oracle: Miller's recurrence for powers of 1+...+x^(r-1), normalised."""
    f = np.arange(f_max + 1)
    n = (groups - f).astype(float)
    b = np.zeros((f_max + 1, f_max + 1))
    b[0] = 1.0
    for k in range(1, f_max + 1):
        acc = np.zeros(f_max + 1)
        ratio = np.ones(f_max + 1)
        for j in range(1, min(k, r - 1) + 1):
            ratio = ratio * (k - j + 1) / (n + k - j)
            acc += (j * (n + 1) - k) * ratio * b[k - j]
        b[k] = acc / k
    return b[f, f]


@pytest.mark.parametrize(
    "strategy, groups, r",
    [
        ("spare", 10, 2),
        ("spare", 12, 3),
        ("replication", 12, 2),
        ("replication", 12, 3),
        ("spare", 9, 4),
    ],
)
def test_survival_matches_brute_force(strategy, groups, r):
    f = np.arange(groups + 1)
    got = analysis.survival(strategy, groups, r, f)
    want = np.array([_brute(strategy, groups, r, int(k)) for k in f])
    np.testing.assert_allclose(got, want, rtol=1e-7, atol=1e-30)


@pytest.mark.parametrize("groups, r", [(60, 2), (200, 3), (100, 5)])
def test_survival_matches_exact_integer_formula(groups, r):
    curve = np.exp(endurance.log_survival_curve("spare", groups, r))
    want = np.array([_exact_stacking(groups, r, f) for f in range(curve.size)])
    keep = want > 1e-25
    np.testing.assert_allclose(curve[keep], want[keep], rtol=1e-4)


@pytest.mark.parametrize("groups, r, f_max", [(3_000, 8, 1_400), (20_000, 3, 2_500)])
def test_survival_matches_recurrence_at_scale(groups, r, f_max):
    curve = np.exp(endurance.log_survival_curve("spare", groups, r))[: f_max + 1]
    want = _miller(groups, r, f_max)[: curve.size]
    np.testing.assert_allclose(curve, want, rtol=1e-7)


def test_design_reference_values():
    assert analysis.endurable_failures("spare", 60, 2) == pytest.approx(7.372, abs=6e-4)
    assert analysis.endurable_failures("replication", 60, 2) == pytest.approx(9.749, abs=6e-4)
    assert analysis.endurable_failures("spare", 120, 4) == pytest.approx(36.21, abs=6e-3)
    assert analysis.endurable_failures("replication", 120, 4) == pytest.approx(46.62, abs=6e-3)


@pytest.mark.parametrize(
    "pairs, published", [(1, 3.0), (2, 3.667), (10, 6.675), (100, 18.75), (1000, 57.06)]
)
def test_published_pair_values_any_convention(pairs, published):
    """Casanova, Robert, Vivien, Zaidouni 2012 (INRIA RR-7951); counts include the last failure."""
    got = analysis.endurable_failures("replication", 2 * pairs, 2, convention="any")
    assert got == pytest.approx(published, abs=6e-3 * max(1.0, published / 10))


def test_any_convention_survival_is_consistent():
    groups = 12
    n = np.arange(200)
    s = analysis.survival("replication", groups, 2, n, convention="any")
    assert s[0] == 1.0 and np.all(np.diff(s) <= 1e-15)
    assert s.sum() == pytest.approx(
        analysis.endurable_failures("replication", groups, 2, convention="any"), rel=1e-9
    )


def test_dp_and_r1():
    assert analysis.endurable_failures("dp", 100, 1) == 1.0
    assert analysis.endurable_failures("checkpoint_restart", 100, 1) == 1.0
    assert analysis.endurable_failures("spare", 100, 1) == 1.0
    assert analysis.mean_time_to_interruption("dp", 100, 1, 1000.0) == pytest.approx(10.0)


@pytest.mark.parametrize("groups, r", [(600_000, 2), (600_000, 4), (75_000, 8)])
def test_large_groups_finite_and_asymptotic(groups, r):
    exact = analysis.endurable_failures("spare", groups, r)
    asym = analysis.endurable_failures_asymptotic("spare", groups, r)
    assert math.isfinite(exact)
    assert abs(exact / asym - 1) < 0.05
    curve = endurance.log_survival_curve("spare", groups, r)
    assert np.all(np.isfinite(curve)) and np.all(np.diff(curve) <= 0) and curve[0] == 0.0
    if r == 2:  # closed form: G/(G-f) prod_{i<f} (G-f-i)/(G-i)
        f = np.arange(0, curve.size, 97)
        exact = [
            math.log(groups / (groups - k)) + np.log1p(-k / (groups - np.arange(k))).sum()
            for k in f
        ]
        np.testing.assert_allclose(np.exp(curve[f] - exact), 1.0, rtol=5e-8)


@pytest.mark.parametrize("groups, r", [(75_000, 2), (600_000, 3)])
def test_replication_asymptotic(groups, r):
    exact = analysis.endurable_failures("replication", groups, r)
    assert exact / analysis.endurable_failures_asymptotic(
        "replication", groups, r
    ) == pytest.approx(1, abs=2e-3)
    assert exact > analysis.endurable_failures("spare", groups, r)


def test_monte_carlo_small_ring():
    rng = np.random.default_rng(1)
    groups, r, trials = 300, 3, 4000
    counts = np.empty(trials)
    for t in range(trials):
        order = rng.permutation(groups)
        dead = np.zeros(groups, bool)
        for i, g in enumerate(order):
            dead[g] = True
            window = dead[(g + np.arange(-(r - 1), r)) % groups]
            if np.convolve(window, np.ones(r, int), "valid").max() >= r:
                counts[t] = i + 1
                break
    exact = analysis.endurable_failures("spare", groups, r)
    assert abs(counts.mean() - exact) < 4 * counts.std() / math.sqrt(trials)


def test_weibull_shape_one_is_exponential():
    e = analysis.mean_time_to_interruption("spare", 2_000, 3, 5_000.0)
    w = analysis.mean_time_to_interruption(
        "spare", 2_000, 3, 5_000.0, law="weibull", weibull_shape=1.0
    )
    assert w == pytest.approx(e, rel=1e-6)
    harmonic = (
        sum(analysis.survival("spare", 2_000, 3, k) / (2_000 - k) for k in range(2_000)) * 5_000.0
    )
    assert e == pytest.approx(harmonic, rel=1e-9)


def test_hot_repair_extends_time_to_interruption():
    base = weights.time_in_state("spare", 5_000, 3, 1e5).sum()
    hot = weights.time_in_state("spare", 5_000, 3, 1e5, mttr_s=3600.0).sum()
    fast = weights.time_in_state("spare", 5_000, 3, 1e5, mttr_s=600.0).sum()
    slow = weights.time_in_state("spare", 5_000, 3, 1e5, mttr_s=1e9).sum()
    assert fast > 10 * hot > 10 * base
    assert slow == pytest.approx(base, rel=1e-3)


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"strategy": "nope"}, "strategy"),
        ({"strategy": None}, "strategy"),
        ({"groups": 0}, "groups"),
        ({"groups": 10.0}, "groups"),
        ({"groups": True}, "groups"),
        ({"groups": 10**8}, "groups"),
        ({"redundancy": 0}, "redundancy"),
        ({"redundancy": 2.7}, "redundancy"),
        ({"groups": 3, "redundancy": 4}, "redundancy"),
        ({"groups": 100, "redundancy": 64}, "redundancy"),
        ({"strategy": "replication", "groups": 10, "redundancy": 3}, "divisible"),
        ({"strategy": "dp", "redundancy": 2}, "redundancy 1"),
    ],
)
def test_rejects_bad_input(bad, name):
    args = {"strategy": "spare", "groups": 10, "redundancy": 2} | bad
    with pytest.raises(ValueError, match=name):
        analysis.endurable_failures(args["strategy"], args["groups"], args["redundancy"])


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: analysis.survival("spare", 10, 2, [1.5]), "failures"),
        (lambda: analysis.survival("spare", 10, 2, [-1]), "failures"),
        (lambda: analysis.survival("spare", 10, 2, [True]), "failures"),
        (lambda: analysis.survival("spare", 10, 2, [1], convention="some"), "convention"),
        (lambda: analysis.survival("spare", 600, 2, [10**8], convention="any"), "failures"),
        (lambda: analysis.endurable_failures("spare", 10, 2, convention="x"), "convention"),
        (lambda: analysis.mean_time_to_interruption("spare", 10, 2, 0.0), "group_mtbf_s"),
        (lambda: analysis.mean_time_to_interruption("spare", 10, 2, math.nan), "group_mtbf_s"),
        (lambda: analysis.mean_time_to_interruption("spare", 10, 2, math.inf), "group_mtbf_s"),
        (lambda: analysis.mean_time_to_interruption("spare", 10, 2, 1.0, law="x"), "law"),
        (
            lambda: analysis.mean_time_to_interruption(
                "spare", 10, 2, 1.0, law="weibull", weibull_shape=0.0
            ),
            "weibull_shape",
        ),
        (lambda: weights.time_in_state("spare", 10, 2, 1.0, mttr_s=-1.0), "mttr_s"),
    ],
)
def test_functions_reject_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    strategy=st.sampled_from(["spare", "replication", "cyclic", "strided"]),
    groups=st.integers(1, 400),
    r=st.integers(1, 6),
)
def test_survival_is_a_tail_probability(strategy, groups, r):
    """1 for fewer than r failures, non-increasing, in [0, 1], summing to E[F] >= r."""
    hypothesis.assume(r <= groups and (strategy != "replication" or groups % r == 0))
    f = np.arange(groups + 2)
    p = analysis.survival(strategy, groups, r, f)
    assert np.all((p >= 0) & (p <= 1)) and np.all(np.diff(p) <= 1e-12)
    np.testing.assert_array_equal(p[: min(r, groups + 1)], 1.0)
    mean = analysis.endurable_failures(strategy, groups, r)
    assert mean == pytest.approx(p.sum(), rel=1e-9) and mean >= min(r, groups)

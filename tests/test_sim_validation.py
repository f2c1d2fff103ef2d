"""Simulation against the closed forms of `spare_jax.analysis` (the README's tolerances).

Endurable failures and mean time to interruption: within 2% at G in {1,000;
10,000; 75,000} and r in {2, 3, 4}. The trial counts keep the Monte Carlo
standard error at or below 0.6% of the mean (the coefficient of variation of
F is about 0.52, 0.38, 0.28 for r = 2, 3, 4, so trials = (cv / 0.006)^2), i.e.
the 2% tolerance is more than 3 standard errors; the tests also assert the
measured standard error, so a change that inflates the variance fails loudly.
Time-to-train: within 5% in representative scenarios.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from spare_jax import analysis, sim
from spare_jax.analysis import weights
from spare_jax.scenario import Scenario

CV = {2: 0.52, 3: 0.38, 4: 0.28}
TARGET_SE = 0.006


def _trials(r: int) -> int:
    return math.ceil((CV[r] / TARGET_SE) ** 2)


def _cases(groups: int) -> list:
    out = []
    for r in (2, 3, 4):
        out.append(("spare", groups, r))
        if groups % r == 0:
            out.append(("replication", groups, r))
    return out


CASES = [
    pytest.param(*c, marks=[pytest.mark.slow] if c[1] == 75_000 else [])
    for g in (1_000, 10_000, 75_000)
    for c in _cases(g)
]


@pytest.mark.parametrize("strategy, groups, r", CASES)
def test_endurable_failures_within_2_percent(strategy, groups, r):
    f = sim.failures_to_interruption(strategy, groups, r, trials=_trials(r), seed=r)
    exact = analysis.endurable_failures(strategy, groups, r)
    se = f.std() / math.sqrt(f.size) / f.mean()
    assert se < 1.2 * TARGET_SE
    assert abs(f.mean() / exact - 1) < 0.02


@pytest.mark.parametrize("strategy, groups, r", CASES)
def test_mean_time_to_interruption_within_2_percent(strategy, groups, r):
    mtbf = Scenario().group_mtbf_s
    t = sim.time_to_interruption(strategy, groups, r, mtbf, trials=_trials(r), seed=10 + r)
    exact = analysis.mean_time_to_interruption(strategy, groups, r, mtbf)
    se = t.std() / math.sqrt(t.size) / t.mean()
    assert se < 1.2 * TARGET_SE
    assert abs(t.mean() / exact - 1) < 0.02


@pytest.mark.parametrize("strategy, groups, r", [("spare", 1_000, 3), ("replication", 1_000, 2)])
def test_any_convention_within_2_percent(strategy, groups, r):
    f = sim.failures_to_interruption(
        strategy, groups, r, trials=_trials(r), seed=20, convention="any"
    )
    exact = analysis.endurable_failures(strategy, groups, r, convention="any")
    assert abs(f.mean() / exact - 1) < 0.02


def test_weibull_mean_time_to_interruption_within_2_percent():
    mtbf, k = Scenario().group_mtbf_s, 0.7
    t = sim.time_to_interruption(
        "spare", 10_000, 3, mtbf, trials=4_000, seed=30, law="weibull", weibull_shape=k
    )
    exact = analysis.mean_time_to_interruption(
        "spare", 10_000, 3, mtbf, law="weibull", weibull_shape=k
    )
    assert abs(t.mean() / exact - 1) < 0.02


def test_deliberately_wrong_model_is_caught():
    """The tolerance has teeth: a 5% error in the model would fail these tests."""
    f = sim.failures_to_interruption("spare", 1_000, 3, trials=_trials(3), seed=3)
    exact = analysis.endurable_failures("spare", 1_000, 3)
    assert abs(f.mean() / (1.05 * exact) - 1) > 0.02
    assert abs(f.mean() / exact - 1) < 0.02
    assert np.isclose(exact, analysis.endurable_failures("spare", 1_000, 3))


# ------------------------------------------------------------ time-to-train (5%)

TTT_CASES = [  # (name, scenario, strategy, r, policy)
    ("600k SPARe r=3", Scenario(), "spare", 3, "adaptive"),
    ("600k SPARe fixed r=3", Scenario(), "spare", 3, "fixed"),
    ("600k replication r=2", Scenario(), "replication", 2, "adaptive"),
    ("100k SPARe r=2", Scenario(gpus=100_000), "spare", 2, "adaptive"),
    ("100k checkpoint/restart", Scenario(gpus=100_000), "checkpoint_restart", 1, "adaptive"),
    ("16k checkpoint/restart", Scenario(gpus=16_384), "checkpoint_restart", 1, "adaptive"),
    (
        "100k SPARe r=3 async save",
        Scenario(gpus=100_000, checkpoint_async=True),
        "spare",
        3,
        "adaptive",
    ),
    ("600k replication r=2 hot re-join", Scenario(repair="hot"), "replication", 2, "adaptive"),
]


def _ttt_case(name, scenario, strategy, r, policy, replicas=8):
    est = analysis.time_to_train(scenario, strategy, redundancy=r, microbatches=8, policy=policy)
    summary = sim.simulate_many(
        scenario,
        strategy,
        replicas=replicas,
        seed=5,
        progress=False,
        redundancy=r,
        checkpoint_interval_s=est.checkpoint_interval_s,
        microbatches=8,
        policy=policy,
    )
    return est, summary


@pytest.mark.slow
@pytest.mark.parametrize("name, scenario, strategy, r, policy", TTT_CASES)
def test_time_to_train_within_5_percent(name, scenario, strategy, r, policy):
    replicas = 8 if scenario.gpus >= 600_000 and strategy == "spare" else 24
    est, summary = _ttt_case(name, scenario, strategy, r, policy, replicas)
    mean, se = summary.mean["time_to_train_s"], summary.stderr["time_to_train_s"]
    assert se / mean < 0.015, name  # the 5% tolerance is > 3 standard errors
    assert abs(mean / est.time_to_train_s - 1) < 0.05, name
    assert abs(summary.mean["availability"] - est.availability) < 0.02, name


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason=(
        "analysis renews every group at each restart; Scenario rule 3 replaces only failed "
        "groups, so Weibull (shape 0.7) survivors age and fail less: the simulation sees about "
        "a third of the interruptions and a ~10% shorter time-to-train at 600k"
    ),
)
def test_time_to_train_weibull_within_5_percent():
    scenario = Scenario(failure_law="weibull")
    est, summary = _ttt_case("weibull", scenario, "spare", 3, "adaptive", replicas=4)
    assert abs(summary.mean["time_to_train_s"] / est.time_to_train_s - 1) < 0.05


@pytest.mark.slow
def test_time_to_train_with_rack_failures_within_5_percent_at_100k():
    scenario = Scenario(gpus=100_000, domain_groups=4, domain_failure_fraction=0.1)
    est, summary = _ttt_case("racks", scenario, "spare", 3, "adaptive")
    assert abs(summary.mean["interruptions"] / est.interruptions - 1) < 0.05
    assert abs(summary.mean["time_to_train_s"] / est.time_to_train_s - 1) < 0.05


@pytest.mark.slow
def test_mean_time_to_interruption_with_rack_failures_at_600k():
    # Whole racks of 4 >= r groups interrupt at once: epochs of 1/nu ~ 3,060 s, far shorter
    # than the ~130 h between group-failure interruptions. The closed form must resolve them.
    scenario = Scenario(domain_groups=4, domain_failure_fraction=0.1)
    est, summary = _ttt_case("racks", scenario, "spare", 3, "adaptive", replicas=2)
    uptime = summary.mean["availability"] * summary.mean["time_to_train_s"]
    measured = uptime / summary.mean["interruptions"]  # ~2,300 epochs: s.e. ~2%
    assert abs(measured / est.mean_time_to_interruption_s - 1) < 0.05


# ------------------------------------------------------------ overhead over an epoch


@pytest.mark.parametrize(
    "r, policy", [(2, "adaptive"), (3, "adaptive"), (4, "adaptive"), (3, "fixed"), (4, "fixed")]
)
def test_epoch_overhead_matches_closed_form(r, policy):
    """Time-weighted overhead over an epoch at G = 1,000, m = 8 (no stated target:
    we hold the closed form to 3%, with a simulation standard error near 1%)."""
    integral, length, _ = sim.epoch_overhead(
        "spare", 1_000, r, 8, policy=policy, trials=400, seed=40 + r
    )
    mean, se = sim.ratio_mean(integral, length)
    w = weights.time_in_state("spare", 1_000, r, 1.0)
    over = analysis.overhead("spare", 1_000, r, 8, np.arange(w.size), policy=policy)
    closed = float(np.dot(w, over) / w.sum())
    assert se < 0.015 * mean
    assert abs(mean / closed - 1) < 0.03

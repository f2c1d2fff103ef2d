"""Checkpoint intervals, time-to-train and the optimiser (spare_jax.analysis)."""

from __future__ import annotations

import dataclasses
import math

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from spare_jax import analysis, placement, reorder
from spare_jax.analysis import checkpointing, planner
from spare_jax.incremental import LoadTracker
from spare_jax.scenario import Scenario

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize(
    "m_min, daly_min, young_min", [(24 * 60, 117, 120), (6 * 60, 57, 60), (15, 9.1, 12.2)]
)
def test_daly_worked_values(m_min, daly_min, young_min):
    """Daly's worked examples (Daly, FGCS 2006): C = 5 min."""
    assert analysis.young(5 * MIN, m_min * MIN) / MIN == pytest.approx(young_min, abs=0.06)
    assert analysis.daly(5 * MIN, m_min * MIN) / MIN == pytest.approx(daly_min, abs=0.35)


def test_daly_large_checkpoint_cost():
    assert analysis.daly(10.0, 4.0) == 4.0


@pytest.mark.parametrize("fn", [analysis.young, analysis.daly, analysis.exact_optimum])
@pytest.mark.parametrize(
    "c, m", [(math.nan, 60.0), (-1.0, 60.0), (60.0, 0.0), (60.0, math.inf), (math.inf, 1.0)]
)
def test_intervals_refuse_bad_costs(fn, c, m):
    with pytest.raises(ValueError, match="C|M"):
        fn(c, m)


@pytest.mark.parametrize("c, m", [(60.0, 3600.0), (300.0, 86400.0), (60.0, 306.0), (600.0, 100.0)])
def test_exact_optimum_minimises_segment_cost(c, m):
    tau = analysis.exact_optimum(c, m)
    grid = tau * np.exp(np.linspace(-1, 1, 201))
    costs = [checkpointing.segment_cost(t, c, m, 0.0)[0] / t for t in grid]
    assert np.argmin(costs) == 100
    if c / m < 0.01:
        assert tau == pytest.approx(analysis.daly(c, m), rel=0.01)


def test_checkpoint_restart_matches_exact_renewal_form():
    """r = 1 interruptions are exactly Poisson: T = (W/tau) (M + R) (exp((tau + C)/M) - 1)."""
    s = Scenario(gpus=80_000, work_hours=100.0)
    est = analysis.time_to_train(s, "checkpoint_restart")
    gap = s.group_mtbf_s / s.groups
    tau = analysis.exact_optimum(s.checkpoint_s, gap)
    want = (
        s.work_hours
        * HOUR
        / tau
        * (gap + s.restart_seconds())
        * math.expm1((tau + s.checkpoint_s) / gap)
    )
    assert est.time_to_train_s == pytest.approx(want, rel=1e-6)
    assert est.checkpoint_interval_s == pytest.approx(tau, rel=1e-3)
    assert est.mean_time_to_interruption_s == pytest.approx(gap)


def test_default_scenario_is_finite_and_ordered():
    s = Scenario()
    cr = analysis.time_to_train(s, "checkpoint_restart")
    rep = analysis.time_to_train(s, "replication", redundancy=2)
    spare = analysis.time_to_train(s, "spare", redundancy=3, microbatches=8)
    fixed = analysis.time_to_train(s, "spare", redundancy=3, policy="fixed")
    for e in (cr, rep, spare, fixed):
        assert math.isfinite(e.time_to_train_s) and 0 < e.availability <= 1
        assert e.effective_ratio == pytest.approx(s.work_hours * HOUR / e.time_to_train_s)
        assert e.time_to_train_s > s.work_hours * HOUR
    # docs/design.md section 1: a failure every ~5 min; replication r=2 interrupted every ~29 h.
    assert cr.mean_time_to_interruption_s == pytest.approx(306.0, rel=1e-9)
    assert rep.mean_time_to_interruption_s / HOUR == pytest.approx(29.0, rel=0.05)
    assert cr.time_to_train_s > 10 * rep.time_to_train_s
    assert spare.time_to_train_s < rep.time_to_train_s < fixed.time_to_train_s * 1.01
    assert rep.overhead_mean == pytest.approx(2.0, abs=1e-3)


def test_monotone_in_costs():
    base = Scenario(gpus=80_000)
    t0 = analysis.time_to_train(base, "spare", redundancy=3).time_to_train_s
    slower_restart = dataclasses.replace(base, restart_s_ref=1200.0)
    worse_gpus = dataclasses.replace(base, gpu_mtbf_hours=2.5e4)
    assert analysis.time_to_train(slower_restart, "spare", redundancy=3).time_to_train_s > t0
    assert analysis.time_to_train(worse_gpus, "spare", redundancy=3).time_to_train_s > t0
    costly_m = dataclasses.replace(base, microbatch_overhead=0.05)
    assert (
        analysis.time_to_train(costly_m, "spare", redundancy=3, microbatches=8).time_to_train_s > t0
    )


def test_hot_repair_and_weibull_run():
    s = Scenario(gpus=80_000)
    hot = analysis.time_to_train(dataclasses.replace(s, repair="hot"), "spare", redundancy=3)
    cold = analysis.time_to_train(s, "spare", redundancy=3)
    assert hot.time_to_train_s < cold.time_to_train_s
    assert hot.overhead_mean < cold.overhead_mean
    wb = analysis.time_to_train(
        dataclasses.replace(s, failure_law="weibull"), "replication", redundancy=2
    )
    assert math.isfinite(wb.time_to_train_s)


def test_domain_failures_interrupt_when_domains_cover_r():
    s = Scenario(gpus=80_000, domain_groups=4, domain_failure_fraction=0.1)
    with_dom = analysis.time_to_train(s, "spare", redundancy=3)
    without = analysis.time_to_train(Scenario(gpus=80_000), "spare", redundancy=3)
    assert with_dom.mean_time_to_interruption_s < without.mean_time_to_interruption_s


def test_optimiser_picks_the_best_candidate():
    s = Scenario(gpus=80_000)
    plan = analysis.optimise(s, "spare", redundancies=(2, 3, 4), microbatches=(1, 8))
    best = min(
        (analysis.time_to_train(s, "spare", redundancy=r, microbatches=m).time_to_train_s, r, m)
        for r in (2, 3, 4)
        for m in (1, 8)
    )
    assert (plan.redundancy, plan.microbatches) == best[1:]
    assert plan.estimate.time_to_train_s == pytest.approx(best[0])
    rep = analysis.optimise(s, "replication", redundancies=(1, 2, 3, 7))
    assert (
        rep.microbatches == 1 and s.groups % rep.redundancy == 0 and rep.strategy == "replication"
    )
    cr = analysis.optimise(s, "checkpoint_restart")
    assert cr.redundancy == 1


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"strategy": "nope"}, "strategy"),
        ({"strategy": "spare", "policy": "nope"}, "policy"),
        ({"strategy": "spare", "policy": "drop"}, "policy"),
        ({"strategy": "checkpoint_restart", "redundancy": 2}, "redundancy 1"),
        ({"strategy": "spare", "redundancy": 0}, "redundancy"),
        ({"strategy": "spare", "redundancy": 2.7}, "redundancy"),
        ({"strategy": "spare", "microbatches": 0}, "microbatches"),
        ({"strategy": "spare", "redundancy": 8, "microbatches": 64}, "microbatches"),
        ({"strategy": "spare", "redundancy": 3, "checkpoint_interval_s": -1.0}, "interval"),
        ({"strategy": "spare", "redundancy": 3, "checkpoint_interval_s": math.nan}, "interval"),
        ({"strategy": "replication", "redundancy": 7}, "divisible"),
    ],
)
def test_rejects_bad_input(bad, name):
    args = dict(bad)
    strategy = args.pop("strategy")
    with pytest.raises(ValueError, match=name):
        analysis.time_to_train(Scenario(gpus=80_000), strategy, **args)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"redundancies": [2.7]}, "redundancies"),
        ({"redundancies": [0, 2]}, "redundancies"),
        ({"redundancies": []}, "at least one"),
        ({"microbatches": [8.0]}, "microbatches"),
        ({"microbatches": [-1]}, "microbatches"),
        ({"redundancies": [64]}, "redundancy"),
        ({"redundancies": [2, 3, 4], "microbatches": [8, 128]}, "microbatches"),
        ({"policy": "replication"}, "policy"),
    ],
)
def test_optimise_refuses_bad_candidates_before_any_work(kwargs, name):
    analysis.clear_caches()
    with pytest.raises(ValueError, match=name):
        analysis.optimise(Scenario(gpus=80_000), "spare", **kwargs)
    assert planner._epoch.cache_info().currsize == 0  # nothing was evaluated


def test_checkpoint_restart_is_an_alias_of_dp():
    s = Scenario(gpus=80_000, work_hours=100.0)
    assert analysis.time_to_train(s, "dp") == analysis.time_to_train(s, "checkpoint_restart")


@pytest.mark.parametrize(
    "field",
    [
        "gpu_mtbf_hours",
        "work_hours",
        "checkpoint_s",
        "checkpoint_async_stall_s",
        "restart_s_ref",
        "restart_exponent",
        "mttr_hours",
        "domain_failure_fraction",
        "microbatch_overhead",
        "weibull_shape",
    ],
)
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
    value=st.sampled_from([math.nan, math.inf, -math.inf, -1.0]) | st.floats(max_value=-1e-9)
)
def test_scenario_refuses_non_finite_and_negative_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        Scenario(**{field: value})


@pytest.mark.parametrize(
    "changes, name",
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": 6e5}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"gpus": 10**12}, "groups"),
        ({"gpus_per_group": 7}, "multiple"),
        ({"restart_ref_gpus": 0}, "restart_ref_gpus"),
        ({"domain_groups": -1}, "domain_groups"),
        ({"failure_law": "gamma"}, "failure_law"),
        ({"repair": "never"}, "repair"),
        ({"checkpoint_async": 1}, "checkpoint_async"),
        ({"weibull_shape": 100.0}, "weibull_shape"),
        ({"restart_exponent": 1e6}, "restart_seconds"),
        ({"gpu_mtbf_hours": 1e307}, "group_mtbf_s"),
    ],
)
def test_scenario_refuses_bad_fields(changes, name):
    with pytest.raises(ValueError, match=name):
        Scenario(**changes)
    with pytest.raises(ValueError, match=name):
        dataclasses.replace(Scenario(), **changes)


def test_scenario_from_mapping():
    assert Scenario.from_mapping({"gpus": 80_000}) == Scenario(gpus=80_000)
    with pytest.raises(ValueError, match="unknown scenario field"):
        Scenario.from_mapping({"gpus": 80_000, "nonsense": 1})


def _simulate(
    s: Scenario, strategy: str, r: int, m: int, tau: float, rng: np.random.Generator
) -> float:
    """A compact player of the scenario rules (exponential, restart repair): wall time to train."""
    g = s.groups
    p = placement.replication(g, r) if strategy == "replication" else placement.cyclic(g, r)
    work, wall, done = s.work_hours * HOUR, 0.0, 0.0
    while True:  # one epoch: fresh groups, failures in a uniform order
        times = np.sort(rng.exponential(s.group_mtbf_s, g))
        order = rng.permutation(g)
        tracker = LoadTracker(p, m, "adaptive")
        over = [tracker.max_load / m]  # r for replication, 1 + ... for stacking
        end = math.inf
        for t, grp in zip(times, order):
            try:
                over.append(tracker.fail(int(grp)) / m)
            except reorder.Interruption:
                end = t
                break
        b = np.concatenate([[0.0], times[: len(over) - 1], [end if math.isfinite(end) else 1e30]])
        rate = 1.0 / np.array(over)
        cum = np.concatenate([[0.0], np.cumsum(np.diff(b) * rate)])
        age = 0.0
        while True:
            start = float(np.interp(age, b, cum))
            need = work - done
            stop = age + tau
            if float(np.interp(stop, b, cum)) - start >= need:  # finishes inside this compute
                stop = float(np.interp(start + need, cum, b))
                if stop <= end:
                    return wall + stop
            if stop + s.checkpoint_s > end:
                wall += end + s.restart_seconds()
                break
            done += float(np.interp(stop, b, cum)) - start
            age = stop + s.checkpoint_s


@pytest.mark.parametrize("strategy, r, m", [("spare", 3, 4), ("replication", 2, 1)])
def test_time_to_train_against_own_monte_carlo(strategy, r, m):
    """Small cluster, several interruptions per run: the closed form within 2.5% (target: 5%)."""
    s = Scenario(
        gpus=8_000,
        gpu_mtbf_hours=1_000.0,
        work_hours=60.0,
        checkpoint_s=300.0,
        restart_s_ref=1800.0,
        restart_ref_gpus=8_000,
    )
    est = analysis.time_to_train(s, strategy, redundancy=r, microbatches=m)
    assert est.interruptions > 3
    rng = np.random.default_rng(7)
    runs = np.array(
        [_simulate(s, strategy, r, m, est.checkpoint_interval_s, rng) for _ in range(150)]
    )
    se = runs.std() / math.sqrt(runs.size)
    assert abs(runs.mean() / est.time_to_train_s - 1) < 0.025 + 3 * se / runs.mean()


@pytest.mark.parametrize("r", [3, 4])
def test_age_grid_resolves_epochs_with_few_groups(r):
    """G = 120: the age grid must end with the epochs, not dozens of MTBFs later.

    (The SimGrid validation found the closed form 7-10% low here: the grid ran to
    36.7 MTBFs with 1,102 s steps against 5,301 s epochs.) The age model's
    time-averaged overhead must match the exact time spent in each dead count.
    """
    from spare_jax.analysis import endurance, overhead_model, renewal, weights

    groups, mtbf = 120, 24_000.0
    k = np.arange(endurance.log_survival_curve("spare", groups, r).size)
    o, inv = overhead_model.overhead_moments("spare", groups, r, 8, k, policy="fixed")
    o = np.where(np.isfinite(o), o, np.nanmax(o))
    inv = np.where(np.isfinite(inv), inv, 1 / o)
    model = renewal.age_model("spare", groups, r, mtbf, o, horizon_s=1e7, inverse=inv)
    w = weights.time_in_state("spare", groups, r, mtbf)
    exact = float(np.sum(w * o[: w.size]) / w.sum())
    assert model.rate_overhead == pytest.approx(exact, rel=1e-3)
    assert model.mean_gap == pytest.approx(float(w.sum()), rel=1e-6)

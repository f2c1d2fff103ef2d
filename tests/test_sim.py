"""Tests of the simulator itself: exact values, hand-worked runs, a tick-by-tick reference."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from spare_jax import placement, reorder, sim, strategies
from spare_jax.scenario import Scenario, weibull_scale
from spare_jax.sim.hot import _Load

HOUR = 3600.0


# ------------------------------------------------------------ failures to interruption


@pytest.mark.parametrize(
    "strategy, groups, r, exact",
    [
        ("spare", 60, 2, 7.372),
        ("replication", 60, 2, 9.749),
        ("spare", 120, 4, 36.21),
        ("replication", 120, 4, 46.62),
    ],
)
def test_failures_to_interruption_matches_design_values(strategy, groups, r, exact):
    f = sim.failures_to_interruption(strategy, groups, r, trials=40_000, seed=1)
    stderr = f.std() / math.sqrt(f.size)  # ~0.3% of the mean
    assert abs(f.mean() - exact) < 4 * stderr + 0.005 * exact


@pytest.mark.parametrize("pairs, exact", [(1, 3.0), (2, 3.667), (10, 6.675), (100, 18.75)])
def test_any_convention_matches_casanova(pairs, exact):
    f = sim.failures_to_interruption(
        "replication", 2 * pairs, 2, trials=40_000, seed=2, convention="any"
    )
    stderr = f.std() / math.sqrt(f.size)
    assert abs(f.mean() - exact) < 4 * stderr + 0.002 * exact


def test_dp_interrupts_at_first_failure_and_counts_are_bounded():
    assert np.all(sim.failures_to_interruption("dp", 50, 1, trials=10) == 1)
    f = sim.failures_to_interruption("spare", 40, 3, trials=500, seed=3)
    assert f.min() >= 3 and f.max() <= 40


def test_threshold_agrees_with_reorder_core():
    """The min-max interruption is exactly where `reorder.uncovered` first fires."""
    rng = np.random.default_rng(4)
    for p in (
        placement.cyclic(30, 3),
        placement.strided(31, 3),
        placement.replication(30, 3),
        placement.cyclic(24, 2, ring_size=8),
        placement.from_stacks(placement.cyclic(20, 2).stacks[rng.permutation(20)]),
    ):
        for _ in range(20):
            death = rng.random(p.groups)
            t = sim.interruption_threshold(p, death)
            assert reorder.uncovered(p, death > t).size > 0
            assert reorder.uncovered(p, death >= t).size == 0


def test_batched_threshold_equals_row_by_row():
    p = placement.cyclic(50, 3)
    death = np.random.default_rng(5).random((7, 50))
    rows = [sim.interruption_threshold(p, d) for d in death]
    np.testing.assert_array_equal(sim.interruption_threshold(p, death), rows)


def test_time_to_interruption_dp_and_weibull_means():
    g, mtbf = 200, 1000.0
    t = sim.time_to_interruption("dp", g, 1, mtbf, trials=20_000, seed=6)
    assert abs(t.mean() / (mtbf / g) - 1) < 0.03  # stderr 0.7%
    k = 0.7
    t = sim.time_to_interruption(
        "dp", g, 1, mtbf, trials=20_000, seed=7, law="weibull", weibull_shape=k
    )
    scale = weibull_scale(mtbf, k)
    exact = scale * g ** (-1 / k) * math.gamma(1 + 1 / k)  # min of g Weibulls
    assert abs(t.mean() / exact - 1) < 0.05  # stderr ~1.1%


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: sim.failures_to_interruption("spare", 10, 2, trials=0), "trials"),
        (lambda: sim.failures_to_interruption("spare", 10, 2, trials=2.5), "trials"),
        (lambda: sim.failures_to_interruption("spare", 10, 2, trials=5, seed=-1), "seed"),
        (lambda: sim.failures_to_interruption("spare", 10, 2, trials=5, convention="x"), "conv"),
        (lambda: sim.failures_to_interruption("nope", 10, 2, trials=5), "strategy"),
        (lambda: sim.failures_to_interruption("spare", 10, 11, trials=5), "redundancy"),
        (lambda: sim.failures_to_interruption("spare", 10**8, 2, trials=1), "groups"),
        (lambda: sim.time_to_interruption("spare", 10, 2, 100.0, trials=5, law="x"), "law"),
        (lambda: sim.time_to_interruption("spare", 10, 2, math.nan, trials=5), "mtbf"),
        (lambda: sim.time_to_interruption("spare", 10, 2, -1.0, trials=5), "mtbf"),
        (lambda: sim.epoch_overhead("spare", 10, 2, 0, trials=5), "microbatches"),
        (lambda: sim.epoch_overhead("spare", 10, 2, 8, trials=5, policy="drop"), "policy"),
        (lambda: sim.ratio_mean(np.ones(3), np.ones(2)), "shape"),
        (lambda: sim.simulate_many(_small(), "spare", replicas=0), "replicas"),
        (lambda: sim.simulate_many(_small(), "spare", replicas=2, seed=-3), "seed"),
    ],
)
def test_monte_carlo_rejects_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize(
    "times, groups, name",
    [
        ([1.0, math.nan], [0, 1], "finite"),
        ([-1.0], [0], "finite"),
        ([1.0], [12], "group ids"),
        ([1.0], [-1], "group ids"),
        ([1.0], [0.5], "integer"),
        ([1.0, 2.0], [0], "equal length"),
    ],
)
def test_trace_is_validated(times, groups, name):
    trace = (np.array(times), np.array(groups))
    with pytest.raises(ValueError, match=name):
        sim.simulate(_small(), "spare", redundancy=2, checkpoint_interval_s=HOUR, trace=trace)


# ------------------------------------------------------------ checkpoint arithmetic


def test_checkpointing_arithmetic():
    c = sim.Checkpointing(interval_s=100.0, stall_s=10.0, save_s=10.0)
    np.testing.assert_allclose(
        c.compute_time(np.array([0, 50, 100, 105, 110, 260])), [0, 50, 100, 100, 100, 240]
    )
    assert c.time_of_compute(100.0) == 100.0 and c.time_of_compute(150.0) == 160.0
    assert c.completed(109.9) == 0 and c.completed(110.0) == 1
    assert c.save_start(2) == 210.0
    a = sim.Checkpointing(interval_s=100.0, stall_s=2.0, save_s=30.0)  # async
    assert a.completed(129.9) == 0 and a.completed(130.0) == 1
    never = sim.Checkpointing(math.inf, 10.0, 10.0)
    assert never.completed(1e9) == 0 and never.time_of_compute(5.0) == 5.0


# ------------------------------------------------------------ hand-worked runs (traces)


def _small(**kw) -> Scenario:
    base = {
        "gpus": 96,
        "gpus_per_group": 8,
        "work_hours": 10.0,
        "checkpoint_s": 60.0,
        "restart_s_ref": 600.0,
        "restart_ref_gpus": 96,
        "restart_exponent": 1.0,
    }
    return Scenario(**(base | kw))


NO_FAILURES = (np.zeros(0), np.zeros(0, np.int64))


def test_no_failures_blocking_and_async():
    res = sim.simulate(
        _small(), "checkpoint_restart", checkpoint_interval_s=HOUR, trace=NO_FAILURES
    )
    assert res.time_to_train_s == pytest.approx(10 * HOUR + 9 * 60)
    assert res.checkpoints == 9 and res.interruptions == 0 and res.availability == 1.0
    res = sim.simulate(
        _small(checkpoint_async=True, checkpoint_async_stall_s=5.0),
        "checkpoint_restart",
        checkpoint_interval_s=HOUR,
        trace=NO_FAILURES,
    )
    assert res.time_to_train_s == pytest.approx(10 * HOUR + 9 * 5)
    res = sim.simulate(
        _small(), "replication", redundancy=2, checkpoint_interval_s=math.inf, trace=NO_FAILURES
    )
    assert res.time_to_train_s == pytest.approx(20 * HOUR) and res.overhead_mean == 2.0


def test_one_failure_checkpoint_restart_by_hand():
    trace = (np.array([2.5 * HOUR]), np.array([4]))
    res = sim.simulate(_small(), "checkpoint_restart", checkpoint_interval_s=HOUR, trace=trace)
    # Saves complete at 3660 s and 7320 s; the failure at 9000 s loses 1680 s of work.
    assert res.lost_work_s == pytest.approx(1680.0) and res.lost_progress_s == pytest.approx(1680.0)
    assert res.time_to_train_s == pytest.approx(9000 + 600 + 8 * HOUR + 7 * 60)
    assert res.interruptions == 1 and res.failures == 1 and res.checkpoints == 2 + 7
    assert res.availability == pytest.approx(1 - 600 / res.time_to_train_s)


def test_spare_overhead_from_live_set_by_hand():
    # G = 12, r = 2, m = 8: one dead group gives max load ceil(96 / 11) = 9 micro-batches.
    trace = (np.array([HOUR]), np.array([3]))
    res = sim.simulate(_small(), "spare", redundancy=2, checkpoint_interval_s=math.inf, trace=trace)
    assert res.time_to_train_s == pytest.approx(HOUR + 9 * HOUR * 9 / 8)
    assert res.overhead_mean == pytest.approx(
        (HOUR + 9 / 8 * 9 * HOUR * 9 / 8) / res.time_to_train_s
    )
    assert res.overhead_max == 9 / 8 and res.interruptions == 0 and res.failures == 1
    fixed = sim.simulate(
        _small(), "spare", redundancy=2, checkpoint_interval_s=math.inf, trace=trace, policy="fixed"
    )
    assert fixed.time_to_train_s == pytest.approx(HOUR + 9 * HOUR * 2)


def test_trace_events_during_restart_and_on_dead_groups_are_ignored():
    # Two adjacent deaths interrupt r = 2 stacking at 1 h; the event at 1 h + 100 s falls
    # inside the 600 s restart; the repeated event on group 3 is a no-op.
    trace = (np.array([0.5 * HOUR, 0.6 * HOUR, HOUR, HOUR + 100]), np.array([3, 3, 4, 7]))
    res = sim.simulate(_small(), "spare", redundancy=2, checkpoint_interval_s=math.inf, trace=trace)
    assert res.interruptions == 1 and res.failures == 2
    assert res.lost_progress_s == pytest.approx(0.5 * HOUR + 0.5 * HOUR * 8 / 9)
    assert res.lost_work_s == pytest.approx(HOUR)
    assert res.time_to_train_s == pytest.approx(HOUR + 600 + 10 * HOUR)


# ------------------------------------------------------------ tick-by-tick reference


def _reference(
    scenario: Scenario, p: placement.Placement, trace, tau: float, m: int, dt: float
) -> tuple[float, float, int]:
    """Naive tick simulation of Scenario's rules: (time-to-train, lost work, interruptions).

    Durations are whole numbers of ticks so the schedule does not drift; a failure
    inside a tick takes effect at the tick's start.
    """

    def ticks(x: float) -> int:
        return round(x / dt)

    work, restart, tau_t = scenario.work_hours * HOUR, ticks(scenario.restart_seconds()), ticks(tau)
    stall = ticks(
        scenario.checkpoint_async_stall_s if scenario.checkpoint_async else scenario.checkpoint_s
    )
    save = ticks(scenario.checkpoint_s)
    times, groups = trace
    alive = np.ones(p.groups, bool)
    tick, done, saved, lost, interruptions, event = 0, 0.0, 0.0, 0.0, 0, 0
    restarting, stalling, computed = 0, 0, 0
    pending: list[tuple[int, float]] = []  # (completion tick, progress recorded)
    overhead = reorder.max_load(p, alive, m) / m
    while done < work - 1e-9:
        while event < len(times) and times[event] < (tick + 1) * dt:
            if restarting <= 0 and alive[groups[event]]:
                alive[groups[event]] = False
                if reorder.uncovered(p, alive).size:
                    lost += done - saved
                    done, interruptions, restarting = saved, interruptions + 1, restart
                    stalling, computed, pending = 0, 0, []
                    alive[:] = True
                overhead = reorder.max_load(p, alive, m) / m
            event += 1
        tick += 1
        if restarting > 0:
            restarting -= 1
            continue
        for item in [x for x in pending if x[0] <= tick]:
            saved = max(saved, item[1])
            pending.remove(item)
        if stalling > 0:
            stalling -= 1
            continue
        done += dt / overhead
        computed += 1
        if computed >= tau_t and done < work - 1e-9:
            pending.append((tick + save, done))
            stalling, computed = stall, 0
    return tick * dt, lost, interruptions


@pytest.mark.parametrize(
    "strategy, r, async_",
    [
        ("spare", 2, False),
        ("spare", 3, True),
        ("replication", 2, False),
        ("checkpoint_restart", 1, False),
    ],
)
def test_engine_matches_tick_reference(strategy, r, async_):
    scenario = _small(
        gpus=8 * 24,
        restart_ref_gpus=8 * 24,
        work_hours=0.5,
        checkpoint_s=20.0,
        restart_s_ref=50.0,
        checkpoint_async=async_,
        checkpoint_async_stall_s=4.0,
    )
    rng = np.random.default_rng(8 + r)
    n = 60 if r > 1 else 8
    times = np.sort(rng.uniform(0, 6000, n))
    trace = (times, rng.integers(0, 24, n))
    p = strategies.placement(strategy, 24, r)
    res = sim.simulate(scenario, strategy, redundancy=r, checkpoint_interval_s=170.0, trace=trace)
    ref_t, ref_lost, ref_int = _reference(scenario, p, trace, 170.0, 8, dt=0.05)
    assert res.interruptions == ref_int
    assert res.time_to_train_s == pytest.approx(ref_t, abs=2.0)
    assert res.lost_progress_s == pytest.approx(ref_lost, abs=2.0)


# ------------------------------------------------------------ random runs


def test_random_run_is_reproducible_and_consistent():
    sc = _small(gpus=8 * 1000, restart_ref_gpus=8 * 1000, gpu_mtbf_hours=2000.0, work_hours=100.0)
    a = sim.simulate(sc, "spare", redundancy=3, checkpoint_interval_s=1800.0, seed=3)
    b = sim.simulate(sc, "spare", redundancy=3, checkpoint_interval_s=1800.0, seed=3)
    assert a == b
    assert a.time_to_train_s > 100 * HOUR and 0 < a.availability <= 1
    assert a.effective_ratio == pytest.approx(100 * HOUR / a.time_to_train_s)
    assert 1 < a.overhead_mean <= a.overhead_max <= 3
    assert a.failures > 0


def test_weibull_and_domains_run():
    sc = _small(
        gpus=8 * 600,
        restart_ref_gpus=8 * 600,
        gpu_mtbf_hours=4000.0,
        work_hours=50.0,
        failure_law="weibull",
        domain_groups=4,
        domain_failure_fraction=0.5,
    )
    cyc = sim.simulate_many(
        sc,
        "spare",
        replicas=6,
        processes=1,
        progress=False,
        redundancy=3,
        checkpoint_interval_s=1800.0,
    )
    strided = sim.simulate_many(
        sc,
        "spare",
        replicas=6,
        processes=1,
        progress=False,
        redundancy=3,
        checkpoint_interval_s=1800.0,
        layout="strided",
    )
    # A rack of 4 consecutive groups takes r = 3 consecutive holders with it under cyclic
    # stacking; the strided layout spreads every shard's holders across racks.
    assert cyc.mean["interruptions"] > 3 * strided.mean["interruptions"]


def test_domain_failures_kill_whole_domains():
    p = placement.cyclic(40, 2)
    proc = sim.RandomFailures(
        p, 1e9, domain_groups=5, domain_failure_fraction=1e6, rng=np.random.default_rng(0)
    )
    seg = proc.segment(0.0, math.inf)
    assert seg.event_sizes.size == 1 and seg.event_sizes[0] == 5
    assert np.all(np.diff(np.sort(seg.groups)) == 1) and seg.groups.min() % 5 == 0


def test_simulate_many_pool_matches_in_process():
    sc = _small(gpus=8 * 200, restart_ref_gpus=8 * 200, gpu_mtbf_hours=1000.0, work_hours=20.0)
    kw = {
        "replicas": 4,
        "seed": 11,
        "progress": False,
        "redundancy": 2,
        "checkpoint_interval_s": 900.0,
    }
    one = sim.simulate_many(sc, "replication", processes=1, **kw)
    two = sim.simulate_many(sc, "replication", processes=2, **kw)
    assert one.mean == two.mean and one.replicas == 4
    assert one.time_to_train_s == one.mean["time_to_train_s"]
    assert one.stderr["time_to_train_s"] > 0


def test_trace_with_hot_repair_is_not_supported():
    with pytest.raises(NotImplementedError):
        sim.simulate(
            _small(repair="hot"),
            "spare",
            redundancy=2,
            checkpoint_interval_s=HOUR,
            trace=NO_FAILURES,
        )


@pytest.mark.parametrize(
    "strategy, kwargs, name",
    [
        ("elastic", {}, "strategy"),
        ("checkpoint_restart", {"redundancy": 2}, "redundancy 1"),
        ("checkpoint_restart", {"checkpoint_interval_s": 0.0}, "checkpoint_interval_s"),
        ("checkpoint_restart", {"checkpoint_interval_s": math.nan}, "checkpoint_interval_s"),
        ("spare", {"redundancy": 2, "policy": "drop"}, "policy"),
        ("spare", {"redundancy": 2, "microbatches": 0}, "microbatches"),
        ("spare", {"redundancy": 2.5}, "redundancy"),
        ("spare", {"redundancy": 2, "seed": -1}, "seed"),
        ("spare", {"redundancy": 2, "layout": "diagonal"}, "layout"),
        ("spare", {"redundancy": 2, "max_wall_factor": math.nan}, "max_wall_factor"),
        ("replication", {"redundancy": 5}, "divisible"),
    ],
)
def test_rejects_bad_arguments(strategy, kwargs, name):
    kwargs = {"checkpoint_interval_s": HOUR} | kwargs
    with pytest.raises(ValueError, match=name):
        sim.simulate(_small(), strategy, **kwargs)


def test_microbatch_cost_slows_spare_adaptive_only():
    sc = dataclasses.replace(_small(), microbatch_overhead=0.01)
    res = sim.simulate(sc, "spare", redundancy=2, checkpoint_interval_s=math.inf, trace=NO_FAILURES)
    assert res.time_to_train_s == pytest.approx(10 * HOUR * 1.07)
    res = sim.simulate(
        sc, "spare", redundancy=2, checkpoint_interval_s=math.inf, trace=NO_FAILURES, policy="fixed"
    )
    assert res.time_to_train_s == pytest.approx(10 * HOUR)


@pytest.mark.parametrize("groups, r, m", [(300, 3, 4), (200, 2, 8), (240, 4, 2)])
def test_hot_repair_load_is_exact(groups, r, m):
    """The hot-repair overhead (gap shortcut + dead-window Hall terms) equals reorder's."""
    rng = np.random.default_rng(groups)
    p = placement.cyclic(groups, r)
    load = _Load(p, m, "adaptive")
    for _ in range(600):
        if load.dead and (rng.random() < 0.45 or len(load.dead) > 50):
            load.set(load.dead[rng.integers(len(load.dead))], True)
        else:
            g = int(rng.integers(groups))
            trial = load.alive.copy()
            trial[g] = False
            if not load.alive[g] or reorder.uncovered(p, trial).size:
                continue
            load.set(g, False)
        assert load.overhead() == reorder.max_load(p, load.alive, m) / m


def test_hot_repair_runs_and_repairs_help():
    base = {
        "gpus": 8 * 3000,
        "restart_ref_gpus": 8 * 3000,
        "gpu_mtbf_hours": 3000.0,
        "work_hours": 100.0,
    }
    kw = {
        "replicas": 3,
        "processes": 1,
        "progress": False,
        "redundancy": 2,
        "checkpoint_interval_s": 3600.0,
    }
    cold = sim.simulate_many(_small(**base), "spare", **kw)
    hot = sim.simulate_many(_small(repair="hot", mttr_hours=0.5, **base), "spare", **kw)
    assert hot.mean["interruptions"] < 0.5 * cold.mean["interruptions"]
    assert hot.mean["time_to_train_s"] < cold.mean["time_to_train_s"]
    assert 1 < hot.mean["overhead_mean"] < 2

"""The SimGrid backend (`spare_jax.sim.simgrid`): platform, collectives, failures, checks.

Tests marked `needs_simgrid` run in CI, which installs SimGrid (.ci/run); on a
machine without it they are skipped, and the tests of what happens without
SimGrid still run.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from spare_jax import analysis, reorder, sim, strategies
from spare_jax.scenario import Scenario
from spare_jax.sim import simgrid
from spare_jax.sim import simgrid_compat as compat

needs_simgrid = pytest.mark.skipif(not compat.available(), reason=compat.INSTALL_HINT)

CM02 = simgrid.Cluster(network="CM02", bandwidth_Bps=400e9, latency_s=2e-6)


def _scenario(groups: int, steps_per_failure: float, work_s: float, **kw) -> Scenario:
    """G groups of 8 GPUs with a failure every `steps_per_failure` one-second steps."""
    mtbf = steps_per_failure * groups  # group MTBF, seconds
    return Scenario(
        gpus=8 * groups,
        gpu_mtbf_hours=mtbf * 8 / 3600.0,
        work_hours=work_s / 3600.0,
        restart_ref_gpus=8 * groups,
        **kw,
    )


def _replay(p, mean_s: float, seed: int, count: int) -> tuple[list[int], list[float]]:
    """Failures and uptime of `count` segments of the fast simulator's failure process."""
    process = sim.RandomFailures(p, mean_s, rng=np.random.default_rng(seed))
    clock, fails, ups = 0.0, [], []
    for _ in range(count):
        seg = process.segment(clock, math.inf)
        fails.append(seg.event_times.size)
        ups.append(seg.interruption)
        clock += seg.interruption
        process.restart(clock)
    return fails, ups


# ---------------------------------------------------------------- without SimGrid


def test_missing_simgrid_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "simgrid", None)  # `import simgrid` now raises ImportError
    assert not compat.available()
    with pytest.raises(compat.SimGridMissing, match="apt-get install python3-simgrid"):
        compat.load()
    sc = _scenario(12, 50, 100)
    with pytest.raises(compat.SimGridMissing):
        simgrid.run(sc, "spare", redundancy=2, checkpoint_interval_s=60.0)
    assert "\n" not in compat.INSTALL_HINT


def test_collectives_keep_messages_linear_in_groups():
    live = np.arange(0, 200, 2)  # 100 live groups
    n, size = live.size, 1e9
    ring = compat.allreduce("ring", live, size, 32)
    assert len(ring[0]) == n and all(len(p) == 1 for p in ring[1:])
    assert len(ring) - 1 == 2 * (n - 1) - 1  # the latency chain
    assert sum(x for _, _, x in ring[0]) == pytest.approx(2 * (n - 1) * size)
    assert {(a, b) for a, b, _ in ring[0]} == set(zip(live, np.roll(live, -1), strict=True))
    rounds = compat.allreduce("ring_rounds", live, size, 32)
    assert len(rounds) == 2 * (n - 1) and sum(len(p) for p in rounds) == 2 * n * (n - 1)
    tree = compat.allreduce("tree", live, size, 32)
    edges = {(a, b) for a, b, _ in tree[0]}
    assert len(tree[0]) == 2 * (n - 1) and all((b, a) in edges for a, b in edges)
    assert set(np.unique([a for a, _ in edges])) == set(live.tolist())  # a spanning tree
    hops = [p[0][:2] for p in tree[1:]]
    assert all(h in edges for h in hops)  # the chain walks tree edges
    assert compat.allreduce("ring", live[:1], size, 32) == []


def test_bad_arguments_are_refused():
    sc = _scenario(12, 50, 100)
    with pytest.raises(ValueError, match="network"):
        simgrid.run_spec(
            sc, "spare", redundancy=2, checkpoint_interval_s=60, cluster=simgrid.Cluster("X")
        )
    with pytest.raises(ValueError, match="allreduce"):
        simgrid.run_spec(
            sc,
            "spare",
            redundancy=2,
            checkpoint_interval_s=60,
            workload=simgrid.Workload(allreduce="butterfly"),
        )
    with pytest.raises(ValueError, match="strategy"):
        simgrid.run_spec(sc, "raid", redundancy=2, checkpoint_interval_s=60)
    with pytest.raises(NotImplementedError, match="blocking"):
        async_sc = _scenario(12, 50, 100, checkpoint_async=True)
        simgrid.run_spec(async_sc, "spare", redundancy=2, checkpoint_interval_s=60)


# ---------------------------------------------------------------- on SimGrid


@needs_simgrid
def test_step_and_save_times_follow_alpha_beta_on_contention_free_links():
    n, size, lat, bw = 8, 8e8, 2e-6, 400e9
    exact = simgrid.Cluster(network="CM02", latency_s=lat, bandwidth_Bps=bw, crosstraffic=False)
    quiet = _scenario(n, 1e12, 5.0, checkpoint_s=0.5)  # no failure in the run
    runs = simgrid.play(
        [
            simgrid.run_spec(
                quiet,
                "spare",
                redundancy=2,
                checkpoint_interval_s=2.0,
                cluster=exact,
                workload=simgrid.Workload(gradient_bytes=size, allreduce=kind),
            )
            for kind in ("ring", "ring_rounds", "tree")
        ],
        processes=2,
    )
    ring, rounds, tree = (r.step_s for r in runs)
    alpha = 2 * lat  # two links per route on the star
    assert rounds == pytest.approx(1.0 + 2 * (n - 1) * (alpha + size / n / bw), rel=1e-9)
    assert ring == pytest.approx(rounds, rel=1e-9)  # wave + chain == round by round
    # Heap of 8: node 1 carries 3 copies each way; the deepest path 7-3-1-0 has 3 hops.
    assert tree == pytest.approx(1.0 + alpha + 3 * size / bw + (2 * 3 - 1) * alpha, rel=1e-9)
    for run in runs:  # 5 steps; a save after steps 2 and 4: the storage link shares 0.5 s of data
        assert run.result.failures == 0 and run.result.checkpoints == 2
        want = 5 * run.step_s + 2 * (0.5 + alpha)
        assert run.result.time_to_train_s == pytest.approx(want, rel=1e-9)


@needs_simgrid
def test_cached_steps_equal_simulated_steps():
    sc = _scenario(16, 40, 800.0, checkpoint_s=5.0, restart_s_ref=50.0)
    kw = {"redundancy": 2, "checkpoint_interval_s": 120.0, "seed": 3, "cluster": CM02}
    cached, each = simgrid.play(
        [
            simgrid.run_spec(sc, "spare", **kw, workload=simgrid.Workload(detection_s=1.5)),
            simgrid.run_spec(
                sc, "spare", **kw, workload=simgrid.Workload(detection_s=1.5, cache_steps=False)
            ),
        ],
        processes=2,
    )
    a, b = cached.result, each.result
    assert a.interruptions >= 2 and a.checkpoints >= 2 and cached.void_steps >= 2  # all paths
    assert each.simulated_steps >= each.steps > 10 * cached.simulated_steps
    for field in ("time_to_train_s", "overhead_mean", "lost_work_s", "availability"):
        assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-9), field
    for field in ("interruptions", "failures", "checkpoints", "lost_progress_s"):
        assert getattr(a, field) == getattr(b, field), field
    assert cached.epoch_failures == each.epoch_failures and cached.steps == each.steps


@needs_simgrid
def test_failures_are_the_fast_simulators_trace():
    g, r, seed = 24, 2, 11
    sc = _scenario(g, 100, 3000.0, checkpoint_s=5.0, restart_s_ref=40.0)
    run = simgrid.run(
        sc,
        "spare",
        redundancy=r,
        checkpoint_interval_s=150.0,
        seed=seed,
        cluster=CM02,
        workload=simgrid.Workload(detection_s=1.0),
    )
    count = len(run.epoch_failures)
    assert count >= 3 and run.result.interruptions == count
    fails, ups = _replay(strategies.placement("spare", g, r), sc.group_mtbf_s, seed, count)
    assert list(run.epoch_failures) == fails
    assert np.allclose(run.epoch_uptime_s, ups, rtol=1e-9)
    # Every failure up to the end: those of the interrupted segments and of the last one.
    assert run.result.failures >= sum(fails)


@needs_simgrid
def test_step_time_is_max_load_when_communication_is_free():
    g = 24
    free = simgrid.Cluster(network="CM02", latency_s=0.0)
    workload = simgrid.Workload(gradient_bytes=1.0, step_compute_s=1.0)
    adaptive, fixed, repl = simgrid.play(
        [
            simgrid.run_spec(
                _scenario(g, 20, 600.0, checkpoint_s=1.0, restart_s_ref=30.0),
                strategy,
                redundancy=2,
                policy=policy,
                checkpoint_interval_s=30.0,
                seed=5,
                cluster=free,
                workload=workload,
            )
            for strategy, policy in (
                ("spare", "adaptive"),
                ("spare", "fixed"),
                ("replication", "adaptive"),
            )
        ],
        processes=2,
    )
    for run in (adaptive, fixed):
        assert len(run.probes) >= 5
        for live, load, step_s in run.probes:
            assert step_s == pytest.approx(load / 8, rel=1e-6)  # m = 8 micro-batches of 1/8 s
        assert run.result.overhead_mean == pytest.approx(run.overhead_load, rel=1e-6)
    assert fixed.overhead_load > adaptive.overhead_load  # same live sets, optimal vs stack order
    assert repl.result.overhead_mean == pytest.approx(2.0, rel=1e-6)
    # The probes' loads are the reorder core's for some live set of that size.
    live, load, _ = adaptive.probes[0]
    assert live == g - 1 and load == reorder.max_load(
        strategies.placement("spare", g, 2), reorder.alive_mask(g, [0]), 8
    )


@needs_simgrid
@pytest.mark.slow
def test_epochs_match_the_closed_forms():
    g, r, n = 60, 2, 3000
    sc = _scenario(g, 50, 100.0)
    ep = simgrid.epochs(sc, "spare", redundancy=r, epochs=n, seed=2)
    assert ep.failures.size == n and ep.uptime_s.size == n
    want_f = analysis.endurable_failures("spare", g, r)  # 7.372
    want_t = analysis.mean_time_to_interruption("spare", g, r, sc.group_mtbf_s)
    for values, want in ((ep.failures, want_f), (ep.uptime_s, want_t)):
        err = values.std(ddof=1) / math.sqrt(n)
        assert err / want < 0.015
        assert abs(values.mean() - want) < 4 * err
    fails, ups = _replay(strategies.placement("spare", g, r), sc.group_mtbf_s, 2, 50)
    assert ep.failures[:50].tolist() == fails and np.allclose(ep.uptime_s[:50], ups)


def _deadlock(payload: dict) -> dict:
    """Child entry: a driver that waits on a mailbox nobody sends to."""

    class Stuck:
        def __init__(self) -> None:
            self.out: dict = {}

        def __call__(self) -> None:
            compat.load().Mailbox.by_name("nobody").get()
            self.out = {"completed": True}

    return compat.play(CM02, 2, [lambda hosts, storage: Stuck()])[0]


def _raises(payload: dict) -> dict:
    """Child entry: a driver whose body raises."""

    class Broken:
        def __init__(self) -> None:
            self.out: dict = {}

        def __call__(self) -> None:
            try:
                raise KeyError("no such shard")
            except BaseException:  # noqa: BLE001 - what the real driver does
                import traceback

                self.out = {"error": traceback.format_exc()}

    return compat.play(CM02, 2, [lambda hosts, storage: Broken()])[0]


@needs_simgrid
def test_an_incomplete_or_failed_run_is_an_error():
    with pytest.raises(compat.SimGridError, match="did not complete"):
        compat.run_isolated(f"{__file__}:_deadlock", {})
    with pytest.raises(compat.SimGridError, match="no such shard"):
        compat.run_isolated(f"{__file__}:_raises", {})


@needs_simgrid
def test_simulate_is_a_backend_of_simulate_many():
    sc = _scenario(12, 50, 400.0, checkpoint_s=2.0, restart_s_ref=20.0)
    summary = sim.simulate_many(
        sc,
        "spare",
        replicas=2,
        processes=1,
        progress=False,
        backend=simgrid.simulate,
        redundancy=2,
        checkpoint_interval_s=60.0,
        cluster=CM02,
    )
    assert summary.replicas == 2 and len({r.time_to_train_s for r in summary.results}) == 2
    assert all(r.time_to_train_s >= 400.0 for r in summary.results)


@needs_simgrid
def test_fat_tree_adds_the_spine_hops():
    # Short links: SimGrid caps a flow at TCP-gamma / (2 x route latency) (4 MiB by
    # default), 262 GB/s on a 4-link route of 2 us links, which would hide the hops.
    n, lat = 40, 0.5e-6
    kw = {"network": "CM02", "latency_s": lat, "crosstraffic": False}
    star = simgrid.Cluster(**kw)
    tree = simgrid.Cluster(topology="fat_tree", leaf_size=8, spines=2, **kw)
    runs = simgrid.play(
        [
            simgrid.run_spec(
                _scenario(n, 1e12, 3.0),
                "spare",
                redundancy=2,
                checkpoint_interval_s=math.inf,
                cluster=c,
                workload=simgrid.Workload(gradient_bytes=4e8, allreduce="ring"),
            )
            for c in (star, tree)
        ],
        processes=2,
    )
    on_star, on_tree = (r.step_s for r in runs)
    # A route inside a leaf has 2 links, as on the star; across leaves 4 (up to a spine
    # switch and down). Ring hops 7->8, 15->16, ..., 39->0 cross: the wave waits for one
    # crossing, and the 2(n-1) - 1 = 77 chain hops go round the ring twice minus 3,
    # crossing 9 times.
    crossings = sum(1 for i in range(2 * (n - 1) - 1) if i % n % 8 == 7)
    assert crossings == 9
    assert on_tree - on_star == pytest.approx((1 + crossings) * 2 * lat, rel=1e-6)

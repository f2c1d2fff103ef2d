"""Checkpoints: Orbax saves when told, restore skips junk, the model sets the interval."""

import json
import math

import jax
import launching as lj
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spare_jax
from spare_jax import analysis, checkpoint, layouts
from spare_jax import interval as interval_lib


def _state():
    mesh = spare_jax.make_mesh((2, 2, 2))
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    step = spare_jax.make_train_step(
        lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean(),
        optax.adam(1e-2),
        mesh,
        param_specs={"w": jax.P(None, "model"), "b": jax.P()},
    )
    return step, params, step.init(params)


def _ckpt(tmp_path, interval=2, extra=(), total=1000):
    policy = checkpoint.Interval(total=total, pinned=interval, extra=frozenset(extra))
    return checkpoint.Checkpointer(str(tmp_path / "ckpt"), policy, keep=3)


def test_policy_decides_and_latest_three_are_kept(tmp_path):
    step, params, state = _state()
    ckpt = _ckpt(tmp_path, interval=3, extra={4})
    saved = [t for t in range(1, 13) if ckpt.save(t, state, {"step": t}) is not None]
    ckpt.wait()
    assert saved == [3, 4, 7, 10]  # every 3 steps since the last save, plus step 4
    assert ckpt.steps() == [4, 7, 10]
    restored = ckpt.restore_latest(step.abstract_state(params))
    assert restored.step == 10 and restored.meta["step"] == 10
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(restored.state), jax.device_get(state)
    )
    assert restored.state.params["w"].sharding.spec == jax.P(None, "model")
    ckpt.close()


def test_restore_skips_corrupt_and_foreign_and_wrong_checksum(tmp_path):
    step, params, state = _state()
    ckpt = _ckpt(tmp_path)
    for t in (2, 4, 6):
        ckpt.save(t, state, {"step": t})
    ckpt.wait()
    root = tmp_path / "ckpt"
    # 6: data files truncated; 4: arrays intact but the record's digest of them lies.
    for f in (root / "6" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 16:
            f.write_bytes(f.read_bytes()[:8])
    meta = next((root / "4" / "meta").glob("metadata"))
    record = json.loads(meta.read_text())
    record["state_digest"][1] ^= 1
    meta.write_text(json.dumps(record))
    (root / "9").mkdir()  # a foreign directory with a step's name
    restored = ckpt.restore_latest(step.abstract_state(params))
    assert restored.step == 2
    assert sorted(p.name.split("-")[0] for p in (root / "corrupt").iterdir()) == ["4", "6", "9"]
    assert ckpt.steps() == [2]
    ckpt.close()


def test_no_usable_checkpoint_is_an_error_and_none_at_all_is_not(tmp_path):
    step, params, state = _state()
    ckpt = _ckpt(tmp_path)
    assert ckpt.restore_latest(step.abstract_state(params)) is None
    ckpt.save(2, state, {"step": 2})
    ckpt.wait()
    for f in (tmp_path / "ckpt" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    with pytest.raises(checkpoint.NoUsableCheckpoint, match="none of the 1 checkpoint"):
        ckpt.restore_latest(step.abstract_state(params))
    ckpt.close()


def test_interval_is_the_analysis_optimum_in_steps():
    model = checkpoint.IntervalModel(
        strategy="spare",
        redundancy=2,
        microbatches=2,
        policy="adaptive",
        groups=16,
        devices_per_group=2,
        steps=100_000,
        failure_rate=1e-3,
        gpu_mtbf_hours=5.1e4,
    )
    steps, figures = model.interval(step_s=0.1, stall_s=0.5, save_s=2.0, restore_s=3.0)
    scenario = model.scenario(0.1, 0.5, 2.0, 3.0)
    assert scenario.group_mtbf_s == pytest.approx(100.0) and scenario.checkpoint_async
    tau = analysis.time_to_train(scenario, "spare", redundancy=2, microbatches=2)
    assert steps == round(tau.checkpoint_interval_s / 0.1)
    assert figures["interval_s"] == tau.checkpoint_interval_s
    assert figures["mtti_s"] == tau.mean_time_to_interruption_s
    # A costlier save or a rarer failure moves the optimum the way Young's formula says.
    slower, _ = model.interval(step_s=0.1, stall_s=2.0, save_s=8.0, restore_s=3.0)
    assert slower > steps
    assert 1 <= model.interval(0.1, 1e4, 1e4, 1e4)[0] <= 100_000  # clipped to the run


def test_no_failure_rate_falls_back_to_the_gpu_mtbf():
    model = checkpoint.IntervalModel(
        strategy="dp",
        redundancy=1,
        microbatches=1,
        policy="adaptive",
        groups=4,
        devices_per_group=2,
        steps=50,
        failure_rate=0.0,
        gpu_mtbf_hours=5.1e4,
    )
    steps, figures = model.interval(0.05, 0.1, 0.1, 0.1)
    assert steps == 50  # a 50-step run at the Llama 3 failure rate: save at the end only
    assert math.isclose(figures["group_mtbf_s"], 5.1e4 * 3600 / 2)


def test_param_checksum_is_the_float64_sum_of_squares():
    params = {"a": np.full((3,), 2.0, np.float32), "b": [np.ones((2, 2), np.float32)]}
    assert checkpoint.param_checksum(params) == pytest.approx(3 * 4.0 + 4 * 1.0)


def test_when_no_interval_finishes_the_run_the_save_cost_optimum_is_used():
    model = checkpoint.IntervalModel(
        strategy="dp",
        redundancy=1,
        microbatches=1,
        policy="adaptive",
        groups=4,
        devices_per_group=2,
        steps=10_000,
        failure_rate=0.05,
        gpu_mtbf_hours=5.1e4,
    )
    scenario = model.scenario(0.1, 50.0, 50.0, 1.0)  # saves far longer than the MTTI
    assert math.isinf(analysis.time_to_train(scenario, "dp").time_to_train_s)
    steps, figures = model.interval(0.1, 50.0, 50.0, 1.0)
    expected = analysis.exact_optimum(50.0, figures["mtti_s"])
    assert figures["interval_s"] == pytest.approx(expected)
    assert steps == min(max(round(expected / 0.1), 1), 10_000)


# ------------------------------------------------------------- what is kept, what is trusted


def _write_checkpoint(root, step: int, *, intact: bool) -> None:
    """A committed step directory: whole, or as a writer that was not the primary host left it."""
    d = root / str(step)
    for sub in ("state", "meta"):
        (d / sub).mkdir(parents=True)
        (d / sub / "commit_success.txt").write_text("ok")
    (d / "_CHECKPOINT_METADATA").write_text("{}")
    if intact:
        (d / "state" / "replica.npz").write_bytes(_npz_bytes())
        (d / "meta" / "metadata").write_text('{"param_checksum": 1.0}')


def _npz_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, a=np.zeros(3))
    return buf.getvalue()


def test_missing_files_names_what_an_empty_committed_checkpoint_lacks(tmp_path):
    _write_checkpoint(tmp_path, 5, intact=False)
    _write_checkpoint(tmp_path, 10, intact=True)
    assert checkpoint.missing_files(str(tmp_path / "5")) == "meta/metadata is missing"
    assert checkpoint.missing_files(str(tmp_path / "10")) is None
    (tmp_path / "5" / "meta" / "metadata").write_text('{"step": 5}')
    assert checkpoint.missing_files(str(tmp_path / "5")) == "state/ holds no array data"
    npz = tmp_path / "10" / "state" / "replica.npz"
    npz.write_bytes(npz.read_bytes()[:40])  # truncated: the archive's index is gone
    assert "damaged" in checkpoint.missing_files(str(tmp_path / "10"))


def test_retention_counts_only_complete_checkpoints():
    import tempfile
    import types

    with tempfile.TemporaryDirectory() as d:
        root = __import__("pathlib").Path(d)
        for step, ok in ((2, True), (4, True), (6, True), (8, False), (10, False)):
            _write_checkpoint(root, step, intact=ok)
        infos = [types.SimpleNamespace(step=s) for s in (2, 4, 6, 8, 10, 12)]  # 12: in flight
        keep = checkpoint.KeepIntact(d, 2).should_preserve(infos, context=None)
        # Empty saves (8, 10) and the save in flight (12) do not push 4 and 6 out.
        assert keep == [False, True, True, True, True, True]
        assert checkpoint.KeepIntact(d, 3).should_preserve(infos, context=None) == [True] * 6


def test_replica_layout_round_trips_every_dtype_and_shape(tmp_path):
    import ml_dtypes

    state = {
        "step": np.int32(7),
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "h": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
    }
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), state)
    d = tmp_path / "r"
    d.mkdir()
    handler = checkpoint.ReplicaHandler()
    handler.save(d, checkpoint.ReplicaSave(state))
    out = handler.restore(d, layouts.ReplicaRestore(target))
    for k, want in state.items():
        assert out[k].dtype == np.asarray(want).dtype and out[k].shape == np.shape(want)
        np.testing.assert_array_equal(out[k], want)
    wrong = {**target, "w": jax.ShapeDtypeStruct((3, 2), np.float32)}
    with pytest.raises(ValueError, match=r"array 2 is float32\(2, 3\)"):
        handler.restore(d, layouts.ReplicaRestore(wrong))


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only); skipped with one line where it cannot be mounted."""
    with lj.small_tmpfs(tmp_path / "disk", "3m") as mount:
        yield mount


def test_a_full_disk_is_named_and_the_newest_intact_checkpoint_kept(small_disk):
    from spare_jax.train_step import TrainState

    def state(value):  # 2 MiB of parameters: the second save cannot fit
        w = np.random.default_rng(int(value)).random((1024, 512), np.float32)  # incompressible
        return TrainState(np.int32(0), {"w": w}, ())

    ckpt = checkpoint.Checkpointer(
        str(small_disk / "ckpt"), checkpoint.Interval(total=100, pinned=1), keep=3
    )
    ckpt.save(1, state(1.0), {"step": 1})
    assert [s.step for s in ckpt.wait()] == [1]
    ckpt.save(2, state(2.0), {"step": 2})
    with pytest.raises(checkpoint.StorageError) as err:
        ckpt.wait()
    assert err.value.disk_full and err.value.exit_status == 5
    message = str(err.value)
    assert "disk holding" in message and str(small_disk) in message and "\n" not in message
    assert "checkpoint 1 is the newest intact one" in message
    assert checkpoint.missing_files(str(small_disk / "ckpt" / "1")) is None
    ckpt.close()


def _interval(total: int) -> checkpoint.Interval:
    model = checkpoint.IntervalModel(
        strategy="spare",
        redundancy=2,
        microbatches=2,
        policy="adaptive",
        groups=4,
        devices_per_group=2,
        steps=total,
        failure_rate=0.0,
        gpu_mtbf_hours=5.1e4,
    )
    return checkpoint.Interval(total=total, model=model)


def test_the_ceiling_caps_the_model_and_says_which_bound_applied():
    # A long run of 1 s steps: Young's interval for the unmodelled interruptions binds.
    interval = _interval(10**6)
    interval.stalls, interval.saves = [5.0, 0.5, 0.5], [9.0, 2.0, 2.0]
    assert interval.update([1.0] * 5)
    young = math.sqrt(2 * 0.5 * interval_lib.UNMODELLED_MTBI_S)  # ~315 s
    f = interval.figures
    assert interval.source == "ceiling" and f["ceiling_by"] == "unmodelled"
    assert f["ceiling_s"] == pytest.approx(young) and 290 < young < 340
    assert interval.steps == f["ceiling_steps"] == int(young - 2.0) < f["model_steps"]
    # A short run: a tenth of it.
    interval = _interval(2000)
    interval.stalls, interval.saves = [5.0, 0.01], [9.0, 0.05]
    interval.update([0.05] * 5)
    assert interval.figures["ceiling_by"] == "run_fraction"
    assert interval.figures["ceiling_s"] == pytest.approx(0.1 * 2000 * 0.05)
    assert interval.steps == int((10.0 - 0.05) // 0.05)
    # Saves that cost more than 5% of the time at that interval: the floor.
    interval.stalls, interval.saves = [5.0, 1.0], [9.0, 1.5]
    interval.update([0.05] * 5)
    assert interval.figures["ceiling_by"] == "save_cost"
    assert interval.figures["ceiling_s"] == pytest.approx(1.0 / interval_lib.STALL_SHARE + 1.5)
    assert interval.steps == int(20.0 // 0.05)  # stalls are 5% of the interval
    # Only the start-up-inflated first save measured: the floor is two saves' duration.
    interval = _interval(2000)
    interval.stalls, interval.saves = [5.0], [9.0]
    interval.update([0.05] * 5)
    assert interval.figures["ceiling_s"] == pytest.approx(18.0)
    assert interval.steps == int((18.0 - 9.0) // 0.05)


def test_the_model_applies_below_the_ceiling_and_a_resume_keeps_the_source():
    model = checkpoint.IntervalModel(
        strategy="spare",
        redundancy=2,
        microbatches=2,
        policy="adaptive",
        groups=4,
        devices_per_group=2,
        steps=100_000,
        failure_rate=1e-3,
        gpu_mtbf_hours=5.1e4,
    )
    interval = checkpoint.Interval(total=100_000, model=model)
    interval.stalls, interval.saves = [1.0, 0.01], [1.0, 0.02]
    interval.update([0.1] * 5)
    assert interval.source == "model" and interval.steps == interval.figures["model_steps"]
    assert interval.steps <= interval.figures["ceiling_steps"]
    again = checkpoint.Interval(total=100_000, model=model)
    again.load({"steps": 7, "source": "ceiling", "figures": {"ceiling_by": "run_fraction"}})
    assert (again.steps, again.source) == (7, "ceiling")


def test_an_array_altered_in_place_is_caught_by_the_digest_saved_with_it(tmp_path):
    """One bit of the optimizer's state flipped, the archive rewritten whole and valid (same
    size, zip checksums right): the parameters' checksum cannot see it, the digest does."""
    import zipfile

    step, params, state = _state()
    policy = checkpoint.Interval(total=1000, pinned=2)
    ckpt = checkpoint.Checkpointer(str(tmp_path / "ckpt"), policy, keep=3, process_local=True)
    host = jax.tree.map(np.asarray, jax.device_get(state))
    for t in (2, 4):
        ckpt.save(t, host, {"step": t})
    ckpt.wait()
    replica = tmp_path / "ckpt" / "4" / "state" / "replica.npz"
    size = replica.stat().st_size
    with np.load(replica) as z:
        arrays = {k: z[k].copy() for k in z.files}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(host)[0]]
    victim = next(i for i, p in enumerate(paths) if "opt_state" in p and arrays[f"a{i}"].size)
    arrays[f"a{victim}"][0] ^= 1
    np.savez(replica, **arrays)
    assert replica.stat().st_size == size
    with zipfile.ZipFile(replica) as archive:
        assert archive.testzip() is None  # the container is sound
    restored = ckpt.restore_latest(step.abstract_state(params))
    assert restored.step == 2
    (moved,) = (tmp_path / "ckpt" / "corrupt").iterdir()
    assert moved.name.startswith("4-")
    ckpt.close()


def test_the_digest_is_the_same_on_device_and_on_the_host_and_sees_one_bit():
    import ml_dtypes

    from spare_jax import digest

    rng = np.random.default_rng(0)
    tree = {
        "f": rng.normal(size=(37, 5)).astype(np.float32),
        "h": rng.normal(size=(7,)).astype(ml_dtypes.bfloat16),
        "b": np.array([True, False, True]),
        "i": np.int32(5),
        "e": np.zeros((0, 3), np.float32),
        "u": rng.integers(0, 255, size=(9,)).astype(np.uint8),
    }
    host = digest.state_digest(tree)
    assert digest.state_digest(jax.tree.map(jax.numpy.asarray, tree)) == host
    for k, x in tree.items():
        if np.asarray(x).size == 0:
            continue
        raw = np.array(x).reshape(-1).view(np.uint8).copy()
        for byte in (0, raw.size - 1):
            flipped = raw.copy()
            flipped[byte] ^= 0x80
            changed = {**tree, k: flipped.view(np.asarray(x).dtype).reshape(np.shape(x))}
            assert digest.state_digest(changed) != host, (k, byte)
    swapped = {**tree, "f": tree["f"][::-1].copy()}  # the same words, elsewhere
    assert digest.state_digest(swapped) != host


def test_a_record_without_a_digest_restores_on_the_parameter_checksum_alone(tmp_path):
    step, params, state = _state()
    ckpt = _ckpt(tmp_path)
    for t in (2, 4):
        ckpt.save(t, state, {"step": t})
    ckpt.wait()
    for t, lie in ((2, False), (4, True)):  # as written before the digest existed
        meta = tmp_path / "ckpt" / str(t) / "meta" / "metadata"
        record = json.loads(meta.read_text())
        del record["state_digest"]
        record["param_checksum"] += 1.0 if lie else 0.0
        meta.write_text(json.dumps(record))
    restored = ckpt.restore_latest(step.abstract_state(params))
    assert restored.step == 2
    assert [p.name.split("-")[0] for p in (tmp_path / "ckpt" / "corrupt").iterdir()] == ["4"]
    ckpt.close()


def test_replica_split_takes_the_most_replicas_that_split_most_of_the_bytes():
    # 1,000 groups and dimensions that are powers of two: 1,000 divides none, 512 does.
    assert layouts.replica_split([((512, 4096), 100, 1), ((4096,), 1, 8)], 1000) == 512
    assert layouts.replica_split([((60, 1024), 1, 1)], 3) == 3  # 3 divides 60
    assert layouts.replica_split([((8, 16), 1, 1)], 3) == 2
    assert layouts.replica_split([((7,), 1, 1)], 4) == 1  # nothing splits: one replica writes
    assert layouts.replica_split([((8, 16), 1, 1)], 1) == 1  # one group: no replica to split
    # Replicated inside each group of 2 as well: 4 groups hold 8 replicas, and 8 divides 8.
    assert layouts.replica_split([((8, 16), 1, 2)], 4) == 8
    # A small array that splits no way does not hold the big one back (under 10% of bytes).
    assert layouts.replica_split([((96, 8), 95, 1), ((5,), 5, 1)], 6) == 6
    # Neither 6 nor 5 splits 90% of these bytes; 2 splits all of them.
    assert layouts.replica_split([((96, 8), 85, 1), ((10,), 15, 1)], 6) == 2


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 96), min_size=1, max_size=3).map(tuple),
            st.integers(1, 1000),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 32),
)
def test_replica_split_is_the_largest_count_that_splits_the_share(shards, groups):
    """Against the rule tried at every count: no larger count splits the share; this one does."""
    c = layouts.replica_split(shards, groups)
    total = sum(n for _, n, _ in shards)
    top = max(groups * m for _, _, m in shards)

    def split(k: int) -> int:
        return sum(
            n
            for shape, n, m in shards
            if min(groups * m, k) == 1 or any(d % min(groups * m, k) == 0 for d in shape)
        )

    assert 1 <= c <= max(top, 1)
    if c > 1:
        assert split(c) >= layouts.SPLIT_SHARE * total
    assert all(split(k) < layouts.SPLIT_SHARE * total for k in range(c + 1, top + 1))


def test_save_wait_grows_with_the_bytes_one_process_writes():
    base, rate = layouts.SAVE_WAIT_BASE_S, layouts.SAVE_WAIT_RATE
    weight = ((512, 4096), 4096 * 4096 * 4, 1)  # an FSDP-8 shard of a 4096 x 4096 float32
    # 1,000 groups split it over 512 replicas (`replica_split`): each writes 1/512 of it.
    assert layouts.save_wait_s([weight], 1000) == pytest.approx(base + 4096 * 4096 * 4 / 512 / rate)
    # Nothing splits (7 rows, 4 replicas): one replica writes all of it.
    assert layouts.save_wait_s([((7,), 7e9, 1)], 4) == pytest.approx(base + 7e9 / rate)
    assert layouts.save_wait_s([], 4) == base
    # 100 GB of such weights over 1,000 groups: 195 MB a replica at most, 4 s over the base.
    hundred_gb = [((512, 4096), 100e9 / 1490, 1)] * 1490
    assert layouts.save_wait_s(hundred_gb, 1000) == pytest.approx(base + 100e9 / 512 / rate)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 96), min_size=1, max_size=3).map(tuple),
            st.integers(1, 10**9),
            st.integers(1, 4),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 32),
    st.integers(2, 5),
)
def test_save_wait_is_the_base_plus_a_split_share_of_the_bytes(shards, groups, scale):
    """Between the base plus 1/(most replicas) of the bytes and the base plus all of them,
    and its part over the base scales with the bytes."""
    base, rate = layouts.SAVE_WAIT_BASE_S, layouts.SAVE_WAIT_RATE
    wait = layouts.save_wait_s(shards, groups)
    total = sum(n for _, n, _ in shards)
    top = max(groups * m for _, _, m in shards)
    assert base + total / top / rate * (1 - 1e-9) <= wait <= base + total / rate * (1 + 1e-9)
    bigger = [(shape, n * scale, m) for shape, n, m in shards]
    assert layouts.save_wait_s(bigger, groups) - base == pytest.approx(scale * (wait - base))


def _group_checkpointer(tmp_path, keep=3):
    """A checkpointer of sharded saves (group mode) in this one process, and a state for it."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jax.device_put(np.arange(60.0, dtype=np.float32).reshape(6, 10), sharding)}
    shards = layouts.shard_table(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state),
        2,
    )
    ckpt = checkpoint.Checkpointer(
        str(tmp_path / "ckpt"),
        checkpoint.Interval(total=4, pinned=1),
        keep=keep,
        group=(0, {0}),
        shards=shards,
        replicas=2,
    )
    return ckpt, state, shards


def test_sharded_saves_bound_orbax_barriers_by_their_wait(tmp_path, monkeypatch, capsys):
    """While a checkpointer of sharded saves is open, its asynchronous saves included,
    Orbax's barriers time out after its `wait_s` (`layouts.save_wait_s` of its state);
    closing it gives Orbax its own timeout back. It says the wait to a launcher."""
    from orbax.checkpoint._src.multihost import multihost as orbax_multihost

    monkeypatch.setenv("SPARE_JAX_LAUNCH_DIR", str(tmp_path / "launch"))
    before = orbax_multihost.coordination_timeout()
    ckpt, state, shards = _group_checkpointer(tmp_path)
    assert ckpt.wait_s == layouts.save_wait_s(shards, 2)
    assert orbax_multihost.coordination_timeout() == math.ceil(ckpt.wait_s) != before
    ckpt.save(1, state, {"step": 1, "param_checksum": 0.0, "state_digest": "-"}, force=True)
    assert ckpt.in_flight()  # the write goes on in the background, under the same timeout
    assert orbax_multihost.coordination_timeout() == math.ceil(ckpt.wait_s)
    assert [s.step for s in ckpt.wait()] == [1] and not ckpt.in_flight()
    ckpt.close()
    assert orbax_multihost.coordination_timeout() == before
    assert checkpoint.missing_files(str(tmp_path / "ckpt" / "1")) is None
    said = [
        json.loads(line.split(":", 1)[1])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("spare-jax-event:")
    ]
    assert {"kind": "save_barriers", "wait_s": round(ckpt.wait_s, 3)} in said, said


@pytest.mark.parametrize(
    "error, dropped",
    [
        (TimeoutError("Timed out while waiting for async_write_complete barrier."), True),
        (RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"), True),
        (OSError(5, "Input/output error"), False),
    ],
)
def test_a_sharded_save_that_times_out_at_a_barrier_is_dropped_and_a_failed_write_is_not(
    tmp_path, monkeypatch, capsys, error, dropped
):
    """A save in flight whose barrier ran out (a process lost in it) is dropped with one line
    and the checkpointer goes on; any other failure of the write stops the run
    (`StorageError`), as it does in every layout."""
    ckpt, state, _ = _group_checkpointer(tmp_path)
    ckpt.save(1, state, {"step": 1, "param_checksum": 0.0, "state_digest": "-"}, force=True)
    ckpt._manager.wait_until_finished()  # the real write ends; then it "fails" as told

    def fails():
        raise RuntimeError("the background thread failed") from error

    monkeypatch.setattr(ckpt._manager, "wait_until_finished", fails)
    if dropped:
        assert ckpt.wait() == [] and not ckpt.in_flight()
        assert "the save of step 1 was dropped: a process was lost in it" in capsys.readouterr().err
    else:
        with pytest.raises(checkpoint.StorageError, match="the save of step 1"):
            ckpt.wait()
    monkeypatch.undo()
    ckpt.close()


META = {"param_checksum": 0.0, "state_digest": "-"}


def _confirm_step_2_while_step_1_is_deleted(ckpt, state, tmp_path, monkeypatch) -> list[int]:
    """Save step 2 and confirm it after one of step 1's files is gone (the primary's delete
    under way); the steps this process then lets go itself."""
    ckpt.save(2, state, {"step": 2, **META}, force=True)
    ckpt._manager.wait_until_finished()
    (tmp_path / "ckpt" / "1" / "meta" / "metadata").unlink()
    deleted = []
    real = ckpt._manager.delete
    monkeypatch.setattr(ckpt._manager, "delete", lambda step: (deleted.append(step), real(step)))
    assert [s.step for s in ckpt.wait()] == [2]
    return deleted


def test_sharded_saves_let_the_same_checkpoint_go_on_every_process(tmp_path, monkeypatch):
    """Every live process of a sharded save lets the oldest checkpoint go once a new one is
    confirmed (Orbax's delete waits for all of them at a barrier), while the primary may have
    removed its files already: each counts a checkpoint complete as it first saw it, not as
    the disk looks now, so all of them decide alike."""
    ckpt, state, _ = _group_checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {"step": 1, **META}, force=True)
    assert [s.step for s in ckpt.wait()] == [1]
    assert _confirm_step_2_while_step_1_is_deleted(ckpt, state, tmp_path, monkeypatch) == [1]
    assert ckpt.steps() == [2]
    ckpt.close()


def test_a_resumed_sharded_checkpointer_lets_an_old_checkpoint_go_like_the_primary(
    tmp_path, monkeypatch
):
    """A job that resumes finds checkpoints it did not save: each process counts them as they
    are when its first save starts, so one that looks only after the primary has deleted the
    oldest still lets it go with the others."""
    ckpt, state, _ = _group_checkpointer(tmp_path, keep=1)
    ckpt.save(1, state, {"step": 1, **META}, force=True)
    ckpt.wait()
    ckpt.close()
    resumed, _, _ = _group_checkpointer(tmp_path, keep=1)
    assert _confirm_step_2_while_step_1_is_deleted(resumed, state, tmp_path, monkeypatch) == [1]
    assert resumed.steps() == [2]
    resumed.close()

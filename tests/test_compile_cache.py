"""spare_jax.compile_cache and `fit`'s default cache: programs written, then loaded, and counted.

JAX's cache settings are process-wide: the fixture takes them away (this
session's cache, from conftest) for each test and puts them back after, so no
other test sees a change.
"""

from __future__ import annotations

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import regression

import spare_jax
from spare_jax import compile_cache


@pytest.fixture
def no_cache():
    """No cache configured during the test; the session's settings back afterwards."""
    saved = compile_cache.snapshot()
    compile_cache.restore(compile_cache.Snapshot(None, 1.0, 0))  # JAX's defaults
    try:
        yield
    finally:
        compile_cache.restore(saved)
    assert compile_cache.snapshot() == saved


def _entries(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith("-cache"))


def _step():
    mesh = spare_jax.make_mesh((1, 4, 2))
    return spare_jax.make_train_step(
        regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2
    )


def _fit(workdir: pathlib.Path, **kwargs):
    return spare_jax.fit(
        _step(),
        regression.init_params(),
        regression.batches,
        steps=2,
        workdir=str(workdir),
        **kwargs,
    )


def test_a_second_compile_loads_the_first(no_cache, tmp_path):
    where = tmp_path / "cache"
    assert compile_cache.enable(where) == str(where) and where.is_dir()
    assert compile_cache.enable(str(where)) == str(where)  # idempotent
    x = jnp.arange(7.0)
    want = np.sin(np.arange(7.0)) * 3.0 + 21.0

    def program(v):
        return jnp.sin(v) * 3.0 + v.sum()

    jax.jit(program)(x).block_until_ready()
    first = compile_cache.counts()
    assert first["cache_hits"] == 0 and first["cache_misses"] >= 1
    assert first["cache_writes"] == first["cache_misses"]  # a lone process is process 0
    written = _entries(where)
    assert any(name.startswith("jit_program-") for name in written), written

    jax.clear_caches()  # forget the compiled program in memory: only the disk has it now
    np.testing.assert_allclose(jax.jit(program)(x), want, rtol=1e-6)
    second = compile_cache.counts()
    assert second["cache_hits"] >= 1, second
    assert second["cache_misses"] == first["cache_misses"], "the second compile compiled"
    assert _entries(where) == written  # nothing new
    assert compile_cache.retrieval_seconds() > 0.0


def test_a_new_directory_takes_effect_and_restore_gives_the_old_back(no_cache, tmp_path):
    before = compile_cache.snapshot()
    with compile_cache.enabled(tmp_path / "a"):
        jax.jit(lambda v: v * 5.0)(jnp.ones(3)).block_until_ready()
        compile_cache.enable(tmp_path / "b")  # a cache JAX has opened: reopened elsewhere
        jax.jit(lambda v: v * 6.0)(jnp.ones(3)).block_until_ready()
    assert compile_cache.snapshot() == before
    assert _entries(tmp_path / "a") and _entries(tmp_path / "b")
    assert not set(_entries(tmp_path / "a")) & set(_entries(tmp_path / "b"))
    with pytest.raises(ValueError, match="not a directory"):
        (tmp_path / "file").write_text("mine")
        compile_cache.enable(tmp_path / "file")


def test_fit_caches_under_the_workdir_unless_told_otherwise(no_cache, tmp_path):
    before = compile_cache.snapshot()
    _fit(tmp_path / "run")
    written = _entries(tmp_path / "run" / "compile_cache")
    assert written and compile_cache.counts()["cache_misses"] >= 1
    assert compile_cache.snapshot() == before  # fit put JAX's settings back

    jax.clear_caches()  # a relaunch, as far as this process can tell: load, do not compile
    _fit(tmp_path / "again", compile_cache=str(tmp_path / "run" / "compile_cache"))
    assert not (tmp_path / "again" / "compile_cache").exists()
    seen = compile_cache.counts()
    assert seen["cache_hits"] >= 1, seen

    _fit(tmp_path / "off", compile_cache=False)
    assert not (tmp_path / "off" / "compile_cache").exists()
    assert compile_cache.snapshot() == before


def test_fit_keeps_a_cache_jax_is_configured_with(no_cache, tmp_path):
    compile_cache.restore(compile_cache.Snapshot(str(tmp_path / "mine"), 1.0, 0))
    _fit(tmp_path / "run")
    assert not (tmp_path / "run" / "compile_cache").exists()
    assert _entries(tmp_path / "mine")
    assert compile_cache.configured() == str(tmp_path / "mine")


@pytest.mark.parametrize("bad", ["", 3, 1.5])
def test_a_bad_compile_cache_is_named_before_any_file(no_cache, tmp_path, bad):
    with pytest.raises(ValueError, match="compile_cache"):
        _fit(tmp_path / "run", compile_cache=bad)
    assert not (tmp_path / "run").exists()


def _as_process(monkeypatch, index: int) -> None:
    """This lone process answers as process ``index`` of a 2-process job (only the store's
    choice of who writes reads these)."""
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: index)
    monkeypatch.setattr(jax, "process_count", lambda *a, **k: 2)


def _lowered():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    program = jax.jit(lambda a, b: (a * b + 1.0, jnp.sum(a)), out_shardings=(sharding, None))
    arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=sharding)
    return program.lower(arg, arg), list(mesh.devices.flat), sharding


def test_a_process_other_than_0_keeps_its_programs_and_loads_them_again(
    no_cache, tmp_path, monkeypatch, caplog
):
    """JAX's cache writes only from process 0: the others' programs go to their own store."""
    compile_cache.enable(tmp_path / "cache")
    _as_process(monkeypatch, 1)
    lowered, devices, sharding = _lowered()
    a = jax.device_put(jnp.arange(8.0), sharding)
    first = compile_cache.compile_lowered(lowered, devices)
    (entry,) = (tmp_path / "cache" / "process-1").iterdir()
    hits = compile_cache.counts()["cache_hits"]
    lowered, devices, _ = _lowered()  # a new lowering of the same program: a hit
    second = compile_cache.compile_lowered(lowered, devices)
    assert compile_cache.counts()["cache_hits"] == hits + 1
    for got, want in zip(second(a, a), first(a, a), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Other devices, another program: its own entry.
    other = jax.sharding.Mesh(np.array(jax.devices()[2:4]), ("x",))
    shard = jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec("x"))
    arg = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=shard)
    program = jax.jit(lambda a, b: (a * b + 1.0, jnp.sum(a)), out_shardings=(shard, None))
    compile_cache.compile_lowered(program.lower(arg, arg), list(other.devices.flat))
    assert len(list((tmp_path / "cache" / "process-1").iterdir())) == 2
    # A damaged entry is compiled again and replaced, never run.
    entry.write_bytes(entry.read_bytes()[:100])
    lowered, devices, _ = _lowered()
    with caplog.at_level(logging.WARNING, logger="spare_jax.compile_cache"):
        third = compile_cache.compile_lowered(lowered, devices)
    assert f"compile cache entry {entry} does not load" in caplog.text
    np.testing.assert_array_equal(np.asarray(third(a, a)[0]), np.asarray(first(a, a)[0]))
    # Gone: JAX's cache (this lone process writes it, as process 0) served the compile, and
    # a program it loaded is not kept again (test_a_program_jax_s_cache_loaded_is_never_...).
    assert not entry.exists()


def test_a_lone_process_and_runs_without_a_cache_leave_the_store_alone(
    no_cache, tmp_path, monkeypatch
):
    lowered, devices, _ = _lowered()
    _as_process(monkeypatch, 1)
    compile_cache.compile_lowered(lowered, devices)  # no cache configured: nothing kept
    compile_cache.enable(tmp_path / "cache")
    monkeypatch.setattr(jax, "process_count", lambda *a, **k: 1)
    compile_cache.compile_lowered(lowered, devices)
    assert not list((tmp_path / "cache").glob("process-*"))


def test_a_program_jax_s_cache_loaded_is_never_kept_again(no_cache, tmp_path, monkeypatch):
    """XLA's CPU client serializes a loaded executable without its kernels ("Function ...
    not found" when that copy runs): such a program goes to neither store, and runs."""
    compile_cache.enable(tmp_path / "cache")
    lowered, devices, sharding = _lowered()
    calls: list[str] = []
    # A lone process is process 0 to JAX: it writes JAX's entries of both programs.
    want = lowered.compile()
    wanted = _scoped(None, calls)
    assert len(_entries(tmp_path / "cache")) == 2
    _as_process(monkeypatch, 0)
    for _ in range(2):
        got = compile_cache.compile_lowered(_lowered()[0], devices)  # JAX's cache serves it
        loaded = _scoped("scope-a", calls)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "process-" in str(p)]
    assert calls == ["traced 8"] * 3, "nothing kept: traced at each lookup"
    a = jax.device_put(jnp.arange(8.0), sharding)
    for run, ref in ((got, want), (loaded, wanted)):
        for x, y in zip(run(a, a), ref(a, a), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_program_that_cannot_be_kept_still_compiles_and_runs(no_cache, tmp_path, monkeypatch):
    """A host callback (jax.debug.print) does not serialize: compiled, run, not kept."""
    compile_cache.enable(tmp_path / "cache")
    _as_process(monkeypatch, 1)

    def noisy(a):
        jax.debug.print("sum {}", a.sum())
        return a * 2

    device = jax.devices()[0]
    lowered = jax.jit(noisy).lower(jax.ShapeDtypeStruct((3,), jnp.float32))
    compiled = compile_cache.compile_lowered(lowered, [device])
    np.testing.assert_array_equal(np.asarray(compiled(jnp.ones(3))), np.full(3, 2.0))
    assert not list((tmp_path / "cache").glob("process-1/*"))


def _scoped(scope, calls: list[str], size: int = 8, process: int = 1):
    """`compile_cache.compile_scoped` on the program of `_lowered`, noting each trace."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))

    def program(a, b):
        calls.append(f"traced {size}")  # runs only while JAX traces it
        return a * b + 1.0, jnp.sum(a)

    arg = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=sharding)
    jitted = jax.jit(program, out_shardings=(sharding, None))
    return compile_cache.compile_scoped(
        scope, "test/program", (arg, arg), list(mesh.devices.flat), lambda: jitted.lower(arg, arg)
    )


@pytest.mark.parametrize("process", [0, 1])
def test_a_scoped_program_loads_again_without_being_traced(
    no_cache, tmp_path, monkeypatch, process
):
    """Under one scope a second lookup (a survivor after a backend reset, a replacement
    inheriting its slot's scope) loads the program untraced, on every process, 0 included;
    another scope, other shapes or no scope trace it again, and a new scope clears the
    slot's older ones."""
    compile_cache.enable(tmp_path / "cache")
    _as_process(monkeypatch, process)
    calls: list[str] = []
    first = _scoped("scope-a", calls)
    assert calls == ["traced 8"]
    hits = compile_cache.counts()["cache_hits"]
    second = _scoped("scope-a", calls)
    assert calls == ["traced 8"], "the second lookup traced the program"
    assert compile_cache.counts()["cache_hits"] == hits + 1
    a = jax.device_put(jnp.arange(8.0), first.input_shardings[0][0])
    for got, want in zip(second(a, a), first(a, a), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _scoped("scope-a", calls, size=16)  # other shapes: another program
    assert calls == ["traced 8", "traced 16"]
    scoped = tmp_path / "cache" / f"process-{process}" / "scoped"
    assert [p.name for p in scoped.iterdir()] == ["scope-a"]
    assert len(list((scoped / "scope-a").iterdir())) == 2
    _scoped("scope-b", calls)  # a new job's scope: traced again; the old scope goes
    assert calls[-1] == "traced 8" and len(calls) == 3
    assert [p.name for p in scoped.iterdir()] == ["scope-b"]
    _scoped(None, calls)  # no scope: traced every time
    _scoped(None, calls)
    assert len(calls) == 5


@pytest.mark.parametrize("scope", ["../outside", "a/b", "..", ".", "", "-x", "a" * 129, "a b"])
def test_a_scope_that_is_not_one_folder_name_is_refused_before_any_file(
    no_cache, tmp_path, monkeypatch, scope
):
    """A scope names a folder whose siblings a new scope deletes: one that could reach
    outside the store (or name no folder) is refused, and nothing is traced or written."""
    compile_cache.enable(tmp_path / "cache")
    _as_process(monkeypatch, 1)
    keep = tmp_path / "outside" / "kept.txt"  # what "../outside" would reach from a slot
    keep.parent.mkdir()
    keep.write_text("a user's file")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    calls: list[str] = []
    with pytest.raises(ValueError, match="one folder name"):
        _scoped(scope, calls)
    assert calls == []
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    _scoped("a" * 128, calls)  # the longest accepted
    assert calls == ["traced 8"] and keep.read_text() == "a user's file"


def test_a_damaged_scoped_program_is_built_again(no_cache, tmp_path, monkeypatch, caplog):
    compile_cache.enable(tmp_path / "cache")
    _as_process(monkeypatch, 1)
    calls: list[str] = []
    first = _scoped("scope-a", calls)
    (entry,) = (tmp_path / "cache" / "process-1" / "scoped" / "scope-a").iterdir()
    entry.write_bytes(entry.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="spare_jax.compile_cache"):
        again = _scoped("scope-a", calls)
    assert f"scoped program {entry} does not load" in caplog.text
    assert calls == ["traced 8", "traced 8"]
    a = jax.device_put(jnp.arange(8.0), first.input_shardings[0][0])
    np.testing.assert_array_equal(np.asarray(again(a, a)[0]), np.asarray(first(a, a)[0]))
    assert entry.stat().st_size > 100  # replaced by the rebuilt program

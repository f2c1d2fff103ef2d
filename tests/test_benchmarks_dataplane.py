"""The data-plane benchmarks (step, checkpoint) run on their tiny settings and report sane figures.

Each runs as a subprocess, as a person runs it, and writes its ``--out`` JSON
into a temporary directory. Times must be positive and ratios finite, and
every figure that the library determines must be the library's: the loads
against `spare_jax.reorder`, the stacked bytes against the placement, the
Young and Daly intervals recomputed from the printed C and M, the MTTI
inversely proportional to the failure rate, the interval within the run. An
unwritable ``--out`` must be refused on one line with status 2 before
anything is measured.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from spare_jax import analysis, placement, reorder

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # each run takes tens of seconds; a busy 2-core host stretches that


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a benchmark; `subprocess.run` kills it if it outlives TIMEOUT_S."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
        env=env,
        check=False,
    )


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.mark.slow  # starts processes: run after the README's command
def test_step_benchmark_tiny(tmp_path):
    out = tmp_path / "step.json"
    result = _run("step.py", "--tiny", "--steps=2", "--warmup=1", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in (
        "1. failure-free",
        "2. step time",
        "3. memory",
        "4. public entry point",
        "5. spare_jax.fit's loop",
    ):
        assert heading in result.stdout, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.json"]
    res = json.loads(out.read_text())
    assert res["config"]["tiny"] and res["config"]["steps"] == 2

    (fit_row,) = res["fit_loop"]
    assert _positive(fit_row["hand_s"]) and _positive(fit_row["fit_s"])
    assert fit_row["ratio"] == pytest.approx(fit_row["fit_s"] / fit_row["hand_s"])
    (row,) = res["spare_vs_dp"]
    assert row["mesh"] == [8, 1, 1]
    assert _positive(row["dp_s"]) and _positive(row["spare_s"]) and _positive(row["ratio"])

    ring = placement.cyclic(8, 2)  # mesh 8x1x1, r = 2: one ring of all 8 groups
    rows = res["load"]
    assert [r["dead"] for r in rows] == [[], [3], [1, 5]]
    for r in rows:
        alive = reorder.alive_mask(8, r["dead"])
        assert r["max_load"] == reorder.max_load(ring, alive, r["m"], r["policy"])
        assert r["expected"] == r["max_load"] / r["m"]
        assert _positive(r["time_s"]) and _positive(r["ratio"]) and _positive(r["control"])
        assert math.isfinite(r["deviation"]) and math.isfinite(r["vs_control"])
    assert rows[0]["ratio"] == 1.0 and rows[0]["control"] == 1.0  # each against itself
    (fit,) = res["fit"]
    assert math.isfinite(fit["fixed_s"]) and math.isfinite(fit["per_slot_s"])

    memory = {r["step"].split()[0]: r for r in res["memory"]}
    assert set(memory) == {"dp", "spare"}
    for name, r_stack in (("dp", 1), ("spare", 2)):
        m = memory[name]
        assert m["stacked"] == r_stack * m["global_batch"] > 0
        assert m["extra"] == m["stacked"] - m["global_batch"] and m["factor"] == r_stack
        assert m["device_stacked"] == m["stacked"]  # 8x1x1: one device per group

    (entry,) = res["entry_point"]
    for key in ("run_s", "entry_s", "spelled_out_s", "stacks_s", "device_batch_entry_s"):
        assert _positive(entry[key]), key
    for key in ("entry_vs_run", "entry_vs_spelled_out", "device_batch_vs_run"):
        assert _positive(entry[key]), key
    assert entry["table_hit_s"] < entry["table_miss_s"]  # a cached live set skips the solve
    assert entry["compiles"] == 1  # new live sets and both entry points share one program


@pytest.mark.slow  # starts processes: run after the README's command
def test_checkpoint_benchmark_tiny(tmp_path):
    out_dir, scratch = tmp_path / "out", tmp_path / "tmp"
    out_dir.mkdir()
    scratch.mkdir()
    out = out_dir / "checkpoint.json"
    env = {**os.environ, "TMPDIR": str(scratch)}
    result = _run(
        "checkpoint.py",
        "--config=configs/lm_tiny.py:smoke",
        "--repeats=1",
        "--steps=2",
        f"--out={out}",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for heading in ("(a) save", "(b) restore", "(c) checkpoint interval"):
        assert heading in result.stdout, result.stdout
    assert [p.name for p in out_dir.iterdir()] == ["checkpoint.json"]
    assert list(scratch.iterdir()) == []  # its checkpoint directory is temporary
    res = json.loads(out.read_text())

    step_s = res["step_s"]
    assert _positive(step_s)
    for mode in ("async", "blocking"):
        s = res["save"][mode]
        assert _positive(s["stall_s"]) and s["save_s"] >= s["stall_s"]
        assert _positive(s["restore_s"]) and s["restore_wall_s"] >= s["restore_s"]
    assert _positive(res["async_over_blocking_stall"])

    rows = res["intervals"]
    run_steps = res["config"]["run_steps"]
    assert len(rows) == 6 and {r["rate"] for r in rows} == {1e-3, 1e-2, 5e-2}
    for r in rows:
        c, m = r["C_s"], r["mtti_s"]
        assert c == res["save"][r["mode"]]["stall_s"] and _positive(m)
        assert isinstance(r["model_steps"], int) and 1 <= r["model_steps"] <= run_steps
        capped = r["model_steps"] in (1, run_steps)
        if math.isfinite(r["model_s"]) and not capped:
            assert r["model_steps"] == round(r["model_s"] / step_s)
        assert r["young_s"] == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)
        assert r["daly_s"] == pytest.approx(analysis.daly(c, m), rel=1e-12)
        assert r["young_steps"] == pytest.approx(r["young_s"] / step_s, rel=1e-12)
        if c < 2 * m:  # Daly's higher-order terms shorten Young's interval by about 2C/3
            assert r["daly_s"] < r["young_s"]
        else:
            assert r["daly_s"] == m
        assert r["model_over_young"] == pytest.approx(r["model_s"] / r["young_s"], rel=1e-12)
        assert r["model_ttt_s"] > 0  # infinite when no interval lets the run finish (starred)
    starred = any(not math.isfinite(r["model_ttt_s"]) for r in rows)
    assert ("* the model's expected time-to-train is infinite" in result.stdout) == starred
    # The model's MTTI scales with the group MTBF, i.e. with 1 / rate, whatever the save figures.
    scaled = [r["mtti_s"] * r["rate"] / step_s for r in rows]
    assert scaled == pytest.approx([scaled[0]] * len(rows), rel=1e-9), scaled


@pytest.mark.parametrize("script, target", [("step.py", "missing/x.json"), ("checkpoint.py", ".")])
def test_unwritable_out_is_refused_before_measuring(script, target, tmp_path):
    result = _run(script, f"--out={tmp_path / target}")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0], result.stderr
    assert result.stdout == ""  # nothing measured
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # starts processes: run after the README's command
def test_hsdp_benchmark_tiny(tmp_path):
    """Three inner layouts timed against a hand HSDP step; the split forms alias the state."""
    out = tmp_path / "hsdp.json"
    result = _run("hsdp.py", "--tiny", "--steps=2", "--warmup=1", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [r["layout"] for r in figures["versus_hand"]] == ["fsdp", "tensor", "fsdp x tensor"]
    forms = {r["form"] for r in figures["memory"]}
    assert {"by domain: gradients", "by domain: cross", "by domain: update"} <= forms
    assert all(_positive(r["ratio"]) for r in figures["versus_hand"])
    for row in figures["memory"]:
        donated = row["form"] in ("fused donated", "split: update", "by domain: update")
        assert (row["aliased"] >= row["state"]) if donated else row["aliased"] == 0, row
        peak = row["arguments"] + row["outputs"] + row["temporaries"] - row["aliased"]
        assert row["peak"] == peak


def _state_run(tmp_path, *args: str) -> tuple[str, dict]:
    """``state.py`` at 1 MB chunks, one repeat, into ``tmp_path``: its output and its record,
    every case exact."""
    result = _run("state.py", "--chunk_mb=1", "--repeats=1", f"--out={tmp_path}", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NOT EXACT" not in result.stdout and "failed" not in result.stdout, result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # its scratch is gone
    (record,) = [json.loads(line) for line in (tmp_path / "state.json").read_text().splitlines()]
    return result.stdout, record


@pytest.mark.slow  # starts processes: run after the README's command
def test_state_benchmark_tiny(tmp_path):
    """A 16 MB state moved over the devices and saved both ways: exact, rates and ratios sane."""
    _, record = _state_run(
        tmp_path, "--sizes_mb=16", "--methods=devices", "--sections=transfer,save"
    )
    (moved,) = record["transfer"]["devices:16"]
    assert moved["exact"] and _positive(moved["seconds"]) and len(moved["peak"]) == 3
    assert 0 < moved["move_s"] < moved["seconds"]  # the collectives alone, inside the whole
    layout = record["transfer"]["layout:16"][0]
    whole = layout["1"]["per_device"]
    for devices in ("2", "4", "8"):  # a group's devices each stream their share
        assert layout[devices]["per_device"] == pytest.approx(whole / int(devices), rel=0.05)
    for kind in ("replica", "orbax"):
        (saved,) = record["save"][f"{kind}:16"]
        assert saved["exact"], saved
        assert _positive(saved["copy_s"]) and _positive(saved["stall_s"])
        assert saved["write_s"] >= saved["stall_s"] and _positive(saved["restore_s"])


@pytest.mark.slow  # starts processes: run after the README's command
def test_state_benchmark_moves_to_one_group_while_the_third_stands_by(tmp_path):
    """``--receivers=1``: one returning group, as one killed worker's re-join; exact both ways."""
    out, record = _state_run(
        tmp_path, "--sizes_mb=8", "--receivers=1", "--methods=devices,kv", "--sections=transfer"
    )
    assert "1 receives, 2 stands by" in out, out
    assert record["receivers"] == 1
    for method in ("devices", "kv"):
        (moved,) = record["transfer"][f"{method}:8"]
        receiver, bystander = moved["peak"][1], moved["peak"][2]
        assert moved["exact"] and receiver >= 1.0 > bystander, moved  # only p1 holds a state
        assert (moved["move_s"] is None) == (method == "kv"), moved  # kv has no collectives


def test_state_benchmark_on_gpu_says_it_needs_three(tmp_path):
    """Without 3 GPUs the transfer on GPU is skipped with its reason, not a worker's crash."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = _run("state.py", "--platform=gpu", "--sections=transfer", "--sizes_mb=1", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped, it needs 3 GPUs (one per process); found 0" in result.stdout


@pytest.mark.slow  # starts processes: run after the README's command
@pytest.mark.parametrize(
    "processes, per_group, optimizer, params",
    [
        (2, 1, "sgd", "array"),
        (3, 1, "sgd", "array"),
        (4, 2, "sgd", "array"),
        (2, 1, "adam", "function"),
    ],
    ids=["2", "3", "4 spanning", "2 adam function"],
)
def test_rejoin_state_benchmark_tiny(tmp_path, processes, per_group, optimizer, params):
    """A 16 MB state re-joins through fit: no relaunch, every byte of it moved, peaks recorded
    (2 workers: the lone survivor sends it, as in the benchmark's run over 2 GiB; 4 in
    groups of 2: both of the lost group's workers replaced, the state sent from halves;
    Adam's state, the matrix and its two moments, from parameters built by a function)."""
    result = _run(
        "rejoin_state.py",
        "--sizes_mb=16",
        f"--processes={processes}",
        f"--processes_per_group={per_group}",
        f"--optimizer={optimizer}",
        f"--params={params}",
        f"--out={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [
        json.loads(line) for line in (tmp_path / "rejoin_state.json").read_text().splitlines()
    ]
    assert not record["relaunched"] and record["exit"] == 143, record  # stopped after the join
    assert record["bytes"] >= record["state_bytes"], record  # the whole state, once
    assert _positive(record["move_s"]) and _positive(record["join_s"]), record
    assert 0 < record["start_s"] < record["join_s"], record  # its own start: part of it
    assert record["processes"] == processes, record
    assert record["processes_per_group"] == per_group, record
    assert (record["optimizer"], record["params"]) == (optimizer, params), record
    assert 15e6 <= record["state_bytes"] <= 17e6, record  # --sizes_mb is the whole state's
    assert sorted(record["peak_rss_over_state"]) == [str(p) for p in range(processes)], record
    cache = record["compile_cache"]  # every process kept its programs, in both stores
    for store in ("own_bytes", "scoped_bytes"):
        assert sorted(cache[store]) == [str(p) for p in range(processes)], record
        assert all(b > 0 for b in cache[store].values()), record
    assert "re-joined without a relaunch: True" in result.stdout, result.stdout


@pytest.mark.slow
def test_rejoin_state_benchmark_stall_rebuilds_keeping_one_copy_of_the_own_shards(tmp_path):
    """Worker 1 stopped past the collective timeout: the collectives are rebuilt, no relaunch;
    the writer kept its own shards (its whole replica, one group per process) on its host."""
    result = _run("rejoin_state.py", "--case=stall", "--sizes_mb=16", f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [
        json.loads(line) for line in (tmp_path / "rejoin_state.json").read_text().splitlines()
    ]
    assert not record["relaunched"] and record["exit"] == 143, record
    assert record["state_bytes"] <= record["host_bytes"] < 1.01 * record["state_bytes"], record
    assert _positive(record["rebuild_s"]) and record["cache_hits"] > 0, record
    for key in ("peak_before_over_state", "peak_at_stop_over_state", "peak_rss_over_state"):
        assert sorted(record[key]) == ["0", "1", "2"], record
    assert "collectives rebuilt without a relaunch: True" in result.stdout, result.stdout


@pytest.mark.slow
def test_restore_benchmark_reads_the_checkpoint_once_per_job(tmp_path):
    """2 and 3 processes save and resume a 16 MB state in both layouts: a replica is
    written by the writer alone, sharded checkpoints by every process about 1/K each
    (Orbax compresses a little); either is read once, by the writer, and the others
    read nothing (the state reaches them over the devices), whatever the process count. A
    third job, preempted, saves the step it reached and exits within the notice."""
    result = _run("restore.py", "--size_mb=16", "--processes=2,3", f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "restore.json").read_text().splitlines()]
    assert [(r["processes"], r["layout"]) for r in records] == [
        (2, "replica"),
        (2, "sharded"),
        (3, "replica"),
        (3, "sharded"),
    ], records
    for r in records:
        k = r["processes"]
        assert _positive(r["restore_s"]) and _positive(r["save_s"]), r
        reads, written = r["read_over_state"], r["written_over_state"]
        assert sorted(reads) == sorted(written) == [str(p) for p in range(k)], r
        assert sorted(r["peak_rss_over_state"]) == sorted(reads), r
        assert 0.8 <= reads["0"] <= 1.3, r  # the writer: the checkpoint, once
        assert all(reads[p] < 0.1 for p in reads if p != "0"), r  # the others: over the devices
        if r["layout"] == "replica":
            assert 0.99 <= written["0"] <= 1.01, r
            assert all(written[p] == 0 for p in written if p != "0"), r
        else:  # each process its part; the writer also the small merged index
            assert all(0.6 / k <= written[p] <= 1.1 / k for p in written), r
            assert 0.8 <= r["written_over_state_total"] <= 1.05, r
        # The preemption notice: its save, then every worker's exit, within the notice.
        assert 0 < r["preempt_save_s"] < r["notice_s"] < 60, r
        assert r["fits_gb"] > 0, r


@pytest.mark.slow  # starts processes: run after the README's command
def test_rejoins_benchmark_finds_a_survivor_level_across_rejoins(tmp_path):
    result = _run("rejoins.py", "--processes=2", "--rejoins=2", f"--out={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "rejoins.jsonl").read_text().splitlines()]
    (row,) = record["rows"]
    samples = row["samples"]
    assert row["processes"] == 2 and len(samples) == 3  # before the first kill, each re-join
    assert all(s["sockets"] > 0 and s["threads"] > 0 and s["rss_mb"] > 0 for s in samples)
    # The first re-join adds a backend (the user's first stays); later ones add nothing.
    assert samples[1]["threads"] > samples[0]["threads"]
    assert samples[2]["threads"] == samples[1]["threads"], samples
    assert abs(samples[2]["sockets"] - samples[1]["sockets"]) <= 1, samples  # one peer here
    assert row["per_rejoin"]["threads"] == 0
    line = re.search(
        r"^K=2: worker 0, .*sockets ([\d ]+), threads ([\d ]+),", result.stdout, re.MULTILINE
    )
    assert line, result.stdout
    assert [int(n) for n in line[1].split()] == [s["sockets"] for s in samples]
    # the jobs sit under --out, and no worker of theirs is left
    runs = list(tmp_path.glob("*/k2-run*"))
    assert runs and all((r / "metrics.jsonl").exists() for r in runs)
    assert not [p for p in pathlib.Path("/proc").iterdir() if _of(p, tmp_path)]


def _of(proc: pathlib.Path, tmp_path: pathlib.Path) -> bool:
    """Whether the /proc entry is a live process whose command line names ``tmp_path``."""
    try:
        return proc.name.isdigit() and str(tmp_path) in (proc / "cmdline").read_text("latin-1")
    except OSError:
        return False

"""A large state through the two paths that reset a running job's backend, via `spare_jax.fit`.

    python benchmarks/rejoin_state.py                      # 1200 MB re-join, one job (minutes)
    python benchmarks/rejoin_state.py --sizes_mb=64,1200 --out=runs/rejoin_state
    python benchmarks/rejoin_state.py --case=stall --sizes_mb=16,64,256 --out=runs/rebuild
    python benchmarks/rejoin_state.py --sizes_mb=2200 --processes=2   # over 2 GiB, 2 workers
    python benchmarks/rejoin_state.py --sizes_mb=512 --processes=4 --processes_per_group=2
    python benchmarks/rejoin_state.py --sizes_mb=512 --params=array,function --optimizer=adam

Each job is ``--processes`` workers (3 unless told) of one CPU device each
(one group each, r = 2) under ``python -m spare_jax.launch``; the model is
one float32 matrix of ``--sizes_mb`` trained with SGD (the loss touches
every element, so every step's gradient and cross-group sum is the whole
state; ``--optimizer=adam`` keeps two moments beside it, the state then 3x
the matrix). ``--params`` picks how the worker hands `fit` the initial
parameters: a host NumPy array (kept by the caller and `fit` for the whole
run: one more state on every process's host) or a function, built on the
devices in their shards; naming both runs one job of each per size, side by
side. ``--processes_per_group=P`` makes each group P consecutive workers,
the matrix sharded over them by rows (FSDP, an inner mesh axis ``fsdp``):
each process holds 1/P of the state. A lost process then takes its group,
the group's other workers leave (77), and all P are replaced and join
together.

``--case=rejoin``: worker 1 SIGKILLs itself in the middle of step
``--kill_step`` (the launcher's injector, ``--replace_after_s=0``); the
launcher starts its replacement at once, which joins the running job and
receives the state from a live group over the devices (`spare_jax.broadcast`).
This is the case of a user's 1.2 GB state whose re-join never completed when
the state went through the coordination service.

``--case=stall``: once step ``--kill_step`` is done, the driver stops worker 1
(SIGSTOP) for the collective timeout plus 3 s, then resumes it (SIGCONT): its
peers' collectives time out, and every process rebuilds its collectives,
keeping its own shards on its host through the backend reset. A stop that
caught worker 1 between collectives is waited out with nothing to rebuild;
then the driver stops it again (3 stops at most, ``stalls`` in the figures). The heartbeat
and the eviction bound are set above the stop, so nobody is declared dead.

Once the job has run a step after the re-join (or the rebuild), the driver
sends the launcher SIGTERM (the workers save and leave, exit 143). Printed
per size, from the writer's ``rejoin`` (``collectives_rebuilt``) event and
the workers' logs: the bytes moved (kept on the host), the seconds, whether
the job relaunched (it must not), and every worker's peak resident memory
(``VmHWM``) as a multiple of the state, whole and above what the worker held
just before `fit` (Python, JAX and the backend: the runtime's own): when the
driver stops the job (after the re-join or the rebuild, the replacement's for
process 1), and at exit (the stop's save included); for a stall also just
before worker 1 stops, so what the rebuild added shows; and the compile
cache's bytes on disk (JAX's entries, and each process's own and scoped
stores), which depend on the programs, not on the state's size. ``--out``
keeps the jobs and a JSON of the figures (appended to ``rejoin_state.json``).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jobs import disk_bytes, peak_bytes, worker_pid  # benchmarks/jobs.py, beside this script

import spare_jax
from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLS = 1024
PEAK = "rejoin_state: peak resident bytes "
RUNTIME = "rejoin_state: resident bytes before fit "

_SIZES = flags.DEFINE_list("sizes_mb", ["1200"], "State sizes (MB of float32 parameters).")
_STEPS = flags.DEFINE_integer(
    "steps", 1000, "Training steps per job (it is stopped once the re-join is done).", lower_bound=4
)
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Seconds a job may take.", lower_bound=10)
_KILL_STEP = flags.DEFINE_integer(
    "kill_step", 3, "Worker 1 is killed in this step (stopped after it).", lower_bound=1
)
_CASE = flags.DEFINE_enum(
    "case",
    "rejoin",
    ["rejoin", "stall"],
    "rejoin: worker 1 killed and replaced; stall: worker 1 stopped past the collective timeout.",
)
_PROCESSES = flags.DEFINE_integer(
    "processes",
    3,
    "Workers (one group each). 2 holds a state over 2 GiB on a 23 GB machine: the survivor "
    "and the replacement.",
    lower_bound=2,
)
_PER_GROUP = flags.DEFINE_integer(
    "processes_per_group",
    1,
    "Workers per group (each holds 1/P of the state, sharded by rows); divides --processes.",
    lower_bound=1,
)
_PARAMS = flags.DEFINE_list(
    "params",
    ["array"],
    "How the worker hands fit its initial parameters, one job per form and size: array (a "
    "host NumPy matrix, which the caller and fit keep for the whole run) or function (a "
    "function fit runs as one program, the parameters born in their shards on the devices).",
)
_OPTIMIZER = flags.DEFINE_enum(
    "optimizer",
    "sgd",
    ["sgd", "adam"],
    "sgd: the state is the matrix; adam: the matrix and its two moments (3x the matrix), "
    "--sizes_mb the whole state's.",
)
_OUT = flags.DEFINE_string("out", "", "Directory for the jobs and rejoin_state.json (optional).")
_ROLE = flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal: worker mode.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Internal: the worker's work directory.")
_SIZE = flags.DEFINE_integer("size_mb", 0, "Internal: the worker's state size (MB).")
_FORM = flags.DEFINE_enum(
    "form", "array", ["array", "function"], "Internal: the worker's --params."
)


def _loss(params, batch):
    return jnp.mean(batch["c"]) * jnp.mean(params["w"])


def _groups() -> int:
    return _PROCESSES.value // _PER_GROUP.value


def _copies() -> int:
    """The state's bytes over the matrix's: SGD keeps the matrix, Adam two moments beside it."""
    return 3 if _OPTIMIZER.value == "adam" else 1


def _rows(size_mb: int) -> int:
    """The matrix's rows: a state of ``size_mb`` of float32, a multiple of the workers per group."""
    per = _PER_GROUP.value
    return -(-max(size_mb * 10**6 // (4 * COLS * _copies()), 1) // per) * per


def _batches(t: int) -> dict[str, np.ndarray]:
    """Step t's global batch: one number per micro-batch (2 per group)."""
    return {"c": np.full((_groups() * 2, 1), 1.0 + 0.01 * t, np.float32)}


def _peaks(workdir: str) -> dict[int, int]:
    """Every running worker's peak resident bytes so far."""
    peaks = {}
    for p in range(_PROCESSES.value):
        try:
            peaks[p] = peak_bytes(str(worker_pid(workdir, p)))
        except (OSError, RuntimeError):  # it has exited
            pass
    return peaks


def _cache_disk(workdir: str) -> dict:
    """Bytes on disk of the job's compile cache (``fit``'s default, ``WORKDIR/compile_cache``):
    JAX's own entries (written by process 0 only) and, per process, its own store
    (``process-<id>/``, the step's programs keyed by their text) and its scoped store
    (``process-<id>/scoped/``, the programs a re-join loads untraced)."""
    cache = pathlib.Path(workdir, "compile_cache")
    if not cache.is_dir():
        return {}
    own, scoped = {}, {}
    for folder in sorted(cache.glob("process-*")):
        p = int(folder.name.split("-")[1])
        scoped[p] = disk_bytes(folder / "scoped") if (folder / "scoped").is_dir() else 0
        own[p] = disk_bytes(folder) - scoped[p]
    jax_own = sum(f.stat().st_size for f in cache.iterdir() if f.is_file())
    return {"jax_bytes": jax_own, "own_bytes": own, "scoped_bytes": scoped}


def _stall(workdir: str, seconds: float) -> dict[int, int]:
    """Worker 1 stopped for ``seconds``, then resumed; every worker's peak RSS before it."""
    before = _peaks(workdir)
    pid = worker_pid(workdir, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return before


def _worker() -> None:
    spare_jax.initialize()
    per = _PER_GROUP.value
    if per == 1:
        mesh, specs = spare_jax.make_mesh((1, _PROCESSES.value, 1)), None
    else:  # a group is `per` consecutive workers; the matrix is split over them by rows
        mesh = spare_jax.make_mesh(f"data:1,redundancy:{_groups()},fsdp:{per}")
        specs = {"w": jax.P("fsdp", None)}
    tx = optax.adam(1e-3) if _OPTIMIZER.value == "adam" else optax.sgd(1e-3)
    step = spare_jax.make_train_step(
        _loss, tx, mesh, redundancy=2, microbatches=2, param_specs=specs
    )
    rows = _rows(_SIZE.value)
    if _FORM.value == "array":
        params = {"w": np.full((rows, COLS), 0.5, np.float32)}
    else:
        params = lambda: {"w": jnp.full((rows, COLS), 0.5, jnp.float32)}
    print(f"{RUNTIME}{peak_bytes()}", flush=True)  # Python, JAX, the backend: no state yet
    try:
        spare_jax.fit(
            step,
            params,
            _batches,
            steps=_STEPS.value,
            workdir=_WORKDIR.value,
            checkpoint_steps=10**6,  # only the end of the run (or the stop) saves
            sharded_checkpoints=False,  # one writer's replica, as docs/checkpointing.md measured
        )
    finally:  # the driver stops the job (SIGTERM: a preemption) once the re-join is done
        print(f"{PEAK}{peak_bytes()}", flush=True)


def _job(workdir: str, size_mb: int, case: str, form: str) -> dict:
    # A survivor may wait in a collective that its peer left on the dead one's error until
    # this passes; the whole state's all-reduce must fit in it (300 s at 1.2 GB).
    timeout = max(30, size_mb // 4)
    if case == "rejoin":
        faults = ["--heartbeat_s=10", "--replace_after_s=0", f"--kill={_KILL_STEP.value}:1"]
    else:  # nobody declared dead or evicted while stopped: a stall, not a loss
        faults = [f"--heartbeat_s={2 * timeout + 10}", f"--evict_after_s={2 * timeout + 10}"]
    command = [
        sys.executable,
        "-m",
        "spare_jax.launch",
        f"--processes={_PROCESSES.value}",
        "--devices_per_process=1",
        f"--collective_timeout_s={timeout}",
        *faults,
        f"--launch_dir={os.path.join(workdir, 'launch')}",
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--role=worker",
        f"--workdir={workdir}",
        f"--size_mb={size_mb}",
        f"--steps={_STEPS.value}",
        f"--processes={_PROCESSES.value}",
        f"--processes_per_group={_PER_GROUP.value}",
        f"--form={form}",
        f"--optimizer={_OPTIMIZER.value}",
    ]
    event = "rejoin" if case == "rejoin" else "collectives_rebuilt"
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    stalls, resumed = 0, 0.0
    with open(os.path.join(workdir, "launcher.log"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _TIMEOUT.value
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                records = read_records(path)
                reached = any(r.get("step", -1) >= _KILL_STEP.value for r in records if "loss" in r)
                rebuilt = any(r.get("event") == event for r in records)
                # A stop that caught worker 1 between collectives is waited out in the next
                # step's live-set check, with nothing to rebuild: stop it again.
                again = stalls and not rebuilt and time.monotonic() - resumed > timeout
                if case == "stall" and reached and (not stalls or again) and stalls < 3:
                    peaks = _stall(workdir, timeout + 3)
                    before = before or peaks
                    stalls, resumed = stalls + 1, time.monotonic()
                    continue
                done = [r for r in records if r.get("event") in (event, "relaunch")]
                if done and any(r.get("step", -1) > done[0].get("step", 0) for r in records):
                    after = _peaks(workdir)  # before the stop's save adds its own
                    proc.send_signal(signal.SIGTERM)  # the workers save and leave (143)
                    break
                time.sleep(0.5)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = read_records(path)
    found = [r for r in records if r.get("event") == event]
    peaks, runtime = {}, {}
    for log in sorted(pathlib.Path(workdir, "launch").glob("worker-*.log")):
        text, p = log.read_text(errors="replace"), int(log.stem.split("-")[1])
        last, own = re.findall(rf"{PEAK}(\d+)", text), re.findall(rf"{RUNTIME}(\d+)", text)
        if last and own:  # the last of each: a replacement's
            peaks[p], runtime[p] = int(last[-1]), int(own[-1])
    state = _rows(size_mb) * COLS * 4 * _copies()
    figures = {
        "case": case,
        "params": form,
        "optimizer": _OPTIMIZER.value,
        "processes": _PROCESSES.value,
        "processes_per_group": _PER_GROUP.value,
        "size_mb": size_mb,
        "state_bytes": state,
        "exit": proc.returncode,
        "relaunched": any(r.get("event") == "relaunch" for r in records),
        "peak_rss_over_state": {p: round(b / state, 2) for p, b in sorted(peaks.items())},
        "runtime_bytes": dict(sorted(runtime.items())),
        "peak_above_runtime_over_state": {
            p: round((b - runtime[p]) / state, 2) for p, b in sorted(peaks.items())
        },
        "compile_cache": _cache_disk(workdir),
    }
    if stalls:
        figures["stalls"] = stalls
    for key, peaks_of in (("peak_before_over_state", before), ("peak_at_stop_over_state", after)):
        if peaks_of:
            figures[key] = {p: round(b / state, 2) for p, b in peaks_of.items()}
    if found:
        keys = ("bytes", "move_s", "move_mb_s", "transfer_s", "join_s", "start_s", "admit_s")
        keys += ("host_bytes", "rebuild_s", "compile_s", "cache_hits")
        figures.update({k: found[0][k] for k in keys if k in found[0]})
    if not found or figures["relaunched"]:  # the launcher's own lines say why
        lines = pathlib.Path(workdir, "launcher.log").read_text(errors="replace").splitlines()
        figures["error"] = "\n".join(x for x in lines if x.startswith("launch: "))[-1500:]
    return figures


def _line(figures: dict) -> str:
    size, ok = figures["size_mb"], not figures["relaunched"]
    if figures["case"] == "rejoin":
        if "bytes" not in figures:
            return (
                f"{size} MB, parameters as {figures['params']}: no re-join (exit {figures['exit']})"
            )
        return (
            f"{size} MB, {figures['processes_per_group']} process(es) a group, "
            f"{figures['optimizer']}, parameters as {figures['params']}: re-joined "
            f"without a relaunch: {ok}; "
            f"{figures['bytes'] / 1e6:.0f} MB moved in {figures['move_s']:.2f} s "
            f"({figures['move_mb_s']:.0f} MB/s); replacement's start to its first step "
            f"{figures['join_s']:.1f} s (its own start {figures['start_s']:.1f} s); peak RSS / "
            "state per process "
            f"{figures['peak_rss_over_state']}, above the runtime's own "
            f"{figures['peak_above_runtime_over_state']}; {_cache_line(figures['compile_cache'])}"
        )
    if "rebuild_s" not in figures:
        return f"{size} MB: no rebuild (exit {figures['exit']})"
    return (
        f"{size} MB, {figures['optimizer']}, parameters as {figures['params']}: collectives "
        f"rebuilt without a relaunch: {ok}; "
        f"{figures['host_bytes'] / 1e6:.0f} MB kept on the writer's host; rebuild "
        f"{figures['rebuild_s']:.2f} s, then {figures['compile_s']:.2f} s compiling "
        f"({figures['cache_hits']} cache hits); peak RSS / state per process before the stall "
        f"{figures['peak_before_over_state']}, after the rebuild "
        f"{figures.get('peak_at_stop_over_state')}, after the stop's save "
        f"{figures['peak_rss_over_state']}"
    )


def _cache_line(cache: dict) -> str:
    if not cache:
        return "no compile cache"
    mb = lambda per: ", ".join(f"{p}: {b / 1e6:.2f}" for p, b in per.items())
    return (
        f"compile cache on disk, MB: JAX's {cache['jax_bytes'] / 1e6:.2f}, each process's "
        f"own store {{{mb(cache['own_bytes'])}}}, scoped {{{mb(cache['scoped_bytes'])}}}"
    )


def main(argv: list[str]) -> None:
    del argv
    if _ROLE.value == "worker":
        _worker()
        return
    try:
        sizes = [int(s) for s in _SIZES.value]
    except ValueError:
        raise app.UsageError(f"--sizes_mb must be whole MB, got {_SIZES.value}") from None
    if any(s < 1 for s in sizes):
        raise app.UsageError(f"--sizes_mb must be >= 1, got {sizes}")
    if _PROCESSES.value % _PER_GROUP.value or _groups() < 2:
        raise app.UsageError(
            f"--processes_per_group={_PER_GROUP.value} must divide --processes="
            f"{_PROCESSES.value} into 2 groups or more"
        )
    if not _PARAMS.value or set(_PARAMS.value) - {"array", "function"}:
        raise app.UsageError(f"--params must name array and/or function, got {_PARAMS.value}")
    if _KILL_STEP.value >= _STEPS.value - 1:
        raise app.UsageError("--kill_step must leave steps for the re-join (< --steps - 1)")
    keep = cli.output_dir("out", _OUT.value) if _OUT.value else ""
    base = keep or tempfile.mkdtemp(prefix="spare_rejoin_state_")
    results = []
    for size, form in [(s, f) for s in sizes for f in _PARAMS.value]:
        name = f"{_CASE.value}-{size}mb-{_PROCESSES.value}p"
        if _PER_GROUP.value > 1:
            name += f"-{_PER_GROUP.value}pg"
        name += "" if form == "array" else "-function"
        name += "" if _OPTIMIZER.value == "sgd" else "-adam"
        workdir = os.path.join(base, name)
        if os.path.exists(workdir):  # an earlier run's job: kept, never overwritten
            workdir = tempfile.mkdtemp(prefix=name + "-", dir=base)
        figures = _job(workdir, size, _CASE.value, form)
        results.append(figures)
        print(json.dumps(figures), flush=True)
        print(_line(figures), flush=True)
    if keep:
        with open(os.path.join(keep, "rejoin_state.json"), "a", encoding="utf-8") as f:
            for figures in results:
                f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    cli.run(main)

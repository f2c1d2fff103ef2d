"""A large state's re-join through `spare_jax.fit`: a killed worker replaced while the job runs.

    python benchmarks/rejoin_state.py                      # 1200 MB, one job (minutes)
    python benchmarks/rejoin_state.py --sizes_mb=64,1200 --out=runs/rejoin_state

Each job is 3 workers of one CPU device each (one group each, r = 2) under
``python -m spare_jax.launch --replace_after_s=0``; the model is one float32
matrix of ``--sizes_mb`` trained with SGD (the loss touches every element,
so every step's gradient and cross-group sum is the whole state). Worker 1
SIGKILLs itself in the middle of step ``--kill_step`` (the launcher's
injector); the launcher starts its replacement at once, which joins the
running job and receives the state from a live group over the devices
(`spare_jax.broadcast`). Once the job has run a step after the re-join, the
driver sends the launcher SIGTERM (the workers save and leave, exit 143).
This is the case of a user's 1.2 GB state whose re-join never completed
when the state went through the coordination service.

Printed per size, from the writer's ``rejoin`` event and the workers' logs:
the bytes moved, the transfer's seconds and MB/s, the replacement's start to
its first step in the job (``join_s``), whether the job relaunched (it must
not), and every worker's peak resident memory (``VmHWM``, the replacement's
for process 1) as a multiple of the state. ``--out`` keeps the jobs and a
JSON of the figures (appended to ``rejoin_state.json``).
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

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import spare_jax
from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLS = 1024
PEAK = "rejoin_state: peak resident bytes "

_SIZES = flags.DEFINE_list("sizes_mb", ["1200"], "State sizes (MB of float32 parameters).")
_STEPS = flags.DEFINE_integer(
    "steps", 1000, "Training steps per job (it is stopped once the re-join is done).", lower_bound=4
)
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Seconds a job may take.", lower_bound=10)
_KILL_STEP = flags.DEFINE_integer("kill_step", 3, "Worker 1 is killed in this step.", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Directory for the jobs and rejoin_state.json (optional).")
_ROLE = flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal: worker mode.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Internal: the worker's work directory.")
_SIZE = flags.DEFINE_integer("size_mb", 0, "Internal: the worker's state size (MB).")


def _loss(params, batch):
    return jnp.mean(batch["c"]) * jnp.mean(params["w"])


def _batches(t: int, rows: int = 3 * 2) -> dict[str, np.ndarray]:
    """Step t's global batch: one number per micro-batch (3 groups x 2 micro-batches)."""
    return {"c": np.full((rows, 1), 1.0 + 0.01 * t, np.float32)}


def _peak_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _worker() -> None:
    spare_jax.initialize()
    mesh = spare_jax.make_mesh((1, 3, 1))
    step = spare_jax.make_train_step(_loss, optax.sgd(1e-3), mesh, redundancy=2, microbatches=2)
    rows = max(_SIZE.value * 10**6 // (4 * COLS), 1)
    try:
        spare_jax.fit(
            step,
            {"w": np.full((rows, COLS), 0.5, np.float32)},
            _batches,
            steps=_STEPS.value,
            workdir=_WORKDIR.value,
            checkpoint_steps=10**6,  # only the end of the run (or the stop) saves
        )
    finally:  # the driver stops the job (SIGTERM: a preemption) once the re-join is done
        print(f"{PEAK}{_peak_bytes()}", flush=True)


def _job(workdir: str, size_mb: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "spare_jax.launch",
        "--processes=3",
        "--devices_per_process=1",
        "--heartbeat_s=10",
        # A survivor may wait in a collective that its peer left on the dead one's error until
        # this passes; the whole state's all-reduce must fit in it (300 s at 1.2 GB).
        f"--collective_timeout_s={max(30, size_mb // 4)}",
        "--replace_after_s=0",
        f"--kill={_KILL_STEP.value}:1",
        f"--launch_dir={os.path.join(workdir, 'launch')}",
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--role=worker",
        f"--workdir={workdir}",
        f"--size_mb={size_mb}",
        f"--steps={_STEPS.value}",
    ]
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    with open(os.path.join(workdir, "launcher.log"), "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _TIMEOUT.value
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                records = read_records(path)
                done = [r for r in records if r.get("event") in ("rejoin", "relaunch")]
                if done and any(r.get("step", -1) > done[0].get("step", 0) for r in records):
                    proc.send_signal(signal.SIGTERM)  # the workers save and leave (143)
                    break
                time.sleep(0.5)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = read_records(path)
    rejoins = [r for r in records if r.get("event") == "rejoin"]
    peaks = {}
    for log in sorted(pathlib.Path(workdir, "launch").glob("worker-*.log")):
        found = re.findall(rf"{PEAK}(\d+)", log.read_text(errors="replace"))
        if found:
            peaks[int(log.stem.split("-")[1])] = int(found[-1])  # the last: a replacement's
    state = max(size_mb * 10**6 // (4 * COLS), 1) * COLS * 4
    figures = {
        "size_mb": size_mb,
        "state_bytes": state,
        "exit": proc.returncode,
        "relaunched": any(r.get("event") == "relaunch" for r in records),
        "peak_rss_over_state": {p: round(b / state, 2) for p, b in sorted(peaks.items())},
    }
    if rejoins:
        e = rejoins[0]
        figures.update(
            {k: e[k] for k in ("bytes", "move_s", "move_mb_s", "transfer_s", "join_s") if k in e}
        )
    if not rejoins or figures["relaunched"]:  # the launcher's own lines say why
        lines = pathlib.Path(workdir, "launcher.log").read_text(errors="replace").splitlines()
        figures["error"] = "\n".join(x for x in lines if x.startswith("launch: "))[-1500:]
    return figures


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
    if _KILL_STEP.value >= _STEPS.value - 1:
        raise app.UsageError("--kill_step must leave steps for the re-join (< --steps - 1)")
    keep = cli.output_dir("out", _OUT.value) if _OUT.value else ""
    base = keep or tempfile.mkdtemp(prefix="spare_rejoin_state_")
    results = []
    for size in sizes:
        workdir = os.path.join(base, f"state-{size}mb")
        figures = _job(workdir, size)
        results.append(figures)
        print(json.dumps(figures), flush=True)
        moved = figures.get("bytes")
        if moved is not None:
            print(
                f"{size} MB: re-joined without a relaunch: {not figures['relaunched']}; "
                f"{moved / 1e6:.0f} MB moved in {figures['move_s']:.2f} s "
                f"({figures['move_mb_s']:.0f} MB/s); replacement's start to its first step "
                f"{figures['join_s']:.1f} s; peak RSS / state per process "
                f"{figures['peak_rss_over_state']}",
                flush=True,
            )
        else:
            print(f"{size} MB: no re-join (exit {figures['exit']})", flush=True)
    if keep:
        with open(os.path.join(keep, "rejoin_state.json"), "a", encoding="utf-8") as f:
            for figures in results:
                f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    cli.run(main)

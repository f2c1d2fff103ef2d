"""A restore against the number of processes: read once per job, sent over the devices.

    python benchmarks/restore.py                           # 256 MB, 2, 3 and 4 processes
    python benchmarks/restore.py --size_mb=512 --processes=2,4 --out=runs/restore

For each process count K, two jobs of K workers (one CPU device and one
group each, r = 2) under ``python -m spare_jax.launch`` train one float32
matrix of ``--size_mb`` with SGD in the same work directory: the first runs
two steps and saves at its end; the second resumes from that checkpoint and
runs one more step. In a job whose groups lie whole on processes only the
writer reads the checkpoint; its group sends the state to the others over the
devices (`spare_jax.broadcast`).

Printed per K: the resume's ``restore_s`` (the writer's read, checked, and
the send to every other group: the time until every process holds the
state), and each process's bytes read (``rchar`` of ``/proc/self/io``) in
the resuming job beyond the fresh one, as a multiple of the state: about 1
for the writer and about 0 for the others when the job reads the checkpoint
once, whatever K. Medians over ``--repeats`` pairs of jobs. ``--out`` keeps
the jobs and appends the figures to ``restore.json``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

import spare_jax
from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLS = 1024
READ = "restore_bench: rchar "

_SIZE = flags.DEFINE_integer(
    "size_mb", 256, "State size (MB of float32 parameters).", lower_bound=1
)
_PROCESSES = flags.DEFINE_list("processes", ["2", "3", "4"], "Process counts K (each >= 2).")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Pairs of jobs per K (medians).", lower_bound=1)
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "Seconds a job may take.", lower_bound=10)
_OUT = flags.DEFINE_string("out", "", "Directory for the jobs and restore.json (optional).")
_ROLE = flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal: worker mode.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Internal: the worker's work directory.")
_STEPS = flags.DEFINE_integer("steps", 2, "Internal: the worker's steps.", lower_bound=1)
_K = flags.DEFINE_integer("k", 2, "Internal: the worker's process count.", lower_bound=2)


def _loss(params, batch):
    return jnp.mean(batch["c"]) * jnp.mean(params["w"])


def _rows() -> int:
    return max(_SIZE.value * 10**6 // (4 * COLS), 1)


def _rchar() -> int:
    with open("/proc/self/io", encoding="utf-8") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _worker() -> None:
    spare_jax.initialize()
    k = _K.value
    mesh = spare_jax.make_mesh((1, k, 1))
    step = spare_jax.make_train_step(_loss, optax.sgd(1e-3), mesh, redundancy=2, microbatches=2)

    def batches(t: int) -> dict[str, np.ndarray]:
        return {"c": np.full((2 * k, 1), 1.0 + 0.01 * t, np.float32)}

    try:
        spare_jax.fit(
            step,
            {"w": np.full((_rows(), COLS), 0.5, np.float32)},
            batches,
            steps=_STEPS.value,
            workdir=_WORKDIR.value,
            checkpoint_steps=10**6,  # the end of the run saves
        )
    finally:
        print(f"{READ}{_rchar()}", flush=True)


def _job(workdir: str, k: int, steps: int) -> dict[int, int]:
    """Run one job to its end; each worker's rchar (by process)."""
    launch_dir = os.path.join(workdir, f"launch-{steps}")
    command = [
        sys.executable,
        "-m",
        "spare_jax.launch",
        f"--processes={k}",
        "--devices_per_process=1",
        "--heartbeat_s=10",
        "--collective_timeout_s=300",
        "--max_relaunches=0",
        f"--launch_dir={launch_dir}",
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--role=worker",
        f"--workdir={workdir}",
        f"--size_mb={_SIZE.value}",
        f"--steps={steps}",
        f"--k={k}",
    ]
    log = os.path.join(workdir, f"launcher-{steps}.log")
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=_TIMEOUT.value)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers (JAX keeps SIGTERM)
            proc.wait()
            raise RuntimeError(f"the job of {k} processes took over {_TIMEOUT.value} s") from None
    if code != 0:
        tail = pathlib.Path(log).read_text(errors="replace").strip()[-400:]
        raise RuntimeError(f"the job of {k} processes ({steps} steps) exited {code}:\n{tail}")
    reads = {}
    for path in sorted(pathlib.Path(launch_dir).glob("worker-*.log")):
        found = re.findall(rf"{READ}(\d+)", path.read_text(errors="replace"))
        if found:
            reads[int(path.stem.split("-")[1])] = int(found[-1])
    return reads


def _pair(workdir: str, k: int) -> dict:
    os.makedirs(workdir, exist_ok=True)
    fresh = _job(workdir, k, 2)
    resumed = _job(workdir, k, 3)
    (event,) = [
        r
        for r in read_records(os.path.join(workdir, "metrics.jsonl"))
        if r.get("event") == "resume"
    ]
    state = _rows() * COLS * 4
    return {
        "restore_s": event["restore_s"],
        "read_over_state": {p: (resumed[p] - fresh.get(p, 0)) / state for p in sorted(resumed)},
    }


def main(argv: list[str]) -> None:
    del argv
    if _ROLE.value == "worker":
        _worker()
        return
    try:
        counts = [int(k) for k in _PROCESSES.value]
    except ValueError:
        raise app.UsageError(f"--processes must be whole numbers, got {_PROCESSES.value}") from None
    if any(k < 2 for k in counts):
        raise app.UsageError(f"--processes must each be >= 2, got {counts}")
    keep = cli.output_dir("out", _OUT.value) if _OUT.value else ""
    base = keep or tempfile.mkdtemp(prefix="spare_restore_")
    state = _rows() * COLS * 4
    print(f"state {state / 1e6:.0f} MB; medians of {_REPEATS.value} pair(s) of jobs per K")
    print(
        f"{'K':>3} {'restore s':>9} {'vs K=' + str(counts[0]):>7} {'read / state, by process':>30}"
    )
    results, base_s = [], None
    for k in counts:
        pairs = [_pair(os.path.join(base, f"k{k}-{i}"), k) for i in range(_REPEATS.value)]
        restore_s = statistics.median(p["restore_s"] for p in pairs)
        reads = {
            p: round(statistics.median(x["read_over_state"][p] for x in pairs), 2)
            for p in pairs[0]["read_over_state"]
        }
        base_s = base_s or restore_s
        figures = {
            "processes": k,
            "state_bytes": state,
            "restore_s": round(restore_s, 4),
            "ratio_to_first": round(restore_s / base_s, 3),
            "read_over_state": reads,
            "read_over_state_total": round(sum(reads.values()), 2),
        }
        results.append(figures)
        shown = " ".join(f"{v:.2f}" for v in reads.values())
        print(f"{k:>3} {restore_s:9.2f} {restore_s / base_s:7.2f} {shown:>30}", flush=True)
    for figures in results:
        print(json.dumps(figures), flush=True)
    if keep:
        with open(os.path.join(keep, "restore.json"), "a", encoding="utf-8") as f:
            for figures in results:
                f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    cli.run(main)

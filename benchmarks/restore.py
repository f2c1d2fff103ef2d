"""A save and a restore against the number of processes, in both checkpoint layouts.

    python benchmarks/restore.py                           # 256 MB, 2, 3 and 4 processes
    python benchmarks/restore.py --size_mb=512 --processes=2,4 --out=runs/restore
    python benchmarks/restore.py --layouts=sharded         # one layout only

For each process count K and layout, two jobs of K workers (one CPU device
and one group each, r = 2) under ``python -m spare_jax.launch`` train one
float32 matrix of ``--size_mb`` with SGD in the same work directory: the
first runs three steps, saving after the second (the save measured) and at
its end; the second resumes from step 3 and runs two more (one step fewer
than the first: the first job's reads are taken off the second's below, and
the restore's broadcast stands in for the missing step's collectives).
The layouts (`spare_jax.fit`'s ``sharded_checkpoints``): *replica*, one
writer copies its whole replica to its host and writes it; *sharded*, every
process writes its part from its device (Orbax's replica-parallel save: a
matrix whose rows K divides is split K ways; the row count here is a
multiple of 60, so K = 2-6 all split). In both, only the writer reads the
checkpoint on a resume; its group sends the state to the others over the
devices (`spare_jax.broadcast`).

A third job resumes from step 5 and is sent a preemption notice (SIGTERM to
the launcher) once step 7 is on record: every worker saves the step reached
and exits. Its ``preempted`` event's ``save_s`` (the notice's save) and the
seconds from the notice to the launcher's exit are printed, with the state
that would fit in a ``--notice_s`` notice at that save rate (linear in the
bytes, the exit's fixed part taken off; on this machine's one disk).

Printed per K and layout, each process's figures as a multiple of the state:
the bytes of the step-2 checkpoint on disk by the process that wrote them
(Orbax keeps each process's under ``ocdbt.process_<p>``), the first job's
peak memory (``VmHWM``: the state, the step's buffers and the save's host
copy; on CPU the device's memory is the host's: a process that does not save
shows what the rest costs), the save's stall (``save_s`` of its
``checkpoint`` event: what the step loop waited for); the resume's
``restore_s`` (the writer's read, checked, and the send to every other
group) and each process's bytes read (``rchar`` of ``/proc/self/io``)
beyond the first job's. The matrix holds random values: Orbax compresses
what it writes, and a constant one would take no space.
Medians over ``--repeats`` pairs of jobs. ``--out`` keeps the jobs and
appends the figures to ``restore.json``.
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
import time

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from jobs import disk_bytes, peak_bytes  # benchmarks/jobs.py, beside this script

import spare_jax
from spare_jax import cli, errors
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLS = 1024
ROWS_MULTIPLE = 60  # the rows split evenly over 2-6 processes (Orbax's replica-parallel rule)
READ = "restore_bench: io "
PREEMPTED = errors.EXIT_PREEMPTED  # the launcher's status after a preemption notice

_SIZE = flags.DEFINE_integer(
    "size_mb", 256, "State size (MB of float32 parameters).", lower_bound=1
)
_PROCESSES = flags.DEFINE_list("processes", ["2", "3", "4"], "Process counts K (each >= 2).")
_LAYOUTS = flags.DEFINE_multi_enum(
    "layouts", ["replica", "sharded"], ["replica", "sharded"], "Checkpoint layouts to run."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Pairs of jobs per K (medians).", lower_bound=1)
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "Seconds a job may take.", lower_bound=10)
_OUT = flags.DEFINE_string("out", "", "Directory for the jobs and restore.json (optional).")
_ROLE = flags.DEFINE_enum("role", "driver", ["driver", "worker"], "Internal: worker mode.")
_WORKDIR = flags.DEFINE_string("workdir", "", "Internal: the worker's work directory.")
_STEPS = flags.DEFINE_integer("steps", 2, "Internal: the worker's steps.", lower_bound=1)
_K = flags.DEFINE_integer("k", 2, "Internal: the worker's process count.", lower_bound=2)
_SHARDED = flags.DEFINE_bool("sharded", False, "Internal: the worker's layout.")
_EVERY = flags.DEFINE_integer(
    "every", 2, "Internal: the worker's checkpoint interval.", lower_bound=1
)
_NOTICE_S = flags.DEFINE_float(
    "notice_s",
    60.0,
    "The preemption notice the fits column is worked out for (the launcher's --preempt_s default).",
    lower_bound=1.0,
)


def _loss(params, batch):
    return jnp.mean(batch["c"]) * jnp.mean(params["w"])


def _rows() -> int:
    rows = _SIZE.value * 10**6 // (4 * COLS)
    return max(rows // ROWS_MULTIPLE, 1) * ROWS_MULTIPLE


def _io() -> dict[str, int]:
    """This process's bytes read (``rchar`` of ``/proc/self/io``) and its peak RSS."""
    out = {}
    with open("/proc/self/io", encoding="utf-8") as f:
        for line in f:
            name, value = line.split(":")
            if name == "rchar":
                out[name] = int(value)
    out["hwm"] = peak_bytes()
    return out


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
            # Random bits: a constant matrix would shrink to nothing in Orbax's compressed files.
            {"w": np.random.default_rng(0).standard_normal((_rows(), COLS), np.float32)},
            batches,
            steps=_STEPS.value,
            workdir=_WORKDIR.value,
            checkpoint_steps=_EVERY.value,  # 2: the save measured is step 2's, between two steps
            sharded_checkpoints=_SHARDED.value,
        )
    finally:
        print(f"{READ}{json.dumps(_io())}", flush=True)


def _job(
    workdir: str, k: int, steps: int, sharded: bool, preempt_at: int | None = None
) -> dict[int, dict[str, int]]:
    """Run one job to its end; each worker's `_io` figures (by process).

    ``preempt_at``: send the launcher a preemption notice (SIGTERM) once a step
    past this one is on record; the figures then hold ``notice_s``, the
    seconds from the notice to the launcher's exit.
    """
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
        f"--sharded={sharded}",
        f"--every={2 if preempt_at is None else steps}",
    ]
    log = os.path.join(workdir, f"launcher-{steps}.log")
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        started, notice = time.monotonic(), None
        try:
            while preempt_at is not None and notice is None:
                if proc.poll() is not None or time.monotonic() - started > _TIMEOUT.value:
                    break
                if _reached(workdir) > preempt_at:
                    proc.send_signal(signal.SIGTERM)
                    notice = time.monotonic()
                time.sleep(0.05)
            code = proc.wait(timeout=_TIMEOUT.value)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers (JAX keeps SIGTERM)
            proc.wait()
            raise RuntimeError(f"the job of {k} processes took over {_TIMEOUT.value} s") from None
    if notice is not None and code == PREEMPTED:
        code, took = 0, time.monotonic() - notice
    elif preempt_at is not None:
        code = code or 1  # it ended before the notice, or did not stop as preempted
    if code != 0:
        tail = pathlib.Path(log).read_text(errors="replace").strip()[-400:]
        raise RuntimeError(f"the job of {k} processes ({steps} steps) exited {code}:\n{tail}")
    figures = {}
    for path in sorted(pathlib.Path(launch_dir).glob("worker-*.log")):
        found = re.findall(rf"{READ}(.+)", path.read_text(errors="replace"))
        if found:
            figures[int(path.stem.split("-")[1])] = json.loads(found[-1])
    if notice is not None:
        figures[-1] = {"notice_s": took}
    return figures


def _reached(workdir: str) -> int:
    """The last step on record in the job's metrics (-1: none)."""
    try:
        records = read_records(os.path.join(workdir, "metrics.jsonl"))
    except (OSError, ValueError):
        return -1
    return max((r["step"] for r in records if "loss" in r), default=-1)


def _written(state_dir: pathlib.Path, k: int) -> dict[int, int]:
    """Bytes of a checkpoint's state on disk, by the process that wrote them.

    Orbax's OCDBT layout keeps each process's writes under ``ocdbt.process_<p>``;
    the rest (the merged manifest, the metadata, or the whole ``replica.npz``)
    is the writer's, process 0 here.
    """
    own = {p: disk_bytes(state_dir / f"ocdbt.process_{p}") for p in range(k)}
    own[0] += disk_bytes(state_dir) - sum(own.values())
    return own


def _pair(workdir: str, k: int, sharded: bool) -> dict:
    os.makedirs(workdir, exist_ok=True)
    fresh = _job(workdir, k, 3, sharded)
    written = _written(pathlib.Path(workdir) / "checkpoints" / "2" / "state", k)
    resumed = _job(workdir, k, 5, sharded)
    # A third job resumes from step 5 and is preempted after step 7: the forced save of
    # the step reached, then every worker's exit.
    preempted = _job(workdir, k, 10**6, sharded, preempt_at=7)
    records = read_records(os.path.join(workdir, "metrics.jsonl"))
    (event,) = [r for r in records if r.get("event") == "resume" and r["step"] == 3]
    (notice,) = [r for r in records if r.get("event") == "preempted"]
    saved = [r for r in records if r.get("event") == "checkpoint" and r["step"] == 2]
    state = _rows() * COLS * 4

    def over(figures: dict[int, dict[str, int]], key: str, less=None) -> dict[int, float]:
        return {
            p: (figures[p][key] - (less or {}).get(p, {}).get(key, 0)) / state
            for p in sorted(figures)
        }

    return {
        "save_s": saved[0]["save_s"],
        "written_over_state": {p: n / state for p, n in written.items()},
        "peak_rss_over_state": over(fresh, "hwm"),
        "restore_s": event["restore_s"],
        "read_over_state": over(resumed, "rchar", fresh),
        "preempt_save_s": notice["save_s"],
        "notice_s": preempted[-1]["notice_s"],
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
    print("per process, as multiples of the state: written, the saving job's peak RSS, read")
    print(
        f"a preemption notice: its save, the notice to the launcher's exit, and the state "
        f"saved in a {_NOTICE_S.value:.0f} s notice at this save rate (fits)"
    )
    print(
        f"{'K':>3} {'layout':>8} {'save s':>7} {'written':>18} "
        f"{'peak RSS':>18} {'restore s':>9} {'read':>18} {'notice save':>11} {'to exit':>7} "
        f"{'fits GB':>7}"
    )
    results = []
    for k in counts:
        for layout in _LAYOUTS.value:
            sharded = layout == "sharded"
            pairs = [
                _pair(os.path.join(base, f"k{k}-{layout}-{i}"), k, sharded)
                for i in range(_REPEATS.value)
            ]

            def median(key: str, pairs=pairs) -> dict[int, float]:
                return {
                    p: round(statistics.median(x[key][p] for x in pairs), 2) for p in pairs[0][key]
                }

            figures = {
                "processes": k,
                "layout": layout,
                "state_bytes": state,
                "save_s": round(statistics.median(p["save_s"] for p in pairs), 4),
                "written_over_state": median("written_over_state"),
                "peak_rss_over_state": median("peak_rss_over_state"),
                "restore_s": round(statistics.median(p["restore_s"] for p in pairs), 4),
                "read_over_state": median("read_over_state"),
                "preempt_save_s": round(statistics.median(p["preempt_save_s"] for p in pairs), 4),
                "notice_s": round(statistics.median(p["notice_s"] for p in pairs), 4),
            }
            # Linear in the bytes: the exit's fixed part, then the save at its measured rate.
            spare = _NOTICE_S.value - (figures["notice_s"] - figures["preempt_save_s"])
            rate = state / max(figures["preempt_save_s"], 1e-9)
            figures["fits_gb"] = round(max(spare, 0.0) * rate / 1e9, 1)
            figures["written_over_state_total"] = round(
                sum(figures["written_over_state"].values()), 2
            )
            figures["read_over_state_total"] = round(sum(figures["read_over_state"].values()), 2)
            results.append(figures)

            def shown(key: str, figures=figures) -> str:
                return " ".join(f"{v:.2f}" for v in figures[key].values())

            print(
                f"{k:>3} {layout:>8} {figures['save_s']:7.2f} {shown('written_over_state'):>18} "
                f"{shown('peak_rss_over_state'):>18} {figures['restore_s']:9.2f} "
                f"{shown('read_over_state'):>18} "
                f"{figures['preempt_save_s']:11.2f} {figures['notice_s']:7.2f} "
                f"{figures['fits_gb']:7.1f}",
                flush=True,
            )
    for figures in results:
        print(json.dumps(figures), flush=True)
    if keep:
        with open(os.path.join(keep, "restore.json"), "a", encoding="utf-8") as f:
            for figures in results:
                f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    cli.run(main)

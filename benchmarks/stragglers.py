"""A slow worker, with and without SPARe's speed-aware assignment (`fit(..., balance=True)`).

    sudo python benchmarks/stragglers.py               # 3 repeats (about 30 minutes on 2 cores)
    python benchmarks/stragglers.py --repeats=1 --steps=40 --slow=3

Every case is a real job of `experiments/launch.py`: 4 worker processes of 2
CPU devices (one group each, r = 2, m = 8), the LM of `configs/lm_tiny.py`
with ``--batch`` sequences of ``--seq_len`` tokens per micro-batch, sized so
that computing the micro-batches is most of a step, as on an accelerator
(the smoke model's step is all fixed cost, which no assignment can move).
Side by side in each repeat, in a rotating order:

* **failure-free**: no worker slowed;
* **slowed, waited on**: once the job reaches step 2, worker 2 is put in a
  CPU cgroup whose quota is ``1/--slow`` of its fair share of this
  machine's cores (cores / 4), from outside, as a throttled host runs (a
  20 ms period, so that the hold is smooth at the step's scale): the step
  waits for it (the behaviour without ``--balance``);
* **slowed, balanced**: the same with ``--balance``: the processes measure
  their own compute speed, share it every 5 steps, and move micro-batches
  off the slow group when that shortens the step;
* **failure-free, m = 1**: one micro-batch per group, to split the step into
  its fixed part F (update, collectives, host work: what a slow worker still
  does slowly whatever it is given) and c per micro-batch, by the two
  failure-free cases. From them the bound of the balanced step: a worker
  ``slow`` times slower at ``k`` micro-batches with the others at the new
  max load, ``max(slow (F + k c), F + max_load c)``, over ``F + m c``; with
  ``slow`` the nominal ``--slow`` and the measured slowdown (the waited-on
  step over the failure-free one: in a failure-free job a worker also runs on
  the cores its waiting peers leave idle, which the quota denies it).

Printed, medians over ``--repeats``: the median step time over the second
half of each run (after the balanced job has switched), its ratio to the
failure-free step, the max load then, and the step of the first
``straggler`` event. The cgroup needs root and the cpu controller (cgroup v1
or v2); without them the script says so and stops. ``--out`` keeps the runs
and a JSON summary.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
from jobs import worker_pid  # benchmarks/jobs.py: this script's directory is on sys.path

from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]

_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each case.", lower_bound=1, upper_bound=20)
_STEPS = flags.DEFINE_integer("steps", 60, "Steps per job.", lower_bound=20)
_SLOW = flags.DEFINE_float("slow", 3.0, "The slowed worker gets 1/SLOW of its fair CPU share.")
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", 8, "m: micro-batches per group.", lower_bound=2
)
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per micro-batch.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.", lower_bound=2)
_OUT = flags.DEFINE_string("out", "", "Directory for the runs and stragglers.json (optional).")

CASES = (
    ("failure-free", False, []),
    ("slowed, waited on", True, []),
    ("slowed, balanced", True, ["--balance"]),
    ("failure-free, m = 1", False, ["--microbatches=1"]),
)
VICTIM = 2
PROCESSES = 4


class CpuQuota:
    """A CPU cgroup of ``cores`` cores' quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``)."""

    def __init__(self, name: str, cores: float):
        v2 = pathlib.Path("/sys/fs/cgroup/cgroup.controllers").exists()
        base = pathlib.Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu")
        self.path = base / name
        period = 20_000
        quota = max(1000, int(cores * period))
        try:
            self.path.mkdir(exist_ok=True)
            if v2:
                (self.path / "cpu.max").write_text(f"{quota} {period}\n")
            else:
                (self.path / "cpu.cfs_period_us").write_text(f"{period}\n")
                (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        except OSError as err:
            raise app.UsageError(
                f"cannot set a CPU quota in {self.path} ({err.strerror}): this benchmark needs "
                "root and the cgroup cpu controller"
            ) from None

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")  # the whole process, every thread

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its processes are still leaving


def _steps(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    return read_records(path) if os.path.exists(path) else []


def _run(workdir: str, slowed: bool, args: list[str], quota: CpuQuota | None) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "launch.py"),
        f"--processes={PROCESSES}",
        f"--workdir={workdir}",
        "--config=configs/lm_tiny.py",
        f"--config.batch={_BATCH.value}",
        f"--config.model.seq_len={_SEQ_LEN.value}",
        f"--steps={_STEPS.value}",
        f"--microbatches={_MICROBATCHES.value}",
        "--checkpoint_steps=1000",
        # The launcher's 2 s CPU collective timeout is for quick detection in tests;
        # a throttled worker lags its peers' collective by a few seconds a step.
        "--collective_timeout_s=60",
        *args,
    ]
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "launcher.err"), "w", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            if slowed:
                deadline = time.monotonic() + 600
                while not any(r.get("step", -1) >= 2 for r in _steps(workdir) if "loss" in r):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the job in {workdir} ended before step 2")
                    time.sleep(0.01)
                quota.add(worker_pid(workdir, VICTIM))
            proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the job in {workdir} failed with status {proc.returncode}")
    records = _steps(workdir)
    broken = [r["event"] for r in records if r.get("event") in ("relaunch", "process_failure")]
    if broken:
        raise RuntimeError(f"the job in {workdir} lost its workers ({broken}): no figure from it")
    last = {r["step"]: r for r in records if "loss" in r}
    late = [last[t] for t in sorted(last) if t >= _STEPS.value // 2]
    events = [r for r in records if r.get("event") == "straggler"]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in late),
        "max_load": statistics.median(r["max_load"] for r in late),
        "straggler_step": events[0]["step"] if events else None,
        "slow_group_load": events[-1]["walked_after"][VICTIM] if events else None,
    }


def main(argv: list[str]) -> None:
    del argv
    keep = cli.output_dir("out", _OUT.value) if _OUT.value else None
    if _SLOW.value <= 1:
        raise app.UsageError(f"--slow must be > 1, got {_SLOW.value}")
    base = keep or tempfile.mkdtemp(prefix="spare_stragglers_")
    cores = (os.cpu_count() or 1) / PROCESSES / _SLOW.value
    quota = CpuQuota(f"spare_jax_straggler_{os.getpid()}", cores)
    print(
        f"{PROCESSES} workers x 2 CPU devices on {os.cpu_count()} cores; worker {VICTIM} "
        f"slowed to {cores:.3f} cores (1/{_SLOW.value:g} of its share) from step 2; "
        f"m = {_MICROBATCHES.value}; {_STEPS.value} steps, figures over the second half; "
        f"medians of {_REPEATS.value}",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name, _, _ in CASES}
    try:
        for rep in range(_REPEATS.value):
            order = CASES[rep % len(CASES) :] + CASES[: rep % len(CASES)]
            for name, slowed, args in order:
                workdir = os.path.join(base, f"{name.split(',')[-1].strip()}-{rep}")
                row = _run(workdir, slowed, args, quota)
                results[name].append(row)
                print(f"  {name} #{rep}: {row}", flush=True)
    finally:
        quota.remove()
    free = statistics.median(r["step_s"] for r in results["failure-free"])
    print(f"\n{'case':>20} {'step s':>8} {'/ free':>7} {'max load':>9} {'straggler at':>13}")
    summary = {}
    for name, rows in results.items():
        step_s = statistics.median(r["step_s"] for r in rows)
        seen = [r["straggler_step"] for r in rows if r["straggler_step"] is not None]
        summary[name] = {
            "step_s": step_s,
            "over_free": step_s / free,
            "max_load": statistics.median(r["max_load"] for r in rows),
            "straggler_steps": seen,
            "runs": rows,
        }
        at = ",".join(map(str, seen)) or "-"
        print(
            f"{name:>20} {step_s:8.4f} {step_s / free:7.2f} "
            f"{summary[name]['max_load']:9.1f} {at:>13}"
        )
    free1 = summary["failure-free, m = 1"]["step_s"]
    m = _MICROBATCHES.value
    per_mb = (free - free1) / (m - 1)
    fixed = free1 - per_mb
    loads = [r["slow_group_load"] for r in results["slowed, balanced"] if r["slow_group_load"]]
    print(
        f"\nfixed part of a step F = {fixed:.4f} s, c = {per_mb:.4f} s per micro-batch "
        f"(movable: {m * per_mb / free:.0%} of the failure-free step)"
    )
    if loads:
        k = statistics.median(loads)
        max_load = summary["slowed, balanced"]["max_load"]
        # The waited-on step is the slow worker's whole step at m micro-batches: its real
        # slowdown, which the quota's nominal one understates (a worker's fair share is not
        # what it gets while its peers wait).
        waited = summary["slowed, waited on"]["over_free"]

        def step_over_free(slow: float, slow_load: float, others_load: float) -> float:
            return max(slow * (fixed + slow_load * per_mb), fixed + others_load * per_mb) / free

        bounds = {"nominal": _SLOW.value, "measured": waited}
        summary["bound"] = {"fixed_s": fixed, "per_microbatch_s": per_mb}
        for name, slow in bounds.items():
            bound = step_over_free(slow, k, max_load)
            summary["bound"][f"over_free_{name}"] = bound
            summary["bound"][f"slowdown_{name}"] = slow
            print(
                f"balanced bound at the slow group's {k:g} micro-batches and max load "
                f"{max_load:g}, a {name} slowdown of {slow:.2f}: {bound:.2f} x failure-free "
                f"(measured {summary['slowed, balanced']['over_free']:.2f})"
            )
        # Every table of the slow group's load k, the others sharing the rest evenly.
        others = [-(-(PROCESSES * m - j) // (PROCESSES - 1)) for j in range(m + 1)]
        by_k = [step_over_free(waited, j, others[j]) for j in range(m + 1)]
        best = min(range(m + 1), key=lambda j: (by_k[j], -j))  # at a tie, more on the slow group
        summary["bound"]["best"] = {"k": best, "max_load": others[best], "over_free": by_k[best]}
        print(
            f"best table at the measured slowdown: the slow group at {best} micro-batches, "
            f"the others at most {others[best]}: {by_k[best]:.2f} x failure-free"
        )
    if keep:
        with open(os.path.join(keep, "stragglers.json"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "slow": _SLOW.value, **summary}) + "\n")


if __name__ == "__main__":
    sys.exit(cli.run(main))

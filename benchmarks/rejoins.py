"""What a survivor holds across repeated re-joins, at several job sizes.

    python benchmarks/rejoins.py                            # 2, 4 and 8 processes, 3 re-joins
    python benchmarks/rejoins.py --processes=4 --rejoins=5 --out=runs/rejoins

A survivor drops its backend at every re-join and builds a new one (its CPU
collectives connect to every peer again). What the old one held must go with
it: a kept backend keeps its threads and its connections, one per peer, for the
job's life. Each job is ``experiments/regression.py`` under ``python -m
spare_jax.launch``: K workers of one CPU device each (one group each, r = 2),
``--replace_after_s=0``. Once the job runs, the driver SIGKILLs worker K/2,
and again after each re-join, ``--rejoins`` times; before the first
kill and 3 steps after each re-join it samples worker 0 (never signalled): its
open sockets (the coordination client's, and on CPU the collectives'
connections to its peers), its threads and its resident memory. Printed per
K: the samples, and their growth per re-join (a least-squares slope over the
samples after the re-joins; level is 0). The sockets are expected to grow
with K, not with the re-joins. On CPU a neighbour of a killed worker can abort
in Gloo, and the job relaunches (docs/multihost.md); such a job is run again,
three runs at most. ``--out`` keeps the jobs and appends the figures to
``rejoins.jsonl``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags
from jobs import worker_pid  # benchmarks/jobs.py: this script's directory is on sys.path

from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]

_PROCESSES = flags.DEFINE_list("processes", ["2", "4", "8"], "Job sizes K (2 or more each).")
_REJOINS = flags.DEFINE_integer("rejoins", 3, "Re-joins per job.", lower_bound=1, upper_bound=20)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_s", 5, "The launcher's heartbeat (a loaded 2-core host needs slack).", lower_bound=1
)
_OUT = flags.DEFINE_string("out", "", "Directory for the jobs and rejoins.jsonl (optional).")

AFTER = 3  # steps after a re-join before the sample: the first step on a new backend collects
WATCHED = 0
ATTEMPTS = 3


def sample(pid: int) -> dict[str, float]:
    """A process's open sockets, threads and resident memory (MB)."""
    fds = pathlib.Path(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds.iterdir():
        try:
            sockets += os.readlink(fd).startswith("socket:")
        except OSError:  # closed since the listing
            continue
    status = pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {
        "sockets": sockets,
        "threads": int(fields["Threads"]),
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,  # "<n> kB"
    }


def slope(values: list[float]) -> float:
    """Growth per re-join: a least-squares line's slope (0 with one value)."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(values)), values, 1)[0])


class _Job:
    """One launcher job of K workers, its records read from ``workdir``."""

    def __init__(self, workdir: pathlib.Path, processes: int):
        self.workdir, self.processes = workdir, processes
        cmd = [
            sys.executable,
            "-m",
            "spare_jax.launch",
            f"--processes={processes}",
            "--devices_per_process=1",
            f"--heartbeat_s={_HEARTBEAT.value}",
            f"--launch_dir={workdir / 'launch'}",
            "--replace_after_s=0",
            "--",
            sys.executable,
            str(ROOT / "experiments" / "regression.py"),
            f"--workdir={workdir}",
            f"--mesh=1,{processes},1",
            "--steps=100000",
            "--checkpoint_steps=100000",
        ]
        workdir.mkdir(parents=True)
        self._err = open(workdir / "launcher.err", "w", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self._err)

    def records(self) -> list[dict]:
        return read_records(str(self.workdir / "metrics.jsonl"))

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records() if r.get("event") == name]

    def step(self) -> int:
        return max((r["step"] for r in self.records() if "loss" in r), default=-1)

    def wait(self, ready, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended ({self.proc.returncode}) before {what}")
            if self.events("relaunch"):
                raise _Relaunched(what)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        """SIGTERM (the workers save and leave), then SIGKILL the launcher's group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in range(self.processes):  # none should be left; if one is, it goes
            try:
                os.kill(worker_pid(str(self.workdir), p), signal.SIGKILL)
            except (RuntimeError, ProcessLookupError):
                continue
        self._err.close()


class _Relaunched(RuntimeError):
    """A neighbour of the killed worker aborted in Gloo: the job relaunched."""


def one_job(workdir: pathlib.Path, processes: int) -> list[dict[str, float]]:
    """The watched worker's samples: before the first kill, then after each re-join."""
    job = _Job(workdir, processes)
    victim = processes // 2  # not a ring neighbour of worker 0 from 4 workers on
    try:
        job.wait(lambda: job.step() >= 5, "step 5", timeout=600)
        samples = [sample(worker_pid(str(workdir), WATCHED))]
        for n in range(1, _REJOINS.value + 1):
            os.kill(worker_pid(str(workdir), victim), signal.SIGKILL)
            job.wait(lambda n=n: len(job.events("rejoin")) >= n, f"re-join {n}")
            at = job.events("rejoin")[-1]["step"] + AFTER
            job.wait(lambda at=at: job.step() >= at, f"step {at}")
            samples.append(sample(worker_pid(str(workdir), WATCHED)))
        return samples
    finally:
        job.close()


def figures(processes: int, base: pathlib.Path) -> dict:
    for attempt in range(ATTEMPTS):
        try:
            samples = one_job(base / f"k{processes}-run{attempt}", processes)
        except _Relaunched as err:
            print(f"K={processes}: relaunched before {err} (a Gloo abort); again", flush=True)
            continue
        after = samples[1:]
        return {
            "processes": processes,
            "samples": samples,
            "per_rejoin": {k: round(slope([s[k] for s in after]), 3) for k in samples[0]},
        }
    raise RuntimeError(f"K={processes}: relaunched in every attempt")


def main(argv: list[str]) -> None:
    try:
        sizes = [int(k) for k in _PROCESSES.value]
    except ValueError:
        raise app.UsageError(f"--processes: whole numbers, got {_PROCESSES.value}") from None
    if not sizes or any(k < 2 for k in sizes):
        raise app.UsageError("--processes: 2 or more workers per job (r = 2)")
    keep = cli.output_dir("out", _OUT.value) if _OUT.value else tempfile.mkdtemp(prefix="rejoins-")
    base = pathlib.Path(keep) / time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for k in sizes:
        row = figures(k, base)
        rows.append(row)
        listed = {
            key: " ".join(
                f"{s[key]:g}" if key != "rss_mb" else f"{s[key]:.0f}" for s in row["samples"]
            )
            for key in ("sockets", "threads", "rss_mb")
        }
        per = row["per_rejoin"]
        print(
            f"K={k}: worker {WATCHED}, before the first kill then after each of "
            f"{_REJOINS.value} re-joins: sockets {listed['sockets']}, threads {listed['threads']}, "
            f"RSS MB {listed['rss_mb']}; per re-join: sockets {per['sockets']:+.2f}, "
            f"threads {per['threads']:+.2f}, RSS {per['rss_mb']:+.1f} MB",
            flush=True,
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        grew = last["samples"][0]["sockets"] - first["samples"][0]["sockets"]
        span = last["processes"] - first["processes"]
        print(f"sockets per added process (before any kill): {grew / span:.2f}")
    if _OUT.value:
        with open(os.path.join(_OUT.value, "rejoins.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"rejoins": _REJOINS.value, "rows": rows}) + "\n")
    else:
        print(f"jobs kept in {keep}")


if __name__ == "__main__":
    cli.run(main)

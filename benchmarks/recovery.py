"""Recovery from a real process failure: SPARe's survivors vs relaunching the job.

    python benchmarks/recovery.py                  # 3 repeats of each case (several minutes)
    python benchmarks/recovery.py --repeats=1 --steps=10

Every case is a real job of `experiments/launch.py` on this machine: 4 worker
processes of 2 CPU devices (one group each), the LM of `configs/lm_tiny.py`
(smoke size), a worker SIGKILLed in the middle of a step. Side by side, in one
run, medians over ``--repeats``:

* **SPARe, survivors continue** (r = 2, kill one process): from the kill to
  the first completed step after it, broken down into detection (kill to
  ``ProcessFailureError``), the new mesh (re-wrapping the state onto the
  survivors' devices), compilation (of the step on that mesh; 0 with
  ``--precompile_failures``) and the first step (the rest);
* the same with ``--precompile_failures``;
* **replication** (r = 2, kill one process): the same breakdown;
* **relaunch and restore**, what a job without SPARe does (kill two
  neighbours, so no live holder is left): from the survivors' exit to the new
  job's restored state, plus the work lost since the last checkpoint (steps
  times the median step time).

The figures come from the events the jobs write to ``metrics.jsonl``
(``process_failure``, ``recovered``, ``relaunch``). Work directories are
temporary unless ``--out`` names a directory to keep them and a JSON summary.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from absl import flags

from spare_jax import cli
from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs of each case.", lower_bound=1, upper_bound=50)
_STEPS = flags.DEFINE_integer(
    "steps", 12, "Training steps per run.", lower_bound=6, upper_bound=10**4
)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_s", 2, "Heartbeat timeout of the jobs (s).", lower_bound=2, upper_bound=60
)
_TIMEOUT = flags.DEFINE_integer(
    "collective_timeout_s", 2, "CPU collective timeout of the jobs (s).", lower_bound=1
)
_OUT = flags.DEFINE_string("out", "", "Directory for the runs and recovery.json (optional).")

CASES = (
    ("SPARe r=2, survivors continue", ["--strategy=spare", "--redundancy=2"], ["KILL:2"]),
    (
        "SPARe r=2, precompiled",
        ["--strategy=spare", "--redundancy=2", "--precompile_failures"],
        ["KILL:2"],
    ),
    (
        "replication r=2, survivors continue",
        ["--strategy=replication", "--redundancy=2"],
        ["KILL:2"],
    ),
    (
        "relaunch and restore (no live holder)",
        ["--strategy=spare", "--redundancy=2"],
        ["KILL:2", "KILL:3"],
    ),
)


def _run(workdir: str, args: list[str], kills: list[str], kill_step: int) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "launch.py"),
        "--processes=4",
        f"--workdir={workdir}",
        "--config=configs/lm_tiny.py:smoke",
        f"--steps={_STEPS.value}",
        f"--heartbeat_s={_HEARTBEAT.value}",
        f"--collective_timeout_s={_TIMEOUT.value}",
        *args,
        *(f"--kill={k.replace('KILL', str(kill_step))}" for k in kills),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"job failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return read_records(os.path.join(workdir, "metrics.jsonl"))


def _figures(records: list[dict], expect_relaunch: bool) -> dict[str, float]:
    """The recovery breakdown of one job, from its events.

    A relaunch where the survivors should have carried on means a live worker
    missed its heartbeats (a busy host) and was declared dead: a false alarm,
    counted apart.
    """
    events = {r["event"]: r for r in records if "event" in r}
    steps = [r["step_time_s"] + r.get("data_time_s", 0.0) for r in records if "loss" in r]
    median_step = statistics.median(steps[1:]) if len(steps) > 1 else float("nan")
    if "relaunch" in events and not expect_relaunch:
        return {"false_alarm": 1.0}
    if "relaunch" in events:
        relaunch = events["relaunch"]
        lost = relaunch["lost_steps"] * median_step
        return {
            "relaunch_s": relaunch["relaunch_s"],
            "lost_work_s": lost,
            "total_s": relaunch["relaunch_s"] + lost,
            "lost_steps": relaunch["lost_steps"],
        }
    failure, recovered = events["process_failure"], events["recovered"]
    first = recovered["first_step_s"]
    return {
        "detect_s": failure["detect_s"],
        "mesh_s": failure["rebuild_s"],
        "compile_s": failure["compile_s"],
        "first_step_s": first,
        "total_s": recovered["recovery_s"],
    }


def main(argv: list[str]) -> None:
    del argv
    keep = _OUT.value
    if keep:
        keep = cli.output_dir("out", keep)
    base = keep or tempfile.mkdtemp(prefix="spare_recovery_")
    kill_step = _STEPS.value // 2
    results: dict[str, list[dict]] = {}
    for case, (name, args, kills) in enumerate(CASES):
        for rep in range(_REPEATS.value):
            workdir = os.path.join(base, f"case{case}-run{rep}")
            figures = _figures(_run(workdir, args, kills, kill_step), len(kills) > 1)
            results.setdefault(name, []).append(figures)
            print(
                f"{name} #{rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()),
                flush=True,
            )
    print(
        f"\nmedians of {_REPEATS.value} runs; heartbeat {_HEARTBEAT.value} s, collective "
        f"timeout {_TIMEOUT.value} s; 4 processes x 2 CPU devices; kill at step {kill_step}"
    )
    columns = (
        "detect_s",
        "mesh_s",
        "compile_s",
        "first_step_s",
        "relaunch_s",
        "lost_work_s",
        "total_s",
    )
    print(f"{'case':<40}" + "".join(f"{c:>13}" for c in columns))
    medians = {}
    for name, all_runs in results.items():
        runs = [r for r in all_runs if "false_alarm" not in r]
        alarms = len(all_runs) - len(runs)
        med = {c: statistics.median(r[c] for r in runs) for c in columns if runs and c in runs[0]}
        medians[name] = {**med, "runs": len(runs), "false_alarms": alarms}
        note = f"  ({alarms} false alarm(s) left out)" if alarms else ""
        cells = "".join(f"{med[c]:>13.3f}" if c in med else f"{'':>13}" for c in columns)
        print(f"{name:<40}{cells}{note}")
    relaunch = medians[CASES[-1][0]].get("total_s", float("nan"))
    for name, _, _ in CASES[:2]:
        spare = medians[name].get("total_s", float("nan"))
        print(
            f"kill -> first completed step, {name}: {spare:.2f} s (target 3 s); relaunch and "
            f"restore plus lost work: {relaunch:.2f} s ({relaunch / spare:.1f}x)"
        )
    if keep:
        with open(os.path.join(keep, "recovery.json"), "w", encoding="utf-8") as f:
            json.dump({"runs": results, "medians": medians}, f, indent=2)


if __name__ == "__main__":
    cli.run(main)

"""Recovery from a real process failure: SPARe's survivors vs relaunching the job.

    python benchmarks/recovery.py                  # 3 repeats of each case (several minutes)
    python benchmarks/recovery.py --repeats=1 --steps=10
    python benchmarks/recovery.py --cases=rejoin    # the relaunch and the two re-joins alone

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
  times the median step time), and from the exit to the new job's first
  completed step (``to_first_step_s``: its programs loaded or compiled, as a
  replacement's are before its first step);
* **a hang**: worker 2 SIGSTOPped from outside (never resumed) instead of
  killed: detection is measured from the stop, the rest as for a kill;
* **a kill during recovery**: worker 1 killed by the injector, worker 3
  SIGKILLed from outside as soon as the survivors report the first loss;
  from that second kill to the first completed step (or to the relaunched
  job's restored state when the survivors could not rebuild without it);
* **re-join**: worker 2 SIGKILLed from outside with ``--replace_after_s=0``:
  the replacement's start to its first step in the running job
  (``join_s``; of it, ``start_s``: its own start, Python, the imports, the
  connect and the script's setup until ``fit`` asks to join, and
  ``admit_s``: waiting for the survivors' next step boundary), the
  survivors' pause for it, the state moved and its
  transfer time, beside the relaunch above; then the same with a warm spare
  (``--spares=1``: the replacement's place given to a process started with
  the job, its imports done; ``join_s`` from that hand-over);
* **preemption**: SIGTERM to the launcher in the middle of a run: from the
  notice to the end of the job (every worker saved the step reached and
  left), and the save itself.

``--worker=regression`` runs the same jobs with ``experiments/regression.py``
(a user's script through `spare_jax.fit`, 4 workers of 2 CPU devices) under
``python -m spare_jax.launch`` instead of the LM: the SPARe r = 2 cases, the
relaunch and the faults from outside (it has no replication or
``--precompile_failures`` flag), each job at least 200 steps long (its steps
take milliseconds), the faults at the same steps as the LM's.

``--neighbour_kills=N`` runs one study instead: N jobs of
``experiments/regression.py`` under ``python -m spare_jax.launch`` (4 workers
of 2 CPU devices, 40 steps), each with one worker SIGKILLed from outside at
step 20 (worker ``i % 4`` for the i-th), once per ``--neighbour_load``
level (that many busy-looping processes started beside the job; the
machine's own load average is printed with each run). On CPU a peer of the
killed worker sometimes aborts in Gloo ("Received data size doesn't match
expected size"), which turns a masked failure into a relaunch; the study
counts those jobs (from the worker logs) and prints the rate per level:

    python benchmarks/recovery.py --neighbour_kills=10 --neighbour_load=0,2

The figures come from the events the jobs write to ``metrics.jsonl``
(``process_failure``, ``recovered``, ``relaunch``, ``rejoin``, ``preempted``). Every job
goes through the library's path: ``experiments/launch.py`` runs
``python -m spare_jax.launch`` around ``experiments/train.py``, a client of
`spare_jax.fit`. Work directories are temporary unless ``--out`` names a
directory to keep them and a JSON summary.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
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
# The figures in docs/multihost.md were taken with one writer's replica checkpoints;
# sharded ones (the default) regroup their savers after a loss (docs/checkpointing.md).
REPLICA = "--nosharded_checkpoints"
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
_NEIGHBOUR_KILLS = flags.DEFINE_integer(
    "neighbour_kills",
    0,
    "Run only the neighbour-abort study: single kills per load level.",
    lower_bound=0,
    upper_bound=200,
)
_NEIGHBOUR_LOAD = flags.DEFINE_list(
    "neighbour_load", ["0"], "Busy-looping processes beside each job of the study, per level."
)
_WORKER = flags.DEFINE_enum(
    "worker",
    "lm",
    ["lm", "regression"],
    "The jobs' worker: the LM (experiments/launch.py around train.py) or "
    "experiments/regression.py under python -m spare_jax.launch (SPARe r = 2 cases only).",
)
_CASES = flags.DEFINE_enum(
    "cases",
    "all",
    ["all", "rejoin"],
    "The cases run: all, or rejoin (relaunch and restore and the two re-joins: their ratios).",
)
GLOO_MISMATCH = "Received data size doesn't match expected size"

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


def _cases() -> tuple[tuple[str, list[str], list[str]], ...]:
    """The kill cases the worker has: experiments/regression.py is SPARe r = 2 alone.

    ``--cases=rejoin``: the relaunch alone, what a re-join is measured against."""
    if _CASES.value == "rejoin":
        return CASES[-1:]
    if _WORKER.value == "lm":
        return CASES
    return tuple(c for c in CASES if c[1] == ["--strategy=spare", "--redundancy=2"])


def _command(workdir: str, args: list[str], kills: list[str], kill_step: int) -> list[str]:
    kill_flags = [f"--kill={k.replace('KILL', str(kill_step))}" for k in kills]
    if _WORKER.value == "regression":
        # Its steps take milliseconds: a run long enough for every fault to land in it.
        steps = [a for a in args if a.startswith("--steps=")] or [
            f"--steps={max(_STEPS.value, 200)}"
        ]
        return [
            *_launcher(workdir),
            *(a for a in args if a.startswith(("--replace_after_s=", "--spares="))),
            *kill_flags,
            "--",
            sys.executable,
            str(ROOT / "experiments" / "regression.py"),
            f"--workdir={workdir}",
            steps[-1],
            REPLICA,
        ]
    return [
        sys.executable,
        str(ROOT / "experiments" / "launch.py"),
        "--processes=4",
        f"--workdir={workdir}",
        "--config=configs/lm_tiny.py:smoke",
        f"--steps={_STEPS.value}",
        f"--heartbeat_s={_HEARTBEAT.value}",
        f"--collective_timeout_s={_TIMEOUT.value}",
        REPLICA,
        *args,
        *kill_flags,
    ]


def _launcher(workdir: str) -> list[str]:
    """``python -m spare_jax.launch`` with the jobs' shape, heartbeat and timeouts."""
    return [
        sys.executable,
        "-m",
        "spare_jax.launch",
        "--processes=4",
        "--devices_per_process=2",
        f"--heartbeat_s={_HEARTBEAT.value}",
        f"--collective_timeout_s={_TIMEOUT.value}",
        f"--launch_dir={os.path.join(workdir, 'launch')}",
    ]


def _run(workdir: str, args: list[str], kills: list[str], kill_step: int) -> list[dict]:
    cmd = _command(workdir, args, kills, kill_step)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"job failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return read_records(os.path.join(workdir, "metrics.jsonl"))


def _outside(
    workdir: str, args: list[str], kills: list[str], act, cmd: list[str] | None = None
) -> tuple[list[dict], dict]:
    """Run a job (``cmd``, else the LM's) in the background; ``act`` sends a fault from outside."""
    cmd = cmd or _command(workdir, args, kills, _STEPS.value // 2)
    os.makedirs(workdir, exist_ok=True)
    err_path = os.path.join(workdir, "launcher.err")
    with open(err_path, "w", encoding="utf-8") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            extra = act(proc, workdir, err_path)
            proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return read_records(os.path.join(workdir, "metrics.jsonl")), {**extra, "code": proc.returncode}


def _wait_for(proc, ready, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the job ended (or stalled) before the fault could be sent")
        time.sleep(0.005)


def _reached(workdir: str, step: int):
    path = os.path.join(workdir, "metrics.jsonl")
    return lambda: any(r.get("step", -1) >= step for r in read_records(path) if "loss" in r)


def _note_kill(workdir: str, process: int) -> None:
    """Leave the fault's time where the survivors look for it (detection is measured from it)."""
    with open(os.path.join(workdir, "launch", f"killed-{process}"), "w", encoding="utf-8") as f:
        f.write(f"{time.time()}\n")


def _hang(proc, workdir: str, err_path: str) -> dict:
    _wait_for(proc, _reached(workdir, _STEPS.value // 2))
    pid = worker_pid(workdir, 2)
    _note_kill(workdir, 2)
    os.kill(pid, signal.SIGSTOP)
    return {}


def _second_kill(proc, workdir: str, err_path: str) -> dict:
    _wait_for(proc, lambda: "declared dead" in pathlib.Path(err_path).read_text())
    try:
        pid = worker_pid(workdir, 3)
    except RuntimeError:  # a neighbour of worker 1 aborted in Gloo: the job relaunches
        return {"neighbour_abort": 1.0}
    _note_kill(workdir, 3)
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return {"second_kill_at": at}


def _preempt(proc, workdir: str, err_path: str) -> dict:
    _wait_for(proc, _reached(workdir, _STEPS.value // 2))
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    return {"notice_to_exit_s": time.monotonic() - start}


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
        back = events.get("relaunch_step", {})  # the new job's first step (its compile in it)
        return {
            "relaunch_s": relaunch["relaunch_s"],
            "lost_work_s": lost,
            "total_s": relaunch["relaunch_s"] + lost,
            "lost_steps": relaunch["lost_steps"],
            "to_first_step_s": back.get("since_exit_s", float("nan")),
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


def _rejoin_kill(proc, workdir: str, err_path: str) -> dict:
    _wait_for(proc, _reached(workdir, _STEPS.value // 2))
    pid = worker_pid(workdir, 2)
    _note_kill(workdir, 2)
    os.kill(pid, signal.SIGKILL)
    path = os.path.join(workdir, "metrics.jsonl")
    wanted = ("rejoin", "relaunch")  # a relaunch: a neighbour went too (a false alarm here)
    try:
        _wait_for(proc, lambda: any(r.get("event") in wanted for r in read_records(path)))
    except RuntimeError:
        return {}
    proc.send_signal(signal.SIGTERM)  # done: the rest of the run would measure nothing
    return {}


def _rejoin_figures(records: list[dict]) -> dict[str, float]:
    """A replaced worker's way back: from its start to its first step, and the survivors' pause.

    The pause is the longest step the survivors took around the re-join (they
    wait at the step boundary from the replacement's connect until it
    reaches its first membership check) beyond their median step.
    """
    rejoins = [r for r in records if r.get("event") == "rejoin" and "join_s" in r]
    if not rejoins:
        return {"false_alarm": 1.0}
    event = rejoins[0]
    steps = {
        r["step"]: r["step_time_s"] + r.get("data_time_s", 0.0) for r in records if "loss" in r
    }
    median_step = statistics.median(steps.values())
    around = [steps[t] for t in range(event["step"] - 2, event["step"] + 1) if t in steps]
    return {
        "join_s": event["join_s"],
        "start_s": event["start_s"],
        "admit_s": event["admit_s"],
        "transfer_s": event["transfer_s"],
        "compile_s": event["compile_s"],
        "survivors_pause_s": max(around) - median_step + event["transfer_s"],
        "bytes": float(event["bytes"]),
    }


def _gloo_aborted(workdir: str) -> list[int]:
    """Workers of the job whose log shows Gloo's collective mismatch."""
    logs = sorted(pathlib.Path(workdir, "launch").glob("worker-*.log"))
    return [
        int(p.stem.split("-")[1]) for p in logs if GLOO_MISMATCH in p.read_text(errors="replace")
    ]


NEIGHBOUR_STEPS = 40  # experiments/regression.py steps per job of the study; the kill at 20


def _regression_command(workdir: str) -> list[str]:
    """experiments/regression.py (a user's script, `spare_jax.fit`) under the launcher."""
    return [
        *_launcher(workdir),
        "--",
        sys.executable,
        str(ROOT / "experiments" / "regression.py"),
        f"--workdir={workdir}",
        f"--steps={NEIGHBOUR_STEPS}",
        "--checkpoint_steps=5",
        REPLICA,
    ]


def _single_kill(victim: int):
    """A fault sent from outside: worker ``victim`` SIGKILLed once the run is half done."""

    def act(proc, workdir: str, err_path: str) -> dict:
        _wait_for(proc, _reached(workdir, NEIGHBOUR_STEPS // 2))
        pid = worker_pid(workdir, victim)
        _note_kill(workdir, victim)
        os.kill(pid, signal.SIGKILL)
        return {"load_at_kill": os.getloadavg()[0]}

    return act


def _busy(count: int) -> list[subprocess.Popen]:
    """``count`` processes that spin on a core each (the study's extra load)."""
    loop = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]


def _neighbour_study(base: str) -> dict[str, dict]:
    """Single kills per load level: how often a peer of the killed worker aborts in Gloo."""
    out = {}
    for level in (int(x) for x in _NEIGHBOUR_LOAD.value):
        runs = []
        busy = _busy(level)
        try:
            for i in range(_NEIGHBOUR_KILLS.value):
                workdir = os.path.join(base, f"neighbour-load{level}-run{i}")
                victim = i % 4
                cmd = _regression_command(workdir)
                records, extra = _outside(workdir, [], [], _single_kill(victim), cmd)
                aborted = _gloo_aborted(workdir)
                events = {r["event"] for r in records if "event" in r}
                run = {
                    "victim": victim,
                    "gloo_aborted": aborted,
                    "relaunched": "relaunch" in events,
                    "masked": "recovered" in events and "relaunch" not in events,
                    "exit": extra["code"],
                    "load_at_kill": round(extra["load_at_kill"], 2),
                }
                runs.append(run)
                print(f"load {level} #{i}: " + ", ".join(f"{k} {v}" for k, v in run.items()))
        finally:
            for p in busy:
                p.kill()
                p.wait()
        aborts = sum(bool(r["gloo_aborted"]) for r in runs)
        loads = [r["load_at_kill"] for r in runs]
        out[f"load {level}"] = {
            "kills": len(runs),
            "neighbour_aborts": aborts,
            "relaunched": sum(r["relaunched"] for r in runs),
            "masked": sum(r["masked"] for r in runs),
            "median_load_at_kill": statistics.median(loads) if loads else float("nan"),
            "runs": runs,
        }
        print(
            f"{level} busy process(es): a neighbour aborted in Gloo after {aborts} of "
            f"{len(runs)} single kills; {out[f'load {level}']['masked']} masked, "
            f"{out[f'load {level}']['relaunched']} relaunched; median load average at the "
            f"kill {out[f'load {level}']['median_load_at_kill']:.1f} ({os.cpu_count()} cores)",
            flush=True,
        )
    return out


HANG = "SPARe r=2, a worker SIGSTOPped (hang)"
REJOIN = "SPARe r=2, a killed worker replaced (re-join)"
REJOIN_SPARE = "SPARe r=2, a killed worker's place taken by a warm spare (re-join, --spares=1)"
SPARE = ["--spares=1"]
SECOND = "SPARe r=2, a second kill during recovery"
PREEMPT = "preemption: SIGTERM to the launcher"


def _second_figures(records: list[dict], extra: dict) -> dict[str, float]:
    """Masked: the last `recovered` event, timed from the second kill (its time is on
    file). Not: the relaunch, from the survivors' exit to the restored state. No second
    kill sent (a neighbour of the first victim aborted in Gloo): counted apart."""
    if "neighbour_abort" in extra:
        return {"neighbour_abort": 1.0}
    relaunch = [r for r in records if r.get("event") == "relaunch"]
    recovered = [r for r in records if r.get("event") == "recovered"]
    total = relaunch[-1]["relaunch_s"] if relaunch else recovered[-1]["recovery_s"]
    return {"relaunched": float(bool(relaunch)), "total_s": float(total)}


def _outside_cases(base: str) -> dict[str, list[dict[str, float]]]:
    """The faults sent from outside: a hang, a kill during recovery, a preemption notice."""
    spare = ["--strategy=spare", "--redundancy=2"]
    out: dict[str, list[dict[str, float]]] = {}
    every = _CASES.value != "rejoin"
    for rep in range(_REPEATS.value):
        if every:
            records, _ = _outside(os.path.join(base, f"hang-run{rep}"), spare, [], _hang)
            out.setdefault(HANG, []).append(_figures(records, expect_relaunch=False))
            records, extra = _outside(
                os.path.join(base, f"second-run{rep}"), spare, ["KILL:1"], _second_kill
            )
            out.setdefault(SECOND, []).append(_second_figures(records, extra))
        for name, run, more in ((REJOIN, "rejoin", []), (REJOIN_SPARE, "rejoin-spare", SPARE)):
            records, _ = _outside(
                os.path.join(base, f"{run}-run{rep}"),
                [*spare, "--steps=400", "--replace_after_s=0", *more],
                [],
                _rejoin_kill,
            )
            out.setdefault(name, []).append(_rejoin_figures(records))
        if not every:
            continue
        records, extra = _outside(
            os.path.join(base, f"preempt-run{rep}"), [*spare, "--steps=400"], [], _preempt
        )
        saved = [r for r in records if r.get("event") == "preempted"]
        out.setdefault(PREEMPT, []).append(
            {
                "notice_to_exit_s": extra["notice_to_exit_s"],
                "save_s": saved[-1]["save_s"] if saved else float("nan"),
                "exit_143": float(extra["code"] == 143),
            }
        )
    return out


def main(argv: list[str]) -> None:
    del argv
    keep = _OUT.value
    if keep:
        keep = cli.output_dir("out", keep)
    base = keep or tempfile.mkdtemp(prefix="spare_recovery_")
    if _NEIGHBOUR_KILLS.value:
        if not all(x.isdigit() for x in _NEIGHBOUR_LOAD.value):
            raise app.UsageError(
                f"--neighbour_load must be counts >= 0, got {_NEIGHBOUR_LOAD.value}"
            )
        study = _neighbour_study(base)
        if keep:
            with open(os.path.join(keep, "neighbour_aborts.json"), "w", encoding="utf-8") as f:
                json.dump(study, f, indent=2)
        return
    kill_step = _STEPS.value // 2
    results: dict[str, list[dict]] = {}
    cases = _cases()
    for case, (name, args, kills) in enumerate(cases):
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
        f"timeout {_TIMEOUT.value} s; 4 processes x 2 CPU devices; kill at step {kill_step}; "
        f"worker: {_WORKER.value}"
    )
    columns = (
        "detect_s",
        "mesh_s",
        "compile_s",
        "first_step_s",
        "relaunch_s",
        "lost_work_s",
        "total_s",
        "to_first_step_s",
    )
    width = {c: max(13, len(c) + 2) for c in columns}
    print(f"{'case':<40}" + "".join(f"{c:>{width[c]}}" for c in columns))
    medians = {}
    for name, all_runs in results.items():
        runs = [r for r in all_runs if "false_alarm" not in r]
        alarms = len(all_runs) - len(runs)
        med = {c: statistics.median(r[c] for r in runs) for c in columns if runs and c in runs[0]}
        medians[name] = {**med, "runs": len(runs), "false_alarms": alarms}
        note = f"  ({alarms} false alarm(s) left out)" if alarms else ""
        cells = "".join(
            f"{med[c]:>{width[c]}.3f}" if c in med else f"{'':>{width[c]}}" for c in columns
        )
        print(f"{name:<40}{cells}{note}")
    outside = _outside_cases(base)
    for name, rows in outside.items():
        print(
            f"{name}: " + "; ".join(", ".join(f"{k} {v:.3f}" for k, v in r.items()) for r in rows)
        )
    for name, rows in outside.items():
        apart = ("false_alarm", "neighbour_abort")
        kept = [r for r in rows if not any(a in r for a in apart)]
        keys = sorted({k for r in kept for k in r})
        figures = {k: statistics.median(r[k] for r in kept if k in r) for k in keys}
        figures.update(
            {a: float(sum(a in r for r in rows)) for a in apart if any(a in r for r in rows)}
        )
        medians[name] = figures
        print(f"{name:<40}" + "".join(f"  {k} {v:.3f}" for k, v in figures.items()))
    hang, kill = medians.get(HANG, {}), medians[cases[0][0]]
    if "detect_s" in hang and "detect_s" in kill:
        print(
            f"detection, hang vs kill: {hang['detect_s']:.2f} s vs {kill['detect_s']:.2f} s "
            f"(heartbeat {_HEARTBEAT.value} s)"
        )
    relaunch = medians[cases[-1][0]].get("total_s", float("nan"))
    # the relaunched job's first step: the like of a replacement's (both load their programs)
    stepped = medians[cases[-1][0]].get("to_first_step_s", float("nan"))
    for name, how in ((REJOIN, "a new process"), (REJOIN_SPARE, "a warm spare")):
        back = medians.get(name, {})
        if "join_s" in back:
            print(
                f"a dead worker back in the job, {how}: re-join {back['join_s']:.2f} s from the "
                f"replacement's start to its first step (its own start {back['start_s']:.2f} s, "
                f"waiting to be taken in {back['admit_s']:.2f} s; survivors paused "
                f"{back['survivors_pause_s']:.2f} s, state {back['bytes']:.0f} bytes in "
                f"{back['transfer_s']:.2f} s) vs relaunch and restore {relaunch:.2f} s "
                f"({back['join_s'] / relaunch:.2f}x) and the relaunched job's exit to its "
                f"first step {stepped:.2f} s ({back['join_s'] / stepped:.2f}x)"
            )
    for name, _, _ in cases[:-1][:2]:
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

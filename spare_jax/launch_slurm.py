"""What the launcher says to SLURM and reads back: its srun step, srun's report, its cancel.

An attempt under ``--scheduler=slurm`` is one named ``srun`` step inside the
job's allocation. Its end signals that step alone: SLURM takes a SIGKILL sent
to the job itself as the job's cancellation, which would revoke the allocation
that the next attempt must run in.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

from spare_jax.launch_worker import Options, say

# srun's own report of tasks that did not exit 0 (a range when several did the same)
_SRUN_TASK = re.compile(r"srun: error: \S+: tasks? ([\d,\-]+): (.*)$")
_SRUN_SIGNALS = {"Killed": -9, "Terminated": -15, "Aborted": -6, "Segmentation fault": -11}


def command(tasks: int, options: Options, name: str) -> list[str]:
    """One srun step of ``tasks`` workers, named ``name``, that goes on when one of them dies."""
    return [
        "srun",
        f"--ntasks={tasks}",
        "--kill-on-bad-exit=0",
        "--label",
        "--unbuffered",
        "--export=ALL",
        *options.srun_args,
        f"--job-name={name}",  # last: a --job-name among srun_args must not hide the step
    ]


def replacement(options: Options, name: str) -> list[str]:
    """A step of one task that replaces a dead one, named like the attempt's step.

    A running step cannot gain a task, so the replacement is a step of its
    own in the allocation, sharing its resources (``--overlap``). Its name is
    the attempt's: ending the attempt cancels it with the rest.
    """
    return [
        "srun",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--export=ALL",
        *options.srun_args,
        "--ntasks=1",  # after the user's srun arguments: one task, whatever they said
        "--nodes=1",
        "--overlap",
        f"--job-name={name}",
    ]


def task_report(line: str) -> tuple[list[int], int] | None:
    """The tasks and their status (a signal as its negative) in one line of srun's report."""
    report = _SRUN_TASK.search(line.strip())
    if report is None:
        return None
    status = report.group(2)
    exited = re.match(r"Exited with exit code (\d+)", status)
    code = int(exited.group(1)) if exited else _SRUN_SIGNALS.get(status, -9)
    tasks = []
    for part in report.group(1).split(","):
        lo, _, hi = part.partition("-")
        tasks.extend(range(int(lo), int(hi or lo) + 1))
    return tasks, code


def steps_named(name: str) -> list[str]:
    """The ids (``JOB.STEP``) of this allocation's steps called ``name``."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return []
    try:
        out = subprocess.run(
            ["squeue", "--steps", f"--jobs={job}", "--noheader", "--format=%i %j"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        say(f"squeue failed ({err}): this attempt's step is left to srun's own end")
        return []
    rows = (line.split() for line in out.stdout.splitlines())
    return [r[0] for r in rows if len(r) == 2 and r[1] == name and r[0].startswith(f"{job}.")]


def cancel(name: str) -> None:
    """SIGKILL every task of the step ``name``, wherever it runs; the job goes on."""
    for step in steps_named(name):
        subprocess.run(
            ["scancel", "--signal=KILL", step], capture_output=True, timeout=30, check=False
        )


def coordinator_host() -> str:
    """Where the tasks reach this launcher: localhost when the allocation is this node alone."""
    nodes = os.environ.get("SLURM_JOB_NODELIST", "")
    me = socket.gethostname()
    return "localhost" if nodes in ("", me, me.split(".")[0]) else me

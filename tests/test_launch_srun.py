"""The launcher's srun step, against stand-in ``srun``, ``squeue`` and ``scancel`` on PATH.

srun names only the tasks that did not exit 0. When its report of a task is
lost (srun killed, a line garbled), a failed step must not pass for a complete
one: a task counts as having exited 0 only when it said it finished. And the
end of an attempt kills its own step, never the job: SLURM takes a SIGKILL sent
to a job as its cancellation, which revokes the allocation the next attempt
needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import launching as lj

# Runs --ntasks copies of the command, each line labelled "i: " and each in its own
# process group (kept in $FAKE_SLURM/tasks), as step 1.1 named by --job-name; exits
# with FAKE_SRUN_STATUS without srun's usual report of the tasks that failed.
FAKE_SRUN = """#!/usr/bin/env bash
set -m
n=1
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) n=${1#--ntasks=}; shift ;;
    --job-name=*) echo "1.1 ${1#--job-name=}" >> "$FAKE_SLURM/steps"; shift ;;
    --*) shift ;;
    *) break ;;
  esac
done
for ((i = 0; i < n; i++)); do
  (SLURM_PROCID=$i "$@" 2>&1 | sed -u "s/^/$i: /") &
  echo $! >> "$FAKE_SLURM/tasks"
done
wait
exit "${FAKE_SRUN_STATUS:-1}"
"""

# Lists a step of another launcher (1.0) and the steps srun started.
FAKE_SQUEUE = """#!/bin/sh
echo "1.0 someone-else"
cat "$FAKE_SLURM/steps" 2>/dev/null
"""

# Keeps its arguments; a KILL for step 1.1 kills that step's tasks.
FAKE_SCANCEL = """#!/bin/sh
echo "$*" >> "$FAKE_SLURM/scancel"
if [ "$*" = "--signal=KILL 1.1" ]; then
  for pgid in $(cat "$FAKE_SLURM/tasks"); do kill -KILL "-$pgid" 2>/dev/null; done
fi
exit 0
"""

# A worker that says it finished (as `spare_jax.fit` does) when WORKER_SAYS is set,
# and stays WORKER_SLEEPS seconds, silent (its pid kept in $FAKE_SLURM/worker-<i>).
WORKER = (
    "import os, time\n"
    "if os.environ.get('WORKER_SAYS'):\n"
    "    print('spare-jax-event: ' + os.environ['WORKER_SAYS'], flush=True)\n"
    "with open(os.path.join(os.environ['FAKE_SLURM'], 'worker-' + os.environ['SLURM_PROCID']),"
    " 'w') as f:\n"
    "    f.write(str(os.getpid()))\n"
    "time.sleep(float(os.environ.get('WORKER_SLEEPS', '0')))\n"
)


def _launch(tmp_path, *flags, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in [("srun", FAKE_SRUN), ("squeue", FAKE_SQUEUE), ("scancel", FAKE_SCANCEL)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    state = tmp_path / "slurm"
    state.mkdir(exist_ok=True)
    run_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "",
        "JAX_PLATFORMS": "cpu",
        "FAKE_SLURM": str(state),
        **env,
    }
    command = [
        sys.executable,
        "-m",
        "spare_jax.launch",
        "--processes=2",
        "--scheduler=slurm",
        "--max_relaunches=0",
        f"--launch_dir={tmp_path / 'launch'}",
        *flags,
        "--",
        sys.executable,
        "-c",
        WORKER,
    ]
    return subprocess.run(
        command, cwd=lj.ROOT, env=run_env, capture_output=True, text=True, timeout=120, check=False
    )


def test_a_failed_step_whose_report_is_lost_is_not_a_complete_job(tmp_path):
    out = _launch(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "srun did not report worker 0's exit status" in text, text


def test_tasks_that_said_they_finished_complete_the_job_though_srun_failed(tmp_path):
    out = _launch(tmp_path, WORKER_SAYS='{"kind": "finished", "step": 3}')
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_task_that_said_its_exit_status_is_taken_at_its_word(tmp_path):
    """Both say they exit 75 (a fresh job rolls back): a relaunch, which --max_relaunches=0
    refuses; never a complete job."""
    out = _launch(tmp_path, WORKER_SAYS='{"kind": "exit", "status": 75}')
    text = out.stdout + out.stderr
    assert out.returncode == 3 and "gave up after 0 relaunches" in text, text
    assert "srun did not report" not in text, text


def test_the_end_of_an_attempt_kills_its_own_step_never_the_job(tmp_path):
    """Silent workers: the job counts as hung, and the launcher ends the attempt while
    srun still runs. It signals step 1.1 (its own, found by name), not job 1."""
    out = _launch(tmp_path, "--hang_timeout_s=2", WORKER_SLEEPS="60")
    text = out.stdout + out.stderr
    assert "counts as hung" in text, text
    pids = [int((tmp_path / "slurm" / f"worker-{i}").read_text()) for i in range(2)]
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    calls = (tmp_path / "slurm" / "scancel").read_text().splitlines()
    assert calls == ["--signal=KILL 1.1"], calls
    assert not left, f"workers {left} outlived their step"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

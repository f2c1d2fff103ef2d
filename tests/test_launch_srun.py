"""The launcher's reading of an srun step, against a stand-in ``srun`` on PATH.

srun names only the tasks that did not exit 0. When its report of a task is
lost (srun killed, a line garbled), a failed step must not pass for a complete
one: a task counts as having exited 0 only when it said it finished.
"""

from __future__ import annotations

import os
import subprocess
import sys

import launching as lj

# Runs --ntasks copies of the command, each line labelled "i: ", and exits with
# FAKE_SRUN_STATUS without srun's usual report of the tasks that failed.
FAKE_SRUN = """#!/usr/bin/env bash
n=1
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) n=${1#--ntasks=}; shift ;;
    --*) shift ;;
    *) break ;;
  esac
done
for ((i = 0; i < n; i++)); do
  (SLURM_PROCID=$i "$@" 2>&1 | sed -u "s/^/$i: /") &
done
wait
exit "${FAKE_SRUN_STATUS:-1}"
"""

# A worker that says it finished (as `spare_jax.fit` does) when WORKER_SAYS is set.
WORKER = (
    "import os\n"
    "if os.environ.get('WORKER_SAYS'):\n"
    "    print('spare-jax-event: ' + os.environ['WORKER_SAYS'], flush=True)\n"
)


def _launch(tmp_path, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    scancel = bin_dir / "scancel"  # the launcher cancels its steps at the end: touch no real job
    scancel.write_text("#!/bin/sh\nexit 0\n")
    scancel.chmod(0o755)
    run_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "",
        "JAX_PLATFORMS": "cpu",
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

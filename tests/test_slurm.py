"""The launcher under a real SLURM: one ``srun`` step of 4 tasks inside ``salloc -n 4``.

CI starts a one-node cluster with ``.ci/slurm.sh`` before the slow tests;
elsewhere these tests are skipped with one line. The worker is the user
script ``experiments/regression.py`` through `spare_jax.fit`; tasks are
SIGKILLed from outside by pid (found through ``/proc``), as a node failure
would take them. Checked: the exit status, ``metrics.jsonl``, every leaf of
every surviving task's parameters against a single-device `jax.grad` run, an
empty queue and no process left afterwards.
"""

from __future__ import annotations

import shutil
import signal
import subprocess

import launching as lj
import pytest

STEPS = 30


def _cluster() -> str:
    """Why there is no usable SLURM here, or '' when there is one."""
    if shutil.which("salloc") is None or shutil.which("sinfo") is None:
        return "no SLURM client here (CI starts a one-node cluster with .ci/slurm.sh)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=20, check=False
        )
    except subprocess.TimeoutExpired:
        return "sinfo timed out: no SLURM controller answers"
    if out.returncode != 0 or "idle" not in out.stdout and "mix" not in out.stdout:
        return f"no idle SLURM node ({(out.stderr or out.stdout).strip()[:120]})"
    return ""


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_cluster()), reason=_cluster() or "-")]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return lj.env(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def reference():
    return lj.reference_params(STEPS)


def _start(env, workdir) -> lj.Job:
    worker = lj.regression_command(workdir, f"--steps={STEPS}", "--checkpoint_steps=5")
    launcher = lj.launcher(workdir, worker, "--scheduler=slurm")
    return lj.Job(["timeout", "-k", "10", "600", "salloc", "-n", "4", *launcher], workdir, env)


def _queue_empty() -> bool:
    out = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=20, check=False)
    return out.stdout.strip() == ""


def _kill(env, tmp_path, victims):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        for victim in victims:
            job.signal(victim, signal.SIGKILL)
        code = job.finish()
    finally:
        job.close()
    return job, code


@pytest.mark.parametrize("victim", [2, 0], ids=["task 2", "task 0"])
def test_a_task_killed_from_outside_is_masked(env, tmp_path, reference, victim):
    job, code = _kill(env, tmp_path, [victim])
    assert code == 0, job.output()[-3000:]
    lj.assert_masked(tmp_path, reference, [victim], STEPS)
    assert _queue_empty()
    lj.no_process_left(tmp_path)


def test_two_neighbour_tasks_killed_start_a_new_step_that_rolls_back(env, tmp_path, reference):
    job, code = _kill(env, tmp_path, [2, 3])
    assert code == 0, job.output()[-3000:]
    relaunches = lj.events(tmp_path, "relaunch")
    assert len(relaunches) == 1, (
        f"{relaunches}\n{[r for r in lj.records(tmp_path) if 'event' in r]}\n"
        f"{job.output()[-3000:]}\n{job.worker_logs()}"
    )
    (relaunch,) = relaunches
    assert relaunch["rolled_back"] and relaunch["to_step"] % 5 == 0
    lj.assert_params(tmp_path, reference, range(4))  # the new step runs all four again
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    assert _queue_empty()
    lj.no_process_left(tmp_path)


def test_the_sbatch_script_runs_the_job_and_survives_a_killed_task(env, tmp_path, reference):
    """experiments/slurm.sbatch as a user submits it (one node here), a task killed from outside."""
    worker = lj.regression_command(tmp_path, f"--steps={STEPS}", "--checkpoint_steps=5")
    submit = [
        "timeout",
        "-k",
        "10",
        "600",
        "sbatch",
        "--wait",
        "--nodes=1",
        "--ntasks-per-node=4",
        f"--output={tmp_path / 'slurm.out'}",
        str(lj.ROOT / "experiments" / "slurm.sbatch"),
        *worker,
    ]
    batch_env = {
        **env,
        "SPARE_JAX_PYTHON": lj.PYTHON,
        "SPARE_JAX_DEVICES_PER_PROCESS": "2",
        "SPARE_JAX_HEARTBEAT_S": "5",
        "SPARE_JAX_COLLECTIVE_TIMEOUT_S": "2",
        "SPARE_JAX_LAUNCH_DIR": str(tmp_path / "launch"),
    }
    job = lj.Job(submit, tmp_path, batch_env)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(1, signal.SIGKILL)
        code = job.finish()
    finally:
        job.close()
    assert code == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    lj.assert_masked(tmp_path, reference, [1], STEPS)
    assert _queue_empty()
    lj.no_process_left(tmp_path)


# Silent in its first attempt (the launcher counts the job as hung and ends the attempt
# while srun still runs); done at once in the next.
_HANGS_ONCE = (
    "import os, pathlib, time\n"
    "mark = pathlib.Path(os.environ['HANG_MARK'] + os.environ['SLURM_PROCID'])\n"
    "if not mark.exists():\n"
    "    mark.touch()\n"
    "    time.sleep(120)\n"
)


def test_an_attempt_ended_by_the_launcher_leaves_the_allocation_to_the_next(env, tmp_path):
    """The launcher ends a hung attempt by killing its own srun step: the job's allocation
    stays, and the relaunch runs in it (SLURM cancels a job sent SIGKILL)."""
    launcher = lj.launcher(
        tmp_path,
        [lj.PYTHON, "-c", _HANGS_ONCE],
        "--scheduler=slurm",
        "--hang_timeout_s=3",
        "--max_relaunches=1",
    )
    job = lj.Job(
        ["timeout", "-k", "10", "300", "salloc", "-n", "4", *launcher],
        tmp_path,
        {**env, "HANG_MARK": str(tmp_path / "hung-")},
    )
    code = job.finish(timeout=240)
    out = job.output()
    assert "counts as hung" in out and "relaunch 1" in out, out[-3000:]
    assert code == 0, out[-3000:]
    # salloc may say "revoked" after it relinquishes the allocation at the end: not before
    assert "revoked" not in out.split("salloc: Relinquishing")[0], out[-3000:]
    assert _queue_empty()
    lj.no_process_left(tmp_path)


REJOIN_STEPS = 600  # long enough for a replacement to start, import JAX and join on 2 busy cores


def test_a_killed_task_is_replaced_by_a_step_of_its_own_and_rejoins_exactly(env, tmp_path):
    """``--replace_after_s`` under SLURM: the replacement is a one-task srun step in the
    allocation, which joins the running job with a live peer's state; no relaunch."""
    reference = lj.reference_params(REJOIN_STEPS)
    worker = lj.regression_command(tmp_path, f"--steps={REJOIN_STEPS}", "--checkpoint_steps=50")
    launcher = lj.launcher(tmp_path, worker, "--scheduler=slurm", "--replace_after_s=0.5")
    job = lj.Job(["timeout", "-k", "10", "600", "salloc", "-n", "4", *launcher], tmp_path, env)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(2, signal.SIGKILL)
        job.wait_for(
            lambda: lj.events(tmp_path, "rejoin") or lj.gloo_aborted(tmp_path), what="a re-join"
        )
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    if lj.gloo_aborted(tmp_path):  # a neighbour aborted in Gloo (docs/multihost.md): a relaunch
        assert lj.events(tmp_path, "relaunch"), job.output()[-3000:]
        lj.assert_params(tmp_path, reference, range(4))
    else:
        (back,) = lj.events(tmp_path, "rejoin")
        assert back["process"] == [2] and back["move_s"] > 0, back
        for name in ("relaunch", "rollback", "resume"):
            assert not lj.events(tmp_path, name), (name, job.output()[-3000:])
        steps = [r for r in lj.records(tmp_path) if "loss" in r]
        assert [r["step"] for r in steps] == list(range(REJOIN_STEPS)), "no step repeated"
        assert steps[-1]["live_groups"] == 4, "every group live at the end"
        lj.assert_params(tmp_path, reference, range(4))  # the replacement's included
        assert "starting a replacement for worker 2" in job.output()
    assert _queue_empty()
    lj.no_process_left(tmp_path)

"""The batch contract under ``python -m spare_jax.launch``: processes that feed different rows.

``tests/own_rows_worker.py`` is a user script whose loader fills only its own
process's rows of the global batch. Every shard's two holders are on two
processes, so their copies differ: the job must stop at step 0 with one line
naming the step and the processes, a non-zero status (`errors.BatchMismatch`),
no step recorded and no checkpoint written. Without the check the job trains
on and exits 0.
"""

from __future__ import annotations

import launching as lj
import pytest

from spare_jax import errors

pytestmark = pytest.mark.slow

WORKER = str(lj.ROOT / "tests" / "own_rows_worker.py")


def test_processes_feeding_different_rows_stop_the_job_before_any_update(tmp_path_factory):
    env = lj.env(tmp_path_factory.mktemp("jax_cache"))
    workdir = tmp_path_factory.mktemp("run")
    worker = [lj.PYTHON, WORKER, f"--workdir={workdir}", "--steps=20", "--checkpoint_steps=1"]
    job = lj.Job(lj.launcher(workdir, worker, "--max_relaunches=1"), workdir, env)
    try:
        code = job.finish(timeout=240)
    finally:
        job.close()
    out = job.output()
    assert code == errors.EXIT_BATCH_MISMATCH, out[-3000:] + job.worker_logs()
    lines = [line for line in out.splitlines() if "batch differs" in line]
    assert len(lines) == 1, out[-3000:]
    assert "step 0: the batch differs across processes [0, 1, 2, 3]" in lines[0], lines[0]
    assert not [r for r in lj.records(workdir) if "loss" in r]  # no step ran
    ckpts = workdir / "checkpoints"
    assert not ckpts.exists() or not [p for p in ckpts.iterdir() if p.name.isdigit()]
    assert not lj.events(workdir, "relaunch")  # a verdict, not a relaunch
    lj.no_process_left(workdir)


def test_rows_that_go_wrong_later_are_caught_at_the_first_step_after_a_recovery(
    tmp_path_factory,
):
    # Right until step 3; the survivors of the kill at step 6 would compute the dead
    # group's shard from their own (zero) copies: the check after the recovery stops it.
    env = lj.env(tmp_path_factory.mktemp("jax_cache"))
    workdir = tmp_path_factory.mktemp("run")
    worker = [
        lj.PYTHON,
        WORKER,
        f"--workdir={workdir}",
        "--steps=20",
        "--checkpoint_steps=2",
        "--own_rows_from=3",
    ]
    job = lj.Job(lj.launcher(workdir, worker, "--kill=6:2", "--max_relaunches=1"), workdir, env)
    try:
        code = job.finish(timeout=300)
    finally:
        job.close()
    out = job.output()
    assert code == errors.EXIT_BATCH_MISMATCH, out[-3000:] + job.worker_logs()
    lines = [line for line in out.splitlines() if "batch differs" in line]
    assert len(lines) == 1, out[-3000:]
    steps = sorted({r["step"] for r in lj.records(workdir) if "loss" in r})
    if lj.gloo_aborted(workdir):  # a neighbour died too (CPU only): the relaunched job's check
        (resume,) = lj.events(workdir, "resume")
        assert f"step {resume['step']}: the batch differs across processes [0, 1, 2, 3]" in lines[0]
    else:
        (failure,) = lj.events(workdir, "process_failure")
        assert failure["process"] == [2] and failure["step"] == 6
        assert "step 6: the batch differs across processes [0, 1, 3]" in lines[0], lines[0]
        assert steps == list(range(6)), steps  # step 6 never ran on the wrong rows
    ckpts = workdir / "checkpoints"
    assert max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) <= 6
    lj.no_process_left(workdir)

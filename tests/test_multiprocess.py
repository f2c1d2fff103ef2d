"""Real process failures under ``python -m spare_jax.launch``, sent from outside the workers.

A user script that is not our LM (``experiments/regression.py``: plain dict
parameters, `spare_jax.fit`) runs as 4 worker processes of 2 CPU devices (one
group each, r = 2). The tests signal worker pids found through ``/proc`` and
damage files on disk, as a cluster does; none goes through the fault
injector. After each: the job's exit status, what ``metrics.jsonl`` says, every
leaf of every surviving worker's final parameters against a single-device
`jax.grad` + optax run over the same batches (rtol 1e-5, atol 1e-6), and no
process left behind.

Slow (each test is one or two multi-process jobs, 20-60 s on 2 cores), run
by CI after the README's test command.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import launching as lj
import pytest

from spare_jax import checkpoint

pytestmark = pytest.mark.slow

STEPS = 30
# One writer's whole replica per checkpoint (the default is sharded: every process its part).
REPLICA = "--nosharded_checkpoints"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return lj.env(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def reference():
    return lj.reference_params(STEPS)


def _start(
    env,
    workdir: pathlib.Path,
    *args: str,
    steps: int = STEPS,
    log: pathlib.Path | None = None,
    launcher_flags: tuple[str, ...] = (),
) -> lj.Job:
    worker = lj.regression_command(workdir, f"--steps={steps}", "--checkpoint_steps=5", *args)
    return lj.Job(lj.launcher(workdir, worker, *launcher_flags), workdir, env, log=log)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGABRT], ids=["SIGKILL", "SIGABRT"])
def test_a_worker_killed_from_outside_is_masked_and_the_run_completes(
    env, tmp_path, reference, sig
):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(2, sig)
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    if lj.assert_masked(tmp_path, reference, [2], STEPS):
        (failure,) = lj.events(tmp_path, "process_failure")
        assert failure["groups"] == [2] and 0 < failure["detect_s"] < 60
        summary = lj.summary(tmp_path)
        assert summary["lost_processes"] == [2] and summary["attempts"] == 1
        assert summary["live_groups"] == 3 and summary["live_group_ids"] == [0, 1, 3]
        assert job.output().count("declared dead") == 1  # relayed by the launcher, once
    lj.no_process_left(tmp_path)


def test_the_writer_killed_during_a_save_leaves_only_whole_checkpoints(env, tmp_path, reference):
    ckpts = tmp_path / "checkpoints"
    job = _start(env, tmp_path, "--checkpoint_steps=2", REPLICA)
    try:

        def saving() -> bool:
            in_flight = ckpts.is_dir() and any(p.name.endswith("-tmp") for p in ckpts.iterdir())
            return in_flight and job.step_reached(6)()

        job.wait_for(saving, what="a save in flight after step 6")
        job.signal(0, signal.SIGKILL)  # process 0 writes the checkpoints
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    aborted = lj.gloo_aborted(tmp_path)
    if aborted:  # a neighbour of the dead process 0 died with it (Gloo, on CPU): a relaunch
        assert aborted == [1] and lj.events(tmp_path, "relaunch")
    else:
        assert not lj.events(tmp_path, "relaunch")
        (failure,) = lj.events(tmp_path, "process_failure")
        assert failure["process"] == [0]
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert steps[-1] == STEPS and len(steps) == 3, steps  # keep=3, all written by process 1
    for step in steps:
        assert checkpoint.missing_files(str(ckpts / str(step))) is None, step
    assert not (ckpts / "corrupt").exists()
    saved = [e["step"] for e in lj.events(tmp_path, "checkpoint")]
    assert saved[-1] == STEPS
    if not aborted:
        assert len(saved) == len(set(saved))
    lj.assert_params(tmp_path, reference, range(4) if aborted else [1, 2, 3])
    lj.assert_resumes_alone(tmp_path, env, reference, STEPS)  # the newest checkpoint restores
    lj.no_process_left(tmp_path)


def test_a_stopped_worker_is_declared_dead_killed_and_the_run_completes(env, tmp_path, reference):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        stopped = job.signal(1, signal.SIGSTOP)  # a hung host: never resumed
        start = time.monotonic()
        code = job.finish(timeout=240)
        took = time.monotonic() - start
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    assert took < 60, f"{took:.0f} s from the stop to the end of the job"
    assert not pathlib.Path(f"/proc/{stopped}").exists(), (
        "the launcher kills a worker declared dead"
    )
    if lj.assert_masked(tmp_path, reference, [1], STEPS):
        (failure,) = lj.events(tmp_path, "process_failure")
        assert failure["detect_s"] < 30
    lj.no_process_left(tmp_path)


@pytest.mark.parametrize(
    ("victims", "masked"), [((1, 3), True), ((2, 3), False)], ids=["apart", "neighbours"]
)
def test_two_kills_close_together(env, tmp_path, reference, victims, masked):
    """0.3 s apart: groups 1 and 3 leave every shard a holder; 2 and 3 take shard 3's both."""
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(victims[0], signal.SIGKILL)
        time.sleep(0.3)
        if victims[1] not in lj.gloo_aborted(tmp_path):  # CPU: it may abort with its neighbour
            job.signal(victims[1], signal.SIGKILL)
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    if masked:
        lj.assert_masked(tmp_path, reference, victims, STEPS)
    else:
        (relaunch,) = lj.events(tmp_path, "relaunch")
        assert relaunch["rolled_back"] and relaunch["to_step"] % 5 == 0
        (back,) = lj.events(tmp_path, "relaunch_step")  # the new job's first step, after it
        assert back["step"] == relaunch["to_step"], (back, relaunch)
        assert back["since_exit_s"] > relaunch["relaunch_s"] and back["first_step_s"] > 0
        assert lj.summary(tmp_path)["attempts"] == 2
        lj.assert_params(tmp_path, reference, range(4))  # a fresh job: every worker is back
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    lj.no_process_left(tmp_path)


def test_two_losses_apart_recompile_only_the_cross_program(env, tmp_path, reference):
    """The step split by failure domain: each loss compiles the small cross-group sum, never
    a survivor's gradient or update program (the records' compile count grows by one)."""
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(1, signal.SIGKILL)
        job.wait_for(
            lambda: lj.events(tmp_path, "recovered") or lj.gloo_aborted(tmp_path),
            what="the first recovery",
        )
        if not lj.gloo_aborted(tmp_path):
            reached = max(r["step"] for r in lj.records(tmp_path) if "loss" in r)
            job.wait_for(job.step_reached(reached + 3), what="three steps on the survivors")
            job.signal(3, signal.SIGKILL)
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    if lj.assert_masked(tmp_path, reference, [1, 3], STEPS):
        failures = lj.events(tmp_path, "process_failure")
        assert [f["process"] for f in failures] == [[1], [3]]
        assert [f["compiled"] for f in failures] == [{"cross": 1}] * 2, failures
        compiles = [r["compiles"] for r in lj.records(tmp_path) if "loss" in r]
        assert compiles[-1] - compiles[0] == 2, compiles
    lj.no_process_left(tmp_path)


def _writers(state_dir: pathlib.Path) -> list[int]:
    """The processes that wrote a part of a sharded checkpoint (Orbax's per-process OCDBT)."""
    return sorted(int(p.name.rsplit("_", 1)[1]) for p in state_dir.glob("ocdbt.process_*"))


@pytest.mark.parametrize("victim", [2, 0], ids=["worker", "writer"])
def test_sharded_checkpoints_are_written_by_every_live_process_and_restore_exactly(
    env, tmp_path, reference, victim
):
    """The default layout: no replica.npz; the live processes write it together, a killed
    one (the writer too) stops writing and the survivors' saves go on without it; the job
    ends exact; a lone process and a job of 4 resume from those checkpoints exactly.

    Which live processes hold data files is Orbax's choice (replica-parallel needs an
    axis that the replica count divides: 4 groups of 2 devices split these arrays over
    all four processes, 3 groups leave them to one).
    """
    ckpts = tmp_path / "checkpoints"
    job = _start(env, tmp_path, "--checkpoint_steps=10")
    try:
        # Between two saves (a loss inside one: the test after this one).
        job.wait_for(lambda: lj.events(tmp_path, "checkpoint"), what="the save of step 10")
        job.signal(victim, signal.SIGKILL)
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    masked = lj.assert_masked(tmp_path, reference, [victim], STEPS)
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert steps == [10, 20, 30], steps
    for step in steps:
        state = ckpts / str(step) / "state"
        assert checkpoint.missing_files(str(ckpts / str(step))) is None, step
        assert not (state / "replica.npz").exists()
        if masked and step > 10:  # saved after the loss: by the survivors alone
            assert _writers(state) and victim not in _writers(state), (step, _writers(state))
    assert not (ckpts / "corrupt").exists()
    lj.assert_resumes_alone(tmp_path, env, reference, STEPS)  # a lone process reads it
    # A job of 4 resumes from it (the writer reads it once and sends it over the devices).
    again = _start(env, tmp_path, "--checkpoint_steps=10", steps=STEPS + 10)
    assert again.finish() == 0, again.output()[-3000:]
    assert lj.events(tmp_path, "resume")[-1]["step"] == STEPS
    assert _writers(ckpts / str(STEPS + 10) / "state") == [0, 1, 2, 3]
    lj.assert_params(tmp_path, lj.reference_params(STEPS + 10), range(4))
    lj.no_process_left(tmp_path)


def test_a_worker_killed_inside_a_sharded_save_is_masked_and_the_save_dropped(
    env, tmp_path, reference
):
    """A loss in the middle of a sharded save: the survivors' Orbax barriers time out after
    the save's wait (`layouts.save_wait_s`: 15 s for this state) instead of Orbax's 300 s,
    they drop that save and go on without the lost process; no relaunch, the run ends
    exact, and every checkpoint on disk is whole.

    The launcher's grace after a death (5 s here) is extended by that wait while the
    survivors say they are in a save: without it the launcher would end the attempt. A
    kill that misses the save (it ended first: a loss between steps, masked too) runs the
    job again, up to three times; the test checks the run whose kill fell inside it.
    """
    workdir, _, step = lj.killed_inside_a_save(
        lambda w: _start(env, w, launcher_flags=("--grace_s=5",)),
        tmp_path,
        victim=2,
    )
    masked = lj.assert_masked(workdir, reference, [2], STEPS)
    if masked:
        (failure,) = lj.events(workdir, "process_failure")
        assert failure["step"] == step, (failure, step)
    ckpts = workdir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert steps and steps[-1] == STEPS, steps
    assert not [p.name for p in ckpts.iterdir() if not p.name.isdigit()], list(ckpts.iterdir())
    for saved in steps:
        assert checkpoint.missing_files(str(ckpts / str(saved))) is None, saved
    lj.no_process_left(workdir)


def test_a_killed_launcher_takes_its_workers_and_a_rerun_resumes(env, tmp_path):
    job = _start(env, tmp_path, steps=200)
    try:
        job.wait_for(lambda: lj.events(tmp_path, "checkpoint"), what="a first checkpoint")
        job.proc.kill()  # SIGKILL: the launcher's own clean-up never runs
        job.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while lj.pids_of(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not lj.pids_of(tmp_path), "workers outlived their launcher by 10 s"
    finally:
        job.close()
    latest = max(e["step"] for e in lj.events(tmp_path, "checkpoint"))
    again = _start(env, tmp_path, steps=200)  # the same command: it resumes
    assert again.finish() == 0, again.output()[-3000:]
    assert lj.events(tmp_path, "resume")[0]["step"] >= latest
    lj.assert_params(tmp_path, lj.reference_params(200), range(4))
    lj.no_process_left(tmp_path)


def _truncate_arrays(step_dir: pathlib.Path) -> None:
    """Every array file of a checkpoint cut to 8 bytes on disk (replica.npz, or the data
    files of Orbax's sharded arrays)."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 16:
            f.write_bytes(f.read_bytes()[:8])


@pytest.mark.parametrize("layout", [(), (REPLICA,)], ids=["sharded", "replica"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_restores(
    env, tmp_path, reference, layout
):
    first = _start(env, tmp_path, *layout, steps=20)
    assert first.finish() == 0, first.output()[-3000:]
    ckpts = tmp_path / "checkpoints"
    _truncate_arrays(ckpts / "20")
    (ckpts / "15" / "meta" / "metadata").unlink()  # a file missing
    again = _start(env, tmp_path, *layout)
    assert again.finish() == 0, again.output()[-3000:]
    out = again.output()
    assert out.count("skipping checkpoint") == 2 and "Traceback" not in out
    assert lj.events(tmp_path, "resume")[-1]["step"] == 10
    assert sorted(p.name.split("-")[0] for p in (ckpts / "corrupt").iterdir()) == ["15", "20"]
    lj.assert_params(tmp_path, reference, range(4))
    lj.no_process_left(tmp_path)


def _hold_at_restore(job: lj.Job, logs: list[pathlib.Path], offsets: list[int]) -> int | None:
    """SIGSTOP worker 2 once the writer (0) or it starts its restore; its pid, or None if it
    had already left (the writer's verdict came first).

    Either restore line means every start-up exchange is done (worker 2 is
    then past the backend's, or the writer could not have started); after
    that the writer waits for no one. The pid comes from worker 2's hello
    line, so that nothing but a log read lies between the restore line and
    the signal.
    """

    def said(i: int, what: str) -> bool:
        return what in logs[i].read_text()[offsets[i] :]

    job.wait_for(lambda: said(2, '"kind": "hello"'), what="worker 2's hello")
    pid = int(re.search(r'"pid": (\d+)', logs[2].read_text()[offsets[2] :]).group(1))
    restore = '"phase": "restore"'
    job.wait_for(lambda: said(0, restore) or said(2, restore), what="a restore")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    return pid if lj.pids_of(job.workdir).get(2) == pid else None  # not gone, nor a zombie


def test_when_no_checkpoint_restores_every_worker_stops_with_the_writers_line(env, tmp_path):
    """Only the writer reads checkpoints; the others learn its verdict, message included.

    Worker 2 is held (SIGSTOP) from the moment the writer or it starts its
    restore (after the backend is up: its start-up exchange needs every
    process) until the writer has given its verdict: the launcher gives the
    others time to reach it (`verdict_s`) instead of killing them before their
    logs say why they stopped. Worker 2 can still leave before it is caught
    (the writer's verdict takes milliseconds): then the damaged checkpoints
    are put back and the job started again, up to three times.
    """
    first = _start(env, tmp_path, steps=10)
    assert first.finish() == 0, first.output()[-3000:]
    ckpts = tmp_path / "checkpoints"
    for step_dir in ckpts.iterdir():
        _truncate_arrays(step_dir)
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpts, damaged)
    logs = [tmp_path / "launch" / f"worker-{i}.log" for i in range(4)]
    held = None
    for _ in range(3):
        shutil.rmtree(ckpts)
        shutil.copytree(damaged, ckpts)
        offsets = [len(log.read_text()) for log in logs]
        again = _start(env, tmp_path, steps=20)
        try:
            held = _hold_at_restore(again, logs, offsets)
            if held is not None:
                try:
                    again.wait_for(
                        lambda at=offsets[0]: "none of the 2" in logs[0].read_text()[at:],
                        what="the verdict",
                    )
                    time.sleep(0.5)  # the writer has left, and the launcher has seen it
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(held, signal.SIGCONT)
            code = again.finish()
        finally:
            again.close()
        assert code == 2, again.output()[-3000:]
        if held is not None:
            break
    assert held is not None, "worker 2 left before it could be held, three times"
    for i, log in enumerate(logs):
        text = log.read_text()[offsets[i] :]
        assert "none of the 2 checkpoint(s)" in text, f"worker {i}: {text[-1500:]}"
        assert "Traceback" not in text, f"worker {i}: {text[-1500:]}"
    lj.no_process_left(tmp_path)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (root only); skipped with one line where it cannot be mounted."""
    with lj.small_tmpfs(tmp_path / "disk", "64m") as mount:
        yield mount


def test_a_full_disk_stops_the_job_with_one_line_and_a_rerun_resumes(env, small_disk, tmp_path):
    workdir = small_disk / "run"
    workdir.mkdir()
    # The launcher's own output goes where the test can read it all.
    job = _start(env, workdir, REPLICA, steps=400, log=tmp_path / "launcher.log")
    try:
        job.wait_for(lambda: len(lj.events(workdir, "checkpoint")) >= 2, what="two checkpoints")
        filler = small_disk / "filler"
        subprocess.run(  # another tenant fills the disk
            ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"],
            capture_output=True,
            check=False,
        )
        code = job.finish(timeout=120)
    finally:
        job.close()
    out = job.output()
    assert code == 5, out[-3000:]
    lines = [line for line in out.splitlines() if "is full" in line]
    assert lines and all(str(workdir) in line for line in lines), out[-3000:]
    assert "Traceback" not in out.split("launch: worker exited")[-1]
    intact = [
        int(p.name)
        for p in (workdir / "checkpoints").iterdir()
        if p.name.isdigit() and checkpoint.missing_files(str(p)) is None
    ]
    assert intact, "the newest intact checkpoint is kept"
    filler.unlink()  # space again: the same command resumes and finishes
    again = _start(env, workdir, REPLICA, steps=400, log=tmp_path / "again.log")
    assert again.finish() == 0, again.output()[-3000:]
    assert lj.events(workdir, "resume")[-1]["step"] >= max(intact)
    lj.assert_params(workdir, lj.reference_params(400), range(4))
    lj.no_process_left(workdir)


def test_a_second_kill_during_the_survivors_recovery_is_masked(env, tmp_path, reference):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(3), what="step 3")
        job.signal(1, signal.SIGKILL)
        job.wait_for(lambda: "declared dead" in job.output(), what="the first loss detected")
        try:
            job.signal(3, signal.SIGKILL)  # the survivors are rebuilding their step right now
        except (AssertionError, ProcessLookupError):
            # On CPU a neighbour of the first victim can abort in Gloo with it
            # (assert_masked): the job is already rolling back, 3 with it.
            if not lj.gloo_aborted(tmp_path):
                raise
        code = job.finish()
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    if "made no progress since" in job.output():
        # Process 3 died before the survivors had rebuilt their collectives: they wait on
        # it until the launcher sees no progress after a loss; a fresh job rolls back.
        assert lj.events(tmp_path, "relaunch")
        lj.assert_params(tmp_path, reference, range(4))
        lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    else:
        lj.assert_masked(tmp_path, reference, [1, 3], STEPS)
    lj.no_process_left(tmp_path)


def test_a_short_stall_is_ridden_out(env, tmp_path, reference):
    """Stopped for 1 s, under the 2 s collective timeout: nobody notices, all four finish."""
    job = _start(env, tmp_path)
    code = job.stall(1, 1.0)
    assert code == 0, job.output()[-3000:]
    lj.assert_masked(tmp_path, reference, [], STEPS)  # nobody lost
    lj.no_process_left(tmp_path)


def test_a_stall_past_the_collective_timeout_is_ridden_out_on_rebuilt_collectives(
    env, tmp_path, reference
):
    """Stopped for 3 s inside a step: past the 2 s collective timeout, under a 10 s heartbeat.

    Its peers' collectives time out and close their Gloo pairs with it; the
    retry fails on those pairs, so every process rebuilds its collectives and
    the step goes through: no relaunch, no process lost, all four exact. (With
    the 5 s heartbeat of the other tests, the 3 s stop plus the time since the
    worker's last heartbeat could pass the timeout: declared dead.)
    """
    job = _start(env, tmp_path, launcher_flags=("--heartbeat_s=10",))
    code = job.stall(1, 3.0, until="collectives_rebuilt", tries=3)
    assert code == 0, job.output()[-3000:]
    assert not lj.events(tmp_path, "relaunch"), job.output()[-3000:]
    assert not lj.events(tmp_path, "process_failure"), job.output()[-3000:]
    (rebuilt,) = lj.events(tmp_path, "collectives_rebuilt")
    assert "a collective failed again" in rebuilt["reason"] and rebuilt["rebuild_s"] > 0
    lj.assert_params(tmp_path, reference, range(4))
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    lj.no_process_left(tmp_path)


@pytest.mark.parametrize(
    "to, flags",
    [("launcher", ()), ("workers", ()), ("launcher", (REPLICA,))],
    ids=["launcher", "workers", "replica"],
)
def test_a_preemption_notice_saves_the_step_reached_and_a_rerun_resumes(env, tmp_path, to, flags):
    """Every process writes its part of the preemption's save, at the same step (``replica``:
    the writer alone saves its whole replica)."""
    steps = 400
    worker = lj.regression_command(tmp_path, f"--steps={steps}", "--checkpoint_steps=1000", *flags)
    job = lj.Job(lj.launcher(tmp_path, worker), tmp_path, env)
    try:
        job.wait_for(job.step_reached(20), what="step 20")
        start = time.monotonic()
        if to == "launcher":
            job.proc.send_signal(signal.SIGTERM)
        else:  # as a scheduler does: every task at once
            for pid in lj.pids_of(tmp_path).values():
                os.kill(pid, signal.SIGTERM)
        code = job.finish(timeout=120)
        took = time.monotonic() - start
    finally:
        job.close()
    assert code == 143, job.output()[-3000:]
    assert took < 30, f"{took:.1f} s from the notice to the end of the job"
    (preempted,) = lj.events(tmp_path, "preempted")
    reached = preempted["step"]
    last = max(r["step"] for r in lj.records(tmp_path) if "loss" in r)
    assert last == reached - 1, "the state of the step reached is saved: nothing is lost"
    assert checkpoint.missing_files(str(tmp_path / "checkpoints" / str(reached))) is None
    if not flags:
        assert _writers(tmp_path / "checkpoints" / str(reached) / "state") == [0, 1, 2, 3]
    else:
        assert (tmp_path / "checkpoints" / str(reached) / "state" / "replica.npz").exists()
    lj.no_process_left(tmp_path)
    again = lj.Job(lj.launcher(tmp_path, worker), tmp_path, env)
    assert again.finish() == 0, again.output()[-3000:]
    assert lj.events(tmp_path, "resume")[-1]["step"] == reached
    lj.steps_of_last_attempt_are_contiguous(tmp_path, steps)
    lj.assert_params(tmp_path, lj.reference_params(steps), range(4))
    lj.no_process_left(tmp_path)

"""Workers that stop or fail on their own under ``python -m spare_jax.launch``.

The user script is tests/cued_worker.py: experiments/regression.py's model
behind a loader that hangs or raises when the test creates a cue file, and a
checkpoint save or compile that takes longer on cue. The launcher runs with
a short eviction bound (``--evict_after_s=4``; heartbeat 5 s). After each
job: its exit status, what the launcher said, ``metrics.jsonl``, every leaf
of every surviving worker's parameters against a single-device `jax.grad`
run, and no process left behind.

Slow: each test is one or two multi-process jobs.
"""

from __future__ import annotations

import time

import launching as lj
import pytest

pytestmark = pytest.mark.slow

STEPS = 60
EVICT_S = 4.0


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return lj.env(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def reference():
    return lj.reference_params(STEPS)


def _start(env, workdir, *args: str, flags: tuple[str, ...] = (), steps: int = STEPS) -> lj.Job:
    worker = lj.cued_command(workdir, f"--steps={steps}", "--checkpoint_steps=5", *args)
    command = lj.launcher(workdir, worker, f"--evict_after_s={EVICT_S}", *flags)
    return lj.Job(command, workdir, env)


def _said(job: lj.Job, text: str) -> float:
    """Wait until the launcher's output holds ``text``; when it did (monotonic)."""
    job.wait_for(lambda: text in job.output(), timeout=120, what=repr(text))
    return time.monotonic()


@pytest.mark.parametrize("victim", [2, 0], ids=["worker2", "process0_the_writer"])
def test_a_hung_loader_is_evicted_and_masked_without_a_relaunch(env, tmp_path, reference, victim):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(10), what="step 10")
        lj.cue(tmp_path, "hang", victim)
        job.wait_for(
            lambda: "blocked on" in (tmp_path / "launch" / f"worker-{victim}.log").read_text(),
            what="the loader blocked",
        )
        hung = time.monotonic()
        evicted = _said(job, f"worker {victim} evicted")
        code = job.finish(timeout=180)
        ended = time.monotonic()
    finally:
        job.close()
    out = job.output()
    print(f"hang to eviction {evicted - hung:.1f} s, to the end of the job {ended - hung:.1f} s")
    assert code == 0, out[-3000:]
    assert evicted - hung < EVICT_S + 6, f"evicted {evicted - hung:.1f} s after the hang"
    assert "relaunching" not in out
    line = next(x for x in out.splitlines() if f"worker {victim} evicted" in x)
    assert str(tmp_path / "launch" / f"worker-{victim}.log") in line
    lj.assert_masked(tmp_path, reference, [victim], STEPS)
    lj.no_process_left(tmp_path)


@pytest.mark.parametrize("busy", ["slow-save", "slow-compile"])
def test_a_worker_busy_saving_or_compiling_is_not_evicted(env, tmp_path, reference, busy):
    """3x the bound in a checkpoint save (the writer) or a compile (worker 1): never evicted."""
    who = 0 if busy == "slow-save" else 1
    if busy == "slow-compile":  # its compile at start-up, before the first step
        lj.cue(tmp_path, busy, who, str(3 * EVICT_S))
    job = _start(env, tmp_path, "--precompile_failures")
    try:
        if busy == "slow-save":
            job.wait_for(job.step_reached(10), what="step 10")
            lj.cue(tmp_path, busy, who, str(3 * EVICT_S))
        code = job.finish(timeout=240)
    finally:
        job.close()
    out = job.output()
    assert code == 0, out[-3000:]
    log = (tmp_path / "launch" / f"worker-{who}.log").read_text()
    assert f"cue: {busy}-{who}" in log, "the slow save or compile happened"
    assert "evicted" not in out and "declared dead" not in out, out[-3000:]
    assert not lj.events(tmp_path, "process_failure")
    if lj.events(tmp_path, "relaunch"):
        # CPU only: peers that waited past the collective timeout (2 s) in a collective
        # with the busy one lose their Gloo connections; the retries fail and a fresh job
        # rolls back (docs/multihost.md). Never an eviction.
        assert busy == "slow-save" and "a collective failed with every process alive" in out
        lj.assert_params(tmp_path, reference, range(4))
        lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    else:
        lj.assert_masked(tmp_path, reference, [], STEPS)
    lj.no_process_left(tmp_path)


def test_a_loader_that_raises_once_is_masked_and_its_death_named(env, tmp_path, reference):
    job = _start(env, tmp_path)
    try:
        job.wait_for(job.step_reached(10), what="step 10")
        lj.cue(tmp_path, "raise", 2)
        code = job.finish(timeout=180)
    finally:
        job.close()
    out = job.output()
    assert code == 0, out[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("launch: worker 2 exited")]
    assert "status 1" in line and "OSError: [Errno 5] Input/output error" in line, line
    assert str(tmp_path / "launch" / "worker-2.log") in line, line
    lj.assert_masked(tmp_path, reference, [2], STEPS)
    lj.no_process_left(tmp_path)


def test_two_jobs_from_one_directory_keep_their_own_logs(env, tmp_path):
    """No --launch_dir: each job's logs go under its own --workdir, never a shared one."""
    for name in ("a", "b"):
        workdir = tmp_path / name
        worker = lj.cued_command(workdir, "--steps=3")
        job = lj.Job(lj.launcher(workdir, worker, launch_dir=False), workdir, env)
        assert job.finish(timeout=180) == 0, job.output()[-3000:]
    for name in ("a", "b"):
        logs = sorted((tmp_path / name / "launch").glob("worker-*.log"))
        assert [p.name for p in logs] == [f"worker-{i}.log" for i in range(4)]
        other = tmp_path / ("b" if name == "a" else "a")
        for log in logs:
            text = log.read_text()
            assert f"workdir: {tmp_path / name}\n" in text and f"workdir: {other}\n" not in text
    lj.no_process_left(tmp_path)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--local_devices=8",), "contradicts the launcher's SPARE_JAX_DEVICES_PER_PROCESS=2"),
        (("--rows=20",), "ValueError: batch"),
    ],
    ids=["conflicting_initialize", "wrong_batch_size"],
)
def test_an_error_in_the_script_stops_the_job_after_one_relaunch_at_most(
    env, tmp_path, args, error
):
    start = time.monotonic()
    job = _start(env, tmp_path, *args, steps=10)
    code = job.finish(timeout=240)
    took = time.monotonic() - start
    out = job.output()
    assert code != 0, out[-3000:]
    assert out.count("relaunching") <= 1, out[-3000:]
    assert error in out, out[-3000:]
    assert "failed the same way" in out or "not complete" in out, out[-3000:]
    print(f"stopped after {took:.1f} s, exit {code}")
    lj.no_process_left(tmp_path)

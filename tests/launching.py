"""Helpers for tests that run real multi-process jobs: start, find, damage, clean up.

Faults come from outside the processes under test, the way a cluster sends
them: signals to worker pids found through ``/proc``, and damage on disk.
Every wait is bounded, and `Job.close` SIGKILLs whatever is left, so a failing
test leaves no process behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from spare_jax.runlog import read_records

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@contextlib.contextmanager
def small_tmpfs(path: pathlib.Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only); the test is skipped with one line otherwise."""
    import pytest

    path.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): full-disk test not run")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def env(cache: pathlib.Path) -> dict[str, str]:
    """The workers' environment: CPU only, one compilation cache shared by the test module."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def run_script_pair(
    script: str, args: list[list[str]], devices: int, timeout: float = 90.0
) -> list[tuple[int, str]]:
    """Run ``script`` as process 0 and 1 of a two-process JAX job on CPU: (status, output) each.

    Each gets a free coordinator port, its id and its own ``args`` after them,
    ``devices`` CPU devices and a 20 s collective timeout. The waits are bounded;
    one still running at the end goes by SIGKILL (JAX catches SIGTERM).
    """
    from spare_jax import launch_worker, multihost

    port = launch_worker.free_port()
    flags = f"--xla_force_host_platform_device_count={devices} "
    worker_env = {
        **os.environ,
        "XLA_FLAGS": flags + multihost.collective_timeout_flag(20),
        "JAX_PLATFORMS": "cpu",
    }
    procs = [
        subprocess.Popen(
            [PYTHON, "-c", script, str(port), str(me), *extra],
            env=worker_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for me, extra in enumerate(args)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def regression_command(workdir: pathlib.Path, *args: str) -> list[str]:
    return [PYTHON, str(ROOT / "experiments" / "regression.py"), f"--workdir={workdir}", *args]


def cued_command(workdir: pathlib.Path, *args: str) -> list[str]:
    """The user script whose loader hangs or raises on cue files (tests/cued_worker.py)."""
    return [PYTHON, str(ROOT / "tests" / "cued_worker.py"), f"--workdir={workdir}", *args]


def cue(workdir: pathlib.Path, name: str, process: int, text: str = "") -> None:
    """Create the cue ``name`` for worker ``process`` (see tests/cued_worker.py)."""
    (workdir / "cues").mkdir(parents=True, exist_ok=True)
    (workdir / "cues" / f"{name}-{process}").write_text(text)


def launcher(
    workdir: pathlib.Path, worker: list[str], *flags: str, launch_dir: bool = True
) -> list[str]:
    """``python -m spare_jax.launch`` with 4 workers of 2 devices each, logs under workdir.

    ``launch_dir=False`` leaves ``--launch_dir`` out: the launcher picks the job's own.
    """
    return [
        PYTHON,
        "-m",
        "spare_jax.launch",
        "--processes=4",
        "--devices_per_process=2",
        "--heartbeat_s=5",  # a busy 2-core CI machine must not take a slow worker for dead
        *([f"--launch_dir={workdir / 'launch'}"] if launch_dir else []),
        *flags,
        "--",
        *worker,
    ]


@functools.cache
def reference_params(steps: int) -> dict[str, np.ndarray]:
    """experiments/regression.py's model trained failure-free on one device with jax.grad."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import regression

    dev = jax.devices()[0]
    params = jax.device_put(regression.init_params(), dev)
    tx = regression.OPTIMIZER
    opt = tx.init(params)
    grad = jax.jit(jax.grad(regression.loss_fn))
    for t in range(steps):
        updates, opt = tx.update(
            grad(params, jax.device_put(regression.batches(t), dev)), opt, params
        )
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def assert_params(workdir: pathlib.Path, reference: dict, processes) -> None:
    """Every leaf of each listed process's final parameters equals the reference."""
    for p in processes:
        with np.load(workdir / f"params-{p}.npz") as got:
            assert sorted(got.files) == sorted(reference), (p, got.files)
            for name, want in reference.items():
                np.testing.assert_allclose(
                    got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"process {p}, {name}"
                )


def assert_resumes_alone(workdir: pathlib.Path, env: dict, reference: dict, steps: int) -> None:
    """A lone process resumes from the job's newest checkpoint, step ``steps``, with nothing
    left to do, and its parameters are exact: the checkpoint restores outside the job."""
    alone = subprocess.run(
        regression_command(workdir, f"--steps={steps}"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert events(workdir, "resume")[-1]["step"] == steps
    assert_params(workdir, reference, [0])


def records(workdir: pathlib.Path) -> list[dict]:
    return read_records(str(workdir / "metrics.jsonl"))


def events(workdir: pathlib.Path, name: str) -> list[dict]:
    return [r for r in records(workdir) if r.get("event") == name]


def steps_of_last_attempt_are_contiguous(workdir: pathlib.Path, total: int) -> None:
    """The last record of each step covers 0..total-1 once each, in the file's order."""
    last = {}
    for r in records(workdir):
        if "event" not in r and "step" in r:
            last[r["step"]] = r
    assert sorted(last) == list(range(total))


GLOO_MISMATCH = "Received data size doesn't match expected size"


def gloo_aborted(workdir: pathlib.Path) -> list[int]:
    """Workers that died of Gloo's collective mismatch (CPU only; see docs/multihost.md)."""
    out = []
    for log in sorted((workdir / "launch").glob("worker-*.log")):
        if GLOO_MISMATCH in log.read_text(errors="replace"):
            out.append(int(log.stem.split("-")[1]))
    return out


def assert_masked(workdir: pathlib.Path, reference: dict, victims, steps: int) -> bool:
    """The victims' loss was masked: survivors finished exactly, no relaunch; True if so.

    One exception, where the logs prove it: on CPU a peer that dies in the middle
    of a collective can make a neighbour abort in Gloo (docs/multihost.md); then
    the job must have relaunched, rolled back and ended exact on all four.
    """
    dead = sorted(p for e in events(workdir, "process_failure") for p in e["process"])
    if gloo_aborted(workdir):
        assert events(workdir, "relaunch"), "a neighbour aborted: the job must relaunch"
        assert_params(workdir, reference, range(4))
        masked = False
    else:
        assert dead == sorted(victims), dead
        assert not events(workdir, "relaunch") and not events(workdir, "resume")
        assert_params(workdir, reference, [p for p in range(4) if p not in victims])
        masked = True
    steps_of_last_attempt_are_contiguous(workdir, steps)
    return masked


def summary(workdir: pathlib.Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())


def pids_of(workdir: pathlib.Path) -> dict[int, int]:
    """``{process id: pid}`` of the live workers whose command line names ``workdir``."""
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if f"--workdir={workdir}" not in cmdline or state == "Z":
            continue
        ids = [v.split("=", 1)[1] for v in environ if v.startswith("SPARE_JAX_PROCESS_ID=")]
        ids = ids or [v.split("=", 1)[1] for v in environ if v.startswith("SLURM_PROCID=")]
        if ids and "regression.py" in cmdline:
            out[int(ids[0])] = int(entry.name)
    return out


def any_process_of(workdir: pathlib.Path) -> list[int]:
    """Pids of every process (launcher included) whose command line names ``workdir``."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                state = (entry / "stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if str(workdir) in cmdline and state != "Z":
                pids.append(int(entry.name))
    return pids


class Job:
    """A launcher started in the background; `close` leaves nothing running."""

    def __init__(
        self,
        command: list[str],
        workdir: pathlib.Path,
        environment: dict,
        log: pathlib.Path | None = None,
    ):
        self.workdir = workdir
        log = log or workdir.parent / f"{workdir.name}.launcher.log"
        self.out = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=self.out, stderr=subprocess.STDOUT
        )

    def wait_for(self, ready, timeout: float = 240.0, what: str = "the condition") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            ended = self.proc.poll() is not None
            if ended or time.monotonic() >= deadline:
                said = "the job ended before" if ended else f"within {timeout} s, no"
                # the launcher's and every worker's last words: a CI log is all there is to read
                pytest.fail(f"{said} {what}:\n{self.output()[-3000:]}\n{self.worker_logs()}")
            time.sleep(0.01)

    def step_reached(self, step: int):
        return lambda: any(r.get("step", -1) >= step for r in records(self.workdir) if "loss" in r)

    def signal(self, process: int, sig: int) -> int:
        """Send ``sig`` to worker ``process``; its pid."""
        pids = pids_of(self.workdir)
        assert process in pids, (
            f"worker {process} is not running (live: {sorted(pids)}):\n{self.output()[-3000:]}"
            f"\n{self.worker_logs()}"
        )
        pid = pids[process]
        os.kill(pid, sig)
        return pid

    def stall(
        self, process: int, seconds: float, at: int = 3, until: str = "", tries: int = 1
    ) -> int:
        """Worker ``process`` stopped (SIGSTOP) at step ``at`` for ``seconds``, then resumed
        (SIGCONT); the job's status once it ends.

        With ``until``, stopped again (``tries`` stops at most) while no ``until``
        event followed within 10 s: a stop that fell between two steps'
        collectives is waited out in the live-set check, and nothing fails.
        """
        try:
            self.wait_for(self.step_reached(at), what=f"step {at}")
            for _ in range(tries):
                self.signal(process, signal.SIGSTOP)
                time.sleep(seconds)
                self.signal(process, signal.SIGCONT)
                deadline = time.monotonic() + 10
                while until and not events(self.workdir, until) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not until or events(self.workdir, until) or self.proc.poll() is not None:
                    break
            return self.finish()
        finally:
            self.close()

    def finish(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end within {timeout} s:\n{self.output()[-3000:]}"
                f"\n{self.worker_logs()}"
            ) from None
        finally:
            self.close()

    def worker_logs(self, tail: int = 1500) -> str:
        """The end of every worker's log, for a failure message."""
        logs = sorted((self.workdir / "launch").glob("worker-*.log"))
        return "\n".join(f"--- {p.name}:\n{p.read_text(errors='replace')[-tail:]}" for p in logs)

    def output(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return pathlib.Path(self.out.name).read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any_process_of(self.workdir) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in any_process_of(self.workdir):  # nothing outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self.out.closed:
            self.out.close()


def kill_in_a_save(job: Job, workdir: pathlib.Path, victim: int, after: int) -> int:
    """SIGKILL ``victim`` as soon as worker 0 says it is in a save of step ``after`` or later;
    that step. The victim's pid is read from its hello line first, so that only a log read
    lies between worker 0's line and the kill."""
    logs = [workdir / "launch" / f"worker-{i}.log" for i in (0, victim)]

    def said(i: int) -> str:
        return logs[i].read_text() if logs[i].exists() else ""

    job.wait_for(lambda: '"kind": "hello"' in said(1), what="the victim's hello")
    pid = int(re.search(r'"pid": (\d+)', said(1)).group(1))
    saving = re.compile(r'"step": (\d+), "phase": "checkpoint"')

    def in_a_save() -> bool:
        return any(int(s) >= after for s in saving.findall(said(0)))

    job.wait_for(in_a_save, what=f"a save of step {after} or later")
    os.kill(pid, signal.SIGKILL)
    return max(int(s) for s in saving.findall(said(0)))


def killed_inside_a_save(
    start, tmp_path: pathlib.Path, victim: int, timeout: float = 300.0
) -> tuple[pathlib.Path, Job, int]:
    """Start a job with ``start(workdir)``, SIGKILL ``victim`` in a save of step 10 or later
    (`kill_in_a_save`) and let the job end; again (three runs at most) while the kill missed
    the save (the survivors did not say they dropped it). The run's workdir, job and step."""
    for attempt in range(3):
        workdir = tmp_path / f"run{attempt}"
        job = start(workdir)
        try:
            step = kill_in_a_save(job, workdir, victim=victim, after=10)
            code = job.finish(timeout=timeout)
        finally:
            job.close()
        assert code == 0, job.output()[-3000:]
        if f"the save of step {step} was dropped" in job.output():
            return workdir, job, step
    raise AssertionError("three kills in a row fell outside the save they were aimed at")


def no_process_left(workdir: pathlib.Path) -> None:
    deadline = time.monotonic() + 30
    while any_process_of(workdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = any_process_of(workdir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"

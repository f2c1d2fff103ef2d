"""Groups that span processes (HSDP across hosts), each process reading only its own rows.

``experiments/regression.py`` under ``python -m spare_jax.launch`` with a named
mesh whose groups are two processes each, ``--input=units`` (each process asks
for the micro-batches of its own group's stack, and only its part of their
rows). One process is SIGKILLed from outside mid-run, between checkpoints (a
loss during a save of such a job waits in Orbax's barrier and ends in a
relaunch: docs/multihost.md): its whole group is
masked, the group's other process leaves (exit 77), and the job ends 0
without a relaunch. Every surviving process's parameters equal a
single-device `jax.grad` + optax run over the same batches (rtol 1e-5,
atol 1e-6); every step read ``r * m * b / parts`` rows per held group. A
process stopped past the collective timeout instead is ridden out on rebuilt
collectives, each process keeping only its own shards. With replacements
(``--replace_after_s``), both processes of a lost group come back and join
together, exact.

Slow (each test is one multi-process job of 1-3 minutes on 2 cores).
"""

from __future__ import annotations

import re
import signal
import sys

import jax
import launching as lj
import numpy as np
import optax
import pytest

from spare_jax import checkpoint

sys.path.insert(0, str(lj.ROOT / "experiments"))
import regression

pytestmark = pytest.mark.slow

STEPS = 16

# processes, devices per process, mesh, groups, row parts per unit, the victim, its group-mate
CASES = {
    "8x1_fsdp": (8, 1, "data:1,redundancy:4,fsdp:2", 4, 2, 3, 2),
    "4x2_fsdp_tensor": (4, 2, "data:1,redundancy:2,fsdp:2,tensor:2", 2, 2, 2, 3),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return lj.env(tmp_path_factory.mktemp("jax_cache"))


def reference(groups: int, steps: int = STEPS) -> dict[str, np.ndarray]:
    """regression.py's model trained failure-free on one device with jax.grad."""
    dev = jax.devices()[0]
    params = jax.device_put(regression.init_params(), dev)
    tx = regression.OPTIMIZER
    opt = tx.init(params)
    grad = jax.jit(jax.grad(regression.loss_fn))
    rows = groups * regression.MICROBATCHES * regression.ROWS
    for t in range(steps):
        batch = jax.device_put(regression.batches(t, rows), dev)
        updates, opt = tx.update(grad(params, batch), opt, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def worker_log(workdir, process: int) -> str:
    return (workdir / "launch" / f"worker-{process}.log").read_text(errors="replace")


def rows_loaded(workdir, process: int) -> int:
    log = worker_log(workdir, process)
    return int(re.findall(r"done: step \d+, loss \S+, rows loaded (\d+)", log)[-1])


def _launcher(
    workdir,
    processes: int,
    devices: int,
    mesh: str,
    steps: int,
    checkpoint_steps: int,
    *launcher_flags: str,
    worker_flags: tuple[str, ...] = (),
) -> list[str]:
    """``experiments/regression.py`` on ``mesh`` with per-unit input, under the launcher."""
    worker = lj.regression_command(
        workdir,
        f"--steps={steps}",
        f"--checkpoint_steps={checkpoint_steps}",
        f"--mesh={mesh}",
        "--input=units",
        *worker_flags,
    )
    return [
        lj.PYTHON,
        "-m",
        "spare_jax.launch",
        f"--processes={processes}",
        f"--devices_per_process={devices}",
        "--heartbeat_s=5",
        # 8 processes on 2 busy cores: a peer still compiling must not read as dead.
        "--collective_timeout_s=10",
        *launcher_flags,  # after the two above: a repeated flag's last value counts
        f"--launch_dir={workdir / 'launch'}",
        "--",
        *worker,
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_process_of_a_spanning_group_killed_masks_its_group(env, tmp_path, case):
    processes, devices, mesh, groups, parts, victim, mate = CASES[case]
    command = _launcher(tmp_path, processes, devices, mesh, STEPS, checkpoint_steps=50)
    job = lj.Job(command, tmp_path, env)
    try:
        job.wait_for(job.step_reached(4), timeout=400, what="step 4")
        job.signal(victim, signal.SIGKILL)
        code = job.finish(timeout=400)
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    survivors = [p for p in range(processes) if p not in (victim, mate)]
    want = reference(groups)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "launch").glob("*.log"))
    if lj.events(tmp_path, "relaunch"):
        # CPU only: a survivor's Gloo connection torn down with the dead peer's
        # (docs/multihost.md, "neighbour aborts"); the relaunch rolls back, exact.
        assert re.search(r"Gloo \S+ failed|" + re.escape(lj.GLOO_MISMATCH), logs), logs[-3000:]
        lj.assert_params(tmp_path, want, range(processes))
    else:
        # The mate may leave before the survivors' check (a collective of its own update
        # failed first): then they find both gone at once.
        failures = lj.events(tmp_path, "process_failure")
        assert failures[0]["process"] in ([victim], sorted([victim, mate])), failures
        assert not lj.events(tmp_path, "relaunch") and not lj.events(tmp_path, "resume")
        lj.assert_params(tmp_path, want, survivors)
        assert not (tmp_path / f"params-{mate}.npz").exists()  # it left with its group
        assert "exited with status 77" in job.output()
        summary = lj.summary(tmp_path)
        assert summary["live_groups"] == groups - 1
        assert sorted(summary["lost_processes"]) == sorted([victim, mate])
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    # Each process read its own group's stack only: r * m units, b / parts rows of each,
    # once for the batch check and once a step, and again only when its step changed
    # (a loss, rebuilt collectives): that step's stack and the next one, read ahead.
    per_step = 2 * regression.MICROBATCHES * regression.ROWS // parts
    global_rows = groups * regression.MICROBATCHES * regression.ROWS
    steps = [r for r in lj.records(tmp_path) if "loss" in r]
    assert {r["input_rows"] for r in steps} == {per_step}
    changes = sum(len(lj.events(tmp_path, k)) for k in ("process_failure", "collectives_rebuilt"))
    for p in survivors:
        loaded, left = divmod(rows_loaded(tmp_path, p), per_step)
        assert left == 0 and 0 < loaded <= STEPS + 1 + 2 * changes, (p, loaded, changes)
        assert loaded * per_step < STEPS * global_rows
    lj.no_process_left(tmp_path)


def test_a_process_killed_inside_a_spanning_save_masks_its_group_without_a_relaunch(env, tmp_path):
    """4 x 2 (`fsdp:2,tensor:2`), a save every 5 steps: worker 2 SIGKILLed as soon as worker
    0 is in the save of step 10 or later. The survivors' barriers in the save time out
    (`layouts.save_wait_s`), the save is dropped, worker 2's group is masked and its mate
    leaves with status 77 (before or after the survivors' check); the launcher, given a 5 s
    grace, waits for the survivors (a group-mate that left is not waited for, and the save's
    wait extends the grace). A kill that misses the save runs the job again, up to three
    times."""
    processes, devices, mesh, groups, _parts, victim, mate = CASES["4x2_fsdp_tensor"]
    workdir, job, _ = lj.killed_inside_a_save(
        lambda w: lj.Job(_launcher(w, processes, devices, mesh, STEPS, 5, "--grace_s=5"), w, env),
        tmp_path,
        victim=victim,
        timeout=400,
    )
    if lj.gloo_aborted(workdir):  # CPU only (docs/multihost.md, "neighbour aborts")
        assert lj.events(workdir, "relaunch")
        lj.assert_params(workdir, reference(groups), range(processes))
    else:
        assert not lj.events(workdir, "relaunch"), job.output()[-3000:]
        # The mate leaves (status 77) when it sees the loss: in the survivors' live-set check
        # (the usual order), or at once when a collective inside the group fails first (its
        # optimizer update, if it was still in it): then the survivors find both gone.
        (failure,) = lj.events(workdir, "process_failure")
        assert failure["process"] in ([victim], sorted([victim, mate])), failure
        assert len(failure["groups"]) == 1, failure
        mate_log = (workdir / "launch" / f"worker-{mate}.log").read_text(errors="replace")
        assert '"kind": "group_lost"' in mate_log, mate_log[-2000:]
        assert "exited with status 77" in job.output()
        survivors = [p for p in range(processes) if p not in (victim, mate)]
        lj.assert_params(workdir, reference(groups), survivors)
    ckpts = workdir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert steps and steps[-1] == STEPS, steps
    assert all(checkpoint.missing_files(str(ckpts / str(s))) is None for s in steps), steps
    lj.no_process_left(workdir)


def test_a_stall_in_a_spanning_job_is_ridden_out_keeping_each_process_s_own_shards(env, tmp_path):
    """4 x 2 (`fsdp:2,tensor:2`): worker 1 stopped for 12 s, past the 10 s collective timeout
    and under a 30 s heartbeat. Every process rebuilds its collectives keeping only its own
    shards on its host: the writer, half of its group, kept half a replica or a little
    more (small leaves are replicated), never all of it. No relaunch, nobody lost, exact."""
    processes, devices, mesh, groups, _parts, _victim, _mate = CASES["4x2_fsdp_tensor"]
    command = _launcher(tmp_path, processes, devices, mesh, STEPS, 50, "--heartbeat_s=30")
    job = lj.Job(command, tmp_path, env)
    code = job.stall(1, 12.0, at=4, until="collectives_rebuilt", tries=3)
    assert code == 0, job.output()[-3000:]
    assert not lj.events(tmp_path, "relaunch"), job.output()[-3000:]
    assert not lj.events(tmp_path, "process_failure"), job.output()[-3000:]
    (rebuilt,) = lj.events(tmp_path, "collectives_rebuilt")
    replica = 3 * sum(a.nbytes for a in regression.init_params().values())  # AdamW: 3 states
    assert replica / 2 <= rebuilt["host_bytes"] < 0.75 * replica, (rebuilt, replica)
    lj.assert_params(tmp_path, reference(groups), range(processes))
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    lj.no_process_left(tmp_path)


def test_a_spanning_job_resumes_and_rolls_back_exactly(env, tmp_path):
    """Checkpoints written by every process of spanning groups restore exactly.

    A job of 8 steps saves at 4 and 8 (every process its own shards, though
    asked for one writer's replica: it says that is not taken); the same
    command to 16 steps resumes from 8. In it one process of each group is
    SIGKILLed at once: no group is left to go on with, the job relaunches and
    rolls back to the latest complete checkpoint. Every process's parameters
    at the end equal the single-device run of 16 steps.
    """
    processes, devices, mesh, groups, _, _, _ = CASES["4x2_fsdp_tensor"]

    def command(steps: int, *flags: str) -> list[str]:
        return _launcher(
            tmp_path, processes, devices, mesh, steps, checkpoint_steps=4, worker_flags=flags
        )

    first = lj.Job(
        command(8, "--nosharded_checkpoints"),
        tmp_path,
        env,
        log=tmp_path.parent / "first.launcher.log",
    )
    assert first.finish(timeout=400) == 0, first.output()[-3000:]
    saved = [e["step"] for e in lj.events(tmp_path, "checkpoint")]
    assert saved[-1] == 8, saved
    said = (tmp_path / "launch" / "worker-0.log").read_text(errors="replace")
    assert "sharded_checkpoints=False is not taken" in said, said[-3000:]
    state = tmp_path / "checkpoints" / "8" / "state"
    assert not (state / "replica.npz").exists() and (state / "manifest.ocdbt").exists()
    job = lj.Job(command(STEPS), tmp_path, env)
    try:
        job.wait_for(job.step_reached(10), timeout=400, what="step 10")
        for victim in (0, 2):  # groups 0 and 1: processes (0, 1) and (2, 3)
            job.signal(victim, signal.SIGKILL)
        code = job.finish(timeout=400)
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    resumes = lj.events(tmp_path, "resume")
    assert resumes[0]["step"] == 8, resumes
    (relaunch,) = lj.events(tmp_path, "relaunch")
    assert relaunch["rolled_back"] and relaunch["to_step"] >= 8, relaunch
    lj.assert_params(tmp_path, reference(groups), range(processes))
    lj.steps_of_last_attempt_are_contiguous(tmp_path, STEPS)
    lj.no_process_left(tmp_path)


def test_a_spanning_group_lost_is_replaced_and_rejoins_exactly(env, tmp_path):
    """4 x 2 (`fsdp:2,tensor:2`), ``--replace_after_s=0.5 --spares=1``: worker 2 SIGKILLed
    at step 8. Its group is masked and its mate leaves (77); the launcher replaces both,
    one from the warm spare (imports done) and one started afresh, seconds later. The
    first waits in the live-set check (saying for whom) until the other is live too;
    both then join at one block, and the live group streams its state to them, each of
    its processes sending only its own shards. No relaunch, no rollback; both groups
    live at the end; all four processes exact."""
    processes, devices, mesh, groups, _parts, victim, mate = CASES["4x2_fsdp_tensor"]
    steps = 400  # long enough for two replacements, a heartbeat apart, to start and join
    flags = ("--replace_after_s=0.5", "--spares=1")
    command = _launcher(tmp_path, processes, devices, mesh, steps, 50, *flags)
    job = lj.Job(command, tmp_path, env)
    try:
        job.wait_for(job.step_reached(8), timeout=400, what="step 8")
        job.signal(victim, signal.SIGKILL)
        job.wait_for(
            lambda: lj.events(tmp_path, "rejoin") or lj.gloo_aborted(tmp_path),
            timeout=400,
            what="the re-join",
        )
        code = job.finish(timeout=400)
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    lj.assert_params(tmp_path, reference(groups, steps), range(processes))
    lj.no_process_left(tmp_path)
    if lj.gloo_aborted(tmp_path):  # CPU only (docs/multihost.md, "neighbour aborts")
        assert lj.events(tmp_path, "relaunch")
        return
    said = job.output()
    for p in (victim, mate):
        assert f"starting a replacement for worker {p}" in said, said[-3000:]
    assert re.search(r"spare 1 takes worker [23]'s place", said), said[-3000:]
    waited = [p for p in (victim, mate) if "waiting for process(es)" in worker_log(tmp_path, p)]
    assert len(waited) == 1, said[-3000:]  # the spare, for the one started afresh
    (rejoined,) = lj.events(tmp_path, "rejoin")
    assert rejoined["process"] == [victim, mate] and rejoined["groups"] == [1], rejoined
    assert rejoined["bytes"] > 0 and rejoined["move_mb_s"] > 0, rejoined
    for name in ("relaunch", "rollback", "resume"):
        assert not lj.events(tmp_path, name), name
    records = [r for r in lj.records(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == list(range(steps)), "no step repeated or missed"
    assert records[-1]["live_groups"] == groups

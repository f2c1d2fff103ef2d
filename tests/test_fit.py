"""`spare_jax.fit` on a model that is not ours, against a single-device `jax.grad` reference.

The model is ``experiments/regression.py``'s (plain dict parameters, AdamW);
the reference trains it on one device with `jax.grad` + optax over the same
batches. Through masked failures, an interruption rolled back, a rerun that
resumes and a process SIGKILLed from outside, every leaf of the final
parameters must equal the reference (fp32 round-off: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import launching as lj
import numpy as np
import pytest
import regression

import spare_jax
from spare_jax import errors

STEPS = 12


def _step():
    mesh = spare_jax.make_mesh((1, 4, 2))
    return spare_jax.make_train_step(
        regression.loss_fn, regression.OPTIMIZER, mesh, redundancy=2, microbatches=2
    )


def _same(params, reference) -> None:
    assert sorted(params) == sorted(reference)
    for name, want in reference.items():
        assert isinstance(params[name], np.ndarray)
        np.testing.assert_allclose(params[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_masked_failures_and_a_rollback_end_on_the_reference(tmp_path):
    seen = []
    result = spare_jax.fit(
        _step(),
        regression.init_params(),
        regression.batches,
        steps=STEPS,
        workdir=str(tmp_path),
        failures="3:1,6:2,6:3",  # with 1 dead, 2 and 3 leave shards 2 and 3 no live holder
        checkpoint_steps=4,
        on_step=seen.append,
    )
    _same(result.params, lj.reference_params(STEPS))
    assert result.summary == json.loads((tmp_path / "summary.json").read_text())
    assert result.summary["rollbacks"] == 1 and result.summary["final_step"] == STEPS
    (rollback,) = lj.events(tmp_path, "rollback")
    assert (rollback["from_step"], rollback["to_step"], rollback["uncovered"]) == (6, 4, [2, 3])
    assert [r["step"] for r in seen] == [*range(6), *range(4, STEPS)]
    assert [r["live_groups"] for r in seen[:6]] == [4, 4, 4, 3, 3, 3]
    # One meaning of live_groups, a count, in the records and the summary; the ids apart.
    assert result.summary["live_groups"] == 4  # the rollback replaced every failed group
    assert result.summary["live_group_ids"] == [0, 1, 2, 3]
    assert [e["step"] for e in lj.events(tmp_path, "checkpoint")] == [4, 8, 12]


def test_a_rerun_resumes_and_a_longer_one_continues(tmp_path):
    step, params = _step(), regression.init_params()
    spare_jax.fit(step, params, regression.batches, steps=8, workdir=str(tmp_path))
    again = spare_jax.fit(step, params, regression.batches, steps=8, workdir=str(tmp_path))
    assert lj.events(tmp_path, "resume")[-1]["step"] == 8
    _same(again.params, lj.reference_params(8))
    longer = spare_jax.fit(step, params, regression.batches, steps=STEPS, workdir=str(tmp_path))
    _same(longer.params, lj.reference_params(STEPS))
    steps = [r["step"] for r in lj.records(tmp_path) if "loss" in r]
    assert steps == list(range(STEPS)), "each step once: the rerun started where the last ended"


def test_params_given_as_a_function_are_built_once_and_only_when_starting_afresh(tmp_path):
    import jax

    built = []  # entries while the building program runs (a trace records nothing)

    def build():
        jax.debug.callback(lambda: built.append(1))
        return regression.initial_params()

    step = _step()
    first = spare_jax.fit(step, build, regression.batches, steps=8, workdir=str(tmp_path))
    ran = len(built)
    assert ran >= 1
    _same(first.params, lj.reference_params(8))
    longer = spare_jax.fit(step, build, regression.batches, steps=STEPS, workdir=str(tmp_path))
    assert len(built) == ran, "a resumed job takes the checkpoint's state and builds nothing"
    _same(longer.params, lj.reference_params(STEPS))


def test_jax_array_params_and_batches_are_taken_as_they_are(tmp_path):
    import jax

    params = jax.device_put(regression.init_params())
    result = spare_jax.fit(
        _step(),
        params,
        lambda t: jax.device_put(regression.batches(t)),
        steps=4,
        workdir=str(tmp_path),
        failures={2: [0]},
    )
    _same(result.params, lj.reference_params(4))


def test_a_non_finite_loss_stops_with_its_status_and_keeps_the_last_good_state(tmp_path):
    def poisoned(t):
        batch = regression.batches(t)
        if t == 3:
            batch["y"][0] = np.nan
        return batch

    with pytest.raises(errors.NonFiniteLoss, match="step 3") as err:
        spare_jax.fit(
            _step(), regression.init_params(), poisoned, steps=STEPS, workdir=str(tmp_path)
        )
    assert err.value.exit_status == 4
    assert (tmp_path / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"steps": 0}, "steps"),
        ({"batches": 3}, "batches must be a function"),
        ({"step": "step"}, "make_train_step"),
        ({"failures": 3.5}, "failures must be"),
        ({"failures": "3-1"}, "bad failure"),
        ({"failures": "3:9"}, "group must lie"),
        ({"checkpoint_steps": 0}, "checkpoint_steps"),
        ({"keep": 0}, "keep"),
        ({"gpu_mtbf_hours": -1.0}, "gpu_mtbf_hours"),
        ({"batches": lambda t: regression.batches(t, rows=12)}, "G\\*m\\*b rows"),
        ({"batches": lambda t: {"x": np.zeros((32, 8)), "y": np.zeros(31)}}, "leading"),
        ({"params": lambda seed: regression.initial_params()}, "called with no arguments"),
    ],
)
def test_bad_arguments_are_named_before_any_work(tmp_path, change, match):
    args = {
        "step": _step(),
        "params": regression.init_params(),
        "batches": regression.batches,
        "steps": 4,
        "workdir": str(tmp_path / "run"),
        **change,
    }
    with pytest.raises(ValueError, match=match):
        spare_jax.fit(args.pop("step"), args.pop("params"), args.pop("batches"), **args)
    assert not (tmp_path / "run").exists()  # no file, no checkpoints/, not even the directory


def test_a_params_function_that_returns_no_arrays_is_named_in_one_line():
    with pytest.raises(ValueError, match=r"^params\(\): .*not a valid JAX type"):
        _step().init(lambda: "weights")


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="not a directory"):
        spare_jax.fit(
            _step(),
            regression.init_params(),
            regression.batches,
            steps=2,
            workdir=str(tmp_path / "file"),
        )
    assert (tmp_path / "file").read_text() == "mine"


def test_a_warm_spare_that_reaches_fit_unplaced_stops_before_any_file(tmp_path, monkeypatch):
    """A launcher's spare waits in spare_jax.initialize(); a script that skips it must not
    train alone beside the job, in its work directory."""
    monkeypatch.setenv("SPARE_JAX_SPARE", "1")
    with pytest.raises(RuntimeError, match="call spare_jax.initialize\\(\\) first"):
        spare_jax.fit(
            _step(),
            regression.init_params(),
            regression.batches,
            steps=2,
            workdir=str(tmp_path / "run"),
        )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # starts processes: run after the README's command
def test_a_process_sigkilled_from_outside_resumes_when_rerun(tmp_path, tmp_path_factory):
    env = lj.env(tmp_path_factory.mktemp("cache"))
    command = lj.regression_command(tmp_path, "--steps=40", "--checkpoint_steps=5")
    proc = subprocess.Popen(
        command, cwd=lj.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while not lj.events(tmp_path, "checkpoint") or len(lj.records(tmp_path)) < 14:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    done = subprocess.run(
        command, cwd=lj.ROOT, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (resume,) = lj.events(tmp_path, "resume")
    assert resume["step"] % 5 == 0 and resume["step"] > 0
    with np.load(tmp_path / "params-0.npz") as got:
        _same(dict(got), lj.reference_params(40))
    lj.steps_of_last_attempt_are_contiguous(tmp_path, 40)


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("balance", "balance=True is off in a one-process job"),
        ("sharded_checkpoints", "sharded_checkpoints=True changes nothing in a one-process job"),
    ],
)
def test_a_multi_process_option_in_one_process_says_so_and_trains_exactly(
    tmp_path, capsys, option, said
):
    steps = 3
    result = spare_jax.fit(
        _step(),
        regression.init_params(),
        regression.batches,
        steps=steps,
        workdir=str(tmp_path),
        **{option: True},
    )
    err = capsys.readouterr().err
    assert said in err, err[-2000:]
    assert not lj.events(tmp_path, "straggler")
    _same(result.params, lj.reference_params(steps))


def test_a_worker_imports_and_steps_without_scipy(tmp_path):
    """SciPy, about a fifth of a new worker's imports here, waits until the run needs it.

    A replacement's start to its first step is mostly imports (docs/multihost.md,
    "Where a new process's time goes"). Nothing before the first step needs SciPy: the
    interval model runs once steps are measured, max-flow only for placements that are
    not rings, the graph of failure domains only for groups spanning processes. Checked
    in fresh interpreters: the LM's worker imported; the regression's worker imported,
    a run with a masked failure, and the failure domains of whole groups.
    """
    run = (
        "import numpy as np\n"
        "import regression, spare_jax\n"
        "from spare_jax import domains\n"
        "seen = ['scipy' in sys.modules]\n"
        "step = spare_jax.make_train_step(regression.loss_fn, regression.OPTIMIZER,\n"
        "    spare_jax.make_mesh((1, 4, 2)), redundancy=2, microbatches=2)\n"
        "spare_jax.fit(step, regression.init_params(), regression.batches, steps=4,\n"
        "    workdir=sys.argv[1], failures='2:1', checkpoint_steps=2,\n"
        "    on_step=lambda record: seen.append('scipy' in sys.modules))\n"
        "domains.failure_domains(np.array([[0, 0], [0, 0], [1, 1], [2, 2]]))\n"
        "seen.append('scipy' in sys.modules)\n"
    )
    lm = "import train\nseen = ['scipy' in sys.modules]\n"
    path = (
        "import sys\n"
        f"sys.path.insert(0, {str(lj.ROOT / 'experiments')!r})\n"
        "import jax\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
    )
    for code, want in ((lm, [False]), (run, [False] * 6)):
        done = subprocess.run(
            [sys.executable, "-c", path + code + "print(seen)", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=lj.env(tmp_path / "cache"),
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == str(want)

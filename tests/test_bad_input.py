"""Bad input to the binaries: one line on stderr, exit status 2, nothing written.

Every binary of the analysis and simulation side (experiments/plan.py,
overhead.py, reproduce.py; benchmarks/analysis.py, reorder.py, sim.py) runs in
a subprocess, from an empty working directory, with bad input of each class:
unknown flags and stray arguments, malformed, negative or non-finite values,
absurd sizes, bad config files and overrides, and output locations that cannot
be written. Each must exit with status 2, print nothing on stdout and exactly
one line on stderr (no traceback, no log line before it), and leave its
working directory as it was, and the repository's output files (`_repo_state`)
too.

`CASES` is a plain table of (binary, args, description): add a row to cover a
new binary or a new kind of mistake. Values that are better drawn than listed
(non-finite floats, negative counts) come from hypothesis. Ctrl-C and
symlinked output files are tested at the end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import csv
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import hypothesis
import pytest
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN = "experiments/plan.py"
OVERHEAD = "experiments/overhead.py"
REPRODUCE = "experiments/reproduce.py"
BENCH_ANALYSIS = "benchmarks/analysis.py"
BENCH_REORDER = "benchmarks/reorder.py"
BENCH_SIM = "benchmarks/sim.py"
TRAIN = "experiments/train.py"
LAUNCH = "experiments/launch.py"
LAUNCHER = "spare_jax/launch.py"
REGRESSION = "experiments/regression.py"
VALIDATE = "experiments/validate.py"
BINARIES = (
    PLAN,
    OVERHEAD,
    REPRODUCE,
    BENCH_ANALYSIS,
    BENCH_REORDER,
    BENCH_SIM,
    TRAIN,
    LAUNCH,
    VALIDATE,
    REGRESSION,
)
# A file the working directory holds, for output locations that name a file.
BLOCKER = "blocker.txt"
TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad invocation: the binary (relative to the repository), its arguments, why bad."""

    binary: str
    args: tuple[str, ...]
    description: str

    @property
    def id(self) -> str:
        return f"{pathlib.Path(self.binary).stem}: {self.description}"


def _cases(binary: str, *rows: tuple[tuple[str, ...], str]) -> list[Case]:
    return [Case(binary, args, description) for args, description in rows]


# Every binary: the command-line plumbing of spare_jax.cli.
COMMON = [
    (("--bogus=1",), "unknown flag"),
    (("stray",), "stray positional argument"),
]

CASES = [
    *(case for binary in BINARIES for case in _cases(binary, *COMMON)),
    *_cases(
        PLAN,
        (("--gpus=abc",), "malformed integer"),
        (("--gpus=-5",), "negative GPUs"),
        (("--gpus=1000000000000",), "absurd size: 10^12 GPUs"),
        (("--gpus=100",), "GPUs not a multiple of the group size"),
        (("--gpus_per_group=0",), "zero GPUs per group"),
        (("--restart_s=nan",), "NaN restart cost"),
        (("--gpu_mtbf_hours=inf",), "infinite MTBF"),
        (("--weibull_shape=0",), "zero Weibull shape"),
        (("--restart_exponent=1e6",), "restart cost overflows"),
        (("--failure_law=gamma",), "unknown failure law"),
        (("--repair=never",), "unknown repair policy"),
        (("--checkpoint_async=maybe",), "malformed bool"),
        (("--redundancy=0",), "zero redundancy"),
        (("--redundancy=2.7",), "fractional redundancy"),
        (("--redundancy=2,x",), "malformed list"),
        (("--redundancy=",), "empty list"),
        (("--redundancy=1000",), "absurd redundancy"),
        (("--gpus=16", "--redundancy=3"), "redundancy above the number of groups"),
        (("--redundancies=0",), "deprecated alias, bad value"),
        (("--microbatches=1000000",), "absurd size: 10^6 micro-batches"),
        (("--microbatches=-8",), "negative micro-batches"),
        (("--scenario=missing.py",), "config file that does not exist"),
        ((f"--scenario={ROOT / 'configs' / 'scenarios.py'}:huge",), "unknown config variant"),
        (("--scenario.nonsense=1",), "override of no config field"),
        (("--scenario.gpus=abc",), "malformed config override"),
        (("--scenario.gpus=-8",), "negative config override"),
        (("--microbatch_tokens=-8192",), "negative micro-batch tokens"),
        (("--microbatch_tokens=0",), "zero micro-batch tokens"),
        (("--sequence_tokens=3000",), "micro-batch not a whole number of sequences"),
        (("--max_global_batch_tokens=-1",), "negative batch cap"),
        (("--max_global_batch_tokens=16777216",), "batch cap below one micro-batch per group"),
        (
            ("--gpus_per_group=600", "--max_global_batch_tokens=16777216", "--microbatches=4,8"),
            "no listed micro-batch count fits the batch cap",
        ),
    ),
    *_cases(
        OVERHEAD,
        (("--groups=abc",), "malformed integer"),
        (("--groups=1",), "too few groups"),
        (("--groups=1000000000",), "absurd size: 10^9 groups"),
        (("--groups=3", "--redundancy=4"), "redundancy above the number of groups"),
        (("--redundancy=x",), "malformed list"),
        (("--redundancy=0",), "zero redundancy"),
        (("--redundancy=1000",), "absurd redundancy"),
        (("--microbatches=1000000",), "absurd micro-batches"),
        (("--trials=0",), "zero trials"),
        (("--trials=1000000000",), "absurd trials"),
        (("--seed=-1",), "negative seed"),
        (("--layout=diagonal",), "unknown layout"),
        (("--placement=diagonal",), "deprecated alias, unknown layout"),
        (("--out=",), "empty output directory"),
        ((f"--out={BLOCKER}",), "output directory is a file"),
        ((f"--out={BLOCKER}/sub",), "output directory under a file"),
        (("--out=/dev/null/sub",), "output directory that cannot be created"),
    ),
    *_cases(
        REPRODUCE,
        (("--replicas=0",), "zero replicas"),
        (("--replicas=1000000000",), "absurd replicas"),
        (("--seed=-1",), "negative seed"),
        (("--seed=1.5",), "fractional seed"),
        (("--quick=maybe",), "malformed bool"),
        (("--out=",), "empty output directory"),
        ((f"--out={BLOCKER}",), "output directory is a file"),
        ((f"--out={BLOCKER}/sub", "--quick"), "output directory under a file"),
        (("--microbatch_tokens=-1",), "negative micro-batch tokens"),
        (("--max_global_batch_tokens=8192",), "batch cap below one micro-batch per group"),
        (("--parts=bogus",), "unknown part"),
        (("--parts=reduction",), "a part without the one it needs"),
    ),
    *_cases(
        BENCH_ANALYSIS,
        (("--repeats=0",), "zero repeats"),
        (("--repeats=1000000000",), "absurd repeats"),
        (("--samples=0", "--validate"), "zero samples"),
        (("--gpus=0",), "zero GPUs"),
        (("--gpus=1000000000000",), "absurd size: 10^12 GPUs"),
        (("--gpus=nan",), "non-integer GPUs"),
    ),
    *_cases(
        BENCH_REORDER,
        (("--repeats=0",), "zero repeats"),
        (("--repeats=1000000000",), "absurd repeats"),
        (("--seed=-1",), "negative seed"),
        (("--groups=4",), "too few groups"),
        (("--groups=1000000000000",), "absurd size: 10^12 groups"),
        (("--flow_groups=-10",), "negative groups"),
    ),
    *_cases(
        BENCH_SIM,
        (("--repeats=0",), "zero repeats"),
        (("--replicas=-1",), "negative replicas"),
        (("--replicas=1000000000",), "absurd replicas"),
        (("--trials=0",), "zero trials"),
        (("--gpus=1000000000000",), "absurd size: 10^12 GPUs"),
        (("--gpus=12",), "GPUs not a multiple of the group size"),
        (("--work_hours=nan",), "NaN work"),
        (("--work_hours=-1",), "negative work"),
    ),
    *_cases(
        TRAIN,
        (("--strategy=raid",), "unknown strategy"),
        (("--policy=greedy",), "unknown policy"),
        (("--redundancy=0",), "zero redundancy"),
        (("--redundancy=9",), "redundancy above the number of groups"),
        (("--strategy=replication", "--redundancy=3"), "replication r not dividing G"),
        (("--microbatches=100000",), "absurd micro-batches"),
        (("--steps=0",), "zero steps"),
        (("--steps=1000000000",), "absurd steps"),
        (("--seed=-1",), "negative seed"),
        (("--failures=3-1",), "malformed failure"),
        (("--failures=9999:1",), "failure past the last step"),
        (("--failures=1:9",), "failure of a group that does not exist"),
        (("--failures=1:1", "--failure_rate=0.1"), "a schedule and a rate at once"),
        (("--failure_rate=nan",), "NaN failure rate"),
        (("--failure_rate=2",), "failure rate above 1"),
        (("--repair_steps=-2",), "negative repair steps"),
        (("--checkpoint_steps=-1",), "negative checkpoint interval"),
        (("--config.learning_rate=nan",), "NaN learning rate"),
        (("--config.learning_rate=-0.1",), "negative learning rate"),
        (("--config.log_every=0",), "zero log interval"),
        (("--config.batch=100000000",), "absurd batch"),
        (("--config.model.heads=3",), "heads not dividing the width"),
        (("--config.mesh=(2,4,2)",), "a mesh larger than the devices"),
        (("--config.data.kind=file",), "token file not named"),
        (("--config.data.kind=file", "--config.data.path=missing.bin"), "missing token file"),
        (
            (
                "--config.data.kind=file",
                f"--config.data.path={BLOCKER}",
                "--config.model.seq_len=2",
            ),
            "token ids outside the vocabulary",
        ),
        (("--config=missing.py",), "config file that does not exist"),
        (("--config.nope=1",), "override of no config field"),
        (("--workdir=",), "empty work directory"),
        ((f"--workdir={BLOCKER}",), "work directory is a file"),
        ((f"--workdir={BLOCKER}/sub",), "work directory under a file"),
        (("--num_processes=2",), "a multi-process job without an address"),
        (
            ("--coordinator_address=localhost:1", "--num_processes=2", "--process_id=5"),
            "process id out of range",
        ),
        (("--host_devices=0",), "zero devices"),
    ),
    *_cases(
        LAUNCH,
        (("--processes=0",), "zero processes"),
        (("--processes=3",), "processes not dividing the devices"),
        (("--config.mesh=(1,2,3)", "--processes=3"), "a process holding parts of two groups"),
        (("--devices_per_process=3",), "devices per process not matching the mesh"),
        (("--kill=5:9",), "kill of a process that does not exist"),
        (("--kill=999:1",), "kill past the last step"),
        (("--kill=abc",), "malformed kill"),
        (("--kill=5:1", "--kill=6:1"), "one process killed twice"),
        (("--strategy=raid",), "a bad train.py flag"),
        (("--workdir=",), "empty work directory"),
    ),
    *_cases(
        LAUNCHER,
        ((), "no worker command"),
        (("--processes=0", "--", "true"), "zero processes"),
        (("--kill=abc", "--", "true"), "malformed kill"),
        (("--kill=1:7", "--", "true"), "kill of a process that does not exist"),
        (("--kill=1:1", "--kill=2:1", "--", "true"), "one process killed twice"),
        ((f"--launch_dir={BLOCKER}", "--", "true"), "launch directory is a file"),
        (("--heartbeat_s=0", "--", "true"), "zero heartbeat"),
        (("--devices_per_process=0", "--", "true"), "zero devices"),
        (("--replace_after_s=-1", "--", "true"), "negative replacement delay"),
        (("--spares=1", "--", "true"), "spares with no replacement"),
        (("--spares=-1", "--replace_after_s=0", "--", "true"), "negative spares"),
    ),
    *_cases(
        REGRESSION,
        (("--mesh=data:1,fsdp",), "a mesh axis without a size"),
        (("--mesh=1,2",), "two mesh sizes"),
        (("--mesh=data:1,redundancy:1,fsdp:2",), "a mesh of one group"),
        (("--mesh=data:1,redundancy:4,fsdp:3",), "a mesh larger than the devices"),
        (("--input=shards",), "an unknown input form"),
        (("--steps=0",), "zero steps"),
        (("--workdir=",), "empty work directory"),
    ),
    *_cases(
        VALIDATE,
        (("--groups=abc",), "malformed list"),
        (("--groups=1",), "too few groups"),
        (("--redundancy=0",), "zero redundancy"),
        (("--map_gradients=x",), "malformed gradient sizes"),
        (("--map_gradients=-1",), "negative gradient size"),
        (("--map_gradients=inf",), "infinite gradient size"),
        (("--epochs=0",), "zero epochs"),
        (("--step_compute_s=0",), "zero step time"),
        (("--bandwidth_Bps=-1",), "negative bandwidth"),
        ((f"--out={BLOCKER}",), "output directory is a file"),
    ),
]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run did: exit status, output streams, files left in its working directory."""

    returncode: int
    stdout: str
    stderr: str
    files: tuple[str, ...]


_SKIP_DIRS = {".git", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__"}
_OUTPUT_SUFFIXES = {".csv", ".png", ".json", ".jsonl"}


def _repo_state() -> dict[str, tuple[int, int]]:
    """(mtime, size) of the repository's output-like files: what a binary of ours writes.

    CSV, PNG and JSON files, `summary.md`, and everything under `runs/`. Sources
    are left out: other work may edit them while the test runs.
    """
    state = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".venv")]
        for name in filenames:
            path = pathlib.Path(dirpath) / name
            rel = path.relative_to(ROOT)
            if path.suffix in _OUTPUT_SUFFIXES or name == "summary.md" or rel.parts[0] == "runs":
                info = path.stat()
                state[str(rel)] = (info.st_mtime_ns, info.st_size)
    return state


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


def run_case(binary: str, args: tuple[str, ...], timeout: float = TIMEOUT_S) -> Outcome:
    """Run `binary` with `args` from a fresh empty working directory (holding only BLOCKER)."""
    with tempfile.TemporaryDirectory() as cwd:
        (pathlib.Path(cwd) / BLOCKER).write_text("not a directory\n")
        env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
        done = subprocess.run(
            [sys.executable, str(ROOT / binary), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        files = tuple(
            sorted(str(p.relative_to(cwd)) for p in pathlib.Path(cwd).rglob("*") if p.is_file())
        )
        assert (pathlib.Path(cwd) / BLOCKER).read_text() == "not a directory\n"
    return Outcome(done.returncode, done.stdout, done.stderr, files)


def assert_refused(outcome: Outcome, what: str) -> None:
    """Exit 2, nothing on stdout, exactly one line on stderr, nothing written."""
    lines = outcome.stderr.splitlines()
    assert outcome.returncode == 2, (what, outcome)
    assert "Traceback" not in outcome.stderr, (what, outcome.stderr)
    assert len(lines) == 1 and lines[0].strip(), (what, outcome.stderr)
    assert outcome.stdout == "", (what, outcome.stdout)
    assert outcome.files == (BLOCKER,), (what, outcome.files)


# The binaries that import JAX take about 3 s to refuse anything: beyond the
# rows every binary has, theirs run with the slow tests.
_HEAVY = (TRAIN, LAUNCH, REGRESSION)


def _param(case: Case):
    common = case.args in {args for args, _ in COMMON}
    slow = case.binary in _HEAVY and not common
    return pytest.param(case, id=case.id, marks=pytest.mark.slow if slow else ())


@pytest.fixture(scope="module")
def outcomes(request) -> dict[Case, Outcome]:
    """The selected cases of CASES, run two at a time; the repository must not change meanwhile."""
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.originalname == "test_bad_input_is_refused" and item.module.__name__ == __name__
    ]
    before = _repo_state()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {case: pool.submit(run_case, case.binary, case.args) for case in selected}
        results = {case: future.result() for case, future in futures.items()}
    assert _changed(before, _repo_state()) == []
    return results


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input_is_refused(case, outcomes):
    assert_refused(outcomes[case], case.id)


def test_every_binary_is_covered():
    """At least 8 table rows per binary; the counts are printed (pytest -s shows them)."""
    counts = collections.Counter(case.binary for case in CASES)
    print("\nbad inputs per binary (table rows):")
    for binary in BINARIES:
        print(f"  {binary}: {counts[binary]}")
    print(
        f"  drawn by hypothesis: {NON_FINITE_EXAMPLES} non-finite or negative numbers to "
        f"{PLAN}, {NEGATIVE_EXAMPLES} negative integers over {len(NEGATIVE_FLAGS)} flags"
    )
    assert all(counts[binary] >= 8 for binary in BINARIES), counts


# ---------------------------------------------------------------- drawn values

NON_FINITE_EXAMPLES = 6
PLAN_FLOAT_FLAGS = (
    "gpu_mtbf_hours",
    "work_hours",
    "checkpoint_s",
    "restart_s",
    "restart_exponent",
    "mttr_hours",
    "weibull_shape",
    "microbatch_overhead",
    "domain_failure_fraction",
)


@hypothesis.settings(max_examples=NON_FINITE_EXAMPLES, deadline=None, database=None)
@hypothesis.given(
    flag=st.sampled_from(PLAN_FLOAT_FLAGS),
    value=st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity"])
    | st.floats(max_value=-1e-6, allow_infinity=False).map(repr),
)
def test_plan_refuses_non_finite_and_negative_numbers(flag, value):
    assert_refused(run_case(PLAN, (f"--{flag}={value}", "--json")), f"--{flag}={value}")


NEGATIVE_EXAMPLES = 8
NEGATIVE_FLAGS = (
    (OVERHEAD, "seed"),
    (OVERHEAD, "trials"),
    (REPRODUCE, "seed"),
    (REPRODUCE, "replicas"),
    (BENCH_ANALYSIS, "repeats"),
    (BENCH_REORDER, "seed"),
    (BENCH_SIM, "replicas"),
    (PLAN, "gpus"),
    (PLAN, "microbatch_tokens"),
    (PLAN, "max_global_batch_tokens"),
)


@hypothesis.settings(max_examples=NEGATIVE_EXAMPLES, deadline=None, database=None)
@hypothesis.given(target=st.sampled_from(NEGATIVE_FLAGS), value=st.integers(max_value=-1))
def test_negative_counts_and_seeds_are_refused(target, value):
    binary, flag = target
    before = _repo_state()
    assert_refused(run_case(binary, (f"--{flag}={value}",)), f"{binary} --{flag}={value}")
    assert _changed(before, _repo_state()) == []


# ---------------------------------------------------------------- help, outputs, Ctrl-C


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_exits_zero(flag):
    outcome = run_case(PLAN, (flag,))
    assert outcome.returncode == 0 and "--redundancy" in outcome.stdout, outcome
    assert outcome.files == (BLOCKER,)


def test_symlinked_output_file_is_replaced_not_followed(tmp_path):
    """A symlink in the output directory is replaced; the file it points to is untouched."""
    victim = tmp_path / "victim.csv"
    victim.write_text("keep me\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.csv").symlink_to(victim)
    done = subprocess.run(
        [sys.executable, str(ROOT / OVERHEAD), "--groups=60", "--trials=1", "--redundancy=2"]
        + ["--microbatches=1", f"--out={out}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert victim.read_text() == "keep me\n"
    assert not (out / "summary.csv").is_symlink()
    assert list(csv.DictReader((out / "summary.csv").read_text().splitlines()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim.csv"]


def test_ctrl_c_exits_130_and_keeps_finished_files(tmp_path):
    """SIGINT to the process group (as a terminal's Ctrl-C) while reproduce.py runs a pool."""
    out = tmp_path / "out"
    first = out / "overhead_vs_redundancy.csv"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / REPRODUCE), "--quick", "--replicas=2", f"--out={out}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120  # about 3 s on an idle machine
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists() and proc.poll() is None, "reproduce.py never reached its 2nd part"
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.splitlines()[-1].strip().endswith("interrupted"), stderr
    assert "wrote" not in stdout
    rows = list(csv.DictReader(first.read_text().splitlines()))
    assert rows and all(None not in row.values() for row in rows)  # complete, not truncated
    assert all(not p.name.startswith(".") for p in out.iterdir())  # no temporary file left
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker left behind


def test_plan_does_not_import_jax():
    """plan.py starts fast: neither it nor the analysis imports JAX."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / PLAN)!r}, '--help']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('jax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "False"

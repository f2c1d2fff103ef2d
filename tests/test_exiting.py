"""How a worker ends: its exit bounded on every Python, one line for a `FitError`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from spare_jax import runlog


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_a_joined_process_exits_cleanly_whatever_the_python():
    """Python 3.12 refuses new threads during shutdown: the bound on the exit must not need
    one then (it once printed "can't create new thread at interpreter shutdown" at every
    exit, which the launcher took for the worker's error)."""
    done = _run(
        """
        from spare_jax import exiting
        exiting.install_handlers(joined=True)
        print("done", flush=True)
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_exit_stuck_in_leaving_the_job_is_cut_short():
    """A shutdown that hangs (a stand-in for waiting on dead peers) ends after the bound (1 s
    here), not when the shutdown returns (60 s)."""
    start = time.monotonic()
    done = _run(
        """
        import time, jax
        from spare_jax import exiting
        exiting.LEAVE_S = 1.0
        exiting.install_handlers(joined=True)
        jax.distributed.shutdown = lambda: time.sleep(60)
        print("done", flush=True)
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"
    assert time.monotonic() - start < 30, "the exit waited for the shutdown"


@pytest.mark.parametrize("joined", [True, False])
def test_a_fit_error_exits_with_its_status_on_one_line(joined, tmp_path):
    done = _run(
        f"""
        from spare_jax import errors, exiting
        exiting.install_handlers(joined={joined})
        raise errors.Relaunch("the peers are gone")
        """,
        env={**os.environ, "SPARE_JAX_LAUNCH_DIR": str(tmp_path)},  # as under the launcher
    )
    assert done.returncode == 75, done.stderr[-2000:]
    assert done.stderr.strip().endswith("the peers are gone"), done.stderr
    assert "Traceback" not in done.stderr
    # The launcher relays the line from the exit event: output written after it cannot
    # take its place (a Gloo line's tail once did, in CI).
    (event,) = [
        json.loads(x.split(runlog.EVENT, 1)[1])
        for x in done.stdout.splitlines()
        if runlog.EVENT in x
    ]
    assert event["kind"] == "exit" and event["status"] == 75, event
    assert event["line"] == done.stderr.strip().splitlines()[-1], event

"""A joined worker's XLA flags: CPU timeouts and GPU recoverability, the user's values kept."""

import os
import socket
import subprocess
import sys

from spare_jax import multihost


def test_with_flags_adds_what_is_missing_and_keeps_the_users_values() -> None:
    got = multihost.with_flags(
        "--xla_gpu_nccl_async_execution=false --other=1",
        ["--xla_gpu_nccl_async_execution=true", "--xla_gpu_nccl_terminate_on_error=false"],
    )
    assert got.split() == [
        "--xla_gpu_nccl_async_execution=false",
        "--other=1",
        "--xla_gpu_nccl_terminate_on_error=false",
    ]
    assert multihost.with_flags("", ["--a=1"]) == "--a=1"


def test_a_joined_worker_sets_the_recovery_flags_and_its_backend_accepts_them() -> None:
    """XLA aborts on a flag its build does not know: every flag set here must parse on CPU too."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    code = (
        "import os, spare_jax, jax\n"
        f"spare_jax.initialize(coordinator_address='localhost:{port}', num_processes=1, "
        "process_id=0)\n"
        "print(float(jax.numpy.ones(3).sum()))\n"
        "print('FLAGS', os.environ['XLA_FLAGS'])\n"
        "print('ABORT', os.environ['XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARE_JAX_")}
    env["XLA_FLAGS"] = "--xla_gpu_nccl_blocking_communicators=true"
    env.pop("XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "3.0" in lines
    flags = next(line for line in lines if line.startswith("FLAGS")).split()[1:]
    assert "--xla_gpu_nccl_blocking_communicators=true" in flags  # the user's, not ours
    assert "--xla_gpu_nccl_blocking_communicators=false" not in flags
    assert "--xla_gpu_nccl_terminate_on_error=false" in flags
    assert any(f.startswith("--xla_cpu_collective_timeout_seconds=") for f in flags)
    assert "ABORT 1" in lines

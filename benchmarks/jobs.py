"""Helpers the multi-process benchmarks share: finding a job's worker, reading its peak memory,
sizing what it wrote."""

from __future__ import annotations

import pathlib

SCRIPTS = ("train.py", "regression.py", "rejoin_state.py")


def worker_pid(workdir: str, process: int) -> int:
    """The pid of worker ``process`` of the job in ``workdir``, found through /proc.

    A worker is a process of one of `SCRIPTS` whose command line names the
    job's ``--workdir`` and whose environment carries its process id, as
    `spare_jax.launch` starts it.

    Raises:
        RuntimeError: no such worker runs.
    """
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        script = any(name in cmdline for name in SCRIPTS)
        mine = f"--workdir={workdir}" in cmdline and script
        if mine and f"SPARE_JAX_PROCESS_ID={process}".encode() in environ:
            return int(entry.name)
    raise RuntimeError(f"no worker {process} of {workdir} found")


def peak_bytes(pid: str | int = "self") -> int:
    """A process's peak resident memory so far (``VmHWM``), bytes; 0 when it reports none."""
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def disk_bytes(path: pathlib.Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

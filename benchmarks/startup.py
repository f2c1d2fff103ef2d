"""A worker's start: seconds from a new Python process to its script's imports done.

    python benchmarks/startup.py                        # 9 starts alone, 9 rounds of 4 at once
    python benchmarks/startup.py --module=spare_jax --starts=5 --concurrent=1

Every new worker pays this before the library does anything: a replacement
that re-joins (the ``rejoin`` event's ``start_s`` is mostly this), each
process of a relaunched job, and each subprocess of the multi-process tests.
Each start is ``python -X importtime -c "import MODULE"`` in a fresh process
from the repository's root (``--module``: ``experiments.train``, the LM's
worker, unless told). Printed, medians over ``--starts``: the process's wall
seconds from spawn to exit, and the import seconds of the packages that weigh
most: each top-level package's own modules (``jax`` is ``jax._src`` too,
never ``ml_dtypes`` or ``numpy``; the figures add up to the imports). Alone, then ``--concurrent``
starts at once, as a relaunch starts every worker of a host together (the
machine's cores shared between them). The versions that set these figures
are printed first; ``--out`` appends the figures as one JSON line to
``startup.jsonl`` there.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from concurrent import futures

from absl import app, flags

from spare_jax import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]

_MODULE = flags.DEFINE_string("module", "experiments.train", "The module a worker imports.")
_STARTS = flags.DEFINE_integer(
    "starts", 9, "Starts (or rounds of starts) per case.", lower_bound=1, upper_bound=100
)
_CONCURRENT = flags.DEFINE_integer(
    "concurrent", 4, "Starts at once in the second case (1: skip it).", lower_bound=1
)
_SHOWN = 8  # packages printed, the heaviest first (--out keeps them all)
_OUT = flags.DEFINE_string("out", "", "Directory to append startup.jsonl to (optional).")

_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def import_seconds(stderr: str) -> dict[str, float]:
    """The whole import's seconds (``total``), and the seconds each top-level package took.

    ``stderr`` is ``python -X importtime``'s output: a line per module with
    the microseconds its own code took and those with what it imported. A
    package's figure is the own time of all its modules (``jax`` is
    ``jax._src.*`` too, never its dependencies), so the figures add up to
    the total.
    """
    own: dict[str, float] = {}
    for line in stderr.splitlines():
        match = _LINE.match(line)
        if match:
            package = match[4].split(".")[0]
            own[package] = own.get(package, 0.0) + int(match[1]) / 1e6
    if not own:
        raise RuntimeError(f"no import times in the output:\n{stderr[-2000:]}")
    return {"total": sum(own.values()), **own}


def _start(module: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def one_round(module: str, concurrent: int) -> list[dict[str, float]]:
    """``concurrent`` fresh processes importing ``module`` at once: each one's figures."""

    def run(began: float) -> dict[str, float]:
        proc = _start(module)
        _, err = proc.communicate(timeout=600)
        wall = time.perf_counter() - began
        if proc.returncode != 0:
            last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
            raise app.UsageError(f"--module={module}: the import failed: {last}")
        return {"wall": wall, **import_seconds(err)}

    with futures.ThreadPoolExecutor(concurrent) as pool:
        began = time.perf_counter()
        return list(pool.map(run, [began] * concurrent))


def versions() -> dict[str, str]:
    """Python's and the versions of the packages that weigh most in a start."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("jax", "jaxlib", "ml_dtypes", "numpy", "flax", "orbax-checkpoint"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median(r[k] for r in rows if k in r), 3) for k in keys}


def main(argv: list[str]) -> None:
    if _OUT.value:
        cli.output_dir("out", _OUT.value)  # before any work
    info = versions()
    print(" ".join(f"{k} {v}" for k, v in info.items()), f"cores {os.cpu_count()}")
    cases = [("alone", 1)]
    if _CONCURRENT.value > 1:
        cases.append((f"{_CONCURRENT.value} at once", _CONCURRENT.value))
    result = {"module": _MODULE.value, "versions": info, "cases": {}}
    for name, k in cases:
        rows = [r for _ in range(_STARTS.value) for r in one_round(_MODULE.value, k)]
        med = medians(rows)
        result["cases"][name] = med
        heavy = sorted((k for k in med if k not in ("wall", "total")), key=lambda k: -med[k])
        parts = ", ".join(f"{p} {med[p]:.3f}" for p in heavy[:_SHOWN])
        print(
            f"import {_MODULE.value}, {name} ({len(rows)} starts, medians, s): "
            f"wall {med['wall']:.3f}, imports {med['total']:.3f}; {parts}"
        )
    if len(cases) == 2:
        alone, together = (result["cases"][n] for n, _ in cases)
        print(f"ratio, {cases[1][0]} / alone: wall {together['wall'] / alone['wall']:.2f}x")
    if _OUT.value:
        with open(os.path.join(_OUT.value, "startup.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    cli.run(main)

"""experiments/exactness.py, the command behind the docs' long-run exactness figures, runs.

A short run of each dtype: dead groups against a failure-free run and a plain
`jax.grad` loop stay within round-off (float32: well under 1e-5 after 30
steps; float64: under 1e-13).
"""

from __future__ import annotations

import json
import subprocess

import launching as lj
import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 1e-5), ("float64", 1e-13)])
def test_dead_groups_stay_within_round_off_of_the_failure_free_run(dtype, bound):
    out = subprocess.run(
        [
            lj.PYTHON,
            str(lj.ROOT / "experiments" / "exactness.py"),
            f"--dtype={dtype}",
            "--steps=30",
            "--json",
        ],
        cwd=lj.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtype"] == dtype and [r["step"] for r in result["rows"]] == [10, 30]
    for row in result["rows"]:
        assert 0 <= row["dead_vs_failure_free"] < bound, row
        assert 0 <= row["dead_vs_jax_grad"] < bound, row
    if dtype == "float64":
        assert result["rows"][-1]["dead_vs_failure_free"] > 0  # not the same run twice

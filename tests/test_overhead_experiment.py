"""The overhead experiment binary: its CSV values hold the claims in miniature.

Bad flags are covered by tests/test_bad_input.py.
"""

import csv
import itertools
import pathlib
import subprocess
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
BINARY = ROOT / "experiments" / "overhead.py"


def _csv(path: pathlib.Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.read_text().splitlines()))


def test_sweep_writes_table_and_csv_values_that_hold_the_claims(tmp_path):
    out = tmp_path / "o"
    result = subprocess.run(
        [sys.executable, str(BINARY), "--groups=240", "--trials=4", "--redundancy=2,3,4"]
        + ["--microbatches=1,4", f"--out={out}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "replication" in result.stdout and "spare_adaptive" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["overhead.csv", "overhead.png", "summary.csv"]

    by = {(int(r["r"]), r["variant"], int(r["m"])): r for r in _csv(out / "summary.csv")}
    assert len(by) == 3 * 4
    for r in (2, 3, 4):
        rep = by[(r, "replication", 1)]
        assert float(rep["overhead_mean"]) == r
        adaptive, fixed = by[(r, "spare_adaptive", 1)], by[(r, "spare_fixed", 1)]
        # Whole shards: any failure costs 2x, and adaptive never loses to fixed order.
        assert 2.0 <= float(adaptive["overhead_mean"]) <= float(fixed["overhead_mean"]) <= r
        assert float(by[(r, "spare_adaptive", 4)]["overhead_mean"]) < float(
            adaptive["overhead_mean"]
        )
        assert adaptive["failures_to_interruption"] == fixed["failures_to_interruption"]

    # The curves behind the figure: one value per dead count, from 1 before any failure.
    curves: dict[tuple[int, str, int], dict[int, tuple[float, int]]] = defaultdict(dict)
    for row in _csv(out / "overhead.csv"):
        key = (int(row["r"]), row["variant"], int(row["m"]))
        curves[key][int(row["dead"])] = (float(row["overhead_mean"]), int(row["trials_alive"]))
    assert set(curves) == set(by)
    for (r, variant, m), curve in curves.items():
        assert curve[0] == ((r if variant == "replication" else 1.0), 4)
        values = [v for v, _ in curve.values()]
        assert all(1.0 <= v <= r for v in values), (r, variant, m)
        alive = [n for _, (_, n) in sorted(curve.items())]
        assert all(a >= b for a, b in itertools.pairwise(alive))
    for r in (2, 3, 4):
        # The same failure orders for every variant: adaptive <= fixed order at each dead
        # count, and more micro-batches never cost more.
        fixed, whole, split = (
            curves[(r, "spare_fixed", 1)],
            curves[(r, "spare_adaptive", 1)],
            curves[(r, "spare_adaptive", 4)],
        )
        assert fixed.keys() == whole.keys() == split.keys()
        for dead in fixed:
            assert split[dead][0] <= whole[dead][0] + 1e-4 <= fixed[dead][0] + 2e-4
        assert all(whole[d][0] >= 2.0 for d in whole if d >= 1)  # 2x from the first failure

"""The run log: append-only, inside the work directory, and the goodput it implies."""

import json
import os

import pytest

from spare_jax import runlog


def test_appends_and_never_truncates(tmp_path):
    log = runlog.RunLog(str(tmp_path))
    log.write({"step": 0, "loss": 1.0, "max_load": 2, "step_time_s": 1.0, "attempt": 0})
    log.close()
    (tmp_path / "metrics.jsonl").open("a").write('{"step": 1, "lo')  # a record cut by a kill
    log = runlog.RunLog(str(tmp_path))
    assert log.next_attempt == 1
    log.event("resume", step=1, restore_s=0.5, attempt=1)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 0 and lines[1] == '{"step": 1, "lo'
    assert json.loads(lines[2])["event"] == "resume"
    assert [r.get("event") for r in runlog.read_records(str(tmp_path / "metrics.jsonl"))] == [
        None,
        "resume",
    ]


def test_refuses_to_follow_a_symlink_out_of_the_workdir(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me\n")
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(outside, work / "metrics.jsonl")
    with pytest.raises(ValueError, match="symbolic link"):
        runlog.RunLog(str(work))
    assert outside.read_text() == "keep me\n"


def test_summary_is_replaced_atomically_and_only_by_the_writer(tmp_path):
    reader = runlog.RunLog(str(tmp_path), writer=False)
    reader.write({"step": 0})
    reader.write_summary({"final_step": 1})
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    writer = runlog.RunLog(str(tmp_path))
    writer.write_summary({"final_step": 2})
    writer.write_summary({"final_step": 3})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_goodput_splits_the_time_budget():
    records = [
        {"step": 0, "max_load": 2, "step_time_s": 1.0, "attempt": 0},
        {"step": 1, "max_load": 3, "step_time_s": 3.0, "attempt": 0},  # m=2: 1/3 is overhead
        {"event": "checkpoint", "step": 2, "save_s": 0.25},
        {"step": 2, "max_load": 2, "step_time_s": 1.0, "attempt": 0},
        {"event": "rollback", "from_step": 3, "to_step": 2, "restore_s": 0.5, "attempt": 1},
        {"step": 2, "max_load": 2, "step_time_s": 2.0, "attempt": 1},  # step 2 again: 1 s lost
        {"event": "process_failure", "step": 3, "detect_s": 1.0},
        {"event": "recovered", "step": 3, "recovery_s": 4.0},
        {"event": "relaunch", "to_step": 2, "relaunch_s": 6.0, "attempt": 2},
        {"event": "resume", "step": 2, "restore_s": 5.0, "attempt": 2},  # inside the relaunch
        {"event": "resume", "step": 2, "restore_s": 0.75, "attempt": 3},
    ]
    g = runlog.goodput(records, microbatches=2)
    assert g["useful_s"] == pytest.approx(1.0 + 2.0 + 2.0)
    assert g["reordering_s"] == pytest.approx(1.0)
    assert g["checkpoint_s"] == pytest.approx(0.25)
    assert g["lost_s"] == pytest.approx(1.0)
    assert g["recovery_s"] == pytest.approx(0.5 + 4.0 + 6.0 + 0.75)
    assert g["total_s"] == pytest.approx(sum(v for k, v in g.items() if k != "total_s"))


def test_a_new_writer_fills_in_the_steps_a_dead_writer_never_recorded(tmp_path):
    writer, other = runlog.RunLog(str(tmp_path)), runlog.RunLog(str(tmp_path), writer=False)
    for t in range(5):
        record = {"step": t, "loss": 1.0, "attempt": 0}
        if t < 3:  # the writer dies after step 4, its records of steps 3 and 4 unwritten
            writer.write(record)
        other.write({**record, "loss": 2.0})
    other.event("failure", step=4, groups=[1])  # events are the writer's: not held
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # and its last line torn by the kill
    other.become_writer()
    other.write({"step": 5, "loss": 2.0, "attempt": 0})
    steps = [(r["step"], r["loss"]) for r in runlog.read_records(str(tmp_path / "metrics.jsonl"))]
    assert steps == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0)]

"""harness.tools.submissions.handin on the reference: the points table and both profiled runs, nothing failed."""

import json

from harness.tools.submissions import handin


def test_handin_writes_points_traces_and_snapshots(tmp_path):
    out = tmp_path / "handin"
    # One quick test case and only the tasks run, to keep this short; students run everything.
    handin.cli(["--impl", "solution/fsdp.py", "--out", str(out), "--runs", "tasks",
                "--", "-q", "-k", "task1_forward and world2-float32-float32"])
    rows = {r["task"]: r for r in json.loads((out / "points.json").read_text())["rows"]}
    # One case of ten ran and passed: not graded (the points need them all), but there.
    assert rows["task 1 forward"]["earned"] is None and "(all passed)" in rows["task 1 forward"]["evidence"], rows
    for who in ("fsdp2", "effdl"):
        for rank in (0, 1):
            assert (out / "tasks" / who / "traces" / f"rank{rank}.json").is_file(), who
            assert (out / "tasks" / who / "snapshots" / f"rank{rank}.pickle").is_file(), who
    summary = (out / "SUMMARY.md").read_text()
    assert "| task 1 forward | - / 3 | not graded" in summary and "Runs that failed" not in summary, summary
    # Each run's overlap picture; no memory test ran in this selection, so no memory.png, said why.
    assert (out / "tasks" / "overlap.png").stat().st_size > 30_000
    assert "- tasks/overlap.png\n- memory.png: not drawn: no memory check ran" in summary, summary

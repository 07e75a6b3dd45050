"""harness.tools.submissions.handin: one command writes the points table and the profiled runs into one folder."""

from pathlib import Path

import pytest

from harness.impl import task1_undone
from harness.tools.submissions import handin

ROOT = Path(__file__).resolve().parents[2]
SKELETON_UNDONE = task1_undone(ROOT / "fsdp.py")


@pytest.mark.skipif(not SKELETON_UNDONE, reason="fsdp.py has task 1 done")
def test_handin_reports_a_failing_run_and_attempted_bonuses(tmp_path):
    """The skeleton: its run stops at TODO(task1), said in SUMMARY.md; FSDP2's run is still there."""
    out = tmp_path / "handin"
    handin.cli(["--impl", "fsdp.py", "--out", str(out), "--no-tests"])
    summary = (out / "SUMMARY.md").read_text()
    assert "Bonuses attempted: none." in summary, summary
    assert "tasks, effdl: TodoError: TODO(task1)" in summary, summary
    assert (out / "tasks" / "fsdp2" / "traces" / "rank0.json").is_file()
    # The overlap picture still drawn, FSDP2's panel alone; no memory.png without the tests.
    assert (out / "tasks" / "overlap.png").is_file()
    assert "- tasks/overlap.png\n- memory.png: not drawn: --no-tests" in summary, summary


def test_attempted_bonuses(tmp_path):
    f = tmp_path / "f.py"
    f.write_text("# TODO(bonus1)\n# TODO(bonus2)\n")
    assert handin.attempted_bonuses(f, None) == ["bonus3"]
    assert handin.attempted_bonuses(f, {"rows": [{"task": "bonus 1", "earned": 1}]}) == ["bonus1", "bonus3"]


def test_summary_shows_the_submissions_text_as_text():
    """The file name, the evidence and a run's error are the submission's words: on the page they
    are text (no link, image, HTML or table cell of theirs), and read as written."""
    hostile = "<script>x</script> ![i](http://e/x.png) [a](javascript:x) | **b** `c`"
    points = {"rows": [{"task": "task 2", "earned": 0, "max": 2, "evidence": hostile}]}
    page = handin.summary(Path("<b>fsdp.py"), True, points, [], ["tasks"], [hostile], "memory.png: drawn",
                          [f"tasks, effdl: RuntimeError: {hostile}"])
    assert "<" not in page and "](" not in page.replace("\\](", ""), page
    assert page.count("|") - page.count("\\|") == 4 * 4, page  # the table's own bars: 4 rows of 4
    assert "&lt;script&gt;x&lt;/script&gt;" in page and "\\*\\*b\\*\\*" in page and "# Hand-in of &lt;b&gt;fsdp.py" in page

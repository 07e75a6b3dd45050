"""The points table: a line earns its points only when every one of its cases ran and passed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tools.submissions import points

ROOT = Path(__file__).resolve().parents[2]

# Stand-ins for test.py's functions, instant: two cases of task 1 forward, one of task 2 fails.
FAKE_TEST = '''
import pytest

@pytest.mark.parametrize("case", ["world2", "world3"])
def test_task1_forward(case):
    pass

def test_task2():
    assert False, "forward all-gathers 0 % hidden"

def test_bonus1():
    pass
'''


def table(tmp_path: Path, *args: str, source: str = FAKE_TEST) -> dict:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test.py").write_text(source)
    out = tmp_path / "points.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test.py",
                           "--points-json", str(out), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.is_file(), proc.stdout + proc.stderr
    return {r["task"]: r for r in json.loads(out.read_text())["rows"]}, proc.stdout


@pytest.mark.parametrize("args, forward", [((), 3), (("-k", "world2 or task2"), None)])
def test_partial_selection_earns_nothing(tmp_path, args, forward):
    rows, stdout = table(tmp_path, *args)
    assert rows["task 1 forward"]["earned"] == forward, (rows, stdout)
    assert rows["task 2"]["earned"] == 0, rows  # a failure costs the line, selection or not
    if forward is None:
        assert "not graded: 1 of its 2 cases ran" in rows["task 1 forward"]["evidence"], rows
        assert "task 1 forward   - / 3   not graded" in stdout, stdout


def test_stop_before_a_line_leaves_it_ungraded(tmp_path):
    rows, stdout = table(tmp_path, "-x", "-k", "task2 or bonus1")
    assert rows["task 2"]["earned"] == 0 and rows["bonus 1"]["earned"] is None, rows
    assert f"total            0 / 2 (of the lines graded; all: {points.TOTAL})" in stdout, stdout


SKIPPING_TEST = '''
import pytest

@pytest.mark.parametrize("case", ["world2", "world3"])
def test_task1_forward(case):
    pass

@pytest.mark.parametrize("case", ["float32", "bfloat16"])
def test_task3_memory(case):
    if case == "bfloat16":
        pytest.skip("all else passed; peaks not compared here")

@pytest.mark.skip(reason="needs two GPUs")
def test_bonus1():
    pass

def test_bonus2():
    pytest.skip("not on this platform")
    assert False
'''


def test_a_skip_is_never_a_failure(tmp_path):
    """A case skipped inside a test body (or by a mark) leaves its line ungraded, with the reason
    as text; the other lines are graded as usual."""
    (tmp_path / "test.py").write_text(SKIPPING_TEST)
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    out = tmp_path / "points.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test.py",
                           f"--points-json={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = {r["task"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["task 1 forward"]["earned"] == 3, rows
    for line, reason in (("task 3", "all else passed; peaks not compared here"), ("bonus 1", "needs two GPUs"),
                         ("bonus 2", "not on this platform")):
        assert rows[line]["earned"] is None, rows[line]
        assert rows[line]["evidence"].startswith("not graded: 1 of its ") and rows[line]["evidence"].endswith(
            f"cases skipped: {reason}"), rows[line]
    assert "('" not in proc.stdout and "Skipped:" not in proc.stdout.split("points")[-1], proc.stdout
    assert "task 3           - / 2   not graded: 1 of its 2 cases skipped: all else passed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("page", ["README.md", "docs/grading.md"])
def test_readme_table_is_the_points_table(page):
    """The points tables (the README's short one, the grading page's in full) list the lines of
    harness/tools/submissions/points.py, in order, with their points and tests: the table is defined once, and
    the pages follow it."""
    text = (ROOT / page).read_text()
    rows = re.findall(r"^\| ([a-z0-9 ]+): (\d+) \| (.*?) \|", text, re.M)
    assert [(name, int(n)) for name, n, _ in rows] == [(line.name, line.points) for line in points.LINES], rows
    for (_, _, tests), line in zip(rows, points.LINES):
        for test in line.tests:
            assert f"`{test}[" in tests or f"`{test}`" in tests, (line.name, test, tests)
    assert f"total           {points.TOTAL} / {points.TOTAL}" in text


def test_earned_exits_zero_only_for_a_line_earned_in_full(tmp_path, capsys):
    """`python -m harness.tools.submissions.points --earned LINE FILE`: what each GitHub Classroom grader step runs."""
    rows, _ = table(tmp_path)
    out = str(tmp_path / "points.json")
    points.cli(["--earned", "task 1 forward", out])  # earned: returns, exit 0
    assert "task 1 forward: 3 / 3   2 cases pass" in capsys.readouterr().out
    for line, code, said in [("task 2", 1, "task 2: 0 / 2   1 of 1 cases fail: forward all-gathers 0 % hidden"),
                             ("task 3", 1, "task 3: - / 2   not run"),
                             ("task 4", 2, "is no line of the points table: give one of 'task 1 forward'")]:
        with pytest.raises(SystemExit) as e:
            points.cli(["--earned", line, out])
        captured = capsys.readouterr()
        assert e.value.code == code and said in captured.out + captured.err, (line, captured)
    with pytest.raises(SystemExit) as e:
        points.cli(["--earned", "task 1 forward", str(tmp_path / "missing.json")])
    assert e.value.code == 1 and "stopped before writing the points table" in capsys.readouterr().err


def test_a_stop_at_a_todo_is_named(tmp_path):
    """The skeleton fails on its ranks: the line's evidence is the TODO it stopped at (deep in the
    rank's traceback), not the error's first line."""
    source = FAKE_TEST.replace('assert False, "forward all-gathers 0 % hidden"',
                               'raise RuntimeError("forward_job failed on rank(s) [0, 1]; traceback of rank 0:\\n'
                               '  File fsdp.py, line 9\\nfsdp.TodoError: TODO(task1): all-gather the shards")')
    rows, _ = table(tmp_path, source=source)
    assert rows["task 2"]["evidence"] == "1 of 1 cases fail: stopped at TODO(task1): all-gather the shards", rows

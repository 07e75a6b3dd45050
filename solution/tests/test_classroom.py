"""The GitHub Classroom workflow (.github/workflows/classroom.yml), released with the student
repository: GitHub Classroom's required names, one run of the graded tests, and one grader step per
line of the points table with that line's points, so the workflow and points.LINES never drift.
test_release.py runs its commands in a released repository."""

from __future__ import annotations

from pathlib import Path

import yaml

from harness.tools.submissions.points import LINES

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "classroom.yml"
GRADER = "classroom-resources/autograding-command-grader@v1"
REPORTER = "classroom-resources/autograding-grading-reporter@v1"
SUITE = "uv run pytest test.py --points-json=points.json"


def workflow(path: Path = WORKFLOW) -> dict:
    return yaml.safe_load(path.read_text())


def steps(doc: dict) -> list[dict]:
    (job,) = doc["jobs"].values()
    return job["steps"]


def graders(doc: dict) -> list[dict]:
    return [s for s in steps(doc) if s.get("uses") == GRADER]


def check(doc: dict) -> None:
    """Everything GitHub Classroom and the points table ask of the workflow; AssertionError if not."""
    assert doc["name"] == "Autograding Tests", "GitHub Classroom reads only the workflow named Autograding Tests"
    assert "push" in doc["on"], doc["on"]
    assert list(doc["jobs"]) == ["run-autograding-tests"], "one job, named run-autograding-tests"
    assert doc["permissions"]["checks"] == "write", doc["permissions"]
    all_steps = steps(doc)
    runs = [s["run"] for s in all_steps if "run" in s]
    assert runs == ["uv sync --frozen", SUITE], runs
    suite = next(s for s in all_steps if s.get("run") == SUITE)
    assert suite.get("continue-on-error") is True, "a failing test must not stop the grader steps"
    grading = graders(doc)
    assert [(s["with"]["test-name"], s["with"]["max-score"]) for s in grading] == [(l.name, l.points) for l in LINES]
    for s, line in zip(grading, LINES):
        assert s["with"]["command"] == f'uv run python -m harness.tools.submissions.points --earned "{line.name}" points.json', s
        assert all_steps.index(s) > all_steps.index(suite), f"{line.name} is graded before the tests ran"
    ids = [s["id"] for s in grading]
    assert len(set(ids)) == len(ids), ids
    (reporter,) = [s for s in all_steps if s.get("uses") == REPORTER]
    assert all_steps[-1] is reporter, "the reporter comes last, after every grader"
    assert reporter["with"]["runners"] == ",".join(ids), reporter["with"]
    # the reporter reads each runner's result from <ID in capitals>_RESULTS
    assert reporter["env"] == {f"{i.upper()}_RESULTS": f"${{{{ steps.{i}.outputs.result }}}}" for i in ids}, reporter["env"]


def test_workflow_matches_the_points_table():
    check(workflow())


def test_check_sees_drift(tmp_path):
    """A max-score off by one, a line missing, and a reporter env name that is not the step id each fail."""
    import copy

    import pytest

    good = workflow()
    broken = []
    doc = copy.deepcopy(good)
    graders(doc)[0]["with"]["max-score"] += 1
    broken.append(doc)
    doc = copy.deepcopy(good)
    steps(doc).remove(graders(doc)[-1])
    broken.append(doc)
    doc = copy.deepcopy(good)
    env = steps(doc)[-1]["env"]
    env["TASK_2_RESULTS"] = env.pop("TASK-2_RESULTS")
    broken.append(doc)
    for doc in broken:
        with pytest.raises(AssertionError):
            check(doc)

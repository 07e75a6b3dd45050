"""The release command writes a student repository that installs, tests and grades on its own."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tests import test_docs
from harness.tools.submissions.points import TOTAL
from solution import release
from solution.release import ReleaseError
from solution.tests import test_classroom as classroom

ROOT = release.ROOT
STUDENT_TOP_LEVEL = {".ci", ".github", ".gitignore", ".python-version", ".vscode", "README.md", "conftest.py", "docs", "fsdp.py",
                     "harness", "pyproject.toml", "snapshots", "test.py", "traces", "train.py", "uv.lock"}


# harness tests whose subject is the student's checkout itself: its files, commands, data and the
# handout's commands. The points table there is the classroom steps' below (its rules are the same
# conftest's, tested in this repository's session).
STUDENT_CHECKOUT_TESTS = ("test_layout", "test_cli", "test_assets", "test_handout", "test_docs")


def uv() -> list[str]:
    """uv as `uv run` started us (it sets UV), else from PATH, else as a module."""
    found = os.environ.get("UV") or shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTHONPATH")}
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{' '.join(cmd)}` in {cwd} did not finish within {timeout:.0f} s:\n{(e.stdout or '')[-3000:]}")


def shell(command: str, cwd: Path, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    """A workflow step's command as its runner would run it: in a shell, with uv on PATH (here the
    uv that started us: CI installs none twice), and ENV added."""
    path = f"{Path(uv()[0]).parent}{os.pathsep}{os.environ['PATH']}" if len(uv()) == 1 else os.environ["PATH"]
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTHONPATH")}
    try:
        return subprocess.run(["bash", "-c", command], cwd=cwd, env={**base, "PATH": path, **env}, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"`{command}` in {cwd} did not finish within {timeout:.0f} s:\n{(e.stdout or '')[-3000:]}")


def show(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def share_store(repo: Path) -> None:
    """Give a released repository this checkout's FSDP2 store (its entries and secret), as a grader
    who built both on one machine would: the key holds no path and no pyproject.toml, so the
    released repository's graded runs find FSDP2's side already computed by this session's test.py
    instead of training FSDP2 in every case again. A missing store is simply computed there."""
    from harness.tools.grading import fsdp2_cache

    if fsdp2_cache.folder().is_dir():
        shutil.copytree(fsdp2_cache.folder(), repo / ".cache" / "fsdp2", symlinks=False)


@pytest.fixture(scope="module")
def student_repo(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("release") / "student"
    release.release(dest)
    return dest


def test_student_repository_has_only_the_students_files(student_repo):
    assert {p.name for p in student_repo.iterdir()} - {".git"} == STUDENT_TOP_LEVEL
    assert (student_repo / "uv.lock").read_bytes() == (ROOT / "uv.lock").read_bytes()
    assert (student_repo / "fsdp.py").read_text() == (ROOT / "fsdp.py").read_text()
    readme = (student_repo / "README.md").read_text()
    # the instructors' page stays here, and so does the README's line that links it
    assert (ROOT / release.INSTRUCTORS_PAGE).is_file() and "instructors.md" in (ROOT / "README.md").read_text()
    assert {p.name for p in (student_repo / "docs").iterdir()} == {"grading.md", "measuring.md"}
    assert "instructors.md" not in readme
    for page in test_docs.pages(student_repo):
        assert not (dead := test_docs.dead_links(page, page.read_text())), (page.name, dead)
    for path in student_repo.rglob("*"):
        if path.is_file() and ".git" not in path.parts and path.name != "uv.lock":
            text = path.read_text()
            assert not release.MENTIONS.search(text), f"{path.relative_to(student_repo)} names the instructors' files"
    log = subprocess.run(["git", "log", "--oneline"], cwd=student_repo, capture_output=True, text=True, check=True)
    assert len(log.stdout.splitlines()) == 1, log.stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=student_repo, capture_output=True, text=True)
    assert status.stdout == "", f"files outside the commit:\n{status.stdout}"


def test_student_repository_installs_tests_and_grades(student_repo):
    """uv sync --frozen works there; its harness tests collect and those about the checkout pass; the
    graded tests stop at the first TODO;
    with the reference as fsdp.py (the default file under test there) a graded line earns its
    points. Only task 1's forward: the same test.py, conftest and harness give the reference all
    the points in this repository's own run of test.py, so all of it again here would prove nothing new."""
    share_store(student_repo)
    sync = run([*uv(), "sync", "--frozen", "--compile-bytecode", "--quiet"], student_repo, timeout=900)  # bytecode: see .ci/run
    assert sync.returncode == 0, show(sync)
    verbose = [str(student_repo / ".venv" / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider"]
    pytest_cmd = [*verbose, "-q"]

    # Every harness test collects there (none needs solution/); those about the student's own checkout
    # run (the rest run in this repository's session: the same files, the same code).
    collected = run([*pytest_cmd, "--collect-only", "harness"], student_repo, timeout=300)
    assert collected.returncode == 0 and " tests collected" in collected.stdout, show(collected)
    harness = run([*pytest_cmd, *(f"harness/tests/{name}.py" for name in STUDENT_CHECKOUT_TESTS)], student_repo,
                  timeout=900)
    assert harness.returncode == 0, show(harness)

    skeleton = run([*pytest_cmd, "-x", "test.py"], student_repo, timeout=600)
    assert skeleton.returncode == 1, show(skeleton)
    assert "TODO(task1)" in skeleton.stdout, f"the first failure should be task 1's TODO\n{show(skeleton)}"

    shutil.copy(ROOT / "solution" / "fsdp.py", student_repo / "fsdp.py")
    # The GitHub Classroom workflow's commands, as its steps run them: its install and graded-tests
    # steps (only task 1's forward here: PYTEST_ADDOPTS narrows them), then each grader step's command.
    doc = classroom.workflow(student_repo / ".github" / "workflows" / "classroom.yml")
    classroom.check(doc)
    for step in classroom.steps(doc):
        if "run" in step:
            graded = shell(step["run"], student_repo, PYTEST_ADDOPTS="-m task1 -k test_task1_forward")
            assert graded.returncode == 0, show(graded)
    # not -q: the header names the file under test
    assert f"effdl (the FSDP under test): {student_repo / 'fsdp.py'}" in graded.stdout, show(graded)
    assert re.search(r"^task 1 forward +3 / 3 +10 cases pass", graded.stdout, re.M), show(graded)
    assert re.search(rf"^total +3 / 3 \(of the lines graded; all: {TOTAL}\)$", graded.stdout, re.M), show(graded)
    earned = {s["with"]["test-name"]: shell(s["with"]["command"], student_repo) for s in classroom.graders(doc)}
    assert earned["task 1 forward"].returncode == 0, show(earned["task 1 forward"])
    assert all(earned[name].returncode == 1 for name in earned if name != "task 1 forward"), \
        {name: show(proc) for name, proc in earned.items()}
    assert "task 2: - / 2   not run" in earned["task 2"].stdout, show(earned["task 2"])


def test_release_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="is not empty"):
        release.release(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_release_refuses_a_stale_skeleton(tmp_path, monkeypatch):
    monkeypatch.setattr(release.make_skeleton, "skeleton", lambda source: "something else\n")
    with pytest.raises(ReleaseError, match="make_skeleton"):
        release.release(tmp_path / "out")


def test_release_names_leaks_and_missing_markers():
    with pytest.raises(ReleaseError, match="instructors"):
        release.transform("README.md", "# no marked section\n")
    with pytest.raises(ReleaseError, match="PYPROJECT_EDITS"):
        release.transform("pyproject.toml", "[project]\n")
    cut = release.transform("README.md", "a\n<!-- instructors -->\n## For instructors\nsecret\n<!-- /instructors -->\nb\n")
    assert "secret" not in cut and "a" in cut and "b" in cut


def test_release_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "solution.release", "--out", str(ROOT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "is not empty" in proc.stderr and "Traceback" not in proc.stderr, show(proc)
    proc = subprocess.run([sys.executable, "-m", "solution.release", "gradescope", "--out", str(tmp_path / "bundle.tar")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not end in .zip" in proc.stderr and "Traceback" not in proc.stderr, show(proc)

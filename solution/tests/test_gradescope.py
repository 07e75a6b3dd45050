"""The Gradescope bundle, end to end: built by the release command, unpacked fresh as Gradescope does
(into ROOT/source, run_autograder copied to ROOT/run_autograder), set up by its own setup.sh, and
run_autograder run on submissions with ROOT redirected (AUTOGRADER_ROOT): the reference (one case of
every line passes),
the skeleton (0, its TODO named), a file that hangs (0, timed out, nothing left running), one that
does not compile (0, its line named), FSDP2 re-exported (0), and an attack on the process boundary
(0, nothing it could write changed, nothing left; as root its ranks run as the sandbox user)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
import zipfile
from pathlib import Path

import psutil
import pytest

from harness.tests.test_gradescope import assert_gradescope_format
from harness.tools.grading import sandbox
from harness.tools.submissions.points import LINES, TOTAL
from solution import make_skeleton, release
from solution.release import ReleaseError
from solution.tests.boundary import digest_tree, sandbox_processes
from solution.tests.mutation import CHEATS
from solution.tests.test_release import share_store, show, uv

HANG = '''"""Hangs in fully_shard: the autograder must stop it."""
from dataclasses import dataclass

import torch


@dataclass
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def fully_shard(module, **kwargs):
    while True:
        pass
'''
SYNTAX_ERROR = "import torch\n\n\ndef fully_shard(module\n    return module\n"  # the error is on line 4


def reference_only_lines() -> list[str]:
    """Lines of the reference that the skeleton lacks (what a student must write), long enough to be
    unmistakable: none may appear in any file of the bundle."""
    skeleton = set(make_skeleton.skeleton(make_skeleton.SOLUTION.read_text()).splitlines())
    return [line.strip() for line in make_skeleton.SOLUTION.read_text().splitlines()
            if line not in skeleton and len(line.strip()) >= 40 and not line.strip().startswith("#")]


def leaks(zip_path: Path) -> list[str]:
    distinctive = reference_only_lines()
    assert len(distinctive) > 20, "the reference and the skeleton should differ in many lines"
    with zipfile.ZipFile(zip_path) as z:
        return [f"{info.filename}: {line}" for info in z.infolist() for text in [z.read(info).decode(errors="replace")]
                for line in distinctive if line in text]


def unpack(zip_path: Path, dest: Path) -> None:
    """As Gradescope unpacks the bundle: each file with the mode the zip stores."""
    with zipfile.ZipFile(zip_path) as z:
        for info in z.infolist():
            z.extract(info, dest)
            os.chmod(dest / info.filename, info.external_attr >> 16 & 0o777)


@pytest.fixture(scope="module")
def autograder():
    """ROOT as Gradescope's image has it after setup.sh ran (uv is on PATH here, so it installs none).

    Not under pytest's own temporary folder: as root, the bundle's ranks under test run as the sandbox
    user, which must pass through every folder above the repository (sandbox.reachable opens them once),
    and the graded pytest inside the bundle closes /tmp/pytest-of-root again (0700) when its first test
    asks for a tmp_path, which cut rank 0 off the data in bonus 1's first case. /autograder on Gradescope
    lies under no such folder."""
    tmp = Path(tempfile.mkdtemp(prefix="gradescope-"))
    try:
        yield build_autograder(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_autograder(tmp: Path) -> Path:
    bundle = tmp / "autograder.zip"
    names = release.gradescope(bundle)
    assert {"setup.sh", "run_autograder", "repository/test.py", "repository/uv.lock"} <= set(names), names
    assert not [n for n in names if n.startswith("repository/solution/") or "/.git/" in n], names
    assert not leaks(bundle), leaks(bundle)
    root = tmp / "autograder"
    unpack(bundle, root / "source")
    assert os.access(root / "source" / "run_autograder", os.X_OK) and os.access(root / "source" / "setup.sh", os.X_OK)
    share_store(root / "source" / "repository")  # setup.sh's graded run then trains FSDP2 only where it must
    env_path = f"{Path(uv()[0]).parent}{os.pathsep}{os.environ['PATH']}"
    setup = subprocess.run(["bash", str(root / "source" / "setup.sh")], cwd=root, capture_output=True, text=True,
                           timeout=900, env={**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
                                             "PATH": env_path})
    assert setup.returncode == 0, show(setup)
    # FSDP2's side of the graded checks is stored in the image, for every submission to share
    assert list((root / "source" / "repository" / ".cache" / "fsdp2").glob("*.entry")), show(setup)
    shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # Gradescope copies it there
    return root


def autograde(root: Path, files: dict[str, str], *args: str, timeout: float = 2400,
              select: str | None = None) -> tuple[dict, str]:
    """One submission: fresh submission/ and results/, run_autograder, its results.json; fails if any
    process it started is still running after it returned. select: a pytest -k expression the graded
    run is narrowed to (through PYTEST_ADDOPTS, as a grader's shell could)."""
    for folder in ("submission", "results"):
        shutil.rmtree(root / folder, ignore_errors=True)
        (root / folder).mkdir()
    for name, text in files.items():
        (root / "submission" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / name).write_text(text)
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTHONPATH")}
    if select is not None:
        env["PYTEST_ADDOPTS"] = f"-k '{select}'"
    proc = subprocess.run([str(root / "run_autograder"), *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env={**env, "AUTOGRADER_ROOT": str(root), "AUTOGRADER_TEST_RUN": marker})
    assert proc.returncode == 0, show(proc)
    deadline = time.monotonic() + 15  # a forkserver leaves within moments of the pytest that started it
    while left_running(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left_running(marker), f"processes left running: {left_running(marker)}"
    doc = json.loads((root / "results" / "results.json").read_text())
    assert_gradescope_format(doc)
    return doc, proc.stdout


def left_running(marker: str) -> list[str]:
    """Processes whose environment carries MARKER (every process one run started inherits it)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("AUTOGRADER_TEST_RUN") == marker:
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def test_bundle_scripts_run_modules_that_exist():
    """Every `python -m harness...` the bundle's scripts run is a module (none of the moved old names)."""
    import importlib.util

    from harness.tests.test_layout import commands_named
    from harness.tools import MOVED

    scripts = [str(p.relative_to(release.ROOT)) for p in (release.GRADESCOPE / "run_autograder",
                                                           release.GRADESCOPE / "setup.sh")]
    named = commands_named(scripts)
    assert "harness.tools.submissions.gradescope" in named, named
    assert not [m for m in named if m in MOVED or importlib.util.find_spec(m) is None], named


def test_bundle_refuses_a_name_that_is_not_a_new_zip(tmp_path):
    with pytest.raises(ReleaseError, match=r"does not end in \.zip: give the bundle's file name"):
        release.gradescope(tmp_path / "autograder")
    (tmp_path / "old.zip").write_bytes(b"")
    with pytest.raises(ReleaseError, match="exists already: remove it, or give a new file name"):
        release.gradescope(tmp_path / "old.zip")
    assert (tmp_path / "old.zip").read_bytes() == b""


def test_leak_check_sees_the_reference(tmp_path):
    """The check on the bundle finds the reference wherever it is put, under any name."""
    with zipfile.ZipFile(tmp_path / "leaky.zip", "w") as z:
        z.writestr("repository/notes.py", make_skeleton.SOLUTION.read_text())
    assert leaks(tmp_path / "leaky.zip")


def lines(doc: dict) -> list[dict]:
    """The tests that are lines of the points table (the pictures are tests of 0 points)."""
    graded = [t for t in doc["tests"] if t["max_score"]]
    assert [t["name"] for t in graded] == [line.name for line in LINES], doc["tests"]
    return graded


def test_syntax_error_names_its_line(autograder):
    doc, _ = autograde(autograder, {"fsdp.py": SYNTAX_ERROR})
    assert doc["score"] == 0 and "fsdp.py line 4: SyntaxError:" in doc["output"], doc["output"]


def test_fsdp2_reexport_scores_zero(autograder):
    doc, _ = autograde(autograder, {"fsdp.py": CHEATS["reexport"]})
    assert doc["score"] == 0, doc
    assert all("uses PyTorch's FSDP2, not your own" in t["output"] for t in lines(doc)), doc["tests"]


def test_skeleton_scores_zero_at_its_todo(autograder):
    """A zipped folder: the file one folder down."""
    doc, _ = autograde(autograder, {"my-fsdp/fsdp.py": (release.ROOT / "fsdp.py").read_text()})
    assert doc["score"] == 0, doc
    # every line names the first TODO its tests reach: task 1's, and on bonus 4's 2-D mesh bonus 4's own
    assert all(f"TODO({'bonus4' if t['name'] == 'bonus 4' else 'task1'})" in t["output"] for t in lines(doc)), \
        doc["tests"]
    # FSDP2's schedule is drawn all the same, the skeleton's panel saying where it stopped
    assert "overlap picture" in [t["name"] for t in doc["tests"] if not t["max_score"]], doc["tests"]


def sandbox_roots() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob(f"{sandbox.ROOT_PREFIX}*"))


def creator(root: Path) -> int:
    """The process that made a pool's private folder (sandbox.Private.make names it so)."""
    return int(root.name.removeprefix(sandbox.ROOT_PREFIX).split("-")[0])


def test_hang_times_out_and_leaves_nothing_running(autograder):
    """Killed for its time, the graded pytest never closes its pools: the tool removes what they would have
    (their private folders; no process of theirs is left, which `autograde` checks)."""
    before = sandbox_roots()
    doc, _ = autograde(autograder, {"fsdp.py": HANG}, "--timeout", "30")
    assert doc["score"] == 0 and doc["output"].startswith("timed out after 30 s"), doc["output"]
    assert all("timed out" in t["output"] for t in lines(doc)), doc["tests"]
    assert 30 <= doc["execution_time"] < 170, doc["execution_time"]
    # a grading beside this one on the same machine (another checkout's tests) has folders of its own, made by a live
    # process: each folder is named for the process that made it, and the killed grading's are all dead
    left = {path for path in sandbox_roots() - before if not psutil.pid_exists(creator(path))}
    assert not left, f"the killed grading left its pools' folders: {left}"


# One case of every line: the bundle's path end to end (its files, its environment, the sandbox user, results.json);
# every case of every line runs on the reference in this repository's own test.py, with the same checks.
ONE_CASE_A_LINE = "(float32-float32 and not world3) or test_task2 or (test_task3 and not memory)"


def test_reference_passes_every_line(autograder):
    """One case of each line passes through the bundle (about a minute on an idle 2-core CPU); a line
    whose selected cases all pass says so, and is left ungraded (a partial selection earns nothing)."""
    doc, stdout = autograde(autograder, {"fsdp.py": make_skeleton.SOLUTION.read_text()}, select=ONE_CASE_A_LINE)
    short = [f"{t['name']}:\n{t['output'][-4000:]}" for t in lines(doc)
             if not re.search(r"cases? (ran \(all passed\)|pass;)", t["output"])]
    assert not short, doc["output"] + "\n\n" + "\n\n".join(short)  # each failed line's whole evidence
    # task 2 has one case, so it ran in full and earned its points; every other line ran part of its cases
    assert doc["score"] == next(line.points for line in LINES if line.name == "task 2"), doc["output"]
    assert f"score {doc['score']} / {TOTAL}" in stdout, stdout


def test_left_running_sees_a_process():
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, "AUTOGRADER_TEST_RUN": marker})
    try:
        assert left_running(marker), "a process carrying the marker was not seen"
    finally:
        proc.kill()
        proc.wait()
    assert not left_running(marker)


def test_run_autograder_writes_a_result_when_the_tool_cannot_start(tmp_path):
    """No environment where the bundle should be (setup.sh never ran): still a results.json, 0 points."""
    proc = subprocess.run([str(release.GRADESCOPE / "run_autograder")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AUTOGRADER_ROOT": str(tmp_path)})
    doc = json.loads((tmp_path / "results" / "results.json").read_text())
    assert doc["score"] == 0 and "the autograder could not start (exit 1)" in doc["output"], (doc, show(proc))


# One end-to-end run through the bundle (as root, the sandbox user's path): the other boundary mutants take
# the same path (solution/tests/test_boundary.py runs each one's attack on the ranks).
@pytest.mark.parametrize("name", ["write-protected"])
def test_boundary_mutant_scores_zero(autograder, name):
    """Each attack on the grader from the submission's own processes (solution/tests/mutation.py):
    0 on every line with the refusal, results.json the tool's own, the repository and FSDP2's stored
    side byte-identical, nothing left running (autograde), no process of the sandbox user either."""
    repo = autograder / "source" / "repository"
    kept = [repo / "test.py", repo / "train.py", repo / "harness", repo / ".cache" / "fsdp2", autograder / "run_autograder"]
    before = digest_tree(*kept)
    doc, _ = autograde(autograder, {"fsdp.py": CHEATS[name]})
    assert doc["score"] == 0 and "forged" not in json.dumps(doc), doc
    assert all("reaches beyond a hand-written FSDP" in t["output"] or "uses PyTorch's FSDP2" in t["output"]
               for t in lines(doc)), doc["tests"]
    assert digest_tree(*kept) == before
    assert not sandbox_processes(), sandbox_processes()

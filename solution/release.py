"""Write the student repository: everything tracked here except what students must not have.

    uv run python -m solution.release --out DEST                   # DEST: a new (or empty) folder
    uv run python -m solution.release gradescope --out DEST.zip    # Gradescope's autograder bundle

DEST becomes a git repository with one commit holding the tracked files of this checkout as
they are in the working tree, except:
  * solution/ (the reference, the skeleton generator, the instructors' tests);
  * docs/instructors.md, the instructors' page;
  * pyproject.toml's instructor settings (pytest's `--impl solution/fsdp.py`, solution/tests);
  * README.md's part between `<!-- instructors -->` and `<!-- /instructors -->` (the line that
    links the instructors' page, which the student repository does not have).
uv.lock is copied byte for byte, so students install exactly what the tests here ran on.
The release refuses to run when fsdp.py is not what the generator makes from the reference,
and fails if anything it wrote still names solution/.

The Gradescope bundle is that repository (without .git) in repository/, with setup.sh and
run_autograder (solution/gradescope/) at the zip's root: Gradescope unpacks it into
/autograder/source, runs setup.sh once to build the image and run_autograder per submission.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from harness.cli import parse
from harness.errors import BAD_INPUT, stop
from solution import make_skeleton

ROOT = make_skeleton.ROOT
INSTRUCTORS = re.compile(r"\n?<!-- instructors -->.*?<!-- /instructors -->\n?", re.S)
# Exact text this command removes from pyproject.toml: if it changes there, update it here.
PYPROJECT_EDITS = [
    ('# Instructors: test the reference. A released student copy has neither this option nor solution/.\n'
     'addopts = "-ra --impl solution/fsdp.py"\n', 'addopts = "-ra"\n'),
    ('testpaths = ["test.py", "harness/tests", "solution/tests"]', 'testpaths = ["test.py", "harness/tests"]'),
]
INSTRUCTORS_PAGE = "docs/instructors.md"
MENTIONS = re.compile(r"solution[/.]|make_skeleton|<!-- /?instructors -->")
GRADESCOPE = ROOT / "solution" / "gradescope"  # setup.sh and run_autograder
BUNDLE_REPOSITORY = "repository"  # the student repository's folder in the Gradescope bundle


class ReleaseError(RuntimeError):
    """Something would make the student repository wrong; the message says what and how to fix it."""


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ReleaseError(f"{ROOT} must be a git checkout (the release copies its tracked files): {e}") from None
    return [f for f in out.decode().split("\0") if f]


def transform(path: str, text: str) -> str:
    """A file's text as the student repository has it."""
    if path == "README.md":
        if not INSTRUCTORS.search(text):
            raise ReleaseError("README.md has no `<!-- instructors -->` ... `<!-- /instructors -->` part to remove "
                               f"(the link to {INSTRUCTORS_PAGE}, which the student repository does not have)")
        return INSTRUCTORS.sub("\n", text)
    if path == "pyproject.toml":
        for old, new in PYPROJECT_EDITS:
            if old not in text:
                raise ReleaseError(f"pyproject.toml no longer contains {old.strip()!r}; update PYPROJECT_EDITS "
                                   "in solution/release.py to what should be removed now")
            text = text.replace(old, new)
    return text


def release(dest: Path) -> list[str]:
    """Write the student repository to dest; return the files written."""
    if dest.exists() and any(dest.iterdir()):
        raise ReleaseError(f"{dest} is not empty: give a new or empty folder")
    solution = make_skeleton.SOLUTION.read_text()
    if (ROOT / "fsdp.py").read_text() != make_skeleton.skeleton(solution):
        raise ReleaseError("fsdp.py is not the skeleton of solution/fsdp.py: run `uv run python -m "
                           "solution.make_skeleton`, commit, and release again")
    files = [f for f in tracked_files()
             if not f.startswith("solution/") and f != INSTRUCTORS_PAGE and (ROOT / f).is_file()]
    leaks = []
    for f in files:
        data = (ROOT / f).read_bytes()
        out = dest / f
        out.parent.mkdir(parents=True, exist_ok=True)
        if f == "uv.lock" or b"\0" in data:
            out.write_bytes(data)
            continue
        text = transform(f, data.decode())
        leaks += [f"{f}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if MENTIONS.search(line)]
        out.write_text(text)
        out.chmod((ROOT / f).stat().st_mode)
    if leaks:
        raise ReleaseError("the student repository would still name the instructors' files:\n  " + "\n  ".join(leaks))
    git = ["git", "-c", "user.name=FSDP course", "-c", "user.email=fsdp-course@localhost",
           "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "FSDP by hand: student repository"], cwd=dest, check=True)
    return files


def gradescope(dest: Path) -> list[str]:
    """Write Gradescope's autograder bundle to DEST (a new .zip); return the names in it: setup.sh
    and run_autograder at its root, the student repository as release() writes it (without .git)
    under BUNDLE_REPOSITORY/. Each file keeps its mode (run_autograder must be executable)."""
    if dest.suffix != ".zip":
        raise ReleaseError(f"{dest} does not end in .zip: give the bundle's file name, e.g. --out autograder.zip")
    if dest.exists():
        raise ReleaseError(f"{dest} exists already: remove it, or give a new file name")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / BUNDLE_REPOSITORY
        release(repo)
        entries = [(GRADESCOPE / name, name) for name in ("setup.sh", "run_autograder")]
        entries += [(p, f"{BUNDLE_REPOSITORY}/{p.relative_to(repo).as_posix()}") for p in sorted(repo.rglob("*"))
                    if p.is_file() and ".git" not in p.relative_to(repo).parts]
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        with zipfile.ZipFile(partial, "w") as z:
            for path, name in entries:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # the same bytes every build
                info.external_attr = (0o100000 | path.stat().st_mode & 0o777) << 16  # a regular file, its mode
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, path.read_bytes())
        partial.replace(dest)
    return [name for _, name in entries]


@dataclass(frozen=True)
class Args:
    """Write the student repository: everything tracked here except what students must not have
    (solution/, the instructors' page and settings, the README's link to that page), as a new git
    repository; or, with `gradescope`, Gradescope's autograder bundle holding it."""

    what: Annotated[Literal["repo", "gradescope"], tyro.conf.Positional] = "repo"
    """repo: the student repository (a folder); gradescope: the autograder bundle (a .zip)."""
    out: Path = tyro.MISSING
    """a new or empty folder for the student repository; for gradescope, a new .zip file."""


def main(args: Args) -> None:
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    note = " (from uncommitted changes too: `git status` lists them)" if dirty else ""
    try:
        files = gradescope(args.out) if args.what == "gradescope" else release(args.out)
    except ReleaseError as e:
        stop(str(e), BAD_INPUT)
    if args.what == "gradescope":
        print(f"wrote {args.out} ({len(files)} files){note}: upload it as the assignment's autograder on Gradescope")
    else:
        print(f"wrote {len(files)} files to {args.out}{note}; try it: cd {args.out} && uv sync --frozen && uv run pytest")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m solution.release"))


if __name__ == "__main__":
    cli()

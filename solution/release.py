"""Write the student repository: everything tracked here except what students must not have.

    uv run python -m solution.release --out DEST      # DEST: a new (or empty) folder

DEST becomes a git repository with one commit holding the tracked files of this checkout as
they are in the working tree, except:
  * solution/ (the reference, the skeleton generator, the instructors' tests);
  * pyproject.toml's instructor settings (pytest's `--impl solution/fsdp.py`, solution/tests);
  * README.md's section between `<!-- instructors -->` and `<!-- /instructors -->`.
uv.lock is copied byte for byte, so students install exactly what the tests here ran on.
The release refuses to run when fsdp.py is not what the generator makes from the reference,
and fails if anything it wrote still names solution/.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

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
MENTIONS = re.compile(r"solution[/.]|make_skeleton|<!-- /?instructors -->")


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
            raise ReleaseError("README.md has no `<!-- instructors -->` ... `<!-- /instructors -->` section to remove")
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
    files = [f for f in tracked_files() if not f.startswith("solution/") and (ROOT / f).is_file()]
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


@dataclass(frozen=True)
class Args:
    """Write the student repository: everything tracked here except what students must not have
    (solution/, the instructor settings and README section), as a new git repository."""

    out: Path
    """a new or empty folder for the student repository."""


def main(args: Args) -> None:
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout
    try:
        files = release(args.out)
    except ReleaseError as e:
        stop(str(e), BAD_INPUT)
    note = " (from uncommitted changes too: `git status` lists them)" if dirty else ""
    print(f"wrote {len(files)} files to {args.out}{note}; try it: cd {args.out} && uv sync --frozen && uv run pytest")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m solution.release"))


if __name__ == "__main__":
    cli()

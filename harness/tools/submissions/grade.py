"""Grade submissions: one file or a folder of them -> one CSV row each (points per task).

    uv run python -m harness.tools.submissions.grade submissions/ --out points.csv
    uv run python -m harness.tools.submissions.grade alice_fsdp.py -- -m task1     # arguments after -- go to pytest

Each row also says how close the submission's own code comes to FSDP2's source or to another
submission of the folder (`similar_to`, `similarity`, `similar_lines`, `flagged`: see
harness.tools.submissions.similarity), and similarity.md beside the CSV shows the closest pairs side by side.

Each submission runs `pytest test.py --impl FILE` in its own process group with a time limit, so
one that hangs or crashes costs only its own row. Its pictures (`pytest --artifacts`: overlap.png,
memory.png, pictures.txt saying what could not be drawn) go to `<CSV stem>-pictures/<submission
stem>/` beside the CSV, or under `--pictures DIR`.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from harness.cli import parse
from harness.errors import BAD_INPUT, stop
from harness.tools.submissions import inert, similarity
from harness.tools.grading import sandbox
from harness.tools.submissions.points import LINES

ROOT = Path(__file__).resolve().parents[3]  # the repository: harness/tools/submissions/grade.py


@dataclass(frozen=True)
class Args:
    """Grade submissions: one file or a folder of them -> one CSV row each (points per task).
    Arguments after `--` go to pytest, e.g. `-- -m task1`."""

    submissions: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SUBMISSIONS")]
    """a .py file, or a folder of them."""
    out: Path | None = None
    """CSV file to write (default: stdout)."""
    pictures: Path | None = None
    """folder for each submission's pictures, DIR/<submission stem>/ (default: <CSV stem>-pictures
    beside --out; none when the CSV goes to stdout)."""
    similarity_page: Path | None = None
    """markdown page of the closest pairs (default: similarity.md beside --out; none on stdout)."""
    timeout: float = 1200
    """seconds per submission: one that takes longer (hung?) gets no points."""
    pytest_args: tyro.conf.Suppress[tuple[str, ...]] = ()


@contextlib.contextmanager
def pictures_only(artifacts: Path | None):
    """Around pytest --artifacts: nothing of an earlier grading left; afterwards the pictures kept, the
    traces removed; a session that never reached its end (timed out, crashed) drew nothing, said in
    pictures.txt."""
    for name in ("overlap.png", "memory.png", "memory.json", "pictures.txt"):
        if artifacts is not None and (artifacts / name).exists():
            (artifacts / name).unlink()
    try:
        yield
    finally:
        if artifacts is not None:
            shutil.rmtree(artifacts / "profiles", ignore_errors=True)
            if not (artifacts / "pictures.txt").exists():
                artifacts.mkdir(parents=True, exist_ok=True)
                (artifacts / "pictures.txt").write_text("no pictures: pytest did not reach the end of its session "
                                                        "(timed out or crashed)\n")


def grade(path: Path, timeout: float, pytest_args: list[str], artifacts: Path | None = None) -> dict:
    """One submission's row: points per task, total, and what failed, in one line; also "rows", the
    points table's rows (task, earned, max, evidence), or None when pytest wrote no table. With `artifacts`,
    pytest draws overlap.png and memory.png there (pictures.txt says what it could not draw); the
    profiled traces they were drawn from are removed (about 50 MB a submission)."""
    row = {"submission": str(path), **{line.name: 0 for line in LINES}, "total": 0, "failures": "", "rows": None}
    artifacts = Path(artifacts).resolve() if artifacts is not None else None
    with tempfile.TemporaryDirectory() as tmp, pictures_only(artifacts):
        out = Path(tmp) / "points.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "test.py"),
               "--impl", str(path.resolve()), "--points-json", str(out), *pytest_args]
        if artifacts is not None:
            cmd += ["--artifacts", str(artifacts)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its rank processes too
            proc.communicate()
            row["failures"] = f"timed out after {timeout:.0f} s (hung?): no points"
            return row
        finally:
            # pytest is done (or killed): whatever it left in its session goes too (a forkserver still
            # importing when a short run ended, anything a submission's rank left in the background), and,
            # killed, what its pools would have removed when they closed (their files, their folders)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            sandbox.sweep()
            sandbox.sweep_files()
            sandbox.remove_dead_roots()
        if not out.exists():
            tail = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
            row["failures"] = f"pytest exited {proc.returncode} before the points table: {tail[0][:200]}"
            return row
        rows = row["rows"] = json.loads(out.read_text())["rows"]
    for r in rows:
        row[r["task"]] = r["earned"] or 0
    row["total"] = sum(r["earned"] or 0 for r in rows)
    row["failures"] = " | ".join(f"{r['task']}: {r['evidence']}" for r in rows if not r["earned"])
    return row


def main(args: Args) -> None:
    if not args.submissions.exists():
        stop(f"{args.submissions} does not exist: give a .py submission or a folder of them", BAD_INPUT)
    if args.submissions.is_dir():
        files = sorted(args.submissions.glob("*.py"))
        if not files:
            stop(f"{args.submissions} has no .py files: give a folder of submissions, or one .py file", BAD_INPUT)
    elif args.submissions.suffix == ".py":
        files = [args.submissions]
    else:
        stop(f"{args.submissions} is not a .py file: give a .py submission or a folder of them", BAD_INPUT)
    fields = ["submission", *(line.name for line in LINES), "total", "failures", *similarity.COLUMNS]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "w", newline="") if args.out else sys.stdout
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")  # "rows": the table, not a column
    writer.writeheader()
    pictures = args.pictures or (args.out.parent / f"{args.out.stem}-pictures" if args.out else None)
    page = args.similarity_page or (args.out and args.out.with_name("similarity.md"))
    if sandbox.wanted():
        if pictures and str(pictures.resolve()) in sandbox.SHARED_FOLDERS:
            stop(f"--pictures {pictures} is a folder every user may write: give a folder of the grading's own "
                 "(its pictures show each submission's results, closed to the submissions graded later)", BAD_INPUT)
        if args.submissions.is_dir():
            sandbox.hide(args.submissions)  # no submission reads another's (each is graded from a copy of its own)
        # nor what the grading writes of the others (their points, messages, code side by side), now or later
        if pictures:
            pictures.mkdir(parents=True, exist_ok=True)
        if page:
            page.touch()
        sandbox.hide(*(p for p in (args.out, pictures, page) if p))
    similar = similarity.check(files)  # seconds, no test run: each row gets its columns as it is written
    for path in files:
        print(f"grading {path}", file=sys.stderr, flush=True)
        row = grade(path, args.timeout, list(args.pytest_args), pictures and pictures / path.stem)
        writer.writerow(inert.csv_row(row | similar.columns(path.name)))  # file names, messages: its text
        out.flush()
    if out is not sys.stdout:
        out.close()
    if page:
        page.write_text(similarity.page(similar, files))
        print(f"wrote {page}", file=sys.stderr)


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.submissions.grade"))


if __name__ == "__main__":
    cli()

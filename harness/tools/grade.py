"""Grade submissions: one file or a folder of them -> one CSV row each (points per task).

    uv run python -m harness.tools.grade submissions/ --out points.csv
    uv run python -m harness.tools.grade alice_fsdp.py -- -m task1     # arguments after -- go to pytest

Each submission runs `pytest test.py --impl FILE` in its own process group with a time limit, so
one that hangs or crashes costs only its own row.
"""

from __future__ import annotations

import csv
import json
import os
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
from harness.tools.points import LINES

ROOT = Path(__file__).resolve().parents[2]  # the repository: harness/tools/grade.py


@dataclass(frozen=True)
class Args:
    """Grade submissions: one file or a folder of them -> one CSV row each (points per task).
    Arguments after `--` go to pytest, e.g. `-- -m task1`."""

    submissions: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SUBMISSIONS")]
    """a .py file, or a folder of them."""
    out: Path | None = None
    """CSV file to write (default: stdout)."""
    timeout: float = 1200
    """seconds per submission: one that takes longer (hung?) gets no points."""
    pytest_args: tyro.conf.Suppress[tuple[str, ...]] = ()


def grade(path: Path, timeout: float, pytest_args: list[str]) -> dict:
    """One submission's row: points per task, total, and what failed, in one line; also "rows",
    the points table's rows (task, earned, max, evidence), or None when pytest wrote no table."""
    row = {"submission": str(path), **{line.name: 0 for line in LINES}, "total": 0, "failures": "", "rows": None}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "points.json"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "test.py"),
               "--impl", str(path.resolve()), "--points-json", str(out), *pytest_args]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its rank processes too
            proc.communicate()
            row["failures"] = f"timed out after {timeout:.0f} s (hung?): no points"
            return row
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
    fields = ["submission", *(line.name for line in LINES), "total", "failures"]
    out = open(args.out, "w", newline="") if args.out else sys.stdout
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")  # "rows": the table, not a column
    writer.writeheader()
    for path in files:
        print(f"grading {path}", file=sys.stderr, flush=True)
        writer.writerow(grade(path, args.timeout, list(args.pytest_args)))
        out.flush()
    if out is not sys.stdout:
        out.close()


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.grade"))


if __name__ == "__main__":
    cli()

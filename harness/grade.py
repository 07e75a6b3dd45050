"""Grade submissions: one file or a folder of them -> one CSV row each (points per task).

    uv run python -m harness.grade submissions/ -o points.csv
    uv run python -m harness.grade alice_fsdp.py

Each submission runs `pytest test.py --impl FILE` in its own process group with a time limit, so
one that hangs or crashes costs only its own row.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.points import LINES

ROOT = Path(__file__).resolve().parents[1]


def grade(path: Path, timeout: float, pytest_args: list[str]) -> dict:
    """One submission's row: points per task, total, and what failed, in one line."""
    row = {"submission": str(path), **{line.name: 0 for line in LINES}, "total": 0, "failures": ""}
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
        rows = json.loads(out.read_text())["rows"]
    for r in rows:
        row[r["task"]] = r["earned"] or 0
    row["total"] = sum(r["earned"] or 0 for r in rows)
    row["failures"] = " | ".join(f"{r['task']}: {r['evidence']}" for r in rows if not r["earned"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submissions", type=Path, help="a .py file, or a folder of them")
    parser.add_argument("-o", "--output", type=Path, default=None, help="CSV file (default: stdout)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per submission (default 1200)")
    parser.epilog = "Arguments after -- go to pytest, e.g. -- -m task1"
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]  # argparse would bind them to no positional after another
    if args.submissions.is_dir():
        files = sorted(args.submissions.glob("*.py"))
    elif args.submissions.suffix == ".py" and args.submissions.exists():
        files = [args.submissions]
    else:
        parser.error(f"{args.submissions}: give a .py submission or a folder of them")
    if not files:
        parser.error(f"{args.submissions}: no .py files in it")
    fields = ["submission", *(line.name for line in LINES), "total", "failures"]
    out = open(args.output, "w", newline="") if args.output else sys.stdout
    writer = csv.DictWriter(out, fieldnames=fields)
    writer.writeheader()
    for path in files:
        print(f"grading {path}", file=sys.stderr, flush=True)
        writer.writerow(grade(path, args.timeout, args.pytest_args))
        out.flush()
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The handout's points table, defined once.

conftest.py prints it at the end of every run of test.py (and writes it with --points-json),
`harness.tools.submissions.grade` makes its CSV columns from it, `harness.tools.submissions.handin` its summary, and a test keeps
the README's table in step with it. A line earns its points only when every case of its tests
ran and passed; a failure costs the whole line; a line whose cases did not all run, or skipped,
is not graded (None), and the total counts only graded lines.

    uv run python -m harness.tools.submissions.points --earned "task 1 forward" points.json

exits 0 when that line was earned in full in a table pytest wrote (`pytest test.py
--points-json=points.json`), 1 when not: the GitHub Classroom workflow grades each line so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from harness.cli import parse
from harness.errors import BAD_INPUT, FAILED, stop


@dataclass(frozen=True)
class Line:
    """One line of the handout's table: its name, its points, the test.py functions behind it
    (every case of each must pass), and the pytest marker that selects them."""

    name: str
    points: int
    tests: tuple[str, ...]
    marker: str
    about: str  # the marker's description


LINES = (
    Line("task 1 forward", 3, ("test_task1_forward",), "task1", "task 1 (forward and step)"),
    Line("task 1 step", 3, ("test_fsdp",), "task1", "task 1 (forward and step)"),
    Line("task 2", 2, ("test_task2",), "task2", "task 2: forward prefetch"),
    Line("task 3", 2, ("test_task3", "test_task3_memory"), "task3", "task 3: backward overlap"),
    Line("bonus 1", 1, ("test_bonus1",), "bonus1", "bonus 1: reshard_after_forward=False"),
    Line("bonus 2", 1, ("test_bonus2",), "bonus2", "bonus 2: set_reshard_after_backward(False)"),
    Line("bonus 3", 1, ("test_bonus3",), "bonus3", "bonus 3: set_requires_gradient_sync(False)"),
    Line("bonus 4", 1, ("test_bonus4",), "bonus4", "bonus 4: HSDP on a 2-D mesh"),
)
MARKERS = {line.marker: line.about for line in LINES}
TOTAL = sum(line.points for line in LINES)


def table(results: dict, collected: dict | None = None, details: dict | None = None) -> list[dict]:
    """One row per line: {task, earned (None: not graded), max, evidence}, and for a failed line its
    first failure's whole report (details: nodeid -> text) as "details".

    results: test function -> {nodeid: (outcome, text)}, outcome "passed" (text: its evidence),
    "skipped" (the reason) or "failed" (its first line); collected: test function -> every case
    collected, selected or not (so a partial selection is seen as one)."""
    rows = []
    for line in LINES:
        cases = {nodeid: r for t in line.tests for nodeid, r in results.get(t, {}).items()}
        expected = {nodeid for t in line.tests for nodeid in (collected or {}).get(t, ())} | set(cases)
        row = dict(task=line.name, earned=None, max=line.points)
        failed = [text for outcome, text in cases.values() if outcome == "failed"]
        first_failed = next((nodeid for nodeid, (outcome, _) in cases.items() if outcome == "failed"), None)
        skipped = [text for outcome, text in cases.values() if outcome == "skipped"]
        if not cases:
            row["evidence"] = "not run"
        elif failed:
            row.update(earned=0, evidence=f"{len(failed)} of {len(cases)} cases fail: {failed[0]}")
            if (text := (details or {}).get(first_failed)):
                row["details"] = f"{first_failed}:\n{text}"
        elif skipped:  # a skip is never a failure
            row["evidence"] = f"not graded: {len(skipped)} of its {len(expected)} cases skipped: {skipped[0]}"
        elif len(cases) < len(expected):
            row["evidence"] = (f"not graded: {len(cases)} of its {len(expected)} cases ran (all passed); "
                               "run them all for the points")
        else:
            evidence = next((text for _, text in cases.values() if text), "passed")
            row.update(earned=line.points, evidence=f"{len(cases)} cases pass; {evidence}")
        rows.append(row)
    return rows


def render(rows: list[dict]) -> list[str]:
    """The table as printed at the end of test.py: one line per row, then the total."""
    graded = [r for r in rows if r["earned"] is not None]
    out = [f"{r['task']:<15} {'-' if r['earned'] is None else r['earned']:>2} / {r['max']}   {r['evidence']}"
           for r in rows]
    total = f"{'total':<15} {sum(r['earned'] for r in graded):>2} / {sum(r['max'] for r in graded)}"
    if len(graded) < len(rows):
        total += f" (of the lines graded; all: {sum(r['max'] for r in rows)})"
    return out + [total]


@dataclass(frozen=True)
class Args:
    """Exit 0 when one line of the points table was earned in full, 1 when not (saying why)."""

    points_json: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="POINTS_JSON")]
    """the table as `pytest test.py --points-json=FILE` wrote it."""
    earned: str
    """the line's name, e.g. "task 1 forward"."""


def earned(rows: list[dict], name: str) -> tuple[bool, str]:
    """Whether line NAME earned all its points in a written table, and its row as one line."""
    row = next((r for r in rows if r["task"] == name), None)
    if row is None:
        raise KeyError(name)
    got = "-" if row["earned"] is None else row["earned"]
    return row["earned"] == row["max"], f"{name}: {got} / {row['max']}   {row['evidence']}"


def main(args: Args) -> None:
    if args.earned not in {line.name for line in LINES}:
        stop(f"--earned {args.earned!r} is no line of the points table: give one of "
             + ", ".join(repr(line.name) for line in LINES), BAD_INPUT)
    if not args.points_json.exists():
        stop(f"{args.points_json} is missing: the graded tests stopped before writing the points table "
             "(their own output says why)")
    ok, text = earned(json.loads(args.points_json.read_text())["rows"], args.earned)
    print(text)
    if not ok:
        raise SystemExit(FAILED)


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.submissions.points"))


if __name__ == "__main__":
    cli()

"""Gradescope's `run_autograder`: grade the submitted fsdp.py and write the results Gradescope shows.

    uv run python -m harness.tools.submissions.gradescope [--timeout SECONDS]

Gradescope runs it once per submission in a fresh container (the autograder bundle, built by the
instructors' release command, calls it). It reads ROOT/submission (the student's files: fsdp.py
at the top or one folder down) and writes ROOT/results/results.json: one test per line of the
points table with its score and its evidence or first failure, the total, the points table, and
the pictures of the run when there are any. ROOT is /autograder, or $AUTOGRADER_ROOT (to try it
anywhere). Whatever happens, a results.json is written: a file that does not compile, a run past
--timeout, no or several fsdp.py, or a fault in this tool itself each give 0 points and say why.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from harness.cli import parse
from harness.tools.submissions import grade as grading
from harness.tools.submissions.points import LINES, TOTAL, render

# Gradescope stops a whole submission at the assignment's limit (at most 40 minutes) and then shows
# nothing; stopping the tests first leaves time to write results that say what happened.
TIMEOUT = 35 * 60
PICTURES = {"overlap.png": "overlap picture", "memory.png": "memory picture"}


@dataclass(frozen=True)
class Args:
    """Grade ROOT/submission/fsdp.py and write ROOT/results/results.json as Gradescope reads it
    (ROOT: $AUTOGRADER_ROOT, default /autograder)."""

    timeout: float = TIMEOUT
    """seconds for the whole graded run: past it, no points ("timed out"). Keep it below the
    assignment's autograder timeout on Gradescope."""


def autograder_root() -> Path:
    return Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))


def find_submission(folder: Path) -> Path | str:
    """The submitted fsdp.py (at the top of FOLDER or one folder down, as a zipped folder
    unpacks), or a message saying what was found instead and what to submit."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__MACOSX" not in p.parts)
    found = [p for p in files if p.name == "fsdp.py" and len(p.relative_to(folder).parts) <= 2]
    if len(found) == 1:
        return found[0]
    names = ", ".join(str(p.relative_to(folder)) for p in (found or files)[:10]) or "nothing"
    if found:
        return f"found {len(found)} files named fsdp.py ({names}): submit exactly one fsdp.py"
    return f"found no fsdp.py (the submission holds {names}): submit your fsdp.py, the file itself"


def syntax_error(path: Path) -> str | None:
    """The file's first syntax error with its line, as Python reports it, or None."""
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as e:
        where = f"fsdp.py line {e.lineno}" if e.lineno else "fsdp.py"
        code = f": {e.text.strip()}" if e.text and e.text.strip() else ""
        return f"{where}: SyntaxError: {e.msg}{code}"
    except ValueError as e:  # e.g. a null byte in the source
        return f"fsdp.py does not compile: {e}"
    return None


def zero_rows(reason: str) -> list[dict]:
    """The points table when nothing was graded: every line 0, REASON as its evidence."""
    return [dict(task=line.name, earned=0, max=line.points, evidence=reason) for line in LINES]


def picture_test(path: Path, name: str) -> dict:
    """A 0-point test that shows a PNG the run wrote, inlined in the test's HTML output."""
    data = base64.b64encode(path.read_bytes()).decode()
    return {"name": name, "score": 0, "max_score": 0, "output_format": "html", "visibility": "visible",
            "output": f'<img src="data:image/png;base64,{data}" alt="{name}" style="max-width:100%">'}


def results(rows: list[dict], failure: str, seconds: float, pictures: Path | None = None) -> dict:
    """results.json: one test per points line (score, max_score, its evidence), the total, the
    table (after the failure, if the run as a whole failed) and the pictures found in PICTURES."""
    tests = []
    for line, row in zip(LINES, rows, strict=True):
        score = row["earned"] or 0  # a line not graded (None) earns nothing here
        tests.append({"name": line.name, "score": score, "max_score": line.points,
                      "status": "passed" if score == line.points else "failed",
                      "output": row["evidence"] + (f"\n\n{row['details']}" if row.get("details") else ""),
                      "output_format": "text", "visibility": "visible"})
    if pictures is not None:
        tests += [picture_test(pictures / f, name) for f, name in PICTURES.items() if (pictures / f).is_file()]
    summary = "\n".join(([failure, ""] if failure else []) + render(rows))
    # Evidence and failures hold the submission's text (its messages, its source line in a syntax error):
    # shown as plain text, never rendered (Gradescope's default renders markdown-like simple_format). Only
    # the pictures' tests, whose HTML is this tool's own, are HTML.
    return {"score": sum(t["score"] for t in tests), "execution_time": int(round(seconds)), "output": summary,
            "output_format": "text", "test_output_format": "text", "test_name_format": "text", "tests": tests}


def grade_submission(root: Path, timeout: float, start: float) -> dict:
    found = find_submission(root / "submission")
    if isinstance(found, str):
        return results(zero_rows(found), found, time.monotonic() - start)
    if problem := syntax_error(found):
        return results(zero_rows(problem), problem, time.monotonic() - start)
    with tempfile.TemporaryDirectory() as tmp:
        pictures = Path(tmp)
        row = grading.grade(found, timeout, [], artifacts=pictures)  # pytest draws overlap.png, memory.png there
        if row["rows"] is None:  # no table: timed out, or pytest stopped before it
            return results(zero_rows(row["failures"]), row["failures"], time.monotonic() - start)
        return results(row["rows"], "", time.monotonic() - start, pictures)


def write(root: Path, doc: dict) -> Path:
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)  # never a half-written file where Gradescope reads
    return out


def main(args: Args) -> None:
    start = time.monotonic()
    root = autograder_root()
    try:
        doc = grade_submission(root, args.timeout, start)
    except Exception as e:  # a fault here must still give the student a result that says so
        last = traceback.format_exception_only(e)[-1].strip()
        traceback.print_exc()
        reason = f"the autograder failed (not your code; tell the course staff): {last}"
        doc = results(zero_rows(reason), reason, time.monotonic() - start)
    out = write(root, doc)
    print(doc["output"])
    print(f"score {doc['score']} / {TOTAL}; wrote {out}")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.submissions.gradescope"))


if __name__ == "__main__":
    cli()

"""Generate the student file fsdp.py from the reference solution/fsdp.py.

    uv run python -m solution.make_skeleton            # rewrite fsdp.py
    uv run python -m solution.make_skeleton --check    # exit 1 if fsdp.py is out of date
    uv run python -m solution.make_skeleton --stats    # lines per task, for docs/instructors.md

In the solution, each piece of the exercise sits between two comment lines:

    # region task1: the piece to write, in a few words
    # what it must achieve and why (at most two lines)
    # H1 (rows): the README hint it needs, in short: its number and name as in the README's Hints,
    #   then the essential fact (continued on lines indented by two spaces; notes: at most 4 lines)
    ...the reference code...
    # else: code the student file runs instead (optional, one line each)
    # endregion

In the skeleton the region becomes its hint and notes as a `# TODO(task1): ...` comment, followed by
`raise TodoError("TODO(task1): ...")` for the required task (task1), or by the
`# else:` lines, if any, for the optional ones (task2, task3, bonus1-4): a file with only
task 1 done then trains correctly, just without overlap or the bonus features. Where the
block goes on after the region, a comment says to replace only the raise (or the stand-in):
the lines below it are given.

`render(..., strip=...)` also makes variants of the solution with chosen regions stripped:
the tests use them to prove each check fails without the feature it checks.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from harness.cli import parse
from harness.errors import BAD_INPUT, FAILED, stop

ROOT = Path(__file__).resolve().parents[1]
SOLUTION, SKELETON = ROOT / "solution" / "fsdp.py", ROOT / "fsdp.py"
REQUIRED = {"task1"}
TAGS = ("task1", "task2", "task3", "bonus1", "bonus2", "bonus3", "bonus4")

OPEN = re.compile(r"^(?P<indent>\s*)# region (?P<tag>\w+): (?P<hint>.*)$")
ELSE = re.compile(r"^\s*# else: (?P<code>.*)$")
CLOSE = re.compile(r"^\s*# endregion\s*$")
# A region's note of a README hint: `H6 (mixed precision, forward): ...`, continued on lines
# that start with two spaces (both as they are after the `# `).
NOTE = re.compile(r"^H(?P<number>\d+) \((?P<name>[^)]+)\): ")
NOTE_MORE = "  "
REPLACE_RAISE = "replace only the raise below with your code; the lines after it are given"

# The solution's docstring ends with SOLUTION_NOTE; the student's with STUDENT_NOTE.
SOLUTION_NOTE = """\
Regions marked `# region taskN` / `# region bonusN` are the exercise: the student file
fsdp.py is generated from this one with each region replaced by a TODO.
"""
STUDENT_NOTE = """\
Your part is every TODO below: TODO(task1) first (each raises TodoError until it is
written), then task2 and task3 (overlap), then the bonuses. Check your work with
`uv run pytest test.py --impl student`.
"""


class SkeletonError(ValueError):
    """The solution's region markers are malformed; the message names the line."""


@dataclass
class Region:
    tag: str
    indent: str
    hint: list[str]     # the comment lines, header first, without "# "
    fallback: list[str]  # the `# else:` code lines


def render(source: str, strip: set[str] | frozenset[str] = frozenset(TAGS)) -> str:
    """The source with the regions tagged in `strip` replaced; other regions keep their code."""
    lines = source.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if not m:
            if CLOSE.match(lines[i]) or ELSE.match(lines[i]):
                raise SkeletonError(f"line {i + 1}: '{lines[i].strip()}' outside a region")
            out.append(lines[i])
            i += 1
            continue
        tag, indent = m["tag"], m["indent"]
        if tag not in TAGS:
            raise SkeletonError(f"line {i + 1}: unknown region tag {tag!r}; expected one of {TAGS}")
        region, body, i = Region(tag, indent, [m["hint"]], []), [], i + 1
        while i < len(lines) and lines[i].startswith(indent + "# ") and not (
                ELSE.match(lines[i]) or CLOSE.match(lines[i]) or OPEN.match(lines[i])):
            region.hint.append(lines[i][len(indent) + 2:])
            i += 1
        while i < len(lines) and not CLOSE.match(lines[i]):
            if OPEN.match(lines[i]):
                raise SkeletonError(f"line {i + 1}: region opened inside the {tag} region (no nesting)")
            if e := ELSE.match(lines[i]):
                region.fallback.append(e["code"])
            else:
                body.append(lines[i])
            i += 1
        if i == len(lines):
            raise SkeletonError(f"the {tag} region opened with '{m['hint'][:40]}...' has no '# endregion'")
        i += 1  # past "# endregion"
        if tag not in strip:
            out.extend(body)
            continue
        out.extend(_todo(region, needs_statement=_opens_block(out) and _closes_block(lines, i, indent),
                         followed=_function_goes_on(out, lines, i, indent)))
    return "\n".join(out) + "\n"


def _todo(region: Region, needs_statement: bool, followed: bool) -> list[str]:
    """The TODO comment (hint and notes), then the raise, the stand-in or nothing. `followed`: given
    lines come after it in the same block, which the student must not mistake for part of the TODO."""
    ind = region.indent
    lines = [f"{ind}# TODO({region.tag}): {region.hint[0]}"] + [f"{ind}# {h}" for h in region.hint[1:]]
    if region.tag in REQUIRED:
        # One short line: the piece to write. The hint is in the comment right above the raise.
        message = f"TODO({region.tag}): {region.hint[0]}".replace("\\", "\\\\").replace('"', '\\"')
        return lines + ([f"{ind}# {REPLACE_RAISE}"] if followed else []) + [f'{ind}raise TodoError("{message}")']
    if region.fallback:
        n = len(region.fallback)
        what = ("replace only the next line; the lines after it" if n == 1 else
                f"replace only the next {n} lines; the lines after them") + " are given"
        return (lines + [f"{ind}# stand-in until this TODO is done ({what if followed else 'replace it'}):"]
                + [ind + code for code in region.fallback])
    return lines + ([f"{ind}pass"] if needs_statement else [])


def split_hint(hint: list[str]) -> tuple[list[str], list[str]]:
    """A region's comment lines after its name: (what and why, the notes of README hints)."""
    first = next((k for k, line in enumerate(hint) if NOTE.match(line)), len(hint))
    return hint[:first], hint[first:]


def _opens_block(out: list[str]) -> bool:
    """Whether the last code line emitted opens a block (so the block needs a statement)."""
    for line in reversed(out):
        code = line.split("#", 1)[0].rstrip()
        if code:
            return code.endswith(":")
    return False


def _function_goes_on(out: list[str], lines: list[str], i: int, indent: str) -> bool:
    """Whether the function around the region has code after position i (given lines that follow it)."""
    def_indent = next((len(line) - len(line.lstrip()) for line in reversed(out)
                       if line.lstrip().startswith("def ") and len(line) - len(line.lstrip()) < len(indent)), -1)
    for line in lines[i:]:
        if line.strip():
            return len(line) - len(line.lstrip()) > def_indent
    return False


def _closes_block(lines: list[str], i: int, indent: str) -> bool:
    """Whether the code after position i leaves the region's block (dedents)."""
    for line in lines[i:]:
        if line.strip():
            return len(line) - len(line.lstrip()) < len(indent)
    return True


def skeleton(solution: str) -> str:
    if SOLUTION_NOTE not in solution:
        raise SkeletonError("solution/fsdp.py's docstring lost the paragraph make_skeleton.SOLUTION_NOTE "
                            "swaps for the student's; put it back or update SOLUTION_NOTE")
    return render(solution).replace(SOLUTION_NOTE, STUDENT_NOTE, 1)


def _code_lines(lines: list[str]) -> int:
    return sum(1 for line in lines if line.strip() and not line.lstrip().startswith("#"))


def line_counts(solution: str) -> dict[str, tuple[int, int]]:
    """Per tag: (code lines the student writes, regions); "given": (code lines outside regions, 0).
    Comments, blank lines and docstrings' insides count as they are: only code and docstring lines."""
    counts: dict[str, list[int]] = {tag: [0, 0] for tag in TAGS}
    given, region, body = [], None, []
    for line in solution.splitlines():
        if m := OPEN.match(line):
            region, body = m["tag"], []
        elif CLOSE.match(line) and region:
            counts[region][0] += _code_lines(body)
            counts[region][1] += 1
            region = None
        elif region:
            body.append(line)
        else:
            given.append(line)
    out = {tag: (n, k) for tag, (n, k) in counts.items()}
    out["given"] = (_code_lines(given), 0)
    return out


def stats_table(solution: str) -> str:
    """docs/instructors.md's table: what each task asks the student to write."""
    counts = line_counts(solution)
    rows = ["| task | regions | lines the student writes (reference) |", "| --- | --- | --- |"]
    rows += [f"| {tag} | {k} | {n} |" for tag, (n, k) in counts.items() if tag != "given"]
    rows.append(f"| given: code and docstrings outside the regions | - | {counts['given'][0]} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class Args:
    """Write fsdp.py, the students' skeleton, from the reference solution/fsdp.py: each exercise
    region becomes its TODO."""

    check: bool = False
    """write nothing; fail when the committed fsdp.py is not what would be written."""
    stats: bool = False
    """print docs/instructors.md's table of what each task asks the student to write, and nothing else."""


def main(args: Args) -> None:
    if not SOLUTION.exists():
        stop(f"{SOLUTION} is missing: restore it with `git checkout {SOLUTION.relative_to(ROOT)}`", BAD_INPUT)
    if args.stats:
        print(stats_table(SOLUTION.read_text()))
        return
    text = skeleton(SOLUTION.read_text())
    compile(text, str(SKELETON), "exec")
    if args.check:
        current = SKELETON.read_text() if SKELETON.exists() else ""
        if current == text:
            print("fsdp.py is up to date with solution/fsdp.py")
            return
        diff = difflib.unified_diff(current.splitlines(), text.splitlines(), "fsdp.py (committed)",
                                    "fsdp.py (regenerated)", lineterm="", n=1)
        print("\n".join(list(diff)[:40]))
        stop("fsdp.py is out of date with solution/fsdp.py (the diff above): run `uv run python -m "
             "solution.make_skeleton`", FAILED)
    SKELETON.write_text(text)
    todos = {tag: text.count(f"TODO({tag})") - text.count(f'"TODO({tag})') for tag in TAGS}
    print(f"wrote {SKELETON.relative_to(ROOT)}: " + ", ".join(f"{n} x {t}" for t, n in todos.items() if n))


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m solution.make_skeleton"))


if __name__ == "__main__":
    cli()

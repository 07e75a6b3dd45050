"""Similarity of submissions, as MOSS and JPlag measure it: the student's own code of each submission,
compared token by token after normalising names, against FSDP2's source and against every other
submission of the batch.

    uv run python -m harness.tools.submissions.similarity submissions/ --out similarity.md   # fast: runs no test
    uv run python -m harness.tools.submissions.grade submissions/ --out points.csv           # adds its CSV columns

handwritten.py stops a submission that imports FSDP2; this catches the one door it leaves open,
FSDP2's source pasted in under new names. How:

1. The student's own code: the submission's logical lines that are not the skeleton's (the top-level
   fsdp.py), found by a line diff on lines reduced to their tokens, so that re-indenting, re-wrapping
   or re-commenting a given line leaves it given. What stays are the filled TODO regions and any
   helper the student added; the skeleton's given code never counts.
2. Tokens: comments, line and indent tokens and docstrings dropped; every name that is not a keyword
   or builtin becomes `V`, numbers `N`, strings `S`, so renaming and reformatting change nothing.
   An attribute name after a dot stays when it is an API name (`all_gather_into_tensor`, `copy_`)
   and becomes `V` when the code or FSDP2 defines it (`self.padded_rows`): see ATTRIBUTES.
3. Fingerprints: hashes of every K tokens in a row, winnowed (of each W consecutive hashes the
   smallest is kept), MOSS's algorithm: any common run of W + K - 1 tokens shares a fingerprint.
4. Score of A against B: the share of A's fingerprints that B has. Two submissions: the larger of
   both directions; a submission against FSDP2: the submission's direction (FSDP2's thousands of lines
   are never mostly inside one submission). Flagged at FLAG or above, with at least MIN_SHARED shared.
   A flag says where to read, not what happened: the page shows both sides of the closest pairs.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import functools
import hashlib
import io
import keyword
import os
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from harness.cli import parse
from harness.errors import BAD_INPUT, stop
from harness.tools.submissions import inert

ROOT = Path(__file__).resolve().parents[3]  # the repository: harness/tools/submissions/similarity.py
SKELETON = ROOT / "fsdp.py"
FSDP2 = "FSDP2"  # the name FSDP2's source goes by in the CSV and on the page

# Calibrated on the cases of the tests, with torch 2.11's FSDP2 (scores measured then, for scale):
# FSDP2's six largest functions pasted in under new names score 0.98 against FSDP2; the reference
# solution renamed and re-spaced 0.98 against itself; two honest solutions of the same TODOs (the
# reference and an independently written one) 0.10 against each other, 0.07 and 0.04 against FSDP2.
K = 12  # tokens per fingerprint, about one statement. Shorter ones are idioms any solution has:
        # the honest scores are at most 0.48 at K = 6, 0.20 at 9, 0.10 at 12, 0.06 at 16, where the
        # copies begin to slip (0.97), each edit breaking longer runs.
W = 8   # winnowing window: a copied run of W + K - 1 = 19 tokens (two statements) is always seen;
        # W hardly moves the scores (4 to 12: within 0.04), it thins the fingerprints kept.
FLAG = 0.5  # half of one's code found in the other: five times the honest scores, half the copies'
MIN_SHARED = 8  # and at least 8 fingerprints (some 60 tokens): one filled two-line TODO has two,
                # and one of them is also FSDP2's (a 0.5 share), which is no evidence
SHOWN = 20  # pairs on the page

# Attribute names after a dot: "keep" (all), "normalise" (none), "defined" (normalise the ones the
# compared code or FSDP2 defines, keep the API's: `copy_`, `all_gather_into_tensor`). Measured: "keep"
# loses a third of the copies (0.66 for FSDP2 pasted, 0.74 for the renamed reference: their renamed
# attributes no longer match), a little more editing would hide them; "normalise" finds them (0.99,
# 0.98) but lifts the honest scores (0.12 between the solutions, 0.11 and 0.07 against FSDP2: every
# `x.y(z)` looks alike); "defined" finds them (0.98, 0.98) and keeps the honest ones lowest (0.10,
# 0.07, 0.04).
ATTRIBUTES = "defined"
_KEPT_NAMES = frozenset(keyword.kwlist) | frozenset(dir(builtins))
# Python 3.12 tokenises an f-string into parts (its expressions as ordinary tokens between them).
_STRINGS = {tokenize.STRING} | {getattr(tokenize, part) for part in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                                if hasattr(tokenize, part)}
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}


@dataclass(frozen=True)
class Line:
    """One logical line (a statement or a block's header), however many physical lines it spans."""

    tokens: tuple[tokenize.TokenInfo, ...]

    @property
    def text(self) -> str:
        return " ".join(t.string for t in self.tokens)


def logical_lines(source: str) -> list[Line]:
    """The code's logical lines, without comments, blank lines and docstrings (a line that is
    nothing but a string). Raises SyntaxError or tokenize.TokenError on a file Python cannot read."""
    lines, current = [], []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NEWLINE or (tok.type == tokenize.ENDMARKER and current):
            if current and not all(t.type == tokenize.STRING for t in current):
                lines.append(Line(tuple(current)))
            current = []
        elif tok.type not in _SKIPPED:
            current.append(tok)
    return lines


def own_code(source: str, skeleton: str) -> list[list[Line]]:
    """The student's own code: the blocks of logical lines the submission inserted or changed with
    respect to the skeleton. Given code left as it was (re-indented or re-commented) is no part."""
    mine, given = logical_lines(source), logical_lines(skeleton)
    diff = difflib.SequenceMatcher(None, [g.text for g in given], [m.text for m in mine], autojunk=False)
    return [mine[j1:j2] for op, _, _, j1, j2 in diff.get_opcodes() if op in ("replace", "insert")]


def defined_names(source: str) -> set[str]:
    """Names the code defines: functions, classes, arguments, imports, assigned names and attributes."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def normalise(line: Line, defined: set[str], attributes: str = ATTRIBUTES) -> list[str]:
    """The line's tokens with names, numbers and strings reduced to V, N and S."""
    out = []
    for i, tok in enumerate(line.tokens):
        text = tok.string
        if tok.type == tokenize.NAME and text not in _KEPT_NAMES:
            after_dot = i > 0 and line.tokens[i - 1].string == "."
            keep = after_dot and (attributes == "keep" or (attributes == "defined" and text not in defined))
            text = text if keep else "V"
        elif tok.type == tokenize.NUMBER:
            text = "N"
        elif tok.type in _STRINGS:
            text = "S"
        out.append(text)
    return out


@dataclass
class Code:
    """A normalised token stream, with where each token came from, and its winnowed fingerprints."""

    name: str                 # a submission's file name, or FSDP2
    tokens: list[str] = field(default_factory=list)
    where: list[tuple[str, int, int]] = field(default_factory=list)  # (file, line, block) per token
    fingerprints: dict[int, list[int]] = field(default_factory=dict)  # hash -> token positions
    error: str = ""           # why the file could not be read (it then has no tokens)

    def add(self, path: str, block: int, lines: list[Line], defined: set[str], attributes: str) -> None:
        for line in lines:
            for tok, text in zip(line.tokens, normalise(line, defined, attributes)):
                self.tokens.append(text)
                self.where.append((path, tok.start[0], block))

    def winnow(self) -> Code:
        """MOSS's winnowing: of every W consecutive k-gram hashes keep the smallest (the rightmost
        of equal ones), each kept position once."""
        hashes = [int.from_bytes(hashlib.blake2b("\x1f".join(self.tokens[i:i + K]).encode(), digest_size=8).digest())
                  for i in range(len(self.tokens) - K + 1)]
        kept: set[int] = set()
        for start in range(max(1, len(hashes) - W + 1)):
            window = hashes[start:start + W]
            if window:
                low = min(window)
                kept.add(start + max(i for i, h in enumerate(window) if h == low))
        for pos in sorted(kept):
            self.fingerprints.setdefault(hashes[pos], []).append(pos)
        return self


def submission_code(path: Path, skeleton: str, attributes: str = ATTRIBUTES) -> Code:
    """A submission's own code (see own_code), fingerprinted."""
    code = Code(path.name)
    try:
        source = path.read_text()
        defined = defined_names(source) | fsdp2_defined()
        blocks = own_code(source, skeleton)
    except (SyntaxError, tokenize.TokenError, ValueError) as e:  # ValueError: not UTF-8, or null bytes
        code.error = f"not compared: Python cannot read it ({type(e).__name__}: {e})"
        return code
    for block, lines in enumerate(blocks):
        code.add(path.name, block, lines, defined, attributes)
    return code.winnow()


def fsdp2_dir() -> Path:
    """FSDP2's source folder in the installed torch (found from torch's path, whatever its version)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent / "distributed" / "fsdp" / "_fully_shard"


@functools.cache
def fsdp2_sources() -> dict[Path, str]:
    files = sorted(fsdp2_dir().glob("*.py"))
    if not files:
        stop(f"no FSDP2 source in {fsdp2_dir()}: this torch has no torch.distributed.fsdp._fully_shard; "
             "install the torch of uv.lock (`uv sync --frozen`)", BAD_INPUT)
    return {f: f.read_text() for f in files}


@functools.cache
def fsdp2_defined() -> frozenset[str]:
    """The names FSDP2 defines. They count as defined in every submission too: one that pastes a part
    of FSDP2 uses attributes (`self._sharded_param_data`) that another part defines."""
    return frozenset().union(*(defined_names(s) for s in fsdp2_sources().values()))


@functools.cache
def fsdp2_code(attributes: str = ATTRIBUTES) -> Code:
    """FSDP2's source files, whole, tokenised as a submission's own code is (one block per file)."""
    code = Code(FSDP2)
    for block, (f, source) in enumerate(fsdp2_sources().items()):
        code.add(os.path.join("_fully_shard", f.name), block, logical_lines(source), set(fsdp2_defined()), attributes)
    return code.winnow()


def _ranges(code: Code, hashes: frozenset[int]) -> list[tuple[str, int, int]]:
    """The lines the matched k-grams cover, adjacent ones merged (never across a block)."""
    covered = [False] * len(code.tokens)
    for h in hashes:
        for pos in code.fingerprints[h]:
            covered[pos:pos + K] = [True] * min(K, len(code.tokens) - pos)
    out: list[tuple[str, int, int]] = []
    for i, hit in enumerate(covered):
        if not hit:
            continue
        path, line, block = code.where[i]
        if out and i > 0 and covered[i - 1] and code.where[i - 1][2] == block:
            out[-1] = (path, out[-1][1], line)
        else:
            out.append((path, line, line))
    return out


@dataclass(frozen=True)
class Match:
    """How much of `a`'s code is in `b`'s, and where (the lines only when asked: a batch has many pairs)."""

    a: Code
    b: Code
    score: float            # the share of a's fingerprints in b (two submissions: either way, the larger)
    shared: frozenset[int]  # the fingerprints in common

    @property
    def flagged(self) -> bool:
        return self.score >= FLAG and len(self.shared) >= MIN_SHARED

    def ranges(self) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
        """(file, first line, last line) of the matched code in a, and in b."""
        return _ranges(self.a, self.shared), _ranges(self.b, self.shared)

    def swapped(self) -> Match:
        return Match(self.b, self.a, self.score, self.shared)

    def __repr__(self) -> str:
        return f"Match({self.a.name} ~ {self.b.name}: {self.score:.3f}, {len(self.shared)} shared, flagged={self.flagged})"


def compare(a: Code, b: Code, both_ways: bool = True) -> Match:
    shared = frozenset(a.fingerprints) & frozenset(b.fingerprints)
    share = lambda c: len(shared) / len(c.fingerprints) if c.fingerprints else 0.0
    return Match(a, b, max(share(a), share(b)) if both_ways else share(a), shared)


@dataclass
class Batch:
    """Every comparison of a batch: each submission against FSDP2 and against each other."""

    codes: list[Code]
    matches: list[Match]

    def best(self, name: str) -> Match | None:
        """The submission's closest match (FSDP2 or another submission), seen from its side."""
        mine = [m if m.a.name == name else m.swapped() for m in self.matches if name in (m.a.name, m.b.name)]
        return max(mine, key=lambda m: (m.score, len(m.shared)), default=None)

    def columns(self, name: str) -> dict[str, str]:
        """The CSV columns of one submission (see COLUMNS); similar_to is empty when nothing matched."""
        code = next(c for c in self.codes if c.name == name)
        if code.error:
            return {"similar_to": code.error, "similarity": "", "similar_lines": "", "flagged": "no"}
        m = self.best(name)
        if m is None or not m.score:
            return {"similar_to": "", "similarity": "0.00", "similar_lines": "", "flagged": "no"}
        mine, theirs = m.ranges()
        return {"similar_to": m.b.name, "similarity": f"{m.score:.2f}",
                "similar_lines": f"{show(mine, 3)} ~ {show(theirs, 3)}", "flagged": "yes" if m.flagged else "no"}


# The CSV columns grade adds: the closest match, its score, its lines on both sides, and whether flagged.
COLUMNS = ("similar_to", "similarity", "similar_lines", "flagged")


def show(ranges: list[tuple[str, int, int]], most: int = 6) -> str:
    """The first `most` line ranges, by file: `a.py:3-9,12; b.py:40-52` (and how many in all)."""
    by_file: dict[str, list[str]] = {}
    for f, a, b in ranges[:most]:
        by_file.setdefault(f, []).append(f"{a}-{b}" if a != b else str(a))
    text = "; ".join(f"{f}:{','.join(lines)}" for f, lines in by_file.items())
    return text + (f" ... ({len(ranges)} ranges)" if len(ranges) > most else "")


def is_skeleton(text: str) -> bool:
    """Whether the file is still the unfilled skeleton: each `# TODO(task1)` still followed by its raise
    (a guard against comparing with a student's own fsdp.py, where nothing would count as theirs)."""
    todos = text.count("# TODO(task1): ")
    return todos > 0 and text.count('raise TodoError("TODO(task1): ') == todos


def read_skeleton(path: Path) -> str:
    if not path.is_file():
        stop(f"the skeleton {path} is missing: restore it (`git checkout fsdp.py`) or give one with --skeleton",
             BAD_INPUT)
    text = path.read_text()
    if not is_skeleton(text):
        stop(f"{path} is not the unfilled skeleton (its TODO(task1)s no longer all raise), and the skeleton's "
             "given code is what similarity leaves out of each submission: put the skeleton back in place "
             "(`git stash` the work in it) or give it with `python -m harness.tools.submissions.similarity --skeleton`",
             BAD_INPUT)
    return text


def check(paths: list[Path], skeleton: Path = SKELETON, attributes: str = ATTRIBUTES) -> Batch:
    """Compare each submission with FSDP2 and with every other one (one file: FSDP2 only). Without
    the unfilled skeleton nothing is compared (each submission says why): grading goes on."""
    given = skeleton.read_text() if skeleton.is_file() else ""
    if not is_skeleton(given):
        why = f"not compared: {skeleton} is not the unfilled skeleton (see harness.tools.submissions.similarity --skeleton)"
        return Batch([Code(p.name, error=why) for p in paths], [])
    codes = [submission_code(p, given, attributes) for p in paths]
    fsdp2 = fsdp2_code(attributes)
    readable = [c for c in codes if not c.error]
    matches = [compare(c, fsdp2, both_ways=False) for c in readable]
    matches += [compare(a, b) for i, a in enumerate(readable) for b in readable[i + 1:]]
    return Batch(codes, matches)


def _excerpt(files: dict[str, list[str]], where: tuple[str, int, int], lines: int = 6) -> str:
    path, first, last = where
    text = files.get(path, [])[first - 1:min(last, first + lines - 1)]
    more = "\n..." if last - first + 1 > lines else ""
    return inert.code_block("\n".join(text) + more)


def page(batch: Batch, paths: list[Path]) -> str:
    """The markdown page: the closest pairs, their scores, line ranges and an excerpt of each side.
    File names, errors and excerpts are the submissions' text, shown as text (harness.tools.submissions.inert)."""
    md = inert.markdown_text
    files = {p.name: p.read_text(errors="replace").splitlines() for p in paths}
    files |= {os.path.join("_fully_shard", f.name): s.splitlines() for f, s in fsdp2_sources().items()}
    rank = sorted((m for m in batch.matches if m.score), key=lambda m: (-m.score, -len(m.shared), m.a.name, m.b.name))[:SHOWN]
    out = ["# Similarity", "",
           f"Each submission's own code (not the skeleton's) against FSDP2's source ({fsdp2_dir()}) and against "
           f"every other submission, after normalising names: the share of its fingerprints ({K}-token runs, "
           f"winnowed over {W}) found in the other. Flagged: {FLAG:.2f} or more, with {MIN_SHARED}+ fingerprints "
           "in common. A flag is a reason to read both, not a verdict.", "",
           "| score | flagged | submission | similar to | shared | lines (submission) | lines (other) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in rank:
        ranges_a, ranges_b = m.ranges()
        out.append(f"| {m.score:.2f} | {'**yes**' if m.flagged else 'no'} | {md(m.a.name)} | {md(m.b.name)} | "
                   f"{len(m.shared)} | {md(show(ranges_a))} | {md(show(ranges_b))} |")
    if not rank:
        out.append("| 0.00 | no | (nothing matched) | | | | |")
    for c in batch.codes:
        if c.error:
            out.append(f"\n{md(c.name)}: {md(c.error)}")
    longest = lambda rs: max(rs, key=lambda r: r[2] - r[1])
    for m in (m for m in rank if m.flagged):
        out += ["", f"## {md(m.a.name)} ~ {md(m.b.name)}: {m.score:.2f}", "", "The longest matched range of each side:"]
        for code, ranges in zip((m.a, m.b), m.ranges()):
            path, first, last = longest(ranges)
            where = f"{md(path)} lines {first}-{last}" if code.name != FSDP2 else f"FSDP2, {path} lines {first}-{last}"
            out += ["", where + ":", "", _excerpt(files, (path, first, last))]
    return "\n".join(out) + "\n"


def submissions(path: Path) -> list[Path]:
    """The .py files of a folder, or the one file; a bad path stops with what to give instead."""
    if not path.exists():
        stop(f"{path} does not exist: give a .py submission or a folder of them", BAD_INPUT)
    if path.is_dir():
        files = sorted(path.glob("*.py"))
        if not files:
            stop(f"{path} has no .py files: give a folder of submissions, or one .py file", BAD_INPUT)
        return files
    if path.suffix != ".py":
        stop(f"{path} is not a .py file: give a .py submission or a folder of them", BAD_INPUT)
    return [path]


@dataclass(frozen=True)
class Args:
    """Compare submissions' own code (not the skeleton's) with FSDP2's source and with each other,
    MOSS-style, without running any test: a markdown page of the closest pairs."""

    submissions: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="SUBMISSIONS")]
    """a .py file (compared with FSDP2 only), or a folder of them (also with each other)."""
    out: Path | None = None
    """markdown page to write (default: stdout)."""
    skeleton: Path = SKELETON
    """the unfilled skeleton, whose given code is no submission's own (default: the repository's fsdp.py)."""


def main(args: Args) -> None:
    files = submissions(args.submissions)
    read_skeleton(args.skeleton)
    batch = check(files, args.skeleton)
    text = page(batch, files)
    if args.out is None:
        print(text, end="")
        return
    args.out.write_text(text)
    flagged = sorted({c.name for m in batch.matches if m.flagged for c in (m.a, m.b)} - {FSDP2})
    print(f"wrote {args.out}: {len(files)} submissions, flagged: {', '.join(flagged) or 'none'}")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.submissions.similarity"))


if __name__ == "__main__":
    cli()

"""harness.tools.submissions.similarity: FSDP2's source pasted in under new names is flagged; the skeleton's given
code never counts. The cases that need the reference solution sit with the instructors' tests.

Every case is built here from the skeleton and the installed FSDP2, nothing is committed: a copy is
renamed with `rename` (every name the code defines, and every local, consistently) and re-spaced by
tokenize's own untokenize, which lays out each token anew."""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from pathlib import Path

import pytest

from harness.tools.submissions import grade, similarity
from harness.tools.grading import handwritten
from harness.tools.submissions.similarity import FSDP2, SKELETON, check

# A student's copy of the repository has their work in fsdp.py: these cases need the unfilled skeleton.
needs_skeleton = pytest.mark.skipif(not similarity.is_skeleton(SKELETON.read_text()), reason="fsdp.py is not the skeleton")


def rename(source: str, keep: set[str] = frozenset()) -> str:
    """`source` with every plain name, and every attribute or method it defines, renamed consistently
    (keywords, builtins, API attributes, imports, keyword arguments and `keep` excepted, so that a
    program still runs), and every token re-spaced."""
    tree = ast.parse(source)
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    attributes |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    new: dict[str, str] = {}
    out, depth, statement = [], 0, []
    for i, tok in enumerate(toks):
        text = tok.string
        depth += (text in "([{") - (text in ")]}") if tok.type == tokenize.OP else 0
        code = [t for t in statement if t.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
        after_dot = bool(code) and code[-1].string == "."
        importing = bool(code) and code[0].string in ("import", "from")
        keyword_argument = depth > 0 and i + 1 < len(toks) and toks[i + 1].string == "="
        if (tok.type == tokenize.NAME and text not in similarity._KEPT_NAMES and text not in keep
                and not importing and not keyword_argument and (text in attributes or not after_dot)):
            text = new.setdefault(text, f"q{len(new)}_{text[::-1].strip('_')}")
        out.append((tok.type, text))
        statement = [] if tok.type == tokenize.NEWLINE else statement + [tok]
    return tokenize.untokenize(out)


def largest_functions(path: Path, n: int) -> list[str]:
    """The source of the n longest functions (methods too) of a file, dedented to top level."""
    source = path.read_text()
    funcs = [f for f in ast.walk(ast.parse(source)) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    funcs.sort(key=lambda f: f.end_lineno - f.lineno, reverse=True)
    lines = source.splitlines()
    return [textwrap.dedent("\n".join(lines[f.lineno - 1:f.end_lineno])) for f in funcs[:n]]


def fsdp2_pasted(tmp_path: Path, name: str = "pasted.py") -> Path:
    """The skeleton with FSDP2's largest functions appended, renamed and re-spaced (a student who
    inlined FSDP2 instead of importing it, which handwritten.py would refuse)."""
    folder = similarity.fsdp2_dir()
    body = largest_functions(folder / "_fsdp_collectives.py", 3) + largest_functions(folder / "_fsdp_param.py", 3)
    path = tmp_path / name
    path.write_text(SKELETON.read_text() + "\n\n" + rename("\n\n".join(body) + "\n"))
    return path


def score(batch: similarity.Batch, a: str, b: str) -> similarity.Match:
    return next(m for m in batch.matches if {m.a.name, m.b.name} == {a, b})


@needs_skeleton
def test_fsdp2_pasted_under_new_names_is_flagged(tmp_path):
    path = fsdp2_pasted(tmp_path)
    pasted = path.read_text()[len(SKELETON.read_text()):]
    assert len(pasted.splitlines()) > 300 and "reduce_scatter" in pasted, "the paste holds no FSDP2 code: nothing was tested"
    batch = check([path])
    m = score(batch, path.name, FSDP2)
    assert m.flagged and m.score > 0.9, m
    columns = batch.columns(path.name)
    assert columns["similar_to"] == FSDP2 and columns["similarity"] == f"{m.score:.2f}" and columns["flagged"] == "yes"
    assert columns["similar_lines"].startswith("pasted.py:") and " ~ _fully_shard/" in columns["similar_lines"], columns
    # the matched lines are the pasted ones, after the skeleton's, and FSDP2's own lines
    given = len(SKELETON.read_text().splitlines())
    ranges_a, ranges_b = m.ranges()
    assert all(first > given for _, first, _ in ranges_a), ranges_a
    assert {f for f, _, _ in ranges_b} >= {"_fully_shard/_fsdp_collectives.py", "_fully_shard/_fsdp_param.py"}


@needs_skeleton
def test_fsdp2_pasted_without_normalising_is_missed(tmp_path, monkeypatch):
    """What makes the check work: names normalised. Compared as written, the renamed copy is missed."""
    path = fsdp2_pasted(tmp_path)
    monkeypatch.setattr(similarity, "normalise", lambda line, defined, attributes="": [t.string for t in line.tokens])
    similarity.fsdp2_code.cache_clear()
    try:
        m = score(check([path]), path.name, FSDP2)
    finally:
        similarity.fsdp2_code.cache_clear()
    assert not m.flagged and m.score < 0.1, m


@needs_skeleton
def test_two_renamed_copies_are_flagged_together(tmp_path):
    """Two submissions of the same pasted code, renamed apart: flagged against each other as well."""
    a, b = fsdp2_pasted(tmp_path, "a.py"), tmp_path / "b.py"
    b.write_text(rename(a.read_text(), keep=similarity.defined_names(SKELETON.read_text())))
    batch = check([a, b])
    assert score(batch, "a.py", "b.py").flagged and score(batch, "a.py", "b.py").score > 0.9


@needs_skeleton
def test_given_code_never_counts(tmp_path):
    """The skeleton has no own code, nor does a copy of it re-spaced and re-commented; one filled TODO
    is that submission's only code."""
    skeleton = SKELETON.read_text()
    assert similarity.own_code(skeleton, skeleton) == []
    respaced = tokenize.untokenize((t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(skeleton).readline))
    assert respaced != skeleton and similarity.own_code(respaced.replace("# TODO", "# todo:"), skeleton) == []

    raise_line = next(line for line in skeleton.splitlines() if "raise TodoError(\"TODO(task1): free the full parameter" in line)
    indent = raise_line[:len(raise_line) - len(raise_line.lstrip())]
    one = tmp_path / "one_todo.py"
    # (two lines that are not the answer: this file is in the student repository)
    one.write_text(skeleton.replace(raise_line, f"{indent}if self.unsharded is not None and self.unsharded.grad is not None:\n"
                                                f"{indent}    self.unsharded.grad = None"))
    blocks = similarity.own_code(one.read_text(), skeleton)
    assert [[line.text for line in block] for block in blocks] == [
        ["if self . unsharded is not None and self . unsharded . grad is not None :", "self . unsharded . grad = None"]]
    files = [tmp_path / "skeleton.py", one]
    files[0].write_text(skeleton)
    batch = check(files)
    assert batch.columns("skeleton.py") == {"similar_to": "", "similarity": "0.00", "similar_lines": "", "flagged": "no"}
    assert score(batch, "skeleton.py", "one_todo.py").score == 0
    # Two lines make a few fingerprints: too few to flag anything (MIN_SHARED), whatever they match.
    m = score(batch, "one_todo.py", FSDP2)
    assert len(similarity.submission_code(one, skeleton).fingerprints) < similarity.MIN_SHARED and not m.flagged, m


def test_winnowing_keeps_a_fingerprint_of_every_long_enough_run():
    """MOSS's guarantee: each window of W hashes keeps one, so a run of W + K - 1 tokens is seen."""
    code = similarity.Code("x", tokens=[f"t{i % 37}" for i in range(400)], where=[("x", i, 0) for i in range(400)])
    kept = sorted(p for ps in code.winnow().fingerprints.values() for p in ps)
    assert kept and all(b - a <= similarity.W for a, b in zip(kept, kept[1:])), kept


@needs_skeleton
def test_page_and_cli(tmp_path, capsys):
    folder = tmp_path / "subs"
    folder.mkdir()
    fsdp2_pasted(folder, "pasted.py")
    (folder / "broken.py").write_text("def f(:\n    '''never closed\n")
    out = tmp_path / "page.md"
    similarity.cli([str(folder), "--out", str(out)])
    assert "flagged: pasted.py" in capsys.readouterr().out
    text = out.read_text()
    assert "| pasted.py | FSDP2 |" in text and "## pasted.py ~ FSDP2" in text and "_fully_shard/" in text, text[:2000]
    assert "broken.py: not compared: Python cannot read it" in text


@pytest.mark.parametrize("make, problem", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "has no .py files"),
    (lambda d: (d / "notes.txt").write_text("x") and d / "notes.txt", "is not a .py file"),
])
def test_bad_input(tmp_path, capsys, make, problem):
    with pytest.raises(SystemExit) as e:
        similarity.cli([str(make(tmp_path))])
    assert e.value.code == 2 and problem in capsys.readouterr().err


@needs_skeleton
def test_a_filled_skeleton_is_refused(tmp_path, capsys):
    """Given code is the skeleton's: a skeleton with a TODO filled (a student's fsdp.py) would hide that code."""
    skeleton = SKELETON.read_text()
    raise_line = next(line for line in skeleton.splitlines() if 'raise TodoError("TODO(task1): ' in line)
    filled = tmp_path / "filled.py"
    filled.write_text(skeleton.replace(raise_line, raise_line.replace('raise TodoError("TODO(task1): ', 'print("')))
    with pytest.raises(SystemExit) as e:
        similarity.cli([str(filled), "--skeleton", str(filled)])
    assert e.value.code == 2 and "is not the unfilled skeleton" in capsys.readouterr().err
    # grade goes on without: each row says why it was not compared
    assert check([filled], filled).columns("filled.py")["similar_to"].startswith("not compared: ")


@needs_skeleton
def test_grade_adds_the_columns_and_the_page(tmp_path, monkeypatch):
    """grade's CSV gets similar_to/similarity/flagged, and similarity.md lands beside it (the tests
    themselves are not run here: test_grade runs them)."""
    import csv

    folder = tmp_path / "subs"
    folder.mkdir()
    a = fsdp2_pasted(folder, "a.py")
    (folder / "b.py").write_text(rename(a.read_text(), keep=similarity.defined_names(SKELETON.read_text())))
    (folder / "skeleton.py").write_text(SKELETON.read_text())
    monkeypatch.setattr(grade, "grade", lambda path, timeout, pytest_args, artifacts=None: {"submission": str(path), "total": 0})
    grade.cli([str(folder), "--out", str(tmp_path / "points.csv")])
    rows = {r["submission"].rsplit("/", 1)[-1]: r for r in csv.DictReader((tmp_path / "points.csv").open())}
    assert rows["a.py"]["flagged"] == rows["b.py"]["flagged"] == "yes", rows
    assert {rows["a.py"]["similar_to"], rows["b.py"]["similar_to"]} <= {"a.py", "b.py", FSDP2}, rows
    assert rows["skeleton.py"]["flagged"] == "no" and rows["skeleton.py"]["similarity"] == "0.00", rows
    assert "| a.py | b.py |" in (tmp_path / "similarity.md").read_text()


def test_fsdp2_imported_is_still_refused(tmp_path):
    """Similarity catches FSDP2 pasted in; importing it stays handwritten.py's to refuse."""
    path = tmp_path / "imports.py"
    path.write_text(SKELETON.read_text() + "\nfrom torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce\n")
    assert handwritten.static_problem(path), "an FSDP2 import passed the static check"


HOSTILE_NAME = "x<img src=y onerror=z>|[a](javascript:b)`c`*d*.py"


@needs_skeleton
def test_page_shows_the_submissions_text_as_text(tmp_path):
    """similarity.md shows a submission's file name, its error and its code as text: no HTML, link,
    emphasis or table cell of theirs, and an excerpt whose own backticks cannot close its fence."""
    folder = tmp_path / "subs"
    folder.mkdir()
    pasted = fsdp2_pasted(folder, HOSTILE_NAME)
    # A fence and HTML in the student's own comments, after every argument of the pasted code.
    pasted.write_text("\n".join(line + "  # ``` </code> <b>" if line.endswith(",") else line
                                for line in pasted.read_text().splitlines()) + "\n")
    (folder / "<b>broken.py").write_text("def f(:\n")
    page = similarity.page(check(sorted(folder.glob("*.py"))), sorted(folder.glob("*.py")))
    outside_code = "".join(block for block in page.split("\n\n") if not block.startswith("````"))
    assert "<img" not in outside_code and "<b>" not in outside_code, outside_code[:3000]
    assert "](javascript" not in page.replace("\\]", ""), page[:3000]
    assert "x&lt;img src=y onerror=z&gt;\\|\\[a\\](javascript:b)\\`c\\`\\*d\\*.py" in page, page[:3000]
    assert "&lt;b&gt;broken.py: not compared" in page
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    assert all(line.count("|") - line.count("\\|") == 8 for line in rows), rows  # 7 cells each, no more
    excerpt = next(block for block in page.split("\n\n") if block.startswith("````python\n"))
    assert excerpt.endswith("\n````") and "# ``` </code> <b>" in excerpt, excerpt


def test_code_block_fence_outlasts_the_code():
    from harness.tools.submissions import inert

    assert inert.code_block("x = 1") == "```python\nx = 1\n```"
    assert inert.code_block("a = '`````'") == "``````python\na = '`````'\n``````"

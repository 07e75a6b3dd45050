"""The pages (README.md and docs/*.md) hold together: every relative link reaches a file and, where
it names one, a heading; every `python -m MODULE` they give runs (`MODULE --help` exits 0); every
hint the code cites (`H6`...) is in the README's Hints. Each check is a function of the text, tried
here on a broken sample too, so a check that can no longer fail is seen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
# `python -m pkg.mod`, also wrapped over two lines and after torchrun's options; a placeholder such as
# `harness.tools.<tool>` names no module, so a name must not run on into `.` or `<`.
MODULE = re.compile(r"(?:python|torchrun[^`\n]*?)\s+-m\s+([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w.<])")
HINT = re.compile(r"\bH(\d{1,2})\b")


def pages(root: Path = ROOT) -> list[Path]:
    """The README and the pages beside it (the student repository has fewer of them)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and inline code: a link or heading shown as code is not one."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2... as GitHub gives it."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def dead_links(page: Path, text: str) -> list[str]:
    """The relative links of `text` (the page at `page`) whose file, or heading in it, is missing."""
    dead = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            dead.append(f"{target}: {file.name} has no heading with anchor #{anchor}")
    return dead


def modules_named(text: str) -> list[str]:
    """The modules the text runs with `python -m` (or `torchrun ... -m`), in order, once each."""
    return list(dict.fromkeys(MODULE.findall(text)))


# Runs `python -m MODULE --help` for each module named in argv, in this one process: importing torch
# once for all of them instead of once each keeps the check to seconds. Prints one JSON line per
# module: its exit code and the end of what it wrote.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
for module in sys.argv[1:]:
    out = io.StringIO()
    code = 0
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps({"module": module, "code": code, "said": out.getvalue()[-2000:]}), flush=True)
"""


def help_problems(modules: list[str], cwd: Path = ROOT) -> dict[str, str]:
    """Module -> what went wrong, for each of `modules` whose `python -m MODULE --help` (run in `cwd`)
    does not exit 0. Empty when all answer."""
    if not modules:
        return {}
    try:
        proc = subprocess.run([sys.executable, "-c", HELP_DRIVER, *modules], cwd=cwd, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        return dict.fromkeys(modules, "`--help` did not finish in 600 s")
    seen = {r["module"]: r for r in map(json.loads, re.findall(r'^\{"module": .*$', proc.stdout, re.M))}
    problems = {}
    for module in modules:
        if module not in seen:
            problems[module] = f"`python -m {module} --help` stopped the checker:\n{proc.stderr[-2000:]}"
        elif seen[module]["code"] != 0:
            problems[module] = f"`python -m {module} --help` exited {seen[module]['code']}:\n{seen[module]['said']}"
    return problems


def hints_cited(sources: list[Path]) -> dict[str, str]:
    """Each hint (`H6`) cited in these files -> the first file citing it."""
    cited: dict[str, str] = {}
    for path in sources:
        for n in HINT.findall(path.read_text()):
            cited.setdefault(f"H{n}", path.relative_to(ROOT).as_posix())
    return cited


def hints_missing(cited: dict[str, str], readme: str) -> list[str]:
    """The cited hints that the README's Hints do not define (each is a `**Hn ` bullet there)."""
    return [f"{hint} (cited in {where})" for hint, where in cited.items() if f"**{hint} " not in readme]


# ---------------------------------------------------------------------------------------- the pages


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page):
    assert not (dead := dead_links(page, page.read_text())), "\n".join(dead)


def test_readme_links_each_other_page_from_one_line():
    """Each page under docs/ is reached from the README by exactly one line (the student repository
    has only the pages it ships, and the README's lines for them)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    for page in pages()[1:]:
        linking = [line for line in lines if f"](docs/{page.name}" in line]
        assert len(linking) == 1, f"README.md links docs/{page.name} from {len(linking)} lines: {linking}"


def test_every_module_the_pages_run_answers_help():
    modules = list(dict.fromkeys(m for page in pages() for m in modules_named(page.read_text())))
    assert "harness.tools.submissions.handin" in modules, modules  # the README's hand-in command: the pattern finds it
    assert not (problems := help_problems(modules)), "\n\n".join(problems.values())


def test_every_cited_hint_is_in_the_readme():
    # fsdp.py carries the reference's comments outside the exercise regions; the regions' own hints
    # are checked where the reference is (its skeleton's tests)
    code = [p for p in [*ROOT.glob("*.py"), *ROOT.glob("harness/**/*.py")] if "tests" not in p.parts]
    cited = hints_cited(code)
    assert "H1" in cited, "no hint cited anywhere: the pattern no longer finds them"
    assert not (missing := hints_missing(cited, (ROOT / "README.md").read_text())), missing


# ------------------------------------------------------------------------- the checks, on broken text


def test_dead_links_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Train.py's flags, in `full`\n\n## Same\n\n## Same\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n## A section\n\n"
        "[ok](docs/other.md) [ok](docs/other.md#trainpys-flags-in-full) [ok](#a-section) [ok](docs/other.md#same-1)\n"
        "[web](https://example.com/missing) `[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
        "[gone](docs/gone.md) [no heading](docs/other.md#nowhere) [here](#b-section)\n")
    dead = dead_links(page, page.read_text())
    assert [d.split(":")[0] for d in dead] == ["docs/gone.md", "docs/other.md#nowhere", "#b-section"], dead


def test_modules_named_reads_wrapped_commands_and_skips_placeholders():
    text = ("`uv run python -m harness.tools.submissions.grade submissions/` and `uv run python -m\nharness.tools.traces.pictures a b`;\n"
            "`uv run torchrun --nproc-per-node W -m harness.tools.lab.init_memory --model 1b`; "
            "`uv run python -m harness.tools.<tool> --help`; again `python -m harness.tools.submissions.grade`")
    assert modules_named(text) == ["harness.tools.submissions.grade", "harness.tools.traces.pictures", "harness.tools.lab.init_memory"]


def test_help_problems_names_a_missing_module_and_a_failing_help(tmp_path):
    (tmp_path / "fails_on_help.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "raises_on_help.py").write_text("raise RuntimeError('broken')\n")
    (tmp_path / "answers_help.py").write_text("import sys\nprint('usage: ...')\nsys.exit(0)\n")
    problems = help_problems(["answers_help", "no_such_module_here", "fails_on_help", "raises_on_help"], cwd=tmp_path)
    assert sorted(problems) == ["fails_on_help", "no_such_module_here", "raises_on_help"], problems
    assert "exited 3" in problems["fails_on_help"] and "No module named" in problems["no_such_module_here"]
    assert "RuntimeError: broken" in problems["raises_on_help"]


def test_hints_missing_names_a_hint_the_readme_lacks():
    cited = {"H1": "fsdp.py", "H14": "harness/x.py"}
    assert hints_missing(cited, "- **H1 rows.** ...\n- H14 mentioned, not defined\n") == ["H14 (cited in harness/x.py)"]

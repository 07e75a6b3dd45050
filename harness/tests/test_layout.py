"""The repository's shape: the student's top level, train.py's size, no import cycles, and two floors:
the runtime (harness/) never imports the tools above it (harness/tools/), and docs/measuring.md says which is which."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL_PYTHON = {"fsdp.py", "train.py", "test.py", "conftest.py"}


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every Python file of the project (not the virtual environment)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "dist"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its file (inside functions too: an import
    deferred to a function is still a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` depends on the deepest project module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports(path, name, modules) for name, path in modules.items()}
    assert graph["train"] and "harness.tools.grading.ranks" in graph["harness.tools.grading.checks"], "the import graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"train": {"harness.tools.grading.ranks"}, "harness.tools.grading.ranks": {"train"}}) == ["harness.tools.grading.ranks", "train", "harness.tools.grading.ranks"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_top_level_is_the_students():
    extra = {p.name for p in ROOT.glob("*.py")} - TOP_LEVEL_PYTHON
    assert not extra, f"the top level is the student's world; move {sorted(extra)} into harness/"


def test_train_py_reads_in_one_sitting():
    lines = len((ROOT / "train.py").read_text().splitlines())
    assert lines <= 300, f"train.py has {lines} lines; move set-up code into harness/"


# --------------------------------------------------------------------------- two floors

RUNTIME, TOOLS = "harness", "harness.tools"  # what train.py stands on; the grading and measuring tools above it


def floors() -> tuple[dict[str, set[str]], set[str], set[str]]:
    modules = project_modules()
    graph = {name: imports(path, name, modules) for name, path in modules.items()}
    runtime = {n for n in modules if n.startswith(RUNTIME + ".") and n.count(".") == 1} - {TOOLS, "harness.tests"}
    tools = {n for n in modules if n.startswith(TOOLS + ".")}
    return graph, runtime, tools


def upward_edges(graph: dict[str, set[str]], below: set[str]) -> list[str]:
    """Imports from a module below (the runtime, train.py) up into the tools, the tests or conftest."""
    above = lambda m: m.startswith((TOOLS, "harness.tests", "solution")) or m in ("conftest", "test")
    return sorted(f"{m} -> {t}" for m in below for t in graph.get(m, ()) if above(t))


def test_no_upward_edge():
    graph, runtime, tools = floors()
    assert runtime and tools, "the floors were not found"
    assert not (edges := upward_edges(graph, runtime | {"train"} | {m for m in graph if m.rpartition(".")[2] == "fsdp"})), \
        "the runtime imports what stands above it: " + ", ".join(edges)
    harness = {m for m in graph if m.startswith("harness")}
    assert not (edges := [f"{m} -> {t}" for m in harness for t in graph[m] if t in ("conftest", "test")]), \
        "the harness reaches up into pytest's files: " + ", ".join(edges)


def test_upward_edge_is_found():
    graph = {"harness.fit": {"harness.tools.grading.checks"}, "train": {"harness.fit"}}
    assert upward_edges(graph, {"harness.fit", "train"}) == ["harness.fit -> harness.tools.grading.checks"]


def test_runtime_is_what_train_py_stands_on():
    """Every runtime module is reached from train.py; anything else belongs to the tools."""
    graph, runtime, _ = floors()
    reached, todo = set(), ["train"]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in reached:
                reached.add(m)
                todo.append(m)
    assert not (extra := sorted(runtime - reached - {RUNTIME})), f"train.py does not use {extra}: move them to harness/tools/"


PACKAGES = ("grading", "traces", "lab", "submissions")  # harness/tools/'s packages


def test_tools_are_four_packages():
    """harness/tools/ holds its packages and its __init__.py, and no module loose beside them."""
    here = ROOT / "harness" / "tools"
    entries = {p.name for p in here.iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__.py", *PACKAGES}, f"harness/tools/ holds {sorted(entries)}: put each tool in one of {PACKAGES}"
    for package in PACKAGES:
        assert (here / package / "__init__.py").is_file(), f"harness/tools/{package}/ has no __init__.py"
        assert not [p for p in (here / package).iterdir() if p.is_dir() and p.name != "__pycache__"], \
            f"harness/tools/{package}/ holds a folder: the packages are one level deep"


def test_readme_table_is_the_layout():
    """docs/measuring.md's table of the harness names every module of the runtime and of each tools
    package, and nothing else."""
    import re

    _, runtime, tools = floors()
    page = (ROOT / "docs" / "measuring.md").read_text()
    rows = [("harness/", runtime)] + [(f"harness/tools/{p}/", {m for m in tools if m.startswith(f"{TOOLS}.{p}.")}) for p in PACKAGES]
    assert any(line.startswith("| `harness/tools/` |") for line in page.splitlines()), "docs/measuring.md has no row for harness/tools/"
    for folder, modules in rows:
        assert modules, f"no module found in {folder}"
        row = next((line for line in page.splitlines() if line.startswith(f"| `{folder}` |")), None)
        assert row, f"docs/measuring.md has no row for {folder}"
        named = set(re.findall(r"`([a-z_][a-z0-9_]*)`", row.split("|")[2]))
        actual = {m.rsplit(".", 1)[1] for m in modules}
        assert named == actual, f"docs/measuring.md's {folder} row: missing {sorted(actual - named)}, extra {sorted(named - actual)}"


# --------------------------------------------------------------------------- commands

COMMAND_SOURCES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
                   ".github/workflows/classroom.yml"]
"""the pages and workflow a student has (the Gradescope bundle's scripts are the instructors' tests' to check)"""


def commands_named(sources: list[str] = COMMAND_SOURCES) -> dict[str, list[str]]:
    """`python -m harness...` module -> the files of SOURCES that run it (those present here: the student
    repository has fewer pages)."""
    from harness.tests.test_docs import modules_named

    out: dict[str, list[str]] = {}
    for name in sources:
        if (ROOT / name).is_file():
            for module in modules_named((ROOT / name).read_text()):
                if module.split(".")[0] == "harness":
                    out.setdefault(module, []).append(name)
    return out


def test_every_command_named_is_a_module():
    import importlib.util

    named = commands_named()
    assert "harness.tools.submissions.handin" in named and "harness.tools.submissions.points" in named, named
    missing = {m: where for m, where in named.items() if importlib.util.find_spec(m) is None}
    assert not missing, f"commands that name no module: {missing}"


def test_moved_commands_lead_to_their_modules():
    """harness.tools.MOVED: each old command (a module no more) -> its module now, which exists; no page
    runs an old one; and docs/grading.md's table of moved commands is that table."""
    import importlib.util
    import re

    from harness.tools import MOVED

    assert MOVED, "harness.tools.MOVED is empty"
    for old, new in MOVED.items():
        with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {new}"):  # no module, and says where it went
            importlib.util.find_spec(old)
        assert new.startswith(f"{TOOLS}.") and new.split(".")[2] in PACKAGES, new
        assert importlib.util.find_spec(new) is not None, f"{old} moved to {new}, which is no module"
    assert not (old := sorted(set(commands_named()) & set(MOVED))), f"pages still run the old commands {old}"
    page = (ROOT / "docs" / "grading.md").read_text()
    table = dict(re.findall(r"^\| `(harness\.tools\.\w+)` \| `(harness\.tools\.\w+\.\w+)` \|$", page, re.M))
    assert table == MOVED, "docs/grading.md's table of moved commands is not harness.tools.MOVED"


def test_an_old_command_says_where_it_went():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "harness.tools.grade", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "harness.tools.grade moved to harness.tools.submissions.grade: run " \
        "`python -m harness.tools.submissions.grade`" in proc.stderr, proc.stderr


def test_one_name_for_the_fsdp_under_test():
    """The FSDP under test is `effdl`, the handout's name (`--fsdp effdl`, traces/effdl), in every message,
    label and page; `--impl` names the file it imports (`student`: fsdp.py); "hand-written" names only the
    rule that it must be (harness/tools/grading/handwritten.py)."""
    import re

    rule = re.compile(r"(is|be|must be) hand-written|hand-written rule|beyond a hand-written FSDP"
                      r"|effdl \(the hand-written FSDP")
    files = [*ROOT.glob("*.py"), *ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *(ROOT / "harness").rglob("*.py"),
             *(ROOT / "solution").rglob("*.py")]
    stray = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
             if f.name not in ("handwritten.py", "test_handwritten.py", "test_layout.py")
             for i, line in enumerate(f.read_text().splitlines(), 1) if "hand-written" in rule.sub("", line)]
    assert not stray, "call the FSDP under test effdl:\n" + "\n".join(stray)

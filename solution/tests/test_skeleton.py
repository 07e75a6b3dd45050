"""The student skeleton: generated from the reference, up to date, and usable task by task."""

import io
import subprocess
import sys
import tokenize

import pytest

from harness.tools.grading import checks
from solution import make_skeleton
from solution.make_skeleton import SkeletonError, render

ROOT = make_skeleton.ROOT


def test_committed_skeleton_is_up_to_date():
    done = subprocess.run([sys.executable, "-m", "solution.make_skeleton", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_skeleton_has_every_todo_and_no_reference_code():
    text = (ROOT / "fsdp.py").read_text()
    for tag in make_skeleton.TAGS:
        assert f"# TODO({tag})" in text, f"fsdp.py has no TODO({tag})"
    # Its code, that is: the TODOs' notes quote the README's hints, which name these calls.
    code = "".join(t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type != tokenize.COMMENT)
    assert "all_gather_into_tensor(" in text, "the notes no longer quote H5: the check below would not show it reads code only"
    for solution_only in ("all_gather_into_tensor(", "reduce_scatter_tensor(", "resize_(0)"):
        assert solution_only not in code, f"fsdp.py gives away {solution_only!r}"
    compile(text, "fsdp.py", "exec")


SOURCE = '''\
def f(x):
    # region task1: double it
    # (more hint)
    y = 2 * x
    # endregion
    return y


def g(flag):
    if flag:
        # region task2: optional, nothing instead
        print("overlap")
        # endregion
    # region bonus1: optional, with a fallback
    z = 1
    # else: z = 0
    # endregion
    return z
'''


def test_render_regions():
    out = render(SOURCE)
    assert ('    # TODO(task1): double it\n    # (more hint)\n    # ' + make_skeleton.REPLACE_RAISE + '\n'
            '    raise TodoError("TODO(task1): double it")\n    return y\n') in out  # the given line after it: said
    assert "        # TODO(task2): optional, nothing instead\n        pass\n" in out  # keeps `if` valid
    assert ("    # TODO(bonus1): optional, with a fallback\n    # stand-in until this TODO is done (replace only the next "
            "line; the lines after it are given):\n    z = 0\n    return z\n") in out
    last = render("def h():\n    # region task1: last\n    pass\n    # endregion\n")
    assert last == 'def h():\n    # TODO(task1): last\n    raise TodoError("TODO(task1): last")\n'  # nothing after: no note
    ns = {"TodoError": type("TodoError", (NotImplementedError,), {})}
    exec(compile(out, "skeleton", "exec"), ns)
    assert ns["g"](True) == 0
    with pytest.raises(ns["TodoError"], match=r"TODO\(task1\): double it"):
        ns["f"](1)
    kept = render(SOURCE, strip={"task1"})  # a variant: only task 1 stripped
    assert 'print("overlap")' in kept and "z = 1" in kept and "region" not in kept


@pytest.mark.parametrize("bad, message", [
    ("# region task1: x\ny = 1\n", "no '# endregion'"),
    ("# region task1: x\n# region task2: y\n# endregion\n", "no nesting"),
    ("# region task9: x\n# endregion\n", "unknown region tag"),
    ("y = 1\n# endregion\n", "outside a region"),
])
def test_render_rejects_bad_markers(bad, message):
    with pytest.raises(SkeletonError, match=message):
        render(bad)


def test_task1_only_trains_like_fsdp2(pool2, tmp_path):
    """A file with task 1 done and nothing else is already correct, just without overlap."""
    task1_only = tmp_path / "task1_only.py"
    task1_only.write_text(render(make_skeleton.SOLUTION.read_text(), strip=set(make_skeleton.TAGS) - {"task1"}))
    for param_dtype, reduce_dtype in [("float32", "float32"), ("bfloat16", "float32")]:
        checks.check_step(pool2, str(task1_only), param_dtype, reduce_dtype)


def test_tasks_1_to_3_without_bonuses_pass_the_task_tests(pool2, tmp_path):
    """What a student hands in after tasks 1-3: the stand-ins of the bonus regions must not cost
    them the overlap or memory tests (e.g. by resharding the root after forward)."""
    tasks_only = tmp_path / "tasks_only.py"
    tasks_only.write_text(render(make_skeleton.SOLUTION.read_text(), strip={"bonus1", "bonus2", "bonus3"}))
    profiles = checks.profile_both(pool2, str(tasks_only), tmp_path / "profiles")
    checks.assert_overlap(profiles, "forward")
    checks.assert_overlap(profiles, "backward")
    checks.check_memory(pool2, str(tasks_only), "float32", "float32")
    checks.check_step(pool2, str(tasks_only), "float32", "float32")


def test_instructors_table_of_lines_per_task_is_current():
    page = (ROOT / "docs" / "instructors.md").read_text()
    table = page.split("<!-- stats -->\n", 1)[1].split("\n<!-- /stats -->", 1)[0]
    assert table == make_skeleton.stats_table(make_skeleton.SOLUTION.read_text()), (
        "docs/instructors.md's table of lines per task is stale: paste `uv run python -m solution.make_skeleton --stats`")


def test_hints_say_what_in_two_lines_and_todos_stop_with_one():
    """Each region: a short name (the TodoError message), at most two lines of hint, then notes of
    the README hints it needs (at most four lines); the hints they cite and note exist in the README,
    under the number and name each note gives."""
    solution = make_skeleton.SOLUTION.read_text()
    lines = solution.splitlines()
    readme = (ROOT / "README.md").read_text()
    for i, line in enumerate(lines):
        if m := make_skeleton.OPEN.match(line):
            hint = []
            for nxt in lines[i + 1:]:
                if not nxt.strip().startswith("# ") or make_skeleton.ELSE.match(nxt) or make_skeleton.CLOSE.match(nxt):
                    break
                hint.append(nxt.strip()[2:])
            hint, notes = make_skeleton.split_hint(hint)
            assert len(m["hint"]) <= 70, f"line {i + 1}: the piece's name is the error message: keep it short"
            assert len(hint) <= 2, f"line {i + 1}: {m['tag']}'s hint has {len(hint)} lines; at most 2 (facts go to notes)"
            assert len(notes) <= 4, f"line {i + 1}: {m['tag']}'s notes have {len(notes)} lines; at most 4"
            for cited in __import__("re").findall(r"\bH\d+\b", " ".join(hint)):
                assert f"**{cited} " in readme, f"line {i + 1} cites {cited}, which README's Hints lack"
            for note in notes:
                if n := make_skeleton.NOTE.match(note):
                    assert f"**H{n['number']} {n['name']}.**" in readme, (
                        f"line {i + 1}: note H{n['number']} ({n['name']}) is not a hint of README's Hints by that number and name")
                else:
                    assert note.startswith(make_skeleton.NOTE_MORE), f"line {i + 1}: {note!r} neither starts a note nor continues one"
    noted = set(__import__("re").findall(r"^\s*# H(\d+) \(", solution, __import__("re").M))
    assert noted == {str(n) for n in range(1, 14)}, f"hints no TODO notes: {sorted(set(map(str, range(1, 14))) - noted)}"
    for message in __import__("re").findall(r'TodoError\("(TODO\([^"]*)"\)', (ROOT / "fsdp.py").read_text()):
        assert len(message) <= 80 and "\n" not in message, message


# variant_fsdp.py is a hand-filled copy of an earlier skeleton (tasks 1-3 written anew, before HSDP,
# reshard_after_forward=<int> and FSDP2's later contract): these of its given definitions predate the
# skeleton's. Every other definition the skeleton gives (no TODO in it) must be the skeleton's exactly.
VARIANT_PREDATES = {
    "MixedPrecisionPolicy", "ShardedState", "FSDPParam.reset_sharded", "FSDPParam.to_dtensor",
    "FSDPParam.to_unsharded", "PendingGather", "PendingGather.wait", "PendingReduce.finish", "FSDPState.__init__",
    "FSDPState.lazy_init", "FSDPModule._apply", "FSDPModule.set_requires_gradient_sync",
    "FSDPModule.set_reshard_after_forward", "fully_shard", "_managed_parameters", "_check_arguments",
    "RootContext.__init__"}  # the skeleton's TODOs of tasks 2 and 3 left it for methods of their own


def given_definitions(text: str) -> dict[str, tuple[str, bool]]:
    """Each top-level function and class, a class with methods as each method plus the rest of its body:
    name -> (AST dump, whether a TODO is in its source)."""
    import ast

    out = {}
    for node in ast.parse(text).body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        methods = [m for m in node.body if isinstance(m, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else []
        for unit, name in [(m, f"{node.name}.{m.name}") for m in methods] + [(node, node.name)]:
            if unit is node and methods:
                unit = ast.Module(body=[n for n in node.body if not isinstance(n, ast.FunctionDef)], type_ignores=[])
            out[name] = (ast.dump(unit), "TODO(" in (ast.get_source_segment(text, unit) or "") if unit is not node or
                         not methods else False)
    return out


def variant_drift(skeleton: str, variant: str) -> set[str]:
    """The definitions given in the skeleton that the variant also has, written otherwise."""
    given, theirs = given_definitions(skeleton), given_definitions(variant)
    return {name for name, (dump, todo) in given.items() if not todo and name in theirs and theirs[name][0] != dump}


def test_variant_keeps_the_skeletons_given_code():
    variant = (ROOT / "solution" / "tests" / "variant_fsdp.py").read_text()
    drift = variant_drift((ROOT / "fsdp.py").read_text(), variant)
    assert drift == VARIANT_PREDATES, (
        f"variant_fsdp.py's copy of the skeleton's given code differs in {sorted(drift - VARIANT_PREDATES)}; "
        f"no longer in {sorted(VARIANT_PREDATES - drift)} (update VARIANT_PREDATES)")


def test_variant_drift_is_found(tmp_path):
    """Altering one given line of the variant (a copy) is found, and so is the skeleton's changing alone."""
    skeleton = (ROOT / "fsdp.py").read_text()
    variant = (ROOT / "solution" / "tests" / "variant_fsdp.py").read_text()
    altered = tmp_path / "variant_fsdp.py"
    altered.write_text(variant.replace("    return found\n", "    return found[::-1]\n", 1))
    assert altered.read_text() != variant
    assert variant_drift(skeleton, altered.read_text()) - VARIANT_PREDATES == {"_tensors"}
    changed = skeleton.replace("class UnshardHandle:\n    def __init__(self, group", "class UnshardHandle:\n    def __init__(self, grp", 1)
    assert variant_drift(changed, variant) - VARIANT_PREDATES == {"UnshardHandle.__init__"}

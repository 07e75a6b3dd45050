"""The student skeleton: generated from the reference, up to date, and usable task by task."""

import io
import subprocess
import sys
import tokenize

import pytest

from harness.tools import checks
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

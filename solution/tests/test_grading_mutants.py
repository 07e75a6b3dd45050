"""Every grading check fails on a submission that deserves it.

Each mutant is the reference with exact snippets replaced (each must occur once), or a cheat
written out (both in solution/tests/mutation.py). The points mutants run test.py in a
subprocess, as graders do, and read its table.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.tools.grading import checks, handwritten, jobs, policy
from harness.tools.grading.ranks import RankError
from harness.tools.submissions.points import LINES
from solution.tests.mutation import CHEATS, SOURCE_CHEATS, SOURCE_REFUSALS, write_mutant

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solution" / "fsdp.py"

@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grading_mutants")

    def make(name: str) -> str:
        return write_mutant(folder, name)

    return make


@pytest.mark.parametrize("name", list(CHEATS))
def test_source_check_refuses(mutant, name):
    assert handwritten.static_problem(Path(mutant(name))) is not None, name


@pytest.mark.parametrize("name", list(SOURCE_CHEATS))
def test_source_check_names_the_refusal(mutant, name):
    """Each door of the allowlist's is refused for what it is, at its line, as reaching beyond an FSDP."""
    problem = handwritten.static_problem(Path(mutant(name)))
    assert problem is not None and SOURCE_REFUSALS[name] in problem and f"{name}.py:" in problem, problem
    assert handwritten.verdict(problem).startswith(handwritten.OUTSIDE), problem


def test_source_check_accepts_reference_and_skeleton():
    assert handwritten.static_problem(SOLUTION) is None
    assert handwritten.static_problem(ROOT / "fsdp.py") is None
    assert handwritten.static_problem(ROOT / "solution" / "tests" / "variant_fsdp.py") is None


def test_given_lookup_is_the_references():
    """The one run-time-name lookup the source check lets through is the reference's (and so the
    skeleton's) register_fsdp_forward_method, exactly: the two cannot drift apart."""
    import ast

    for path in (SOLUTION, ROOT / "fsdp.py"):
        tree = ast.parse(path.read_text())
        given = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == handwritten.GIVEN_LOOKUP_NAME)
        assert handwritten._shape(given) == handwritten._shape(ast.parse(handwritten.GIVEN_LOOKUP).body[0]), path


def test_runtime_check_sees_fsdp2(pool2, mutant):
    """Without the source check, the run itself gives FSDP2 away (exported objects, classes, ops)."""
    runs = checks.run(pool2, jobs.forward_job, policy.config(mutant("reexport")))
    assert all(r.uses_fsdp2 for r in runs), [r.uses_fsdp2 for r in runs]
    clean = checks.run(pool2, jobs.forward_job, policy.config(str(SOLUTION)))
    assert not any(r.uses_fsdp2 for r in clean)


@pytest.mark.parametrize("name, said", [
    ("module-method-mixed-in-at-run-time", "_Listed (the file's) defines `named_parameters`, a name of nn.Module's"),
    ("property-mixed-in-at-run-time", "_Shows (the file's) defines `layers` as a property, not a plain method")])
def test_a_module_method_mixed_in_at_run_time_is_named(pool2, mutant, name, said):
    """A class of the file's mixed into each wrapped module's class at run time (past the source check), with a method
    of nn.Module's (an honest one) or a property, is refused where the file sets the class ([Note: a class the file
    mixes into a module] in impl.py): the graded check fails saying so."""
    with pytest.raises((AssertionError, RankError), match=re.escape(said)):
        checks.check_forward(pool2, mutant(name), "float32", "float32")


def test_full_parameters_not_from_the_all_gather_lose_forward(pool2, mutant):
    """Full parameters whose bytes did not all come from this forward's all-gathers (a copy kept from elsewhere; here a
    selection by a random draw, the values and the loss FSDP2's all the same) are named by the first forward's data
    following ([Note: where the model's parameters came from])."""
    with pytest.raises(AssertionError, match="holds data no all-gather of this forward brought"):
        checks.check_forward(pool2, mutant("full-parameters-not-only-gathered"), "float32", "float32")


def test_no_reshard_after_forward_loses_forward(pool2, mutant):
    with pytest.raises(AssertionError, match="still alive after its forward"):
        checks.check_forward(pool2, mutant("no-reshard-after-forward"), "float32", "float32")


@pytest.mark.parametrize("name, message", [("no-reshard-after-backward", "gathered parameters still alive after step|not a DTensor"),
                                           ("keep-full-grads", "full gradients still alive")])
def test_step_checks_fail(pool2, mutant, name, message):
    path = mutant(name)
    checks.check_forward(pool2, path, "float32", "float32")  # the forward is fine
    with pytest.raises(AssertionError, match=message):
        checks.check_step(pool2, path, "float32", "float32")


def test_shard_difference_is_measured(pool2, mutant):
    """One step, so only the shards after it tell: the first differing one, and by how much."""
    with pytest.raises(AssertionError, match=r"shard of \S+ differs from FSDP2's after step 1: \d+ of \d+ elements "
                                             r"differ, max abs [0-9.e+-]+, max \d+ ulps of float32") as e:
        checks.check_step(pool2, mutant("negate-sharded-grad"), "float32", "float32", num_steps=1)
    print(e.value)


def test_cast_after_gather_fails_communication(pool2, mutant):
    with pytest.raises(AssertionError, match=r"effdl sent .*float32.*FSDP2 sent .*bfloat16"):
        checks.check_forward(pool2, mutant("cast-after-gather"), "bfloat16", "float32")


@pytest.mark.parametrize("name, message", [
    # Rank 0's shard averaged with rank 1's (a different shard): the numbers, and the all-reduce's group.
    ("hsdp-all-reduce-world", r"bonus 4 \(HSDP on a 2 x 2 mesh\): .*(differs|process group)"),
    ("hsdp-skip-all-reduce", r"bonus 4 \(HSDP on a 2 x 2 mesh\): .*(differs|collectives differ)"),
])
def test_hsdp_check_fails(pool4, mutant, tmp_path, name, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_hsdp(pool4, mutant(name), "float32", "float32", tmp_path)


def test_hsdp_check_fails_on_the_skeleton(pool4, tmp_path):
    """The skeleton (and any file that only supports 1-D meshes) fails bonus 4 with its TODO, saying why."""
    with pytest.raises((AssertionError, RankError), match=r"(?s)bonus 4 \(HSDP on a 2 x 2 mesh\): .*TODO\(bonus4\).*does not support a 2-D mesh"):
        checks.check_hsdp(pool4, str(ROOT / "fsdp.py"), "float32", "float32", tmp_path)


def points(path: str, tmp_path: Path, *args: str, output: list | None = None) -> dict:
    out = tmp_path / "points.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "test.py"),
                          "--impl", path, "--points-json", str(out), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    if output is not None:
        output.append(run.stdout + run.stderr)
    return {r["task"]: r["earned"] for r in json.loads(out.read_text())["rows"]}


def test_reexport_scores_zero(mutant, tmp_path):
    earned = points(mutant("reexport"), tmp_path)
    assert set(earned.values()) == {0}, earned


def test_forward_only_scores_three(mutant, tmp_path):
    """Every case of task 1's forward (its 3 points need them all), one case of each other line (one failing
    case makes a line 0: the same verdict as every case)."""
    from solution.tests.test_gradescope import ONE_CASE_A_LINE

    earned = points(mutant("forward-only"), tmp_path, "-k", f"test_task1_forward or {ONE_CASE_A_LINE}")
    assert earned["task 1 forward"] == 3 and sum(v or 0 for v in earned.values()) == 3, earned
    assert all(v == 0 for k, v in earned.items() if k != "task 1 forward"), earned  # each line graded, and 0


@pytest.mark.parametrize("name", ["annotation-type-hints"])  # one end to end; test_source_check_names_the_refusal has each
def test_source_cheat_scores_zero(mutant, tmp_path, name):
    """A door of the allowlist's, in a file that would otherwise hand FSDP2's work in, earns nothing on any
    line and says why; the source check refuses it before any rank is spawned."""
    path = Path(mutant(name))
    path.write_text(path.read_text() + CHEATS["reexport"])
    output: list[str] = []
    earned = points(str(path), tmp_path, output=output)
    assert set(earned.values()) == {0} and len(earned) == len(LINES), earned
    assert handwritten.OUTSIDE in output[0] and SOURCE_REFUSALS[name] in output[0], output[0][-3000:]

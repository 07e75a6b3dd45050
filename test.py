"""What graders run: effdl (the FSDP under test, fsdp.py) against PyTorch's FSDP2, on spawned CPU/gloo ranks.

    uv run pytest test.py                            # everything, ending with the points table
    uv run pytest test.py::test_fsdp                 # the handout's test: task 1's full step
    uv run pytest test.py -m task1                   # one task: task1 task2 task3 bonus1 bonus2 bonus3 bonus4
    uv run pytest test.py -k "world3 and bfloat16"   # one world size or precision case
    uv run pytest test.py --impl path/to/fsdp.py     # any other file (default: fsdp.py)

Each test earns part of one line of the handout's points table (harness/tools/submissions/points.py); a line's
points need all its tests to pass. The header names the file under test.
"""

import pytest

from harness.tools.grading import checks, handwritten, policy

CASES = [pytest.param(w, p, r, id=f"world{w}-{p}-{r}") for w in (2, 3) for p, r in policy.PRECISIONS] + \
    [pytest.param(2, p, r, id=f"world2-{p}-{r}") for p, r in policy.UNSET_PRECISIONS]
PRECISIONS = [pytest.param(p, r, id=f"{p}-{r}") for p, r in policy.PRECISIONS]


@pytest.fixture(scope="session", autouse=True)
def hand_written_source(impl):
    """The file's source is hand-written (handwritten.static_problem), checked once before
    anything else: a session fixture comes before the rank pools, so a refused file spawns no rank."""
    from harness.impl import impl_path

    if problem := handwritten.static_problem(impl_path(impl)):
        raise AssertionError(f"{impl}: {handwritten.verdict(problem)}")


@pytest.fixture(autouse=True)
def hand_written(impl, pool2):
    """Every graded test first checks that the file is not PyTorch's FSDP2 (once per session)."""
    checks.check_not_fsdp2(pool2, impl)


def pool(request, world: int):
    return request.getfixturevalue(f"pool{world}")


@pytest.mark.task1
@pytest.mark.parametrize("world, param_dtype, reduce_dtype", CASES)
def test_task1_forward(impl, world, param_dtype, reduce_dtype, request, evidence):
    """Task 1 forward: the first forward's loss bit-identical to FSDP2's, parameters
    Shard(0) DTensors before and after, each block's gathered parameters freed after its forward,
    FSDP2's all-gathers (dtype and bytes). Needs no backward."""
    evidence(checks.check_forward(pool(request, world), impl, param_dtype, reduce_dtype))


# The handout's test: `pytest test.py::test_fsdp`. The Llama in every precision case, and a tiny
# model whose rows do not divide by the world size (padding, empty shards).
FSDP_CASES = CASES + [pytest.param(w, "odd-shapes", None, id=f"world{w}-odd-shapes") for w in (2, 3)]


@pytest.mark.task1
@pytest.mark.parametrize("world, param_dtype, reduce_dtype", FSDP_CASES)
def test_fsdp(impl, world, param_dtype, reduce_dtype, request, evidence):
    """Task 1 step, the handout's test: every loss, grad norm and parameter shard bit-identical to
    FSDP2's over 4 steps of 2 micro-steps, gathered parameters and full gradients freed by the end
    of each step, FSDP2's all-gathers and reduce-scatters (dtype and bytes) in forward and backward;
    the odd-shapes cases: rows that do not divide by the world size, and empty shards."""
    if param_dtype == "odd-shapes":
        evidence(checks.check_odd_shapes(pool(request, world), impl))
    else:
        evidence(checks.check_step(pool(request, world), impl, param_dtype, reduce_dtype))


@pytest.fixture(scope="module")
def profiles(pool2, impl, artifacts, tmp_path_factory):
    """One profiled run each of FSDP2 and effdl (the FSDP under test, fsdp.py), shared by tasks 2 and 3 (kept in
    DIR/profiles with --artifacts DIR). A module fixture is set up before the autouse check above, so
    it makes that check itself: no file is run before its source was read."""
    checks.check_not_fsdp2(pool2, impl)
    return checks.profile_both(pool2, impl, artifacts / "profiles" if artifacts else tmp_path_factory.mktemp("profiles"),
                               memory=True)  # task 3 judges this run's memory too


@pytest.mark.task2
def test_task2(profiles, evidence):
    """Task 2: forward all-gathers run while compute runs, as many as FSDP2's."""
    evidence(checks.assert_overlap(profiles, "forward"))


@pytest.mark.task3
def test_task3(profiles, evidence):
    """Task 3: backward all-gathers prefetched and reduce-scatters left in flight, in a run whose peak memory
    per step stays within one reduce-scatter buffer of FSDP2's (that very run: prefetch one group ahead)."""
    evidence(checks.assert_overlap(profiles, "backward") + "; " + checks.assert_profiled_memory(profiles))


@pytest.mark.task3
@pytest.mark.parametrize("param_dtype, reduce_dtype", PRECISIONS)
def test_task3_memory(impl, pool2, param_dtype, reduce_dtype, evidence):
    """Task 3: peak memory per step within one reduce-scatter buffer of FSDP2's, no growth."""
    evidence(checks.check_memory(pool2, impl, param_dtype, reduce_dtype))


def _bonus(bonus: str):
    @pytest.mark.parametrize("param_dtype, reduce_dtype", PRECISIONS)
    def test(impl, pool2, param_dtype, reduce_dtype, tmp_path, evidence):
        # memory in the first case only: what a mode keeps alive is the same in every dtype
        evidence(checks.check_mode(pool2, impl, [bonus], param_dtype, reduce_dtype, tmp_path,
                                   memory=(param_dtype, reduce_dtype) == policy.PRECISIONS[0]))
    test.__doc__ = (f"{policy.MODES[bonus].name}, each precision case: {policy.MODES[bonus].promise}, "
                    "FSDP2's collectives per phase, overlap kept, bit-identical numbers; memory in the first.")
    return getattr(pytest.mark, bonus)(test)


test_bonus1, test_bonus2, test_bonus3 = (_bonus(b) for b in ("bonus1", "bonus2", "bonus3"))


@pytest.mark.bonus4
@pytest.mark.parametrize("param_dtype, reduce_dtype", PRECISIONS)
def test_bonus4(impl, pool4, param_dtype, reduce_dtype, tmp_path, evidence):
    """HSDP on a 2 x 2 mesh (4 ranks: 2 replicas of 2 shards), each precision case: every loss, grad norm
    and shard bit-identical to FSDP2's HSDP, its collectives per phase and process group (count, dtype,
    bytes); in the first case also overlap kept and memory."""
    evidence(checks.check_hsdp(pool4, impl, param_dtype, reduce_dtype, tmp_path))


@pytest.mark.bonus2
@pytest.mark.bonus3
@pytest.mark.parametrize("bonuses", [["bonus1", "bonus2", "bonus3"]], ids=["1+2+3"])
def test_bonuses_combined(impl, pool2, bonuses, tmp_path):
    """Bonuses together (no line of the points table): every promise and FSDP2's collectives (float32),
    losses, grad norms and shards bit-identical to FSDP2 in the mixed-precision cases."""
    checks.check_mode(pool2, impl, bonuses, "float32", "float32", tmp_path)
    for param_dtype, reduce_dtype in policy.PRECISIONS[1:]:
        checks.check_step(pool2, impl, param_dtype, reduce_dtype, **policy.mode_flags(bonuses))

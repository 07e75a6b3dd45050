"""The reference is a drop-in for FSDP2's fully_shard (solution/tests/dropin.py): each behaviour run
under FSDP2 and under the reference in the same process group, and the records equal bit for bit.

World sizes 1, 2 and 3 (1: no collectives at all; 3: where summation order shows); float32 and
bfloat16 where precision matters. The pools are shared by the whole module.
"""

import pytest
import torch

from harness.tools.grading import checks
from harness.tools.grading.compare import tensor_difference
from harness.tools.grading.ranks import RankPool
from solution import make_skeleton
from solution.tests import dropin

REFERENCE = str(make_skeleton.SOLUTION)
WORLDS = [1, 2, 3]


# The instructors' own pools ("own": the reference is this project's file, and the records it returns are
# compared here, not graded), one per world size, shared by the whole module.
@pytest.fixture(scope="module")
def pools():
    made: dict[int, RankPool] = {}
    yield lambda world: made[world] if world in made else made.setdefault(world, RankPool(world, device="cpu", role="own"))
    for p in made.values():
        p.close()


def same(a, b, where="") -> None:
    """AssertionError at the first place where `b` (the reference's record) differs from `a` (FSDP2's)."""
    __tracebackhide__ = True
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: FSDP2 gives a tensor, the reference {b!r}"
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), \
            f"{where}: differs from FSDP2's: {tensor_difference(a, b)}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(b) if isinstance(b, dict) else b} " \
                                                            f"where FSDP2 has {list(a)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {b!r} where FSDP2 has {a!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {b!r} where FSDP2 has {a!r}"


def check(pool, case, *args):
    __tracebackhide__ = True
    ref = checks.run(pool, case, None, *args)
    got = checks.run(pool, case, REFERENCE, *args)
    for rank, (a, b) in enumerate(zip(ref, got)):
        same(a, b, f"{case.__name__}{args}, world {pool.world_size}, rank {rank}")
    return ref, got


@pytest.fixture(params=WORLDS, ids=lambda w: f"world{w}")
def pool(request, pools):
    return pools(request.param)


# ---- bugs: behaviours the reference got wrong

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_freeze_after_wrapping(pool, dtype):
    """No reduce-scatter slot and no optimizer update for parameters frozen after fully_shard;
    unfrozen again, they train again (requires_grad read at each all-gather)."""
    check(pool, dropin.case_freeze_after_wrapping, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_post_accumulate_grad_hook(pool, dtype):
    """Hooks on the sharded parameters fire once the reduced gradient is in (optimizer in backward)."""
    check(pool, dropin.case_post_accumulate_grad_hook, dtype)


def test_state_dict_always_sharded(pool):
    """state_dict() gives the sharded DTensors even while parameters are gathered, and loads back."""
    check(pool, dropin.case_state_dict_sharded)


@pytest.mark.parametrize("how", ["float64", "bf16 model, fp32 reduce", "bf16 built, fp32 reduce"])
def test_dtype_after_wrapping(pool, how):
    check(pool, dropin.case_dtype_after_wrapping, how)


@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta"])
def test_default_mesh(pool, meta):
    """No mesh=: the mesh is on FSDP2's default device; meta-device models materialise with to_empty."""
    check(pool, dropin.case_default_mesh, meta)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_collectives(pool, dtype):
    """The same collectives (kind, dtype, elements) in the same order; none at world size 1."""
    ref, _ = check(pool, dropin.case_train, dtype)
    if pool.world_size == 1:
        assert ref[0]["collectives"] == [], "FSDP2 issues collectives at world size 1?"


def test_error_contract(pool):
    """0-dim and non-contiguous parameters, a 3-D mesh, parameters left on meta, bad reshard_after_forward:
    FSDP2's exception types; key words of its messages."""
    ref = checks.run(pool, dropin.case_errors, None)[0]
    got = checks.run(pool, dropin.case_errors, REFERENCE)[0]
    same(ref[0], got[0], "exception types")
    for what, words in {"non-contiguous parameter": ["non-contiguous"], "3-D mesh": ["1D or 2D"],
                        "meta parameters at forward": ["meta device", "to_empty"],
                        "reshard_after_forward=0": ["factor"]}.items():
        for word in words:
            assert word in got[1][what], f"{what}: {got[1][what]!r} lacks {word!r} (FSDP2: {ref[1][what]!r})"


# ---- API

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_prefetch(pool, dtype):
    check(pool, dropin.case_explicit_prefetch, dtype)


def test_set_is_last_backward(pool):
    check(pool, dropin.case_is_last_backward)


def test_register_fsdp_forward_method(pool):
    check(pool, dropin.case_forward_method)


@pytest.mark.parametrize("which", ["positional", "output dtype, no input cast"])
def test_mixed_precision_policy(pool, which):
    check(pool, dropin.case_mixed_precision_policy, which)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fully_shard_list_of_modules(pool, dtype):
    check(pool, dropin.case_list_of_modules, dtype)


def test_reshard_after_forward_int(pool):
    """On a 1-D mesh an int must divide the world size: 1 means False (with a warning), the world size True."""
    for k in sorted({1, pool.world_size}):
        check(pool, dropin.case_train, "float32", k)


@pytest.fixture
def pool4(pools):
    return pools(4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reshard_after_forward_to_a_smaller_group(pool4, dtype):
    """reshard_after_forward=2 on 4 ranks: after forward each rank keeps half of every parameter, and
    backward's all-gathers run among 2 ranks (FSDP2's post-forward mesh): same numbers and collectives."""
    check(pool4, dropin.case_train, dtype, 2)


# ---- HSDP (bonus 4): a 2-D (replicate, shard) mesh on 4 ranks

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 2), (2, 1), (1, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_hsdp(pools, shape, dtype):
    """Parameters (Replicate(), Shard(0)) DTensors with the shard dim's rows; all-gathers and reduce-scatters
    within the shard group, the all-reduce across the replicate group (AVG, FSDP2's order and dtypes); every
    loss, gradient norm and shard bit for bit. 2x1: no all-gather or reduce-scatter at all; 1x2: an
    all-reduce over one rank, as FSDP2. (2x1 and 1x2 run on 2 ranks: what a 4-rank run adds is 2x2's.)"""
    pool = pools(shape[0] * shape[1])
    ref, _ = check(pool, dropin.case_hsdp, dtype, shape)
    kinds = {(name, group) for name, _, _, group in ref[0]["collectives"]}
    expect = {(2, 2): {("all_gather_into_tensor", (0, 1)), ("reduce_scatter_tensor", (0, 1)), ("all_reduce", (0, 2))},
              (2, 1): {("all_reduce", (0, 1))},
              (1, 2): {("all_gather_into_tensor", (0, 1)), ("reduce_scatter_tensor", (0, 1)), ("all_reduce", (0,))}}
    assert kinds == expect[shape], f"FSDP2's HSDP collectives on rank 0 changed: {kinds}"


@pytest.mark.parametrize("mode", dropin.HSDP_MODES[1:])
def test_hsdp_modes(pools, mode):
    """HSDP with reshard_after_forward=False, and with accumulation over 2 micro-steps without gradient sync,
    without reshard after backward, or without the replica all-reduce (set_requires_all_reduce(False))."""
    check(pools(4), dropin.case_hsdp, "float32", (2, 2), mode)


def test_refusals_name_the_argument_and_the_alternative(pools):
    """What the reference refuses by design (FSDP2 supports it): the exception names the argument and
    what to use instead; where FSDP2 validates (mixed dtypes, unnamed 2-D mesh) FSDP2's exception type."""
    pool2 = pools(2)
    ref = checks.run(pool2, dropin.case_refused, None)[0]
    got = checks.run(pool2, dropin.case_refused, REFERENCE)[0]
    for what, argument in {"ignored_params": "ignored_params", "shard_placement_fn": "shard_placement_fn",
                           "mixed dtypes": "dtype", "DTensor parameter": "DTensor",
                           "2-D mesh without names": "mesh"}.items():
        assert got[what] is not None, f"{what}: the reference accepts it"
        kind, message = got[what]
        assert argument in message and ("use" in message or "instead" in message), f"{what}: {message!r}"
        if what in ("mixed dtypes", "2-D mesh without names"):  # FSDP2 validates these: its type
            assert ref[what] is not None and kind == ref[what][0], f"{what}: {kind} where FSDP2 gives {ref[what]}"
        else:  # FSDP2 supports these (its DTensor case needs a TP mesh this test does not build)
            assert kind == "NotImplementedError", f"{what}: {kind}"

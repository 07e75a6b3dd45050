"""The reference against FSDP2 on models this project did not write (solution/tests/conformance.py):
losses, gradient norms and every parameter shard, bit for bit, after every step.

World size 3 is where layouts and summation orders show: with two ranks every sum of two values
is the same either way round, with three the order in which gloo adds them changes the last bits.
"""

import pytest

from harness.tools.grading.policy import PRECISIONS
from solution import make_skeleton
from solution.tests import conformance

REFERENCE = str(make_skeleton.SOLUTION)
# Without and with mixed precision; frozen parameters get all four cases.
UNIFORM = [("float32", "float32"), ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("param_dtype, reduce_dtype", UNIFORM)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["encoder", "sometimes", "twice", "tied"])
def test_matches_fsdp2(request, model, world, param_dtype, reduce_dtype):
    conformance.check(request.getfixturevalue(f"pool{world}"), model, REFERENCE, param_dtype, reduce_dtype)


@pytest.mark.parametrize("param_dtype, reduce_dtype", PRECISIONS)
@pytest.mark.parametrize("world", [3])
def test_frozen_matches_fsdp2(request, world, param_dtype, reduce_dtype):
    """Frozen parameters in a group and a group frozen whole: gathered, never reduced (world size 3, where
    summation orders show; freezing after wrapping is test_dropin's, at world sizes 1, 2 and 3)."""
    conformance.check(request.getfixturevalue(f"pool{world}"), "frozen", REFERENCE, param_dtype, reduce_dtype)

"""FSDPModule.unshard / reshard and UnshardHandle, which training never calls: the reference is a
drop-in for fully_shard, so by hand they give what FSDP2's give."""

import pytest
import torch

from harness.tools.grading import checks, compare
from solution import make_skeleton
from solution.tests import conformance

REFERENCE = str(make_skeleton.SOLUTION)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world, model, param_dtype", [(2, "frozen", "float32"), (3, "tied", "bfloat16")])
def test_unshard_and_reshard_match_fsdp2(request, world, model, param_dtype, async_op):
    pool = request.getfixturevalue(f"pool{world}")
    ref = checks.run(pool, conformance.unshard_job, model, None, param_dtype, async_op)
    got = checks.run(pool, conformance.unshard_job, model, REFERENCE, param_dtype, async_op)
    for rank, (ref_rank, got_rank) in enumerate(zip(ref, got)):
        for a, b in zip(ref_rank, got_rank):
            for kind in ("full", "shards"):
                assert a[kind].keys() == b[kind].keys(), (a["when"], kind)
                for name, x in a[kind].items():
                    y = b[kind][name]
                    if kind == "full":
                        assert x[1] == y[1], f"{a['when']}: {name}.requires_grad after unshard differs from FSDP2's"
                        x, y = x[0], y[0]
                    assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (
                        f"rank {rank}, {a['when']}: {name} after {'unshard' if kind == 'full' else 'reshard'} "
                        f"differs from FSDP2's: {compare.tensor_difference(x, y)}")

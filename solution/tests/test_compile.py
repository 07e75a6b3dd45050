"""torch.compile (train.py --compile) with the reference against FSDP2.

Each transformer block is compiled in place before fully_shard, so FSDP's hooks run inside the
compiled call. The reference keeps them out of the graphs (torch.compiler.disable) and then
matches FSDP2 bit for bit; with that taken out, the run stops with one line naming the fix.

Inductor compiles on the ranks' CPU: a block's graphs take a minute or two the first time on a
2-core machine; later runs reuse inductor's on-disk cache.
"""

import pytest
import torch

from harness import checks
from harness.ranks import RankError
from solution import make_skeleton
from solution.tests.mutation import write_mutant

REFERENCE = str(make_skeleton.SOLUTION)
HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "final_callback")
# The reference without its compile support: no hook is kept out of the compiled graphs.
NO_COMPILE_DISABLE = [(f"    @torch.compiler.disable\n    def {hook}(", f"    def {hook}(") for hook in HOOKS]


def compiled_job(cfg):
    """train_job, and how many graphs dynamo compiled meanwhile (0 would mean nothing was compiled)."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result = checks.train_job(cfg, check_shards=True)
    return result, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def test_reference_with_compile_matches_fsdp2(pool2):
    # One configuration, each compile being slow: bf16 compute, where inductor's fused kernels give
    # other bits than eager, so equal numbers mean both ran the same compiled code around their hooks.
    cfg = checks.config(REFERENCE, compile=True, num_steps=3, param_dtype="bfloat16", reduce_dtype="float32")
    what = "--compile, " + checks.describe(cfg, pool2.world_size)
    ref = checks.run(pool2, compiled_job, checks.as_fsdp2(cfg))
    got = checks.run(pool2, compiled_job, cfg)
    for name, runs in (("FSDP2", ref), ("the reference", got)):
        assert all(graphs for _, graphs in runs), f"{name}'s run compiled no graph: --compile did nothing"
    checks.assert_same_numbers(ref[0][0][0], got[0][0][0], what)
    checks.assert_same_parameters([d for (_, d), _ in ref], [d for (_, d), _ in got], what)


def test_file_without_compile_support_stops_with_one_line(pool2, tmp_path):
    mutant = write_mutant(tmp_path, "no-compile-disable", NO_COMPILE_DISABLE)
    cfg = checks.config(mutant, compile=True, num_steps=1, num_gradient_accumulation_steps=1)
    with pytest.raises(RankError) as failure:
        checks.run(pool2, checks.train_job, cfg)
    last = str(failure.value).strip().splitlines()[-1]
    assert last.startswith("harness.impl.FeatureError: "), str(failure.value)[-3000:]
    for fragment in ("--compile", "hand-written FSDP", "@torch.compiler.disable", *HOOKS):
        assert fragment in last, f"the error does not name {fragment!r}: {last}"

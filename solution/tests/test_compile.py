"""torch.compile (train.py --compile) with the reference against FSDP2.

Each transformer block is compiled in place before fully_shard, so FSDP's hooks run inside the
compiled call. The reference keeps them out of the graphs (torch.compiler.disable) and then
matches FSDP2 bit for bit; with that taken out, the run stops with one line naming the fix.

Inductor compiles on the ranks' CPU: a block's graphs take a minute or two the first time on a
2-core machine; later runs reuse inductor's on-disk cache.
"""

import dataclasses

import pytest
import torch

import train
from harness.tools.grading import checks, compare, jobs, policy
from harness.tools.grading.ranks import RankError
from solution import make_skeleton

REFERENCE = str(make_skeleton.SOLUTION)


def compiled_job(cfg: train.Config) -> tuple[jobs.Run, int]:
    """train_job (unobserved: no Python dispatch mode around the compiled code), and how many graphs
    dynamo compiled meanwhile (0 would mean nothing was compiled)."""
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result = jobs.train_job(cfg, False)
    return result, torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


# One configuration, each compile being slow: bf16 compute, where inductor's fused kernels give other
# bits than eager, so equal numbers mean both ran the same compiled code around their hooks.
CFG = policy.config(REFERENCE, compile=True, num_steps=3, param_dtype="bfloat16", reduce_dtype="float32")


def test_reference_with_compile_matches_fsdp2(pool2):
    cfg = CFG
    what = "--compile, " + policy.describe(cfg, pool2.world_size)
    ref = checks.run(pool2, compiled_job, policy.as_fsdp2(cfg))
    got = checks.run(pool2, compiled_job, cfg)
    for name, runs in (("FSDP2", ref), ("the reference", got)):
        assert all(graphs for _, graphs in runs), f"{name}'s run compiled no graph: --compile did nothing"
    compare.assert_same_numbers(ref[0][0].result, got[0][0].result, what)
    compare.assert_same_parameters([r.digests for r, _ in ref], [r.digests for r, _ in got], what)


def test_file_without_compile_support_stops_with_one_line(pool2, tmp_path):
    # imported here, not above: ranks import this module for its job, and mutation.py (snippets of the reference) is
    # closed to them
    from solution.tests.mutation import COMPILED_HOOKS, write_mutant

    mutant = write_mutant(tmp_path, "no-compile-disable")
    cfg = policy.config(mutant, compile=True, num_steps=1, num_gradient_accumulation_steps=1)
    with pytest.raises(RankError) as failure:
        checks.run(pool2, jobs.train_job, cfg, False)
    # the rank's traceback ends with the error line, then where it happened (a note)
    lines = str(failure.value).strip().splitlines()
    last = next((line for line in reversed(lines) if line.startswith("harness.impl.FeatureError: ")), None)
    assert last is not None, str(failure.value)[-3000:]
    for fragment in ("--compile", "effdl's code", "@torch.compiler.disable", *COMPILED_HOOKS):
        assert fragment in last, f"the error does not name {fragment!r}: {last}"


def test_no_fsdp_compiled_trains(pool2):
    """--fsdp none --compile (DDP over compiled blocks, float32: no FSDP, no mixed precision) compiles
    and trains the same model: its first loss is the eager run's, to rounding (compiled kernels may
    round differently, so not bit for bit)."""
    cfg = policy.config(None, fsdp="none", compile=True, num_steps=1)
    compiled = checks.run(pool2, compiled_job, cfg)
    eager = checks.run(pool2, compiled_job, dataclasses.replace(cfg, compile=False))
    assert all(graphs for _, graphs in compiled), "--fsdp none --compile compiled no graph"
    a, b = compiled[0][0].result.losses[0], eager[0][0].result.losses[0]
    assert abs(a - b) <= 1e-5 * abs(b), f"compiled first loss {a!r}, eager {b!r}"

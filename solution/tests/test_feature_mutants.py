"""The feature checks of harness/tests/test_features.py can fail: run them against the reference
with its activation-checkpointing, to_empty or tied-weight support taken out (mutants of
solution/tests/mutation.py). Each mutant's snippet must still be in solution/fsdp.py exactly once."""

import pytest

from harness.tools.grading import checks, jobs
from harness.tools.grading.ranks import RankError
from harness.tests import test_features as features
from solution.tests.mutation import write_mutant

@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("feature_mutants")

    def make(name: str) -> str:
        return write_mutant(folder, name)

    return make


def test_recompute_check_fails_without_recompute_handling(mutant, pool2):
    """A file that does not recognise a recomputed forward gets the explanation, not a storage crash."""
    cfg = features.short(mutant("no-recompute-handling"), param_dtype="float32", reduce_dtype="float32")
    with pytest.raises(RankError, match="(?s)recomputes the block's forward.*PRE_BACKWARD.*setStorage"):
        checks.run(pool2, features.recompute_outside_job, cfg)


def test_torchtitan_order_does_not_need_recompute_handling(mutant, pool2):
    """Why the recompute-around-the-module test exists: with torchtitan's order (checkpoint inside
    fully_shard) FSDP's hooks sit outside the recompute, so this mutant still matches FSDP2 there."""
    checks.check_step(pool2, mutant("no-recompute-handling"), "float32", "float32", num_steps=2,
                        activation_checkpoint="full")


def test_meta_init_fails_without_to_empty_support(mutant, pool2):
    cfg = features.short(mutant("no-to-empty"))
    with pytest.raises(RankError, match="(?s)to_empty\\(\\) after fully_shard.*--no-meta-init"):
        checks.run(pool2, jobs.train_job, cfg)
    # ... and it is only that: building the full model first, the mutant matches FSDP2.
    checks.check_step(pool2, cfg.impl, "float32", "float32", num_steps=2, meta_init=False)


def test_tied_weights_check_fails_without_aliases(mutant, pool2):
    with pytest.raises((RankError, AssertionError), match="tie was broken|differs at step"):
        ref = checks.run(pool2, features.tied_job, None)[0]
        got = checks.run(pool2, features.tied_job, mutant("no-tie-aliases"))[0]
        for step, (a, b) in enumerate(zip(ref, got), start=1):
            for name in a:
                assert (a[name] == b[name]).all(), f"{name} differs at step {step}"

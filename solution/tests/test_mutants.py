"""Every check in test.py can fail: run it against a deliberately broken reference.

Each mutant is the reference with one snippet replaced; the snippet must still be in
solution/fsdp.py (a mutant that silently stops mutating would prove nothing).
"""

from pathlib import Path

import pytest

from harness import checks
from harness.ranks import RankError
from solution import make_skeleton
from solution.tests import conformance
from solution.tests.mutation import write_mutant

SOLUTION = make_skeleton.SOLUTION

# name: (snippet in the reference, replacement), or a list of such pairs
MUTANTS = {
    # Pre-dividing and summing is what many write; at world size 3 it is not bit-equal to AVG.
    "predivide": (
        "            op = dist.ReduceOp.AVG if self.world > 1 else dist.ReduceOp.SUM\n",
        "            flat.div_(self.world)\n            op = dist.ReduceOp.SUM\n",
    ),
    # Overwriting instead of accumulating the sharded gradient loses all micro-steps but the last.
    "overwrite-grad": (
        "            self.sharded.grad.to_local().add_(local)\n",
        "            self.sharded.grad.to_local().copy_(local)\n",
    ),
    # Ignoring reduce_dtype: gradients reduced in the compute dtype (bf16) instead of float32.
    "ignore-reduce-dtype": (
        "        self.reduce_dtype = reduce_dtype or self.compute_dtype\n",
        "        self.reduce_dtype = self.compute_dtype\n",
    ),
    # torch.tensor_split's rows instead of torch.chunk's (86/85/85 instead of 86/86/84 at world 3).
    "tensor-split-rows": [
        ("        self.rows = [max(0, min(self.padded_rows, param.shape[0] - r * self.padded_rows)) for r in range(world)]\n",
         "        self.rows = [param.shape[0] // world + (r < param.shape[0] % world) for r in range(world)]\n"),
        ("        start = rank * self.padded_rows\n", "        start = sum(self.rows[:rank])\n"),
    ],
    # Never resharding after forward: every block's full parameters stay until backward.
    "no-reshard-after-forward": (
        "                if self.group.reshard_after_forward:\n                    self.group.reshard()\n",
        "                pass\n",
    ),
    # Bonus 3 accumulating in the compute dtype (bf16) instead of FSDP2's reduce-dtype copy.
    "accumulate-in-compute-dtype": (
        "            self.accumulated_grad = grad.to(self.accumulate_dtype)\n",
        "            self.accumulated_grad = grad.clone()\n",
    ),
    # Keeping every all-gather buffer: memory grows step after step.
    "leak-gather-buffers": (
        "            self.pending_gather = PendingGather(work, flat)\n",
        "            self.pending_gather = PendingGather(work, flat)\n"
        "            self.__dict__.setdefault('leaked', []).append(flat)\n",
    ),
    # Never resharding after backward: full parameters are left in the model between steps.
    "no-reshard-after-backward": (
        "            if group.reshard_after_backward:\n                group.reshard()\n",
        "            if False:\n                group.reshard()\n",
    ),
    # Forward prefetch waited for at once: issued early, but nothing computes while it runs.
    "wait-prefetch-at-once": (
        "                order[i + 1].prefetch()\n",
        "                order[i + 1].prefetch()\n                order[i + 1].wait_for_unshard()\n",
    ),
    # A zero-filled reduce-scatter slot for every parameter of the group, gradient or not: frozen and
    # unused parameters move the others, and gloo adds the ranks' values in another order there.
    "zero-fill-every-slot": [
        ("            numel = sum(p.padded_numel for p in params)\n"
         "            flat = torch.empty((self.world, numel), dtype=self.reduce_dtype, device=self.device)\n"
         "            start = 0\n"
         "            for p, grad in zip(params, grads):\n",
         "            numel = self.shard_numel\n"
         "            flat = torch.zeros((self.world, numel), dtype=self.reduce_dtype, device=self.device)\n"
         "            for p, grad in zip(params, grads):\n"
         "                start = self.offsets[self.params.index(p)]\n"),
        ("        start = 0\n        for p in pending.params:\n",
         "        for p in pending.params:\n            start = self.offsets[self.params.index(p)]\n"),
    ],
    # One pre-backward per step: a module called twice per forward runs its second backward on
    # parameters the first post-backward freed.
    "pre-backward-once-per-step": (
        "        if self.training_state is TrainingState.PRE_BACKWARD:\n            # Once per call's backward",
        "        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):\n"
        "            # Once per call's backward",
    ),
    # A blocking all-gather: the main thread waits inside the issue (FSDP2's own choice on CPU).
    "blocking-all-gather": (
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=False)\n",
    ),
}


@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mutants")

    def make(name: str) -> str:
        return write_mutant(folder, name, MUTANTS[name] if isinstance(MUTANTS[name], list) else [MUTANTS[name]])

    return make


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_every_mutant_still_mutates(mutant, name):
    """Fast and first: a reworded reference must not leave a mutant silently stale."""
    assert Path(mutant(name)).read_text() != SOLUTION.read_text()


@pytest.mark.parametrize("name, world, precision, message", [
    # Dividing first changes the rounding of the sum: a loss, a grad norm or (first, in torch 2.11) a
    # shard differs by a few ulps.
    ("predivide", 3, ("float32", "float32"), r"differs (at step|from FSDP2's after step)"),
    ("overwrite-grad", 2, ("float32", "float32"), "differs at step"),
    ("ignore-reduce-dtype", 2, ("bfloat16", "float32"), "differs at step"),
    ("tensor-split-rows", 3, ("float32", "float32"), "torch.chunk gives it"),
    ("no-reshard-after-backward", 2, ("float32", "float32"), "not a DTensor"),
])
def test_parity_check_fails(mutant, request, name, world, precision, message):
    pool = request.getfixturevalue(f"pool{world}")
    with pytest.raises(AssertionError, match=message):
        checks.check_parity(pool, mutant(name), *precision)


def test_odd_shapes_check_fails(mutant, pool3):
    with pytest.raises(AssertionError, match="torch.chunk gives it"):
        checks.check_odd_shapes(pool3, mutant("tensor-split-rows"))


def test_conformance_frozen_check_fails(mutant, pool2, pool3):
    """Frozen parameters in a group: a slot for each in the reduce-scatter changes the bits at world
    size 3 (at 2, a sum of two values is the same either way round)."""
    with pytest.raises(AssertionError, match="frozen, world 3, .* differs from FSDP2's"):
        conformance.check(pool3, "frozen", mutant("zero-fill-every-slot"), "bfloat16", "bfloat16")
    conformance.check(pool2, "frozen", mutant("zero-fill-every-slot"), "bfloat16", "bfloat16")


def test_conformance_twice_check_fails(mutant, pool2):
    with pytest.raises(RankError, match="setStorage"):
        conformance.check(pool2, "twice", mutant("pre-backward-once-per-step"), "float32", "float32")


def test_predivide_is_invisible_at_world_2(mutant, pool2):
    """Why test_fsdp also runs at world size 3: at 2 every division order happens to agree."""
    checks.check_parity(pool2, mutant("predivide"), "float32", "float32")


@pytest.mark.parametrize("name, message", [
    ("no-reshard-after-forward", "peak memory per step"),
    ("leak-gather-buffers", "leaks every step"),
])
def test_memory_check_fails(mutant, pool2, name, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_memory(pool2, mutant(name), "float32", "float32")


@pytest.mark.parametrize("name, message", [
    ("no-reshard-after-forward", "still alive after its forward"),
    ("no-reshard-after-backward", "still alive after step"),
])
def test_residency_check_fails(mutant, pool2, name, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_residency(pool2, mutant(name))


@pytest.mark.parametrize("strip, fails, passes", [
    ({"task2"}, ["forward"], ["backward"]),
    ({"task3"}, ["backward"], ["forward"]),
    ({"task2", "task3"}, ["forward", "backward"], []),  # task 1 only
])
def test_overlap_check_fails_without_the_task(pool2, tmp_path, strip, fails, passes):
    """The reference without an overlap task fails that task's test and passes the other's."""
    variant = tmp_path / f"without_{'_'.join(sorted(strip))}.py"
    variant.write_text(make_skeleton.render(SOLUTION.read_text(), strip=strip))
    profiles = checks.profile_both(pool2, str(variant), tmp_path / "profiles")
    for which in fails:
        with pytest.raises(AssertionError, match="not overlapped"):
            checks.assert_overlap(profiles, which)
    for which in passes:
        checks.assert_overlap(profiles, which)


@pytest.mark.parametrize("name, fails, passes", [
    ("wait-prefetch-at-once", ["forward"], ["backward"]),
    ("blocking-all-gather", ["forward", "backward"], []),
])
def test_overlap_check_fails_when_waiting_at_once(mutant, pool2, tmp_path, name, fails, passes):
    """Overlap is judged by where the main thread waits: issuing early and waiting at once fails."""
    profiles = checks.profile_both(pool2, mutant(name), tmp_path / "profiles")
    for which in fails:
        with pytest.raises(AssertionError, match="not overlapped"):
            checks.assert_overlap(profiles, which)
    for which in passes:
        checks.assert_overlap(profiles, which)


@pytest.mark.parametrize("bonus", ["bonus1", "bonus2", "bonus3"])
def test_bonus_check_fails_without_the_bonus(pool2, tmp_path, bonus):
    """The reference with one bonus region stripped breaks that bonus's promise, by name."""
    variant = tmp_path / f"without_{bonus}.py"
    variant.write_text(make_skeleton.render(SOLUTION.read_text(), strip={bonus}))
    with pytest.raises(AssertionError, match=rf"hand-written FSDP breaks the promise of bonus {bonus[-1]}"):
        checks.check_mode(pool2, str(variant), [bonus], "float32", "float32", tmp_path / "run")


def test_bonus3_parity_fails_when_accumulating_in_the_compute_dtype(mutant, pool2, tmp_path):
    with pytest.raises(AssertionError, match="differ"):
        checks.check_mode(pool2, mutant("accumulate-in-compute-dtype"), ["bonus3"], "bfloat16", "float32", tmp_path)

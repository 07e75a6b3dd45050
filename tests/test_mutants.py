"""Every check in test.py can fail: run it against a deliberately broken reference.

Each mutant is the reference with one snippet replaced; the snippet must still be in
solution/fsdp.py (a mutant that silently stops mutating would prove nothing).
"""

from pathlib import Path

import pytest

import checks

SOLUTION = Path(__file__).resolve().parents[1] / "solution" / "fsdp.py"
pytestmark = pytest.mark.skipif(not SOLUTION.exists(), reason="student copy: no reference to break")

# name: (snippet in the reference, replacement), or a list of such pairs
MUTANTS = {
    # Pre-dividing and summing is what many write; at world size 3 it is not bit-equal to AVG.
    "predivide": (
        "        op = dist.ReduceOp.AVG if self.world > 1 else dist.ReduceOp.SUM\n",
        "        flat.div_(self.world)\n        op = dist.ReduceOp.SUM\n",
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
    # Never resharding after backward: full parameters are left in the model between steps.
    "no-reshard-after-backward": (
        "        if group.reshard_after_backward:\n            group.reshard()\n",
        "        if False:\n            group.reshard()\n",
    ),
}


@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    source = SOLUTION.read_text()
    folder = tmp_path_factory.mktemp("mutants")

    def make(name: str) -> str:
        changes = MUTANTS[name] if isinstance(MUTANTS[name], list) else [MUTANTS[name]]
        text = source
        for old, new in changes:
            assert text.count(old) == 1, f"mutant {name}: its snippet is no longer in solution/fsdp.py once"
            text = text.replace(old, new)
        path = folder / f"{name}.py"
        path.write_text(text)
        return str(path)

    return make


@pytest.mark.parametrize("name, world, precision, message", [
    ("predivide", 3, ("float32", "float32"), "differs from FSDP2"),
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


def test_predivide_is_invisible_at_world_2(mutant, pool2):
    """Why test_fsdp also runs at world size 3: at 2 every division order happens to agree."""
    checks.check_parity(pool2, mutant("predivide"), "float32", "float32")

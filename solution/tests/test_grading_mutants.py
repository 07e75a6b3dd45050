"""Every grading check fails on a submission that deserves it.

Each mutant is the reference with exact snippets replaced (each must occur once), or a cheat
written out. The points mutants run test.py in a subprocess, as graders do, and read its table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import checks, handwritten
from solution.tests.mutation import write_mutant

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solution" / "fsdp.py"

REEXPORT = "from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n"
MUTANTS = {
    # Task 1 forward works, backward does not: the reduce-scatter is a TODO.
    "forward_only": [(
        "            flat = torch.empty((self.world, numel), dtype=self.reduce_dtype, device=self.device)\n",
        "            raise TodoError('TODO(task1): reduce-scatter')\n")],
    "no_free_after_forward": [(
        "                if self.group.reshard_after_forward:\n                    self.group.reshard()\n",
        "                pass\n")],
    "no_free_after_backward": [(
        "            if group.reshard_after_backward:\n                group.reshard()\n",
        "            pass\n")],
    "keep_full_grads": [(
        "        if grad is not None:\n            self.unsharded.grad = None\n",
        "")],
    # Gather in the parameter's own dtype and cast after: the same numbers, twice the bytes in bfloat16.
    "cast_after_gather": [(
        "            flat = torch.empty(self.world * self.shard_numel, dtype=self.compute_dtype, device=self.device)\n",
        "            flat = torch.empty(self.world * self.shard_numel, dtype=self.orig_dtype, device=self.device)\n")],
    # The sharded gradient negated: losses and grad norms as FSDP2's, the parameters not.
    "negate_sharded_grad": [(
        "            p.set_sharded_grad(output[start:start + p.padded_numel])\n",
        "            p.set_sharded_grad(-output[start:start + p.padded_numel])\n")],
}
# Doors a student might try to reach FSDP2 or the checks; each must be refused by the source check.
CHEATS = {
    "reexport": REEXPORT,
    "import_as": "import torch.distributed.fsdp as f\nfully_shard = f.fully_shard\n",
    "from_package": "from torch.distributed import fsdp\n",
    "dunder_import": "fully_shard = __import__('torch.distributed.fsdp').distributed.fsdp.fully_shard\n",
    "importlib": "import importlib\nm = importlib.import_module('torch.distributed.' + 'fs' + 'dp')\n",
    "getattr_built": "import torch.distributed as d\nm = getattr(d, ''.join(['f', 'sdp']))\n",
    "sys_modules": "import torch\nm = torch.sys.modules['torch.distributed.fsdp']\n",
    "internals": "from torch.distributed.fsdp._fully_shard import _fully_shard\n",
    "composable": "from torch.distributed._composable.fsdp import fully_shard\n",
    "patch_checks": "import harness.checks\nharness.checks.check_step = lambda *a, **k: 'ok'\n",
    "globals_walk": "import torch\ng = torch.nn.Module.__init__.__globals__\n",
    "frames": "try:\n    1 / 0\nexcept Exception as e:\n    f = e.__traceback__.tb_frame.f_back\n",
    "exec": "exec('import torch.distributed.fsdp')\n",
    "read_reference": "rows = open('losses.json').read()\n",
}


@pytest.fixture(scope="module")
def mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grading_mutants")

    def make(name: str) -> str:
        if name not in CHEATS:
            return write_mutant(folder, name, MUTANTS[name])
        path = folder / f"{name}.py"
        path.write_text(CHEATS[name])
        return str(path)

    return make


@pytest.mark.parametrize("name", list(CHEATS))
def test_source_check_refuses(mutant, name):
    assert handwritten.static_problem(Path(mutant(name))) is not None, name


def test_source_check_accepts_reference_and_skeleton():
    assert handwritten.static_problem(SOLUTION) is None
    assert handwritten.static_problem(ROOT / "fsdp.py") is None


def test_runtime_check_sees_fsdp2(pool2, mutant):
    """Without the source check, the run itself gives FSDP2 away (exported objects, classes, ops)."""
    runs = checks.run(pool2, checks.forward_job, checks.config(mutant("reexport")))
    assert all(r.fsdp2 for r in runs), [r.fsdp2 for r in runs]
    clean = checks.run(pool2, checks.forward_job, checks.config(str(SOLUTION)))
    assert not any(r.fsdp2 for r in clean)


def test_no_free_after_forward_loses_forward(pool2, mutant):
    with pytest.raises(AssertionError, match="still alive after its forward"):
        checks.check_forward(pool2, mutant("no_free_after_forward"), "float32", "float32")


@pytest.mark.parametrize("name, message", [("no_free_after_backward", "gathered parameters still alive after step|not a DTensor"),
                                           ("keep_full_grads", "full gradients still alive")])
def test_step_checks_fail(pool2, mutant, name, message):
    path = mutant(name)
    checks.check_forward(pool2, path, "float32", "float32")  # the forward is fine
    with pytest.raises(AssertionError, match=message):
        checks.check_step(pool2, path, "float32", "float32")


def test_shard_difference_is_measured(pool2, mutant):
    """One step, so only the shards after it tell: the first differing one, and by how much."""
    with pytest.raises(AssertionError, match=r"shard of \S+ differs from FSDP2's after step 1: \d+ of \d+ elements "
                                             r"differ, max abs [0-9.e+-]+, max \d+ ulps of float32") as e:
        checks.check_step(pool2, mutant("negate_sharded_grad"), "float32", "float32", num_steps=1)
    print(e.value)


def test_cast_after_gather_fails_communication(pool2, mutant):
    with pytest.raises(AssertionError, match=r"hand-written FSDP sent .*float32.*FSDP2 sent .*bfloat16"):
        checks.check_forward(pool2, mutant("cast_after_gather"), "bfloat16", "float32")


def points(path: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "points.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "test.py"),
                    "--impl", path, "--points-json", str(out), *args], cwd=ROOT, capture_output=True, timeout=1800)
    return {r["task"]: r["earned"] for r in json.loads(out.read_text())["rows"]}


def test_reexport_scores_zero(mutant, tmp_path):
    earned = points(mutant("reexport"), tmp_path)
    assert set(earned.values()) == {0}, earned


def test_forward_only_scores_three(mutant, tmp_path):
    earned = points(mutant("forward_only"), tmp_path)
    assert earned["task 1 forward"] == 3 and sum(earned.values()) == 3, earned

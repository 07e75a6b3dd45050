"""Every mutant the instructors' tests run, in one registry: the reference with snippets replaced
(MUTANTS), or a cheat written out whole (CHEATS). Each name is used once, in kebab-case; each
mutant says in one line what it breaks. The mutant test files pick them by name (write_mutant)."""

from pathlib import Path

from solution import make_skeleton

# name: [(snippet in solution/fsdp.py, its replacement), ...]; every snippet must occur there once
# The FSDPState hooks the reference keeps out of compiled graphs (torch.compiler.disable).
COMPILED_HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "final_callback")

MUTANTS: dict[str, list[tuple[str, str]]] = {
    # Task 1's backward missing: the reduce-scatter is still a TODO (the forward works).
    "forward-only": [(
        "            flat = torch.empty((self.world, numel), dtype=self.reduce_dtype, device=self.device)\n",
        "            raise TodoError('TODO(task1): reduce-scatter')\n")],
    # Pre-dividing and summing, as many write: at world size 3 not bit-equal to AVG.
    "predivide": [(
        "            op = dist.ReduceOp.AVG if self.world > 1 else dist.ReduceOp.SUM\n",
        "            flat.div_(self.world)\n            op = dist.ReduceOp.SUM\n")],
    # Overwriting instead of accumulating the sharded gradient: every micro-step but the last is lost.
    "overwrite-grad": [(
        "            self.sharded.grad.to_local().add_(local)\n",
        "            self.sharded.grad.to_local().copy_(local)\n")],
    # The sharded gradient negated: losses and grad norms as FSDP2's, the parameters not.
    "negate-sharded-grad": [(
        "            p.set_sharded_grad(output[start:start + p.padded_numel])\n",
        "            p.set_sharded_grad(-output[start:start + p.padded_numel])\n")],
    # reduce_dtype ignored: gradients reduced in the compute dtype (bf16) instead of float32.
    "ignore-reduce-dtype": [(
        "        self.reduce_dtype = reduce_dtype or self.compute_dtype\n",
        "        self.reduce_dtype = self.compute_dtype\n")],
    # Gathering in the parameter's own dtype and casting after: the same numbers, twice the bytes in bf16.
    "cast-after-gather": [(
        "            flat = torch.empty(self.world * self.shard_numel, dtype=self.compute_dtype, device=self.device)\n",
        "            flat = torch.empty(self.world * self.shard_numel, dtype=self.orig_dtype, device=self.device)\n")],
    # torch.tensor_split's rows instead of torch.chunk's (86/85/85 instead of 86/86/84 at world 3).
    "tensor-split-rows": [
        ("        self.rows = [max(0, min(self.padded_rows, param.shape[0] - r * self.padded_rows)) for r in range(world)]\n",
         "        self.rows = [param.shape[0] // world + (r < param.shape[0] % world) for r in range(world)]\n"),
        ("        start = rank * self.padded_rows\n", "        start = sum(self.rows[:rank])\n"),
    ],
    # Never resharding after forward: every block's full parameters stay until backward.
    "no-reshard-after-forward": [(
        "                if self.group.reshard_after_forward:\n                    self.group.reshard()\n",
        "                pass\n")],
    # Never resharding after backward: full parameters are left in the model between steps.
    "no-reshard-after-backward": [(
        "            if group.reshard_after_backward:\n                group.reshard()\n",
        "            pass\n")],
    # Full gradients kept after the reduce-scatter: memory the sharded gradient was meant to free.
    "keep-full-grads": [(
        "        if grad is not None:\n            self.unsharded.grad = None\n",
        "")],
    # Every all-gather buffer kept: memory grows step after step.
    "leak-gather-buffers": [(
        "            self.pending_gather = PendingGather(work, flat)\n",
        "            self.pending_gather = PendingGather(work, flat)\n"
        "            self.__dict__.setdefault('leaked', []).append(flat)\n")],
    # Forward prefetch waited for at once: issued early, but nothing computes while it runs.
    "wait-prefetch-at-once": [(
        "                order[i + 1].prefetch()\n",
        "                order[i + 1].prefetch()\n                order[i + 1].wait_for_unshard()\n")],
    # A blocking all-gather: the main thread waits inside the issue (FSDP2's own choice on CPU).
    "blocking-all-gather": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=False)\n")],
    # Bonus 3 accumulating in the compute dtype (bf16) instead of FSDP2's reduce-dtype copy.
    "accumulate-in-compute-dtype": [(
        "            self.accumulated_grad = grad.to(self.accumulate_dtype)\n",
        "            self.accumulated_grad = grad.clone()\n")],
    # Recomputed forwards (activation checkpointing) treated as new ones: post_forward frees
    # parameters backward still uses.
    "no-recompute-handling": [
        ("        if self.training_state is TrainingState.PRE_BACKWARD:\n"
         "            # Activation checkpointing", "        if False:\n            # Activation checkpointing"),
        ("        if self.training_state is TrainingState.PRE_BACKWARD:\n            return output",
         "        if False:\n            return output"),
    ],
    # No FSDPModule._apply: to_empty() leaves the group gathering from the meta shards.
    "no-to-empty": [("    def _apply(self, fn: Callable", "    def _apply_unused(self, fn: Callable")],
    # Tied weights: the second place holding the parameter is not re-pointed at the shard.
    "no-tie-aliases": [("        self.aliases = aliases\n", "        self.aliases = []\n")],
    # No hook kept out of compiled graphs: under --compile dynamo traces the collectives and storage
    # resizes into the blocks' graphs (train.py stops with one line naming the fix).
    "no-compile-disable": [(f"    @torch.compiler.disable\n    def {hook}(", f"    def {hook}(") for hook in COMPILED_HOOKS],
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
    "pre-backward-once-per-step": [(
        "        if self.training_state is TrainingState.PRE_BACKWARD:\n            # Once per call's backward",
        "        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):\n"
        "            # Once per call's backward",
    )],
}

# Doors a student might try to reach FSDP2 or the checks, each a whole file: the source check
# (harness/tools/handwritten.py) must refuse every one.
CHEATS: dict[str, str] = {
    # FSDP2 re-exported under the names train.py calls.
    "reexport": "from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard\n",
    # FSDP2's module imported under another name.
    "import-as": "import torch.distributed.fsdp as f\nfully_shard = f.fully_shard\n",
    # FSDP2's package taken from its parent package.
    "from-package": "from torch.distributed import fsdp\n",
    # FSDP2 imported through __import__.
    "dunder-import": "fully_shard = __import__('torch.distributed.fsdp').distributed.fsdp.fully_shard\n",
    # FSDP2 imported by a name built at run time.
    "importlib": "import importlib\nm = importlib.import_module('torch.distributed.' + 'fs' + 'dp')\n",
    # FSDP2 reached as an attribute whose name is built at run time.
    "getattr-built": "import torch.distributed as d\nm = getattr(d, ''.join(['f', 'sdp']))\n",
    # FSDP2 taken from sys.modules.
    "sys-modules": "import torch\nm = torch.sys.modules['torch.distributed.fsdp']\n",
    # FSDP2's private implementation module.
    "internals": "from torch.distributed.fsdp._fully_shard import _fully_shard\n",
    # FSDP2 under its older composable path.
    "composable": "from torch.distributed._composable.fsdp import fully_shard\n",
    # The graded checks patched to pass.
    "patch-checks": "import harness.tools.checks\nharness.tools.checks.check_step = lambda *a, **k: 'ok'\n",
    # Another module's globals walked to reach what it imported.
    "globals-walk": "import torch\ng = torch.nn.Module.__init__.__globals__\n",
    # The caller's frame (the checks) reached through a traceback.
    "frames": "try:\n    1 / 0\nexcept Exception as e:\n    f = e.__traceback__.tb_frame.f_back\n",
    # Code hidden in a string and run.
    "exec": "exec('import torch.distributed.fsdp')\n",
    # FSDP2's reference numbers read instead of computed.
    "read-reference": "rows = open('losses.json').read()\n",
}


def write_mutant(folder: Path, name: str, changes: list[tuple[str, str]] | None = None) -> str:
    """Write mutant or cheat NAME as FOLDER/NAME.py and return its path. A mutant is
    solution/fsdp.py with each (snippet, replacement) of MUTANTS[name] (or `changes`) applied;
    every snippet must occur exactly once (a mutant that silently stops mutating would prove nothing)."""
    path = folder / f"{name}.py"
    if name in CHEATS and changes is None:
        path.write_text(CHEATS[name])
        return str(path)
    text = make_skeleton.SOLUTION.read_text()
    for old, new in MUTANTS[name] if changes is None else changes:
        assert text.count(old) == 1, f"mutant {name}: its snippet is no longer in solution/fsdp.py once"
        text = text.replace(old, new)
    path.write_text(text)
    return str(path)

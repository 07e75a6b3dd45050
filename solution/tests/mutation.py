"""Every mutant the instructors' tests run, in one registry: the reference with snippets replaced
(MUTANTS), or a cheat written out whole (CHEATS). Each name is used once, in kebab-case; each
mutant says in one line what it breaks. The mutant test files pick them by name (write_mutant)."""

from pathlib import Path

from solution import make_skeleton
from harness.tools.grading import handwritten

# name: [(snippet in solution/fsdp.py, its replacement), ...]; every snippet must occur there once
# The FSDPState hooks the reference keeps out of compiled graphs (torch.compiler.disable).
COMPILED_HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "final_callback")

# The reference's post-backward: the previous group's reduce-scatter finished, then this group's issued and left running.
_FINISH_THEN_ISSUE = ("        if ctx.pending_reduce is not None:\n"
                      "            ctx.pending_reduce, pending = None, ctx.pending_reduce\n"
                      "            pending.finish()\n"
                      "        pending = self.group.reduce_scatter()\n"
                      "        if pending is not None:\n"
                      "            ctx.pending_reduce = pending\n")
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
    # HSDP (bonus 4): the replica all-reduce over the whole world instead of the replicate group: each
    # rank's shard averaged with other ranks' different shards.
    "hsdp-all-reduce-world": [(
        "            work = dist.all_reduce(pending.output, op=op, group=self.replicate_group, async_op=True)\n",
        "            work = dist.all_reduce(pending.output, op=op, async_op=True)\n")],
    # HSDP without the replica all-reduce: each replica keeps its own gradients, the replicas drift apart.
    "hsdp-skip-all-reduce": [(
        "        if self.group.replicate_group is not None:  # HSDP: averaged across the replicas next\n",
        "        if False:\n")],
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
    # Polls the all-gather until it is done, right after issuing it, outside the issue's range and with no
    # Work.wait(): the FSDP ranges still say "waited later" (schedule.marked_waits marks the poll).
    "poll-all-gather-at-once": [(
        "            # endregion\n        self.state = ShardedState.GATHERING\n\n    def wait_for_unshard",
        "            # endregion\n        self.state = ShardedState.GATHERING\n"
        "        while not self.pending_gather.work.is_completed():\n            pass\n\n    def wait_for_unshard")],
    # Waits for the all-gather right after the issue with Work.wait kept from the file's import (before any
    # instrument was on), then asks is_completed(), which finds it done: unless every call goes through what is
    # on at the time (schedule's [Note: gates put in place before the file]), no mark shows the wait, and the
    # later wait() in all_gather_copy_out looks overlapped (a red-team file earned tasks 2 and 3 so).
    "wait-with-a-method-kept-from-import": [(
        "from torch.profiler import record_function\n",
        "from torch.profiler import record_function\n\n_WAIT = dist.Work.wait\n"), (
        "            # endregion\n        self.state = ShardedState.GATHERING\n\n    def wait_for_unshard",
        "            # endregion\n        self.state = ShardedState.GATHERING\n"
        "        _WAIT(self.pending_gather.work)\n        self.pending_gather.work.is_completed()\n\n"
        "    def wait_for_unshard")],
    # Tells the runs apart by its own history: no prefetch for the first model its process wraps (the memory
    # job's, on fresh ranks), every group at once for any later one (the profiled runs', when they ran on the
    # ranks that ran the other checks first): lean where memory is judged, overlapped where overlap is. The
    # profiled runs run on fresh ranks too.
    "prefetch-only-after-the-first-model": [(
        "from torch.profiler import record_function\n",
        "from torch.profiler import record_function\n\n_FIRST = []  # the first model's context this process saw\n"), (
        "            ctx.forward_order.append(self.group)\n",
        "            ctx.forward_order.append(self.group)\n            if not _FIRST:\n                _FIRST.append(ctx)\n"), (
        "                order[i + 1].prefetch()\n",
        "                for later in order[i + 1:] if _FIRST[0] is not ctx else []:\n                    later.prefetch()\n"), (
        "            ctx.post_forward_order[index - 1].prefetch()\n",
        "            for earlier in reversed(ctx.post_forward_order[:index]) if _FIRST[0] is not ctx else []:\n"
        "                earlier.prefetch()\n")],
    # Two groups ahead, each group's own all-gather waited for first: every all-gather still looks overlapped, and
    # one more block gathered fits task 3's memory allowance; two in flight at once is not FSDP2's schedule.
    "prefetch-two-ahead": [(
        "            if self.group in order and (i := order.index(self.group)) + 1 < len(order):\n"
        "                order[i + 1].prefetch()\n",
        "            if self.group in order:\n                i = order.index(self.group)\n"
        "                for later in order[i + 1:i + 3]:\n                    later.prefetch()\n"), (
        "        if index > 0:\n            ctx.post_forward_order[index - 1].prefetch()\n",
        "        for earlier in reversed(ctx.post_forward_order[max(index - 2, 0):index]):\n"
        "            earlier.prefetch()\n")],
    # The next group's all-gather issued before this group's own is waited for (two in flight), with an empty
    # copy-out range of this group's opened first: the schedule's wait, though its Work is waited for after the issue.
    "prefetch-before-own-wait-early-copy-out": [(
        "            self.group.unshard()  # no-op if prefetched or still gathered\n"
        "            self.group.wait_for_unshard()\n            # region task2",
        "            self.group.unshard()  # no-op if prefetched or still gathered\n"
        "            with record_function(self.group.link_label(ALL_GATHER_WAIT_RANGE)):\n"
        "                pass\n            # region task2"), (
        "            # endregion\n            _prefetch(self.forward_prefetch)  # set_modules_to_forward_prefetch\n",
        "            # endregion\n            self.group.wait_for_unshard()\n"
        "            _prefetch(self.forward_prefetch)  # set_modules_to_forward_prefetch\n")],
    # The same, the early range holding a synchronize() of this group's Work, which returns at once on gloo (the work
    # still running): asked there, released only where wait() finds or makes it done.
    "prefetch-before-own-wait-synchronize": [(
        "            self.group.unshard()  # no-op if prefetched or still gathered\n"
        "            self.group.wait_for_unshard()\n            # region task2",
        "            self.group.unshard()  # no-op if prefetched or still gathered\n"
        "            with record_function(self.group.link_label(ALL_GATHER_WAIT_RANGE)):\n"
        "                if self.group.pending_gather is not None and self.group.pending_gather.work is not None:\n"
        "                    self.group.pending_gather.work.synchronize()\n            # region task2"), (
        "            # endregion\n            _prefetch(self.forward_prefetch)  # set_modules_to_forward_prefetch\n",
        "            # endregion\n            self.group.wait_for_unshard()\n"
        "            _prefetch(self.forward_prefetch)  # set_modules_to_forward_prefetch\n")],
    # The next group's all-gather waited for mid-block (a hook on the block's first child, after some of its
    # compute) and the group after it issued there: one all-gather in flight at a time, each waited for after
    # another group's compute, and two groups ahead of the one computing: three groups gathered at once.
    "prefetch-mid-block": [(
        "            if self.group in order and (i := order.index(self.group)) + 1 < len(order):\n"
        "                order[i + 1].prefetch()\n",
        "            if self.group in order and (i := order.index(self.group)) + 1 < len(order):\n"
        "                order[i + 1].prefetch()\n"
        "                if i + 2 < len(order) and (child := next(module.children(), None)) is not None:\n"
        "                    def mid_block(*_, following=order[i + 1], after=order[i + 2]):\n"
        "                        handle.remove()\n"
        "                        following.wait_for_unshard()\n"
        "                        after.prefetch()\n"
        "                    handle = child.register_forward_hook(mid_block)\n")],
    # No backward prefetch: each group's all-gather issued in its own pre-backward, and before it is waited for,
    # backward nodes run as compute to hide it behind: those of a graph of its own (differentiated there) ...
    "own-graph-before-own-wait": [(
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "            self.group.wait_for_unshard()\n"
        "            if not self.backward_prefetch:",
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "        with torch.enable_grad():  # off in a backward hook\n"
        "            own = torch.ones(64, 64, requires_grad=True)\n"
        "            torch.autograd.grad((own @ own).sum(), own)\n"
        "        with record_function(self.group.label('pre_backward')):\n"
        "            self.group.wait_for_unshard()\n"
        "            if not self.backward_prefetch:"), (
        "        if index > 0:\n            ctx.post_forward_order[index - 1].prefetch()\n", "")],
    # ... or the model's, called by hand (`grad_fn`, saved in forward, given the gradient the hook was given): the
    # node of the last op of the block's last leaf (the feed-forward's output projection), or the root's output's.
    "call-leaf-node-before-own-wait": [(
        "            t.register_hook(self.pre_backward)\n",
        "            t.register_hook(self.pre_backward)\n"
        "                node = t.grad_fn\n"
        "                self.node = node.next_functions[-1][0] if node.name() == 'AddBackward0' else node\n"), (
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "            self.group.wait_for_unshard()\n"
        "            if not self.backward_prefetch:",
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "        if getattr(self, 'node', None) is not None:\n            self.node(grad)\n"
        "        with record_function(self.group.label('pre_backward')):\n"
        "            self.group.wait_for_unshard()\n"
        "            if not self.backward_prefetch:"), (
        "        if index > 0:\n            ctx.post_forward_order[index - 1].prefetch()\n", "")],
    # Two blocks' attention norms swapped at the first forward, each position still given its own group's weight
    # (the same numbers): which group the grader sees computing would follow the instance, not the position.
    "swap-block-norms": [(
        "        self.is_root = True\n        fqns: dict[FSDPGroup, list[str]] = {}\n",
        "        self.is_root = True\n"
        "        first, second = [m for m in self.module.modules() if isinstance(m, FSDPModule)][1:3]\n"
        "        a, b = first.attention_norm, second.attention_norm\n"
        "        first.attention_norm, second.attention_norm = b, a\n"
        "        for state in states:\n"
        "            for p in state.group.params if state.group is not None else []:\n"
        "                p.module = {id(a): b, id(b): a}.get(id(p.module), p.module)\n"
        "        fqns: dict[FSDPGroup, list[str]] = {}\n")],
    # Each block's attention norm called from a module of the FSDP's put in its place at the first forward: the same
    # leaves in the same order, but not called by the model (a file could so time the model's compute as it likes).
    "norm-called-through-a-module-of-its-own": [(
        "        self.is_root = True\n        fqns: dict[FSDPGroup, list[str]] = {}\n",
        "        self.is_root = True\n"
        "        class Through(nn.Module):\n"
        "            def __init__(self, inner):\n"
        "                super().__init__()\n"
        "                self.__dict__['inner'] = inner  # not a child: the parameters keep their names\n"
        "            def forward(self, x):\n"
        "                return self.inner(x)\n"
        "        for block in [m for m in self.module.modules() if isinstance(m, FSDPModule)][1:]:\n"
        "            block.attention_norm = Through(block.attention_norm)\n"
        "        fqns: dict[FSDPGroup, list[str]] = {}\n")],
    # The first two blocks' all-gathers each issued under the other's name: every count, byte and wait as
    # FSDP2's, and the order of the names differs; which group a collective carries is told by its data, not
    # its name (jobs.py's [Note: where the model's parameters came from]).
    "all-gathers-under-swapped-names": [(
        '        return f"FSDP::{phase} ({self.fqn})" if self.fqn else f"FSDP::{phase}"\n',
        '        fqn = {"layers.0": "layers.1", "layers.1": "layers.0"}.get(self.fqn, self.fqn) \\\n'
        '            if phase == ALL_GATHER_RANGE else self.fqn\n'
        '        return f"FSDP::{phase} ({fqn})" if fqn else f"FSDP::{phase}"\n')],
    # Honest names and data, and the second block's all-gather issued before the first's at the root's
    # pre-forward: another order than FSDP2's.
    "prefetch-second-block-first": [(
        "                order[i + 1].prefetch()\n",
        "                if i == 0 and len(order) > 2:\n"
        "                    order[2].prefetch()\n"
        "                order[i + 1].prefetch()\n")],
    # Backward copies each block's parameters out of its forward all-gather's buffer, kept (the same values),
    # not out of the all-gather it waited for: a group held gathered from forward (the stash behind two groups
    # ahead in backward with FSDP2's counts).
    "backward-copies-out-of-forward": [(
        "            columns = pending.wait().view(self.world, self.shard_numel)\n",
        "            columns = pending.wait().view(self.world, self.shard_numel)\n"
        "            if torch.is_grad_enabled():\n"
        "                self.kept = columns\n"
        "            elif getattr(self, \"kept\", None) is not None:\n"
        "                columns, self.kept = self.kept, None\n")],
    # The same, its bytes copied into the all-gather's output it waited for through a table of constants looked up by
    # the kept bytes' bits and a where() whose condition is all False: an index made from data carries it.
    "backward-copies-out-of-forward-through-an-index": [(
        "            columns = pending.wait().view(self.world, self.shard_numel)\n",
        "            columns = pending.wait().view(self.world, self.shard_numel)\n"
        "            if torch.is_grad_enabled():\n"
        "                self.kept = columns\n"
        "            elif getattr(self, \"kept\", None) is not None:\n"
        "                kept, self.kept = self.kept, None\n"
        "                table = torch.arange(65536, dtype=torch.int32).to(torch.int16)\n"
        "                bits = kept.reshape(-1).view(torch.int16).to(torch.int32) & 65535\n"
        "                out = columns.reshape(-1)\n"
        "                out.copy_(torch.where(torch.zeros(out.shape, dtype=torch.bool), out,\n"
        "                                      table[bits].view(out.dtype)))\n")],
    # The all-gather's output read when synchronize() returned (at once on gloo, the work maybe still running), and
    # that copy used after the real wait: every parameter computes with bytes read before its all-gather landed.
    "copy-out-after-synchronize": [(
        "            self.work.wait()\n"
        "        if self.post_forward is None:\n",
        "            self.work.synchronize()\n"
        "            early = self.flat.clone()\n"
        "            self.work.wait()\n"
        "            self.flat.copy_(early)\n"
        "        if self.post_forward is None:\n")],
    # The last block's parameters kept from forward (a copy) and put in the parameters' place (`.data`) in every
    # second backward: that pass computes with forward's data, its reads of memory the model was never called with,
    # which the log does not see; the other backward passes are honest and read what FSDP2's do.
    # Two reduce-scatters in flight (the previous one finished only after the next is issued), each said done early in
    # the trace by an empty done range around a tag of the marks' name written by the program itself: the marks'
    # names carry the run's secret, so such a tag is no tag.
    "reduce-scatter-said-done-by-a-forged-tag": [(
        "            if ctx.pending_reduce is not None and ctx.pending_reduce.done():\n"
        "                ctx.pending_reduce, pending = None, ctx.pending_reduce\n"
        "                pending.finish()\n",
        "            if (said := ctx.pending_reduce) is not None and said.work is not None:\n"
        "                with record_function(said.group.link_label(REDUCE_SCATTER_DONE_RANGE)):\n"
        "                    with record_function(\"Work found done #\" + str(id(said.work))):\n"
        "                        pass\n"), (
        _FINISH_THEN_ISSUE,
        "        if (said := ctx.pending_reduce) is not None and said.work is not None:\n"
        "            with record_function(said.group.link_label(REDUCE_SCATTER_DONE_RANGE)):\n"
        "                with record_function(\"Work found done #\" + str(id(said.work))):\n"
        "                    pass\n"
        "        previous = ctx.pending_reduce\n"
        "        pending = self.group.reduce_scatter()\n"
        "        if previous is not None:\n"
        "            previous.finish()\n"
        "        ctx.pending_reduce = pending\n")],
    "backward-alternately-reads-a-copy": [(
        "                if self.group.reshard_after_forward:\n"
        "                    self.group.reshard()\n",
        "                order = self.ctx.last_forward_order\n"
        "                if order and order[-1] is self.group and torch.is_grad_enabled():\n"
        "                    self.ctx.kept = (self.group, [p.gathered.detach().clone() for p in self.group.params])\n"
        "                if self.group.reshard_after_forward:\n"
        "                    self.group.reshard()\n"), (
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "            self.group.wait_for_unshard()\n"
        "            if not self.backward_prefetch:",
        "            self.group.unshard()  # no-op if prefetched or never resharded\n"
        "            self.group.wait_for_unshard()\n"
        "            kept = getattr(ctx, 'kept', None)\n"
        "            if kept is not None and kept[0] is self.group:\n"
        "                ctx.kept, ctx.swaps = None, getattr(ctx, 'swaps', 0) + 1\n"
        "                if ctx.swaps % 2 == 0:\n"
        "                    for p, copy in zip(self.group.params, kept[1]):\n"
        "                        p.unsharded.data = copy[:p.shape[0]]\n"
        "            if not self.backward_prefetch:"), (
        "            if group.reshard_after_backward:\n"
        "                group.reshard()\n",
        "            for p in group.params:\n"
        "                if p.gathered is not None and p.unsharded.data_ptr() != p.gathered.data_ptr():\n"
        "                    p.unsharded.data = p.gathered.data[:p.shape[0]]\n"
        "            if group.reshard_after_backward:\n"
        "                group.reshard()\n")],
    # Every reduce-scatter left running until the end of backward: each overlaps the compute after it, and every
    # group's gradient buffers are held at once (FSDP2 finishes the previous group's before issuing the next).
    "reduce-scatters-all-in-flight": [(
        _FINISH_THEN_ISSUE,
        "        pending = self.group.reduce_scatter()\n"
        "        if pending is not None:\n"
        "            ctx.__dict__.setdefault(\"flying\", []).append(pending)\n"), (
        "            if ctx.pending_reduce is not None:\n"
        "                ctx.pending_reduce, pending = None, ctx.pending_reduce\n"
        "                pending.finish()\n"
        "            if ctx.is_last_backward:",
        "            for pending in ctx.__dict__.pop(\"flying\", []):\n"
        "                pending.finish()\n"
        "            if ctx.is_last_backward:")],
    # Tells the runs apart by the step it is in: every group prefetched at once through step 3 (the last a
    # profiled run of tasks 2 and 3 has), nothing from step 4 (which only the memory job has). The memory check
    # judges the peak on the profiled steps only.
    # A copy of every group's gathered parameters kept from forward to the end of backward in step 2 only: a whole
    # model more than FSDP2 holds in one judged step, lean in the other (the least of the two would pass it).
    "hold-every-group-in-step-2": [(
        "            if self.is_root:  # a new forward begins\n",
        "            if self.is_root:  # a new forward begins\n"
        "                ctx.root_forwards = getattr(ctx, \"root_forwards\", 0) + 1\n"), (
        "                if self.group.reshard_after_forward:\n"
        "                    self.group.reshard()\n"
        "                # else: if not self.is_root:",
        "                if getattr(self.ctx, \"root_forwards\", 0) in (3, 4):\n"
        "                    self.ctx.held = getattr(self.ctx, \"held\", []) + [\n"
        "                        p.gathered.clone() for p in self.group.params if p.gathered is not None]\n"
        "                if self.group.reshard_after_forward:\n"
        "                    self.group.reshard()\n"
        "                # else: if not self.is_root:"), (
        "            if ctx.pending_reduce is not None:\n"
        "                ctx.pending_reduce, pending = None, ctx.pending_reduce\n"
        "                pending.finish()\n"
        "            if ctx.is_last_backward:",
        "            if ctx.pending_reduce is not None:\n"
        "                ctx.pending_reduce, pending = None, ctx.pending_reduce\n"
        "                pending.finish()\n"
        "            ctx.held = []\n"
        "            if ctx.is_last_backward:")],
    "prefetch-all-until-step-4": [(
        "from torch.profiler import record_function\n",
        "from torch.profiler import record_function\n\n_FORWARDS = []  # the root forwards this process ran\n"), (
        "            ctx.forward_order.append(self.group)\n",
        "            ctx.forward_order.append(self.group)\n            if self.is_root:\n                _FORWARDS.append(None)\n"), (
        "                order[i + 1].prefetch()\n",
        "                for later in order[i + 1:] if len(_FORWARDS) <= 6 else []:\n                    later.prefetch()\n"), (
        "            ctx.post_forward_order[index - 1].prefetch()\n",
        "            for earlier in reversed(ctx.post_forward_order[:index]) if len(_FORWARDS) <= 6 else []:\n"
        "                earlier.prefetch()\n")],
    # No prefetch: each group's all-gather issued in its own pre-forward and waited for after a token op
    # outside FSDP's ranges, which is not the model's compute (schedule's [Note: what counts as compute]).
    "token-compute-forward": [(
        "        with record_function(self.group.label(\"pre_forward\")):\n"
        "            self.group.unshard()  # no-op if prefetched or still gathered\n",
        "        self.group.unshard()\n        torch.zeros(1).add_(1)\n"
        "        with record_function(self.group.label(\"pre_forward\")):\n"), (
        "                order[i + 1].prefetch()\n", "                pass\n")],
    # The same in backward, and each reduce-scatter finished after a token op right after its issue.
    "token-compute-backward": [(
        "        with record_function(self.group.label(\"pre_backward\")):\n",
        "        self.group.unshard()\n        torch.zeros(1).add_(1)\n"
        "        with record_function(self.group.label(\"pre_backward\")):\n"), (
        "                self.prefetch_next_backward()\n", "                pass\n"), (
        "            self.reduce_grads()\n",
        "            self.reduce_grads()\n        torch.zeros(1).add_(1)\n"
        "        if self.ctx.pending_reduce is not None:\n"
        "            self.ctx.pending_reduce, pending = None, self.ctx.pending_reduce\n"
        "            pending.finish()\n")],
    # Waits for the all-gather's Work right after the issue, outside every range FSDP's schedule reads: the
    # later all_gather_copy_out range then finds it done (schedule's ISSUED/WAITED tags see the first wait).
    "wait-work-at-once": [(
        "            # endregion\n        self.state = ShardedState.GATHERING\n\n    def wait_for_unshard",
        "            # endregion\n        self.state = ShardedState.GATHERING\n"
        "        self.pending_gather.work.wait()\n\n    def wait_for_unshard")],
    # Runs one of the model's own modules itself (the root's final norm, on a dummy input): its forward is
    # the model's compute by kind, but not the model's run, so the overlap check compares the count with FSDP2's.
    "extra-model-call": [(
        "            self.group.wait_for_unshard()\n            # region task2: forward prefetch\n",
        "            self.group.wait_for_unshard()\n            if self.is_root:\n"
        "                norm = self.module.norm\n"
        "                norm(torch.ones(norm.weight.shape, dtype=norm.weight.dtype, device=norm.weight.device))\n"
        "            # region task2: forward prefetch\n")],
    # Calls the group's own norm on a dummy input (marked compute), then hides the model's own call of it behind a
    # dict subclass, so that the leaf forwards marked as compute stay as many as FSDP2's: every call of the
    # model's leaves is counted, compute or not.
    "token-call-unmarked-twin": [(
        "            self.group.wait_for_unshard()\n            # region task2: forward prefetch\n",
        "            self.group.wait_for_unshard()\n"
        "            norm = next((m for m in self.module.children() if isinstance(m, nn.RMSNorm)), None)\n"
        "            if norm is not None and torch.is_grad_enabled():\n"
        "                table = norm._parameters\n"
        "                norm._parameters = dict(table)\n"
        "                norm(torch.ones(norm.weight.shape, dtype=norm.weight.dtype, device=norm.weight.device))\n"
        "                norm._parameters = _Table(table)\n"
        "            # region task2: forward prefetch\n"), (
        "def _register_group_forward_hooks(", "class _Table(dict):\n    pass\n\n\ndef _register_group_forward_hooks(")],
    # Data sent beside the logged collectives: a broadcast in every group's forward (a collective FSDP2 never
    # issues, which the collective log once did not record).
    "side-channel-broadcast": [(
        "            self.group.wait_for_unshard()\n            # region task2: forward prefetch\n",
        "            self.group.wait_for_unshard()\n"
        "            dist.broadcast(torch.zeros(1, device=self.group.device), src=0)\n"
        "            # region task2: forward prefetch\n")],
    # The same beside-traffic issued inside DTensor's own dispatch: a sharded parameter concatenated with an
    # empty replicated one makes DTensor all-gather it (which the collective log, a dispatch mode popped while
    # it runs an op, once did not see).
    "side-channel-dtensor": [(
        "            self.group.wait_for_unshard()\n            # region task2: forward prefetch\n",
        "            self.group.wait_for_unshard()\n"
        "            _p = self.group.params[0]\n"
        "            torch.cat([_p.sharded.detach(), DTensor.from_local(_p.sharded.to_local().detach()[:0], _p.mesh,\n"
        "                                                               [Replicate()] * _p.mesh.ndim)])\n"
        "            # region task2: forward prefetch\n")],
    # The all-gather's output polled until it is there, then waited for later (after the compute, where its
    # wait finds it done): the poll is the wait, which no mark shows; the collective log names the read.
    "poll-all-gather-output": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            while bool(torch.isnan(flat).any()):\n"
        "                pass\n")],
    # The same output read where the dispatcher does not show it: printed (torch prints with every dispatch mode
    # off), or copied into a new tensor by torch.tensor (its Python key off) ([Note: reads the dispatcher does not
    # show] in jobs.py).
    "read-all-gather-output-by-printing": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            str(flat[:2])\n")],
    "read-all-gather-output-by-a-tensor-made-from-it": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            torch.tensor([flat[0], flat[1]])\n")],
    # ... or by torch.tensor from a sequence that is no list (a deque, whose items the log did not look into)
    "read-all-gather-output-by-a-tensor-made-from-a-deque": [
        ("import functools\n", "import collections\nimport functools\n"),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            torch.tensor(collections.deque(flat[:2].unbind()))\n")],
    # ... or by the file's own code run inside a call of torch's (a NamedTuple's __iter__, which a walk of the call's
    # arguments would run where the function mode is off)
    "read-all-gather-output-in-a-sequence-torch-reads": [
        ("from typing import Any, Callable\n", "import typing\nfrom typing import Any, Callable\n"),
        ("\ndef fully_shard(", "\nclass _Size(typing.NamedTuple):\n    n: int\n\n    def __iter__(self):\n"
                               "        return iter([self.n])\n\n\ndef fully_shard("),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            torch.zeros(_Size(1))\n")],
    # ... or by printing it in backward, whose hooks torch's backward would run with the log's function mode off
    "read-all-gather-output-by-printing-in-backward": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            if not torch.is_grad_enabled():\n                str(flat[:2])\n")],
    # ... or in a function of the file that torch calls inside its own call (apply_, or an object's __eq__)
    "read-all-gather-output-in-a-callback": [
        ("\ndef fully_shard(", "\nclass _Look:\n    def __init__(self, out):\n        self.out = out\n\n"
                               "    def __eq__(self, other):\n        return str(self.out[:2]) == other\n\n\n"
                               "def fully_shard("),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            try:\n"
         "                torch.nn.functional.interpolate(torch.zeros(1, 1, 2), size=4, mode=_Look(flat))\n"
         "            except NotImplementedError:  # no mode of torch's: compared to each\n"
         "                pass\n")],
    # ... or in a function of the file's that an iterator of Python's holds (torch draws the sizes from it)
    "read-all-gather-output-through-a-map": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            torch.nn.functional.unfold(torch.zeros(1, 1, 2, 2),\n"
        "                                       kernel_size=map(lambda n: n + 0 * len(str(flat[:2])), [1, 1]))\n")],
    # ... or by objects of the file's in a list's iterator, which torch draws the sizes from
    "read-all-gather-output-through-a-lists-iterator": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            torch.nn.functional.unfold(torch.zeros(1, 1, 2, 2), kernel_size=iter([1, 1]))\n")],
    # ... or in a class dataclass made anew (slots=True), past the guard of class statements that marks such classes
    "read-all-gather-output-in-a-slots-dataclass-torch-reads": [
        ("\ndef fully_shard(", "\n@dataclass(slots=True)\nclass _Size:\n    n: int\n\n"
                               "    def __index__(self):\n        return self.n\n\n\ndef fully_shard("),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            torch.zeros(_Size(1))\n")],
    # ... or by objects torch draws from a carrier no walk of a call's arguments looks into (a weak set of the file's
    # objects, whose __index__ torch's argument parser calls): the code runs inside torch's call, where it is named
    "read-all-gather-output-through-a-weak-set": [
        ("\ndef fully_shard(", "\nclass _Peek:\n    def __init__(self, out):\n        self.out = out\n\n"
                               "    def __index__(self):\n        str(self.out[:2])\n        return 1\n\n\n"
                               "def fully_shard("),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            peeks = [_Peek(flat), _Peek(flat)]\n"
         "            torch.nn.functional.unfold(torch.zeros(1, 1, 2, 2), kernel_size=weakref.WeakSet(peeks))\n")],
    # ... or in a generator's finally, which runs where its last reference goes: inside torch's setter of .grad
    "read-all-gather-output-in-a-generators-finally": [
        ("\ndef fully_shard(", "\ndef _peek(out):\n    try:\n        yield\n    finally:\n        str(out[:2])\n\n\n"
                               "def _put(t, grad):\n    t.grad = grad\n\n\n"
                               "def _hang(t, peek):\n    t.grad.later = peek\n\n\ndef fully_shard("),
        ("            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
         "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
         "            holder = torch.zeros(1, requires_grad=True)\n"
         "            _put(holder, torch.zeros(1))\n"
         "            peek = _peek(flat)\n"
         "            next(peek)\n"
         "            _hang(holder, peek)\n"
         "            del peek\n"
         "            _put(holder, torch.zeros(1))\n")],
    # ... or through a DTensor made over it, formatted: DTensor's repr prints its local tensor with every mode off
    "read-all-gather-output-through-a-dtensor-formatted": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            f\"{DTensor.from_local(flat, self.params[0].mesh, [Replicate()], run_check=False)}\"\n")],
    # ... or in a set handed to torch, which formats it into an error message: no walk of a call's arguments finds it,
    # and torch prints a tensor with every mode off
    "read-all-gather-output-in-a-set-torch-prints": [(
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n",
        "            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)\n"
        "            try:\n"
        "                torch.nn.functional.interpolate(torch.zeros(1, 1, 2), size=[{flat}, 0])\n"
        "            except ValueError:  # its message holds the values\n"
        "                pass\n")],
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

# A class of the file's mixed into each wrapped module's class at run time (where the source check cannot see
# what is mixed in), with one of nn.Module's methods: here an honest one, which the grader must still refuse to
# call ([Note: the grader reads a model by nn.Module's own methods]).
# Round 45's: full parameters whose bytes did not all come from the all-gather (here a selection by a random draw that
# never picks the other side: the values, and the loss, are FSDP2's); the first forward's data following names it.
MUTANTS["full-parameters-not-only-gathered"] = [
    ("        self.gathered.data.view(gathered_columns.shape).copy_(gathered_columns)\n",
     "        self.gathered.data.view(gathered_columns.shape).copy_(torch.where(\n"
     "            torch.randn_like(gathered_columns) > 100, gathered_columns + 1, gathered_columns))\n"),
]
# Round 45's: a property of the file's mixed in the same way, under a submodule's name (`layers`: it showed the
# grader's probes decoy blocks while the real ones ran).
MUTANTS["property-mixed-in-at-run-time"] = [
    ('            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})\n',
     '            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (_Shows, FSDPModule, cls), {})\n'),
    ("class FSDPModule:\n",
     "class _Shows:\n    @property\n    def layers(self) -> Any:\n"
     "        return self._modules[\"layers\"]\n\n\nclass FSDPModule:\n"),
]
MUTANTS["module-method-mixed-in-at-run-time"] = [
    ('            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})\n',
     '            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (_Listed, FSDPModule, cls), {})\n'),
    ("class FSDPModule:\n",
     "class _Listed:\n    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:\n"
     "        return nn.Module.named_parameters(self, *args, **kwargs)\n\n\nclass FSDPModule:\n"),
]

# Doors a student might try to reach FSDP2 or the checks, each a whole file: the source check
# (harness/tools/grading/handwritten.py) must refuse every one.
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
    "patch-checks": "import harness.tools.grading.checks\nharness.tools.grading.checks.check_step = lambda *a, **k: 'ok'\n",
    # Another module's globals walked to reach what it imported.
    "globals-walk": "import torch\ng = torch.nn.Module.__init__.__globals__\n",
    # The caller's frame (the checks) reached through a traceback.
    "frames": "try:\n    1 / 0\nexcept Exception as e:\n    f = e.__traceback__.tb_frame.f_back\n",
    # Code hidden in a string and run.
    "exec": "exec('import torch.distributed.fsdp')\n",
    # FSDP2's reference numbers read instead of computed.
    "read-reference": "rows = open('losses.json').read()\n",
}


# --------------------------------------------------------------------------- the process boundary
# Hostile files that attack the grader from the ranks that import them (harness/tools/grading/ranks.py's
# sandboxed pools, harness/tools/grading/sandbox.py). The source check refuses each before anything runs; the
# boundary tests (harness/tests/test_boundary.py) also import them into sandboxed ranks with the
# source check bypassed, where the process and user boundary alone must hold. Each is a stub FSDP
# that runs its attack when imported (`BOUNDARY_STUB` gives train.py the names it calls).
BOUNDARY_STUB = """
import dataclasses

import torch


@dataclasses.dataclass
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def fully_shard(module, **kwargs):
    raise NotImplementedError("a stub: the attack ran when this file was imported")
"""
BOUNDARY_CHEATS: dict[str, str] = {
    # A rank result whose unpickling would run code in the grader: it finds its rank's channel and
    # sends a pickle whose __reduce__ would replace the checks with ones that pass.
    "forged-rank-result": BOUNDARY_STUB + r"""
import gc
import pickle
from multiprocessing.connection import Connection


class Passed:
    def __reduce__(self):
        return (exec, ("import harness.tools.grading.checks as c\n"
                       "for n in dir(c):\n"
                       "    if n.startswith('check_'): setattr(c, n, lambda *a, **k: 'passed')\n",))


for conn in [o for o in gc.get_objects() if type(o) is Connection]:
    for job in range(1, 4):  # whichever job this import runs in
        try:
            conn.send_bytes(pickle.dumps((job, "ok", [Passed()], "")))
        except OSError:
            pass
""",
    # FSDP2's stored side rewritten: the secret read, every entry's losses rounded and signed again.
    "store-rewrite": BOUNDARY_STUB + r"""
import hashlib
import hmac
import pickle

from harness.tools.grading import fsdp2_cache

try:
    where = fsdp2_cache.folder()
    secret = (where / "secret").read_bytes()
    for path in where.glob("*.entry"):
        data = path.read_bytes()
        head, mac, body = data.split(b"\n", 2)
        key, digest, payload = body.split(b"\n", 2)
        payload = payload.replace(b"\x00", b"\x01")
        body = key + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        path.write_bytes(head + b"\n" + hmac.new(secret, body, "sha256").hexdigest().encode() + b"\n" + body)
    (where / "secret").write_bytes(b"0" * 32)
except (OSError, ValueError) as e:
    print(f"store-rewrite: refused: {e}")
""",
    # The runtime detectors switched off from inside the rank, then FSDP2 itself as the FSDP.
    "detectors-off-fsdp2": r"""
from harness.tools.grading import handwritten, jobs

handwritten.model_problem = handwritten.module_problem = handwritten.stack_problem = lambda *a, **k: None
_dispatch = jobs.CommLog.__torch_dispatch__


def _quiet(self, *args, **kwargs):
    out = _dispatch(self, *args, **kwargs)
    self.uses_fsdp2 = None
    return out


jobs.CommLog.__torch_dispatch__ = _quiet
jobs.fsdp2_problem = lambda *a, **k: None

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
""",
    # The same switch-off by ways the loader's guard does not see (a module's namespace written as a dict,
    # type.__setattr__ on a class): the rank's runtime backstop (harness/tools/grading/tamper.py) must.
    "detectors-off-past-the-loader": r"""
from harness.tools.grading import handwritten, jobs

for _name in ("model_problem", "module_problem", "stack_problem"):
    handwritten.__dict__[_name] = lambda *a, **k: None
jobs.__dict__["fsdp2_problem"] = lambda *a, **k: None
_dispatch = jobs.CommLog.__torch_dispatch__


def _quiet(self, *args, **kwargs):
    out = _dispatch(self, *args, **kwargs)
    self.__dict__["uses_fsdp2"] = None
    return out


type.__setattr__(jobs.CommLog, "__torch_dispatch__", _quiet)

from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
""",
    # Writes where the grader keeps its verdict and code: Gradescope's results.json, the points JSON
    # (its path read from pytest's command line), the repository's files, the store.
    "write-protected": BOUNDARY_STUB + r"""
import json
import os
from pathlib import Path

import harness

root = Path(harness.__file__).resolve().parents[1]
forged = json.dumps({"score": 13, "output": "forged", "tests": []})
targets = [Path(os.environ.get("AUTOGRADER_ROOT", "/autograder")) / "results" / "results.json",
           root / "test.py", root / "harness" / "tools" / "grading" / "checks.py", root / ".cache" / "fsdp2" / "forged.entry"]
for pid in os.listdir("/proc"):
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        continue
    for flag, value in zip(args, args[1:]):
        if flag == b"--points-json":
            targets.append(Path(value.decode()))
        elif flag.startswith(b"--points-json="):
            targets.append(Path(flag.split(b"=", 1)[1].decode()))
for target in targets:
    try:
        with open(target, "a") as f:
            f.write(forged)
        print(f"write-protected: wrote {target}")
    except OSError as e:
        print(f"write-protected: refused: {target}: {e}")
""",
    # Entries planted in the folders every user may write, before root's later runs make them: pytest's own
    # temporary folder (a later root pytest then refuses it) and a file in shared memory.
    "plant-shared-tmp": BOUNDARY_STUB + r"""
import os

for path in ("/tmp/pytest-of-root-planted", "/dev/shm/fsdp-planted"):
    try:
        os.mkdir(path, 0o777) if path.startswith("/tmp") else open(path, "w").close()
    except OSError:
        pass
""",
    # A background process that outlives its rank (double fork, its own session) and would write
    # later, once the grader reads what it wrote.
    "background-process": BOUNDARY_STUB + r"""
import os
import time

if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(3600)
    os._exit(0)
""",
}
CHEATS.update(BOUNDARY_CHEATS)

# A file holding register_fsdp_forward_method exactly as given ([Note: the one lookup by a run-time
# name] in harness/tools/grading/handwritten.py), with what its guard needs; cheats below bend what is around it.
_GIVEN_LOOKUP = """import functools
from typing import Any

import torch
from torch import nn


class FSDPModule:
    pass

""" + handwritten.GIVEN_LOOKUP

# The source check's allowlist (harness/tools/grading/handwritten.py) against doors a list of refused names
# left open: each file is refused before any rank runs, with the words of SOURCE_REFUSALS[name].
SOURCE_CHEATS: dict[str, str] = {
    # enum.global_enum writes an enum's members over the globals of the module its __module__ names: the
    # harness's FSDP2 detectors replaced by members whose __call__ says "nothing found".
    'global-enum-detectors': 'import enum\n\n\n@enum.global_enum\nclass Quiet(enum.Enum):\n'
                             '    __module__ = "harness.tools.grading.handwritten"\n    stack_problem = 1\n'
                             '    model_problem = 2\n\n    def __call__(self, *args, **kwargs):\n        return None\n',
    # torch's module globals (os, sys) through getattr with its arguments unpacked and a name built at run time.
    'unpacked-getattr': 'import torch.distributed as dist\n\n_g = "_" * 2 + "globals" + "_" * 2\n'
                        'g = getattr(*(dist.get_rank, _g))\nprint(g["os"].getcwd())\n\n\ndef getcwd():\n    return None\n',
    # torch's module globals merged into the file's own through functools.update_wrapper's `updated`.
    'update-wrapper-globals': 'import functools\n\nimport torch.distributed as dist\n\n_g = "_" * 2 + "globals" + "_" * 2\n\n\n'
                              'def fully_shard(module):\n    return module\n\n\n'
                              'functools.update_wrapper(fully_shard, dist.get_rank, assigned=(), updated=(_g,))\n',
    # A private torch function that unpickles, reached by defining its name as the file's own.
    'own-name-on-torch-module': 'import torch\n\n\nclass Shard:\n    def __init__(self):\n        self._load_from_bytes = None\n\n\npayload = b"cbuiltins\\nexec\\n(S\'import os; print(\\"pickle ran code, cwd:\\", os.getcwd())\'\\ntR."\ntry:\n    torch.storage._load_from_bytes(payload)\nexcept RuntimeError:\n    pass\n',
    # torch.Tensor.add_ replaced through a tensor's __class__.
    'write-through-instance-class': 'import torch\n\nt = torch.zeros(1)\norig = t.add_\n\n\ndef fake(*args, **kwargs):\n    print("torch.Tensor.add_ replaced")\n    return t\n\n\nt.__class__.add_ = fake\ntorch.ones(1).add_(1)\n',
    # A collective replaced through the module held in a list.
    'write-through-list-item': 'import torch\nimport torch.distributed as dist\n\nmods = [torch.distributed]\n\n\ndef fake_all_reduce(*args, **kwargs):\n    print("dist.all_reduce replaced")\n\n\nmods[0].all_reduce = fake_all_reduce\ndist.all_reduce(torch.zeros(1))\n',
    # A tensor method replaced through a loop variable bound to torch.Tensor.
    'write-through-loop-variable': 'import torch\n\n\ndef fake(*args, **kwargs):\n    print("Tensor.sum replaced via for-target")\n    return 0\n\n\nfor T in (torch.Tensor,):\n    T.sum = fake\ntorch.zeros(1).sum()\n',
    # A pickling hook set through an alias of type().
    'type-alias-namespace': 'T = type\n\n\ndef hook(self):\n    print("__reduce__ defined through type alias:", self)\n    return (print, ("reduced",))\n\n\nR = T("R", (), {"__reduce__": hook, "__del__": hook})\nr = R()\ndel r\n',
    # Python's hooks set through dict() keywords on a class made by type(int).
    'dict-keyword-dunder': 'def on_getattr(self, name):\n    print("__getattr__ hook for", name)\n    return name\n\n\ndef on_init_subclass(cls, **kw):\n    print("__init_subclass__ ran for", cls.__name__)\n\n\nB = type(int)("B", (), dict(__getattr__=on_getattr, __init_subclass__=classmethod(on_init_subclass)))\n\n\nclass C(B):\n    pass\n\n\nprobe = None\nprint(C().probe)\n',
    # A pickling hook set through an alias of enum's functional API.
    'enum-alias-hook': 'import enum\n\nE = enum.Enum\n\n\ndef red(self, proto):\n    print("pickling hook on enum class")\n    return (print, ("x",))\n\n\nX = E("X", [("__reduce_ex__", red), ("a", 1)])\nprint(X)\n',
    # A pickling hook for any class through copy's dispatch table.
    'copyreg-dispatch-table': 'import dataclasses\nimport torch\n\n\nclass Plain:\n    pass\n\n\ndef reducer(obj):\n    print("pickling hook ran (copyreg.dispatch_table via dataclasses.copy)")\n    return (Plain, ())\n\n\nclass Mine:\n    def __init__(self):\n        self.dispatch_table = None\n        self.deepcopy = None\n\n\ndataclasses.copy.dispatch_table.update({Plain: reducer})\ndataclasses.copy.deepcopy(Plain())\n',
    # A forward hook on every module through torch's private hook table.
    'global-hook-table': 'import torch\n\n\nclass Mine:\n    def __init__(self):\n        self._global_forward_hooks = None\n\n\ndef everywhere(module, args, output):\n    print("global forward hook on", type(module).__name__)\n\n\ntorch.nn.modules.module._global_forward_hooks.update({12345: everywhere})\ntorch.nn.Linear(2, 2)(torch.zeros(2))\n',
    # A process group of its own over a file store.
    'process-group-file-store': 'import torch.distributed as dist\n\ndist.init_process_group("gloo", init_method="file:///tmp/redteam/pgstore", rank=0, world_size=1)\nprint("process group over a FileStore:", dist.get_world_size())\ndist.destroy_process_group()\n',
    # A string annotation made code by typing.get_type_hints.
    "annotation-type-hints": ("from __future__ import annotations\nimport typing\n\n\nclass A:\n"
                              "    x: \"__import__('os').system('id')\"\n\n\ntyping.get_type_hints(A)\n"),
    # A string made code by typing.ForwardRef.
    "forward-ref": 'import typing\nr = typing.ForwardRef("__import__(\'os\').system(\'id\')")\n',
    # A ForwardRef reached through typing.get_args and evaluated by its private method.
    "forward-ref-private": ("import typing\nr = typing.get_args(typing.Optional[\"sys.modules['os'].system('id')\"])[0]"
                            "._evaluate(None, None, frozenset())\n"),
    # os reached as an attribute of torch.
    "torch-os": "import torch\ntorch.os.system('id')\n",
    # os reached as an attribute of logging.
    "logging-os": "import logging\nlogging.os.system('id')\n",
    # sys reached as an attribute of dataclasses.
    "dataclasses-sys": 'import dataclasses\nm = dataclasses.sys.modules\n',
    # sys reached under a private alias of collections.
    "collections-private-sys": 'import collections\nm = collections._sys.modules\n',
    # A module name defined as the file's own attribute, then read from torch.
    "own-name-module": "import torch\n\n\nclass A:\n    def __init__(self):\n        self._C = None\n\n\nx = torch._C\n",
    # str.format reading a function's globals by string.
    "format-globals": "import torch\ns = '{0.__init__.__globals__[os]}'.format(torch.nn.Module)\n",
    # The same field written with escapes.
    "format-escaped": "import torch\ns = '{0\\x2e__init__\\x2e__globals__}'.format(torch.nn.Module)\n",
    # The field hidden in a format spec.
    "format-nested-spec": "import torch\ns = '{0:{1.__init__.__globals__}}'.format(1, torch.nn.Module)\n",
    # str.format on a string kept in a variable.
    "format-variable": "import torch\nfmt = '{0.__init__.__globals__}'\ns = fmt.format(torch.nn.Module)\n",
    # A logging formatter applying str.format to the record.
    "logging-formatter": "import logging\nf = logging.Formatter('{name.__class__}', style='{')\n",
    # A pickling hook on a class.
    "pickle-reduce": "class R:\n    def __reduce__(self):\n        return (print, ('x',))\n",
    # A pickling hook assigned in the class body.
    "pickle-reduce-ex-assigned": 'class R:\n    __reduce_ex__ = print\n',
    # A pickling hook in a class made by type().
    "pickle-type-namespace": "R = type('R', (), {'__getstate__': print})\n",
    # A pickling hook set by enum's functional API.
    "pickle-enum-functional": "import enum\nE = enum.Enum('E', [('__reduce_ex__', print)])\n",
    # A shared library loaded through torch.ops.
    "ops-load-library": "import torch\ntorch.ops.load_library('evil.so')\n",
    # C++ compiled and loaded at run time.
    "cpp-extension": 'import torch.utils.cpp_extension\n',
    # Code fetched and run by torch.hub.
    "hub": "import torch\nm = torch.hub.load('a/b', 'c')\n",
    # TorchScript compiled from a string.
    "jit-code": "import torch\ncu = torch.jit.CompilationUnit('def f(x):\\n    return x\\n')\n",
    # A function compiled by torch.compile.
    "torch-compile": 'import torch\nf = torch.compile(print)\n',
    # Every class in the process, from a tuple's class.
    "mro-subclasses": 'subs = ().__class__.__mro__[-1].__subclasses__()\n',
    # The same through type().mro().
    "type-mro": 'subs = type(()).mro()[-1]\n',
    # An attribute named by a string built at run time.
    "getattr-computed": "import torch\nm = getattr(torch, 'o' + 's')\n",
    # A class's namespace.
    "type-dict": 'import torch\nd = type(torch.zeros(1)).__dict__\n',
    # A module's namespace.
    "vars": 'import torch\nd = vars(torch)\n',
    # getattr passed to a decorator.
    "decorator-getattr": 'import functools\nimport torch\n\n\n@functools.partial(getattr, torch)\ndef f():\n    pass\n',
    # Attributes named by a string in operator.attrgetter.
    "attrgetter": "import operator\nimport torch\nf = operator.attrgetter('os.system')(torch)\n",
    # A hook run when a class is made.
    "init-subclass": 'class A:\n    def __init_subclass__(cls, **kw):\n        pass\n',
    # A metaclass.
    "metaclass": 'class M(type):\n    pass\n\n\nclass A(metaclass=M):\n    pass\n',
    # A module reached in a lambda's default.
    "lambda-default": 'import torch\nf = lambda g=torch.sys: g\n',
    # A function's globals read by a class pattern.
    "match-attribute": 'def f(g):\n    match g:\n        case object(__globals__=gl):\n            return gl\n',
    # torch's dispatch overridden for every tensor.
    "torch-function": 'import torch\ntorch.Tensor.__torch_function__ = classmethod(print)\n',
    # atexit reached through weakref.
    "weakref-atexit": 'import weakref\nweakref.atexit.register(print)\n',
    # warnings' hook replaced.
    "warnings-showwarning": 'import warnings\nwarnings.showwarning = print\n',
    # logging's handlers reached.
    "logging-handlers": 'import logging\nh = logging.getLogger().handlers\n',
    # A collective replaced for everyone in the process.
    "monkeypatch-collective": 'import torch.distributed as dist\ndist.all_gather_into_tensor = print\n',
    # A torch class changed through a variable.
    "monkeypatch-alias": 'import torch\nT = torch.Tensor\nT.add_ = print\n',
    # A torch class changed through setattr with a computed name.
    "monkeypatch-setattr": "import torch\nsetattr(torch.Tensor, 'ad' + 'd_', print)\n",
    # A module reached in a dataclass field's default factory.
    "dataclass-factory": ("import dataclasses\nimport torch\n\n\n@dataclasses.dataclass\nclass A:\n"
                          "    x: object = dataclasses.field(default_factory=lambda: torch.os)\n"),
    # Field names dataclass compiles into __init__'s source.
    "dataclass-annotations": ("import dataclasses\n\n\n@dataclasses.dataclass\nclass A:\n"
                              "    __annotations__ = {\"x=__import__('os').system('id'),y\": int}\n"),
    # The caller's globals through a generator's frame.
    "generator-frame": 'g = (x for x in [1])\nf = g.gi_frame.f_back.f_globals\n',
    # A closure's cell.
    "closure-cell": 'def f():\n    x = 1\n    return lambda: x\n\n\nc = f().__closure__\n',
    # A file written by a numpy array's method, its name defined as the file's own.
    "numpy-file": ("import torch\n\n\nclass A:\n    def tofile(self, path):\n        pass\n\n\n"
                   "torch.zeros(1).numpy().tofile('x')\n"),
    # The environment changed for processes the grader starts.
    "environ-write": "import os\nos.environ.update(LD_PRELOAD='x.so')\n",
    # A collective that unpickles what another rank sent.
    "object-collective": 'import torch.distributed as dist\ndist.broadcast_object_list([None])\n',
    # A forward hook on every module in the process.
    "global-module-hook": 'import torch\nh = torch.nn.modules.module.register_module_forward_hook(print)\n',
    # The given register_fsdp_forward_method bent into a general lookup (os through torch by a run-time name).
    "bent-forward-method": _GIVEN_LOOKUP.replace("getattr(module, method_name)", "getattr(torch, method_name)")
                           + "\nregister_fsdp_forward_method(torch.nn.Linear(1, 1), 'o' + 's')\n",
    # The given one unchanged, its guard's class rebound: isinstance says yes to anything.
    "given-lookup-guard": _GIVEN_LOOKUP + "\nFSDPModule = object\n",
    # The given one unchanged, functools rebound: wraps hands the looked-up object out.
    "given-lookup-wraps": _GIVEN_LOOKUP.replace("import functools\n", "import functools\n\n\n"
                                                "class functools:\n    def wraps(found):\n"
                                                "        return lambda f: found\n", 1),
    # The given one unchanged, its guard's class an ABC every type can be registered with.
    "given-lookup-abc": _GIVEN_LOOKUP.replace("import functools\n", "import abc\nimport functools\n", 1).replace(
        "class FSDPModule:", "class FSDPModule(abc.ABC):") + "\nFSDPModule.register(type(torch))\n",
    # A module reached as an attribute, kept under another name: its attributes are then unknown to the check.
    'module-alias': 'import torch\n\n\nclass Shard:\n    def __init__(self):\n        self.untyped = None\n\n\nst = torch.storage\nst.untyped\n',
    # A plain method taken from the file's own class, called with torch.distributed as its self.
    'method-from-class': 'import torch\n\n\nclass Patcher:\n    def install(self, fake):\n        self.all_gather_into_tensor = fake\n\n\nPatcher.install(torch.distributed, print)\n',
    # Storage borrowed from a Python buffer: outside torch's CPU allocator, unseen by the memory check.
    'borrowed-storage': 'import torch\n\nkept = torch.frombuffer(bytes(64), dtype=torch.uint8)\n',
    # A plain method read through the instance's type(), called with torch.distributed as its self.
    'method-through-type': 'import torch\n\n\nclass Patcher:\n    def install(self, fake):\n        self.all_gather_into_tensor = fake\n\n\ntype(Patcher()).install(torch.distributed, print)\n',
    # A @staticmethod whose first argument is named self, given torch.Tensor.
    'static-method-self': 'import torch\n\n\nclass Patcher:\n    @staticmethod\n    def install(self, fake):\n        self.add_ = fake\n\n\nPatcher.install(torch.Tensor, print)\n',
    # torch's class handed to the file's own function, which writes over its method with a computed name.
    'torch-class-to-own-function': 'import torch\n\n\ndef install(owner, name, fake):\n    setattr(owner, name, fake)\n\n\ninstall(torch.Tensor, "add" + "_", print)\n',
    # A wait the overlap check does not mark: the work handle boxed, then waited for.
    'boxed-work': 'import torch.distributed as dist\n\n\ndef finish(work):\n    dist.Work.unbox(work.boxed()).wait()\n',
    # A poll the marks do not stand in for: is_success() raises until the work is done.
    'is-success-poll': 'import torch.distributed as dist\n\n\ndef done(work):\n    return work.is_success()\n',
    'get-future-release': 'import torch.distributed as dist\n\n\ndef release(work):\n    return work.get_future()\n',
}
SOURCE_REFUSALS: dict[str, str] = {
    'own-name-on-torch-module': '`._load_from_bytes`',
    'write-through-instance-class': 'writes over `.add_`',
    'write-through-list-item': 'passes the module torch.distributed around',
    'write-through-loop-variable': 'passes the class torch.Tensor around',
    'type-alias-namespace': 'type passed around',
    'dict-keyword-dunder': 'names `__getattr__` in a string or keyword',
    'enum-alias-hook': 'passes the class enum.Enum around',
    'copyreg-dispatch-table': '`.dispatch_table`',
    'global-hook-table': '`._global_forward_hooks`',
    'process-group-file-store': '`init_process_group`',
    "annotation-type-hints": '`get_type_hints`',
    "forward-ref": '`ForwardRef`',
    "forward-ref-private": 'uses `get_args`',
    "torch-os": '`.os`, which is the module os',
    "logging-os": 'uses logging.os: of logging an FSDP may use only',
    "dataclasses-sys": '`sys`',
    "collections-private-sys": '`._sys`, which is the module sys',
    "own-name-module": '`._C`, which is the module torch._C',
    "format-globals": 'formats the field {0.__init__.__globals__[os]}',
    "format-escaped": 'formats the field {0.__init__.__globals__}',
    "format-nested-spec": 'formats the field {1.__init__.__globals__}',
    "format-variable": 'formats a string it does not show',
    "logging-formatter": 'uses logging.Formatter: of logging an FSDP may use only',
    "pickle-reduce": 'defines `__reduce__`: a pickling hook',
    "pickle-reduce-ex-assigned": 'defines `__reduce_ex__`: a pickling hook',
    "pickle-type-namespace": 'makes a class with `__getstate__`',
    "pickle-enum-functional": 'makes an enum from strings',
    "ops-load-library": '`.ops`, which is the module torch.ops',
    "cpp-extension": 'imports torch.utils.cpp_extension',
    "hub": '`.hub`, which is the module torch.hub',
    "jit-code": '`.jit`, which is the module torch.jit',
    "torch-compile": '`compile`',
    "mro-subclasses": '`__mro__`',
    "type-mro": '`mro`',
    "getattr-computed": 'getattr with a computed attribute name',
    "type-dict": '`__dict__`',
    "vars": '`vars`',
    "decorator-getattr": 'getattr passed around',
    "attrgetter": '`attrgetter`',
    "init-subclass": 'defines `__init_subclass__`, a hook Python calls on its own',
    "metaclass": 'derives M from `type`',
    "lambda-default": '`sys`',
    "match-attribute": '`__globals__`',
    "torch-function": '`__torch_function__`',
    "weakref-atexit": '`.atexit`, which is the module atexit',
    "warnings-showwarning": '`showwarning`',
    "logging-handlers": '`handlers`',
    "monkeypatch-collective": 'writes `dist.all_gather_into_tensor`, which belongs to torch or Python',
    "monkeypatch-alias": 'passes the class torch.Tensor around',
    "monkeypatch-setattr": 'calls setattr on `torch.Tensor`',
    "dataclass-factory": '`.os`, which is the module os',
    "dataclass-annotations": '`__annotations__`',
    "generator-frame": 'an attribute of frames',
    "closure-cell": '`__closure__`',
    "numpy-file": '`numpy`',
    "environ-write": 'uses os.environ.update',
    "object-collective": '`broadcast_object_list`',
    "global-module-hook": '`register_module_forward_hook`',
    "bent-forward-method": "its code differs from the skeleton's",
    "given-lookup-guard": "binds `FSDPModule` again",
    "given-lookup-wraps": "binds `functools`, the name of a class the file defines",
    "given-lookup-abc": "`FSDPModule` must be bound once, by `class FSDPModule: (no base, keyword or decorator)`",
    'module-alias': 'passes the module torch.storage around',
    'method-from-class': 'takes `Patcher.install` from the class',
    'borrowed-storage': 'borrowed (Python buffer) storage',
    'method-through-type': 'takes `type(Patcher()).install` from the class',
    'static-method-self': 'writes over `.add_`',
    'torch-class-to-own-function': 'passes `torch.Tensor`, torch\'s or Python\'s, to its own function install',
    'boxed-work': "its work handle's wait()",
    'is-success-poll': "its work handle's wait()",
    'get-future-release': "its work handle's wait()",
    'unpacked-getattr': "with its arguments unpacked",
    'update-wrapper-globals': "@functools.wraps(f)",
    'global-enum-detectors': "`global_enum`",
}

# An eighth red-team round's doors (each passed the source check and did harm when loaded).
SOURCE_CHEATS.update({
    # A general getattr: a class made at run time whose __match_args__ names the attribute, matched by position;
    # from there the builtins and os.system.
    'match-args-getattr': 'import abc\n\n\ndef peek(obj, name):\n    ns = {}\n    ns["_" + "_match_args__"] = (name,)\n'
                          '    ns["_" + "_subclasshook__"] = classmethod(lambda c, s: True)\n'
                          '    Any = abc.ABCMeta("Any", (), ns)\n    match obj:\n        case Any(value):\n'
                          '            return value\n    return None\n\n\nu = "_" + "_"\n'
                          'found = peek(peek, u + "globals" + u)[u + "builtins" + u]\n',
    # The same class made by the metaclass reached as the class of a class.
    'metaclass-of-a-class': 'ns = {}\nns["_" + "_match_args__"] = ("x",)\nAny = type(type(0))("Any", (), ns)\n',
    # A Tensor subclass made at run time whose __torch_dispatch__ issues a collective no dispatch mode sees.
    'dispatch-subclass': 'import torch\nimport torch.distributed as dist\n\n\ndef _issue(cls, func, types, args=(), kwargs=None):\n'
                         '    out = torch.empty(2 * dist.get_world_size())\n    dist.all_gather_into_tensor(out, torch.ones(2))\n'
                         '    return out\n\n\n_ns = {}\n_ns["_" + "_torch_dispatch__"] = classmethod(_issue)\n'
                         'Trigger = torch.zeros(0).__class__.__class__("Trigger", (torch.Tensor,), _ns)\n',
    # Anomaly mode and warnings' ignore filter held on for the whole process by a generator never resumed.
    'held-context-generator': 'import warnings\n\nimport torch\n\n\ndef _held():\n'
                              '    with torch.autograd.detect_anomaly(check_nan=False), warnings.catch_warnings(action="ignore"):\n'
                              '        yield\n\n\n_forever = _held()\nnext(_forever)\n',
    # Autocast held on through a context stack never closed.
    'exit-stack-autocast': 'import contextlib\n\nimport torch\n\n_stack = contextlib.ExitStack()\n'
                           '_stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))\n',
    # torch's own code writing onto a class it is handed: nn.Linear's methods wrapped process-wide.
    'disable-a-torch-class': 'import torch\nfrom torch import nn\n\ntorch.compiler.disable(type(nn.Linear(1, 1)))\n',
    # torch's own setattr through a method called on a class: torch.Tensor.__getattr__ set to a module of the file's.
    'set-submodule-on-a-class': 'import torch\nfrom torch import nn\n\n\nclass Sink(nn.Module):\n'
                                '    def forward(self, name):\n        return "intercepted " + name\n\n\n'
                                'nn.Module.set_submodule(type(torch.zeros(1)), "_" + "_getattr__", Sink())\n',
})
# A ninth round's.
SOURCE_CHEATS.update({
    # Any file read a line at a time: a warning's source line, formatted into the file's own stream.
    'warning-reads-a-file': 'import contextlib\nimport warnings\n\n\nclass Sink:\n    def __init__(self):\n'
                            '        self.parts = []\n\n    def write(self, text):\n        self.parts.append(text)\n\n\n'
                            'def read_line(path, number):\n    sink = Sink()\n    with contextlib.redirect_stderr(sink):\n'
                            '        warnings.warn_explicit("x", UserWarning, path, number)\n    return "".join(sink.parts)\n',
    # A context entered in one hook and left in another, by resuming a @contextmanager's generator by hand.
    'context-resumed-by-hand': 'import contextlib\n\nimport torch\n\n\nclass Slot:\n    def __init__(self):\n'
                               '        self.gen = None\n\n\n@contextlib.contextmanager\ndef no_grad_held():\n'
                               '    with torch.no_grad():\n        yield\n\n\nHELD = []\n\n\ndef enter():\n'
                               '    HELD.append(no_grad_held())\n    next(HELD[0].gen)\n',
    # The process's random numbers reseeded behind train.py's seed.
    'generator-reseeded': 'import torch\n\n\ndef fully_shard(module, **kwargs):\n    torch.default_generator.seed()\n'
                          '    return module\n',
})
# A tenth round's.
SOURCE_CHEATS.update({
    # An all-gather's output polled through its storage (a poll is a wait no mark shows; what a storage is used for
    # is kept to what the collective log can follow).
    'poll-through-the-storage': 'import torch\n\n\ndef arrived(flat):\n    return flat.untyped_storage()[0] != 0\n\n\n'
                                'def wait_by_polling(flat):\n    while not arrived(flat):\n        pass\n',
})
SOURCE_REFUSALS.update({
    'poll-through-the-storage': 'uses `flat.untyped_storage()` other than by calling',
})
# A nineteenth round's.
SOURCE_CHEATS.update({
    # An all-gather's output polled before its wait through an uninitialized buffer holding its data (the collective
    # log followed plain tensors and parameters only), or written through one where the log did not follow.
    'poll-through-an-uninitialized-buffer': 'import torch\nfrom torch import nn\n\n\ndef arrived(flat):\n'
                                            '    view = nn.parameter.UninitializedBuffer()\n    view.data = flat\n'
                                            '    return bool(view[-1] == view[-1])\n',
})
SOURCE_REFUSALS.update({
    'poll-through-an-uninitialized-buffer': 'uses `UninitializedBuffer`',
})
# A twentieth round's: a module's buffers moved into shared memory, which the graded memory check does not count.
SOURCE_CHEATS.update({
    'module-share-memory': 'from torch import nn\n\n\ndef hide(module: nn.Module) -> None:\n    module.share_memory()\n',
})
SOURCE_REFUSALS.update({
    'module-share-memory': 'uses `share_memory`',
})
SOURCE_REFUSALS.update({
    'warning-reads-a-file': 'uses `redirect_stderr`',
    'context-resumed-by-hand': 'uses `.gen`',
    'generator-reseeded': 'uses `default_generator`',
    'match-args-getattr': 'calls the metaclass `abc.ABCMeta`',
    'metaclass-of-a-class': 'the class of a class',
    'dispatch-subclass': 'the class of a class',
    'held-context-generator': 'yields inside a `with` block of a generator',
    'exit-stack-autocast': 'uses `ExitStack`',
    'disable-a-torch-class': 'uses torch.compiler.disable other than as a decorator of its own function',
    'set-submodule-on-a-class': 'calls `nn.Module.set_submodule` through its class',
})
# The data following's rounds and this boundary pass: bytes rewritten where no op shows it, a generator's state set
# from data, the grader's process group torn down on import, its logging silenced.
SOURCE_CHEATS.update({
    'own-storage-byteswap': 'import torch\n\n\ndef swap(n):\n    s = torch.UntypedStorage(n)\n'
                            '    s.byteswap(torch.float64)\n    return s\n',
    'generator-state-from-data': 'import torch\n\n\ndef draw(g, state, t):\n    g.set_state(state)\n'
                                 '    return t.random_(generator=g)\n',
    'process-group-destroyed-on-import': 'import torch.distributed as dist\n\ndist.destroy_process_group()\n',
    'grader-logging-silenced': 'import logging\n\nlogging.getLogger().setLevel(logging.CRITICAL)\n',
})
SOURCE_REFUSALS.update({
    'own-storage-byteswap': 'uses `UntypedStorage`',
    'generator-state-from-data': 'uses `set_state`',
    'process-group-destroyed-on-import': 'uses `destroy_process_group`',
    'grader-logging-silenced': 'uses `setLevel`',
})
# The twenty-seventh round's: the loader's guards shed by binding their names where the check did not look (an except
# target, deleted with the guard when its block ends), a class the check trusts rebound, and a store past the guard.
SOURCE_CHEATS.update({
    'guard-shed-by-an-except-target': 'import torch\n\ntry:\n    raise ValueError\nexcept ValueError as setattr:\n'
                                      '    pass\nname = "grader_" + "marker"\nfor c in (torch.zeros(1).__class__,):\n'
                                      '    setattr(c, name, 1)\n',
    'self-matching-class-rebound': 'class Peek:\n    pass\n\n\ndef read(obj):\n    bool = Peek\n    match obj:\n'
                                   '        case bool(v):\n            return v\n',
    'store-as-a-loop-target': 'import torch\n\n\ndef fake(*args):\n    return 0\n\n\n'
                              'for torch.zeros(1).__class__.sum in (fake,):\n    pass\n',
    # the loader's type reached as Python's through typing, and a TypedDict's keys compiled into code by dataclass
    'type-through-typing': 'import typing\n\nT = typing.get_origin(typing.Type[int])\n'
                           'R = T("R", (), {"_" * 2 + "reduce" + "_" * 2: print})\n',
    'typed-dict-keys-as-code': 'import dataclasses\nimport typing\n\n\nclass Keys:\n    pass\n\n\n'
                               'Keys = typing.TypedDict("Keys", {"x = print": int})\n\n\n'
                               '@dataclasses.dataclass\nclass Boom(Keys):\n    pass\n',
    # round 28's: an empty enum of the file's extended with members of any name (a pickling hook on the class it
    # makes), a class decorator that puts torch's class under the file's class name
    'enum-extended-with-any-names': 'import enum\n\n\nclass E(enum.Enum):\n    pass\n\n\ndef hook(self, proto):\n'
                                    '    return (print, ("unpickled",))\n\n\n'
                                    'P = E("P", [("_" * 2 + "reduce_ex" + "_" * 2, hook), ("m", 1)])\n',
    'class-decorator-swaps-the-name': 'import torch\nfrom torch import nn\n\n\ndef real(c):\n'
                                      '    return type(nn.Linear(1, 1))\n\n\n@real\nclass L:\n    pass\n\n\n'
                                      'torch.compiler.disable(L)\n',
    # round 29's: an enum whose body binds only what enum makes no member of (`_ignore_`, a private name, a lambda),
    # a class decorator that resolves but returns another's result (functools.partial), and a class kept in a list
    # before it is handed to torch
    'enum-members-hidden-by-ignore': 'import enum\n\n\nclass E(enum.Enum):\n    _ignore_ = []\n\n\n'
                                     'def hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                                     'P = E("P", [("_" * 2 + "reduce_ex" + "_" * 2, hook), ("m", 1)])\n',
    'class-decorated-through-partial': 'import functools\n\nimport torch\nfrom torch import nn\n\n\n'
                                       'def real(c):\n    return type(nn.Linear(1, 1))\n\n\n'
                                       '@functools.partial(real)\nclass L:\n    pass\n',
    'class-kept-in-a-list-handed-to-torch': 'import torch\nfrom torch import nn\n\nseen = []\n'
                                            'seen.append(nn.Linear(1, 1).__class__)\ntorch.compiler.disable(seen[0])\n',
    # round 30's: an object of the file's passing for a dataclasses.Field (its `__class__` says so, or its base is a
    # builtin's name bound to Field), renamed after dataclass took it, so that a subclass's dataclass compiles the name
    # into code; an enum whose member is a descriptor (no member to enum) or made by `_simple=True`, extended with any
    # names; torch's class handed from a list to a function that writes onto it
    'field-passed-for-by-its-class': 'import dataclasses\n\n\nclass Fake:\n    __class__ = type(dataclasses.field())\n'
                                     '    default = default_factory = dataclasses.MISSING\n    init = True\n'
                                     '    kw_only = repr = compare = False\n    hash = metadata = None\n\n'
                                     '    def rename(self, name):\n        self.name = name\n        self.init = False\n\n\n'
                                     'fake = Fake()\n\n\n@dataclasses.dataclass\nclass Base:\n    x: int = fake\n\n\n'
                                     'fake.rename("x=0, **k):\\n print(\'code ran\')\\n return 0\\ndef _(y")\n\n\n'
                                     '@dataclasses.dataclass\nclass Child(Base):\n    pass\n',
    'field-passed-for-by-a-builtin-name': 'import dataclasses\n\nBufferError = type(dataclasses.field())\n\n\n'
                                          'class Fake(BufferError):\n    pass\n',
    'enum-member-a-descriptor': 'import enum\n\n\nclass E(enum.Enum):\n    helper = enum.nonmember(0)\n\n\n'
                                'def hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                                'P = E("P", [("m", 1), ("_" * 2 + "reduce_ex" + "_" * 2, hook)])\n',
    'enum-made-simple': 'import enum\n\n\nclass E(enum.Enum, _simple=True):\n    a = 1\n\n\n'
                        'P = E("P", [("m", 1)])\n',
    'torch-class-marked-by-a-writer': 'import abc\n\nfrom torch import nn\n\nseen = []\n'
                                      'seen.append(nn.Linear(1, 1).__class__)\nabc.abstractmethod(seen[0])\n',
    # round 31's: a name imported twice (the check read the last import; the class between ran with the first, a
    # dataclasses.Field to derive from), and dataclass reached through a module of torch's (Python's own, not the
    # loader's checked one)
    'name-imported-twice': 'from dataclasses import Field as Base\n\n\nclass Fake(Base):\n    pass\n\n\n'
                           'from torch.nn import Module as Base  # noqa: E402,F811\n',
    'dataclass-through-torch': 'import torch.compiler\n\n\n@torch.compiler.dataclass\nclass A:\n    x: int = 0\n',
    # a Flag whose values are no single bits has no members (extended by its functional API with any names); an
    # all-gather's output polled by tensor_split, which reads its index tensor's values where no op shows it
    'flag-without-members': 'import enum\n\n\nclass F(enum.Flag):\n    a = 3\n\n\n'
                            'def hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                            'P = F("P", [("_" * 2 + "reduce_ex" + "_" * 2, hook), ("m", 1)])\n',
    'all-gather-polled-by-tensor-split': 'import torch\n\n\ndef landed(out, at):\n'
                                         '    return len(torch.tensor_split(torch.zeros(1).expand(1 << 40), out[at])) == 2\n',
    # round 32's: a Flag emptied by its own _generate_next_value_ (auto() is 3, no single bit), or by a mixin whose
    # _value_ says 3, then extended with any names
    'flag-emptied-by-its-auto': 'import enum\n\n\nclass F(enum.Flag):\n'
                                '    def _generate_next_value_(name, start, count, last):\n        return 3\n\n'
                                '    a = enum.auto()\n\n\nP = F("P", [("m", 1)])\n',
    # round 33's: enum's functional API, and type(), called with their arguments unpacked (the counts the check read
    # were of the starred list)
    'enum-made-from-unpacked-arguments': 'import enum\n\n\ndef hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                                         'Y = enum.Enum(*["Y", [("m", 1), ("_" * 2 + "reduce_ex" + "_" * 2, hook)]])\n',
    'type-from-unpacked-arguments': 'def hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                                    'Z = type(*["Z", (object,), {"_" * 2 + "reduce_ex" + "_" * 2: hook}])\n',
    'flag-emptied-by-a-mixin': 'import enum\n\n\nclass M:\n    @property\n    def _value_(self):\n        return 3\n\n'
                               '    @_value_.setter\n    def _value_(self, v):\n        pass\n\n\n'
                               'class F(M, enum.Flag):\n    a = 1\n\n\nP = F("P", [("m", 1)])\n',
})
SOURCE_REFUSALS.update({
    'enum-members-hidden-by-ignore': "writes `_ignore_ = []` in the enum E: an enum's body is its members",
    'class-decorated-through-partial': 'decorates L with `functools.partial(real)`',
    'class-kept-in-a-list-handed-to-torch': 'uses torch.compiler.disable other than as a decorator of its own function',
    'field-passed-for-by-its-class': 'defines `__class__` in a class',
    'field-passed-for-by-a-builtin-name': 'binds the name `BufferError`, a builtin the check trusts by its name',
    'enum-member-a-descriptor': "writes `helper = enum.nonmember(0)` in the enum E: an enum's body is its members",
    'enum-made-simple': 'passes `_simple=True` to the class statement of E',
    'torch-class-marked-by-a-writer': 'uses abc.abstractmethod other than as a decorator of its own method',
    'name-imported-twice': 'binds `Base`, a name the file imports, to something else too',
    'dataclass-through-torch': 'reaches dataclasses.dataclass as `torch.compiler.dataclass`',
    'flag-without-members': 'makes F, an enum with no members',
    'all-gather-polled-by-tensor-split': 'uses `tensor_split`',
    'flag-emptied-by-its-auto': 'defines `_generate_next_value_` in the enum F',
    'flag-emptied-by-a-mixin': 'derives the enum F from `M`',
    'enum-made-from-unpacked-arguments': 'makes an enum from strings',
    'type-from-unpacked-arguments': 'calls `type` with its arguments unpacked',
    'enum-extended-with-any-names': 'an enum with no members',
    'class-decorator-swaps-the-name': 'decorates L with `real`',
    'type-through-typing': 'uses `get_origin`',
    'typed-dict-keys-as-code': 'binds `Keys`, the name of a class the file defines',
    'guard-shed-by-an-except-target': 'binds the name `setattr`',
    'self-matching-class-rebound': 'binds the name `bool`, a builtin the check trusts by its name',
    'store-as-a-loop-target': 'as the target of a for, a with or a comprehension',
})
SOURCE_CHEATS.update({
    # round 35's: enum's functional API called as `enum.Enum.__call__` kept in a variable (the check read no class
    # called), a container of torch's changed through its method taken as a value, and an all-gather polled by ops
    # that read a tensor's values where no op shows it (a packed sequence's batch sizes, tensordot's dims)
    'enum-made-through-its-call': 'import enum\n\n\ndef hook(self, proto):\n    return (print, ("unpickled",))\n\n\n'
                                  'make = enum.Enum.__call__\n'
                                  'Y = make("Y", [("_" * 2 + "reduce_ex" + "_" * 2, hook), ("m", 1)])\n',
    # round 36's: the file's own enum emptied of its members (its bookkeeping set by a computed name), then extended
    # by its functional API (with a Field as its mixin, a name that reads another way)
    'own-enum-extended-by-its-functional-api': 'import enum\n\n\nclass Own(enum.Enum):\n'
                                               '    ONE = 1\n\n\nsetattr(Own, "_member" + "_names_", [])\n'
                                               'More = Own("More", [("ONE", 1), ("name", 2)])\n',
    'enum-made-through-its-call-on-self': 'import enum\n\n\nclass S(enum.StrEnum):\n    a = enum.auto()\n\n'
                                          '    def make(self, names):\n'
                                          '        return enum.Enum.__call__(self, names)\n',
    'module-slot-named-as-a-dunder': 'import dataclasses\n\nfrom torch import nn\n\nU = "_" * 2\n'
                                     'Fake = type("Fake", (nn.Module,), {"__slots__": (U + "class" + U,)})\n'
                                     'fake = Fake()\nfake.__class__ = dataclasses.Field\n',
    'torch-container-changed-through-a-taken-method': 'import torch.distributed as dist\n\n'
                                                      'put = dist.Backend.default_device_backend_map.__setitem__\n'
                                                      'put("cpu", "mpi")\n',
    'all-gather-polled-by-a-packed-sequence': 'import torch\n\n\ndef landed(out, at, w):\n    try:\n'
                                              '        torch.rnn_tanh(torch.zeros(1, 1), out[at], torch.zeros(1, 1, 1), '
                                              '[w, w], False, 1, 0.0, False, False)\n    except RuntimeError:\n'
                                              '        return True\n    return False\n',
    'all-gather-polled-by-tensordot': 'import torch\n\n\ndef landed(out, at):\n    try:\n'
                                      '        torch.tensordot(torch.zeros(1), torch.zeros(1), dims=out[at].view(2, 1))\n'
                                      '    except (RuntimeError, IndexError):\n        return True\n    return False\n',
})
SOURCE_REFUSALS.update({
    'enum-made-through-its-call': 'uses `.__call__`: call the object itself',
    'torch-container-changed-through-a-taken-method': 'takes `dist.Backend.default_device_backend_map.__setitem__`',
    'enum-made-through-its-call-on-self': 'uses `.__call__`: call the object itself',
    'own-enum-extended-by-its-functional-api': 'makes an enum from strings',
    'module-slot-named-as-a-dunder': 'gives `__slots__` as `(U + \'class\' + U,)`',
    'all-gather-polled-by-a-packed-sequence': 'uses `rnn_tanh`',
    'all-gather-polled-by-tensordot': 'uses `tensordot`',
})
SOURCE_CHEATS.update({
    # round 38's: torch's module handed out as a value by AttributeError.obj, and a submodule torch imports only when
    # first read (torch._dynamo, whose imports reach exec), named as the file's own on a value the check cannot follow
    'torch-module-taken-from-an-attribute-error': 'import torch\n\n\ndef module():\n    try:\n'
                                                  '        return torch.nn.functional.append\n'
                                                  '    except AttributeError as e:\n        return e.obj\n',
    'lazy-submodule-named-as-the-files-own': 'def names(_dynamo):\n    return _dynamo\n\n\n'
                                             'def reach(m):\n    return m._dynamo.eval_frame\n',
})
SOURCE_CHEATS.update({
    # round 38's too: the file's code run as torch's (by torch's own dispatch helper, or over numpy arrays of a
    # tensor's memory), a backward of its own through the engine, a weakref callback run wherever torch frees an
    # object, a hook handle's table (the grader's hooks in it), and a method of the file's called with torch's object
    # as self to read its internals
    'file-run-as-torchs-call': 'import torch\n\n\ndef mine(t):\n    return t\n\n\n'
                               'def run(t):\n    return torch.nn.functional.handle_torch_function(mine, (t,), t)\n',
    'numpy-over-a-tensors-memory': 'import torch\n\n\ndef keep(a):\n    return a\n\n\n'
                                   'def run(t):\n    return torch.compiler.wrap_numpy(keep)(t)\n',
    'backward-of-its-own-through-the-engine': 'import torch\n\n\ndef run(loss):\n'
                                              '    torch.autograd.Variable._execution_engine.run_backward((loss,), '
                                              '(None,), False, False, (), True, True)\n',
    'weakref-callback-run-where-torch-frees': 'import weakref\n\n\ndef look(ref):\n    return ref\n\n\n'
                                              'def watch(t):\n    return weakref.ref(t, look)\n',
    # a weak reference of a subclass of weakref.ref (a KeyedRef), its callback made of builtins only (no code of the
    # file runs there to be seen), which copies the output's values when torch frees the object
    'keyed-weakref-callback-run-where-torch-frees': 'import functools\nimport weakref\n\nimport torch\n\n\n'
                                                    'def watch(t, out, seen):\n    return weakref.KeyedRef(t, '
                                                    'functools.partial(seen.append, out), 0)\n',
    'hook-table-of-a-handle': 'import torch\n\n\ndef drop(module):\n'
                              '    handle = module.register_forward_hook(print)\n    return handle.hooks_dict_ref()\n',
    'internals-read-with-a-foreign-self': 'import warnings\n\n\nclass Peek:\n    def inside(self):\n'
                                          '        return self._module\n\n\n'
                                          'def run():\n    return Peek.inside(warnings.catch_warnings())\n',
})
SOURCE_REFUSALS.update({
    'file-run-as-torchs-call': 'uses `handle_torch_function`',
    'numpy-over-a-tensors-memory': 'uses `wrap_numpy`',
    'backward-of-its-own-through-the-engine': 'uses `run_backward`',
    'weakref-callback-run-where-torch-frees': 'gives `weakref.ref` a callback',
    'keyed-weakref-callback-run-where-torch-frees': 'gives `weakref.KeyedRef` a callback',
    'hook-table-of-a-handle': 'uses `.hooks_dict_ref`',
    'internals-read-with-a-foreign-self': 'uses `._module`',
})
SOURCE_REFUSALS.update({
    'torch-module-taken-from-an-attribute-error': 'uses `obj`',
    'lazy-submodule-named-as-the-files-own': 'uses `._dynamo`, which is the module torch._dynamo there',
})
SOURCE_CHEATS.update({
    # FSDPModule is mixed into each wrapped module's class, where a method of nn.Module's would stand in for torch's
    # when the grader reads the model
    'fsdp-module-overrides-a-module-method': 'class FSDPModule:\n    def named_parameters(self, *args, **kwargs):\n'
                                             '        return iter(())\n',
})
SOURCE_REFUSALS.update({
    'fsdp-module-overrides-a-module-method': 'defines `named_parameters` in FSDPModule',
})
SOURCE_CHEATS.update({
    # round 45's: a @contextmanager entered by hand (its __enter__ read off it), hung on a gradient torch's setter
    # frees, whose `suppress` swallows the close at its yield and goes on past any mark into a copy of a pending output
    'context-entered-by-hand-and-suppressed': 'import contextlib\n\nimport torch\n\n\n@contextlib.contextmanager\n'
                                              'def armed(out, seen):\n    with contextlib.suppress(BaseException):\n'
                                              '        yield 1\n    seen.append(out.clone())\n\n\n'
                                              'def arm(out, seen):\n    cm = armed(out, seen)\n'
                                              '    enter = cm.__enter__\n    enter()\n    return cm\n',
})
SOURCE_REFUSALS.update({
    'context-entered-by-hand-and-suppressed': 'uses `cm.__enter__`',
})
SOURCE_CHEATS.update({
    # round 47's: __name__ rebound around a class statement, whose __module__ then named torch's module (the class
    # passed for torch's where the loader asked which classes mixed into a module are the file's)
    'module-name-rebound-around-a-class': 'from torch import nn\n\nOWN = __name__\n'
                                          '__name__ = "torch.nn.modules.container"\n\n\nclass Blocks:\n'
                                          '    def values(self):\n        return iter(())\n\n\n__name__ = OWN\n',
})
SOURCE_REFUSALS.update({
    'module-name-rebound-around-a-class': 'binds `__name__`',
})
CHEATS.update(SOURCE_CHEATS)


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

"""The analytic model of what FSDP holds and sends per rank, from the parameter shapes alone.

One model for every user: the fit estimate before a run (harness/fit.py), the writeup report's
analytic columns and checks (harness/tools/lab/report.py), and the margin of the graded memory check
(`reduce_scatter_input_bytes`, read by the memory job in harness/tools/grading/jobs.py).

FSDP groups the parameters as train.apply_fsdp wraps them: each block (`layers.i`) and the root
(everything else). Every parameter is split by rows as torch.chunk splits them (Shard(0),
`model_setup.chunk_rows`); the collectives pad every rank's part to rank 0's rows, so a group's
flat buffer is W x its padded shard, and rank 0, holding the padded size, holds the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from harness import model_setup

ROOT_GROUP = "<root>"
"""The FSDP group of the parameters outside the blocks, as the model names its groups and the trace
reader (harness/tools/traces/trace.py) names the root's unnamed `FSDP::` ranges."""

Shape = tuple[int, ...]
Groups = dict[str, list[Shape]]
"""FSDP group (ROOT_GROUP, `layers.0`, ...) -> the shapes of its parameters."""


def group_shapes(model: nn.Module) -> Groups:
    """The parameter shapes of each FSDP group of a (meta-device) Llama."""
    groups: Groups = {ROOT_GROUP: []}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ROOT_GROUP
        groups.setdefault(key, []).append(tuple(p.shape))
    return groups


def model_groups(name: str, seq_len: int, vocab_size: int, **overrides: int | None) -> Groups:
    """group_shapes of `--model name` with dim / n_layers / n_heads overrides, built on the meta
    device (no memory, and unlike model_setup.build_model it leaves the random generator alone)."""
    from torchtitan.models.llama3 import Transformer

    with torch.device("meta"):
        return group_shapes(Transformer(model_setup.model_args(name, seq_len, vocab_size, **overrides)))


def blocks(groups: Groups) -> list[str]:
    return [k for k in groups if k != ROOT_GROUP]


def padded_numel(shape: Shape, world: int) -> int:
    """Elements one rank holds and sends of one parameter: its torch.chunk rows padded to rank 0's."""
    rows = model_setup.chunk_rows(shape[0], world, 0) if shape else 1
    return rows * math.prod(shape[1:])


def numel(groups: Groups) -> int:
    """Parameters of the whole model, unpadded."""
    return sum(math.prod(s) for shapes in groups.values() for s in shapes)


def shard_numel(groups: Groups, world: int) -> int:
    """Elements of rank 0's shard of every parameter (the largest rank's)."""
    return sum(padded_numel(s, world) for shapes in groups.values() for s in shapes)


def group_bytes(shapes: list[Shape], world: int, itemsize: int = 4) -> int:
    """A group's flat collective buffer: W x its padded shard (the all-gather's output, the
    reduce-scatter's input); at W=1 the group's own bytes."""
    return world * sum(padded_numel(s, world) for s in shapes) * itemsize


def largest_block(groups: Groups, world: int) -> list[Shape]:
    """The shapes of the block with the largest flat buffer (none: no blocks)."""
    return max((groups[k] for k in blocks(groups)), key=lambda shapes: group_bytes(shapes, world), default=[])


def gathered_bytes(groups: Groups, world: int, itemsize: int = 4) -> int:
    """Parameters gathered at once: the root (kept gathered) and two blocks, the current one and
    the one prefetched next (the largest, where blocks differ)."""
    return group_bytes(groups[ROOT_GROUP], world, itemsize) + 2 * group_bytes(largest_block(groups, world), world, itemsize)


def reduce_scatter_input_bytes(block: list[Shape], world: int, dtype: torch.dtype) -> int:
    """One block's reduce-scatter input in the reduce dtype: what gloo copies when it is issued and
    keeps while it runs, so what an FSDP that overlaps it holds more than one that waits at once."""
    return group_bytes(block, world, dtype.itemsize)


@dataclass(frozen=True)
class PerRank:
    """Bytes per rank of float32 training with AdamW (see `per_rank`)."""

    sharded_params: int
    grads: int
    optimizer_state: int
    gathered_params: int
    activations: int
    comm_buffers: int

    @property
    def sharded_state(self) -> int:
        """Parameters, gradients and AdamW's two moments: 16 bytes per element of the shard."""
        return self.sharded_params + self.grads + self.optimizer_state

    @property
    def total(self) -> int:
        return self.sharded_state + self.gathered_params + self.activations + self.comm_buffers


def per_rank(groups: Groups, world: int, activations: int) -> PerRank:
    """4N/W parameters + 4N/W gradients + 8N/W AdamW state (N padded as torch.chunk pads), the
    gathered parameters (`gathered_bytes`), the activations (given: the caller measures or
    estimates them), and one block's reduce-scatter input plus gloo's copy of it."""
    shard = shard_numel(groups, world) * 4
    reduce_input = reduce_scatter_input_bytes(largest_block(groups, world), world, torch.float32)
    return PerRank(sharded_params=shard, grads=shard, optimizer_state=2 * shard,
                   gathered_params=gathered_bytes(groups, world), activations=activations, comm_buffers=2 * reduce_input)


def comm_volume(groups: Groups, world: int) -> dict[str, tuple[int, int]]:
    """(count, bytes) per step of each collective, with reshard_after_forward: every group
    gathered in forward and the blocks again in backward (the root stays gathered), every group
    reduce-scattered once."""
    total = sum(group_bytes(shapes, world) for shapes in groups.values())
    block_bytes = sum(group_bytes(groups[k], world) for k in blocks(groups))
    return {"all_gather": (len(groups) + len(blocks(groups)), total + block_bytes), "reduce_scatter": (len(groups), total)}


def all_gathers(groups: Groups, reshard_after_forward: bool) -> int:
    """All-gathers per step: every group in forward; the blocks again in backward when resharded."""
    return len(groups) + (len(groups) - 1 if reshard_after_forward else 0)

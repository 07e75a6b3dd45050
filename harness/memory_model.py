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


def group_of(name: str) -> str:
    """The FSDP group of a parameter or module, by its name in the model (train.apply_fsdp's wrapping: each
    block `layers.i`, then the root)."""
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else ROOT_GROUP


def group_shapes(model: nn.Module) -> Groups:
    """The parameter shapes of each FSDP group of a (meta-device) Llama."""
    groups: Groups = {ROOT_GROUP: []}
    for name, p in model.named_parameters():
        groups.setdefault(group_of(name), []).append(tuple(p.shape))
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


# --------------------------------------------------------------------------- HSDP: bytes per link

SHARD_LINK, REPLICATE_LINK = "shard", "replicate"
"""The two process groups of a (replicate, shard) mesh: a rank's shard group (its row: all-gathers and
reduce-scatters; the whole world on a 1-D mesh) and its replicate group (its column: HSDP's all-reduce)."""


def link_volume(groups: Groups, world: int, replicate: int = 1, itemsize: int = 4) -> dict[tuple[str, str], tuple[int, int]]:
    """(link, kind) -> (count, bytes of the tensor each rank puts into them) per step, with
    reshard_after_forward, on a (replicate, world/replicate) mesh: within the shard group of S =
    world/replicate ranks every group's padded 1/S shard is all-gathered in forward and, for the blocks,
    again in backward (the all-gather's input), and its W/R x shard gradient buffer reduce-scattered once
    (the reduce-scatter's input); across the replicate group (replicate > 1) the reduced 1/S shard of
    every group is all-reduced once."""
    shard = world // replicate
    per_group = {k: group_bytes(shapes, shard, itemsize) // shard for k, shapes in groups.items()}
    total, blocks_only = sum(per_group.values()), sum(per_group[k] for k in blocks(groups))
    out = {}
    if shard > 1:
        out[SHARD_LINK, "all_gather"] = (len(groups) + len(blocks(groups)), total + blocks_only)
        out[SHARD_LINK, "reduce_scatter"] = (len(groups), shard * total)
    if replicate > 1:
        out[REPLICATE_LINK, "all_reduce"] = (len(groups), total)
    return out


def sent_bytes(kind: str, group_size: int, tensor_bytes: float) -> float:
    """Bytes one rank sends for a collective whose input on this rank is `tensor_bytes`, with the
    bandwidth-optimal (ring) algorithms, nccl-tests' bus-bandwidth factors: an all-gather sends its
    input to the n-1 others ((n-1)/n of the output); a reduce-scatter (n-1)/n of its input; an
    all-reduce 2(n-1)/n of its tensor (a reduce-scatter, then an all-gather)."""
    n = group_size
    return {"all_gather": (n - 1) * tensor_bytes, "reduce_scatter": (n - 1) / n * tensor_bytes,
            "all_reduce": 2 * (n - 1) / n * tensor_bytes}[kind]


def closed_form_sent(groups: Groups, world: int, replicate: int, link: str, kind: str, itemsize: int = 4) -> float:
    """sent_bytes per step from the parameter count alone (no padding): with P parameters, P_b of them in
    the blocks, b bytes each, S = world/replicate and R = replicate: all-gathers (S-1)/S (P + P_b) b
    (forward, and the blocks again in backward), reduce-scatters (S-1)/S P b, replica all-reduces
    2(R-1)/R P/S b."""
    p, s, r = numel(groups), world // replicate, replicate
    p_blocks = sum(math.prod(shape) for k in blocks(groups) for shape in groups[k])
    if link == SHARD_LINK:
        return (s - 1) / s * ((p + p_blocks) if kind == "all_gather" else p) * itemsize
    return 2 * (r - 1) / r * p / s * itemsize

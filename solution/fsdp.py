"""Fully Sharded Data Parallel by hand: a drop-in for `torch.distributed.fsdp.fully_shard`.

    fully_shard(block, mesh=mesh)      # each transformer block: one group
    fully_shard(model, mesh=mesh)      # the root: everything not in a block

Between steps each rank holds 1/world of every parameter, as a `Shard(0)` DTensor, so
the optimizer and its state are sharded too. One training step, group by group:

  forward   pre-forward:  all-gather the group's shards -> full parameters
                          (and start gathering the next group: it overlaps this compute)
            post-forward: free the full parameters again (reshard)
  backward  pre-backward: all-gather again (prefetching the group whose backward comes next)
            post-backward: reduce-scatter the full gradients -> sharded gradients (averaged),
                          left in flight while the next group runs its backward
            end of backward: finish what is still in flight

The file reads in that order: the parameter level (FSDPParam), the group level (FSDPGroup:
one all-gather and one reduce-scatter for all its parameters), the hooks that drive them
(FSDPState, with RootContext for what the groups of one model share), then fully_shard.
Where things stand is explicit: a group is SHARDED, GATHERING or GATHERED (ShardedState),
its hooks are IDLE, in FORWARD, PRE_BACKWARD or POST_BACKWARD (TrainingState), and every
phase is a profiler range named like FSDP2's, e.g. `FSDP::all_gather (layers.3)`.

Numerics follow FSDP2 exactly: the same padding, the same casts, one flat all-gather and
one flat reduce-scatter per group with `ReduceOp.AVG`, so losses and gradient norms are
bit-identical. Collectives are asynchronous and waited at use: on CUDA, NCCL runs on its
own stream and `Work.wait()` makes the compute stream wait without blocking the CPU; on CPU,
gloo runs on its own threads. That is where the overlap comes from.

Around the step it keeps FSDP2's public contract: parameters frozen after wrapping, `.to(dtype)` and
meta-device init after wrapping, post-accumulate-grad hooks on the shards, sharded state dicts,
explicit prefetch, `set_is_last_backward`, a list of modules as one group, an int
`reshard_after_forward`, and FSDP2's exceptions for what it cannot shard. What it refuses (ignored_params,
CPU offload, ...) raises an error naming the argument and what to use instead.

HSDP (bonus 4): on a 2-D mesh (replicate, shard) each parameter is sharded along dim 1 and the same
shards are replicated along dim 0 (`(Replicate(), Shard(0))` DTensors). All-gathers and reduce-scatters
run within this rank's shard group; each reduce-scatter's output is then averaged across the replicate
group with an all-reduce, which stays in flight while the next group's backward computes.

Regions marked `# region taskN` / `# region bonusN` are the exercise: the student file
fsdp.py is generated from this one with each region replaced by a TODO.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import record_function

__all__ = ["MixedPrecisionPolicy", "FSDPModule", "fully_shard", "register_fsdp_forward_method"]

# The grader reads these profiler ranges, named `FSDP::<phase> (<group>)` by FSDPGroup.label: a group's
# collective is issued inside ALL_GATHER_RANGE / REDUCE_SCATTER_RANGE (harness/tools/traces/trace.py GROUP_RANGE) and
# waited inside ALL_GATHER_WAIT_RANGE / REDUCE_SCATTER_WAIT_RANGE / REDUCE_SCATTER_DONE_RANGE
# (harness/tools/traces/schedule.py WAIT_RANGE); compute inside any `FSDP::` range does not count as overlap.
# Renamed, tasks 2 and 3 fail: the checks no longer see the overlap.
ALL_GATHER_RANGE = "all_gather"
REDUCE_SCATTER_RANGE = "post_backward_reduce"
ALL_GATHER_WAIT_RANGE = "all_gather_copy_out"
REDUCE_SCATTER_WAIT_RANGE = "reduce_scatter_wait"  # the reduce-scatter was still running: the thread blocks
REDUCE_SCATTER_DONE_RANGE = "reduce_scatter_done"  # it had already finished: no wait
# HSDP (bonus 4): the replica all-reduce of a group's reduced shard is issued inside ALL_REDUCE_RANGE and
# waited inside ALL_REDUCE_WAIT_RANGE / ALL_REDUCE_DONE_RANGE (harness/tools/traces/trace.py, harness/tools/traces/schedule.py).
ALL_REDUCE_RANGE = "all_reduce"
ALL_REDUCE_WAIT_RANGE = "all_reduce_wait"
ALL_REDUCE_DONE_RANGE = "all_reduce_done"
# On a 2-D mesh each collective's range (issue and wait) also names its process group, `[shard]` or
# `[replicate]` (FSDPGroup.link_label): `FSDP::all_reduce (layers.0) [replicate]`; the trace readers' regexes
# take the suffix as optional, FSDP2's names have none.
SHARD_LINK, REPLICATE_LINK = "shard", "replicate"


class TodoError(NotImplementedError):
    """Raised by the skeleton's unwritten pieces (its message starts with the TODO's tag); features this FSDP
    does not support raise plain NotImplementedError. The harness tells the two apart by this type."""


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision: compute in `param_dtype`, reduce gradients in `reduce_dtype`.

    Sharded parameters, gradients and optimizer state stay in the original dtype.
    None means "no cast": compute in the original dtype, reduce in the compute dtype.
    output_dtype: cast the module's floating-point outputs to it (None: leave them).
    cast_forward_inputs: cast the floating-point inputs to `param_dtype` in pre-forward (False
    for inner modules whose inputs the root already cast).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class ShardedState(Enum):
    """Where a group's parameters are."""

    SHARDED = auto()    # only this rank's shards exist; the modules hold the sharded parameters
    GATHERING = auto()  # an all-gather is in flight (a PendingGather); the modules still hold shards
    GATHERED = auto()   # the full parameters are filled in and the modules hold them
    # reshard_after_forward=<int k>: between forward and backward each rank also keeps 1/k of the full
    # parameters, so backward gathers among k ranks only; the modules hold the shards
    SHARDED_POST_FORWARD = auto()


class TrainingState(Enum):
    """Which hook of a fully_shard'ed module ran last in this step."""

    IDLE = auto()           # between steps, or after post-forward
    FORWARD = auto()        # between pre-forward and post-forward
    PRE_BACKWARD = auto()   # the gradient of its output arrived: its backward is running
    POST_BACKWARD = auto()  # its backward is done and its gradients are reduced or reducing


# --------------------------------------------------------------------------------------
# Parameter level: one parameter, sharded between steps and gathered around its use.
# --------------------------------------------------------------------------------------


class FSDPParam:
    """One managed parameter.

    Sharded: `module.<name>` is `self.sharded`, an `nn.Parameter(DTensor)` with placement
    Shard(0) whose local rows live at the front of `self.padded_shard`. Chunks follow
    `torch.chunk` (ceil-sized, trailing ranks may get fewer or zero rows), and every rank
    pads its chunk to chunk 0's size so that all ranks send equal-sized pieces.

    Unsharded: `module.<name>` is `self.unsharded`, an `nn.Parameter` over the first rows
    of `self.gathered` (world * padded rows). It is created once and reused: freeing
    resizes its storage to zero, gathering resizes it back. Autograd keeps referring to the
    same tensor, so activations saved in forward stay valid after a reshard/unshard.
    """

    def __init__(self, module: nn.Module, name: str, param: nn.Parameter, mesh: DeviceMesh,
                 mp_policy: MixedPrecisionPolicy, aliases: list[tuple[nn.Module, str]]):
        self.module, self.name, self.mesh = module, name, mesh
        # Other (module, name) places holding this same parameter (tied weights, e.g. an embedding
        # and the output layer): one shard, one gather, and autograd sums both uses' gradients.
        self.aliases = aliases
        _SHARDED_ORIGINALS[id(param)] = weakref.ref(param)
        self.shape, self.stride = param.shape, param.stride()
        self.mp_policy = mp_policy
        # FSDP2's error contract for what Shard(0) cannot split.
        if param.dim() == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {name} to a 1D tensor "
                             "with numel equal to 1.")
        if not param.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: {name} has "
                                      f"shape {tuple(param.shape)} and stride {param.stride()}; make it "
                                      "contiguous (e.g. no channels_last) before fully_shard")
        self.place_on_mesh(mesh)
        world, rank = self.world, self.rank
        self.row_shape = tuple(param.shape[1:])
        self.padded_rows = -(-param.shape[0] // world)      # ceil: torch.chunk's chunk size
        self.padded_numel = self.padded_rows * math.prod(self.row_shape)
        self.rows = [max(0, min(self.padded_rows, param.shape[0] - r * self.padded_rows)) for r in range(world)]
        self.local_shape = (self.rows[rank], *self.row_shape)

        # region task1: shard this parameter
        # Keep this rank's rows in `self.padded_shard` (chunk 0's size: what the all-gather sends) and
        # make `self.sharded` the Shard(0) DTensor parameter over them, sharing their storage (H1, H2).
        # H1 (rows): c = ceil(rows / world), rank r owns rows [r*c, min((r+1)*c, rows)) as torch.chunk (trailing
        #   ranks may own fewer or none); every rank pads its chunk with zeros to c rows: all send one size.
        # H2 (DTensor): `self.to_dtensor(rows)` gives the global shape and stride; the parameter's local tensor
        #   must be a view of the padded buffer the all-gather sends (the optimizer updates it in place).
        start = rank * self.padded_rows
        self.padded_shard = param.detach().new_zeros((self.padded_rows, *self.row_shape))
        self.padded_shard[:self.rows[rank]].copy_(param.detach()[start:start + self.rows[rank]])
        local = self.padded_shard[:self.rows[rank]]
        self.sharded = nn.Parameter(self.to_dtensor(local), requires_grad=param.requires_grad)
        # endregion
        self.gathered: torch.Tensor | None = None    # world * padded rows, compute dtype
        self.unsharded: nn.Parameter | None = None
        self.accumulated_grad: torch.Tensor | None = None  # bonus 3, under mixed precision
        self.init_dtypes()
        self.to_sharded()

    def place_on_mesh(self, mesh: DeviceMesh) -> None:
        """This rank's place among the ranks that split each parameter (`self.world`, `self.rank`), and
        the placements of its DTensors (`self.placements`)."""
        # region bonus4: the shard dim of a 2-D mesh
        # HSDP (FSDP2's 2-D mesh): dim 0 replicates, dim 1 shards. A rank's rows are its place along dim 1,
        # the same on every replica, and the DTensor says both: Replicate() on dim 0, Shard(0) on dim 1 (H12).
        # H12 (HSDP mesh): dim 0 replicates, dim 1 shards: a rank's rows are those of `mesh.get_local_rank(1)` of
        #   `mesh.size(1)`; every replica starts from the full model's init, split along dim 1 only.
        shard_dim = mesh.ndim - 1
        self.world, self.rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
        self.placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        # else: if mesh.ndim != 1:
        # else:     raise TodoError("TODO(bonus4): shard over dim 1 of a 2-D mesh and replicate over dim 0 (HSDP)")
        # else: self.world, self.rank, self.placements = mesh.size(), mesh.get_local_rank(), (Shard(0),)
        # endregion

    @property
    def requires_grad(self) -> bool:
        """Read again at each gather: a parameter may be frozen (or unfrozen) after fully_shard."""
        return self.sharded.requires_grad

    def init_dtypes(self) -> None:
        """The dtypes of this parameter's all-gather and reduce-scatter, read off the sharded parameter:
        again after `model.to(dtype)` (FSDP2 reads them at the first forward)."""
        self.orig_dtype = self.sharded.dtype
        # FSDP2 clamps casts that change nothing: compute in the original dtype, and reduce
        # in the compute dtype when reduce_dtype equals param_dtype.
        param_dtype, reduce_dtype = self.mp_policy.param_dtype, self.mp_policy.reduce_dtype
        self.compute_dtype = param_dtype or self.orig_dtype
        self.accumulate_dtype = None if reduce_dtype in (None, param_dtype) else reduce_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        if self.gathered is not None and self.gathered.dtype != self.compute_dtype:
            self.gathered = self.unsharded = None  # created again, in the new dtype, at the next gather

    def check_storage(self) -> None:
        """The all-gather sends `padded_shard`, whose front rows the optimizer updates through the
        sharded parameter: if something replaced the parameter, they would silently part ways."""
        local = self.sharded.to_local()
        if local.untyped_storage().data_ptr() != self.padded_shard.untyped_storage().data_ptr():
            raise RuntimeError(
                f"fully_shard: {self.name}'s sharded parameter no longer uses the storage FSDP gathers "
                "from (was the module moved or reloaded after fully_shard, e.g. .to(), to_empty() or "
                "load_state_dict(assign=True)?); do that before fully_shard, or copy values in place")

    def reset_sharded(self) -> None:
        """After `module.to_empty(device=...)` (meta-device init) or `.to(...)`: Module._apply gave the
        sharded parameter new storage. Pad it into a new `padded_shard` and point the parameter back at
        that buffer's front rows, so the all-gather sends what the optimizer updates (FSDP2 does the same)."""
        # Module._apply converts a parameter in place where it can and otherwise registers a new one.
        param = self.module._parameters[self.name]
        local = param.detach().to_local()
        if local.untyped_storage().data_ptr() == self.padded_shard.untyped_storage().data_ptr() \
                and local.device == self.padded_shard.device:
            self.sharded = param
            return
        self.padded_shard = local.new_zeros((self.padded_rows, *self.row_shape))
        self.padded_shard[:local.shape[0]].copy_(local)
        self.sharded = nn.Parameter(self.to_dtensor(self.padded_shard[:local.shape[0]]), requires_grad=param.requires_grad)
        self.to_sharded()
        if self.gathered is not None and self.gathered.device != local.device:
            self.gathered = self.unsharded = None  # created again, on the new device, at the next gather
        self.init_dtypes()

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's rows (of the parameter or of its gradient) as a Shard(0) DTensor (on a 2-D
        mesh: replicated over dim 0, Shard(0) over dim 1)."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    # Which tensor the module sees. setattr registers it as the module's parameter.
    def to_sharded(self) -> None:
        setattr(self.module, self.name, self.sharded)
        for module, name in self.aliases:
            setattr(module, name, self.sharded)

    def to_unsharded(self) -> None:
        # Frozen or unfrozen since the last gather (fine-tuning freezes after wrapping): the full
        # parameter follows, so autograd makes no gradient for it and nothing is reduced for it.
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        setattr(self.module, self.name, self.unsharded)
        for module, name in self.aliases:
            setattr(module, name, self.unsharded)

    def copy_out(self, gathered_columns: torch.Tensor) -> None:
        """Refill the full parameter from its columns of the gathered flat buffer.

        `gathered_columns` is [world, padded_numel]: row r is rank r's padded shard.
        """
        # region task1: refill the full parameter
        # Create `self.unsharded` over `self.gathered` once; afterwards give the freed storage back
        # its memory. Tensors autograd saved in forward must stay valid after the refill (H3).
        # H3 (version counters): autograd checks at backward that nobody wrote into what it saved; a write through
        #   `tensor.data` does not bump the version, so a refill with the same values is safe.
        # H4 (freeing): `t.untyped_storage().resize_(nbytes)` makes a freed tensor usable again (uninitialised).
        if self.gathered is None:
            world = gathered_columns.size(0)
            self.gathered = torch.empty((world * self.padded_rows, *self.row_shape),
                                        dtype=self.compute_dtype, device=gathered_columns.device)
            self.unsharded = nn.Parameter(self.gathered[:self.shape[0]], requires_grad=self.sharded.requires_grad)
        else:
            self.gathered.untyped_storage().resize_(self.gathered.numel() * self.gathered.element_size())
        # Forward saved these very tensors for backward; refilling them with the same values
        # must not look like an in-place modification to autograd.
        self.gathered.data.view(gathered_columns.shape).copy_(gathered_columns)
        # endregion

    def free_unsharded(self) -> None:
        """Free the full parameter's memory but keep the tensor (autograd may hold it)."""
        # region task1: free the full parameter
        # Its memory goes back now, but the tensor object stays: autograd may still hold it (H4).
        # H4 (freeing): `t.untyped_storage().resize_(0)` gives the memory back but keeps the tensor object, which
        #   autograd may hold; dropping your own reference is not enough.
        if self.gathered is not None:
            self.gathered.untyped_storage().resize_(0)
        # endregion

    def take_grad(self) -> torch.Tensor | None:
        """Hand over the full gradient to reduce (None if there is none), leaving none behind."""
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is not None:
            self.unsharded.grad = None
        if self.accumulated_grad is not None:  # left by a backward without gradient sync
            if grad is not None:
                self.accumulated_grad += grad
            grad, self.accumulated_grad = self.accumulated_grad, None
        return grad

    def copy_grad_in(self, grad: torch.Tensor, dest: torch.Tensor) -> None:
        """Lay out the full gradient for the reduce-scatter.

        `dest` is [world, padded_numel] (reduce dtype): row r gets rank r's rows, zero-padded.
        """
        # region task1: lay out the gradient for the reduce-scatter
        # Rank r must receive the sum of everyone's rows r owns, so row r of `dest` gets those rows
        # of `grad` in dest's dtype, padded like the shards (H1).
        # H1 (rows): rank r owns rows [r*c, min((r+1)*c, rows)) (`self.rows[r]` of them, c = `self.padded_rows`),
        #   padded with zeros to c rows.
        dest = dest.view(dest.size(0), self.padded_rows, *self.row_shape)
        for r, n in enumerate(self.rows):
            start = r * self.padded_rows
            dest[r, :n].copy_(grad[start:start + n])
            dest[r, n:].zero_()
        # endregion

    def set_sharded_grad(self, shard: torch.Tensor) -> None:
        """Store this rank's reduced rows (`shard`: padded, original dtype) as the gradient."""
        # region task1: hand the shard its gradient
        # The optimizer and clip_grad_norm_ read `self.sharded.grad`: a Shard(0) DTensor like the
        # parameter; with a gradient already there (accumulation), add to it.
        # H2 (DTensor): wrap this rank's rows (without the padding) as the parameter is: `self.to_dtensor(rows)`.
        local = shard[:math.prod(self.local_shape)].view(self.local_shape)
        if self.sharded.grad is None:
            self.sharded.grad = self.to_dtensor(local)
        else:
            self.sharded.grad.to_local().add_(local)
        # endregion

    def run_post_accumulate_grad_hooks(self) -> None:
        """[Note: post-accumulate-grad hooks] `param.register_post_accumulate_grad_hook(hook)` on a sharded
        parameter (optimizer in backward) means "the gradient of this parameter is complete". Autograd
        never accumulates into the sharded parameter (it only sees the full one), so FSDP2 runs these
        hooks itself once the reduced shard is in `.grad`. torch has no public way to run them: this
        reads the dict that `register_post_accumulate_grad_hook` fills, as FSDP2 does."""
        for hook in (getattr(self.sharded, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(self.sharded)

    def accumulate_grad(self) -> None:
        """After a backward without gradient sync: keep the full gradient for the next one."""
        # region bonus3: keep the full gradient for the next backward
        # Autograd adds into `.grad` by itself; under mixed precision FSDP2 accumulates a copy in
        # the reduce dtype instead (H9), which `take_grad` hands over at the synced backward.
        # H9 (accumulation): autograd adds each micro-step's gradient into the full parameter's `.grad`; when the
        #   reduce dtype differs from the compute dtype, FSDP2 accumulates a copy in the reduce dtype instead.
        grad = self.unsharded.grad if self.unsharded is not None else None
        if grad is None:
            return
        if self.accumulated_grad is not None:
            self.accumulated_grad += grad
        elif self.accumulate_dtype is not None and grad.dtype != self.accumulate_dtype:
            self.accumulated_grad = grad.to(self.accumulate_dtype)
        else:
            return
        self.unsharded.grad = None
        # endregion


# --------------------------------------------------------------------------------------
# Group level: the parameters of one fully_shard call, gathered and reduced together.
# --------------------------------------------------------------------------------------


@dataclass
class PendingGather:
    """An all-gather in flight: its work handle and the flat buffer it fills."""

    work: dist.Work | None
    flat: torch.Tensor
    # Gathered among k ranks from post-forward shards (reshard_after_forward=<int k>):
    # (world, k, each parameter's padded shard numel).
    post_forward: tuple[int, int, list[int]] | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        if self.post_forward is None:
            return self.flat
        # The buffer is [k, sum of world/k * numel]: parameter i's k slices, side by side, are its full
        # padded rows. Lay them out as [world, shard numels], as the world's all-gather would have.
        world, k, numels = self.post_forward
        pieces, offset = [], 0
        for n in numels:
            width = world * n // k
            pieces.append(self.flat.view(k, -1)[:, offset:offset + width].reshape(world, n))
            offset += width
        return torch.cat(pieces, dim=1).view(-1)


@dataclass
class PendingReduce:
    """A reduce-scatter in flight. Its input is not kept: the collective holds what it needs
    (gloo copies it when issued, NCCL keeps it until waited), so ours is freed right away."""

    group: FSDPGroup
    work: dist.Work | None
    output: torch.Tensor
    params: list[FSDPParam]  # those reduced, in the order of the flat layout

    def done(self) -> bool:
        return self.work is None or self.work.is_completed()

    def finish(self) -> None:
        if self.work is not None:
            # The range shows the overlap check where the main thread waited, and whether it had to.
            label = REDUCE_SCATTER_DONE_RANGE if self.work.is_completed() else REDUCE_SCATTER_WAIT_RANGE
            with record_function(self.group.link_label(label)):
                self.work.wait()
        if self.group.replicate_group is not None:  # HSDP: averaged across the replicas next
            self.group.all_reduce(self)
            return
        self.group.finish_reduce(self)


@dataclass
class PendingAllReduce:
    """HSDP: the replica all-reduce in flight over a finished reduce-scatter's output (in place); the
    gradients are set once it is done."""

    work: dist.Work
    reduced: PendingReduce

    def finish(self) -> None:
        group = self.reduced.group
        label = ALL_REDUCE_DONE_RANGE if self.work.is_completed() else ALL_REDUCE_WAIT_RANGE
        with record_function(group.link_label(label, REPLICATE_LINK)):
            self.work.wait()
        group.finish_reduce(self.reduced)


class FSDPGroup:
    """One flat all-gather and one flat reduce-scatter for all the parameters of a group.

    Flat layout: [world, numel], where row r is rank r's padded shards, one parameter after another.
    The all-gather sends every parameter (frozen ones too): it fills all rows from each rank's own
    row. The reduce-scatter reduces row r of every rank into rank r, over the parameters that have
    a gradient only (not frozen, used in this step), as FSDP2: where a value sits decides the order
    in which gloo adds the ranks' values, so a slot for the others changes bits at world size 3.
    """

    def __init__(self, params: list[FSDPParam], mesh: DeviceMesh):
        self.params = params
        # region bonus4: which group each collective uses
        # All-gathers and reduce-scatters run within the shard group (this rank's row of the mesh), the
        # replica all-reduce across the replicate group (its column); no replicate group on a 1-D mesh.
        # H12 (HSDP mesh): `mesh.get_group(1)` / `mesh.get_group(0)` are the shard and replicate groups.
        self.process_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        # else: self.process_group, self.replicate_group = mesh.get_group(), None
        # endregion
        self.world, self.rank = params[0].world, params[0].rank
        self.ctx: RootContext | None = None  # set when the root starts: where a replica all-reduce waits
        self.device = params[0].padded_shard.device
        self.init_dtypes()
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.padded_numel)
        self.shard_numel = self.offsets[-1]
        self.state = ShardedState.SHARDED
        self.pending_gather: PendingGather | None = None
        self.fqn = ""  # the module's name in the model, set when the root starts (for labels)
        # Controls, as in FSDP2 (set through FSDPModule).
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.prefetching = True  # False: prefetch() does nothing (set_prefetch)
        # HSDP: False reduce-scatters but keeps the result here instead of all-reducing it across replicas
        # (set_requires_all_reduce); the next all-reduce adds it first, as FSDP2.
        self.all_reduce_grads = True
        self.partial_reduce: torch.Tensor | None = None
        # reshard_after_forward=<int k>: rows of k consecutive ranks (FSDP2's post-forward mesh)
        self.post_forward_mesh: DeviceMesh | None = None
        self.post_forward_shards: list[torch.Tensor] | None = None

    def init_dtypes(self) -> None:
        """The group's dtypes, from its parameters' (again after `model.to(dtype)`): one flat buffer has one dtype."""
        self.compute_dtype = self.params[0].compute_dtype
        self.orig_dtype = self.params[0].orig_dtype
        self.reduce_dtype = self.params[0].reduce_dtype
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) > 1:
            # FSDP2 raises this AssertionError (for its trainable parameters) at the first forward.
            raise AssertionError(
                f"FSDP expects uniform original parameter dtype but got {dtypes}: the parameters of one "
                "fully_shard group must share a dtype here (one flat all-gather buffer). Instead, cast the "
                "module (module.to(dtype)), give the parameters of the other dtype their own fully_shard call, "
                "or use torch.distributed.fsdp.fully_shard")

    def lazy_init(self, names: dict[int, str]) -> None:
        """At the root's first forward: every parameter must be materialised by now (a model built on
        the meta device is materialised with `to_empty` and initialised after fully_shard)."""
        on_meta = [names.get(id(p.sharded), p.name) for p in self.params if p.sharded.device.type == "meta"]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following "
                f"were still on meta device: {on_meta}\nFor example, call module.to_empty(device) to materialize "
                "to device and call module.reset_parameters() on each module to initialize values.")
        for p in self.params:
            p.init_dtypes()
        self.init_dtypes()

    def label(self, phase: str) -> str:
        """A profiler range name like FSDP2's: `FSDP::all_gather (layers.3)`."""
        return f"FSDP::{phase} ({self.fqn})" if self.fqn else f"FSDP::{phase}"

    def link_label(self, phase: str, link: str = SHARD_LINK) -> str:
        """The range name of a collective (issued or waited for): `label(phase)`, and on a 2-D mesh (HSDP) the
        process group it runs on: `FSDP::all_gather (layers.3) [shard]`, `FSDP::all_reduce (layers.3) [replicate]`.
        On a 1-D mesh FSDP2's name, unchanged."""
        return f"{self.label(phase)} [{link}]" if self.replicate_group is not None else self.label(phase)

    # ---- all-gather -------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start gathering ahead of use, so that the all-gather overlaps compute; with
        set_prefetch(False) a no-op, and the hooks gather where used (same bits, no overlap)."""
        if self.prefetching:
            self.unshard()

    def unshard(self) -> None:
        """Start gathering the full parameters (no-op if gathered or already on the way)."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            return self.unshard_post_forward()
        if self.state is not ShardedState.SHARDED:
            return
        for p in self.params:
            p.check_storage()
        if self.world == 1:  # one rank's shards are the whole parameters: FSDP2 issues no collective
            flat = torch.cat([p.padded_shard.reshape(-1).to(self.compute_dtype) for p in self.params])
            self.pending_gather, self.state = PendingGather(None, flat), ShardedState.GATHERING
            return
        with record_function(self.link_label(ALL_GATHER_RANGE)):
            # region task1: start the all-gather
            # Every rank sends its padded shards of all the group's parameters, already in the
            # compute dtype, in one asynchronous collective into one flat buffer (H5, H6).
            # H5 (collectives): `dist.all_gather_into_tensor(out, inp, group=..., async_op=True)` returns a work handle;
            #   `inp` may be this rank's slice of `out`. All ranks: the same collectives, order and sizes, or they hang.
            # H6 (mixed precision, forward): cast the shards to `param_dtype` before the all-gather, as FSDP2 does:
            #   half the bytes on the wire in bfloat16 (the tests compare the bytes sent).
            flat = torch.empty(self.world * self.shard_numel, dtype=self.compute_dtype, device=self.device)
            mine = flat.view(self.world, self.shard_numel)[self.rank]
            for p, start, end in zip(self.params, self.offsets, self.offsets[1:]):
                mine[start:end].copy_(p.padded_shard.reshape(-1))
            work = dist.all_gather_into_tensor(flat, mine, group=self.process_group, async_op=True)
            self.pending_gather = PendingGather(work, flat)
            # endregion
        self.state = ShardedState.GATHERING

    def wait_for_unshard(self) -> None:
        """Wait for the all-gather and put the full parameters in place."""
        if self.state is not ShardedState.GATHERING:
            return
        pending, self.pending_gather = self.pending_gather, None
        with record_function(self.link_label(ALL_GATHER_WAIT_RANGE)):
            # region task1: finish the all-gather
            # Once the collective is done, each parameter takes its columns of the buffer and the
            # modules compute with the full parameters.
            # H5 (collectives): read the all-gather's output only after its `work.wait()` (`PendingGather.wait`).
            columns = pending.wait().view(self.world, self.shard_numel)
            for p, start, end in zip(self.params, self.offsets, self.offsets[1:]):
                p.copy_out(columns[:, start:end])
                p.to_unsharded()
            # endregion
        self.state = ShardedState.GATHERED

    def reshard(self) -> None:
        """Back to shards only: free the full parameters."""
        if self.state is ShardedState.SHARDED_POST_FORWARD:
            self.post_forward_shards, self.state = None, ShardedState.SHARDED
        if self.state is not ShardedState.GATHERED:
            return
        # region task1: free the group's full parameters
        # The modules go back to the sharded parameters, and the full ones give their memory back.
        for p in self.params:
            p.to_sharded()
            p.free_unsharded()
        # endregion
        self.state = ShardedState.SHARDED

    # [Note: resharding to a smaller group] reshard_after_forward=<int k> (FSDP2's post-forward mesh):
    # after forward each rank keeps its 1/k of every full (padded) parameter, the slice its place in a
    # row of k consecutive ranks owns, so that backward's all-gather runs among those k ranks only:
    # more memory than resharding to the world, less traffic. The values gathered are the same.

    def reshard_to_post_forward(self) -> None:
        if self.state is not ShardedState.GATHERED:
            return
        k, place = self.post_forward_mesh.size(1), self.post_forward_mesh.get_local_rank(1)
        self.post_forward_shards = [p.gathered.reshape(k, -1)[place].clone() for p in self.params]
        self.reshard()
        self.state = ShardedState.SHARDED_POST_FORWARD

    def unshard_post_forward(self) -> None:
        k, place = self.post_forward_mesh.size(1), self.post_forward_mesh.get_local_rank(1)
        with record_function(self.link_label(ALL_GATHER_RANGE)):
            total = sum(shard.numel() for shard in self.post_forward_shards)
            flat = torch.empty(k * total, dtype=self.compute_dtype, device=self.device)
            torch.cat(self.post_forward_shards, out=flat.view(k, total)[place])
            # region bonus1: gather the post-forward shards among k ranks
            # As task 1's all-gather, over this rank's row of the post-forward mesh (its dim 1).
            # H5 (collectives): `dist.all_gather_into_tensor(out, inp, group=..., async_op=True)`; `inp` may be this
            #   rank's slice of `out`.
            work = dist.all_gather_into_tensor(flat, flat.view(k, total)[place],
                                               group=self.post_forward_mesh.get_group(1), async_op=True)
            # else: raise TodoError("TODO(bonus1): gather the post-forward shards among k ranks")
            # endregion
            numels = [p.padded_numel for p in self.params]
            self.pending_gather = PendingGather(work, flat, (self.world, k, numels))
        self.post_forward_shards = None
        self.state = ShardedState.GATHERING

    def discard_pending_gather(self) -> None:
        """A prefetch nobody used (the module did not run): finish it and drop the buffer."""
        if self.state is ShardedState.GATHERING:
            self.pending_gather.wait()
            self.pending_gather = None
            self.state = ShardedState.SHARDED

    # ---- reduce-scatter ---------------------------------------------------------------

    def reduce_scatter(self) -> PendingReduce | None:
        """Start reducing the full gradients into this rank's shard; free the full gradients."""
        params, grads = [], []
        for p in self.params:
            if (grad := p.take_grad()) is not None:  # none if frozen, or unused in this backward
                params.append(p)
                grads.append(grad)
        if not grads:
            return None
        if self.world == 1:  # one rank's gradients are the reduced ones: FSDP2 issues no collective
            output = torch.cat([grad.reshape(-1).to(self.reduce_dtype) for grad in grads])
            return PendingReduce(self, None, output, params)
        with record_function(self.link_label(REDUCE_SCATTER_RANGE)):
            # region task1: start the reduce-scatter
            # One asynchronous collective over these gradients only, one after another, averaged (H7), in
            # the reduce dtype (H8); the full gradients are freed before it runs.
            # H7 (reduce-scatter): only the gradients there are, one after another (no slot for a frozen or unused
            #   parameter); `ReduceOp.AVG` inside the collective (`SUM` at world size 1), no division before it.
            # H8 (mixed precision, backward): gradients go into the collective in the reduce dtype.
            numel = sum(p.padded_numel for p in params)
            flat = torch.empty((self.world, numel), dtype=self.reduce_dtype, device=self.device)
            start = 0
            for p, grad in zip(params, grads):
                p.copy_grad_in(grad, flat[:, start:start + p.padded_numel])
                start += p.padded_numel
            del grads, grad  # the full gradients are freed here, before the collective runs
            output = torch.empty(numel, dtype=self.reduce_dtype, device=self.device)
            # FSDP2's choice: average inside the collective. Dividing before it gives other bits at
            # world size 3 (at 2 every order happens to agree).
            op = dist.ReduceOp.AVG if self.world > 1 else dist.ReduceOp.SUM
            work = dist.reduce_scatter_tensor(output, flat.view(-1), op=op, group=self.process_group,
                                              async_op=True)
            return PendingReduce(self, work, output, params)
            # endregion

    def all_reduce(self, pending: PendingReduce) -> None:
        """HSDP, once this group's reduce-scatter is done: start averaging this rank's reduced shard with
        the other replicas' (the ranks at the same place of the shard dim), in place. It runs while the
        next group's backward computes; the gradients are set when it is finished (PendingAllReduce)."""
        if not self.all_reduce_grads:  # set_requires_all_reduce(False): keep the partial sum, no gradient yet
            if self.partial_reduce is None:
                self.partial_reduce = pending.output
            else:
                self.partial_reduce += pending.output
            return
        if self.partial_reduce is not None:
            pending.output += self.partial_reduce
            self.partial_reduce = None
        ctx = self.ctx
        ctx.finish_all_reduce()  # at most one in flight: the previous group's first
        with record_function(self.link_label(ALL_REDUCE_RANGE, REPLICATE_LINK)):
            # region bonus4: start the replica all-reduce
            # Asynchronous, across the replicate group, averaged as FSDP2 does: AVG both times (within the
            # shard group, then across replicas), SUM when there is one data-parallel rank in all (H13).
            # H13 (HSDP reduction): `dist.all_reduce` the finished reduce-scatter's output in place across the
            #   replicate group with `ReduceOp.AVG`, even over one replica (`SUM` only with one data-parallel rank
            #   in all).
            op = dist.ReduceOp.AVG if self.world * self.replicate_group.size() > 1 else dist.ReduceOp.SUM
            work = dist.all_reduce(pending.output, op=op, group=self.replicate_group, async_op=True)
            # else: raise TodoError("TODO(bonus4): start the replica all-reduce")
            # endregion
        ctx.pending_all_reduce = PendingAllReduce(work, pending)

    def finish_reduce(self, pending: PendingReduce) -> None:
        """The reduce-scatter is done: give each parameter its slice as sharded gradient."""
        # region task1: finish the reduce-scatter
        # Each parameter reduced gets its slice of the output (where its gradient sat in the input),
        # in its own dtype.
        # H8 (mixed precision, backward): the reduced gradients come out cast back to the parameter's dtype.
        output = pending.output.to(self.orig_dtype)
        start = 0
        for p in pending.params:
            p.set_sharded_grad(output[start:start + p.padded_numel])
            start += p.padded_numel
        # endregion
        for p in pending.params:
            p.run_post_accumulate_grad_hooks()


# --------------------------------------------------------------------------------------
# Hooks: when a group gathers, frees and reduces, driven by forward and by autograd.
# --------------------------------------------------------------------------------------


class RootContext:
    """What the groups under one root share during a step."""

    def __init__(self, states: list[FSDPState], is_last_backward: bool = True):
        self.states = states
        self.final_callback_queued = False
        # set_is_last_backward(False): more backwards follow before the optimizer step (microbatches),
        # so backward keeps what forward recorded for prefetching.
        self.is_last_backward = is_last_backward
        self.pending_all_reduce: PendingAllReduce | None = None  # HSDP: a replica all-reduce in flight
        self.init_forward_order()
        self.init_backward_order()

    def init_forward_order(self) -> None:
        """Task 2's state: what a forward remembers for the next one."""
        # region task2: what a forward remembers for the next one
        # Forward prefetch needs to know, before a group runs, which group ran after it last time.
        # H10 (overlap): FSDP2 keeps at most the current group and the next one gathered.
        self.forward_order: list[FSDPGroup] = []       # pre-forward order of this forward
        self.last_forward_order: list[FSDPGroup] = []  # ... and of the previous one
        # endregion

    def init_backward_order(self) -> None:
        """Task 3's state: what backward needs from forward, and the reduce-scatter in flight."""
        # region task3: what backward needs from forward, and the reduce-scatter in flight
        # Backward runs the groups in reverse, and a reduce-scatter may still be running while the
        # next group's backward computes.
        # H11 (backward order): autograd runs the groups' backward in the reverse of the order in which their
        #   forwards finished (post-forward), and a group that ran twice runs backward twice.
        self.post_forward_order: list[FSDPGroup] = []  # post-forward order of this step's forwards
        self.backward_positions: dict[FSDPGroup, list[int]] = {}  # a group's places in that order
        self.pending_reduce: PendingReduce | None = None
        # endregion

    def finish_all_reduce(self) -> None:
        """HSDP: finish the replica all-reduce in flight, if any: before the next group's starts (its
        buffers are not kept longer than FSDP2 keeps them) and at the end of backward."""
        if self.pending_all_reduce is None:
            return
        # region bonus4: finish the replica all-reduce in flight
        # It sets that group's gradients, which the optimizer reads; as task 3 does with the reduce-scatters.
        # H13 (HSDP reduction): only once the all-reduce is finished are the gradients cast back and handed out,
        #   before the optimizer reads them.
        self.pending_all_reduce, pending = None, self.pending_all_reduce
        pending.finish()
        # else: raise TodoError("TODO(bonus4): finish the replica all-reduce still in flight")
        # endregion


class FSDPState:
    """The hooks of one fully_shard call. The root's state also owns the RootContext.

    Every hook is `torch.compiler.disable`d, as FSDP2's are: a module compiled in place
    (`block.compile()`, train.py --compile) runs its forward hooks inside the compiled call, and
    dynamo would trace their collectives, storage resizes and state changes into the graph instead
    of running them for real on every call. Disabled, each runs eagerly between the graphs. The
    backward hooks run from autograd, outside compiled code; disabled alike, no tracer of backward
    (compiled autograd) takes them in either.
    """

    def __init__(self, modules: list[nn.Module], group: FSDPGroup | None, mp_policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool | None):
        self.modules, self.group, self.mp_policy = modules, group, mp_policy
        self.module = modules[0]
        self.auto_reshard_after_forward = reshard_after_forward is None
        if group is not None:
            group.reshard_after_forward = reshard_after_forward is not False
        self.ctx: RootContext | None = None
        self.is_root = False
        self.is_last_backward = True  # set before the first forward; the root's goes to the RootContext
        self.training_state = TrainingState.IDLE
        # Explicit prefetch (set_modules_to_forward_prefetch / ..._backward_prefetch): the states
        # whose all-gathers this one starts right after its own.
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self.post_forward, always_call=True)
        else:
            _register_group_forward_hooks(self, modules)
        if group is not None:
            # [Note: state dicts are always sharded] FSDP2's state_dict() holds the sharded DTensors even
            # while the parameters are gathered (the root after an eval forward): saving or loading first
            # reshards the group, so a checkpoint never mixes full tensors and DTensors.
            for m in {id(owner): owner for p in group.params for owner, _ in [(p.module, p.name), *p.aliases]}.values():
                m.register_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())
                m.register_load_state_dict_pre_hook(lambda *args, **kwargs: group.reshard())

    def lazy_init(self) -> None:
        """The first FSDP module to run forward is the root: it collects the states below it."""
        # One state per fully_shard call (a call on a list of modules shares one among them).
        states = list(dict.fromkeys(m._fsdp_state for m in self.module.modules() if isinstance(m, FSDPModule)))
        ctx = RootContext(states, self.is_last_backward)
        for state in states:
            if state.ctx is not None:
                raise RuntimeError("fully_shard: run forward through the root module first; a module "
                                   "wrapped inside it already ran forward on its own")
            state.ctx = ctx
            if state.group is not None:
                state.group.ctx = ctx
        self.is_root = True
        fqns: dict[FSDPGroup, list[str]] = {}
        for fqn, m in self.module.named_modules():
            if isinstance(m, FSDPModule) and m._fsdp_state.group is not None:
                fqns.setdefault(m._fsdp_state.group, []).append(fqn)
        names = {id(p): name for name, p in self.module.named_parameters()}
        for group, group_fqns in fqns.items():
            group.fqn = ", ".join(group_fqns)
            group.lazy_init(names)
        # The root's parameters are needed again right at the start of backward: by default
        # they stay gathered after forward (as in FSDP2).
        if self.group is not None and self.auto_reshard_after_forward:
            self.group.reshard_after_forward = False

    # ---- forward ----------------------------------------------------------------------

    @torch.compiler.disable
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Activation checkpointing recomputes this forward inside its own backward: the
            # pre-backward gathered the parameters and the post-backward frees them, so this is
            # no new forward (no prefetch, no order, no post-backward hook), as in FSDP2.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        if self.ctx is None:
            self.lazy_init()
        ctx = self.ctx
        self.training_state = TrainingState.FORWARD
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            cast = _cast_to(self.mp_policy.param_dtype)
            args, kwargs = _map_tensors(cast, args), _map_tensors(cast, kwargs)
        if self.group is None:
            _prefetch(self.forward_prefetch)
            return args, kwargs
        with record_function(self.group.label("pre_forward")):
            self.group.unshard()  # no-op if prefetched or still gathered
            self.group.wait_for_unshard()
            # region task2: forward prefetch
            # Prefetch the group that will run after this one, so that its all-gather runs while
            # this group computes; it is waited for where it is used (H10).
            # H10 (overlap): a collective started with `async_op=True` runs while Python goes on; wait for it where its
            #   result is first needed. FSDP2 keeps at most the current group and the next one gathered.
            if self.is_root:  # a new forward begins
                ctx.last_forward_order, ctx.forward_order = ctx.forward_order or ctx.last_forward_order, []
            ctx.forward_order.append(self.group)
            order = ctx.last_forward_order
            if self.group in order and (i := order.index(self.group)) + 1 < len(order):
                order[i + 1].prefetch()
            # endregion
            _prefetch(self.forward_prefetch)  # set_modules_to_forward_prefetch
        if torch.is_grad_enabled():
            # Identity in forward; its backward runs once the gradients w.r.t. the inputs
            # exist, i.e. when this group's backward is done: that is the post-backward.
            args, kwargs = _PostBackward.wrap(self, args, kwargs)
        return args, kwargs

    @torch.compiler.disable
    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return output  # a recompute in backward (see pre_forward): its backward needs them
        self.training_state = TrainingState.IDLE
        if self.group is not None:
            with record_function(self.group.label("post_forward")):
                if self.group.post_forward_mesh is not None:  # reshard_after_forward=<int>
                    self.group.reshard_to_post_forward()
                # region bonus1: keep the parameters gathered until backward when asked
                # With reshard_after_forward=False a group keeps its full parameters from forward to
                # backward (the root by default: backward starts with it), so backward gathers nothing.
                if self.group.reshard_after_forward:
                    self.group.reshard()
                # else: if not self.is_root:  # FSDP2's default: the root stays gathered
                # else:     self.group.reshard()
                # endregion
        if not torch.is_grad_enabled():
            return self.cast_output(output)
        if self.group is not None:
            self.record_backward_position()
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self.pre_backward)
        return self.cast_output(output)

    def record_backward_position(self) -> None:
        """This group's forward finished: where it stands in the order backward reverses."""
        # region task3: remember where this group ran, for backward
        # Backward visits the groups in the reverse of the order in which forward finished them.
        # H11 (backward order): backward runs the groups in the reverse of the order in which their forwards
        #   finished, and a group that ran twice runs backward twice.
        self.ctx.backward_positions.setdefault(self.group, []).append(len(self.ctx.post_forward_order))
        self.ctx.post_forward_order.append(self.group)
        # endregion

    def cast_output(self, output: Any) -> Any:
        """MixedPrecisionPolicy.output_dtype: cast after the pre-backward hooks are in place, so the
        cast's backward runs before this module's pre-backward, as in FSDP2."""
        if self.mp_policy.output_dtype is None:
            return output
        return _map_tensors(_cast_to(self.mp_policy.output_dtype), output)

    # ---- backward ---------------------------------------------------------------------

    @torch.compiler.disable
    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Runs when the gradient w.r.t. this module's output is ready, before its backward."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            # Once per call's backward, however many outputs. A module called twice per forward runs
            # backward twice: after its first post-backward (resharded, reduced) it gathers again, as FSDP2.
            return grad
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(self.final_callback)
        if self.group is None:
            _prefetch(self.backward_prefetch)
            return grad
        with record_function(self.group.label("pre_backward")):
            # region task3: finish a reduce-scatter that is already done
            # Its buffers (gloo's copy of the input included) are freed before this group's
            # all-gather allocates more; one still running is left to run.
            # H10 (overlap): a collective runs while Python goes on; `PendingReduce.done()` asks without waiting.
            if ctx.pending_reduce is not None and ctx.pending_reduce.done():
                ctx.pending_reduce, pending = None, ctx.pending_reduce
                pending.finish()
            # endregion
            self.group.unshard()  # no-op if prefetched or never resharded
            self.group.wait_for_unshard()
            if not self.backward_prefetch:  # set_modules_to_backward_prefetch replaces it, as in FSDP2
                self.prefetch_next_backward()
            _prefetch(self.backward_prefetch)
        return grad

    def prefetch_next_backward(self) -> None:
        """Start gathering the group whose backward runs after this one's."""
        # region task3: backward prefetch
        # Prefetch the group whose backward runs next, so that its all-gather runs while this
        # group's backward computes (H11).
        # H11 (backward order): backward runs the groups in the reverse of the order in which their forwards
        #   finished, and a group that ran twice runs backward twice.
        ctx = self.ctx
        positions = ctx.backward_positions.get(self.group)
        index = positions.pop() if positions else 0
        if index > 0:
            ctx.post_forward_order[index - 1].prefetch()
        # endregion

    @torch.compiler.disable
    def post_backward(self) -> None:
        """This group's backward is done: reshard and reduce-scatter its gradients."""
        self.training_state = TrainingState.POST_BACKWARD
        if self.group is None:
            return
        group = self.group
        with record_function(group.label("post_backward")):
            # region bonus2: keep the parameters gathered after backward when asked
            # With reshard_after_backward=False they stay for the next micro-step's forward, which
            # then gathers nothing.
            if group.reshard_after_backward:
                group.reshard()
            # else: group.reshard()
            # endregion
            if self.accumulate_grads():
                return
            self.reduce_grads()

    def accumulate_grads(self) -> bool:
        """Without gradient sync (set_requires_gradient_sync(False)): keep the full gradients for a later
        backward instead of reducing them. Whether it did."""
        # region bonus3: skip the reduce-scatter without gradient sync
        # Keep the full gradients instead: the next synced backward reduces their sum once (H9).
        # H9 (accumulation): without gradient sync the full gradients accumulate (`FSDPParam.accumulate_grad`)
        #   and are reduced once, at the next synced backward.
        if not self.group.reduce_grads:
            for p in self.group.params:
                p.accumulate_grad()
            return True
        # endregion
        return False

    def reduce_grads(self) -> None:
        """Reduce-scatter this group's gradients."""
        # region task3: one reduce-scatter in flight, left running
        # Finish the previous one first (FSDP2 frees its buffers before this one's are allocated), then
        # leave this one running while the next group's backward computes: something finishes it later.
        # H10 (overlap): a collective started with `async_op=True` runs while Python goes on; wait for it where
        #   its result is first needed.
        ctx = self.ctx
        if ctx.pending_reduce is not None:
            ctx.pending_reduce, pending = None, ctx.pending_reduce
            pending.finish()
        pending = self.group.reduce_scatter()
        if pending is not None:
            ctx.pending_reduce = pending
        # else: if (pending := self.group.reduce_scatter()) is not None:
        # else:     pending.finish()
        # endregion

    @torch.compiler.disable
    def final_callback(self) -> None:
        """End of backward: post-backward for groups autograd never reached, wait for the rest."""
        ctx = self.ctx
        with record_function("FSDP::root_post_backward_callback"):
            for state in ctx.states:
                # The root's inputs (token ids) need no gradient, so its post-backward runs here.
                if state.training_state is not TrainingState.POST_BACKWARD:
                    state.post_backward()
            # region task3: nothing may stay in flight after backward
            # The optimizer reads the sharded gradients next, and the next backward starts afresh.
            # H10 (overlap): wait for a collective where its result is first needed: here, the optimizer's step.
            if ctx.pending_reduce is not None:
                ctx.pending_reduce, pending = None, ctx.pending_reduce
                pending.finish()
            if ctx.is_last_backward:  # else: more microbatches' backwards follow (set_is_last_backward)
                ctx.post_forward_order.clear()
                ctx.backward_positions.clear()
            # endregion
            ctx.finish_all_reduce()  # HSDP: the last replica all-reduce; the optimizer reads what it sets
            for state in ctx.states:
                if state.group is not None:
                    state.group.discard_pending_gather()
                state.training_state = TrainingState.IDLE
            ctx.final_callback_queued = False


class _PostBackward(torch.autograd.Function):
    """Identity on the module's inputs; its backward is the module's post-backward."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor):
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.state.post_backward()
        return (None, *grads)

    @staticmethod
    def wrap(state: FSDPState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat = _tensors((args, kwargs))
        needs_grad = [t for t in flat if t.requires_grad]
        if not needs_grad:
            return args, kwargs
        replaced = dict(zip(map(id, needs_grad), _PostBackward.apply(state, *needs_grad)))
        swap = lambda t: replaced.get(id(t), t)
        return _map_tensors(swap, args), _map_tensors(swap, kwargs)


def _prefetch(states: list[FSDPState]) -> None:
    """Explicit prefetch: start the all-gathers of these states' groups now (no-op where gathered)."""
    for state in states:
        if state.group is not None:
            state.group.prefetch()


def _cast_to(to_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mixed precision casts only floating-point tensors (token ids and masks pass through)."""
    return lambda t: t.to(to_dtype) if t.is_floating_point() else t


def _register_group_forward_hooks(state: FSDPState, modules: list[nn.Module]) -> None:
    """[Note: one group over several modules] `fully_shard([norm, output])`: one group, one all-gather,
    one reduce-scatter for both. As in FSDP2, the group's pre-forward runs when the first of its modules
    starts forward and its post-forward when the last of them has finished (all must run)."""
    to_run: set[nn.Module] = set()

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if to_run:
            return None
        to_run.update(modules)
        return state.pre_forward(module, args, kwargs)

    def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
        to_run.discard(module)
        return None if to_run else state.post_forward(module, args, output)

    for module in modules:
        module.register_forward_pre_hook(pre_hook, prepend=True, with_kwargs=True)
        module.register_forward_hook(post_hook, always_call=True)


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(lambda t: found.append(t) or t, obj)
    return found


# --------------------------------------------------------------------------------------
# The module users see, and fully_shard.
# --------------------------------------------------------------------------------------


class FSDPModule:
    """Mixed into the class of every module passed to fully_shard (as FSDP2 does)."""

    _fsdp_state: FSDPState

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
        """`to_empty()`, `.to()`, `.float()`...: nn.Module swaps the sharded parameters' data for new
        tensors (every submodule runs this for itself); the group follows the new storage."""
        group = self._fsdp_state.group
        if group is not None and group.state is not ShardedState.SHARDED:
            raise RuntimeError("fully_shard: move or materialise the model between steps, not while its "
                               "parameters are gathered")
        module = super()._apply(fn, *args, **kwargs)
        if group is not None:
            for p in group.params:
                p.reset_sharded()
            group.device = group.params[0].padded_shard.device
            group.init_dtypes()  # model.to(torch.float64) after fully_shard: gather and reduce in it
        return module

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters now (e.g. before a forward you want to time)."""
        group = self._fsdp_state.group
        handle = UnshardHandle(group)
        if group is not None:
            group.unshard()
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps full gradients and skips the reduce-scatter (accumulation); under HSDP
        the replica all-reduce too."""
        self._set("reduce_grads", requires_gradient_sync, recurse)
        self._set("all_reduce_grads", requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but skips the replica all-reduce (accumulation across replicas);
        the next backward that all-reduces adds the kept sum first. No effect on a 1-D mesh."""
        self._set("all_reduce_grads", requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        self._set("reshard_after_forward", reshard_after_forward, recurse)
        for m in self._fsdp_modules(recurse):
            m._fsdp_state.auto_reshard_after_forward = False
            if m._fsdp_state.group is not None:
                m._fsdp_state.group.post_forward_mesh = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False: parameters stay gathered after backward, so the next forward needs no all-gather."""
        self._set("reshard_after_backward", reshard_after_backward, recurse)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Right after this module's all-gather in forward, start those of `modules` too (several groups
        ahead; FSDP2's explicit prefetch). The groups stay gathered until used."""
        self._fsdp_state.forward_prefetch = _fsdp_states(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Right after this module's all-gather in backward, start those of `modules` too."""
        self._fsdp_state.backward_prefetch = _fsdp_states(modules)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: more backwards follow before the optimizer step (microbatching, e.g. pipeline 1F1B);
        backward then keeps what forward recorded for backward prefetching. Gradients are complete
        after every backward either way."""
        state = self._fsdp_state
        if state.ctx is not None:
            state.ctx.is_last_backward = is_last_backward
        else:  # before the first forward: the root hands it to the RootContext
            for m in self._fsdp_modules(recurse=True):
                m._fsdp_state.is_last_backward = is_last_backward

    def set_prefetch(self, prefetch: bool, *, recurse: bool = True) -> None:
        """False: no forward or backward prefetch; each group gathers when it runs (the same
        numbers, nothing overlapped), to measure what prefetching buys."""
        self._set("prefetching", prefetch, recurse)

    def _set(self, attr: str, value: bool, recurse: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"{attr} must be a bool, got {value!r}")
        for m in self._fsdp_modules(recurse):
            if m._fsdp_state.group is not None:
                setattr(m._fsdp_state.group, attr, value)

    def _fsdp_modules(self, recurse: bool) -> list[FSDPModule]:
        return [m for m in self.modules() if isinstance(m, FSDPModule)] if recurse else [self]


def _fsdp_states(modules: list[FSDPModule]) -> list[FSDPState]:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
    return [module._fsdp_state for module in modules]


class UnshardHandle:
    def __init__(self, group: FSDPGroup | None):
        self.group = group

    def wait(self) -> None:
        if self.group is not None:
            self.group.wait_for_unshard()


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), **unsupported: Any) -> nn.Module:
    """Shard `module`'s parameters (those not already managed by a fully_shard'ed submodule)
    over a 1-D mesh (or dim 1 of a 2-D mesh: HSDP), and gather/reduce them around its forward and backward.

    module: one module, or a list of modules that form one group (one all-gather, one reduce-scatter).
    mesh: a 1-D DeviceMesh, or a 2-D one with mesh_dim_names (HSDP: dim 0 replicates, dim 1 shards);
    None: all ranks on FSDP2's default device (the accelerator, else CPU).
    reshard_after_forward: None (default) frees parameters after forward except for the root,
    True/False force it; an int is the group size to reshard to, as in FSDP2 (1 means False, the
    shard dim's size True). Returns `module`, whose class (each's) now also derives from FSDPModule.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    _check_modules(modules, unsupported)
    if mesh is None:  # FSDP2's default: the whole world on the accelerator, else on CPU
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        mesh = init_device_mesh(accelerator.type if accelerator else "cpu", (dist.get_world_size(),))
    reshard_after_forward = _check_arguments(mesh, reshard_after_forward, mp_policy)
    post_forward_mesh = None
    if not isinstance(reshard_after_forward, (bool, type(None))):  # an int k: rows of k ranks
        # Built on every rank (it creates process groups), as FSDP2's post-forward mesh.
        post_forward_mesh = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, reshard_after_forward))
        reshard_after_forward = False  # after forward: the post-forward shards, not the world's
    device = _mesh_device(mesh)
    found = _managed_parameters(modules, device)
    params = [FSDPParam(m, n, p, mesh, mp_policy, aliases) for m, n, p, aliases in found]
    group = FSDPGroup(params, mesh) if params else None
    state = FSDPState(modules, group, mp_policy, reshard_after_forward)
    if group is not None:
        group.post_forward_mesh = post_forward_mesh
    for m in modules:
        cls = m.__class__
        if cls not in _FSDP_CLASSES:  # one FSDP class per module class, as FSDP2
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _FSDP_CLASSES[cls]
        m._fsdp_state = state
    return module


_FSDP_CLASSES: dict[type, type] = {}
# Parameters that fully_shard replaced by shards, by id (a tensor's == compares values, not identity).
_SHARDED_ORIGINALS: dict[int, weakref.ref] = {}


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Gather around a method other than forward that runs the module (e.g. `generate`), as the
    forward hooks do around forward: FSDP2's register_fsdp_forward_method. A module that is not an
    FSDPModule is left alone, so the same code runs with and without FSDP.

    The one lookup by a name given at run time in this file: the source check lets a graded file
    hold this function only exactly as written here (harness/tools/grading/handwritten.py, [Note: the one
    lookup by a run-time name]).
    """
    if not (isinstance(module, nn.Module) and isinstance(module, FSDPModule)):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def forward_method(*args: Any, **kwargs: Any) -> Any:
        state = module._fsdp_state
        args, kwargs = state.pre_forward(module, args, kwargs)
        return state.post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, forward_method)


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device FSDP keeps shards on: the mesh's type (CPU, or this process's accelerator)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _managed_parameters(modules: list[nn.Module], device: torch.device) -> list[tuple[nn.Module, str, nn.Parameter, list]]:
    """(owner, name, parameter, other places holding it), post-order, skipping subtrees that are
    already FSDP modules. A parameter shared within the group is managed once (tied weights).
    As FSDP2, moves the parameters and buffers to the mesh's device (those on meta stay there:
    materialised later with `to_empty`)."""
    found: list[tuple[nn.Module, str, nn.Parameter, list]] = []
    first: dict[int, int] = {}
    seen: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child_name, child in m.named_children():
            if not isinstance(child, FSDPModule):
                visit(child, prefix + child_name + ".")
        for name, b in m._buffers.items():
            if b is not None and b.device != device and b.device.type != "meta":
                m._buffers[name] = b.to(device)
        for name, p in m._parameters.items():
            if p is None:
                continue
            if (original := _SHARDED_ORIGINALS.get(id(p))) is not None and original() is p:
                raise NotImplementedError(
                    f"fully_shard: parameter {prefix}{name} is shared with a module that an earlier fully_shard "
                    "call already sharded (tied weights across groups): each group would shard its own copy "
                    "and the two would silently part ways. Keep tied modules in one fully_shard group")
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    f"fully_shard: parameter {prefix}{name} is already a DTensor (tensor parallel?): this FSDP "
                    "shards plain tensors only. Apply fully_shard to a model without "
                    "DTensor parameters, or use torch.distributed.fsdp.fully_shard for FSDP + TP")
            if id(p) in first:
                found[first[id(p)]][3].append((m, name))
                continue
            if p.device != device and p.device.type != "meta":  # in place: tied modules keep sharing it
                p.data = p.detach().to(device)
            first[id(p)] = len(found)
            found.append((m, name, p, []))

    for module in modules:
        visit(module, "")
    return found


def _check_modules(modules: list[nn.Module], unsupported: dict[str, Any]) -> None:
    for name, value in unsupported.items():
        # FSDP2's default OffloadPolicy() offloads nothing; any subclass (CPUOffloadPolicy) does. Told apart
        # by name: importing torch.distributed.fsdp would be using FSDP2.
        offloads_nothing = type(value).__name__ == "OffloadPolicy" and type(value).__module__.startswith("torch.distributed.fsdp")
        harmless = {"shard_placement_fn": value is None, "ignored_params": not value, "offload_policy": offloads_nothing}
        if name not in harmless:
            raise TypeError(f"fully_shard() got an unexpected keyword argument {name!r}")
        if not harmless[name]:
            raise NotImplementedError(f"fully_shard: {name}={value!r} is not supported here: {_REFUSED[name]}")
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(module).__name__}")
        if isinstance(module, FSDPModule):
            raise ValueError(f"fully_shard: {type(module).__name__} is already sharded")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs a process group: call dist.init_process_group first")


# What to use instead of each FSDP2 argument this FSDP refuses (each is a second layout or communication pattern).
_REFUSED = {
    "ignored_params": "every parameter of the modules passed is sharded. Keep those parameters out of the "
                      "modules you pass (e.g. fully_shard the submodules without them), or use "
                      "torch.distributed.fsdp.fully_shard",
    "shard_placement_fn": "every parameter is sharded on dim 0 (Shard(0)). Drop the argument, or use "
                          "torch.distributed.fsdp.fully_shard to shard on another dim",
    "offload_policy": "parameters stay on the mesh's device. Drop the argument (or pass OffloadPolicy()), "
                      "or use torch.distributed.fsdp.fully_shard for CPU offload",
}


def _check_arguments(mesh: DeviceMesh, reshard_after_forward: Any, mp_policy: Any) -> bool | int | None:
    """FSDP2's validation of the mesh and of reshard_after_forward; returns reshard_after_forward
    as None, True, False or an int strictly between 1 and the mesh size."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified: use e.g. "
                             "init_device_mesh(type, (replicas, shards), mesh_dim_names=('replicate', 'shard'))")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError("reshard_after_forward should be a bool or an int representing the group size to "
                         f"reshard to, not {reshard_after_forward}")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        mesh_size = mesh.size(mesh.ndim - 1)  # the shard dim's (HSDP: dim 1)
        if reshard_after_forward < 1 or reshard_after_forward > mesh_size or mesh_size % reshard_after_forward:
            raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {mesh_size}, "
                             f"not {reshard_after_forward}")
        if reshard_after_forward == 1:  # FSDP2: resharding to one rank keeps every parameter: False
            warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, "
                          "instead of reshard_after_forward=True (bool)", stacklevel=3)
            reshard_after_forward = False
        elif reshard_after_forward == mesh_size:
            reshard_after_forward = True
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be this module's MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__module__}.{type(mp_policy).__name__}")
    return reshard_after_forward

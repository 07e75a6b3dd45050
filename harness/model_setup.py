"""The model train.py trains: torchtitan's Llama 3 in the shapes the course uses."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.overrides import TorchFunctionMode

from harness.distributed import agree
from harness.errors import ConfigError


def model_args(name: str, seq_len: int, vocab_size: int, *, dim: int | None = None,
               n_layers: int | None = None, n_heads: int | None = None):
    """torchtitan's arguments for `--model debug` (its debugmodel) or `--model 1b` (Llama 3.2 1B
    shapes); dim / n_layers / n_heads, when given, override the family's width and depth."""
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    if name == "debug":
        args = dataclasses.replace(llama3_args["debugmodel"], vocab_size=vocab_size, max_seq_len=seq_len)
    else:
        args = TransformerModelArgs(
            dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024,
            rope_theta=500000, vocab_size=128256, max_seq_len=seq_len,
        )
    overrides = {k: v for k, v in dict(dim=dim, n_layers=n_layers, n_heads=n_heads).items() if v is not None}
    if not overrides:
        return args
    for flag, value in overrides.items():
        if value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    new = dataclasses.replace(args, **overrides)
    kv = new.n_kv_heads or new.n_heads
    if new.n_kv_heads is not None and new.n_heads % kv:  # grouped-query attention needs whole groups
        new = dataclasses.replace(new, n_kv_heads=new.n_heads)
    head_dim, odd = divmod(new.dim, new.n_heads)
    if odd or head_dim % 2:
        raise ConfigError(f"--dim {new.dim} / --n-heads {new.n_heads} must give a whole, even head size "
                          f"(rotary embeddings rotate pairs); pick --dim a multiple of 2 x --n-heads")
    return new


def build_model(name: str, seq_len: int, seed: int, device: torch.device, vocab_size: int,
                **overrides: int | None) -> nn.Module:
    """The same full model on every rank: same seed, same init, before any sharding.
    overrides: dim / n_layers / n_heads (see model_args)."""
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(model_args(name, seq_len, vocab_size, **overrides))
    if device.type != "meta":  # on meta there is nothing to fill: see materialize
        # Seeded again here, as materialize does: building on a real device ran the modules' own
        # default init, which drew from the generator; the meta build drew nothing.
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights()
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """torchtitan's full activation checkpointing: every block runs under non-reentrant
    `torch.utils.checkpoint` (its activations are recomputed in backward), applied before
    fully_shard so that FSDP's hooks sit outside the recompute, as torchtitan orders them."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.named_children()):
        # preserve_rng_state=False as torchtitan: the Llama has no dropout, nothing random to replay.
        model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def compile_blocks(model: nn.Module, backend) -> None:
    """train.py --compile: torchtitan's per-block torch.compile, after activation checkpointing and
    before fully_shard. The blocks share one compiled graph. Compiled in place (Module.compile) where
    torchtitan registers a torch.compile wrapper, so parameter names stay the model's (checkpoints,
    comparisons); in place, the hooks fully_shard registers run inside the compiled call, and the FSDP
    must keep them out of the graph (FSDP2 and the reference disable dynamo in them)."""
    # Each run compiles afresh, the same way whatever ran before in this process: dynamo forgets
    # earlier runs' graphs (their shapes could make it compile these dynamic; they count against
    # its recompile limit, past which it silently runs eager).
    torch.compiler.reset()
    for block in model.layers.values():
        block.compile(backend=backend)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """FSDP2's meta-device recipe, after fully_shard: allocate only this rank's shards
    (`to_empty`), then run the model's own initialisation on them with the run's seed."""
    torch.manual_seed(seed)
    model.to_empty(device=device)
    with torch.no_grad(), FullTensorInit():
        model.init_weights(buffer_device=device)
    check_row_layout(model)


def check_row_layout(model: nn.Module) -> None:
    """Every rank's Shard(0) parameters hold torch.chunk's rows (what FullTensorInit fills), agreed on
    all ranks at once so that each names the same problem instead of some ranks going on to hang."""
    if dist.is_initialized():
        agree(row_layout_error(model, "after wrapping"))


def chunk_rows(rows: int, world: int, rank: int) -> int:
    """The rows torch.chunk gives `rank` of `world`: ceil(rows / world) each, the last ranks fewer or
    none. Shard(0)'s split; FSDP's collectives pad every rank's part to rank 0's rows."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def row_layout_error(model: nn.Module, when: str) -> str | None:
    """The first Shard(0) parameter whose local rows on this rank are not torch.chunk's, or None. On a 2-D
    (replicate, shard) mesh (HSDP): the rows of this rank's place along the shard dim."""
    for name, p in model.named_parameters():
        if not (isinstance(p, DTensor) and tuple(p.placements) in ((Shard(0),), (Replicate(), Shard(0)))):
            continue
        mesh = p.device_mesh
        world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
        full, local = tuple(p.shape), tuple(p.to_local().shape)
        expected = (chunk_rows(full[0], world, rank), *full[1:])
        if local != expected:
            return (f"{when}: rank {rank} holds {local} of {name} {full}; torch.chunk gives it {expected} "
                    "(Shard(0) splits rows as torch.chunk does: README, Hints)")
    return None


class FullTensorInit(TorchFunctionMode):
    """Random initialisers (nn.init.normal_, trunc_normal_...) called on a DTensor draw the whole
    tensor, as the full model's initialisation would, and keep this rank's part of it.

    The generator then advances exactly as without sharding, so every shard equals its rows of
    the full-model init with the same seed, whatever the world size and for both FSDPs. (DTensor's
    own random ops on a CPU mesh draw each rank's shard from the same generator state: every rank
    would get the same rows, duplicated neurons.) Costs one full parameter at a time, never the model.
    """

    RANDOM = {nn.init.normal_, nn.init.trunc_normal_, nn.init.uniform_, torch.Tensor.normal_, torch.Tensor.uniform_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        if func not in self.RANDOM or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        local = target.to_local()
        full = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        func(full, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensor"})
        if tuple(target.placements) in ((Shard(0),), (Replicate(), Shard(0))):  # both FSDPs: torch.chunk's rows,
            mesh = target.device_mesh  # copied straight in (HSDP: the shard dim's, the same on every replica)
            chunks = full.chunk(mesh.size(mesh.ndim - 1))
            rank = mesh.get_local_rank(mesh.ndim - 1)
            if rank < len(chunks) and local.shape == chunks[rank].shape:
                local.copy_(chunks[rank])  # another row split is named on every rank by check_row_layout
        else:
            local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())
        return target

"""Will a run fit in memory? Estimated before anything is built, so that a configuration that
cannot fit is refused with the numbers (and what to change) instead of being killed by the
kernel's OOM killer halfway through building the model.

Per rank, in bytes: the sharded training state (parameters, gradients and AdamW's two moments:
16 bytes per parameter / world size, all in float32), the full model while it is built without
meta-device init, the gathered groups (the root stays gathered; a block and the one prefetched
next, with their full gradients), the activations backward needs (all of them, or with
activation checkpointing only each block's input plus one block recomputed), the logits, and
the process itself (torch and torchtitan loaded). Every rank on this machine needs that much.
The sharded state and the gathered groups are harness/memory_model.py's, which the report shares.
"""

from __future__ import annotations

import os

import torch

from harness import compat, memory_model, model_setup

PROCESS_BYTES = 700 * 2**20  # a rank with torch and torchtitan imported, before any model
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "none": 4}


def available_bytes(device: torch.device) -> int:
    """Memory this run may still use: CUDA's free memory, else the memory available to new
    processes (harness/compat.py: MemAvailable on Linux, free plus inactive pages on macOS)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return compat.available_memory()


def estimate(cfg, world_size: int, vocab_size: int) -> dict[str, int]:
    """Bytes per rank, by part (see the module docstring); cfg is a train.Config."""
    overrides = dict(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads)  # the model the run asks for
    model = model_setup.build_model(cfg.model, cfg.seq_len, cfg.seed, torch.device("meta"), vocab_size, **overrides)
    args = model_setup.model_args(cfg.model, cfg.seq_len, vocab_size, **overrides)
    groups = memory_model.group_shapes(model)
    total = memory_model.numel(groups)
    hidden = model.layers["0"].feed_forward.w1.out_features
    sharded = cfg.fsdp != "none"
    world = world_size if sharded else 1
    compute = DTYPE_BYTES[cfg.param_dtype]
    tokens = cfg.batch_size * cfg.seq_len
    # Saved for backward per block: ~a dozen dim-wide tensors, the feed-forward's three
    # hidden-wide ones, and attention scores plus softmax (CPU's SDPA materialises them).
    per_block = tokens * (12 * args.dim + 3 * hidden) * compute + 2 * cfg.batch_size * args.n_heads * cfg.seq_len**2 * compute
    if cfg.activation_checkpoint == "full":
        activations = len(model.layers) * tokens * args.dim * compute + per_block
    else:
        activations = len(model.layers) * per_block
    # Rank 0's sizes, padded as torch.chunk pads: the largest rank's, which is the one that must fit.
    # Where W divides every parameter's rows (W = 1, 2, 4 for the course's models) they are exactly the
    # 16 * total / W and compute * (root + 2 blocks) of before; elsewhere a plain division undercounts.
    state = memory_model.per_rank(groups, world, activations=0).sharded_state
    parts = {
        "parameters, gradients, AdamW state (float32)": state,
        "gathered groups and their full gradients": (2 * memory_model.gathered_bytes(groups, world, compute)
                                                     if sharded else 4 * total),
        "activations": activations,
        "logits and their gradient (float32)": 3 * tokens * args.vocab_size * 4,
        "the process (torch, torchtitan)": PROCESS_BYTES,
    }
    if not (cfg.meta_init and sharded):
        # Every rank first builds (and initialises) the whole model, then shards it.
        parts["the full model, built before sharding"] = 4 * total
    return parts


def check(cfg, world_size: int, local_world_size: int, vocab_size: int, device: torch.device) -> str | None:
    """None if the run fits, else the error: the estimate, the memory available, and what to change."""
    parts = estimate(cfg, world_size, vocab_size)
    need = sum(parts.values()) * (local_world_size if device.type == "cpu" else 1)
    have = available_bytes(device)
    if need <= have:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    lines = "\n".join(f"  {gib(b):>9}  {what}" for what, b in parts.items())
    ranks = f"{local_world_size} ranks on this machine x " if device.type == "cpu" and local_world_size > 1 else ""
    return (f"--model {cfg.model} does not fit: it needs about {ranks}{gib(sum(parts.values()))} = {gib(need)} "
            f"and {gib(have)} is available ({'CUDA free memory' if device.type == 'cuda' else 'memory available'}). "
            f"Estimate per rank:\n{lines}\nFix: a smaller --model, --seq-len or --batch-size, "
            "--activation-checkpoint full, more ranks on more machines, or --no-memory-check to try anyway.")


def refuse_if_too_big(cfg, device: torch.device, vocab_size: int) -> None:
    """Raise ConfigError on every rank if rank 0's estimate says the run cannot fit (one
    decision for all: ranks reading free memory at different moments must not part ways)."""
    import torch.distributed as dist

    from harness.errors import ConfigError

    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    verdict: list = [None]
    if dist.get_rank() == 0:
        try:
            verdict = [check(cfg, dist.get_world_size(), local, vocab_size, device)]
        except Exception as e:  # the other ranks wait in the broadcast: tell them, then raise
            dist.broadcast_object_list([f"the memory check itself failed ({e!r}); --no-memory-check skips it"], src=0)
            raise
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])


"""The model train.py trains: torchtitan's Llama 3 in the shapes the course uses."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

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
    with torch.no_grad():
        model.init_weights()
    return model

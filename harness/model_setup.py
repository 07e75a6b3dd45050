"""The model train.py trains: torchtitan's Llama 3 in the shapes the course uses."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


def model_args(name: str, seq_len: int, vocab_size: int):
    """torchtitan's arguments for `--model debug` (its debugmodel) or `--model 1b` (Llama 3.2 1B shapes)."""
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

    if name == "debug":
        return dataclasses.replace(llama3_args["debugmodel"], vocab_size=vocab_size, max_seq_len=seq_len)
    return TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=1024,
        rope_theta=500000, vocab_size=128256, max_seq_len=seq_len,
    )


def build_model(name: str, seq_len: int, seed: int, device: torch.device, vocab_size: int) -> nn.Module:
    """The same full model on every rank: same seed, same init, before any sharding."""
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(model_args(name, seq_len, vocab_size))
    with torch.no_grad():
        model.init_weights()
    return model

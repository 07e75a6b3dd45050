"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save and resume.

    DIR/step-000003/     one DCP checkpoint: every rank writes its own shards, .metadata last
    DIR/.tmp-step-.../   a save in progress; renamed to step-N only once complete

What is saved: the model and optimizer state dicts (DTensor shards, from
`torch.distributed.checkpoint.state_dict.get_state_dict`, so a checkpoint saved by one FSDP or
world size loads under another), the step, the run's shape (model, seed, sequences per step)
and each rank's RNG state. The data position is the step: resuming skips the batches the
finished steps consumed, which puts the loader exactly where the uninterrupted run was.
A save never touches the last good checkpoint until the new one is complete (write to a
temporary name, then rename), so an interrupted save leaves the previous one usable.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from harness.errors import ConfigError

STEP_DIR = re.compile(r"^step-(\d{6})$")
FORMAT = "fsdp-by-hand/train.py checkpoint v1"


class CheckpointError(ConfigError):
    """A checkpoint directory that cannot be resumed from; the message says why and what to do."""


def _run_shape(cfg) -> dict:
    """What must match for a resumed run to continue the saved one."""
    return {"model": cfg.model, "seq_len": cfg.seq_len, "seed": cfg.seed}


def save(directory: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> Path:
    """Save step `step` as DIR/step-NNNNNN, atomically; every rank calls it."""
    rank = dist.get_rank()
    final = directory / f"step-{step:06d}"
    tmp = directory / f".tmp-step-{step:06d}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was interrupted
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd,
             "train": {"format": FORMAT, "step": step, "world_size": dist.get_world_size(), **_run_shape(cfg)},
             # Per rank: keys no other rank writes, so each keeps its own generator state.
             "rng": {f"rank{rank}": torch.get_rng_state()}}
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's shards and the metadata are written
    if rank == 0:
        old = directory / f".old-step-{step:06d}"
        if final.exists():  # the same step saved again (a resumed run): replace it only now
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest(directory: Path) -> Path:
    """The newest complete checkpoint in DIR, or a CheckpointError saying what is wrong."""
    if not directory.is_dir():
        raise CheckpointError(f"--resume: {directory} does not exist; run once with --checkpoint-dir {directory} "
                              "to create a checkpoint, or drop --resume")
    steps = sorted(p for p in directory.iterdir() if STEP_DIR.match(p.name))
    if not steps:
        raise CheckpointError(f"--resume: {directory} holds no checkpoint (no step-NNNNNN folder; a "
                              ".tmp-step-* folder is an interrupted save); drop --resume to start afresh")
    newest = steps[-1]
    if not (newest / ".metadata").is_file():
        raise CheckpointError(f"--resume: {newest} is torn (no .metadata: its save never finished, or files were "
                              "removed); delete that folder to resume from the one before it")
    return newest


def nothing_left(cfg) -> str:
    """What --resume says when the latest checkpoint is already at --num-steps."""
    return (f"--resume: the latest checkpoint in {cfg.checkpoint_dir} is at step {cfg.num_steps} = --num-steps: "
            f"nothing left to train; pass a larger --num-steps to train on")


def load(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> int:
    """Load the latest checkpoint into the (wrapped) model and optimizer; return its step."""
    path = latest(directory)
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"--resume: {path} is not a readable DCP checkpoint ({e}); delete it or "
                              "choose another --checkpoint-dir") from None
    if "train" not in meta and "train.format" not in meta:
        raise CheckpointError(f"--resume: {path} is a DCP checkpoint but not one train.py wrote (no "
                              "'train' entry); choose another --checkpoint-dir")
    train_state = {"format": "", "step": 0, "world_size": 0, **{k: type(v)() for k, v in _run_shape(cfg).items()}}
    dcp.load({"train": train_state}, checkpoint_id=str(path))
    if train_state["format"] != FORMAT:
        raise CheckpointError(f"--resume: {path} was written by {train_state['format']!r}, not {FORMAT!r}")
    if train_state["step"] > cfg.num_steps:
        raise CheckpointError(f"--resume: {path} is at step {train_state['step']}, past --num-steps {cfg.num_steps}: "
                              f"pass --num-steps {train_state['step'] + 1} or more to train on, or another --checkpoint-dir")
    if (saved := {k: train_state[k] for k in _run_shape(cfg)}) != _run_shape(cfg):
        raise CheckpointError(f"--resume: {path} was saved by a run with {saved}; this run has {_run_shape(cfg)}: "
                              "use the same --model, --seq-len and --seed, or another --checkpoint-dir")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    rng_key = f"rank{dist.get_rank()}"
    same_world = train_state["world_size"] == dist.get_world_size()
    if same_world:  # at another world size the ranks' generators do not correspond
        state["rng"] = {rng_key: torch.get_rng_state()}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:
        raise CheckpointError(f"--resume: {path} does not match this model and optimizer ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:300]}); resume with the flags it was saved with") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if same_world:
        torch.set_rng_state(state["rng"][rng_key])
    return train_state["step"]

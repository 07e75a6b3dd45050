"""Process-group set-up: which device each rank uses, and joining (or creating) the group."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.errors import ConfigError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(flag: str) -> torch.device:
    """auto: CUDA when every rank on this machine has its own GPU, else CPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if flag == "cuda" and gpus < local_world:
        raise ConfigError(
            f"--device cuda needs one GPU per rank: found {gpus} GPU(s) for {local_world} rank(s) on this "
            "machine; use --device cpu (gloo) or fewer processes"
        )
    if flag == "cuda" or (flag == "auto" and gpus >= local_world):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device_flag: str = "auto") -> torch.device:
    """Join (or, without torchrun, create a 1-rank) process group on the chosen device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        device = pick_device(device_flag)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
        else:
            dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    return current_device(device_flag)


def current_device(device_flag: str) -> torch.device:
    """The device of the process group this process already belongs to."""
    backend = dist.get_backend()
    if device_flag == "auto":  # a group already running (e.g. a CPU RankPool) decides
        device_flag = "cuda" if backend == "nccl" else "cpu"
    device = pick_device(device_flag)
    if (backend == "nccl") != (device.type == "cuda"):
        raise ConfigError(f"--device {device_flag} does not match the {backend} process group already running")
    return device


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

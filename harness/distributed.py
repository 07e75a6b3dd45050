"""Process-group set-up: which device each rank uses, and joining (or creating) the group."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from harness import compat
from harness.errors import ConfigError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(flag: str) -> torch.device:
    """auto: CUDA when every rank on this machine has its own GPU, else CPU.

    Either every rank sees all GPUs (rank r takes GPU LOCAL_RANK), or a scheduler binds one
    GPU to each process through CUDA_VISIBLE_DEVICES (each sees one GPU: its index 0)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    bound = gpus == 1 and len(visible) == 1
    enough = gpus >= local_world or bound
    if flag == "cuda" and not enough:
        raise ConfigError(
            f"--device cuda needs one GPU per rank: found {gpus} GPU(s) for {local_world} rank(s) on this "
            "machine; use --device cpu (gloo) or fewer processes"
        )
    if flag == "cuda" or (flag == "auto" and enough):
        return torch.device("cuda", 0 if gpus < local_world else int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def pool_device(flag: str, world_size: int) -> str:
    """The device of `world_size` ranks started on this machine (a RankPool), chosen as each rank's
    pick_device chooses: auto is CUDA when there is a GPU per rank, else CPU."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if flag == "cuda" and gpus < world_size:
        raise ConfigError(f"--device cuda needs one GPU per rank: found {gpus} GPU(s) for {world_size} rank(s); "
                          "use --device cpu (gloo) or auto")
    return "cuda" if flag == "cuda" or (flag == "auto" and gpus >= world_size) else "cpu"


def deterministic_cuda() -> None:
    """The settings torchtitan's `--debug.deterministic` makes (torchtitan/distributed/utils.py),
    so that a CUDA run repeats bit for bit and FSDP2 and effdl, running the same
    kernels, agree bit for bit. CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS starts.

    Attention: torchtitan's SDPA wrapper prefers the cuDNN and flash backends, whose backward
    may accumulate in a varying order (flash only honours the deterministic flag in its C++
    source, which no Python test here can check); the math backend is built from matmuls and
    softmax, which the settings above make deterministic. So on CUDA attention runs the math
    backend, in FSDP2's runs and effdl's alike (slower, same numbers each run)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    from torch.nn.attention import SDPBackend
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    ScaledDotProductAttentionWrapper.sdpa_backends = [SDPBackend.MATH]


def init_distributed(device_flag: str = "auto") -> torch.device:
    """Join (or, without torchrun, create a 1-rank) process group on the chosen device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        device = pick_device(device_flag)
        if device.type == "cuda":
            deterministic_cuda()
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
        else:
            if "GLOO_SOCKET_IFNAME" not in os.environ and (name := compat.gloo_interface(os.environ["MASTER_ADDR"])):
                os.environ["GLOO_SOCKET_IFNAME"] = name
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
    if device.type == "cuda":
        deterministic_cuda()
    return device


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(error: str | None) -> None:
    """Raise on every rank if a check failed on any (error: this rank's problem, or None): a rank
    that carried on alone would hang in the next collective."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise AssertionError(f"{first} [rank {rank}; failed on ranks {[r for r, _ in failed]}]")


def device_mesh(device: torch.device, world_size: int, replicate: int) -> DeviceMesh:
    """The ranks as one shard group (a 1-D mesh), or with --replicate R as R replicas of world/R ranks each:
    rank r is in replica r // (world/R) and shards with the ranks of its replica (FSDP2's HSDP mesh)."""
    if replicate == 1:
        return init_device_mesh(device.type, (world_size,))
    if world_size % replicate:
        raise ConfigError(f"--replicate {replicate} must divide the world size {world_size} (each replica "
                          f"shards over world/replicate ranks); use a divisor of {world_size}")
    return init_device_mesh(device.type, (replicate, world_size // replicate), mesh_dim_names=("replicate", "shard"))

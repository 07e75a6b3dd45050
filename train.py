"""Train a torchtitan Llama under PyTorch's FSDP2, effdl (the hand-written FSDP in fsdp.py), or no sharding.

    uv run torchrun --nproc-per-node 2 train.py --fsdp fsdp2
    uv run torchrun --nproc-per-node 2 train.py --fsdp effdl     # your fsdp.py

Every implementation is wrapped by the same function and driven by the same loop, so
losses, grad norms, traces (traces/<run>/rank{r}.json) and memory snapshots
(snapshots/<run>/rank{r}.pickle) compare like for like. `train(cfg)` is also importable:
it returns every step's loss, grad norm, time and peak memory.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable, Literal

# The data loader must never try the network: the assets are local.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # no "Generating train split" bars

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from harness import assets, checkpoint, fit, impl, memory, model_setup, profiling
from harness.distributed import current_device, device_mesh, init_distributed, shutdown_distributed
from harness.errors import ConfigError, stop
from harness.validate import validate

ROOT = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "none": None}


@dataclass(frozen=True)
class Config:
    fsdp: Literal["fsdp2", "effdl", "none"] = "fsdp2"
    """fsdp2: torch.distributed.fsdp.fully_shard; effdl: the FSDP in fsdp.py (or --impl); none: no sharding
    (each rank holds the whole model, gradients averaged with DistributedDataParallel)."""
    impl: str = "student"
    """which file --fsdp effdl imports: student (fsdp.py) or the path of any .py file
    with fully_shard and MixedPrecisionPolicy (e.g. a submission)."""
    model: Literal["debug", "1b"] = "debug"
    """debug: torchtitan's debugmodel (dim 256, 6 layers); 1b: a Llama 3.2 1B-sized model."""
    dim: int | None = None
    """override the model's width (default: the --model family's)."""
    n_layers: int | None = None
    """override the model's depth (transformer blocks)."""
    n_heads: int | None = None
    """override the model's attention heads (--dim / --n-heads must be even)."""
    num_steps: int = 5
    seq_len: int = 256
    batch_size: int = 2
    """sequences per rank per micro-step."""
    num_gradient_accumulation_steps: int = 1
    lr: float = 3e-4
    max_grad_norm: float = 1.0
    seed: int = 0
    param_dtype: Literal["float32", "bfloat16", "none"] = "none"
    """mixed precision: dtype of the gathered parameters used for compute (none: keep float32)."""
    reduce_dtype: Literal["float32", "bfloat16", "none"] = "none"
    """mixed precision: dtype gradients are reduce-scattered in (none: the compute dtype)."""
    replicate: int = 1
    """HSDP: R replicas of world/R ranks (2-D mesh): sharded within a replica, averaged across."""
    prefetch: bool = True
    """--fsdp effdl: gather the next group while the current one computes (False: each group gathers
    when it runs; same numbers, no overlap: FSDPModule.set_prefetch)."""
    reshard_after_forward: bool = True
    """free each block's gathered parameters after its forward (False: keep them until backward, ZeRO-2)."""
    reshard_after_backward_before_last_backward: bool = True
    """with accumulation: free gathered parameters after every micro-step's backward (False: keep them)."""
    reduce_grads_before_last_backward: bool = True
    """with accumulation: reduce-scatter after every micro-step (False: accumulate unsharded, reduce once)."""
    profile_steps: int = 2
    """profile the last N steps (trace + memory snapshot); 0 turns profiling off."""
    profile_memory: bool = True
    """with profiling: record allocations in the trace and write the memory snapshot (False: the trace alone, faster)."""
    traces_dir: Path | None = None
    """default: traces/<run>: fsdp2, none, effdl (fsdp.py) or effdl-<path> (another --impl)."""
    snapshots_dir: Path | None = None
    """default: snapshots/<run>, named as traces."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA + NCCL when every rank has its own GPU, else CPU + gloo."""
    exact_cpu_memory: bool = False
    """CPU: hand freed memory back to the OS at once (allocations of 64 KiB or more get their own
    mapping), so the logged peak rss is each step's true peak; costs speed (page faults)."""
    log: bool = True
    """rank 0 prints one line per step."""
    activation_checkpoint: Literal["none", "full"] = "none"
    """full: every block recomputes its activations in backward (torchtitan's full AC): less memory, more compute."""
    compile: bool = False
    """torch.compile each block before wrapping, as torchtitan (minutes on CPU); FSDP hooks stay out of graphs."""
    meta_init: bool = True
    """build on the meta device and materialise only each rank's shards after wrapping (False: build the full model first)."""
    memory_check: bool = True
    """refuse, before building anything, a run estimated not to fit in the memory available (harness/fit.py)."""
    checkpoint_dir: Path | None = None
    """save distributed checkpoints (torch.distributed.checkpoint) under this folder (harness/checkpoint.py)."""
    checkpoint_every: int = 0
    """with --checkpoint-dir: save every N steps (0: after the last step only)."""
    resume: bool = False
    """continue from the latest checkpoint in --checkpoint-dir."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    peak_memory: list[int] = field(default_factory=list)
    """bytes, per step: CUDA's peak allocated, or on CPU the process's peak resident set."""
    trace_path: Path | None = None
    snapshot_path: Path | None = None


# --------------------------------------------------------------------------- model, wrapping, data


def fsdp_module(cfg: Config) -> ModuleType:
    """The namespace whose `fully_shard` and `MixedPrecisionPolicy` wrap the model."""
    return impl.fsdp2() if cfg.fsdp == "fsdp2" else impl.load(cfg.impl)


def apply_fsdp(model: nn.Module, fsdp: ModuleType, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """One wrapping for every implementation: each transformer block, then the root."""
    mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype])
    model_setup.apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if cfg.compile:
        model_setup.compile_blocks(model, impl.compile_backend(cfg.fsdp, cfg.impl))
    for block in model.layers.values():
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=cfg.reshard_after_forward)
    # The root (embeddings, final norm, output) keeps its default: not resharded after forward (backward starts there).
    return fsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def build_data(cfg: Config, rank: int, world_size: int):
    """torchtitan's text dataset over c4_test/, split by data-parallel rank, in a fixed order."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    tokenizer = HuggingFaceTokenizer(str(ROOT / "tokenizer"))
    dataset = HuggingFaceTextDataset(
        "c4_test", str(ROOT / "c4_test"), tokenizer, seq_len=cfg.seq_len,
        dp_rank=rank, dp_world_size=world_size, infinite=True,
    )
    return iter(torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size))


# --------------------------------------------------------------------------- the loop


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, data, cfg: Config,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `num_gradient_accumulation_steps` micro-steps: (loss, grad norm)."""
    micro = cfg.num_gradient_accumulation_steps
    step_loss = torch.zeros((), device=device)
    for i in range(micro):
        last = i == micro - 1
        if cfg.fsdp != "none":
            # Both FSDPs expose FSDP2's accumulation controls on the root module.
            model.set_requires_gradient_sync(last or cfg.reduce_grads_before_last_backward)
            model.set_reshard_after_backward(last or cfg.reshard_after_backward_before_last_backward)
        inputs, labels = next(data)
        inputs, labels = inputs["input"].to(device), labels.to(device)
        with torch.profiler.record_function("## forward ##"):
            loss = loss_fn(model(inputs), labels, micro)
        with torch.profiler.record_function("## backward ##"):
            loss.backward()
        step_loss += loss.detach()
    with torch.profiler.record_function("## optimizer ##"):
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad()
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
    return step_loss, grad_norm


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, micro: int) -> torch.Tensor:
    """Cross-entropy in float32 over every token, a 1/micro share of the optimizer step's loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)) / micro


def setup(cfg: Config) -> tuple[nn.Module, torch.device]:
    """Everything before the first step, on every rank: the data and tokenizer, the memory check,
    and the model, built, wrapped by the FSDP under test and materialised."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    validate(cfg)
    device = current_device(cfg.device)
    if device.type == "cpu" and cfg.exact_cpu_memory:
        memory.exact_cpu_memory()
    if cfg.log and rank == 0 and (note := memory.note(device)):
        print(note, flush=True)

    if rank == 0:
        assets.ensure(ROOT, log=lambda msg: print(msg, flush=True))
    dist.barrier()
    assets.check(ROOT)
    if cfg.memory_check:
        fit.refuse_if_too_big(cfg, device, assets.vocab_size(ROOT))
    model = model_setup.build_model(cfg.model, cfg.seq_len, cfg.seed, torch.device("meta") if cfg.meta_init else device,
                                    assets.vocab_size(ROOT), dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    mesh = device_mesh(device, world_size, cfg.replicate)
    if cfg.fsdp == "none":
        model_setup.apply_activation_checkpointing(model, cfg.activation_checkpoint)
        if cfg.compile:
            model_setup.compile_blocks(model, "inductor")
    else:
        model = impl.explain_errors(apply_fsdp, model, fsdp_module(cfg), mesh, cfg)
        if not cfg.prefetch:
            impl.turn_off_prefetch(model, cfg.impl)
    if cfg.meta_init:
        impl.explain_errors(model_setup.materialize, model, device, cfg.seed)
    if cfg.fsdp == "none" and world_size > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, device


def train(cfg: Config, inspect: Callable[[nn.Module, int], None] | None = None) -> TrainResult:
    """Train in the process group this process belongs to (see `init_distributed`).

    `inspect(model, step)` runs after wrapping (step 0) and after every optimizer step.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, device = setup(cfg)
    if inspect is not None:
        inspect(model, 0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1, foreach=True)
    data = build_data(cfg, rank, world_size)
    first = checkpoint.load(cfg.checkpoint_dir, model, optimizer, cfg) if cfg.resume else 0
    if cfg.resume and first == cfg.num_steps and cfg.log and rank == 0:
        print(checkpoint.nothing_left(cfg), flush=True)
    for _ in range(first * cfg.num_gradient_accumulation_steps):
        next(data)  # where the saved run's loader was
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.num_gradient_accumulation_steps * world_size
    result = TrainResult()
    run = impl.run_name(cfg.fsdp, cfg.impl)
    with profiling.StepProfiler(
        active=cfg.profile_steps, skip=max(0, cfg.num_steps - first - cfg.profile_steps), device=device, rank=rank,
        traces_dir=cfg.traces_dir or ROOT / "traces" / run, snapshots_dir=cfg.snapshots_dir or ROOT / "snapshots" / run,
        memory=cfg.profile_memory,
    ) as prof:
        for step in range(first + 1, cfg.num_steps + 1):
            memory.reset_peak(device)
            start = time.perf_counter()
            loss, grad_norm = impl.explain_errors(train_step, model, optimizer, data, cfg, device)
            loss_value, norm_value = loss.item(), grad_norm.item()
            elapsed = time.perf_counter() - start
            result.losses.append(loss_value)
            result.grad_norms.append(norm_value)
            result.step_times.append(elapsed)
            result.peak_memory.append(memory.peak(device))
            if cfg.log and rank == 0:
                print(f"step {step:3d} | loss {loss_value:.6f} | grad norm {norm_value:.6f} | {elapsed:6.3f} s"
                      f" | {tokens_per_step / elapsed:9,.0f} tok/s | {memory.label(device)} "
                      f"{result.peak_memory[-1] / 2**20:8.1f} MiB", flush=True)
            if inspect is not None:
                inspect(model, step)
            if cfg.checkpoint_dir and (step == cfg.num_steps or cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                checkpoint.save(cfg.checkpoint_dir, step, model, optimizer, cfg)
            prof.step()
    if cfg.profile_steps:
        result.trace_path, result.snapshot_path = prof.trace_path, prof.snapshot_path
    return result


def main(cfg: Config) -> None:
    try:
        validate(cfg)
        device = init_distributed(cfg.device)
        if dist.get_rank() == 0:
            print(f"{cfg.fsdp}{'/' + cfg.impl if cfg.fsdp == 'effdl' else ''}: {cfg.model} model on "
                  f"{dist.get_world_size()} x {device.type} ({dist.get_backend()})", flush=True)
        train(cfg)
    except (ConfigError, assets.AssetError) as e:
        stop(str(e), 2 if isinstance(e, ConfigError) else 1)
    except NotImplementedError as e:
        # The skeleton's TodoError (a class of the FSDP under test, so known by name); an
        # unsupported feature or a real bug deserves its traceback.
        if type(e).__name__ != "TodoError":
            raise
        stop(f"{e} (in {impl.impl_path(cfg.impl)})")
    except impl.FeatureError as e:  # the FSDP under test lacks a feature this run uses: say which
        stop(f"{e} (in {impl.impl_path(cfg.impl)})")
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Config))

"""The checks behind test.py, as plain functions over a RankPool.

Each `check_*` runs FSDP2 and a hand-written FSDP (`impl`: student, solution, or a .py
path) in the same spawned process group and raises AssertionError saying exactly what
differs. tests/test_mutants.py runs the same functions against broken variants of the
reference to prove that every check can fail.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import train
from ranks import RankError, RankPool

PRECISIONS = [(p, r) for p in ("float32", "bfloat16") for r in ("float32", "bfloat16")]


def config(impl: str | None = None, **overrides) -> train.Config:
    """A small, fast run: debug model, 4 steps of 2 micro-steps, no profiling."""
    base = dict(model="debug", num_steps=4, seq_len=64, batch_size=2, num_gradient_accumulation_steps=2,
                profile_steps=0, log=False)
    if impl is not None:
        base.update(fsdp="effdl", impl=impl)
    return train.Config(**{**base, **overrides})


def describe(cfg: train.Config, world: int) -> str:
    return (f"world {world}, param_dtype={cfg.param_dtype}, reduce_dtype={cfg.reduce_dtype}, "
            f"{cfg.num_gradient_accumulation_steps} micro-steps")


# --------------------------------------------------------------------------- rank-side jobs


def train_job(cfg: train.Config, check_shards: bool = False):
    """Train; return the result and, per step, a digest of every parameter shard on this rank."""
    digests: list[dict[str, str]] = []

    def inspect(model: nn.Module, step: int) -> None:
        if check_shards:
            assert_sharded(model, step)
        digests.append({name: digest(p) for name, p in model.named_parameters()})

    return train.train(cfg, inspect=inspect), digests


def digest(p: torch.Tensor) -> str:
    local = p.to_local() if isinstance(p, DTensor) else p
    return hashlib.sha256(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def assert_sharded(model: nn.Module, step: int) -> None:
    """Every parameter is a Shard(0) DTensor on the world mesh with torch.chunk's rows."""
    agree(sharding_error(model, step))


def sharding_error(model: nn.Module, step: int) -> str | None:
    when = "after wrapping" if step == 0 else f"after step {step}"
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            return (f"{when}: parameter {name} is a {type(p).__name__}, not a DTensor "
                    "(between steps every parameter must be sharded)")
        if tuple(p.placements) != (Shard(0),) or p.device_mesh.size() != world:
            return (f"{when}: parameter {name} has placements {p.placements} on a mesh of "
                    f"{p.device_mesh.size()} ranks; expected (Shard(0),) on {world}")
        rows = p.shape[0]
        chunk = -(-rows // world)
        mine = max(0, min(chunk, rows - rank * chunk))
        if tuple(p.to_local().shape) != (mine, *p.shape[1:]):
            return (f"{when}: rank {rank} holds {tuple(p.to_local().shape)} of {name} "
                    f"{tuple(p.shape)}; torch.chunk gives it {(mine, *p.shape[1:])}")
    return None


def agree(error: str | None) -> None:
    """Raise on every rank if the check failed on any: a rank that carried on alone would
    hang in the next collective."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise AssertionError(f"{first} [rank {rank}; failed on ranks {[r for r, _ in failed]}]")


# --------------------------------------------------------------------------- checks


def run(pool: RankPool, fn, *args):
    """pool.run, with a check that failed on the ranks raised here as an AssertionError."""
    try:
        return pool.run(fn, *args, timeout=300)
    except RankError as e:
        if "AssertionError: " in str(e) and "hung" not in str(e):
            raise AssertionError(str(e)) from None
        raise


def run_both(pool: RankPool, cfg_effdl: train.Config, check_shards: bool = False):
    """Per-rank (result, digests) of FSDP2 and of the hand-written FSDP, same config otherwise."""
    cfg_fsdp2 = dataclasses.replace(cfg_effdl, fsdp="fsdp2", impl="student")
    return run(pool, train_job, cfg_fsdp2, check_shards), run(pool, train_job, cfg_effdl, check_shards)


def assert_same_parameters(ref: list[list[dict]], got: list[list[dict]], what: str) -> None:
    """Every rank's shard of every parameter, after wrapping and after every step."""
    for rank, (ref_steps, got_steps) in enumerate(zip(ref, got)):
        for step, (a, b) in enumerate(zip(ref_steps, got_steps)):
            for name in a:
                if a[name] != b.get(name):
                    when = "after wrapping" if step == 0 else f"after step {step}"
                    raise AssertionError(
                        f"{what}: rank {rank}'s shard of {name} differs from FSDP2's {when} (the "
                        "optimizer saw different gradients, even if losses and grad norms agree)")


def assert_same_numbers(ref: train.TrainResult, got: train.TrainResult, what: str) -> None:
    for metric in ("losses", "grad_norms"):
        a, b = getattr(ref, metric), getattr(got, metric)
        if len(a) != len(b):
            raise AssertionError(f"{what}: FSDP2 ran {len(a)} steps, the hand-written FSDP {len(b)}")
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if x != y:
                raise AssertionError(
                    f"{what}: {metric[:-1].replace('_', ' ')} differs at step {step}: FSDP2 {x!r}, "
                    f"hand-written {y!r} (steps before it were equal: {step - 1}). Bitwise equality "
                    "needs FSDP2's padding, casts and ReduceOp.AVG inside the reduce-scatter."
                )


def check_parity(pool: RankPool, impl: str, param_dtype: str, reduce_dtype: str, **overrides) -> None:
    """Every step's loss and grad norm equal FSDP2's bit for bit; parameters stay Shard(0) DTensors."""
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    ref, got = run_both(pool, cfg, check_shards=True)
    what = describe(cfg, pool.world_size)
    assert_same_numbers(ref[0][0], got[0][0], what)
    assert_same_parameters([d for _, d in ref], [d for _, d in got], what)


# ---- odd shapes: padding and empty shards, on a tiny model whose parameters we can compare


class OddMLP(nn.Module):
    """Rows that do not divide by 2 or 3, and a layer with fewer rows than ranks."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 7)      # 7 rows: 3/3/1 on 3 ranks, 4/3 on 2
        self.down = nn.Linear(7, 2)    # 2 rows: 1/1/0 on 3 ranks (an empty shard)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.down(torch.relu(self.up(x * self.scale)))


def odd_shapes_job(impl: str | None, steps: int = 3) -> dict[str, list[torch.Tensor]]:
    """Train OddMLP a few steps; return every parameter (full) and its gradient at each step."""
    cfg = config(impl) if impl else config()
    fsdp = train.fsdp_module(cfg)
    device = train.current_device("cpu")
    torch.manual_seed(0)
    model = OddMLP().to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (model.up, model.down):
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    assert_sharded(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    seen: dict[str, list[torch.Tensor]] = {}
    for step in range(1, steps + 1):
        x = torch.randn(4, 5, generator=gen).to(device)
        model(x).pow(2).mean().backward()
        for name, p in model.named_parameters():
            seen.setdefault(name + ".grad", []).append(p.grad.full_tensor().cpu())
        opt.step()
        opt.zero_grad()
        assert_sharded(model, step)
        for name, p in model.named_parameters():
            seen.setdefault(name, []).append(p.full_tensor().detach().cpu())
    return seen


def check_odd_shapes(pool: RankPool, impl: str) -> None:
    ref = run(pool, odd_shapes_job, None)[0]
    got = run(pool, odd_shapes_job, impl)[0]
    for name, values in ref.items():
        for step, (a, b) in enumerate(zip(values, got[name]), start=1):
            if not torch.equal(a, b):
                raise AssertionError(f"odd shapes, world {pool.world_size}: {name} differs from FSDP2's "
                                     f"at step {step} (max abs diff {(a - b).abs().max().item():.3g}); "
                                     "check padding of shards that torch.chunk leaves short or empty")

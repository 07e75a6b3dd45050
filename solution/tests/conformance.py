"""Conformance: models this project did not write, trained under FSDP2 and under effdl (the FSDP under
test), which must agree bit for bit.

Each model is tiny (hundreds to a few thousand parameters) and stresses one thing the debug
Llama of test.py does not: torch's own `nn.TransformerEncoderLayer`, frozen parameters, a
parameter unused in some steps, a module called twice per forward, tied weights. `train_job`
trains one of them on every rank of a RankPool and returns what `compare` holds against FSDP2:
per-step losses, gradient norms and every parameter's local shard; `check` does both runs.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import train
from harness.tools.grading import checks, jobs
from harness.tools.grading.compare import tensor_difference
from harness.tools.grading.ranks import RankPool

VOCAB, DIM = 19, 12  # 19 rows (embedding, output layer): uneven shards on 2, 3 and 4 ranks, some padded


class Block(nn.Module):
    """A pre-norm MLP block with a residual (`up` has 21 rows: uneven on 2 and 4 ranks)."""

    def __init__(self, dim: int = DIM, hidden: int = 21):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor, use_norm: bool = True) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h) if use_norm else h)))


class LanguageModel(nn.Module):
    """Embedding, blocks, final norm, output layer. Subclasses choose the blocks and the path
    through them; `step` (1, 2, ...) lets a forward depend on the training step."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def body(self, h: torch.Tensor, step: int) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(tokens), step)))

    def groups(self) -> list[nn.Module]:
        """The modules fully_shard'ed one by one before the root."""
        return list(self.layers)


class Encoder(LanguageModel):
    """(a) Blocks of torch's own nn.TransformerEncoderLayer: attention, its packed in_proj and
    two layer norms, none of it written here."""

    def __init__(self):
        super().__init__([nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=20, dropout=0.0,
                                                     batch_first=True) for _ in range(2)])


class Frozen(LanguageModel):
    """(b) requires_grad=False on the embedding (the root group is part frozen), on one block's
    norm (a block group part frozen) and on a whole block (a group with nothing to reduce, whose
    parameters are still gathered: the gradient flows through them)."""

    def __init__(self):
        super().__init__([Block() for _ in range(3)])
        self.embed.requires_grad_(False)
        self.layers[0].norm.requires_grad_(False)
        self.layers[1].requires_grad_(False)


class Sometimes(LanguageModel):
    """(c) Parameters unused on odd steps: the first block's norm (the first parameters of its
    group), a branch block (a whole group) and the root's `gate` (its last parameter)."""

    def __init__(self):
        super().__init__([Block(), Block()])
        self.branch = Block()
        self.gate = nn.Parameter(torch.full((DIM,), 0.5))

    def body(self, h: torch.Tensor, step: int) -> torch.Tensor:
        even = step % 2 == 0
        h = self.layers[0](h, use_norm=even)
        if even:
            h = h + self.gate * self.branch(h)
        return self.layers[1](h)

    def groups(self) -> list[nn.Module]:
        return [*self.layers, self.branch]


class Twice(LanguageModel):
    """(d) One block called twice per forward, with another block in between (weights shared
    across depth): its group gathers, and runs backward, twice per step."""

    def __init__(self):
        super().__init__([Block(), Block()])

    def body(self, h: torch.Tensor, step: int) -> torch.Tensor:
        shared, other = self.layers
        return shared(other(shared(h)))


class Tied(LanguageModel):
    """(e) The output layer reuses the embedding's weight (as GPT-2 does), both in the root group:
    one parameter in two places, whose gradient sums both uses."""

    def __init__(self):
        super().__init__([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight


MODELS: dict[str, type[LanguageModel]] = {
    "encoder": Encoder, "frozen": Frozen, "sometimes": Sometimes, "twice": Twice, "tied": Tied,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Run:
    """One rank's record of a run: per step, its loss, the (global) gradient norm, and its local
    shard of every parameter after the optimizer step (index 0: right after wrapping)."""

    losses: list[float]
    grad_norms: list[float]
    shards: list[dict[str, torch.Tensor]]


def wrap(model: str, impl: str | None, param_dtype: str, reduce_dtype: str):
    """(the FSDP module, MODELS[model] wrapped by it): every group of `groups()`, then the root,
    under FSDP2 (impl None) or effdl at `impl` (a path)."""
    fsdp = train.fsdp_module(train.Config(fsdp="fsdp2") if impl is None else train.Config(fsdp="effdl", impl=impl))
    torch.manual_seed(0)
    net = MODELS[model]()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = fsdp.MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    for group in net.groups():
        fsdp.fully_shard(group, mesh=mesh, mp_policy=policy)
    fsdp.fully_shard(net, mesh=mesh, mp_policy=policy)
    return fsdp, net


def train_job(model: str, impl: str | None, param_dtype: str, reduce_dtype: str, steps: int = 4) -> Run:
    """Train MODELS[model] under FSDP2 (impl None) or effdl at `impl` (a path):
    AdamW with clipping, a few steps of random tokens."""
    _, net = wrap(model, impl, param_dtype, reduce_dtype)
    rank = dist.get_rank()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    run = Run([], [], [_shards(net, 0)])
    for step in range(1, steps + 1):
        tokens = torch.randint(VOCAB, (2, 9), generator=gen)
        logits = net(tokens[:, :-1], step)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        # Small enough to clip: the norm then scales every gradient, so its last bit matters too.
        norm = nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.5, foreach=True)
        opt.step()
        opt.zero_grad()
        run.losses.append(loss.item())
        run.grad_norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        run.shards.append(_shards(net, step))
    return run


@dataclasses.dataclass
class Unsharded:
    """What the modules held after unshard (full tensors and requires_grad) and reshard (shards)."""

    when: str
    full: dict[str, tuple[torch.Tensor, bool]]
    shards: dict[str, torch.Tensor]

    def __getitem__(self, field: str):
        return getattr(self, field)


def unshard_job(model: str, impl: str | None, param_dtype: str, async_op: bool) -> list[Unsharded]:
    """FSDPModule.unshard()/reshard() by hand on every FSDP module, right after wrapping and again
    after a training step: what the modules hold after each (full tensors, then shards again)."""
    fsdp, net = wrap(model, impl, param_dtype, param_dtype)
    modules = [m for m in net.modules() if isinstance(m, fsdp.FSDPModule)]
    seen = []
    for when in ("after wrapping", "after a step"):
        if when == "after a step":
            tokens = torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
            net(tokens[:, :-1], 2).float().square().mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    if p.grad is not None:
                        p.sub_(p.grad)
                        p.grad = None
        handles = [m.unshard(async_op=async_op) for m in modules]
        for h in handles:
            assert (h is not None) == async_op, f"unshard(async_op={async_op}) returned {h!r}"
            if async_op:
                h.wait()
        full = {}
        for name, p in net.named_parameters():
            assert isinstance(p, nn.Parameter) and not isinstance(p, DTensor), f"{when}: unshard left {name} a {type(p)}"
            full[name] = (p.detach().clone(), p.requires_grad)
        for m in modules:
            m.reshard()
        shards = {}
        for name, p in net.named_parameters():
            assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),), f"{when}: reshard left {name} a {type(p)}"
            shards[name] = p.to_local().detach().clone()
        seen.append(Unsharded(when, full, shards))
    return seen


def _shards(net: nn.Module, step: int) -> dict[str, torch.Tensor]:
    jobs.assert_sharded(net, step)
    return {name: p.to_local().detach().clone() for name, p in net.named_parameters()}


def compare(ref: list[Run], got: list[Run], what: str) -> None:
    """Raise AssertionError at the first step where any rank's loss, the gradient norm or a
    parameter shard differs from FSDP2's (`ref`), saying which and by how much."""
    __tracebackhide__ = True
    for step in range(len(ref[0].shards)):
        for rank, (a, b) in enumerate(zip(ref, got)):
            if step and a.losses[step - 1] != b.losses[step - 1]:
                raise AssertionError(f"{what}: rank {rank}'s loss of step {step} differs from FSDP2's "
                                     f"({b.losses[step - 1]!r}, FSDP2 {a.losses[step - 1]!r})")
            if step and a.grad_norms[step - 1] != b.grad_norms[step - 1]:
                raise AssertionError(f"{what}: the gradient norm of step {step} differs from FSDP2's "
                                     f"({b.grad_norms[step - 1]!r}, FSDP2 {a.grad_norms[step - 1]!r})")
            when = "after wrapping" if step == 0 else f"after step {step}"
            for name, x in a.shards[step].items():
                y = b.shards[step].get(name)
                if y is None:
                    raise AssertionError(f"{what}: {name} is not a parameter of the model {when}")
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    raise AssertionError(f"{what}: rank {rank}'s shard of {name} differs from FSDP2's "
                                         f"{when}: {tensor_difference(x, y)}")


def check(pool: RankPool, model: str, impl: str, param_dtype: str, reduce_dtype: str) -> None:
    """Train MODELS[model] under FSDP2 and under `impl` on the pool's ranks; AssertionError at the
    first difference."""
    __tracebackhide__ = True
    what = f"{model}, world {pool.world_size}, param_dtype={param_dtype}, reduce_dtype={reduce_dtype}"
    ref = checks.run(pool, train_job, model, None, param_dtype, reduce_dtype)
    got = checks.run(pool, train_job, model, impl, param_dtype, reduce_dtype)
    compare(ref, got, what)

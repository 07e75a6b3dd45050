"""The drop-in contract: FSDP2's public behaviour one step outside training a model wrapped once.

Each `case_*` function runs on every rank of a RankPool with one implementation (`impl` None:
FSDP2's `torch.distributed.fsdp`; a path: effdl, the FSDP there) and returns a record of
what a user can observe: losses, gradient norms, every local shard after every step, the
collectives FSDP issued (kind, dtype, elements), exceptions (type and message). The test runs the
same case under both and requires the records equal, bit for bit (`same`).

Written from FSDP2's documented behaviour and its public-API unit tests
(test/distributed/_composable/fsdp/test_fully_shard_*.py): freezing after wrapping, post-accumulate-
grad hooks, state dicts, dtype changes after init, the default mesh, world size 1, the error
contract, explicit prefetch, set_is_last_backward, register_fsdp_forward_method, the four-field
MixedPrecisionPolicy, fully_shard on a list, int reshard_after_forward.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness import impl as impls
from solution.tests.conformance import DIM, VOCAB, Block, LanguageModel

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
               "reduce_scatter", "broadcast", "_reduce_scatter_base", "_all_gather_base")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, None: None}


def fsdp(impl: str | None):
    return impls.fsdp2() if impl is None else impls.load(impl)


@contextlib.contextmanager
def recorded(log: list, groups: bool = False):
    """Record every torch.distributed collective called meanwhile: (kind, dtype, elements sent), and
    with `groups` the global ranks of its process group (None: the default group)."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, fn):
        def call(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            sent = tensors[-1] if tensors else None  # (output, input): the input is last
            entry = (name, str(sent.dtype) if sent is not None else None, sent.numel() if sent is not None else None)
            if groups:
                group = kwargs.get("group")
                entry += (tuple(dist.get_process_group_ranks(group)) if group is not None else None,)
            log.append(entry)
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def model(blocks: int = 2, dtype: torch.dtype = torch.float32, device: str | None = None) -> LanguageModel:
    torch.manual_seed(0)
    with torch.device(device) if device else contextlib.nullcontext():
        net = LanguageModel([Block() for _ in range(blocks)])
    return net.to(dtype)


def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def wrap(f, net: LanguageModel, policy=None, **kwargs) -> LanguageModel:
    kwargs = {"mesh": mesh(), **kwargs}
    if policy is not None:
        kwargs["mp_policy"] = policy
    for block in net.layers:
        f.fully_shard(block, **kwargs)
    kwargs.pop("reshard_after_forward", None)
    f.fully_shard(net, **kwargs)
    return net


def tokens(step: int) -> torch.Tensor:
    return torch.randint(VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def loss_of(net: nn.Module, step: int) -> torch.Tensor:
    t = tokens(step)
    return F.cross_entropy(net(t[:, :-1], step).float().flatten(0, 1), t[:, 1:].flatten())


def shards(net: nn.Module) -> dict:
    return {name: (type(p).__name__, p.to_local().detach().clone() if isinstance(p, DTensor) else p.detach().clone())
            for name, p in net.named_parameters()}


def train(net: nn.Module, steps: int = 3, between=None, record: dict | None = None, log: list | None = None) -> dict:
    """AdamW with clipping: per step the loss, the gradient norm, every shard; `between(step)` runs
    before each step's forward."""
    record = record if record is not None else {}
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    log = log if log is not None else []
    record.setdefault("steps", [])
    with recorded(log):
        for step in range(1, steps + 1):
            if between is not None:
                between(step)
            loss = loss_of(net, step)
            loss.backward()
            grads = {n: p.grad is not None for n, p in net.named_parameters()}
            norm = nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], 0.5, foreach=True)
            opt.step()
            opt.zero_grad()
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            record["steps"].append({"loss": loss.item(), "norm": norm.item(), "grads": grads, "shards": shards(net)})
    record["collectives"] = log
    return record


def error(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is the contract
        return type(e).__name__, str(e)
    return None


# ---------------------------------------------------------------------------------- cases


def case_freeze_after_wrapping(impl, dtype):
    """requires_grad_(False) after fully_shard, before the first step and between steps. (Unfreezing
    again is left out: FSDP2 fixes a group's dtypes from its trainable parameters at the first forward
    and fails under bf16 for a parameter trainable only later.)"""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    net = wrap(f, model(3), policy)
    net.embed.requires_grad_(False)
    net.layers[0].requires_grad_(False)

    def between(step):
        if step == 2:
            net.layers[1].up.requires_grad_(False)
    return train(net, between=between)


def case_post_accumulate_grad_hook(impl, dtype):
    """Optimizer in backward: a hook per sharded parameter steps SGD as soon as its reduced gradient is in."""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    net = wrap(f, model(2), policy)
    fired = []

    def hook(p):
        fired.append((names[id(p)], type(p).__name__, type(p.grad).__name__))
        with torch.no_grad():
            p.sub_(0.1 * p.grad)
        p.grad = None

    names = {id(p): n for n, p in net.named_parameters()}
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(hook)
    record = {"steps": []}
    for step in range(1, 3):
        loss = loss_of(net, step)
        loss.backward()
        record["steps"].append({"loss": loss.item(), "fired": sorted(fired), "shards": shards(net)})
        fired.clear()
    return record


def case_state_dict_sharded(impl):
    """state_dict() while the root is gathered (after an eval forward) and after unshard() by hand."""
    f = fsdp(impl)
    net = wrap(f, model(2))
    with torch.no_grad():
        net(tokens(1)[:, :-1], 1)  # the root stays gathered
    sd = net.state_dict()
    record = {"after eval forward": {k: (type(v).__name__, v.to_local().clone() if isinstance(v, DTensor) else v.clone())
                                     for k, v in sd.items()}}
    for m in net.modules():  # every group gathered by hand
        if isinstance(m, f.FSDPModule):
            m.unshard()
    record["after unshard()"] = {k: type(v).__name__ for k, v in net.state_dict().items()}
    record["parameters after"] = [type(p).__name__ for p in net.parameters()]
    net.load_state_dict(sd)
    return train(net, steps=2, record=record)


def case_dtype_after_wrapping(impl, how):
    """The model's dtype changed after fully_shard, before training."""
    f = fsdp(impl)
    if how == "float64":
        net = wrap(f, model(2))
        net.to(torch.float64)
    elif how == "bf16 model, fp32 reduce":
        net = wrap(f, model(2), f.MixedPrecisionPolicy(reduce_dtype=torch.float32))
        net.to(torch.bfloat16)
    else:  # "bf16 built, fp32 reduce"
        net = wrap(f, model(2, torch.bfloat16), f.MixedPrecisionPolicy(reduce_dtype=torch.float32))
    return train(net, steps=2)


def case_default_mesh(impl, meta):
    """No mesh=: FSDP2's default device (the accelerator, else CPU), and deferred init from meta."""
    f = fsdp(impl)
    net = model(2, device="meta" if meta else None)
    for block in net.layers:
        f.fully_shard(block)
    f.fully_shard(net)
    record = {"mesh": [(type(p.device_mesh.device_type).__name__, p.device_mesh.device_type, p.device.type)
                       for p in net.parameters()]}
    if meta:
        net.to_empty(device=torch._C._get_accelerator())
        torch.manual_seed(0)
        with torch.no_grad():
            for m in net.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    record["devices"] = [p.device.type for p in net.parameters()]
    return train(net, steps=2, record=record)


def case_train(impl, dtype, reshard_after_forward=None):
    """Plain training (for world size 1's collectives and int reshard_after_forward)."""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = wrap(f, model(2), policy, **kwargs)
    return train(net, steps=2)


def case_errors(impl):
    """FSDP2's error contract: the exception each misuse raises."""
    f = fsdp(impl)
    ws = dist.get_world_size()
    out = {}

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.scale * self.lin(x)

    def scalar():
        net = f.fully_shard(Scalar(), mesh=mesh())
        net(torch.randn(2, 4)).sum().backward()
    out["0-dim parameter"] = error(scalar)

    def channels_last():
        conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        f.fully_shard(conv, mesh=mesh())
    out["non-contiguous parameter"] = error(channels_last)
    out["3-D mesh"] = error(lambda: f.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, ws))))

    def not_materialised():
        with torch.device("meta"):
            net = nn.Linear(4, 4)
        f.fully_shard(net, mesh=mesh())
        net(torch.randn(2, 4))
    out["meta parameters at forward"] = error(not_materialised)
    out["reshard_after_forward='yes'"] = error(lambda: f.fully_shard(nn.Linear(4, 4), mesh=mesh(), reshard_after_forward="yes"))
    for k in (0, ws + 1, -1):
        out[f"reshard_after_forward={k}"] = error(lambda: f.fully_shard(nn.Linear(4, 4), mesh=mesh(), reshard_after_forward=k))
    out["set_modules_to_forward_prefetch([Linear])"] = error(
        lambda: f.fully_shard(nn.Linear(4, 4), mesh=mesh()).set_modules_to_forward_prefetch([nn.Linear(2, 2)]))
    return {k: v[0] if v else None for k, v in out.items()}, {k: v[1] if v else None for k, v in out.items()}


def case_explicit_prefetch(impl, dtype):
    """set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: two groups ahead."""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    net = wrap(f, model(4), policy)
    layers = list(net.layers)
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 3])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - 2):i][::-1])
    net.set_modules_to_forward_prefetch(layers[:2])
    return train(net, steps=2)


def case_is_last_backward(impl):
    """Microbatching: set_is_last_backward(False) on every backward but the last of a step."""
    f = fsdp(impl)
    net = wrap(f, model(2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    record = {"steps": []}
    log = []
    with recorded(log):
        for step in range(1, 3):
            losses = []
            for micro in range(3):
                net.set_is_last_backward(micro == 2)
                loss = loss_of(net, 10 * step + micro)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            record["steps"].append({"losses": losses, "shards": shards(net)})
    record["collectives"] = log
    return record


class WithMethod(LanguageModel):
    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """A method other than forward that uses the root's own parameters."""
        return self.head(self.norm(h))


def case_forward_method(impl):
    """register_fsdp_forward_method: a method other than forward gathers and frees like forward."""
    f = fsdp(impl)
    torch.manual_seed(0)
    net = WithMethod([Block() for _ in range(2)])
    wrap(f, net)
    f.register_fsdp_forward_method(net, "logits_of")
    f.register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDP module: a no-op
    record = {"missing": error(lambda: f.register_fsdp_forward_method(net, "no_such_method"))}
    record["missing"] = record["missing"][0] if record["missing"] else None
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    record["steps"] = []
    for step in range(1, 3):
        h = torch.randn(3, DIM, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        out = net.logits_of(h)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        record["steps"].append({"out": out.detach(), "types": [type(p).__name__ for p in net.parameters()],
                                "shards": shards(net)})
    return record


def case_mixed_precision_policy(impl, which):
    """The four fields, positional construction: the root casts the inputs and its outputs (logits in
    float32); the blocks compute in bf16 without casting their (already bf16) inputs again."""
    f = fsdp(impl)
    bf16, fp32 = torch.bfloat16, torch.float32
    record = {"fields": [x.name for x in __import__("dataclasses").fields(f.MixedPrecisionPolicy)]}
    if which == "positional":
        root, blocks = f.MixedPrecisionPolicy(bf16, fp32, fp32, True), f.MixedPrecisionPolicy(bf16, fp32, None, False)
    else:
        root = f.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32)
        blocks = f.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False)
    record["values"] = [(p.param_dtype, p.reduce_dtype, p.output_dtype, p.cast_forward_inputs) for p in (root, blocks)]
    record["default"] = f.MixedPrecisionPolicy() == f.MixedPrecisionPolicy(None, None, None, True)
    net = model(2)
    for block in net.layers:
        f.fully_shard(block, mesh=mesh(), mp_policy=blocks)
    f.fully_shard(net, mesh=mesh(), mp_policy=root)
    seen = []
    for m in (*net.layers, net):
        m.register_forward_hook(lambda m, i, o: seen.append((str(i[0].dtype), str(o.dtype))))
    record["seen"] = seen
    net(tokens(0)[:, :-1], 0).sum().backward()  # one step's dtypes (and no training yet)
    record["output"] = str(net(tokens(0)[:, :-1], 0).dtype)
    for p in net.parameters():
        p.grad = None
    return train(net, steps=2, record=record)


class Pair(nn.Module):
    """torchtitan groups [norm, output] in one fully_shard call."""


def case_list_of_modules(impl, dtype):
    """fully_shard([norm, head]): one group over two modules (one all-gather, one reduce-scatter)."""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    net = model(2)
    for block in net.layers:
        f.fully_shard(block, mesh=mesh(), mp_policy=policy)
    returned = f.fully_shard([net.norm, net.head], mesh=mesh(), mp_policy=policy)
    f.fully_shard(net, mesh=mesh(), mp_policy=policy)
    record = {"returned": [type(m).__name__ for m in returned],
              "fsdp": [isinstance(m, f.FSDPModule) for m in (net.norm, net.head)]}
    return train(net, steps=2, record=record)


def case_refused(impl):
    """What effdl refuses by design, and FSDP2's outcome for the same call."""
    f = fsdp(impl)
    ws = dist.get_world_size()
    out = {}
    lin = lambda: nn.Linear(4, 4)  # noqa: E731
    out["ignored_params"] = error(lambda: (m := lin(), f.fully_shard(m, mesh=mesh(), ignored_params={m.bias})))
    out["shard_placement_fn"] = error(lambda: f.fully_shard(lin(), mesh=mesh(), shard_placement_fn=lambda p: None))

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64)

        def forward(self, x):
            return self.b(self.a(x).double())

    def mixed():
        m = f.fully_shard(Mixed(), mesh=mesh())
        m(torch.randn(2, 4)).sum().backward()
    out["mixed dtypes"] = error(mixed)

    def dtensor_param():
        m = lin()
        m.weight = nn.Parameter(DTensor.from_local(m.weight.detach(), mesh(), [__import__("torch.distributed.tensor", fromlist=["Replicate"]).Replicate()]))
        f.fully_shard(m, mesh=mesh())
    out["DTensor parameter"] = error(dtensor_param)
    out["2-D mesh without names"] = error(lambda: f.fully_shard(lin(), mesh=init_device_mesh("cpu", (1, ws))))
    return out


def hsdp_mesh(shape: tuple[int, int]):
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))


HSDP_MODES = (None, "no-reshard-after-forward", "no-sync", "no-reshard-after-backward", "no-all-reduce")


def case_hsdp(impl, dtype, shape, mode=None, steps=3):
    """HSDP on a 2-D (replicate, shard) mesh: 2 micro-steps per step, AdamW with clipping. Per step the
    losses, the gradient norm, every shard; the placements, and every collective with its group's ranks.
    mode: reshard_after_forward=False, or before the first micro-step set_requires_gradient_sync(False),
    set_reshard_after_backward(False) or set_requires_all_reduce(False)."""
    f = fsdp(impl)
    policy = f.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=DTYPES[dtype])
    kwargs = {"reshard_after_forward": False} if mode == "no-reshard-after-forward" else {}
    net = wrap(f, model(2), policy, mesh=hsdp_mesh(shape), **kwargs)
    record = {"placements": {n: (p.device_mesh.mesh.tolist(), [str(x) for x in p.placements], tuple(p.to_local().shape))
                             for n, p in net.named_parameters()},
              "steps": []}
    control = {"no-sync": net.set_requires_gradient_sync, "no-reshard-after-backward": net.set_reshard_after_backward,
               "no-all-reduce": getattr(net, "set_requires_all_reduce", None)}.get(mode)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    log: list = []
    with recorded(log, groups=True):
        for step in range(1, steps + 1):
            losses = []
            for micro in range(2):
                if control is not None:
                    control(micro == 1)
                loss = loss_of(net, 10 * step + micro) / 2
                loss.backward()
                losses.append(loss.item())
            norm = nn.utils.clip_grad_norm_(list(net.parameters()), 0.5, foreach=True)
            opt.step()
            opt.zero_grad()
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            record["steps"].append({"losses": losses, "norm": norm.item(), "shards": shards(net)})
    record["collectives"] = log
    return record

"""The checks behind test.py, as plain functions over a RankPool.

Each `check_*` runs FSDP2 and a hand-written FSDP (`impl`: student or a .py
path) in the same spawned process group and raises AssertionError saying exactly what
differs. Every check has been run against deliberately broken variants of a correct FSDP
and fails there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import train
from harness import assets, memory, model_setup
from harness.distributed import agree, current_device
from harness.ranks import RankError, RankPool

PRECISIONS = [(p, r) for p in ("float32", "bfloat16") for r in ("float32", "bfloat16")]
# train.py's default (no mixed precision) and a reduce dtype left to FSDP2's clamping.
UNSET_PRECISIONS = [("none", "none"), ("bfloat16", "none")]


def config(impl: str | None = None, **overrides) -> train.Config:
    """A small, fast run: debug model, 4 steps of 2 micro-steps, no profiling."""
    base = dict(model="debug", num_steps=4, seq_len=64, batch_size=2, num_gradient_accumulation_steps=2,
                profile_steps=0, log=False)
    if impl is not None:
        base.update(fsdp="effdl", impl=impl)
    return train.Config(**{**base, **overrides})


def as_fsdp2(cfg: train.Config) -> train.Config:
    """The same run under PyTorch's FSDP2."""
    return dataclasses.replace(cfg, fsdp="fsdp2", impl="student")


def mode_flags(modes: list[str]) -> dict:
    """train.py flags of one or more bonus modes."""
    return {k: v for m in modes for k, v in MODES[m].flags.items()}


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

    from harness import analysis

    with analysis.marked_waits() if cfg.profile_steps else contextlib.nullcontext():
        return train.train(cfg, inspect=inspect), digests


def shard_job(cfg: train.Config, step: int, name: str) -> torch.Tensor:
    """Train again (deterministic: same bits) and return this rank's shard of `name` at `step`."""
    kept = {}

    def inspect(model: nn.Module, at: int) -> None:
        if at == step:
            p = dict(model.named_parameters())[name]
            kept["shard"] = (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()

    train.train(dataclasses.replace(cfg, num_steps=max(step, 1), profile_steps=0), inspect=inspect)
    return kept["shard"]


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How many elements differ, the max abs difference and the max distance in ulps."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"FSDP2's is {a.dtype} {tuple(a.shape)}, the hand-written {b.dtype} {tuple(b.shape)}"
    differ = a.reshape(-1) != b.reshape(-1)
    x, y = a.reshape(-1)[differ], b.reshape(-1)[differ]
    if not x.numel():
        return "equal when measured again (is the run deterministic?)"
    text = f"{x.numel()} of {a.numel()} elements differ, max abs {(x.double() - y.double()).abs().max().item():.3g}"
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(a.dtype)
    if bits is not None:
        def ordered(t):  # sign-magnitude bit patterns onto a line where neighbouring floats differ by 1
            i = t.view(bits).long()
            return torch.where(i < 0, -(i & (2 ** (torch.iinfo(bits).bits - 1) - 1)), i)
        text += f", max {(ordered(x) - ordered(y)).abs().max().item()} ulps of {str(a.dtype).removeprefix('torch.')}"
    return text


def digest(p: torch.Tensor) -> str:
    local = p.to_local() if isinstance(p, DTensor) else p
    return hashlib.sha256(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def assert_sharded(model: nn.Module, step: int) -> None:
    """Every parameter is a Shard(0) DTensor on the world mesh with torch.chunk's rows."""
    agree(sharding_error(model, step))


def sharding_error(model: nn.Module, step: int) -> str | None:
    when = "after wrapping" if step == 0 else f"after step {step}"
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            return (f"{when}: parameter {name} is a {type(p).__name__}, not a DTensor "
                    "(between steps every parameter must be sharded)")
        if tuple(p.placements) != (Shard(0),) or p.device_mesh.size() != world:
            return (f"{when}: parameter {name} has placements {p.placements} on a mesh of "
                    f"{p.device_mesh.size()} ranks; expected (Shard(0),) on {world}")
    return model_setup.row_layout_error(model, when)


# --------------------------------------------------------------------------- checks


def run(pool: RankPool, fn, *args):
    """pool.run, with a check that failed on the ranks raised here as an AssertionError."""
    __tracebackhide__ = True  # the student's line is in the ranks' traceback, not here
    cfg = next((a for a in args if isinstance(a, train.Config)), None)
    where = f"[{describe(cfg, pool.world_size)}, {cfg.fsdp if cfg.fsdp != 'effdl' else 'hand-written'}] " if cfg else ""
    try:
        return pool.run(fn, *args, timeout=300)
    except RankError as e:
        if "AssertionError: " in str(e) and "hung" not in str(e):
            raise AssertionError(where + str(e)) from None
        raise type(e)(where + str(e)) from None


def run_both(pool: RankPool, cfg_effdl: train.Config, check_shards: bool = False):
    """Per-rank (result, digests) of FSDP2 and of the hand-written FSDP, same config otherwise."""
    __tracebackhide__ = True
    return run(pool, train_job, as_fsdp2(cfg_effdl), check_shards), run(pool, train_job, cfg_effdl, check_shards)


def assert_same_parameters(ref: list[list[dict]], got: list[list[dict]], what: str,
                           pool: RankPool | None = None, cfg: train.Config | None = None) -> None:
    """Every rank's shard of every parameter, after wrapping and after every step. With `pool`
    and `cfg`, the first difference is measured (both runs again, up to that step)."""
    __tracebackhide__ = True
    for rank, (ref_steps, got_steps) in enumerate(zip(ref, got)):
        for step, (a, b) in enumerate(zip(ref_steps, got_steps)):
            for name in a:
                if a[name] != b.get(name):
                    when = "after wrapping" if step == 0 else f"after step {step}"
                    size = ""
                    if pool is not None and cfg is not None and name in b:
                        try:
                            x = run(pool, shard_job, as_fsdp2(cfg), step, name)[rank]
                            y = run(pool, shard_job, cfg, step, name)[rank]
                            size = f": {tensor_difference(x, y)}"
                        except (AssertionError, RankError) as e:
                            size = f" (could not measure by how much: {str(e).splitlines()[0][:200]})"
                    raise AssertionError(
                        f"{what}: rank {rank}'s shard of {name} differs from FSDP2's {when}{size} (the "
                        "optimizer saw different gradients, even if losses and grad norms agree)")


def assert_same_numbers(ref: train.TrainResult, got: train.TrainResult, what: str) -> None:
    __tracebackhide__ = True
    for metric, label in (("losses", "loss"), ("grad_norms", "grad norm")):
        a, b = getattr(ref, metric), getattr(got, metric)
        if len(a) != len(b):
            raise AssertionError(f"{what}: FSDP2 ran {len(a)} steps, the hand-written FSDP {len(b)}")
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if x != y:
                raise AssertionError(
                    f"{what}: {label} differs at step {step}: FSDP2 {x!r}, "
                    f"hand-written {y!r}, {ulps(x, y)} (steps before it were equal: {step - 1}). Bitwise equality "
                    "needs FSDP2's padding, casts and ReduceOp.AVG inside the reduce-scatter."
                )


def check_parity(pool: RankPool, impl: str, param_dtype: str, reduce_dtype: str, **overrides) -> None:
    """Every step's loss and grad norm equal FSDP2's bit for bit; parameters stay Shard(0) DTensors."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    ref, got = run_both(pool, cfg, check_shards=True)
    what = describe(cfg, pool.world_size)
    assert_same_numbers(ref[0][0], got[0][0], what)
    assert_same_parameters([d for _, d in ref], [d for _, d in got], what, pool, cfg)


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
    device = current_device("cpu")
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
            if p.grad is None:
                raise AssertionError(f"odd shapes: {name} has no gradient after backward (step {step})")
            seen.setdefault(name + ".grad", []).append(p.grad.full_tensor().cpu())
        opt.step()
        opt.zero_grad()
        assert_sharded(model, step)
        for name, p in model.named_parameters():
            seen.setdefault(name, []).append(p.full_tensor().detach().cpu())
    return seen


def check_odd_shapes(pool: RankPool, impl: str) -> None:
    __tracebackhide__ = True
    ref = run(pool, odd_shapes_job, None)[0]
    got = run(pool, odd_shapes_job, impl)[0]
    for name, values in ref.items():
        if name not in got:
            raise AssertionError(f"odd shapes, world {pool.world_size}: {name.removesuffix('.grad')} has no "
                                 f"{'gradient' if name.endswith('.grad') else 'value'} in the hand-written run")
        for step, (a, b) in enumerate(zip(values, got[name]), start=1):
            if not torch.equal(a, b):
                raise AssertionError(f"odd shapes, world {pool.world_size}: {name} differs from FSDP2's "
                                     f"at step {step} (max abs diff {(a - b).abs().max().item():.3g}); "
                                     "check padding of shards that torch.chunk leaves short or empty")


# ---- memory: full parameters are freed when they should be


def residency_job(cfg: train.Config) -> list[str]:
    """Train with probes on every block: the full parameters a block computed with must be
    freed after its forward (when it reshards after forward) and all of them by the end of
    each step. Freed means dropped, or storage resized to zero (tensors autograd still holds)."""
    problems: list[str] = []
    gathered: dict[str, list[weakref.ref]] = {}

    def alive(refs: list[weakref.ref]) -> int:
        return sum(t.untyped_storage().nbytes() for r in refs if (t := r()) is not None)

    def probe(name: str, block: nn.Module) -> None:
        # Registered after fully_shard: the pre-hook runs after FSDP's (prepended) pre-forward,
        # the post-hook after FSDP's post-forward.
        def pre(module, args):
            gathered[name] = [weakref.ref(p) for p in module.parameters() if not isinstance(p, DTensor)]

        def post(module, args, output):
            if cfg.reshard_after_forward and (n := alive(gathered.get(name, []))):
                problems.append(f"{name}: {n / 2**20:.2f} MiB of full parameters still alive after its "
                                "forward (reshard_after_forward=True: free them in post-forward)")

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)

    def inspect(model: nn.Module, step: int) -> None:
        if step == 0:
            for name, block in model.layers.named_children():
                probe(f"layers.{name}", block)
            return
        if not gathered:
            problems.append(f"step {step}: no block computed with full (non-DTensor) parameters")
        for name, refs in gathered.items():
            if n := alive(refs):
                problems.append(f"{name}: {n / 2**20:.2f} MiB of full parameters still alive after step {step} "
                                "(free them after backward)")

    train.train(cfg, inspect=inspect)
    return problems


def check_residency(pool: RankPool, impl: str, **overrides) -> None:
    __tracebackhide__ = True
    for which in (None, impl):
        cfg = config(which, **overrides)
        problems = run(pool, residency_job, cfg)[0]
        if problems:
            who = "FSDP2" if which is None else "the hand-written FSDP"
            raise AssertionError(f"{describe(cfg, pool.world_size)}, {who}: " + "; ".join(problems[:5]))


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage that a Python-visible tensor holds (parameters, DTensors'
    local tensors, optimizer state, anything a list or attribute keeps): exact, whatever the
    allocator or the threads did. A leak of tensors that Python keeps shows here to the byte."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # isinstance would query proxies for __class__
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type != "cpu" or type(t) not in (torch.Tensor, nn.Parameter):
            continue
        s = t.untyped_storage()
        storages[s.data_ptr(), s.nbytes()] = s.nbytes()
    return sum(storages.values())


@dataclasses.dataclass
class Memory:
    """One rank's memory in one run (bytes; per step from step 1): peaks, the bytes held at the end
    of each step, and the bytes of Python-visible tensors then; and the model's block sizes."""

    peaks: list[int]
    held: list[int]
    live: list[int]
    block_reduce: int
    """one block's parameters in the reduce dtype: its reduce-scatter input"""
    block_largest: int
    """one block's parameters in the larger of the parameter and reduce dtypes: the largest
    buffer of one collective"""


def memory_job(cfg: train.Config) -> Memory:
    """This rank's memory per step: on CPU what memory.TensorPeaks counts (the same on every
    platform), on CUDA the caching allocator's peak and current allocated bytes."""
    from torchtitan.models.llama3.model.model import TransformerBlock

    with torch.device("meta"):
        block = TransformerBlock(0, model_setup.model_args(cfg.model, cfg.seq_len, assets.vocab_size()))
    params = sum(p.numel() for p in block.parameters())
    reduce = train.DTYPES[cfg.reduce_dtype] or train.DTYPES[cfg.param_dtype] or torch.float32
    compute = train.DTYPES[cfg.param_dtype] or torch.float32
    live, held = [], []
    device = current_device(cfg.device)
    if device.type == "cuda":
        def inspect(model: nn.Module, step: int) -> None:
            if step:
                live.append(live_tensor_bytes())
                held.append(torch.cuda.memory_allocated(device))

        peaks = train.train(cfg, inspect=inspect).peak_memory
    else:
        with memory.TensorPeaks() as tp:
            def inspect(model: nn.Module, step: int) -> None:
                tp.mark()  # step 0: the model is built and wrapped
                if step:
                    live.append(live_tensor_bytes())

            train.train(cfg, inspect=inspect)
        peaks, held = tp.peaks[1:], tp.levels[1:]
    return Memory(peaks, held, live, params * reduce.itemsize, params * max(reduce.itemsize, compute.itemsize))


# What is compared: per rank, the least over steps 2..N of each step's peak (step 1 also pays one-time
# allocations: the optimizer's state). On CPU that is tensor memory, the bytes c10's allocator held
# (memory.TensorPeaks), the same measure on every platform, so a file gets the same verdict on a
# student's Mac as on the grader's Linux. (The peak resident set with --exact-cpu-memory, which this
# check used before, exists on Linux only, varied by up to 1.9 MiB between runs, and also sees what no
# FSDP decides: malloc's overhead, gloo's transport buffers, Python objects; train.py still logs it.)
# A step's peak is what the schedule holds at its fullest plus, in some steps, a buffer that gloo's
# worker thread is still releasing (a finished collective's buffers are freed by whichever thread
# drops the work last, and the main thread does not wait for gloo's): the least over steps leaves
# those out and keeps whatever the FSDP holds in every step. The hand-written FSDP may exceed FSDP2 by:
#   * what overlapping costs on gloo: gloo copies a reduce-scatter's input when it is issued and
#     keeps the copy while it runs, i.e. during the next block's backward (FSDP2 on CPU waits at
#     once): one block's reduce-scatter input (3.25 MiB in float32 at world 2, debug model);
#   * LATE_BUFFERS collective buffers still on their way out in every step compared (at most one
#     block in the larger of the parameter and reduce dtypes each).
# Measured on 2 busy cores (debug model, world 2, 4 steps of 2 micro-steps, fresh ranks; MiB, least of
# steps 2..4 per rank; FSDP2 and the reference 3 times each in the four precision cases and bonus modes
# in float32, twice or once for the bonuses in the other precision cases): FSDP2's value is one number
# per configuration in every run (float32 80.961, float32-bfloat16 80.468, bfloat16-float32 68.521,
# bfloat16-bfloat16 66.089), single steps above it only by whole late buffers (+3.252, +1.626,
# +0.493). The reference over FSDP2, with the allowance:
#                        float32        float32-bfloat16  bfloat16-float32  bfloat16-bfloat16
#   tasks 1-3            +1.63..+2.75   +0.43..+1.50      +3.24 (always)    -0.01..+0.62
#   bonus 1              -0.38          -1.00             +1.62             0.00
#   bonus 2              +2.17..+2.54   +0.81..+1.13      +3.24             -0.01..+0.62
#   bonus 3              +0.12..+0.75   +1.00..+1.25      -0.38..-0.06      -0.81..-0.47
#   allowed              +6.50          +4.88             +6.50             +3.25
# Keeping every block gathered from forward to backward (the `no-reshard-after-forward` mutant) costs
# +11.38 in float32 and +8.12 in bfloat16-float32, in every run: it fails.
LATE_BUFFERS = 1
# Leaks: the bytes of Python-visible tensors are the same at the end of every step from step 2 on,
# which finds a list or attribute that keeps tensors; the bytes the allocator holds at the end of each
# step also see tensors only C++ keeps (an autograd graph, a collective's work). Both were equal to the
# byte at the end of every step for FSDP2 and the reference in every run above; the latter may grow by
# a late buffer (LATE_BUFFERS), so only growth beyond it counts.


def check_memory(pool: RankPool, impl: str, param_dtype: str, reduce_dtype: str, **overrides) -> str:
    """Peak memory per step (tensor memory on CPU) within one reduce-scatter input and a late buffer of
    FSDP2's, and no growth.

    Each run gets fresh ranks forked from the same preloaded image, so absolute numbers compare
    (in a long-lived process, what earlier jobs left behind shifts them)."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    what = describe(cfg, pool.world_size)
    runs = {}
    for name, c in (("FSDP2", as_fsdp2(cfg)), ("hand-written", cfg)):
        with RankPool(pool.world_size, device=pool.device) as fresh:
            runs[name] = run(fresh, memory_job, c)
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    worst, margin = -float("inf"), 0
    for rank, (ref, got) in enumerate(zip(runs["FSDP2"], runs["hand-written"])):
        if any(n != got.live[1] for n in got.live[1:]):  # step 1 may still create state (the optimizer's)
            raise AssertionError(f"{what}: rank {rank} holds {', '.join(mib(n) for n in got.live)} of tensors at the "
                                 f"end of steps 1 to {len(got.live)} (each distinct storage a Python-visible tensor "
                                 "holds): something leaks every step (a list or attribute that keeps tensors)")
        late = LATE_BUFFERS * got.block_largest
        if (growth := got.held[-1] - got.held[1]) > late:
            raise AssertionError(f"{what}: rank {rank} holds {mib(growth)} more tensor memory at the end of step "
                                 f"{len(got.held)} than at the end of step 2 ({', '.join(mib(x) for x in got.held)}): "
                                 "something leaks every step (tensors kept by a collective's work, an autograd "
                                 "graph or a buffer that is never freed)")
        margin = got.block_reduce + late
        steady_ref, steady = min(ref.peaks[1:]), min(got.peaks[1:])
        worst = max(worst, steady - steady_ref)
        if steady > steady_ref + margin:
            raise AssertionError(
                f"{what}: rank {rank}'s peak memory per step is {mib(steady)}, FSDP2's {mib(steady_ref)} "
                f"(+{mib(steady - steady_ref)}, allowed {mib(margin)}: one block's reduce-scatter input and one "
                "collective's buffer freed late; the least of steps 2.., tensor memory): something is kept longer "
                f"than FSDP2 keeps it (gathered parameters, gradients, communication buffers). Per step: "
                f"hand-written {', '.join(mib(x) for x in got.peaks)}; FSDP2 {', '.join(mib(x) for x in ref.peaks)}")
    return f"peak {worst / 2**20:+.1f} MiB over FSDP2 (allowed +{margin / 2**20:.1f})"


# ---- overlap, from the profiler traces


@dataclasses.dataclass
class Profiles:
    """One profiled run of FSDP2 and of the hand-written FSDP, analysed."""

    what: str
    fsdp2: "analysis.RunStats"
    effdl: "analysis.RunStats"


def profile_both(pool: RankPool, impl: str, folder, memory: bool = False, **overrides) -> Profiles:
    __tracebackhide__ = True
    cfg = config(impl, num_steps=3, profile_steps=2, **overrides)
    return run_profiled(pool, cfg, folder, describe(cfg, pool.world_size), memory=memory)[0]


def run_profiled(pool: RankPool, cfg_effdl: train.Config, folder, what: str, check_shards: bool = False,
                 memory: bool = False):
    """Profiled runs of FSDP2 and the hand-written FSDP (same config otherwise): their analysed
    traces under folder/<fsdp2|effdl>/traces, and per implementation the per-rank (result, digests)
    of train_job. The checks read the schedule and the collectives only, so by default there are
    no allocation events and no snapshots (memory=True: snapshots in folder/<...>/snapshots)."""
    __tracebackhide__ = True
    from harness import analysis

    results, stats = {}, {}
    for name, cfg in (("fsdp2", as_fsdp2(cfg_effdl)), ("effdl", cfg_effdl)):
        cfg = dataclasses.replace(cfg, traces_dir=folder / name / "traces", profile_memory=memory,
                                  snapshots_dir=folder / name / "snapshots" if memory else None)
        results[name] = run(pool, train_job, cfg, check_shards)
        stats[name] = analysis.analyze_run(cfg.traces_dir)
    return Profiles(what, stats["fsdp2"], stats["effdl"]), results


def assert_same_collectives(p: Profiles, promise: str = "") -> None:
    """The same number of all-gathers and reduce-scatters as FSDP2, phase by phase."""
    __tracebackhide__ = True
    for kind in ("all_gather", "reduce_scatter"):
        a, b = p.fsdp2.comm.kind(kind).count_by_phase, p.effdl.comm.kind(kind).count_by_phase
        if a != b:
            raise AssertionError(
                f"{p.what}: {kind.replace('_', '-')}s per step by phase: FSDP2 {fmt(a)}, hand-written "
                f"{fmt(b)}{promise}. Expected one per group and micro-step where FSDP2 has one; an extra "
                "all-gather in backward often means the root was resharded after forward (FSDP2 keeps "
                "it gathered), a missing one a prefetch that was never waited for")


def fmt(counts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in counts.items()) + "}" if counts else "none"


# Overlap is judged by schedule, not by time: a collective is overlapped when the main thread ran
# compute of another group between issuing it and waiting for it (analysis.schedule), which is
# the same on every run of a program however busy the machine. Time fractions (how much of the
# collectives' time compute ran) depend on thread scheduling (under load the reference's fell
# from 30-58 % to 7 %) and are only shown as evidence. FSDP2 on CPU waits for each right away.
OVERLAP = {
    "forward": [("all_gather", "forward", "task 2: start the next group's all-gather asynchronously "
                 "in pre-forward and wait for it only when that group runs")],
    "backward": [("all_gather", "backward", "task 3: in pre-backward start gathering the group that "
                  "runs backward next, before this group computes"),
                 ("reduce_scatter", "backward", "task 3: leave each reduce-scatter in flight while the "
                  "next group runs its backward")],
}


def assert_overlap(p: Profiles, which: str) -> str:
    """Every collective of the phase that FSDP's schedule can overlap (all but the first all-gather
    and the last reduce-scatter of a pass, see analysis.must_overlap) is issued before, and waited
    for after, compute of another group."""
    __tracebackhide__ = True
    assert_same_collectives(p)
    shown = []
    for kind, phase, fix in OVERLAP[which]:
        if not p.effdl.comm.kind(kind).by_phase[phase].count:
            continue  # a mode without such collectives (no all-gather in backward, say)
        done, could, missed = p.effdl.overlap(kind, phase)
        ref_done, ref_could, _ = p.fsdp2.overlap(kind, phase)
        name = f"{kind.replace('_', '-')}s in {phase}"
        issued = sum(s.kind(kind).by_phase[phase].count for s in p.effdl.steps)
        if (placed := sum((s.kind, s.phase) == (kind, phase) for s in p.effdl.scheduled)) < issued:
            raise AssertionError(
                f"{p.what}: {name}: {issued - placed:g} of {issued:g} were issued outside a group's "
                f"`FSDP::{'all_gather' if kind == 'all_gather' else 'post_backward_reduce'} (name)` range, so "
                "where they are waited for cannot be told: issue them in FSDPGroup.unshard / reduce_scatter.")
        if missed:
            s = missed[0]
            where = (f"rank {s.rank}, step {s.step}: {s.group}'s was waited for before any other group computed"
                     if s.waited is not None else
                     f"rank {s.rank}, step {s.step}: {s.group}'s was never waited for in FSDP's ranges "
                     "(all_gather_copy_out / PendingReduce.finish)")
            raise AssertionError(
                f"{p.what}: {name}: {done} of the {could} that can overlap compute did ({where}; FSDP2 on "
                f"CPU: {ref_done} of {ref_could}, it waits at once). They are not overlapped: {fix}.")
        hidden = p.effdl.comm.kind(kind).by_phase[phase].hidden_fraction
        shown.append(f"{phase} {kind.replace('_', '-')}s {done}/{could} overlapped ({hidden:.0%} of their time hidden)")
    return ", ".join(shown)


# ---- the bonuses: FSDP2's gradient-accumulation and resharding controls


@dataclasses.dataclass(frozen=True)
class Mode:
    """A bonus mode: train.py flags, and what it promises about the collectives of a step."""

    name: str
    flags: dict
    promise: str
    holds: "Callable[[analysis.StepStats, int], bool]"
    """(mean counts per step, number of groups) -> whether the promise holds."""


def _count(stats, kind: str, phase: str) -> float:
    return stats.kind(kind).by_phase[phase].count


MODES = {
    "bonus1": Mode("bonus 1 (reshard_after_forward=False)", dict(reshard_after_forward=False),
                   "no all-gather in backward",
                   lambda s, groups: _count(s, "all_gather", "backward") == 0),
    "bonus2": Mode("bonus 2 (set_reshard_after_backward(False) before the last micro-step)",
                   dict(reshard_after_backward_before_last_backward=False),
                   "all-gathers in forward only in the first micro-step (one per group)",
                   lambda s, groups: _count(s, "all_gather", "forward") == groups),
    "bonus3": Mode("bonus 3 (set_requires_gradient_sync(False) before the last micro-step)",
                   dict(reduce_grads_before_last_backward=False),
                   "reduce-scatters only in the last backward (one per group)",
                   lambda s, groups: _count(s, "reduce_scatter", "backward") == groups),
}


def check_mode(pool: RankPool, impl: str, modes: list[str], param_dtype: str, reduce_dtype: str, folder) -> str:
    """One profiled run each of FSDP2 and the hand-written FSDP in the given bonus modes: the
    collectives per phase equal FSDP2's and keep each mode's promise, overlap still holds, and
    every loss, grad norm and parameter shard equals FSDP2's."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, num_steps=3, profile_steps=1,
                 **mode_flags(modes))
    label = " + ".join(MODES[m].name for m in modes)
    what = f"{label}, {describe(cfg, pool.world_size)}"
    profiles, results = run_profiled(pool, cfg, folder, what, check_shards=True)
    stats = {"fsdp2": profiles.fsdp2, "effdl": profiles.effdl}
    # FSDP groups as FSDP2 labels them (each block and the root; the model is never built here)
    groups = len({s.group for s in profiles.fsdp2.scheduled if s.kind == "all_gather"})
    if not groups:
        raise RuntimeError(f"{what}: FSDP2's trace shows no `FSDP::all_gather (name)` range: this torch "
                           "labels FSDP2's phases differently; update GROUP_RANGE in harness/analysis.py")
    for m in modes:
        for who in ("fsdp2", "effdl"):
            s = stats[who].comm
            if not MODES[m].holds(s, groups):
                shown = {k: fmt(s.kind(k).count_by_phase) for k in ("all_gather", "reduce_scatter")}
                raise AssertionError(
                    f"{what}: {'FSDP2' if who == 'fsdp2' else 'the hand-written FSDP'} breaks the promise of "
                    f"{MODES[m].name}: {MODES[m].promise}; the trace shows per step all-gathers "
                    f"{shown['all_gather']}, reduce-scatters {shown['reduce_scatter']} ({groups} groups, "
                    f"{cfg.num_gradient_accumulation_steps} micro-steps)")
    assert_same_collectives(profiles, f" (in {label})")
    hidden = [assert_overlap(profiles, which) for which in ("forward", "backward")]
    ref, got = results["fsdp2"], results["effdl"]
    assert_same_numbers(ref[0][0], got[0][0], what)
    assert_same_parameters([d for _, d in ref], [d for _, d in got], what, pool, cfg)
    return f"{MODES[modes[-1]].promise}; " + ", ".join(h for h in hidden if h)


# ---- grading: communication observed, FSDP2 not used, forward alone


from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from harness import handwritten  # noqa: E402

# Collective ops as the dispatcher sees them (eager c10d and functional), by kind; the input
# tensor is what each rank puts on the wire.
_COLLECTIVES = {
    "_allgather_base_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
}


class CommLog(TorchDispatchMode):
    """Every all-gather and reduce-scatter a rank issues: (step, phase, kind, dtype, bytes), and
    whether FSDP2 issued it (its ops or its source on the stack)."""

    def __init__(self):
        super().__init__()
        self.step = 0  # set by the job: 0 is wrapping, then the optimizer step under way
        self.events: list[tuple[int, str, str, str, int]] = []
        self.fsdp2: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "fsdp" and self.fsdp2 is None:
            self.fsdp2 = f"it runs FSDP2's op fsdp::{name}"
        if ns in ("c10d", "_c10d_functional") and name in _COLLECTIVES:
            kind, index = _COLLECTIVES[name]
            tensors = args[index] if isinstance(args[index], (list, tuple)) else [args[index]]
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            for t in tensors:
                self.events.append((self.step, phase, kind, str(t.dtype).removeprefix("torch."),
                                    t.numel() * t.element_size()))
            if self.fsdp2 is None:
                self.fsdp2 = handwritten.stack_problem()
        return func(*args, **kwargs)

    def sent(self, phase: str) -> dict:
        """{(kind, dtype, bytes): count} of one phase, over all steps after wrapping."""
        out: dict = {}
        for step, ph, kind, dtype, nbytes in self.events:
            if step > 0 and ph == phase:
                out[(kind, dtype, nbytes)] = out.get((kind, dtype, nbytes), 0) + 1
        return out


def fsdp2_problem(model: nn.Module, cfg: train.Config) -> str | None:
    if cfg.fsdp != "effdl":
        return None
    return handwritten.module_problem(train.fsdp_module(cfg)) or handwritten.model_problem(model)


class Probes:
    """Hooks on every block: its gathered (non-DTensor) parameters must be freed after its
    forward (when it reshards after forward) and, with their full gradients, by the end of
    each step. Freed means dropped, or storage resized to zero (tensors autograd still holds)."""

    def __init__(self, model: nn.Module, reshard_after_forward: bool):
        self.problems: list[str] = []
        self.gathered: dict[str, list[weakref.ref]] = {}
        self.grads: dict[str, list[weakref.ref]] = {}
        self._hooked: set[int] = set()
        for name, block in model.layers.named_children():
            self._probe(f"layers.{name}", block, reshard_after_forward)

    @staticmethod
    def alive(refs: list[weakref.ref]) -> int:
        return sum(t.untyped_storage().nbytes() for r in refs if (t := r()) is not None)

    def _probe(self, name: str, block: nn.Module, reshard_after_forward: bool) -> None:
        # Registered after fully_shard: the pre-hook runs after FSDP's (prepended) pre-forward,
        # the post-hook after FSDP's post-forward.
        def pre(module, args):
            full = [p for p in module.parameters() if not isinstance(p, DTensor)]
            self.gathered[name] = [weakref.ref(p) for p in full]
            for p in full:
                if p.requires_grad and id(p) not in self._hooked:
                    self._hooked.add(id(p))
                    p.register_hook(lambda g, n=name: self.grads.setdefault(n, []).append(weakref.ref(g)) or g)

        def post(module, args, output):
            if reshard_after_forward and (n := self.alive(self.gathered.get(name, []))):
                self.problems.append(f"{name}: {n / 2**20:.2f} MiB of gathered parameters still alive after its "
                                     "forward (reshard_after_forward=True: free them in post-forward)")

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)

    def after_step(self, step: int) -> None:
        if not self.gathered:
            self.problems.append(f"step {step}: no block computed with full (non-DTensor) parameters")
        for name, refs in self.gathered.items():
            if n := self.alive(refs):
                self.problems.append(f"{name}: {n / 2**20:.2f} MiB of gathered parameters still alive after "
                                     f"step {step} (free them after backward)")
            kept = sum(g.untyped_storage().nbytes() for r in refs if (p := r()) is not None and (g := p.grad) is not None)
            kept += self.alive(self.grads.pop(name, []))
            if kept:
                self.problems.append(f"{name}: {kept / 2**20:.2f} MiB of full gradients still alive after step "
                                     f"{step} (free them once they are laid out for the reduce-scatter)")


@dataclasses.dataclass
class Run:
    """What one rank saw of one run: numbers, shard digests, memory problems, collectives."""

    result: "train.TrainResult | None"
    digests: list[dict[str, str]]
    problems: list[str]
    comm: CommLog
    fsdp2: str | None
    forward_loss: float | None = None


def step_job(cfg: train.Config) -> Run:
    """Train under a CommLog with Probes; shards checked and digested after wrapping and every step."""
    log, digests, holder = CommLog(), [], {}

    def inspect(model: nn.Module, step: int) -> None:
        if step == 0:
            holder["fsdp2"] = fsdp2_problem(model, cfg)
            holder["probes"] = Probes(model, cfg.reshard_after_forward)
        else:
            holder["probes"].after_step(step)
        assert_sharded(model, step)
        digests.append({name: digest(p) for name, p in model.named_parameters()})
        log.step = step + 1

    try:
        with log:
            result = train.train(cfg, inspect=inspect)
    except BaseException as e:
        e.add_note(f"(in step {log.step} of {cfg.num_steps}, rank {dist.get_rank()})" if log.step else
                   "(while wrapping the model with fully_shard)")
        raise
    return Run(result, digests, holder["probes"].problems, log, holder["fsdp2"] or log.fsdp2)


def forward_job(cfg: train.Config) -> Run:
    """Wrap as train.py does and run the first micro-step's forward only (no backward)."""
    import torch.nn.functional as F

    rank, world = dist.get_rank(), dist.get_world_size()
    device = current_device(cfg.device)
    if rank == 0:
        assets.ensure(train.ROOT, log=lambda msg: None)
    dist.barrier()
    model = model_setup.build_model(cfg.model, cfg.seq_len, cfg.seed, device, assets.vocab_size(train.ROOT))
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    model = train.apply_fsdp(model, train.fsdp_module(cfg), mesh, cfg)
    assert_sharded(model, 0)
    problem = fsdp2_problem(model, cfg)
    probes = Probes(model, cfg.reshard_after_forward)
    data = train.build_data(cfg, rank, world)
    inputs, labels = next(data)
    log = CommLog()
    log.step = 1
    with log:
        logits = model(inputs["input"].to(device))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(device).flatten(0, 1)) / cfg.num_gradient_accumulation_steps
    when = "after the first forward"
    for name, p in model.layers.named_parameters():
        if not isinstance(p, DTensor):
            probes.problems.append(f"{when}: layers.{name} is a {type(p).__name__}, not its sharded DTensor "
                                   "(a block that reshards after forward puts its sharded parameters back)")
            break
    return Run(None, [], probes.problems, log, problem or log.fsdp2, forward_loss=loss.item())


def run_graded(pool: RankPool, job, cfg: train.Config) -> tuple[list[Run], list[Run]]:
    """FSDP2's and the hand-written FSDP's runs of `job`; fails at once if the latter is FSDP2."""
    __tracebackhide__ = True
    ref = run(pool, job, as_fsdp2(cfg))
    got = run(pool, job, cfg)
    for rank, r in enumerate(got):
        if r.fsdp2:
            raise AssertionError(f"{cfg.impl}: {handwritten.verdict(r.fsdp2)} [rank {rank}]")
    return ref, got


def assert_same_comm(ref: list[Run], got: list[Run], phase: str, what: str) -> str:
    """Per phase, the all-gathers and reduce-scatters (dtype and bytes of each) equal FSDP2's."""
    __tracebackhide__ = True
    def show(sent: dict) -> str:
        return ", ".join(f"{n} x {k.replace('_', '-')} {d} {b:,} B" for (k, d, b), n in sorted(sent.items())) or "nothing"

    for rank, (a, b) in enumerate(zip(ref, got)):
        sa, sb = a.comm.sent(phase), b.comm.sent(phase)
        if sa != sb:
            wrong_dtype = {d for _, d, _ in sb} - {d for _, d, _ in sa}
            hint = (f" The wire carries {', '.join(sorted(wrong_dtype))} where FSDP2 sends "
                    f"{', '.join(sorted({d for _, d, _ in sa}))}: cast before the all-gather (H6) and reduce "
                    "in the reduce dtype (H8)." if wrong_dtype else
                    " One collective per group and phase, each the group's padded shards (H1, H5).")
            raise AssertionError(f"{what}: rank {rank}'s {phase} collectives differ from FSDP2's: the hand-written "
                                 f"FSDP sent {show(sb)}; FSDP2 sent {show(sa)}.{hint}")
    total = sum(n * nbytes for (_, _, nbytes), n in ref[0].comm.sent(phase).items())
    return f"{phase}: {sum(ref[0].comm.sent(phase).values())} collectives, {total / 2**20:.1f} MiB as FSDP2"


def check_forward(pool: RankPool, impl: str, param_dtype: str, reduce_dtype: str) -> str:
    """Task 1, forward: the first forward's loss bit-identical to FSDP2's on every rank, parameters
    Shard(0) DTensors before and the blocks' after, each block's gathered parameters freed after
    its forward, and the forward's all-gathers (dtype, bytes) FSDP2's. Returns the evidence."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    what = describe(cfg, pool.world_size) + ", first forward"
    ref, got = run_graded(pool, forward_job, cfg)
    for rank, (a, b) in enumerate(zip(ref, got)):
        if b.problems:
            raise AssertionError(f"{what}: rank {rank}: " + "; ".join(b.problems[:3]))
        if a.forward_loss != b.forward_loss:
            raise AssertionError(f"{what}: rank {rank}'s loss is {b.forward_loss!r}, FSDP2's {a.forward_loss!r} "
                                 f"({ulps(a.forward_loss, b.forward_loss)}): the gathered parameters differ "
                                 "from FSDP2's (rows, padding, casts: H1, H6)")
    return assert_same_comm(ref, got, "forward", what)


def ulps(a: float, b: float) -> str:
    """How far apart two float32 values are, in units in the last place."""
    x, y = torch.tensor([a, b], dtype=torch.float32).view(torch.int32).tolist()
    return f"{abs(x - y)} ulp{'s' if abs(x - y) != 1 else ''} of float32 apart"


def check_step(pool: RankPool, impl: str, param_dtype: str, reduce_dtype: str, **overrides) -> str:
    """Task 1, step: every loss, grad norm and shard bit-identical to FSDP2's; gathered parameters
    and full gradients freed by the end of each step; every collective's dtype and bytes FSDP2's."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    what = describe(cfg, pool.world_size)
    ref, got = run_graded(pool, step_job, cfg)
    for rank, r in enumerate(got):
        if r.problems:
            raise AssertionError(f"{what}: rank {rank}: " + "; ".join(r.problems[:3]))
    assert_same_numbers(ref[0].result, got[0].result, what)
    assert_same_parameters([r.digests for r in ref], [r.digests for r in got], what, pool, cfg)
    evidence = [assert_same_comm(ref, got, phase, what) for phase in ("forward", "backward")]
    return f"{len(got[0].result.losses)} steps bit-identical; " + "; ".join(evidence)


_NOT_FSDP2: dict[str, str | None] = {}


def check_not_fsdp2(pool: RankPool, impl: str) -> None:
    """The file is not PyTorch's FSDP2: its source (static_problem) and one wrapped forward on the
    ranks (classes, state, hooks, ops, stack). Once per file and process."""
    __tracebackhide__ = True
    if impl not in _NOT_FSDP2:
        from harness.impl import impl_path

        problem = handwritten.static_problem(impl_path(impl))
        if problem is None:
            cfg = config(impl)
            try:
                problem = next((r.fsdp2 for r in run(pool, forward_job, cfg) if r.fsdp2), None)
            except RankError:
                problem = None  # its forward crashes: the graded tests say where
        _NOT_FSDP2[impl] = problem
    if _NOT_FSDP2[impl]:
        raise AssertionError(f"{impl}: {handwritten.verdict(_NOT_FSDP2[impl])}")

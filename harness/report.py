"""The writeup lab: one command measures what the writeup asks, as markdown tables and PNG plots.

    uv run python -m harness.report                          # the hand-written fsdp.py, full report (~5 min, 2 cores)
    uv run python -m harness.report --quick                  # small model, about a minute
    uv run python -m harness.report --impl path/to/fsdp.py --out my-report

Writes DIR/report.md (every table, every figure with the command that reproduces it),
DIR/*.png and DIR/report.json (the numbers). CPU + gloo by default; CUDA + NCCL when every rank
has a GPU (--device auto). Every run is on fresh ranks forked from one preloaded image; runs that
are compared alternate (A B, B A, ...) so a drifting machine load hits both alike, and
comparisons are quoted as ratios of medians.

Memory is what the tests trust: on CPU the peak resident set with --exact-cpu-memory (every free
of 64 KiB or more goes back to the OS, on whichever thread frees it) above the rank's resident
set before the model was built; on CUDA the peak allocated. The CPU memory snapshot
(snapshots/<run>/rank{r}.pickle) is not used: it shows allocations only (gloo frees buffers on
its own threads, which the profiler does not see), so its peak is not the process's. The parts of
memory (shards, grads, optimizer state, gathered params, saved activations) are measured in the
same runs from the tensors themselves (Components); communication buffers are analytic only.
Checks are on facts (bytes, counts, bits); timings only ever warn.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import train
from harness import analysis, assets, compat, impl, memory, model_setup
from harness.ranks import RankPool

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
NAMES = {"none": "DDP (no sharding)", "noprefetch": "hand-written, no prefetch",
         "effdl": "hand-written, prefetch", "fsdp2": "FSDP2"}


@dataclass(frozen=True)
class Args:
    """Measure FSDP2 and the FSDP under test for the writeup: markdown tables and PNG plots in --out.
    --quick: a small model, about a minute on 2 cores; default (full): torchtitan's debugmodel, about
    5 minutes on an idle 2-core machine. Exits 1 when a check on the measured facts fails."""

    impl: str = "student"
    """the FSDP under test: student (fsdp.py) or the path of a .py file."""
    quick: bool = False
    """a 2-block dim-128 model, one run of each, 3 message sizes: about a minute on 2 cores (the test
    runs it). Default, the full report: debugmodel, 3 repeats, 4 KiB..32 MiB, about 5 minutes."""
    out: Path = ROOT / "report"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when the machine has a GPU per rank for the largest world size, else CPU."""


@dataclass(frozen=True)
class Plan:
    """What each section runs: sizes and repeats."""

    model: dict
    seq_len: int
    batch_size: int
    steps: int
    repeats: int
    worlds: tuple[int, ...]
    sizes: tuple[int, ...]
    iters: int
    weak_layers: int
    bench_worlds: tuple[int, ...]


# quick: a 2-block, dim-128 model, 4 steps, one run each, 3 message sizes (about a minute on 2 cores);
# full: torchtitan's debugmodel (6 blocks, dim 256), 4 steps, 3 interleaved repeats, 4 KiB..32 MiB
# (about 5 minutes on an idle 2-core machine).
QUICK = Plan(dict(n_layers=2, dim=128, n_heads=8), 128, 1, 4, 1, (1, 2, 4),
             (4 * 2**10, 256 * 2**10, 4 * MiB), 3, 1, (2, 4))
FULL = Plan({}, 256, 2, 4, 3, (1, 2, 4),
            tuple(4 * 2**10 * 4**i for i in range(6)) + (32 * MiB,), 10, 2, (2, 4))


# --------------------------------------------------------------------------- jobs (run on every rank)


def train_job(cfg: train.Config, components: bool = False) -> dict:
    """One training run: per-step numbers, and the peak memory above this rank's baseline.
    components: also measure what the memory holds, part by part (see Components)."""
    import torch

    base = 0 if cfg.device == "cuda" else memory.resident_bytes()
    parts = Components() if components else None
    inspect = parts.attach if parts else None
    real_adamw = torch.optim.AdamW
    if parts:  # train() builds its optimizer inside; a subclass lets us read grads and state at step()
        torch.optim.AdamW = parts.optimizer_class(real_adamw)
    try:
        result = train.train(cfg, inspect=inspect)
    finally:
        torch.optim.AdamW = real_adamw
        if parts:
            parts.detach()
    out = dict(losses=result.losses, grad_norms=result.grad_norms, step_times=result.step_times,
               peak=max(result.peak_memory[1:] or result.peak_memory) - base)
    if parts:
        out["components"] = parts.result()
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Components:
    """Measures, on this rank, the bytes of each part of training memory:

    sharded params / grads: the local shards of the parameters, and of their gradients at the
    optimizer step (after backward, before they are freed); optimizer state: every AdamW state
    tensor (exp_avg, exp_avg_sq; `step` scalars counted apart); gathered params: the most bytes of
    unsharded parameters registered on modules at once (unique storages, read whenever autograd saves
    or unpacks a tensor: through forward and backward); activations: the unique storages autograd
    saved for backward in one forward, parameters excluded."""

    def __init__(self):
        self.params = self.params_numel = self.grads = self.optim = self.steps = 0
        self.gathered = self.activations = 0
        self._forward: dict[int, int] = {}  # storage -> bytes saved in the current forward
        self._hooks = None
        self._model = None

    def attach(self, model, step: int) -> None:
        import torch

        if step == 0:
            self._model = model
            self._param_ids = set()
            local = [_local(p) for p in model.parameters()]
            self.params = _nbytes(local)
            self.params_numel = sum(t.numel() for t in local)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()  # open for the whole run; closed in detach()
        self.activations = max(self.activations, sum(self._forward.values()))
        self._forward.clear()

    def detach(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _gathered_now(self) -> set[int]:
        from torch.distributed.tensor import DTensor

        storages = {}
        for m in self._model.modules():
            for _, p in m.named_parameters(recurse=False):  # what each module computes with right now
                if not isinstance(p, DTensor) and p.untyped_storage().nbytes():
                    storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        self.gathered = max(self.gathered, sum(storages.values()))
        return set(storages)

    def _pack(self, t):
        gathered = self._gathered_now()
        storage = t.untyped_storage()
        if not isinstance(t, __import__("torch").nn.Parameter) and storage.data_ptr() not in gathered:
            self._forward[storage.data_ptr()] = storage.nbytes()
        return t

    def _unpack(self, t):
        self._gathered_now()
        return t

    def optimizer_class(self, base):
        parts = self

        class Measured(base):
            def step(self, *args, **kwargs):
                params = [p for g in self.param_groups for p in g["params"]]
                parts.grads = max(parts.grads, _nbytes(_local(p.grad) for p in params if p.grad is not None))
                out = super().step(*args, **kwargs)
                state = [_local(v) for s in self.state.values() for k, v in s.items() if hasattr(v, "numel")]
                steps = [_local(v) for s in self.state.values() for k, v in s.items() if k == "step"]
                parts.optim, parts.steps = _nbytes(state) - _nbytes(steps), _nbytes(steps)
                return out

        return Measured

    def result(self) -> dict:
        self.activations = max(self.activations, sum(self._forward.values()))
        return {"sharded params": self.params, "grads": self.grads, "optimizer state": self.optim,
                "gathered params": self.gathered, "activations": self.activations,
                "params_numel": self.params_numel, "optimizer steps": self.steps}


def warm_up(pool: RankPool, cfg: train.Config) -> None:
    """A first run in a fresh process pays one-off costs (lazy imports, the data set's cache,
    allocator growth) that would land on whichever run came first."""
    pool.run(train_job, dataclasses.replace(cfg, num_steps=2))


def timeline_job(cfg: train.Config) -> dict:
    """Memory sampled every millisecond while training, with the phase ranges of every step."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else None
    base = 0 if device is not None else memory.resident_bytes()
    read = (lambda: torch.cuda.memory_allocated(device)) if device is not None else memory.resident_bytes
    t0 = time.perf_counter()
    samples, phases, stop = [], [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, read() - base))
            time.sleep(0.001)

    real = torch.profiler.record_function

    class phase_range(real):  # train_step marks its phases with "## forward ##" etc.
        def __enter__(self):
            self._start = time.perf_counter() - t0
            return super().__enter__()

        def __exit__(self, *exc):
            if self.name.startswith("## "):
                phases.append((self._start, time.perf_counter() - t0, self.name.strip("# ")))
            return super().__exit__(*exc)

    thread = threading.Thread(target=sample, daemon=True)
    torch.profiler.record_function = phase_range
    thread.start()
    try:
        result = train.train(cfg)
    finally:
        stop.set()
        thread.join()
        torch.profiler.record_function = real
    return dict(samples=samples, phases=phases, peaks=[p - base for p in result.peak_memory])


def comm_job(sizes: tuple[int, ...], iters: int) -> list[dict]:
    """All-gather and reduce-scatter of `size` bytes (nccl-tests' size: the gathered output, the
    reduce-scatter's input), float32; the slowest rank's mean time per call."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for size in sizes:
        n = max(world, size // 4 // world * world)
        big, small = torch.ones(n, device=device), torch.ones(n // world, device=device)
        for kind, run in (("all_gather", lambda: dist.all_gather_into_tensor(big, small)),
                          ("reduce_scatter", lambda: dist.reduce_scatter_tensor(small, big))):
            for _ in range(2):  # warm-up
                run()
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            _sync(device)
            t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append(dict(kind=kind, world=world, bytes=n * 4, seconds=t.item()))
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- analytic models


def model_shapes(plan: Plan, n_layers: int | None = None) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes per FSDP group (`<root>` and each block), from a model on the meta device."""
    import torch
    from torchtitan.models.llama3 import Transformer

    overrides = dict(plan.model, **({"n_layers": n_layers} if n_layers else {}))
    with torch.device("meta"):
        model = Transformer(model_setup.model_args("debug", plan.seq_len, assets.vocab_size(ROOT), **overrides))
    groups: dict[str, list] = {analysis.ROOT_GROUP: []}
    for name, p in model.named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else analysis.ROOT_GROUP
        groups.setdefault(key, []).append(tuple(p.shape))
    return groups


def padded_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements one rank sends: its torch.chunk rows padded to chunk 0's (H1)."""
    rows = math.ceil(shape[0] / world) if shape else 1
    return rows * math.prod(shape[1:])


def group_bytes(shapes: list[tuple[int, ...]], world: int, itemsize: int = 4) -> int:
    """A group's flat collective buffer: world x its padded shard."""
    return world * sum(padded_numel(s, world) for s in shapes) * itemsize


def memory_model(groups: dict, world: int, activations: int) -> dict[str, int]:
    """Bytes per rank (float32, AdamW): 4N/W params + 4N/W grads + 8N/W optimizer state, plus the
    root kept gathered and two blocks gathered at once (current + prefetched), one block's
    reduce-scatter input and gloo's copy of it, and the activations (calibrated, see report)."""
    shard = sum(padded_numel(s, world) for shapes in groups.values() for s in shapes) * 4
    blocks = [group_bytes(s, world) for k, s in groups.items() if k != analysis.ROOT_GROUP]
    root = group_bytes(groups[analysis.ROOT_GROUP], world)
    block = max(blocks) if blocks else 0
    return {"sharded params": shard, "grads": shard, "optimizer state": 2 * shard,
            "gathered params": root + 2 * block, "activations": activations, "comm buffers": 2 * block}


def comm_volume(groups: dict, world: int) -> dict[str, tuple[int, int]]:
    """Per step (reshard_after_forward: blocks gathered twice, the root once): (count, bytes)."""
    blocks = [k for k in groups if k != analysis.ROOT_GROUP]
    total = sum(group_bytes(groups[k], world) for k in groups)
    block_bytes = sum(group_bytes(groups[k], world) for k in blocks)
    return {"all_gather": (len(groups) + len(blocks), total + block_bytes), "reduce_scatter": (len(groups), total)}


def all_gathers(groups: dict, reshard_after_forward: bool) -> int:
    """All-gathers per step: every group in forward; the blocks again in backward when resharded."""
    return len(groups) + (len(groups) - 1 if reshard_after_forward else 0)


def measured_volume(trace_dir: Path) -> dict[str, tuple[float, float]]:
    """Per step, mean over profiled steps and ranks: (count, bytes) of each collective, read off the
    c10d ops' recorded shapes (all-gather: its output; reduce-scatter: its input)."""
    sums: dict[str, list[float]] = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
    steps = 0
    for path in analysis.rank_files(trace_dir, ".json"):
        t = analysis.Trace(path)
        steps += len(t.steps.ranges)
        for op in t.ops:
            kind, _, index = analysis.C10D_OPS[op["name"]]
            if kind not in sums or t.steps.at(op["ts"]) is None:
                continue
            index = 0 if kind == "all_gather" else index
            dims, dtype = op["args"]["Input Dims"][index], op["args"]["Input type"][index]
            sums[kind][0] += 1
            sums[kind][1] += math.prod(dims) * analysis.ITEMSIZE[dtype]
    return {k: (c / steps, b / steps) for k, (c, b) in sums.items()}


# --------------------------------------------------------------------------- checks


def check(data: dict) -> list[str]:
    """What must hold in every report, whatever the machine's load: facts, not timings. Each
    problem says what differs."""
    problems = []
    for row in data["comm_volume"]:
        if row["measured_count"] != row["analytic_count"] or row["measured_bytes"] != row["analytic_bytes"]:
            problems.append(f"{row['run']} {row['kind']}: measured {row['measured_count']:g} collectives, "
                            f"{row['measured_bytes']:,.0f} B per step; analytic {row['analytic_count']}, "
                            f"{row['analytic_bytes']:,} B")
    for row in data["reshard"]:
        if row["all_gathers"] != row["analytic_all_gathers"]:
            problems.append(f"{row['run']} reshard_after_forward={row['reshard_after_forward']}: "
                            f"{row['all_gathers']:g} all-gathers per step, analytic {row['analytic_all_gathers']}")
    losses = data["losses"]
    for run, curve in losses.items():
        if not all(math.isfinite(x) and x > 0 for x in curve):
            problems.append(f"{run}: non-finite or non-positive loss {curve}")
        elif run != "fsdp2" and curve != losses["fsdp2"]:
            problems.append(f"{run}: losses {curve} are not bit-identical to FSDP2's {losses['fsdp2']}")
    for row in data["memory"]:
        where = f"memory W={row['world']} {row['run']}"
        if not row["measured"] > 0:
            problems.append(f"{where}: measured peak {row['measured']} B")
        parts, model, sums = row["parts"], row["model"], row["rank_sums"]
        # Rank 0 holds chunk 0 of every parameter, the padded size, so the largest shard is the model's.
        for key in ("sharded params", "grads", "optimizer state"):
            if parts[key] != model[key]:
                problems.append(f"{where}: measured {key} {parts[key]:,} B on the largest rank, analytic {model[key]:,} B")
        if sums["params_numel"] != data["n_params"]:
            problems.append(f"{where}: the ranks' shards hold {sums['params_numel']:,} elements, the model has "
                            f"{data['n_params']:,}")
        if not parts["gathered params"] > 0 or not parts["activations"] > 0:
            problems.append(f"{where}: gathered params {parts['gathered params']} B, activations {parts['activations']} B")
    return problems


def timing_warnings(data: dict) -> list[str]:
    """Timings that look surprising; printed and written, never failed on (a loaded machine can do this)."""
    hidden = {r["run"]: r["hidden_share"] for r in data["step_time"]}
    warnings = []
    if "noprefetch" in hidden and "effdl" in hidden and not hidden["noprefetch"] < hidden["effdl"]:
        warnings.append(f"hidden share without prefetch ({hidden['noprefetch']:.0%}) is not below with prefetch "
                        f"({hidden['effdl']:.0%}): a loaded machine, or set_prefetch(False) does not stop prefetching")
    return warnings


# --------------------------------------------------------------------------- the report


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        print(f"[{self.done:2d}/{self.total}] {time.perf_counter() - self.start:6.0f} s  {what}", flush=True)


def main(args: Args) -> int:
    import torch

    plan = QUICK if args.quick else FULL
    flags = ["--impl", args.impl] + (["--quick"] if args.quick else [])
    path = impl.impl_path(args.impl)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= max(plan.worlds) else "cpu"
    if device == "cuda" and torch.cuda.device_count() < max(plan.worlds):
        print(f"error: --device cuda needs {max(plan.worlds)} GPUs (one per rank), found "
              f"{torch.cuda.device_count()}; use --device cpu", file=sys.stderr)
        return 2
    assets.ensure(ROOT)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "uv run python -m harness.report " + " ".join(flags)
    base = dict(model="debug", seq_len=plan.seq_len, batch_size=plan.batch_size, num_steps=plan.steps,
                profile_steps=0, log=False, device=device, **plan.model)
    cfgs = {"none": train.Config(fsdp="none", **base), "fsdp2": train.Config(fsdp="fsdp2", **base),
            "effdl": train.Config(fsdp="effdl", impl=args.impl, **base),
            "noprefetch": train.Config(fsdp="effdl", impl=args.impl, prefetch=False, **base)}
    groups = model_shapes(plan)
    data: dict = dict(command=command, impl=str(path), device=device, plan=dataclasses.asdict(plan),
                      n_params=sum(math.prod(s) for shapes in groups.values() for s in shapes),
                      memory=[], comm_bench=[], comm_volume=[], step_time=[], reshard=[], weak=[], losses={})
    progress = Progress(total=2 * len(plan.worlds) + 6)
    print(f"report: {path} on {device}; {'quick' if args.quick else 'full'}; out {out}", flush=True)

    # ---- world size 2: speed (fast pool), then memory (exact-memory pool)
    world = 2
    with RankPool(world, device=device) as pool:
        warm_up(pool, cfgs["fsdp2"])
        times: dict[str, list[float]] = {k: [] for k in cfgs}
        order = list(cfgs)
        for r in range(plan.repeats):
            for name in (order if r % 2 == 0 else order[::-1]):
                res = pool.run(train_job, cfgs[name])
                times[name].append(max(statistics.median(x["step_times"][1:]) for x in res))
                if name != "none" and r == 0:  # DDP averages gradients otherwise: not the same bits
                    data["losses"][name] = res[0]["losses"]
        progress(f"step time: {plan.repeats} interleaved runs of {', '.join(cfgs)}")
        traces = {}
        for name, cfg in cfgs.items():
            traces[name] = out / "traces" / name
            pool.run(train_job, dataclasses.replace(cfg, num_steps=3, profile_steps=2, traces_dir=traces[name],
                                                    snapshots_dir=out / "snapshots" / name))
        progress("profiled runs (traces: communication and hidden share)")
        for name in cfgs:
            comm = analysis.analyze_run(traces[name]).comm
            coll = [comm.kind(k) for k in analysis.KINDS]
            # Hidden share of the collectives that carry the model: DDP's gradient all-reduces, an
            # FSDP's all-gathers and reduce-scatters (the loss and grad-norm all-reduces are tiny).
            carried = [comm.all_reduce] if name == "none" else [comm.all_gather, comm.reduce_scatter]
            t_carried = sum(c.time_ms for c in carried)
            data["step_time"].append(dict(
                run=name, step_ms=statistics.median(times[name]) * 1e3,
                ratio=statistics.median(times[name]) / statistics.median(times["fsdp2"]),
                comm_share=sum(c.time_ms for c in coll) / comm.step_ms,
                hidden_share=sum(c.hidden_ms for c in carried) / t_carried if t_carried else 0.0,
                ag_hidden=comm.all_gather.hidden_fraction, rs_hidden=comm.reduce_scatter.hidden_fraction))
            if name != "none":
                measured, analytic = measured_volume(traces[name]), comm_volume(groups, world)
                for kind in analytic:
                    data["comm_volume"].append(dict(run=name, kind=kind, measured_count=measured[kind][0],
                                                    measured_bytes=measured[kind][1], analytic_count=analytic[kind][0],
                                                    analytic_bytes=analytic[kind][1]))
        for name in ("fsdp2", "effdl"):
            trace = out / "traces" / f"{name}-keep"
            pool.run(train_job, dataclasses.replace(cfgs[name], num_steps=3, profile_steps=2, reshard_after_forward=False,
                                                    traces_dir=trace, snapshots_dir=out / "snapshots" / f"{name}-keep"))
            for keep, tdir in ((False, traces[name]), (True, trace)):
                count, nbytes = measured_volume(tdir)["all_gather"]
                data["reshard"].append(dict(run=name, reshard_after_forward=not keep, all_gathers=count,
                                            all_gather_bytes=nbytes, analytic_all_gathers=all_gathers(groups, not keep)))
        progress("reshard_after_forward False: all-gathers per step")
        data["comm_bench"] = pool.run(comm_job, plan.sizes, plan.iters)[0]
        progress(f"collective microbenchmark, {len(plan.sizes)} sizes")

    # ---- memory per world size (exact memory), weak scaling on fast pools
    for w in plan.worlds:
        layers = plan.weak_layers * w
        with RankPool(w, device=device) as pool:
            warm_up(pool, dataclasses.replace(cfgs["fsdp2"], n_layers=layers))
            steps: dict[str, list[float]] = {"fsdp2": [], "effdl": []}
            for r in range(plan.repeats):  # interleaved A B, B A, ...: a drifting load hits both alike
                for name in (("fsdp2", "effdl") if (w + r) % 2 else ("effdl", "fsdp2")):
                    res = pool.run(train_job, dataclasses.replace(cfgs[name], n_layers=layers))
                    steps[name].append(max(statistics.median(x["step_times"][1:]) for x in res))
            for name, times_ in steps.items():
                step = statistics.median(times_)
                data["weak"].append(dict(world=w, run=name, n_layers=layers, step_ms=step * 1e3,
                                         tokens_per_s_per_rank=plan.batch_size * plan.seq_len / step))
            if w in plan.bench_worlds and w != 2:
                data["comm_bench"] += pool.run(comm_job, plan.sizes, plan.iters)[0]
        progress(f"weak scaling W={w} ({layers} blocks)")
        with RankPool(w, device=device) as pool:
            warm_up(pool, dataclasses.replace(cfgs["fsdp2"], exact_cpu_memory=True))
            for name in ("fsdp2", "effdl"):
                res = pool.run(train_job, dataclasses.replace(cfgs[name], exact_cpu_memory=True), components=True)
                parts = [x["components"] for x in res]
                row = dict(world=w, run=name, measured=max(x["peak"] for x in res),
                           parts={k: max(p[k] for p in parts) for k in parts[0]},
                           rank_sums={k: sum(p[k] for p in parts) for k in parts[0]})
                # Activations do not depend on W (fixed batch per rank): the model takes FSDP2's
                # measured saved bytes at the smallest W; the other rows test it.
                act = next((r["parts"]["activations"] for r in data["memory"] if r["run"] == "fsdp2"),
                           row["parts"]["activations"])
                row["model"] = memory_model(groups, w, act)
                data["memory"].append(row)
            if w == 2:
                for name in ("fsdp2", "effdl"):
                    res = pool.run(train_job, dataclasses.replace(cfgs[name], exact_cpu_memory=True,
                                                                  reshard_after_forward=False))
                    for row in data["reshard"]:
                        if row["run"] == name and not row["reshard_after_forward"]:
                            row["peak"] = max(x["peak"] for x in res)
                    for row in data["memory"]:
                        if row["world"] == 2:
                            for rrow in data["reshard"]:
                                if rrow["run"] == row["run"] and rrow["reshard_after_forward"]:
                                    rrow["peak"] = row["measured"]
                tl = pool.run(timeline_job, dataclasses.replace(cfgs["effdl"], exact_cpu_memory=True, num_steps=3))
                data["timeline"] = tl[0]
        progress(f"memory W={w} (exact)")

    data["checks"], data["warnings"] = check(data), timing_warnings(data)
    progress("checks")
    write(out, data, plan, groups)
    progress(f"wrote {out / 'report.md'}")
    for warning in data["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    for problem in data["checks"]:
        print(f"check failed: {problem}", file=sys.stderr)
    return 1 if data["checks"] else 0


# --------------------------------------------------------------------------- writing


def environment(data: dict) -> list[str]:
    import torch
    import torchtitan

    cpu = compat.cpu_name()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["| what | value |", "| --- | --- |",
            f"| python | {platform.python_version()} |", f"| torch | {torch.__version__} |",
            f"| torchtitan | {getattr(torchtitan, '__version__', '?')} |", f"| OS | {platform.platform()} |",
            f"| CPU | {cpu}, {os.cpu_count()} cores |", f"| GPU | {', '.join(gpus) or 'none'} |",
            f"| device / backend | {data['device']} / {'nccl' if data['device'] == 'cuda' else 'gloo'} |",
            f"| FSDP under test | `{data['impl']}` |", f"| world sizes | {', '.join(map(str, data['plan']['worlds']))} |"]


def write(out: Path, data: dict, plan: Plan, groups: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mib(x: float) -> str:
        return f"{x / MiB:.1f}"

    cmd = data["command"]
    n_params = sum(math.prod(s) for shapes in groups.values() for s in shapes)
    model = ", ".join(f"{k} {v}" for k, v in plan.model.items()) or "debugmodel (dim 256, 6 blocks, 16 heads)"
    md = [f"# FSDP report: `{Path(data['impl']).name}`", "",
          f"Reproduce: `{cmd}`. Model: {model}, {n_params:,} parameters (float32, AdamW), seq {plan.seq_len}, "
          f"batch {plan.batch_size} per rank, {plan.steps} steps (the first is warm-up).", "",
          "## Environment", "", *environment(data), ""]

    md += ["## Memory per rank", "",
           "Per rank, worst rank, MiB. **Measured** (m): the peak over steps 2.. of the resident set with "
           "`--exact-cpu-memory` above the rank's resident set before the model was built (CUDA: peak "
           "allocated), and, in the same run, each part: the local parameter shards; the local gradients at "
           "the optimizer step; AdamW's exp_avg and exp_avg_sq (its `step` scalars apart); the most bytes of "
           "gathered (unsharded) parameters registered on modules at once, read whenever autograd saves or "
           "unpacks a tensor (a prefetched group is not registered until it is waited on, so this counts one block "
           "where the model counts two); the unique storages autograd saved for backward in one forward, parameters "
           "excluded. **Analytic** (a): 4N/W sharded parameters, 4N/W gradients, 8N/W AdamW state (N padded "
           "as torch.chunk pads), the root kept gathered plus two blocks gathered (current and prefetched), "
           "the activations FSDP2 saved at W=1 (they do not depend on W), and communication buffers: one "
           "block's reduce-scatter input plus gloo's copy of it (**analytic only**: gloo's internal buffers "
           "cannot be read from Python). The check holds measured shards, gradients and optimizer state "
           "equal to the analytic ones exactly.", ""]
    keys = list(data["memory"][0]["model"])
    md += ["| W | FSDP | " + " | ".join(f"{k} m / a" if k != "comm buffers" else f"{k} (a)" for k in keys)
           + " | analytic total | measured peak | peak / analytic |",
           "| --- | --- | " + " | ".join("---" for _ in keys) + " | --- | --- | --- |"]
    for row in data["memory"]:
        total = sum(row["model"].values())
        cells = [f"{mib(row['parts'][k])} / {mib(row['model'][k])}" if k in row["parts"] else mib(row["model"][k])
                 for k in keys]
        md.append(f"| {row['world']} | {NAMES[row['run']]} | " + " | ".join(cells)
                  + f" | {mib(total)} | {mib(row['measured'])} | {row['measured'] / total:.2f} |")
    md += ["", "(MiB per rank.)", ""]
    fig, ax = plt.subplots(figsize=(7, 4))
    worlds = sorted({r["world"] for r in data["memory"]})
    bottom = [0.0] * len(worlds)
    for k in keys:
        vals = [next(r["model"][k] for r in data["memory"] if r["world"] == w) / MiB for w in worlds]
        ax.bar([str(w) for w in worlds], vals, bottom=bottom, label=f"model: {k}", alpha=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for name, marker in (("fsdp2", "o"), ("effdl", "x")):
        ax.plot([str(w) for w in worlds], [next(r["measured"] for r in data["memory"] if r["world"] == w and r["run"] == name) / MiB
                                            for w in worlds], marker, color="k", markersize=9, label=f"measured: {NAMES[name]}")
    ax.set(xlabel="world size W", ylabel="MiB per rank", title="Peak memory per rank")
    ax.legend(fontsize=7)
    _save(fig, out / "memory.png")
    md += [f"![memory](memory.png)  \n`{cmd}` (memory.png)", ""]

    bench_worlds = sorted({r["world"] for r in data["comm_bench"]})
    md += ["## Communication", "", f"### Collective microbenchmark (W={', '.join(map(str, bench_worlds))}, float32)", "",
           "nccl-tests definitions: size is the all-gather's output / the reduce-scatter's input; "
           "latency the slowest rank's mean time per call; algbw = size / time; busbw = algbw x (W-1)/W "
           "with the W the collective ran at (what each rank's link carries).", "",
           "| collective | W | size | latency (us) | algbw (GB/s) | busbw (GB/s) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in data["comm_bench"]:
        algbw = r["bytes"] / r["seconds"] / 1e9
        r["algbw"], r["busbw"] = algbw, algbw * (r["world"] - 1) / r["world"]
        md.append(f"| {r['kind']} | {r['world']} | {_size(r['bytes'])} | {r['seconds'] * 1e6:,.0f} | {algbw:.3f} | {r['busbw']:.3f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, w in ((k, w) for k in ("all_gather", "reduce_scatter") for w in bench_worlds):
        rows = [r for r in data["comm_bench"] if r["kind"] == kind and r["world"] == w]
        ax.plot([r["bytes"] for r in rows], [r["busbw"] for r in rows], "o-", label=f"{kind}, W={w}")
    ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title="Collective bus bandwidth")
    ax.legend()
    _save(fig, out / "comm_bandwidth.png")
    md += ["", f"![bandwidth](comm_bandwidth.png)  \n`{cmd}` (comm_bandwidth.png)", "",
           "### Bytes per training step (W=2)", "",
           "Measured from the profiled steps' c10d ops (all-gather: output buffer; reduce-scatter: input "
           "buffer; mean over steps and ranks) against the analytic volume: every group's padded flat "
           "buffer, all-gathered in forward and again in backward for the blocks (the root stays gathered), "
           "reduce-scattered once. Each rank sends and receives (W-1)/W of it.", "",
           "| FSDP | collective | count measured | count analytic | MiB measured | MiB analytic |", "| --- | --- | --- | --- | --- | --- |"]
    for r in data["comm_volume"]:
        md.append(f"| {NAMES[r['run']]} | {r['kind']} | {r['measured_count']:g} | {r['analytic_count']} | "
                  f"{r['measured_bytes'] / MiB:.3f} | {r['analytic_bytes'] / MiB:.3f} |")

    md += ["", "## Step time (W=2)", "",
           f"Median over {plan.repeats} interleaved runs of each run's median step; ratio to FSDP2. Communication "
           "share: collective wall time (union of intervals per kind) / step time; hidden share: the part of "
           "the model's collectives (DDP: all-reduces; FSDP: all-gathers and reduce-scatters) during which "
           "compute ran (harness/analysis.py, one profiled run each).", "",
           "| run | step (ms) | / FSDP2 | comm share | hidden share | all-gather hidden | reduce-scatter hidden |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["step_time"]:
        md.append(f"| {NAMES[r['run']]} | {r['step_ms']:.0f} | {r['ratio']:.2f} | {r['comm_share']:.0%} | "
                  f"{r['hidden_share']:.0%} | {r['ag_hidden']:.0%} | {r['rs_hidden']:.0%} |")

    md += ["", "## reshard_after_forward (W=2)", "",
           "| FSDP | reshard_after_forward | all-gathers per step (measured / analytic) | all-gather MiB per step | peak (MiB) |",
           "| --- | --- | --- | --- | --- |"]
    for r in data["reshard"]:
        md.append(f"| {NAMES[r['run']]} | {r['reshard_after_forward']} | {r['all_gathers']:g} / {r['analytic_all_gathers']} | "
                  f"{r['all_gather_bytes'] / MiB:.3f} | {mib(r.get('peak', 0))} |")

    md += ["", "## Weak scaling", "",
           f"The model grows with W ({plan.weak_layers} blocks per rank); batch per rank fixed; median over "
           f"{plan.repeats} interleaved runs of each run's median step. On a machine "
           "with fewer cores than ranks the ranks share cores, so tokens/s per rank falls for that reason too.", "",
           "| W | blocks | FSDP | step (ms) | tokens/s per rank |", "| --- | --- | --- | --- | --- |"]
    for r in data["weak"]:
        md.append(f"| {r['world']} | {r['n_layers']} | {NAMES[r['run']]} | {r['step_ms']:.0f} | {r['tokens_per_s_per_rank']:,.0f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("fsdp2", "effdl"):
        rows = [r for r in data["weak"] if r["run"] == name]
        ax.plot([r["world"] for r in rows], [r["tokens_per_s_per_rank"] for r in rows], "o-", label=NAMES[name])
    ax.set(xlabel="world size W (model grows with W)", ylabel="tokens/s per rank", title="Weak scaling")
    ax.legend()
    _save(fig, out / "weak_scaling.png")
    md += ["", f"![weak scaling](weak_scaling.png)  \n`{cmd}` (weak_scaling.png)", ""]

    losses = data["losses"]
    diff = max(abs(a - b) for k in losses for a, b in zip(losses["fsdp2"], losses[k]))
    md += ["## Loss curves (W=2)", "",
           f"{'Bit-identical' if diff == 0 else 'NOT identical'} across " + ", ".join(NAMES[k] for k in losses)
           + f": max |difference| from FSDP2 {diff:.3g}.", "",
           "| step | " + " | ".join(NAMES[k] for k in losses) + " |", "| --- |" + " --- |" * len(losses)]
    for i, vals in enumerate(zip(*losses.values()), 1):
        md.append(f"| {i} | " + " | ".join(f"{v:.6f}" for v in vals) + " |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, curve), style in zip(losses.items(), ("-", "--", ":")):
        ax.plot(range(1, len(curve) + 1), curve, style, marker="o", label=NAMES[name])
    ax.set(xlabel="step", ylabel="loss", title="Loss, W=2 (the curves lie on top of each other)")
    ax.legend()
    _save(fig, out / "loss.png")
    md += ["", f"![loss](loss.png)  \n`{cmd}` (loss.png)", ""]

    tl = data["timeline"]
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    for start, end, phase in tl["phases"]:
        ax.axvspan(start, end, color=colors.get(phase, "grey"), alpha=0.15)
    ax.plot([t for t, _ in tl["samples"]], [m / MiB for _, m in tl["samples"]], lw=0.8, color="k")
    for phase, c in colors.items():
        ax.axvspan(0, 0, color=c, alpha=0.3, label=phase)
    ax.set(xlabel="seconds", ylabel="MiB above baseline",
           title=f"Memory of rank 0, {NAMES['effdl']}, W=2 ({'allocated' if data['device'] == 'cuda' else 'RSS, exact CPU memory'})")
    ax.legend(fontsize=8)
    _save(fig, out / "memory_timeline.png")
    md += ["## Memory timeline (rank 0, W=2)", "",
           "Sampled every millisecond during 3 steps of the hand-written FSDP: on CPU the resident set with "
           "`--exact-cpu-memory` (what test_memory trusts), on CUDA the allocated bytes; forward, backward and "
           "optimizer phases shaded. Per-step peaks (MiB): " + ", ".join(mib(p) for p in tl["peaks"]) + ". "
           "The CPU memory snapshot in snapshots/ shows allocations only (gloo's frees are not recorded), so "
           "its peak is not this one.", "",
           f"![timeline](memory_timeline.png)  \n`{cmd}` (memory_timeline.png)", ""]

    md += ["## Checks", ""] + ([f"- FAILED: {p}" for p in data["checks"]] or
                               ["- measured collective counts and bytes equal the analytic volume",
                                "- all-gathers per step equal the analytic count, reshard_after_forward True and False",
                                "- losses bit-identical: FSDP2, hand-written with and without prefetch",
                                "- measured shards, gradients and optimizer state equal the analytic bytes; the "
                                "ranks' shards hold every parameter element once",
                                "- every loss finite and positive, every memory peak and part positive"])
    md += [f"- warning (timing, not a failure): {w}" for w in data["warnings"]]
    (out / "report.md").write_text("\n".join(md) + "\n")
    data = {k: v for k, v in data.items() if k != "timeline"}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 2**10:g} KiB"


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def cli(args: Args) -> int:
    from harness.errors import ConfigError
    from harness.ranks import RankError

    try:
        return main(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        todo = [line for line in str(e).splitlines() if "NotImplementedError: TODO(" in line]
        if not todo:
            raise
        print(f"error: {todo[-1].split(': ', 1)[1]} (in {impl.impl_path(args.impl)}): the report needs a file that "
              "trains (task 1 done)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    import tyro

    sys.exit(cli(tyro.cli(Args)))

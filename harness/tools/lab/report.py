"""The writeup lab: one command measures what the writeup asks, as markdown tables and PNG plots.

    uv run python -m harness.tools.lab.report                          # effdl (fsdp.py), full report (~5 min, 2 cores)
    uv run python -m harness.tools.lab.report --quick                  # small model, about a minute
    uv run python -m harness.tools.lab.report --impl path/to/fsdp.py --out my-report

Writes DIR/report.md (every table, every figure with the command that reproduces it),
DIR/*.png and DIR/report.json (the numbers). CPU + gloo by default; CUDA + NCCL when every rank
has a GPU (--device auto). Every run is on fresh ranks forked from one preloaded image; runs that
are compared alternate (A B, B A, ...) so a drifting machine load hits both alike, and
comparisons are quoted as ratios of medians.

Memory here is the whole process's: on CPU the peak resident set with --exact-cpu-memory (every
free of 64 KiB or more goes back to the OS, on whichever thread frees it) above the rank's resident
set before the model was built; on CUDA the peak allocated. (The graded memory check compares
tensor memory instead, the same on every platform: harness/memory.py TensorPeaks.) The CPU memory snapshot
(snapshots/<run>/rank{r}.pickle) is not used: it shows allocations only (gloo frees buffers on
its own threads, which the profiler does not see), so its peak is not the process's. The parts of
memory (shards, grads, optimizer state, gathered params, saved activations) are measured in the
same runs from the tensors themselves (Components); communication buffers are analytic only.
Checks are on facts (bytes, counts, bits); timings only ever warn.

Measuring and writing are apart: this module runs the measurements (the rank-side jobs are in
harness/tools/lab/report_jobs.py) into typed results (harness/tools/lab/report_results.py: a Report, checked there);
harness/tools/lab/report_render.py writes them. The analytic columns are harness/memory_model.py's.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import train
from harness import assets, compat, impl, memory_model
from harness.tools.traces.analysis import analyze_run
from harness.cli import parse
from harness.tools.traces.collectives import measured_volume
from harness.distributed import pool_device
from harness.errors import FAILED, stop
from harness.tools.grading.ranks import RankPool, run_tool
from harness.tools.lab.report_jobs import comm_job, link_job, timeline_job, train_job
from harness.tools.lab.report_results import (
    CommBench, Environment, LinkVolume, MemoryRow, MeshTime, Parts, Plan, Report, Reshard, StepTime, Timeline, Volume,
    Weak, check, timing_warnings,
)
from harness.tools.lab.report_render import render
from harness.tools.traces.trace import KINDS

ROOT = Path(__file__).resolve().parents[3]  # the repository: harness/tools/lab/report.py
MiB = 2**20


@dataclass(frozen=True)
class Args:
    """Measure FSDP2 and the FSDP under test for the writeup: markdown tables and PNG plots in --out.
    --quick: a small model, about a minute on 2 cores; default (full): torchtitan's debugmodel, about
    5 minutes on an idle 2-core machine. Exits 1 when a check on the measured facts fails."""

    impl: str = "student"
    """the file effdl (the FSDP under test) imports: student (fsdp.py) or the path of a .py file."""
    quick: bool = False
    """a 2-block dim-128 model, one run of each, 3 message sizes: about a minute on 2 cores (the test
    runs it). Default, the full report: debugmodel, 3 repeats, 4 KiB..32 MiB, about 5 minutes."""
    out: Path = ROOT / "report"
    """folder to write: report.md, report.json and the PNG plots."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA + NCCL when the machine has a GPU per rank for the largest world size (4), else CPU + gloo."""


# quick: a 2-block, dim-128 model, 4 steps, one run each, 3 message sizes (about a minute on 2 cores);
# full: torchtitan's debugmodel (6 blocks, dim 256), 4 steps, 3 interleaved repeats, 4 KiB..32 MiB
# (about 5 minutes on an idle 2-core machine).
QUICK = Plan(dict(n_layers=2, dim=128, n_heads=8), 128, 1, 4, 1, (1, 2, 4),
             (4 * 2**10, 256 * 2**10, 4 * MiB), 3, 1, (2, 4))
FULL = Plan({}, 256, 2, 4, 3, (1, 2, 4),
            tuple(4 * 2**10 * 4**i for i in range(6)) + (32 * MiB,), 10, 2, (2, 4))
# The speed, trace and reshard sections run at this world size.
WORLD = 2
# The HSDP section: FSDP over HSDP_WORLD ranks (a 1-D mesh) against HSDP_REPLICATE replicas of
# HSDP_WORLD / HSDP_REPLICATE shards (train.Config.replicate).
HSDP_WORLD, HSDP_REPLICATE = 4, 2


def environment() -> Environment:
    import torch
    import torchtitan

    cpu = compat.cpu_name()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return Environment(platform.python_version(), torch.__version__, getattr(torchtitan, "__version__", "?"),
                       platform.platform(), cpu, os.cpu_count(), gpus)


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def __call__(self, what: str) -> None:
        self.done += 1
        print(f"[{self.done:2d}/{self.total}] {time.perf_counter() - self.start:6.0f} s  {what}", flush=True)


def slowest_median_step(runs) -> float:
    """The slowest rank's median step, the first (warm-up) left out."""
    return max(statistics.median(r.step_times[1:]) for r in runs)


@dataclass
class Sections:
    """Measures each section of the report into its typed rows. Every run is on fresh ranks of a
    pool forked from one preloaded image; runs that are compared alternate (A B, B A, ...) so a
    drifting machine load hits both alike."""

    plan: Plan
    cfgs: dict[str, train.Config]
    """run name -> its configuration: none (DDP), fsdp2, effdl, noprefetch."""
    groups: memory_model.Groups
    out: Path
    device: str
    progress: Progress

    def warm_up(self, pool: RankPool, cfg: train.Config) -> None:
        """A first run in a fresh process pays one-off costs (lazy imports, the data set's cache,
        allocator growth) that would land on whichever run came first."""
        pool.run(train_job, dataclasses.replace(cfg, num_steps=2))

    def speed(self, pool: RankPool) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Step times of every run, interleaved, and the losses of the FSDPs' first runs."""
        times: dict[str, list[float]] = {k: [] for k in self.cfgs}
        losses: dict[str, list[float]] = {}
        order = list(self.cfgs)
        for r in range(self.plan.repeats):
            for name in (order if r % 2 == 0 else order[::-1]):
                res = pool.run(train_job, self.cfgs[name])
                times[name].append(slowest_median_step(res))
                if name != "none" and r == 0:  # DDP averages gradients otherwise: not the same bits
                    losses[name] = res[0].losses
        self.progress(f"step time: {self.plan.repeats} interleaved runs of {', '.join(self.cfgs)}")
        return times, losses

    def traces(self, pool: RankPool, times: dict[str, list[float]]) -> tuple[list[StepTime], list[Volume], dict[str, Path]]:
        """One profiled run each: communication share, hidden share, bytes per step."""
        traces = {}
        for name, cfg in self.cfgs.items():
            traces[name] = self.out / "traces" / name
            pool.run(train_job, dataclasses.replace(cfg, num_steps=3, profile_steps=2, traces_dir=traces[name],
                                                    snapshots_dir=self.out / "snapshots" / name))
        self.progress("profiled runs (traces: communication and hidden share)")
        step_time, volume = [], []
        fsdp2 = statistics.median(times["fsdp2"])
        for name in self.cfgs:
            comm = analyze_run(traces[name]).comm
            coll = [comm.kind(k) for k in KINDS]
            # Hidden share of the collectives that carry the model: DDP's gradient all-reduces, an
            # FSDP's all-gathers and reduce-scatters (the loss and grad-norm all-reduces are tiny).
            carried = [comm.all_reduce] if name == "none" else [comm.all_gather, comm.reduce_scatter]
            t_carried = sum(c.time_ms for c in carried)
            step = statistics.median(times[name])
            step_time.append(StepTime(
                run=name, step_ms=step * 1e3, ratio=step / fsdp2,
                comm_share=sum(c.time_ms for c in coll) / comm.step_ms,
                hidden_share=sum(c.hidden_ms for c in carried) / t_carried if t_carried else 0.0,
                ag_hidden=comm.all_gather.hidden_fraction, rs_hidden=comm.reduce_scatter.hidden_fraction))
            if name != "none":
                measured, analytic = measured_volume(traces[name]), memory_model.comm_volume(self.groups, WORLD)
                volume += [Volume(name, kind, *measured[kind], *analytic[kind]) for kind in analytic]
        return step_time, volume, traces

    def kept_gathered(self, pool: RankPool, traces: dict[str, Path]) -> dict[tuple[str, bool], tuple[float, float]]:
        """(run, reshard_after_forward) -> (all-gathers, their bytes) per step, from traces."""
        counts = {}
        for name in ("fsdp2", "effdl"):
            trace = self.out / "traces" / f"{name}-keep"
            pool.run(train_job, dataclasses.replace(self.cfgs[name], num_steps=3, profile_steps=2, reshard_after_forward=False,
                                                    traces_dir=trace, snapshots_dir=self.out / "snapshots" / f"{name}-keep"))
            for keep, tdir in ((False, traces[name]), (True, trace)):
                counts[name, not keep] = measured_volume(tdir)["all_gather"]
        self.progress("reshard_after_forward False: all-gathers per step")
        return counts

    def weak(self, w: int) -> tuple[list[Weak], list[CommBench]]:
        """Weak scaling at world size w (the model grows with it); the microbenchmark at w too."""
        layers = self.plan.weak_layers * w
        rows, bench = [], []
        with RankPool(w, device=self.device, role="own") as pool:
            self.warm_up(pool, dataclasses.replace(self.cfgs["fsdp2"], n_layers=layers))
            steps: dict[str, list[float]] = {"fsdp2": [], "effdl": []}
            for r in range(self.plan.repeats):  # interleaved A B, B A, ...: a drifting load hits both alike
                for name in (("fsdp2", "effdl") if (w + r) % 2 else ("effdl", "fsdp2")):
                    res = pool.run(train_job, dataclasses.replace(self.cfgs[name], n_layers=layers))
                    steps[name].append(slowest_median_step(res))
            for name, times in steps.items():
                step = statistics.median(times)
                rows.append(Weak(w, name, layers, step * 1e3, self.plan.batch_size * self.plan.seq_len / step))
            if w in self.plan.bench_worlds and w != WORLD:
                bench = pool.run(comm_job, self.plan.sizes, self.plan.iters)[0]
        self.progress(f"weak scaling W={w} ({layers} blocks)")
        return rows, bench

    def hsdp(self) -> tuple[list[LinkVolume], list[MeshTime], dict[str, list[float]]]:
        """At HSDP_WORLD: FSDP2 and the FSDP under test on the 1-D mesh and on the (HSDP_REPLICATE,
        HSDP_WORLD / HSDP_REPLICATE) mesh: bytes per link from one observed run each (CommLog), step times
        from unobserved runs interleaved (A B C D, D C B A, ...), and the losses of the first of those."""
        w, layouts = HSDP_WORLD, (1, HSDP_REPLICATE)
        cfgs = {(name, r): dataclasses.replace(self.cfgs[name], replicate=r) for name in ("fsdp2", "effdl") for r in layouts}
        volume, times, losses = [], {k: [] for k in cfgs}, {}
        with RankPool(w, device=self.device, role="own") as pool:
            self.warm_up(pool, cfgs["fsdp2", 1])
            for (name, r), cfg in cfgs.items():
                per_rank = pool.run(link_job, dataclasses.replace(cfg, num_steps=2))
                measured = {key: tuple(sum(x[key][i] if key in x else 0 for x in per_rank) / w for i in (0, 1))
                            for key in {k for x in per_rank for k in x}}
                analytic = memory_model.link_volume(self.groups, w, r)
                for link, kind in sorted(set(measured) | set(analytic)):
                    size = w // r if link == memory_model.SHARD_LINK else r
                    volume.append(LinkVolume(name, r, link, size, kind, *measured.get((link, kind), (0.0, 0.0)),
                                             *analytic.get((link, kind), (0, 0)),
                                             memory_model.closed_form_sent(self.groups, w, r, link, kind)))
            order = list(cfgs)
            for rep in range(self.plan.repeats):
                for key in (order if rep % 2 == 0 else order[::-1]):
                    res = pool.run(train_job, cfgs[key])
                    times[key].append(slowest_median_step(res))
                    if rep == 0:
                        losses[f"{key[0]} {key[1]}"] = res[0].losses
        rows = [MeshTime(name, r, statistics.median(t) * 1e3, statistics.median(t) / statistics.median(times[name, 1]))
                for (name, r), t in times.items()]
        self.progress(f"HSDP W={w}: 1-D mesh and {HSDP_REPLICATE} x {w // HSDP_REPLICATE}, bytes per link and step time")
        return volume, rows, losses

    def memory(self, w: int, earlier: list[MemoryRow]) -> tuple[list[MemoryRow], dict[str, int], Timeline | None]:
        """Peak and parts per rank at world size w, with --exact-cpu-memory; at WORLD also the peaks
        with reshard_after_forward False (run -> peak) and rank 0's memory timeline."""
        rows, kept_peaks, timeline = [], {}, None
        with RankPool(w, device=self.device, role="own") as pool:
            self.warm_up(pool, dataclasses.replace(self.cfgs["fsdp2"], exact_cpu_memory=True))
            for name in ("fsdp2", "effdl"):
                res = pool.run(train_job, dataclasses.replace(self.cfgs[name], exact_cpu_memory=True), components=True)
                parts = [x.components for x in res]
                largest = Parts.over_ranks(parts, max)
                # Activations do not depend on W (fixed batch per rank): the model takes FSDP2's
                # measured saved bytes at the smallest W; the other rows test it.
                act = next((r.parts.activations for r in earlier + rows if r.run == "fsdp2"), largest.activations)
                rows.append(MemoryRow(w, name, max(x.peak for x in res), largest, Parts.over_ranks(parts, sum),
                                      memory_model.per_rank(self.groups, w, act)))
            if w == WORLD:
                for name in ("fsdp2", "effdl"):
                    res = pool.run(train_job, dataclasses.replace(self.cfgs[name], exact_cpu_memory=True,
                                                                  reshard_after_forward=False))
                    kept_peaks[name] = max(x.peak for x in res)
                timeline = pool.run(timeline_job, dataclasses.replace(self.cfgs["effdl"], exact_cpu_memory=True,
                                                                      num_steps=3))[0]
        self.progress(f"memory W={w} (exact)")
        return rows, kept_peaks, timeline


def measure(args: Args, plan: Plan, device: str, out: Path, progress: Progress) -> Report:
    """Every section, in the order that keeps pools few: WORLD (speed, traces, reshard, the
    microbenchmark), then per world size weak scaling and memory."""
    base = dict(model="debug", seq_len=plan.seq_len, batch_size=plan.batch_size, num_steps=plan.steps,
                profile_steps=0, log=False, device=device, **plan.model)
    cfgs = {"none": train.Config(fsdp="none", **base), "fsdp2": train.Config(fsdp="fsdp2", **base),
            "effdl": train.Config(fsdp="effdl", impl=args.impl, **base),
            "noprefetch": train.Config(fsdp="effdl", impl=args.impl, prefetch=False, **base)}
    groups = memory_model.model_groups("debug", plan.seq_len, assets.vocab_size(ROOT), **plan.model)
    flags = ["--impl", args.impl] + (["--quick"] if args.quick else [])
    report = Report(command="uv run python -m harness.tools.lab.report " + " ".join(flags), impl=str(impl.impl_path(args.impl)),
                    device=device, plan=plan, n_params=memory_model.numel(groups), environment=environment())
    sections = Sections(plan, cfgs, groups, out, device, progress)

    with RankPool(WORLD, device=device, role="own") as pool:
        sections.warm_up(pool, cfgs["fsdp2"])
        times, report.losses = sections.speed(pool)
        report.step_time, report.comm_volume, traces = sections.traces(pool, times)
        all_gathers = sections.kept_gathered(pool, traces)
        report.comm_bench = pool.run(comm_job, plan.sizes, plan.iters)[0]
        sections.progress(f"collective microbenchmark, {len(plan.sizes)} sizes")

    kept_peaks = {}
    for w in plan.worlds:
        weak, bench = sections.weak(w)
        report.weak += weak
        report.comm_bench += bench
        rows, peaks, timeline = sections.memory(w, report.memory)
        report.memory += rows
        kept_peaks.update(peaks)
        report.timeline = timeline or report.timeline

    report.hsdp_volume, report.hsdp_time, report.hsdp_losses = sections.hsdp()

    resharded_peaks = {r.run: r.measured for r in report.memory if r.world == WORLD}
    report.reshard = [Reshard(run, reshard, *all_gathers[run, reshard], memory_model.all_gathers(groups, reshard),
                              resharded_peaks[run] if reshard else kept_peaks[run])
                      for run in ("fsdp2", "effdl") for reshard in (True, False)]
    return report


def main(args: Args) -> int:
    plan = QUICK if args.quick else FULL
    path = impl.impl_path(args.impl)
    device = pool_device(args.device, max(plan.worlds))
    assets.ensure(ROOT)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress(total=2 * len(plan.worlds) + 7)
    print(f"report: {path} on {device}; {'quick' if args.quick else 'full'}; out {out}", flush=True)
    report = measure(args, plan, device, out, progress)
    checks, warnings = check(report), timing_warnings(report)
    progress("checks")
    render(out, report, checks, warnings)
    progress(f"wrote {out / 'report.md'}")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for problem in checks:
        print(f"check failed: {problem}", file=sys.stderr)
    if checks:
        stop(f"{len(checks)} check(s) on the measured facts failed (listed above and in {out / 'report.md'}): "
             "the FSDP under test does not do what FSDP2 does there", FAILED)
    return 0


def cli(argv: list[str] | None = None) -> None:
    run_tool(main, parse(Args, argv, prog="python -m harness.tools.lab.report"), "the report")


if __name__ == "__main__":
    cli()

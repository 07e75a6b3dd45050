"""Speed, memory and overlap of effdl (the FSDP under test) against FSDP2, in one interleaved run.

    uv run python -m harness.tools.lab.benchmark                       # debug model, seq 256 and 1024: every GPU, else 2 CPU ranks
    uv run python -m harness.tools.lab.benchmark --device cpu          # 2 CPU ranks, gloo, even on a machine with GPUs
    uv run python -m harness.tools.lab.benchmark --impl student --seq-lens 256

For each sequence length, FSDP2 and effdl (the FSDP under test) alternate (A B, B A, A B, ...), each
run on fresh ranks (on CPU forked from the same preloaded image), so drifting machine load and what a
process accumulated hit both alike. Reported as ratios effdl / FSDP2 of the medians:
  * step time: median over runs of each run's median step (the first step, warm-up, skipped);
  * peak memory: CUDA's peak allocated; on CPU the peak resident set above the rank's resident
    set when the run began (the Python/torch baseline, the same for both, would hide any ratio),
    from separate runs with --exact-cpu-memory (slower, so not used for the step times); where
    that is unavailable (macOS) the speed runs' peak since the rank started, baseline included;
  * hidden: the fraction of all-gather / reduce-scatter time that ran while compute ran, from
    one profiled run each (harness/tools/traces/collectives.py).
Targets: step time <= 0.95 on CPU (FSDP2 overlaps nothing there), <= 1.02 on CUDA; memory <= 1.00.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import train
from harness import impl, memory
from harness.tools.traces import analysis
from harness.cli import parse
from harness.distributed import pool_device
from harness.tools.grading.ranks import RankPool, run_tool

TARGETS = {"cpu": 0.95, "cuda": 1.02}


@dataclass(frozen=True)
class Args:
    """Step time, peak memory and overlap of the FSDP under test against FSDP2, as ratios of medians
    over interleaved runs."""

    impl: str = "student"
    """the file effdl (the FSDP under test) imports: student (fsdp.py) or the path of a .py file."""
    seq_lens: tuple[int, ...] = (256, 1024)
    model: Literal["debug", "1b"] = "debug"
    batch_size: int = 2
    num_steps: int = 6
    repeats: int = 3
    """runs of each implementation per sequence length (interleaved)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA + NCCL when there is a GPU per rank (--world-size of them, or 2 when it is not
    given), else CPU + gloo."""
    world_size: int | None = None
    """default: 2 on CPU, every GPU on CUDA."""
    param_dtype: Literal["float32", "bfloat16", "none"] = "none"
    reduce_dtype: Literal["float32", "bfloat16", "none"] = "none"


def measure_job(cfg: train.Config) -> tuple[float, int]:
    """(median step time after warm-up, peak memory of the run) on this rank."""
    base = 0 if cfg.device == "cuda" else memory.resident_bytes()
    result = train.train(cfg)
    return statistics.median(result.step_times[1:]), max(result.peak_memory[1:]) - base


def main(args: Args) -> int:
    import torch

    path = impl.impl_path(args.impl)
    # auto weighs 2 ranks when none are asked for (1 would compare nothing); explicit cuda needs 1 GPU
    device = pool_device(args.device, args.world_size or (1 if args.device == "cuda" else 2))
    world = args.world_size or (torch.cuda.device_count() if device == "cuda" else 2)
    args = dataclasses.replace(args, device=device)
    print(f"benchmark: {args.model} model, {world} x {args.device}, batch {args.batch_size}, {args.num_steps} "
          f"steps (first skipped), {args.repeats} interleaved runs each; effdl: {args.impl} "
          f"({path})", flush=True)
    if args.device == "cpu" and (why := memory.exact_available()):
        print(f"peak memory: from the speed runs, not exact ({why}); {memory.NOTE[len('note: '):]}", flush=True)
    rows = []
    for seq in args.seq_lens:
        base = dict(model=args.model, seq_len=seq, batch_size=args.batch_size, num_steps=args.num_steps,
                    profile_steps=0, log=False, device=args.device, param_dtype=args.param_dtype,
                    reduce_dtype=args.reduce_dtype)
        configs = {"fsdp2": train.Config(fsdp="fsdp2", **base), "effdl": train.Config(fsdp="effdl", impl=args.impl, **base)}
        times = {k: [] for k in configs}
        peaks = {k: [] for k in configs}
        # On CPU, speed and memory come from separate runs: exact CPU memory (every free handed
        # back to the OS) costs page faults, which would blur the speed comparison. On CUDA the
        # speed runs' peak allocated is exact already.
        # Without exact CPU memory (macOS: no /proc, no glibc) the speed runs' peak is the best there is.
        exact_runs = args.device == "cpu" and memory.exact_available() is None
        passes = [(False, ("time",) if exact_runs else ("time", "peak"))]
        if exact_runs:
            passes.append((True, ("peak",)))
        for exact, measured in passes:
            for r in range(args.repeats):
                for name in (("fsdp2", "effdl") if r % 2 == 0 else ("effdl", "fsdp2")):
                    with RankPool(world, device=args.device, role="own") as pool:
                        per_rank = pool.run(measure_job, dataclasses.replace(configs[name], exact_cpu_memory=exact))
                    if "time" in measured:
                        times[name].append(max(t for t, _ in per_rank))  # the slowest rank sets the pace
                    if "peak" in measured:
                        peaks[name].append(max(p for _, p in per_rank))
                    print(f"  seq {seq} {name}: " + ", ".join(
                        f"{times[name][-1] * 1000:.0f} ms/step" if m == "time" else f"peak {peaks[name][-1] / 2**20:.1f} MiB"
                        for m in measured), flush=True)
        hidden = {}
        with tempfile.TemporaryDirectory() as tmp, RankPool(world, device=args.device, role="own") as pool:
            for name, cfg in configs.items():
                traced = dataclasses.replace(cfg, num_steps=3, profile_steps=2, traces_dir=Path(tmp) / name,
                                             profile_memory=False)
                pool.run(train.train, traced)
                comm = analysis.analyze_run(traced.traces_dir).comm
                hidden[name] = (comm.all_gather.hidden_text, comm.reduce_scatter.hidden_text)
        med = {k: (statistics.median(times[k]), statistics.median(peaks[k])) for k in configs}
        rows.append((seq, med, hidden))

    target = TARGETS[args.device]
    print(f"\n{'seq':>5} | {'step FSDP2':>10} {'hand':>8} {'ratio':>6} | {'peak FSDP2':>10} {'hand':>10} {'ratio':>6} |"
          f" {'AG hidden FSDP2':>15} {'hand':>5} | {'RS hidden FSDP2':>15} {'hand':>5}")
    for seq, med, hidden in rows:
        t_ratio = med["effdl"][0] / med["fsdp2"][0]
        m_ratio = med["effdl"][1] / med["fsdp2"][1]
        print(f"{seq:>5} | {med['fsdp2'][0] * 1000:>7.0f} ms {med['effdl'][0] * 1000:>5.0f} ms {t_ratio:>6.2f} |"
              f" {med['fsdp2'][1] / 2**20:>6.1f} MiB {med['effdl'][1] / 2**20:>6.1f} MiB {m_ratio:>6.3f} |"
              f" {hidden['fsdp2'][0]:>15} {hidden['effdl'][0]:>5} | {hidden['fsdp2'][1]:>15} {hidden['effdl'][1]:>5}")
    print(f"targets: step-time ratio <= {target} ({args.device}), peak-memory ratio <= 1.00")
    return 0


def cli(argv: list[str] | None = None) -> None:
    run_tool(main, parse(Args, argv, prog="python -m harness.tools.lab.benchmark"), "the benchmark")


if __name__ == "__main__":
    cli()

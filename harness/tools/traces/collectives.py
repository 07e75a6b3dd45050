"""Collectives per profiled step, read off one rank's trace (harness/tools/traces/trace.py): how many
all-gathers / reduce-scatters / all-reduces were issued per phase, how long they ran (the union of
their intervals), which part of that was hidden behind compute, and their bytes.

Intervals
---------
CPU / gloo (torch 2.11): the op only enqueues the work; a gloo worker thread runs it as a
`gloo:all_gather` / `gloo:all_reduce` range, which is the collective's *interval*. Gloo has no
flat reduce-scatter: `_reduce_scatter_base_` runs as a `gloo:all_reduce`, like `allreduce_`.
No arg links a gloo range to its op (their "External id"s differ; "Sequence number" is
autograd's), so they are matched by issue order: gloo's work queue is FIFO, so per range name
the k-th op issued is the k-th started. Two checks keep the matching right: the op's tensor
must have the gloo range's "Input Dims" (the shard of an all-gather, the full input of a
reduce-scatter or all-reduce: the scalar loss all-reduce cannot pair with a reduce-scatter),
and a range never pairs with an op issued after it started (so a range of work issued before
profiling started pairs with nothing).

CUDA / NCCL (written from the trace format, not run here): the interval is the
`ncclDevKernel_*` / `ncclKernel_*` kernel; its "correlation" arg leads to the CPU launch, and
the c10d op around the launch gives kind, step and phase.

Hidden time
-----------
hidden = |union(collective intervals) & union(compute intervals)|; fraction = hidden / time.

  * CPU: compute is main-thread time inside a dispatcher op of the `aten::` or `fsdp::`
    namespace (FSDP2's copy-in/out ops), outside c10d ops. A main thread that waits for a
    collective is never inside one: `Work.wait()` is called from Python hooks, which the trace
    shows as a gap or inside wrapper ranges (`FSDP::all_gather`,
    `autograd::engine::evaluate_function: ...`) that this definition leaves out on purpose.
    FSDP2 on CPU waits for each collective right away (the main thread sits in
    `FSDP::all_gather` while gloo runs), so it hides 0 %; an FSDP that issues `async_op=True`
    and waits at first use hides whatever aten work the main thread did meanwhile. Python time
    between ops is not counted as compute, so the fraction is a lower bound.
  * CUDA: compute is every non-NCCL kernel, so an NCCL kernel is hidden while another stream
    computes.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.tools.traces.trace import (
    C10D_OPS, ITEMSIZE, KINDS, OTHER, PHASES, Interval, Trace, input_dims, inside, length, overlap, rank_files, union,
)

NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_(?P<algo>[A-Za-z]+)")
NCCL_KIND = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce"}
COMPUTE_OPS = ("aten::", "fsdp::")


# --------------------------------------------------------------------------- per step


@dataclass
class Comm:
    """Collectives of one kind, in one phase or in all: one step's, or a mean over steps."""

    count: float = 0.0
    time_ms: float = 0.0
    """wall time of the union of their intervals."""
    hidden_ms: float = 0.0
    """the part of it during which compute ran."""
    timed: float = 0.0
    """how many of them were found running (a gloo range or NCCL kernel); normally == count."""

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_ms / self.time_ms if self.time_ms > 0 else 0.0

    @property
    def hidden_text(self) -> str:
        """The hidden fraction as a percentage, or "no communication" where none ran (world size
        1: FSDP2 skips its reduce-scatter and NCCL launches no kernel), which 0 % would misstate."""
        return f"{self.hidden_fraction:.0%}" if self.time_ms > 0 else "no communication"


@dataclass
class CollectiveStats:
    total: Comm = field(default_factory=Comm)
    by_phase: dict[str, Comm] = field(default_factory=lambda: {p: Comm() for p in (*PHASES, OTHER)})

    @property
    def count_by_phase(self) -> dict[str, float]:
        """Phases with any collective of this kind."""
        return {p: c.count for p, c in self.by_phase.items() if c.count}

    @property
    def time_ms(self) -> float:
        return self.total.time_ms

    @property
    def hidden_ms(self) -> float:
        return self.total.hidden_ms

    @property
    def hidden_fraction(self) -> float:
        return self.total.hidden_fraction

    @property
    def hidden_text(self) -> str:
        return self.total.hidden_text


@dataclass
class StepStats:
    """One profiled step of one rank; `rank` and `step` are None for a mean over several."""

    rank: int | None
    step: int | None
    step_ms: float
    all_gather: CollectiveStats = field(default_factory=CollectiveStats)
    reduce_scatter: CollectiveStats = field(default_factory=CollectiveStats)
    all_reduce: CollectiveStats = field(default_factory=CollectiveStats)
    by_group: dict[tuple[str, str, str], int] = field(default_factory=dict)
    """(kind, phase, group) -> collectives issued inside that group's FSDP range (see GROUP_RANGE)."""

    def kind(self, kind: str) -> CollectiveStats:
        return getattr(self, kind)


def mean(steps: list[StepStats]) -> StepStats:
    """Mean over steps (and ranks) of counts and times; fractions are then ratios of means."""
    if not steps:
        raise ValueError("no profiled steps to average")
    n = len(steps)

    def avg(comms: list[Comm]) -> Comm:
        return Comm(sum(c.count for c in comms) / n, sum(c.time_ms for c in comms) / n,
                    sum(c.hidden_ms for c in comms) / n, sum(c.timed for c in comms) / n)

    out = StepStats(None, None, sum(s.step_ms for s in steps) / n)
    for key in {k for s in steps for k in s.by_group}:
        out.by_group[key] = sum(s.by_group.get(key, 0) for s in steps) / n
    for kind in KINDS:
        out.kind(kind).total = avg([s.kind(kind).total for s in steps])
        for phase in (*PHASES, OTHER):
            out.kind(kind).by_phase[phase] = avg([s.kind(kind).by_phase[phase] for s in steps])
    return out


# --------------------------------------------------------------------------- one rank's trace


def match_gloo(ops: list[dict], gloo: list[dict]) -> dict[int, dict]:
    """id(op) -> the gloo range that ran it (see the module docstring)."""
    matched: dict[int, dict] = {}
    queues: dict[str, list[dict]] = defaultdict(list)
    for op in sorted(ops, key=lambda e: e["ts"]):
        queues[C10D_OPS[op["name"]][1]].append(op)
    for name, waiting in queues.items():
        for g in sorted((g for g in gloo if g["name"] == name), key=lambda e: e["ts"]):
            shape = input_dims(g, 0)
            for k, op in enumerate(waiting):
                if op["ts"] > g["ts"]:
                    break  # issued after this work started: not its op
                want = input_dims(op, C10D_OPS[op["name"]][2])
                if shape is None or want is None or shape == want:
                    matched[id(op)] = g
                    del waiting[k]
                    break
    return matched


def _cpu_intervals(t: Trace) -> tuple[list[tuple[dict, Interval]], list[Interval]]:
    """(op, its gloo interval) for every matched op, and the main thread's compute."""
    gloo = [e for e in t.ranges if e["name"].startswith("gloo:") and (e["pid"], e["tid"]) != t.main]
    matched = match_gloo(t.ops, gloo)
    collectives = [(op, (g["ts"], g["ts"] + g["dur"])) for op in t.ops if (g := matched.get(id(op)))]
    in_c10d = union((e["ts"], e["ts"] + e["dur"]) for e in t.on_main
                    if e["name"].startswith(("c10d::", "_c10d_functional::")))
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in t.on_main
               if e.get("cat") == "cpu_op" and e["name"].startswith(COMPUTE_OPS) and not inside(e["ts"], in_c10d)]
    return collectives, compute


def _cuda_intervals(t: Trace) -> tuple[list[tuple[dict, Interval]], list[Interval]]:
    """(op, kernel interval) for every NCCL kernel launched inside a c10d op, and the other kernels."""
    launches = {e["args"]["correlation"]: e["ts"] for e in t.ranges
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    starts = [op["ts"] for op in t.ops]
    collectives, compute = [], []
    for k in t.kernels:
        span = (k["ts"], k["ts"] + k["dur"])
        m = NCCL_KERNEL.match(k["name"])
        if m is None:
            compute.append(span)
            continue
        launched = launches.get(k.get("args", {}).get("correlation"))
        if launched is None:
            continue
        i = bisect.bisect_right(starts, launched) - 1
        if i >= 0 and launched <= t.ops[i]["ts"] + t.ops[i]["dur"]:
            collectives.append((t.ops[i], span))
        elif kind := NCCL_KIND.get(m["algo"]):  # launched outside a c10d op: kind from the name
            collectives.append(({"name": kind, "ts": launched}, span))
    return collectives, compute


def work_intervals(t: Trace) -> list[tuple[dict, Interval]]:
    """(c10d op, where its work ran: the gloo range or the NCCL kernel) for every op found running."""
    return (_cuda_intervals(t) if t.cuda else _cpu_intervals(t))[0]


def analyze_trace(trace: Trace | str | Path | dict) -> list[StepStats]:
    """Per profiled step of one rank."""
    t = trace if isinstance(trace, Trace) else Trace(trace)

    def kind_of(op: dict) -> str:
        return C10D_OPS[op["name"]][0] if op["name"] in C10D_OPS else op["name"]

    counts: dict[tuple, int] = defaultdict(int)  # (step, kind, phase)
    by_group: dict[int, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))  # step -> (kind, phase, group)
    for op in t.ops:
        step, kind, phase = t.steps.at(op["ts"]), kind_of(op), t.phases.at(op["ts"], OTHER)
        counts[step, kind, phase] += 1
        if (group := t.group_of(op)) is not None:
            by_group[step][kind, phase, group] += 1
    intervals: dict[tuple, list[Interval]] = defaultdict(list)
    collectives, compute = _cuda_intervals(t) if t.cuda else _cpu_intervals(t)
    for op, span in collectives:
        intervals[t.steps.at(op["ts"]), kind_of(op), t.phases.at(op["ts"], OTHER)].append(span)
    compute = union(compute)

    def comm(count: float, spans: list[Interval]) -> Comm:
        merged = union(spans)
        return Comm(count, length(merged) / 1e3, overlap(merged, compute) / 1e3, len(spans))

    out = []
    for start, end, step in t.steps.ranges:
        stats = StepStats(t.rank, step, (end - start) / 1e3, by_group=dict(by_group[step]))
        for kind in KINDS:
            agg = stats.kind(kind)
            for phase in (*PHASES, OTHER):
                agg.by_phase[phase] = comm(counts[step, kind, phase], intervals[step, kind, phase])
            agg.total = comm(sum(c.count for c in agg.by_phase.values()),
                             [s for phase in (*PHASES, OTHER) for s in intervals[step, kind, phase]])
        out.append(stats)
    return out


# --------------------------------------------------------------------------- bytes


def measured_volume(trace_dir: str | Path) -> dict[str, tuple[float, float]]:
    """Per step, mean over profiled steps and ranks: (count, bytes) of each all-gather and
    reduce-scatter, read off the c10d ops' recorded shapes (all-gather: its output; reduce-scatter:
    its input)."""
    sums: dict[str, list[float]] = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
    steps = 0
    for path in rank_files(trace_dir, ".json"):
        t = Trace(path)
        steps += len(t.steps.ranges)
        for op in t.ops:
            kind, _, index = C10D_OPS[op["name"]]
            if kind not in sums or t.steps.at(op["ts"]) is None:
                continue
            index = 0 if kind == "all_gather" else index
            dims, dtype = op["args"]["Input Dims"][index], op["args"]["Input type"][index]
            sums[kind][0] += 1
            sums[kind][1] += math.prod(dims) * ITEMSIZE[dtype]
    return {k: (c / steps, b / steps) for k, (c, b) in sums.items()}

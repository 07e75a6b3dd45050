"""Overlap and memory, measured from the traces and snapshots that `train.py` writes.

    uv run python -m harness.analysis traces/fsdp2 traces/effdl    # memory from snapshots/fsdp2, snapshots/effdl

Instead of reading Perfetto and memory_viz by eye, this computes for every profiled step
(`ProfilerStep#N`) of every rank, then averages over steps and ranks:

  * how many all-gathers / reduce-scatters / all-reduces were issued, per phase;
  * how long they ran (the union of their intervals) and which part of that was hidden
    behind compute;
  * from the memory snapshot: the peak over the window, within forward and within backward,
    and what each step leaves allocated (growth).

Collectives
-----------
A collective is *counted* once per c10d dispatcher op, on whichever thread issued it (the main
thread, with the `ProfilerStep#N` ranges; on CUDA backward hooks run on autograd's device thread): `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`,
`c10d::allreduce_` (C10D_OPS). Its *phase* is the `## forward ##` / `## backward ##` /
`## optimizer ##` range containing the op; FSDP's last reduce-scatters run in autograd's final
callback, still inside `## backward ##`. Anything else (the loss all-reduce) is "other".

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

Schedule (what the graded overlap checks use)
--------
`schedule` places each FSDP group's all-gather and reduce-scatter in the issuing thread's order:
issued by the c10d op inside `FSDP::all_gather (G)` / `FSDP::post_backward_reduce (G)`, waited
for at the next `FSDP::all_gather_copy_out (G)` / `FSDP::reduce_scatter_wait (G)` (the reference's
PendingReduce.finish; `reduce_scatter_done` when it had already finished), or at once when a
`Work.wait` range (`marked_waits`) follows the op inside its group range, or its own wait comes in
the same FSDP hook. It is overlapped when aten compute outside `FSDP::` ranges ran in between.
Unlike hidden time, this depends only on the program, never on how threads were scheduled.

Memory
------
`profiling.memory_timeline` (bytes allocated since recording started) read against the phase
ranges of the same rank's trace. CPU snapshots carry the trace's `ts` as `time_us`; CUDA ones
carry unix time, which is `ts + baseTimeNanoseconds / 1000`. CPU numbers are relative to the
start of profiling: frees of older blocks are not recorded, so the first profiled step's growth
includes what the step before it left (its logits: 1 MiB for the debug model).
CPU traces also miss the frees that gloo worker threads perform after a collective (see
`untracked_blocks`): those blocks are left out of the timeline and reported as `untracked`.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import tyro

from harness import profiling
from harness.cli import parse
from harness.errors import BAD_INPUT, stop

PHASES = ("forward", "backward", "optimizer")
OTHER = "other"
KINDS = ("all_gather", "reduce_scatter", "all_reduce")

# c10d dispatcher op -> (kind, the gloo range it runs as, index of the tensor gloo works on)
C10D_OPS = {
    "c10d::_allgather_base_": ("all_gather", "gloo:all_gather", 1),        # (output, input)
    "c10d::allgather_": ("all_gather", "gloo:all_gather", 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "gloo:all_reduce", 1),  # (output, input)
    "c10d::reduce_scatter_": ("reduce_scatter", "gloo:reduce_scatter", 1),
    "c10d::allreduce_": ("all_reduce", "gloo:all_reduce", 0),              # ([tensors], ...)
}
NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_(?P<algo>[A-Za-z]+)")
NCCL_KIND = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce"}
COMPUTE_OPS = ("aten::", "fsdp::")
STEP = re.compile(r"^ProfilerStep#(\d+)$")
# FSDP's profiler ranges around a group's collectives (FSDP2's names, which the hand-written FSDP
# shares): `FSDP::all_gather (layers.3)`; the root's group has no name in parentheses.
GROUP_RANGE = re.compile(r"^FSDP::(?:all_gather|post_backward_reduce)(?: \((?P<fqn>.*)\))?$")
ROOT_GROUP = "<root>"
# Where the main thread waited for a group's collective: the all-gather's copy-out (FSDP2's name),
# and PendingReduce.finish's two ranges: `reduce_scatter_wait` when the reduce-scatter was still
# running (the thread blocks), `reduce_scatter_done` when it had already finished (no wait).
WAIT_RANGE = re.compile(r"^FSDP::(?P<what>all_gather_copy_out|reduce_scatter_wait|reduce_scatter_done)"
                        r"(?: \((?P<fqn>.*)\))?$")
ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "int": 4, "long int": 8,
            "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}

Interval = tuple[float, float]  # (start, end), microseconds


# --------------------------------------------------------------------------- intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(spans: list[Interval]) -> float:
    return sum(e - s for s, e in spans)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both of two unions (each sorted and disjoint)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def inside(t: float, spans: list[Interval]) -> bool:
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t <= spans[i][1]


class Ranges:
    """Labelled ranges that do not overlap (steps, or phases): which one holds time t."""

    def __init__(self, ranges: Iterable[tuple[float, float, object]]):
        self.ranges = sorted(ranges, key=lambda r: r[0])
        self._starts = [r[0] for r in self.ranges]

    def at(self, t: float, default: object = None) -> object:
        i = bisect.bisect_right(self._starts, t) - 1
        return self.ranges[i][2] if i >= 0 and t <= self.ranges[i][1] else default

    def spans(self, label: object) -> list[Interval]:
        return [(s, e) for s, e, lab in self.ranges if lab == label]


# --------------------------------------------------------------------------- results


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


@dataclass
class MemoryStats:
    """Bytes allocated since recording started (CPU: since profiling started)."""

    peak: int
    peak_forward: int
    peak_backward: int
    peak_optimizer: int
    growth: list[int]
    """per profiled step: allocated at its end minus allocated at its start."""
    untracked: list[int] = field(default_factory=list)
    """per profiled step (CPU): bytes of blocks whose free the trace lacks, left out above."""

    @staticmethod
    def worst(stats: list[MemoryStats]) -> MemoryStats:
        """Over ranks: the highest peaks and, per step, the value furthest from zero."""

        def per_step(name: str) -> list[int]:
            return [max(v, key=abs) for v in zip(*(getattr(s, name) for s in stats))]

        return MemoryStats(max(s.peak for s in stats), max(s.peak_forward for s in stats),
                           max(s.peak_backward for s in stats), max(s.peak_optimizer for s in stats),
                           per_step("growth"), per_step("untracked"))


# --------------------------------------------------------------------------- reading a trace


class Trace:
    """One rank's chrome trace, with the main thread's step and phase ranges."""

    def __init__(self, trace: str | Path | dict):
        if not isinstance(trace, dict):
            with open(trace) as f:
                trace = json.load(f)
        self.data = trace
        self.rank = trace.get("distributedInfo", {}).get("rank")
        self.ranges = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        main = next((e for e in self.ranges if e.get("cat") == "user_annotation" and STEP.match(e["name"])), None)
        if main is None:
            raise ValueError("the trace has no ProfilerStep#N range: was it written by profiling.StepProfiler?")
        self.main = (main["pid"], main["tid"])
        self.on_main = [e for e in self.ranges if (e["pid"], e["tid"]) == self.main]
        annotations = [e for e in self.on_main if e.get("cat") == "user_annotation"]
        self.steps = Ranges((e["ts"], e["ts"] + e["dur"], int(m[1]))
                            for e in annotations if (m := STEP.match(e["name"])))
        labels = {f"## {p} ##": p for p in PHASES}
        self.phases = Ranges((e["ts"], e["ts"] + e["dur"], labels[e["name"]])
                             for e in annotations if e["name"] in labels)
        # c10d ops of every thread: on CUDA, FSDP's backward hooks run on autograd's device thread.
        self.ops = sorted((e for e in self.ranges if e["name"] in C10D_OPS), key=lambda e: e["ts"])
        self.kernels = [e for e in self.ranges if e.get("cat") == "kernel"]
        self.cuda = bool(self.kernels)
        groups: dict[tuple, list] = defaultdict(list)  # (pid, tid) -> FSDP group ranges on it
        for e in self.ranges:
            if e.get("cat") == "user_annotation" and (m := GROUP_RANGE.match(e["name"])):
                groups[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], m["fqn"] or ROOT_GROUP))
        self.groups = {thread: Ranges(r) for thread, r in groups.items()}

    def group_of(self, op: dict) -> str | None:
        """The FSDP group whose all-gather or reduce-scatter range issued this c10d op, if any."""
        ranges = self.groups.get((op.get("pid"), op.get("tid")))
        return ranges.at(op["ts"]) if ranges else None


def _dims(event: dict, index: int) -> tuple | None:
    dims = event.get("args", {}).get("Input Dims")
    if not dims or index >= len(dims):
        return None
    d = dims[index]
    if d and isinstance(d[0], list):  # a TensorList: its first tensor
        d = d[0]
    return tuple(d)


def match_gloo(ops: list[dict], gloo: list[dict]) -> dict[int, dict]:
    """id(op) -> the gloo range that ran it (see the module docstring)."""
    matched: dict[int, dict] = {}
    queues: dict[str, list[dict]] = defaultdict(list)
    for op in sorted(ops, key=lambda e: e["ts"]):
        queues[C10D_OPS[op["name"]][1]].append(op)
    for name, waiting in queues.items():
        for g in sorted((g for g in gloo if g["name"] == name), key=lambda e: e["ts"]):
            shape = _dims(g, 0)
            for k, op in enumerate(waiting):
                if op["ts"] > g["ts"]:
                    break  # issued after this work started: not its op
                want = _dims(op, C10D_OPS[op["name"]][2])
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


# --------------------------------------------------------------------------- schedule


@dataclass
class Scheduled:
    """One all-gather or reduce-scatter of an FSDP group, placed in the main thread's order."""

    rank: int | None
    step: int | None
    phase: str
    pass_start: float
    """start of the `## forward ##` / `## backward ##` range it was issued in: one pass."""
    kind: str
    group: str
    issued: float
    waited: float | None
    """start of the range where the thread waited for it; None if it never did (or not via FSDP's ranges)."""
    blocked: bool
    """the thread had to wait (False: a reduce-scatter found already finished, see WAIT_RANGE)."""
    overlapped: bool
    """compute of another group ran on the thread between issue and wait, or it never blocked."""


BLOCKING_WAIT, DONE_WAIT = "Work.wait (blocking)", "Work.wait (done)"


@contextlib.contextmanager
def marked_waits():
    """Every `Work.wait()` of the process shows in the trace as a range, named for whether the
    work was still running: a wait right after the issue, inside the same FSDP range (a blocking
    all-gather, `async_op=False`), is then seen even when no FSDP range marks it."""
    work = torch.distributed.Work
    plain = work.wait

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function(DONE_WAIT if self.is_completed() else BLOCKING_WAIT):
            return plain(self, *args, **kwargs)

    work.wait = wait
    try:
        yield
    finally:
        work.wait = plain


def schedule(trace: Trace | str | Path | dict) -> list[Scheduled]:
    """Every collective issued inside an FSDP group's range, with whether compute ran between its
    issue and its wait. Compute: aten ops on the issuing thread outside every `FSDP::` range and
    c10d op, i.e. what modules compute (another group's: this group's parameters are not gathered
    yet, or its gradients already reduced). Only order counts, not durations: for a given program
    the verdict does not depend on how threads were scheduled."""
    t = trace if isinstance(trace, Trace) else Trace(trace)
    out = []
    for thread in {(op["pid"], op["tid"]) for op in t.ops}:
        on = [e for e in t.ranges if (e["pid"], e["tid"]) == thread]
        fsdp = union((e["ts"], e["ts"] + e["dur"]) for e in on
                     if e.get("cat") == "user_annotation" and e["name"].startswith("FSDP::"))
        c10d = union((e["ts"], e["ts"] + e["dur"]) for e in on if e["name"].startswith(("c10d::", "_c10d_functional::")))
        compute = sorted(e["ts"] for e in on if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
                         and not inside(e["ts"], fsdp) and not inside(e["ts"], c10d))
        waits: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)  # (kind, group) -> (ts, what)
        for e in on:
            if e.get("cat") == "user_annotation" and (m := WAIT_RANGE.match(e["name"])):
                kind = "all_gather" if m["what"] == "all_gather_copy_out" else "reduce_scatter"
                waits[kind, m["fqn"] or ROOT_GROUP].append((e["ts"], m["what"]))
        for ranges in waits.values():
            ranges.sort()
        issues: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for op in (op for op in t.ops if (op["pid"], op["tid"]) == thread):
            if (group := t.group_of(op)) is not None and C10D_OPS[op["name"]][0] in ("all_gather", "reduce_scatter"):
                issues[C10D_OPS[op["name"]][0], group].append(op)
        any_wait = sorted(e["ts"] for e in on if e["name"] in (BLOCKING_WAIT, DONE_WAIT))
        group_ranges = t.groups.get(thread)
        for (kind, group), ops in issues.items():
            for k, op in enumerate(ops):
                end = op["ts"] + op["dur"]
                before = ops[k + 1]["ts"] if k + 1 < len(ops) else float("inf")  # its wait precedes the next issue
                candidates = waits[kind, group]
                i = bisect.bisect_left(candidates, (end, ""))
                waited, what = candidates[i] if i < len(candidates) and candidates[i][0] < before else (None, None)
                # Waited at once: any Work.wait before its group range ends (a blocking collective), or
                # its own wait in the same FSDP hook (outermost FSDP range) that issued it.
                issuing = next(((s, e) for s, e, _ in group_ranges.ranges if s <= op["ts"] <= e), None)
                j = bisect.bisect_left(any_wait, end)
                hook = _span_at(fsdp, op["ts"])
                if issuing and j < len(any_wait) and any_wait[j] <= issuing[1]:
                    waited, what = any_wait[j], "at once"
                elif waited is not None and hook and waited <= hook[1]:
                    what = "at once"
                blocked = what != "reduce_scatter_done"
                ran = (waited is not None and what != "at once"
                       and bisect.bisect_left(compute, end) < bisect.bisect_left(compute, waited))
                phase_range = next(((s, e) for s, e, _ in t.phases.ranges if s <= op["ts"] <= e), None)
                out.append(Scheduled(t.rank, t.steps.at(op["ts"]), t.phases.at(op["ts"], OTHER),
                                     phase_range[0] if phase_range else -1.0, kind, group, op["ts"], waited,
                                     blocked, ran or what == "reduce_scatter_done"))
    return sorted(out, key=lambda s: (s.rank or 0, s.issued))


def _span_at(spans: list[Interval], t: float) -> Interval | None:
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return spans[i] if i >= 0 and spans[i][0] <= t <= spans[i][1] else None


def must_overlap(scheduled: list[Scheduled]) -> list[Scheduled]:
    """Those of one kind and phase that FSDP's schedule can overlap: per pass, every all-gather but
    the first issued (no group ran before it in that pass to hide it; FSDP2 prefetches only within
    a pass) and every reduce-scatter but the last (the last group's: backward ends with it)."""
    passes: dict[tuple, list[Scheduled]] = defaultdict(list)
    for s in scheduled:
        passes[s.rank, s.pass_start].append(s)
    out = []
    for ops in passes.values():
        ops.sort(key=lambda s: s.issued)
        out += ops[1:] if ops[0].kind == "all_gather" else ops[:-1]
    return out


# --------------------------------------------------------------------------- memory


def untracked_blocks(trace: Trace | dict) -> dict[tuple[int, int], int]:
    """(address, time_us) -> bytes of every CPU block whose free the trace does not show.

    A tensor handed to gloo can be freed by a gloo worker thread after the collective, outside
    any profiled range, so no free is recorded: the reduce-scatter's clone of its input, or an
    all-gather buffer whose last reference the worker dropped. The snapshot then shows it alive
    until its address is reused, or to the end. Such a block is certain when its address is
    allocated again without a free in between; a block never freed in the window counts as one
    when it is a collective's buffer: allocated inside a c10d op, or exactly the size of a
    tensor of the next c10d op its thread issued.
    """
    events = trace.data["traceEvents"] if isinstance(trace, Trace) else trace["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"
                     and e.get("args", {}).get("Device Type") == 0), key=lambda e: e["ts"])
    ops: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name", "").startswith("c10d::"):
            ops[e["pid"], e["tid"]].append(e)
    for thread_ops in ops.values():
        thread_ops.sort(key=lambda e: e["ts"])

    def collective_buffer(block: dict) -> bool:
        thread_ops = ops.get((block["pid"], block["tid"]), [])
        i = bisect.bisect_right([op["ts"] for op in thread_ops], block["ts"])
        if i > 0 and block["ts"] <= thread_ops[i - 1]["ts"] + thread_ops[i - 1]["dur"]:
            return True
        return i < len(thread_ops) and block["args"]["Bytes"] in _tensor_bytes(thread_ops[i])

    live: dict[int, dict] = {}
    found: dict[tuple[int, int], int] = {}
    for e in memory:
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            if addr in live:  # allocated again: the previous block's free is missing
                found[addr, int(live[addr]["ts"])] = live[addr]["args"]["Bytes"]
            live[addr] = e
        elif addr in live:
            del live[addr]
    for addr, e in live.items():
        if collective_buffer(e):
            found[addr, int(e["ts"])] = e["args"]["Bytes"]
    return found


def _tensor_bytes(op: dict) -> set[int]:
    """Byte sizes of an op's tensor arguments, from the recorded shapes and dtypes."""
    args = op.get("args", {})
    sizes = set()
    for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", [])):
        if dims and isinstance(dims[0], list):
            dims = dims[0]
        if dims and dtype in ITEMSIZE:
            n = ITEMSIZE[dtype]
            for d in dims:
                n *= d
            sizes.add(n)
    return sizes


def _time_offset(t: Trace, times: list[int]) -> float:
    """What to subtract from snapshot times to get trace times (see the module docstring)."""
    if not times or not t.steps.ranges:
        return 0.0
    lo, hi = t.steps.ranges[0][0], t.steps.ranges[-1][1]
    sample = times[:: max(1, len(times) // 100)]
    for offset in (0.0, t.data.get("baseTimeNanoseconds", 0) / 1e3):
        if any(lo <= x - offset <= hi for x in sample):
            return offset
    raise ValueError("the snapshot's times do not fall in the trace's profiled steps: "
                     "are they from the same run and rank?")


def analyze_memory(snapshot: str | Path | dict, trace: Trace | str | Path | dict) -> MemoryStats:
    """Peaks per phase and growth per step of one rank, from its snapshot and its trace."""
    t = trace if isinstance(trace, Trace) else Trace(trace)
    snap = snapshot if isinstance(snapshot, dict) else profiling.load_snapshot(snapshot)
    untracked = {} if t.cuda else untracked_blocks(t)
    if untracked:  # without their allocations, memory_timeline also ignores their (late) frees
        traces = snap["device_traces"]
        device = next((i for i, d in enumerate(traces) if d), 0)
        kept = [e for e in traces[device]
                if not (e["action"] == "alloc" and (e["addr"], e["time_us"]) in untracked)]
        snap = {**snap, "device_traces": [*traces[:device], kept, *traces[device + 1:]]}
    timeline = profiling.memory_timeline(snap)
    offset = _time_offset(t, [x for x, _ in timeline])
    times = [x - offset for x, _ in timeline]
    values = [b for _, b in timeline]

    def at(x: float) -> int:
        """Bytes allocated at time x, after every event up to it."""
        i = bisect.bisect_right(times, x) - 1
        return values[i] if i >= 0 else 0

    def peak(spans: list[Interval]) -> int:
        best = 0
        for s, e in spans:
            best = max(best, at(s), *values[bisect.bisect_left(times, s):bisect.bisect_right(times, e)])
        return best

    steps = [(s, e) for s, e, _ in t.steps.ranges]
    return MemoryStats(
        peak=max(values, default=0),
        peak_forward=peak(t.phases.spans("forward")),
        peak_backward=peak(t.phases.spans("backward")),
        peak_optimizer=peak(t.phases.spans("optimizer")),
        growth=[at(e) - at(s) for s, e in steps],
        untracked=[sum(b for (_, x), b in untracked.items() if s <= x - offset <= e) for s, e in steps],
    )


# --------------------------------------------------------------------------- a whole run


@dataclass
class RunStats:
    """Every rank of one run: collectives averaged over steps and ranks, memory worst over ranks."""

    comm: StepStats
    memory: MemoryStats | None
    steps: list[StepStats]
    """per rank and profiled step."""
    memories: list[MemoryStats]
    """per rank."""
    scheduled: list[Scheduled] = field(default_factory=list)
    """every FSDP group's collective of every rank (see `schedule`)."""

    def overlap(self, kind: str, phase: str) -> tuple[int, int, list[Scheduled]]:
        """(overlapped, that could be, the ones that could be and were not) for one kind and phase."""
        could = must_overlap([s for s in self.scheduled if (s.kind, s.phase) == (kind, phase)])
        missed = [s for s in could if not s.overlapped]
        return len(could) - len(missed), len(could), missed


def rank_files(directory: str | Path, suffix: str) -> list[Path]:
    files = sorted(Path(directory).glob(f"rank*{suffix}"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise FileNotFoundError(f"no rank*{suffix} in {directory}")
    return files


def analyze_run(traces: str | Path, snapshots: str | Path | None = None, *, snapshots_optional: bool = False) -> RunStats:
    """rank{r}.json in `traces` and, when given, rank{r}.pickle in `snapshots` (each read once).
    A trace profiled without allocation events (train.py --no-profile-memory) has no snapshot of its
    own: one found beside it is an older run's, refused (or, with snapshots_optional, not read)."""
    steps, memories, scheduled = [], [], []
    for path in rank_files(traces, ".json"):
        t = Trace(path)
        steps += analyze_trace(t)
        scheduled += schedule(t)
        if snapshots is None:
            continue
        if t.data.get("profile_memory"):  # torch's mark of a trace with allocation events
            memories.append(analyze_memory(Path(snapshots) / f"{path.stem}.pickle", t))
        elif not snapshots_optional:
            raise ValueError(f"{path} was profiled with --no-profile-memory, so no snapshot in {snapshots} is "
                             "from its run: profile again without that flag, or analyse the traces alone")
    return RunStats(mean(steps), MemoryStats.worst(memories) if memories else None, steps, memories, scheduled)


# --------------------------------------------------------------------------- CLI


def snapshots_dir_for(traces: Path) -> Path:
    """train.py's layout: traces/<fsdp> next to snapshots/<fsdp>."""
    parts = list(traces.parts)
    if "traces" in parts:
        parts[len(parts) - 1 - parts[::-1].index("traces")] = "snapshots"
    return Path(*parts)


def table(runs: dict[str, RunStats]) -> str:
    """Runs side by side: counts and times per step (mean over steps and ranks), memory in MiB."""
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell) -> None:
        rows.append((label, [cell(r) for r in runs.values()]))

    def memory(cell):
        return lambda r: "-" if r.memory is None else cell(r.memory)

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f}"

    row("step (ms)", lambda r: f"{r.comm.step_ms:.0f}")
    for kind in KINDS:
        name = kind.replace("_", "-")
        for phase in (*PHASES, OTHER):
            if any(r.comm.kind(kind).by_phase[phase].count for r in runs.values()):
                row(f"{name}s, {phase}", lambda r, k=kind, p=phase: f"{r.comm.kind(k).by_phase[p].count:g}")
        if kind == "all_reduce":
            continue  # the grad norm and the loss: counted, not worth timing
        row(f"{name} time (ms)", lambda r, k=kind: f"{r.comm.kind(k).time_ms:.1f}")
        row(f"{name} hidden", lambda r, k=kind: r.comm.kind(k).hidden_text)
        for phase in PHASES:
            if any(r.comm.kind(kind).by_phase[phase].time_ms for r in runs.values()):
                row(f"  in {phase}", lambda r, k=kind, p=phase: r.comm.kind(k).by_phase[p].hidden_text)
    row("peak memory (MiB)", memory(lambda m: mib(m.peak)))
    row("  in forward", memory(lambda m: mib(m.peak_forward)))
    row("  in backward", memory(lambda m: mib(m.peak_backward)))
    row("growth per step (MiB)", memory(lambda m: " ".join(f"{g / 2**20:+.2f}" for g in m.growth)))
    if any(r.memory and any(r.memory.untracked) for r in runs.values()):
        row("  untracked (MiB)", memory(lambda m: " ".join(mib(u) for u in m.untracked)))

    names = list(runs)
    width = max(len(label) for label, _ in rows)
    cols = [max(len(n), *(len(cells[i]) for _, cells in rows)) for i, n in enumerate(names)]
    lines = [" " * width + "".join(f"  {n:>{w}}" for n, w in zip(names, cols))]
    lines += [f"{label:<{width}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, cols)) for label, cells in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Args:
    """Collectives, overlap and memory of profiled runs, side by side."""

    traces: Annotated[tuple[Path, ...], tyro.conf.Positional, tyro.conf.arg(metavar="TRACES...")]
    """trace directories with rank{r}.json, e.g. traces/fsdp2 traces/effdl."""
    snapshots: tuple[Path, ...] | None = None
    """snapshot directories, one per trace directory (default: traces/X -> snapshots/X, left out
    where absent or from an older run)."""


def main(args: Args) -> None:
    if not args.traces:  # tyro accepts an empty tuple; a table of nothing helps no one
        stop("no trace directory given: name one or more, e.g. traces/fsdp2 traces/effdl", BAD_INPUT)
    snapshots = args.snapshots or [snapshots_dir_for(t) for t in args.traces]
    if len(snapshots) != len(args.traces):
        stop(f"{len(args.traces)} trace directories but {len(snapshots)} --snapshots: give one snapshot directory "
             "per trace directory, in the same order", BAD_INPUT)
    missing = [str(t) for t in args.traces if not t.is_dir()]
    missing += [str(s) for s in (args.snapshots or []) if not s.is_dir()]  # asked for explicitly
    if missing:
        stop(f"no such directory: {', '.join(missing)} (train.py writes traces/<fsdp> and snapshots/<fsdp>)",
             BAD_INPUT)
    runs = {}
    for traces, snaps in zip(args.traces, snapshots):
        name = traces.name or str(traces)
        while name in runs:
            name += "'"
        try:
            runs[name] = analyze_run(traces, snaps if snaps.is_dir() else None, snapshots_optional=not args.snapshots)
        except ValueError as e:  # traces or snapshots not written as train.py writes them
            stop(str(e), BAD_INPUT)
    print(table(runs))


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.analysis"))


if __name__ == "__main__":
    cli()

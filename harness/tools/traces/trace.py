"""A rank's chrome trace (what `train.py --profile-steps` writes) read into what the analyses use:
its profiled steps and phases, the c10d ops that issued collectives, FSDP's group ranges, and
interval arithmetic over them. The analyses: harness/tools/traces/collectives.py (counts, hidden time),
harness/tools/traces/schedule.py (the overlap the graded checks judge), harness/tools/traces/memory_analysis.py.

A collective is *counted* once per c10d dispatcher op, on whichever thread issued it (the main
thread, with the `ProfilerStep#N` ranges; on CUDA backward hooks run on autograd's device thread):
`c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, `c10d::allreduce_` (C10D_OPS). Its *phase*
is the `## forward ##` / `## backward ##` / `## optimizer ##` range containing the op; FSDP's last
reduce-scatters run in autograd's final callback, still inside `## backward ##`. Anything else
(the loss all-reduce) is "other".
"""

from __future__ import annotations

import bisect
import json
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from harness.memory_model import ROOT_GROUP  # the root group's name, the runtime's memory model's too

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
STEP = re.compile(r"^ProfilerStep#(\d+)$")
# FSDP's profiler ranges around a group's collectives (FSDP2's names, which effdl
# shares): `FSDP::all_gather (layers.3)`; the root's group has no name in parentheses. On a 2-D mesh
# (HSDP) the reference also names the process group: `FSDP::all_gather (layers.3) [shard]` (LINK).
LINK = r"(?: \[(?P<link>shard|replicate)\])?"
GROUP_RANGE = re.compile(r"^FSDP::(?:all_gather|post_backward_reduce)(?: \((?P<fqn>.*?)\))?" + LINK + "$")
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


def span_at(spans: list[Interval], t: float) -> Interval | None:
    """The span of a union that holds time t, if any."""
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return spans[i] if i >= 0 and spans[i][0] <= t <= spans[i][1] else None


def inside(t: float, spans: list[Interval]) -> bool:
    return span_at(spans, t) is not None


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


# --------------------------------------------------------------------------- reading a trace


# [Note: an op run through a dispatch mode]
# Under a Python dispatch mode (the graded runs' collective log, jobs.CommLog), the profiler records each op
# twice: the op as called, then `PythonDispatchMode` (the mode's Python code), then the same op again where the
# mode runs it. Only the outer one is the program's call: the two inside are dropped (what the op itself runs,
# nested further in, stays), so a collective is one issue with a mode on as without one. (Where autograd's own
# range sits between an op and the mode, a compute op keeps its duplicate: compute counts by order only.)
DISPATCH_MODE = "PythonDispatchMode"


def without_mode_redispatch(events: list[dict]) -> list[dict]:
    """`events` less each op's re-run inside a dispatch mode, and the mode's own ranges (see [Note: an op run
    through a dispatch mode])."""
    dropped: set[int] = set()
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[e.get("pid"), e.get("tid")].append(e)
    for on in by_thread.values():
        stack: list[tuple] = []  # (end, name, whether a cpu_op) of the ranges enclosing the current one, outermost first
        for e in sorted(on, key=lambda e: (e["ts"], -e["dur"])):
            ts, name, op = e["ts"], e["name"], e.get("cat") == "cpu_op"
            while stack and stack[-1][0] < ts:
                stack.pop()
            if op:  # the profiler's own ranges: a program's record_function is a user_annotation
                if name == DISPATCH_MODE:
                    dropped.add(id(e))
                elif len(stack) >= 2 and stack[-1][1] == DISPATCH_MODE and stack[-1][2] \
                        and stack[-2][1] == name and stack[-2][2]:
                    dropped.add(id(e))
            stack.append((ts + e["dur"], name, op))
    return [e for e in events if id(e) not in dropped]


MAX_TRACE = 1 << 30
"""bytes of one trace file read (a profiled step of the debug model writes megabytes)"""


class Trace:
    """One rank's chrome trace, with the main thread's step and phase ranges."""

    def __init__(self, trace: str | Path | dict):
        if not isinstance(trace, dict):
            with open(trace, "rb") as f:  # a trace may come from a run of a file under test: data, capped
                text = f.read(MAX_TRACE + 1)
            if len(text) > MAX_TRACE:
                raise ValueError(f"{trace} is over {MAX_TRACE} bytes: not a trace of the graded runs")
            trace = json.loads(text)
            if not isinstance(trace, dict):
                raise ValueError(f"{trace} is not a chrome trace (a JSON object)")
        self.data = trace
        self.rank = trace.get("distributedInfo", {}).get("rank")
        self.ranges = without_mode_redispatch([e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e])
        main = next((e for e in self.ranges if e.get("cat") == "user_annotation" and STEP.match(e["name"])), None)
        if main is None:
            raise ValueError("the trace has no ProfilerStep#N range: was it written by profiling.StepProfiler?")
        self.main = (main["pid"], main["tid"])
        by_thread: dict[tuple, list[dict]] = defaultdict(list)  # (pid, tid) -> its ranges, in the trace's order
        for e in self.ranges:
            by_thread[e["pid"], e["tid"]].append(e)
        self.by_thread = dict(by_thread)
        self.on_main = self.by_thread[self.main]
        self.memo: dict = {}  # what the analyses read of this trace more than once (schedule.node_leaves)
        annotations = [e for e in self.on_main if e.get("cat") == "user_annotation"]
        self.steps = Ranges((e["ts"], e["ts"] + e["dur"], int(m[1]))
                            for e in annotations if (m := STEP.match(e["name"])))
        labels = {f"## {p} ##": p for p in PHASES}
        self.phases = Ranges((e["ts"], e["ts"] + e["dur"], labels[e["name"]])
                             for e in annotations if e["name"] in labels)
        # c10d ops of every thread: on CUDA, FSDP's backward hooks run on autograd's device thread.
        # (the dispatcher's: a program's record_function range so named is a user_annotation, not an op)
        self.ops = sorted((e for e in self.ranges if e["name"] in C10D_OPS and e.get("cat") == "cpu_op"),
                          key=lambda e: e["ts"])
        # every collective op the dispatcher ran, of whatever kind or namespace (waits move no data): what the
        # graded profiled run compares with FSDP2's whole, so no data moves in it beside the collectives
        # the analysis reads (a functional collective, a broadcast)
        self.c10d_calls: dict[str, int] = {}
        for e in self.ranges:
            if e["name"].startswith(("c10d::", "_c10d_functional::")) and e.get("cat") == "cpu_op" \
                    and not e["name"].endswith(("::wait", "::wait_tensor")):
                self.c10d_calls[e["name"]] = self.c10d_calls.get(e["name"], 0) + 1
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


def input_dims(event: dict, index: int) -> tuple | None:
    """The recorded shape of an op's `index`-th input (a TensorList's first tensor), if recorded."""
    dims = event.get("args", {}).get("Input Dims")
    if not dims or index >= len(dims):
        return None
    d = dims[index]
    if d and isinstance(d[0], list):
        d = d[0]
    return tuple(d)


def rank_files(directory: str | Path, suffix: str) -> list[Path]:
    """rank{r}<suffix> in a directory, in rank order."""
    files = sorted(Path(directory).glob(f"rank*{suffix}"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        raise FileNotFoundError(f"no rank*{suffix} in {directory}")
    return files

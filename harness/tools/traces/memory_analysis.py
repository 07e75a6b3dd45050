"""Memory of one rank per phase and per step: its memory snapshot (`profiling.memory_timeline`,
bytes allocated since recording started) read against the phase ranges of the same rank's trace
(harness/tools/traces/trace.py).

CPU snapshots carry the trace's `ts` as `time_us`; CUDA ones carry unix time, which is
`ts + baseTimeNanoseconds / 1000`. CPU numbers are relative to the start of profiling: frees of
older blocks are not recorded, so the first profiled step's growth includes what the step before
it left (its logits: 1 MiB for the debug model). CPU traces also miss the frees that gloo worker
threads perform after a collective (see `untracked_blocks`): those blocks are left out of the
timeline and reported as `untracked`.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness import profiling
from harness.tools.traces.trace import ITEMSIZE, Interval, Trace


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


def tensor_peaks(trace: Trace) -> list[int]:
    """Per profiled step (the main thread's `ProfilerStep#N` ranges, in order): the most tensor memory held at
    once, memory.TensorPeaks' measure, read from a trace with allocation events of a run that counted them
    (memory.allocations_counted: each `[memory]` event carries c10's exact total then, frees on other threads
    included). The level the step starts at counts too: the total of the last event before it, or, for the
    first, the first event's total less its own bytes. The trace may be a file under test's: what is read is
    checked for type, and a step without allocation events is refused."""
    events = []
    for e in trace.data["traceEvents"]:
        if e.get("name") != "[memory]" or not isinstance(args := e.get("args"), dict) or args.get("Device Type") != 0:
            continue
        ts, total, size = e.get("ts"), args.get("Total Allocated"), args.get("Bytes", 0)
        if not (isinstance(ts, (int, float)) and type(total) is int and type(size) is int and total >= 0):
            raise ValueError(f"an allocation event of rank {trace.rank}'s trace is malformed: {str(e)[:200]}")
        events.append((ts, total, size))
    events.sort()
    times = [ts for ts, _, _ in events]
    peaks = []
    for start, end, number in trace.steps.ranges:
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        if first == last:
            raise ValueError(f"rank {trace.rank}'s trace has no allocation event in ProfilerStep#{number}: was it "
                             "profiled with allocation events (profile_memory)?")
        level = events[first - 1][1] if first else events[first][1] - events[first][2]
        peaks.append(max(level, *(total for _, total, _ in events[first:last])))
    return peaks


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

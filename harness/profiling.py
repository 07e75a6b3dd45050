"""Per-rank profiling of a few training steps: a chrome trace and a memory snapshot.

`StepProfiler` profiles `active` steps after `skip` warm-up steps and writes, per rank,

    traces/rank{R}.json        chrome trace  -> open in https://ui.perfetto.dev
    snapshots/rank{R}.pickle   memory snapshot -> drop on https://pytorch.org/memory_viz

The trace has one `ProfilerStep#N` range per profiled step (N counts from 0 at the first
training step, so with skip=1 the profiled steps are #1, #2, ...), every aten op with input
shapes, the `record_function` ranges of the code (FSDP2 labels its phases `FSDP::all_gather (i)`,
`FSDP::post_backward_reduce (i)`, ...) and `[memory]` instant events for every allocation and free.
With memory=False (train.py --no-profile-memory) there are no `[memory]` events and no snapshot.

Finding the collectives in the trace
------------------------------------
CPU / gloo (checked with torch 2.11):
  * main thread: the c10d dispatcher ops `c10d::_allgather_base_` (all_gather_into_tensor),
    `c10d::_reduce_scatter_base_` (reduce_scatter_tensor), `c10d::allreduce_` (all_reduce).
    These only enqueue the work; the time spent waiting for it is wherever the result is used.
  * gloo worker threads (named `pt_gloo_runloop`): `gloo:all_gather`, `gloo:all_reduce`. Gloo has
    no reduce-scatter of a flat tensor: `_reduce_scatter_base_` runs as a `gloo:all_reduce`
    followed by a copy of this rank's shard, so a reduce-scatter shows up as an all-reduce there.
CUDA / NCCL (names as emitted by ProcessGroupNCCL and NCCL >= 2.19; not checked on a GPU here):
  * CPU side: the same `c10d::*` ops, around `nccl:_all_gather_base` / `nccl:_reduce_scatter_base`.
  * GPU side: kernels `ncclDevKernel_AllGather_*`, `ncclDevKernel_ReduceScatter_*` on the NCCL
    stream, which is how compute/communication overlap becomes visible.

Memory snapshot
---------------
CUDA: the caching allocator's own history (`torch.cuda.memory._record_memory_history`), switched
on for the profiled steps only and dumped at the end: real segments, Python stack traces, and
blocks that were allocated before recording started but are still alive.

CPU: torch keeps no such history for the CPU allocator, so the snapshot is rebuilt in the same
format from the profiler's `[memory]` events (read back from the exported chrome trace). It
contains only what c10's CPU allocator handled during the profiled steps, on threads the profiler
watched (main thread, autograd, gloo work that copies tensors): tensor storage. It does not contain
gloo's internal buffers, Python objects, or anything allocated before profiling began (the CPU
allocator only starts tracking sizes once profiling is on: it warns "Memory block of unknown size
was allocated before the profiling started" and reports no event for such frees). Consequently:
  * frees of blocks never seen allocated are dropped, so the curve starts at 0 and shows memory
    *relative to the start of profiling*, not the process's absolute usage;
  * c10 mallocs every tensor separately (no caching), so each allocation is modelled as its own
    segment (segment_alloc/alloc ... free/segment_free): reserved == allocated by construction;
  * "frames" are not Python stacks but the stack of profiler ranges enclosing the allocation on its
    thread, innermost first, e.g. `cpu_op:0:aten::empty`, `cpu_op:0:aten::mm`,
    `user_annotation:0:FSDP::all_gather (0)`, `user_annotation:0:ProfilerStep#1`, then the thread
    as `thread:<tid>:<name>`. With `with_stack=True` Python functions appear as file:line frames;
  * addresses are the CPU pointers as reported; `time_us` are the chrome trace's `ts` values, so
    they line up with the trace in Perfetto.

The CLI accepts both kinds: `python -m torch.cuda._memory_viz trace_plot rank0.pickle -o out.html`
(the Active Memory Timeline; `-s` for the segment timeline), `segment_plot`, `stats` and `trace`
(which calls each CPU allocation's segment a cudaMalloc: its wording, not what happened).
`segments` and `memory` also parse but render flamegraphs with `flamegraph.pl`, which the CLI
downloads from GitHub on first use.

`load_snapshot` and `memory_timeline` give the same data to Python code.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import sys
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

__all__ = ["StepProfiler", "load_snapshot", "memory_timeline", "snapshot_from_chrome_trace"]

# Enough for a few steps of a small model, bounded so a long run cannot exhaust host memory.
_CUDA_HISTORY_MAX_ENTRIES = 500_000
# memory_viz's in-browser unpickler understands protocols 2-4 only.
_PICKLE_PROTOCOL = 4


CPU_SNAPSHOT_NOTE = ("CPU snapshot built from the profiler's allocator events: allocations only. Frees done "
                     "on gloo's threads are not recorded, so its peak is not the process's; for peak memory "
                     "use peak RSS with --exact-cpu-memory (train.py) or harness.tools.lab.report's timeline.")
_cpu_profiler_quiet = False


def _quiet_cpu_profiler() -> None:
    """Silence the two lines a CPU profile prints on every run, both expected and harmless:

    - kineto's "gpuGetDeviceCount failed" (an ERROR) when torch has CUDA support but the machine
      no GPU: kineto asks for GPU properties while exporting a CPU-only trace. KINETO_LOG_LEVEL
      is read when profiling starts; 5 is above kineto's ERROR (4). Only without a GPU, where
      kineto has no device to report on; a value the user set wins.
    - c10's "Memory block of unknown size was allocated before the profiling started" (see the
      module docstring): c10 logs it once per process, so a throwaway profile with stderr
      closed frees one such block and spends that once, before the real profile starts.
    """
    global _cpu_profiler_quiet
    if _cpu_profiler_quiet:
        return
    _cpu_profiler_quiet = True
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    block = torch.empty(16)
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with _no_cycle_warning(), torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            del block
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def _no_cycle_warning():
    """torch.profiler warns once per process that each cycle's events are cleared ("set
    acc_events=True" to keep them). There is one cycle here; acc_events=True would only silence
    that line, at the price of parsing every event into Python objects when profiling stops
    (about 1 s for two steps of the debug model), which nothing here reads."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning: Profiler clears events at the end of each cycle")
        yield


class StepProfiler:
    """Profiles `active` training steps after `skip` steps (skip is usually 1 warm-up step);
    active == 0 disables everything (zero overhead, step() is a no-op).

    Use as a context manager and call `step()` once at the end of every training step. The trace
    and snapshot are written as soon as the last profiled step ends (or on exit if training stops
    earlier), to `trace_path` and `snapshot_path`. With memory=False the trace has no `[memory]`
    events and no snapshot is written (`snapshot_path` is None): faster, for what reads only the
    schedule and the collectives.
    """

    def __init__(
        self,
        *,
        active: int,
        skip: int,
        device: torch.device,
        rank: int,
        traces_dir: Path,
        snapshots_dir: Path,
        with_stack: bool = False,
        memory: bool = True,
    ):
        if active < 0 or skip < 0:
            raise ValueError(f"active and skip must be >= 0, got {active=} {skip=}")
        self.active, self.skip = active, skip
        self.device = torch.device(device)
        self.with_stack = with_stack
        self.trace_path = Path(traces_dir) / f"rank{rank}.json"
        self.memory = memory
        self.snapshot_path = Path(snapshots_dir) / f"rank{rank}.pickle" if memory else None
        self._cuda = self.device.type == "cuda"
        self._prof: torch.profiler.profile | None = None
        self._steps_done = 0
        self._recording_cuda_memory = False

    def __enter__(self) -> StepProfiler:
        if self.active == 0:
            return self
        activities = [ProfilerActivity.CPU]
        if self._cuda:
            activities.append(ProfilerActivity.CUDA)
        # The last skipped step doubles as the profiler's warm-up (tracer start-up cost lands
        # there, outside the profiled steps); with nothing skipped there is no room for one.
        warmup = 1 if self.skip > 0 else 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            schedule = torch.profiler.schedule(
                wait=self.skip - warmup, warmup=warmup, active=self.active, repeat=1
            )
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._write_outputs,
            record_shapes=True,
            profile_memory=self.memory,
            with_stack=self.with_stack,
        )
        if not self._cuda:
            _quiet_cpu_profiler()
        with _no_cycle_warning():
            self._prof.__enter__()
        if self.skip == 0:
            self._start_cuda_memory_history()
        return self

    def step(self) -> None:
        if self._prof is None:
            return
        self._steps_done += 1
        # Ends the last profiled step and writes the outputs (via _write_outputs) when due.
        with _no_cycle_warning():
            self._prof.step()
        if self._steps_done == self.skip:
            self._start_cuda_memory_history()
        elif self._steps_done == self.skip + self.active:
            self._close()  # the remaining training steps run without a profiler

    def __exit__(self, *exc) -> None:
        self._close(*exc)

    def _close(self, *exc) -> None:
        if self._prof is None:
            return
        try:
            # Writes the outputs if training stopped while steps were still being recorded.
            self._prof.__exit__(*(exc or (None, None, None)))
        finally:
            self._prof = None
            self._stop_cuda_memory_history()

    def _start_cuda_memory_history(self) -> None:
        if not (self._cuda and self.memory):
            return
        # Python stacks only: C++ unwinding per allocation is slow and rarely what one reads.
        torch.cuda.memory._record_memory_history(
            max_entries=_CUDA_HISTORY_MAX_ENTRIES, stacks="python", clear_history=True
        )
        self._recording_cuda_memory = True

    def _stop_cuda_memory_history(self) -> None:
        if self._recording_cuda_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_cuda_memory = False

    def _write_outputs(self, prof: torch.profiler.profile) -> None:
        _refuse_unwritable_names(prof)
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        if not self.memory:
            return
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        if self._cuda:
            if self._recording_cuda_memory:
                torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
                self._stop_cuda_memory_history()
        else:
            with open(self.trace_path) as f:
                snapshot = snapshot_from_chrome_trace(json.load(f))
            with open(self.snapshot_path, "wb") as f:
                pickle.dump(snapshot, f, protocol=_PICKLE_PROTOCOL)


def _refuse_unwritable_names(prof: torch.profiler.profile) -> None:
    """The chrome trace is JSON that torch writes without escaping names: a `record_function` name with
    a quote, a backslash or a control character would end its string early, and the rest would be read as
    events of their own (a forged op, a collective). Such a name is refused before anything is written."""
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CPU:
            continue  # a device's kernels and copies: named by the libraries, not by the program
        name = event.name()
        if any(c in '"\\' or ord(c) < 0x20 for c in name):
            raise ValueError(f"a profiled range is named {name!r}: the trace cannot hold a quote, a backslash or a "
                             "control character in a name; name your record_function ranges with plain text")


# ----------------------------------------------------------------------------------------------
# CPU memory snapshot from a chrome trace


_PY_FRAME = re.compile(r"^(?P<file>.*)\((?P<line>\d+)\): (?P<name>.*)$")


def _frame(cat: str, name: str) -> dict:
    if cat == "python_function" and (m := _PY_FRAME.match(name)):
        return {"filename": m["file"], "line": int(m["line"]), "name": m["name"]}
    return {"filename": cat, "line": 0, "name": name}


def _enclosing_stacks(ops, mems, base, frame) -> list[list[dict]]:
    """For each memory event (sorted by ts) the frames of the ranges enclosing it, innermost first.

    Ranges on one thread nest, so a sweep in start order (outer before inner on equal starts)
    with a stack of open ranges finds them; each range's frame list is built once and shared.
    """
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    open_ops: list[tuple[float, list[dict]]] = []  # (end, frames)
    stacks, i = [], 0
    for mem in mems:
        t = mem["ts"]
        while i < len(ops) and ops[i]["ts"] <= t:
            op = ops[i]
            while open_ops and open_ops[-1][0] < op["ts"]:
                open_ops.pop()
            parent = open_ops[-1][1] if open_ops else base
            open_ops.append((op["ts"] + op["dur"], [frame(op.get("cat", ""), op["name"]), *parent]))
            i += 1
        while open_ops and open_ops[-1][0] < t:
            open_ops.pop()
        stacks.append(open_ops[-1][1] if open_ops else base)
    return stacks


def snapshot_from_chrome_trace(trace: dict, device_type: int = 0) -> dict:
    """Builds a memory_viz snapshot from the `[memory]` events of a chrome trace.

    `device_type` selects the allocator (0: CPU, as in the events' "Device Type" argument).
    Everything lands in device_traces[0]; see the module docstring for what it contains.
    """
    events = trace["traceEvents"]
    thread_names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    ops_by_thread: dict[tuple, list[dict]] = {}
    mem_by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and "dur" in e:
            ops_by_thread.setdefault(key, []).append(e)
        elif e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type:
            mem_by_thread.setdefault(key, []).append(e)

    # Shared frame objects keep the pickle small: pickle stores each distinct object once.
    frame_cache: dict[tuple[str, str], dict] = {}

    def frame(cat: str, name: str) -> dict:
        if (cat, name) not in frame_cache:
            frame_cache[cat, name] = _frame(cat, name)
        return frame_cache[cat, name]

    located: list[tuple[float, int, int, list[dict]]] = []  # (ts, addr, bytes, frames)
    for (pid, tid), mems in mem_by_thread.items():
        label = thread_names.get((pid, tid), f"thread {tid}")  # "thread 4083 (pt_gloo_runloop)"
        short = m[1] if (m := re.search(r"\((.*)\)$", label)) else label
        thread = [{"filename": "thread", "line": tid if isinstance(tid, int) else 0, "name": short}]
        mems = sorted(mems, key=lambda e: e["ts"])
        stacks = _enclosing_stacks(ops_by_thread.get((pid, tid), []), mems, thread, frame)
        for mem, frames in zip(mems, stacks):
            located.append((mem["ts"], mem["args"]["Addr"], mem["args"]["Bytes"], frames))
    located.sort(key=lambda x: x[0])

    device_trace: list[dict] = []
    live: dict[int, tuple[int, list[dict]]] = {}  # addr -> (size, frames of the allocation)

    def emit(action: str, t: float, addr: int, size: int, frames: list[dict]) -> None:
        device_trace.append(
            {"action": action, "addr": addr, "size": size, "stream": 0,
             "time_us": int(t), "frames": frames}
        )

    def free(t: float, addr: int) -> None:
        size, frames = live.pop(addr)
        for action in ("free_requested", "free_completed", "segment_free"):
            emit(action, t, addr, size, frames)

    for t, addr, nbytes, frames in located:
        if nbytes > 0:
            if addr in live:  # its free happened on a thread the profiler did not watch
                free(t, addr)
            live[addr] = (nbytes, frames)
            emit("segment_alloc", t, addr, nbytes, frames)
            emit("alloc", t, addr, nbytes, frames)
        elif nbytes < 0 and addr in live:  # frees of blocks allocated before profiling: dropped
            free(t, addr)

    segments = [
        {
            "device": 0,
            "address": addr,
            "total_size": size,
            "allocated_size": size,
            "active_size": size,
            "requested_size": size,
            "stream": 0,
            "segment_type": "large" if size > 1 << 20 else "small",
            "frames": frames,
            "blocks": [
                {"address": addr, "size": size, "requested_size": size,
                 "state": "active_allocated", "frames": frames}
            ],
        }
        for addr, (size, frames) in sorted(live.items())
    ]
    # Said in the file itself, since memory_viz shows it with a GPU legend: only the frees the
    # profiler saw are in it (gloo frees on its own threads), so its peak is not the process's.
    return {"segments": segments, "device_traces": [device_trace], "note": CPU_SNAPSHOT_NOTE}


# ----------------------------------------------------------------------------------------------
# Reading snapshots


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, strings and numbers only, which is all a snapshot holds: a snapshot may come from a
    run of a file under test, and a pickle that names anything else could run code."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a memory snapshot holds plain data only, not {module}.{name}")


def load_snapshot(path: str | Path) -> dict:
    """Loads a snapshot written by StepProfiler (CPU or CUDA) or torch.cuda.memory._dump_snapshot."""
    with open(path, "rb") as f:
        return _PlainUnpickler(f).load()


def memory_timeline(snapshot: dict, device: int | None = None) -> list[tuple[int, int]]:
    """(time_us, bytes allocated) after each alloc / free_completed event of one device trace.

    `device` defaults to the first device with events (device_traces[0] for CPU snapshots; a CUDA
    snapshot is indexed by GPU, so rank r on cuda:r has its events in device_traces[r]).
    Bytes are counted from the start of the recording: blocks allocated before it are not known
    (CPU snapshots never contain them; for CUDA snapshots their frees are ignored here), so this
    is the memory allocated during the recorded steps and still alive, starting from 0.
    """
    traces = snapshot["device_traces"]
    if device is None:
        device = next((i for i, trace in enumerate(traces) if trace), 0)
    live: dict[int, int] = {}
    allocated = 0
    timeline = []
    for e in traces[device] if device < len(traces) else []:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            allocated += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"])
        else:
            continue
        timeline.append((e.get("time_us", 0), allocated))
    return timeline

"""Tests for profiling.py on CPU: chrome trace, CPU memory snapshot, memory_viz compatibility."""

import json
import pickle
import pickletools
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.cuda import _memory_viz as memory_viz

from harness import profiling
from harness.profiling import (
    StepProfiler,
    load_snapshot,
    memory_timeline,
    snapshot_from_chrome_trace,
)

MiB = 1 << 20


def make_profiler(tmp: Path, **kw) -> StepProfiler:
    return StepProfiler(
        device=torch.device("cpu"),
        rank=0,
        traces_dir=tmp / "traces",
        snapshots_dir=tmp / "snapshots",
        **kw,
    )


def train(prof: StepProfiler, steps: int, extra=lambda: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        extra()
        prof.step()


def scratch_4mib() -> None:
    scratch = torch.ones(MiB, dtype=torch.uint8).repeat(4)  # a fresh 4 MiB block
    del scratch


def trace_events(prof: StepProfiler) -> list[dict]:
    with open(prof.trace_path) as f:
        return json.load(f)["traceEvents"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> StepProfiler:
    tmp = tmp_path_factory.mktemp("profiled")
    with make_profiler(tmp, active=2, skip=1) as prof:
        train(prof, steps=4, extra=scratch_4mib)
    return prof


def test_trace_has_profiled_steps(profiled):
    names = {e.get("name") for e in trace_events(profiled)}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names
    assert not {"ProfilerStep#0", "ProfilerStep#3"} & names  # skipped / after the window
    assert "aten::addmm" in names and "[memory]" in names


def test_cpu_snapshot_format(profiled):
    with open(profiled.snapshot_path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces"}
    events = snap["device_traces"][0]
    actions = {e["action"] for e in events}
    assert {"alloc", "free_requested", "free_completed"} <= actions
    for e in events:
        assert {"action", "addr", "size", "stream", "time_us", "frames"} <= set(e)
        assert all(set(f) == {"filename", "line", "name"} for f in e["frames"])
    innermost = {e["frames"][0]["name"] for e in events if e["action"] == "alloc"}
    assert any(name.startswith("aten::") for name in innermost)
    # Every frame stack ends in the profiled step, then the thread.
    alloc = next(e for e in events if e["action"] == "alloc")
    assert alloc["frames"][-2]["name"] == "ProfilerStep#1"
    assert alloc["frames"][-1]["filename"] == "thread"


def test_snapshot_uses_only_opcodes_the_web_viewer_reads(profiled):
    # pytorch.org/memory_viz unpickles in JavaScript and knows only a subset of opcodes.
    supported = {
        "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
        "LONG_BINGET", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST",
        "APPEND", "APPENDS", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE",
        "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT",
        "SHORT_BINUNICODE", "BINUNICODE",
    }  # fmt: skip
    data = profiled.snapshot_path.read_bytes()
    used = {op.name for op, _, _ in pickletools.genops(data)}
    assert used <= supported, used - supported
    assert data[1] <= 4  # protocol


def test_memory_viz_cli(profiled, tmp_path):
    html = tmp_path / "out.html"
    cmd = [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(profiled.snapshot_path)]
    run = subprocess.run([*cmd, "-o", str(html)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "<html>" in html.read_text()
    # `stats` is this function plus a print; calling it here spares starting another interpreter.
    assert "total_allocated" in memory_viz.segsum(load_snapshot(profiled.snapshot_path))


def test_timeline_shows_4mib_bump(profiled):
    snap = load_snapshot(profiled.snapshot_path)
    events = [e for e in snap["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    timeline = memory_timeline(snap)
    assert len(timeline) == len(events)
    bytes_ = [0] + [b for _, b in timeline]
    bumps = [i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == 4 * MiB]
    assert len(bumps) == 2  # one per profiled step
    for i in bumps:
        assert bytes_[i + 1] - bytes_[i] == 4 * MiB
        j = next(
            k for k in range(i + 1, len(events))
            if events[k]["action"] == "free_completed" and events[k]["addr"] == events[i]["addr"]
        )  # fmt: skip
        assert bytes_[j + 1] - bytes_[j] == -4 * MiB
    assert min(bytes_) >= 0  # relative to the start of profiling
    assert [t for t, _ in timeline] == sorted(t for t, _ in timeline)


def test_memory_timeline_synthetic():
    def ev(action, addr, size, t):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": []}

    snap = {
        "segments": [],
        "device_traces": [[
            ev("alloc", 1, 100, 1), ev("alloc", 2, 50, 2), ev("free_requested", 1, 100, 3),
            ev("free_completed", 1, 100, 3), ev("free_completed", 9, 70, 4),  # 9: never allocated
            ev("segment_alloc", 3, 512, 5), ev("free_completed", 2, 50, 6),
        ]],
    }  # fmt: skip
    assert memory_timeline(snap) == [(1, 100), (2, 150), (3, 50), (6, 0)]
    # A CUDA snapshot of rank 1 has its events under cuda:1.
    assert memory_timeline({"segments": [], "device_traces": [[], snap["device_traces"][0]]})[-1] == (6, 0)


def test_snapshot_from_chrome_trace_synthetic():
    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    def mem(ts, addr, nbytes, tid=1):
        args = {"Addr": addr, "Bytes": nbytes, "Device Type": 0, "Device Id": -1}
        return {"ph": "i", "name": "[memory]", "pid": 7, "tid": tid, "ts": ts, "args": args}

    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "thread 1 (python)"}},
        op("ProfilerStep#1", 0, 100, cat="user_annotation"),
        op("aten::mm", 10, 10), op("aten::empty", 10, 2), op("aten::add", 30, 10),
        mem(11, 0xA0, 64), mem(35, 0xB0, 32), mem(50, 0xA0, -64),
        mem(60, 0xC0, -16),  # allocated before profiling: dropped
        mem(70, 0xD0, 8, tid=2),  # a thread without ranges or name
    ]}  # fmt: skip
    snap = snapshot_from_chrome_trace(trace)
    events = snap["device_traces"][0]
    allocs = {e["addr"]: [f["name"] for f in e["frames"]] for e in events if e["action"] == "alloc"}
    assert allocs == {
        0xA0: ["aten::empty", "aten::mm", "ProfilerStep#1", "python"],
        0xB0: ["aten::add", "ProfilerStep#1", "python"],
        0xD0: ["thread 2"],
    }
    assert [e["action"] for e in events if e["addr"] == 0xA0] == [
        "segment_alloc", "alloc", "free_requested", "free_completed", "segment_free"
    ]  # fmt: skip
    assert not any(e["addr"] == 0xC0 for e in events)
    # Blocks alive at the end are the snapshot's segments.
    assert sorted(s["address"] for s in snap["segments"]) == [0xB0, 0xD0]
    assert all(s["blocks"][0]["state"] == "active_allocated" for s in snap["segments"])
    # The CLI's `stats` and `trace` accept it (stats checks its segment accounting).
    assert "total_allocated: 40.0B" in memory_viz.segsum(snap)
    assert "TOTAL MEM" in memory_viz.trace(snap)


def test_active_zero_writes_nothing(tmp_path):
    with make_profiler(tmp_path, active=0, skip=1) as prof:
        train(prof, steps=3)
    assert prof._prof is None
    assert not (tmp_path / "traces").exists() and not (tmp_path / "snapshots").exists()


def test_training_shorter_than_window_still_writes(tmp_path):
    with make_profiler(tmp_path, active=5, skip=0) as prof:
        train(prof, steps=2)
    names = {e.get("name") for e in trace_events(prof)}
    assert {"ProfilerStep#0", "ProfilerStep#1"} <= names
    assert load_snapshot(prof.snapshot_path)["device_traces"][0]


def test_trace_alone_without_memory(tmp_path):
    """memory=False: the same steps and ops in the trace, no allocation events, no snapshot."""
    with make_profiler(tmp_path, active=1, skip=1, memory=False) as prof:
        train(prof, steps=2)
    events = trace_events(prof)
    assert "ProfilerStep#1" in {e.get("name") for e in events}
    assert any(e.get("name") == "aten::addmm" for e in events)
    assert not [e for e in events if e.get("name") == "[memory]"]
    assert prof.snapshot_path is None and not (tmp_path / "snapshots").exists()


@pytest.mark.parametrize("first", [True, False], ids=["first profile of the process", "a later one"])
def test_profiling_warns_nothing(tmp_path, recwarn, monkeypatch, first):
    """torch.profiler's once-per-process "clears events at the end of each cycle" warning is silenced
    without acc_events=True (which parses every event into Python objects when profiling stops):
    in the throwaway CPU profile a process runs first, and in StepProfiler's own."""
    import torch.profiler.profiler as tp

    tp._WARNINGS_SHOWN.clear()  # torch shows it once per process: make this profile the first to
    monkeypatch.setattr(profiling, "_cpu_profiler_quiet", not first)  # False: the throwaway runs again
    with make_profiler(tmp_path, active=1, skip=1) as prof:
        train(prof, steps=2)
    assert not [str(w.message) for w in recwarn if "Profiler" in str(w.message)]
    assert prof._prof is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_visible_with_gloo(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        shard = torch.randn(1024)
        full = torch.empty(1024)

        def collectives():
            dist.all_gather_into_tensor(full, shard)
            dist.reduce_scatter_tensor(shard, full.clone())

        with make_profiler(tmp_path, active=1, skip=1) as prof:
            train(prof, steps=2, extra=collectives)
    finally:
        dist.destroy_process_group()
    events = trace_events(prof)
    names = {e.get("name") for e in events}
    assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= names
    assert "gloo:all_gather" in names  # on a gloo worker thread


@pytest.mark.parametrize("name", ['x", "cat": "cpu_op", "name": "aten::forged', "back\\slash", "new\nline"])
def test_a_range_name_json_cannot_hold_is_refused(tmp_path, name):
    """torch writes range names into the trace unescaped: one that would end its JSON string early (and
    forge events after it) is refused by name before anything is written."""
    def labelled():
        with torch.profiler.record_function(name):
            torch.zeros(1).add_(1)

    with pytest.raises(ValueError, match="cannot hold a quote, a backslash or a control character"):
        with make_profiler(tmp_path, active=1, skip=0, memory=False) as prof:
            train(prof, steps=1, extra=labelled)
    assert not prof.trace_path.exists()


def test_probes_see_a_block_whose_parameters_are_gathered_inside_its_layers():
    """Probes (the graded step's check that gathered parameters are freed) see a block's gathered parameters at its
    pre-forward, as FSDP2 gathers them: a block still holding DTensors there (gathered inside its layers, where
    the probe would never see them nor their freeing) is named; one gathered at its pre-forward is not."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from harness.tools.grading.jobs import Probes

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        mesh = init_device_mesh("cpu", (1,))

        def model():
            m = nn.Module()
            m.layers = nn.ModuleList([nn.Linear(4, 4)])
            for name in ("weight", "bias"):
                p = getattr(m.layers[0], name)
                m.layers[0].register_parameter(name, nn.Parameter(DTensor.from_local(p.detach(), mesh, [Shard(0)])))
            return m

        def gather(module, args):  # a block's pre-forward, as FSDP's: plain tensors while it runs
            for name in ("weight", "bias"):
                module._parameters[name] = nn.Parameter(module._parameters[name].full_tensor())

        late, early = model(), model()
        early.layers[0].register_forward_pre_hook(gather)  # registered before the probe, as FSDP's is
        probes = {m: Probes(m, reshard_after_forward=False) for m in (late, early)}
        late.layers[0].linear_hook = late.layers[0].register_forward_pre_hook(gather)  # inside: after the probe
        for m in (late, early):
            m.layers[0](torch.ones(2, 4))
        assert any("still DTensors when its forward began" in p for p in probes[late].problems), probes[late].problems
        assert not probes[early].problems, probes[early].problems
    finally:
        dist.destroy_process_group()


def test_probes_name_a_block_whose_hooks_did_not_run():
    """Probes check, step by step, that every block ran their hooks (a forward that skipped them, its parameters'
    gathering and freeing unseen, is named); a block called as a module is not named (the control)."""
    from torch import nn

    from harness.tools.grading.jobs import Probes

    def model():
        m = nn.Module()
        m.layers = nn.ModuleList([nn.Linear(4, 4)])
        return m

    called, skipped = model(), model()
    probes = {m: Probes(m, reshard_after_forward=False) for m in (called, skipped)}
    called.layers[0](torch.ones(2, 4))
    skipped.layers[0].forward(torch.ones(2, 4))  # its hooks never run
    for p in probes.values():
        p.after_step(1)
    assert not any("did not run" in p for p in probes[called].problems), probes[called].problems
    assert any("forward hooks on layers.0 (pre), layers.0 (post) did not run" in p for p in probes[skipped].problems), \
        probes[skipped].problems

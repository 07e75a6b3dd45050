"""The trace analyses (harness/tools/traces/trace.py, collectives.py, schedule.py, memory_analysis.py and the
analysis CLI): on real CPU traces of FSDP2, and on small synthetic traces."""

import dataclasses
import json
import os
import pickle
import re
from pathlib import Path

import pytest

import train
from harness import profiling
from harness.memory_model import ROOT_GROUP
from harness.tools.traces import analysis, collectives, memory_analysis, schedule

from harness.tools.grading import policy
from harness.tools.traces.trace import GROUP_RANGE, KINDS, Trace, length, overlap, union

MiB = 1 << 20

# The debug model is wrapped in 7 groups (6 blocks, then the root) and policy.config() runs 2
# micro-steps per step, each with its own forward, backward and reduce-scatters.
GROUPS, MICRO = 7, 2
EXPECTED_COUNTS = {
    # The root is not resharded after forward, so backward gathers only the 6 blocks again.
    "all_gather": {"forward": GROUPS * MICRO, "backward": (GROUPS - 1) * MICRO},
    "reduce_scatter": {"backward": GROUPS * MICRO},
    # The grad norm over DTensors (optimizer) and the loss average after the step (other).
    "all_reduce": {"optimizer": 1, "other": 1},
}
# FSDP2 on CPU waits for every collective as soon as it is issued: it measured exactly 0.
FSDP2_MAX_HIDDEN = 0.02


# --------------------------------------------------------------------------- real runs


def profiled_run(pool, folder: Path, impl: str | None = None) -> analysis.RunStats:
    """Three steps (the last two profiled) of FSDP2, or of effdl (the file `impl`), analysed."""
    cfg = policy.config(impl, num_steps=3, profile_steps=2, traces_dir=folder / "traces",
                        snapshots_dir=folder / "snapshots")
    pool.run(train.train, cfg)
    return analysis.analyze_run(folder / "traces", folder / "snapshots")


@pytest.fixture(scope="module")
def fsdp2_run(pool2, tmp_path_factory) -> analysis.RunStats:
    return profiled_run(pool2, tmp_path_factory.mktemp("fsdp2"))


def assert_counts(run: analysis.RunStats) -> None:
    steps = run.steps
    assert sorted({(s.rank, s.step) for s in steps}) == [(r, n) for r in (0, 1) for n in (1, 2)]
    for s in steps:
        for kind, expected in EXPECTED_COUNTS.items():
            assert s.kind(kind).count_by_phase == expected, (s.rank, s.step, kind)


def assert_every_collective_found_running(run: analysis.RunStats) -> None:
    # Each c10d op was paired with the gloo range that ran it, so times are those of real work.
    for s in run.steps:
        for kind in KINDS:
            for phase, comm in s.kind(kind).by_phase.items():
                assert comm.timed == comm.count, (s.rank, s.step, kind, phase)
                assert (comm.time_ms > 0) == (comm.count > 0)
                assert 0 <= comm.hidden_ms <= comm.time_ms + 1e-9


def assert_memory(run: analysis.RunStats) -> None:
    for m in run.memories:
        assert 0 < m.peak_forward <= m.peak and 0 < m.peak_backward <= m.peak
        assert len(m.growth) == 2
        # The first profiled step also frees what its predecessor left (the logits), but those
        # frees are not recorded: it shows that much growth. The second one is complete.
        assert 0 <= m.growth[0] <= 2 * MiB
        assert abs(m.growth[1]) < 64 * 1024


def test_collective_counts_per_phase(fsdp2_run):
    assert_counts(fsdp2_run)


def test_every_collective_found_running(fsdp2_run):
    assert_every_collective_found_running(fsdp2_run)


def test_fsdp2_hides_nothing_on_cpu(fsdp2_run):
    for kind in ("all_gather", "reduce_scatter"):
        assert fsdp2_run.comm.kind(kind).hidden_fraction < FSDP2_MAX_HIDDEN, kind


def test_memory(fsdp2_run):
    assert_memory(fsdp2_run)


# --------------------------------------------------------------------------- synthetic traces


def x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def mem(ts, addr, nbytes, tid=1):
    args = {"Addr": addr, "Bytes": nbytes, "Device Type": 0, "Device Id": -1}
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 7, "tid": tid, "ts": ts, "args": args}


def step_and_phases():
    return [x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
            x("## forward ##", 10, 300, cat="user_annotation"),
            x("## backward ##", 320, 500, cat="user_annotation"),
            x("## optimizer ##", 830, 100, cat="user_annotation")]


def gloo_trace() -> dict:
    """One all-gather (half hidden behind an mm), one reduce-scatter (not hidden), the loss
    all-reduce, and a gloo range left over from before profiling."""
    return {"traceEvents": [
        *step_and_phases(),
        x("c10d::_allgather_base_", 20, 5, **{"Input Dims": [[8], [4]], "Input type": ["float", "float"]}),
        x("aten::mm", 40, 30),
        x("c10d::_reduce_scatter_base_", 400, 5, **{"Input Dims": [[4], [8]]}),
        x("aten::empty", 401, 1),  # inside the c10d op: not compute
        x("c10d::allreduce_", 950, 20, **{"Input Dims": [[[]]]}),
        x("gloo:all_reduce", 1, 3, tid=2, cat="user_annotation", **{"Input Dims": [[8]]}),  # before profiling
        x("gloo:all_gather", 30, 80, tid=2, cat="user_annotation", **{"Input Dims": [[4]]}),
        x("gloo:all_reduce", 410, 40, tid=3, cat="user_annotation", **{"Input Dims": [[8]]}),
        x("gloo:all_reduce", 955, 10, tid=2, cat="user_annotation", **{"Input Dims": [[]]}),
    ]}


def test_interval_helpers():
    spans = union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert spans == [(0, 3), (5, 9)]
    assert length(spans) == 7
    assert overlap(spans, [(2, 6), (8.5, 20)]) == 1 + 1 + 0.5


def test_gloo_trace():
    [s] = collectives.analyze_trace(gloo_trace())
    assert s.step == 1 and s.step_ms == 1.0
    ag, rs, ar = s.all_gather, s.reduce_scatter, s.all_reduce
    assert ag.count_by_phase == {"forward": 1} and rs.count_by_phase == {"backward": 1}
    assert ar.count_by_phase == {"other": 1}
    # The all-gather ran 30..110 us, the mm 40..70 us.
    assert ag.time_ms == pytest.approx(0.080) and ag.hidden_ms == pytest.approx(0.030)
    assert ag.by_phase["forward"].hidden_fraction == pytest.approx(30 / 80)
    # The reduce-scatter got its own range (shape [8]), not the early one nor the loss's.
    assert rs.time_ms == pytest.approx(0.040) and rs.hidden_ms == 0
    assert ar.time_ms == pytest.approx(0.010) and ar.total.timed == 1


def test_cuda_trace():
    """NCCL kernels found through their launch's correlation id; compute = other kernels."""
    def kernel(name, ts, dur, corr, stream):
        return x(name, ts, dur, tid=stream, cat="kernel", correlation=corr, stream=stream, device=0)

    trace = {"traceEvents": [
        *step_and_phases(),
        x("c10d::_allgather_base_", 20, 10),
        x("cudaLaunchKernel", 22, 2, cat="cuda_runtime", correlation=1),
        x("cudaLaunchKernel", 40, 2, cat="cuda_runtime", correlation=2),
        x("c10d::_reduce_scatter_base_", 400, 10),
        x("cuLaunchKernelEx", 402, 2, cat="cuda_driver", correlation=3),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 100, 1, 20),
        kernel("void at::native::gemm(...)", 100, 200, 2, 7),
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...)", 500, 50, 3, 20),
    ]}
    [s] = collectives.analyze_trace(trace)
    assert s.all_gather.count_by_phase == {"forward": 1} and s.reduce_scatter.count_by_phase == {"backward": 1}
    assert s.all_gather.time_ms == pytest.approx(0.100) and s.all_gather.hidden_fraction == pytest.approx(0.5)
    assert s.reduce_scatter.time_ms == pytest.approx(0.050) and s.reduce_scatter.hidden_ms == 0


def memory_trace() -> dict:
    return {"traceEvents": [
        *step_and_phases(),
        x("c10d::_reduce_scatter_base_", 400, 20),
        mem(20, 0xA, 100), mem(200, 0xA, -100),    # forward only: freed
        mem(30, 0xB, 50),                          # allocated again below without a free
        mem(350, 0xB, 70), mem(900, 0xB, -70),
        mem(405, 0xC, 400),                        # inside the c10d op, never freed
        mem(500, 0xD, 8),                          # never freed, not a collective's: kept
    ]}


def test_untracked_blocks():
    assert memory_analysis.untracked_blocks(memory_trace()) == {(0xB, 30): 50, (0xC, 405): 400}


def _memory_trace(steps: list[tuple[float, float]], events: list[tuple[float, object, int]]) -> Trace:
    ranges = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": 1, "tid": 1, "ts": s,
               "dur": e - s} for i, (s, e) in enumerate(steps, start=2)]
    memory = [{"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
               "args": {"Total Allocated": total, "Bytes": size, "Device Type": 0}} for ts, total, size in events]
    return Trace({"traceEvents": ranges + memory, "profile_memory": 1})


def test_tensor_peaks():
    """Per profiled step the most held at once, the level it starts at included (the total before it, or
    the first event's total less its bytes), whatever thread an event is on; malformed or missing events
    are refused, not read as zero."""
    t = _memory_trace([(0, 10), (10, 20)], [(1, 100, 40), (2, 180, 80), (3, 50, -130), (12, 70, 20), (15, 40, -30)])
    assert memory_analysis.tensor_peaks(t) == [180, 70]
    t = _memory_trace([(0, 10), (10, 20)], [(1, 100, 40), (12, 30, -70)])
    assert memory_analysis.tensor_peaks(t) == [100, 100]  # step 3 starts where step 2 left it
    with pytest.raises(ValueError, match="no allocation event in ProfilerStep#3"):
        memory_analysis.tensor_peaks(_memory_trace([(0, 10), (10, 20)], [(1, 100, 40)]))
    with pytest.raises(ValueError, match="malformed"):
        memory_analysis.tensor_peaks(_memory_trace([(0, 10)], [(1, "100", 40)]))


def test_memory_stats():
    trace = memory_trace()
    m = memory_analysis.analyze_memory(profiling.snapshot_from_chrome_trace(trace), trace)
    # B's first block and C are left out; D (8 bytes) outlives the step.
    assert (m.peak_forward, m.peak_backward, m.peak_optimizer) == (100, 78, 78)
    assert m.peak == 100 and m.growth == [8] and m.untracked == [450]


def test_memory_stats_unix_time():
    """CUDA snapshots are stamped in unix time: trace ts + baseTimeNanoseconds / 1000."""
    trace = memory_trace()
    trace["baseTimeNanoseconds"] = 1_700_000_000 * 10**9
    trace["traceEvents"].append(x("void gemm(...)", 0, 1, tid=7, cat="kernel"))  # a CUDA trace
    snap = profiling.snapshot_from_chrome_trace(memory_trace())
    for e in snap["device_traces"][0]:
        e["time_us"] += 1_700_000_000 * 10**6
    m = memory_analysis.analyze_memory(snap, trace)
    # Nothing is left out on CUDA (the allocator records every free): B until reused, C, D.
    assert (m.peak_forward, m.peak_backward, m.growth, m.untracked) == (150, 478, [408], [0])


def test_cli(tmp_path, capsys):
    trace = gloo_trace()
    trace["traceEvents"] += [e for e in memory_trace()["traceEvents"] if e["name"] == "[memory]"]
    trace["profile_memory"] = 1  # as torch marks a trace with allocation events
    for name in ("a", "b"):
        (tmp_path / "traces" / name).mkdir(parents=True)
        (tmp_path / "snapshots" / name).mkdir(parents=True)
        (tmp_path / "traces" / name / "rank0.json").write_text(json.dumps(trace))
        with open(tmp_path / "snapshots" / name / "rank0.pickle", "wb") as f:
            pickle.dump(profiling.snapshot_from_chrome_trace(trace), f)
    analysis.cli([str(tmp_path / "traces" / "a"), str(tmp_path / "traces" / "b")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["a", "b"]
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])}
    assert rows["all-gathers, forward"] == ["1", "1"]
    assert rows["all-gather hidden"] == ["38%", "38%"]
    assert rows["reduce-scatters, backward"] == ["1", "1"]
    assert rows["growth per step (MiB)"] == ["+0.00", "+0.00"]


def test_cli_leaves_an_older_snapshot_out(tmp_path, capsys):
    """A trace profiled with --no-profile-memory beside an older run's snapshot: the table has no
    memory rows (not the old run's numbers); naming that snapshot explicitly is refused."""
    old = gloo_trace()
    old["traceEvents"] += [e for e in memory_trace()["traceEvents"] if e["name"] == "[memory]"]
    (tmp_path / "traces" / "a").mkdir(parents=True)
    (tmp_path / "snapshots" / "a").mkdir(parents=True)
    (tmp_path / "traces" / "a" / "rank0.json").write_text(json.dumps(gloo_trace()))
    with open(tmp_path / "snapshots" / "a" / "rank0.pickle", "wb") as f:
        pickle.dump(profiling.snapshot_from_chrome_trace(old), f)
    analysis.cli([str(tmp_path / "traces" / "a")])
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in capsys.readouterr().out.splitlines()[1:])}
    assert rows["all-gathers, forward"] == ["1"] and rows["peak memory (MiB)"] == ["-"]
    with pytest.raises(SystemExit) as e:
        analysis.cli([str(tmp_path / "traces" / "a"), "--snapshots", str(tmp_path / "snapshots" / "a")])
    assert e.value.code == 2
    assert "--no-profile-memory" in capsys.readouterr().err


def test_cli_reads_traces_outside_a_traces_folder(tmp_path, capsys):
    """train.py --traces-dir X --snapshots-dir Y with X outside any traces/ folder: no snapshot is
    guessed (the table has no memory rows); --snapshots Y reads them; a folder without the rank's
    snapshot is refused by name."""
    trace = gloo_trace()
    trace["traceEvents"] += [e for e in memory_trace()["traceEvents"] if e["name"] == "[memory]"]
    trace["profile_memory"] = 1
    (tmp_path / "tr").mkdir()
    (tmp_path / "sn").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "tr" / "rank0.json").write_text(json.dumps(trace))
    with open(tmp_path / "sn" / "rank0.pickle", "wb") as f:
        pickle.dump(profiling.snapshot_from_chrome_trace(trace), f)

    def rows(out: str) -> dict[str, list[str]]:
        return {c[0]: c[1:] for c in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:])}

    analysis.cli([str(tmp_path / "tr")])
    alone = rows(capsys.readouterr().out)
    assert alone["all-gathers, forward"] == ["1"] and alone["peak memory (MiB)"] == ["-"]
    analysis.cli([str(tmp_path / "tr"), "--snapshots", str(tmp_path / "sn")])
    assert rows(capsys.readouterr().out)["peak memory (MiB)"] != ["-"]
    with pytest.raises(SystemExit) as e:
        analysis.cli([str(tmp_path / "tr"), "--snapshots", str(tmp_path / "empty")])
    assert e.value.code == 2 and "no rank0.pickle in" in capsys.readouterr().err


def schedule_trace(wait_at_once: bool = False, blocking_issue: bool = False, reduce_done_at_once: bool = False,
                   polled_at_once: bool = False):
    """Forward: root, layers.0, layers.1, each all-gather prefetched by the group before (the
    root's, first of the pass, cannot be); backward: two reduce-scatters, each finished in the next
    group's hook after its compute (the last one's cannot be). Variants wait at once."""
    a = lambda name, ts, dur: x(name, ts, dur, cat="user_annotation")
    ag = lambda ts: x("c10d::_allgather_base_", ts, 2, **{"Input Dims": [[8], [4]]})
    rs = lambda ts: x("c10d::_reduce_scatter_base_", ts, 2, **{"Input Dims": [[4], [8]]})
    return {"traceEvents": [
        *step_and_phases(),
        a("FSDP::pre_forward", 20, 20), a("FSDP::all_gather", 21, 4), ag(22), a("FSDP::all_gather_copy_out", 26, 2),
        a("FSDP::all_gather (layers.0)", 30, 4), ag(31),
        x("aten::embedding", 50, 5),
        a("FSDP::pre_forward (layers.0)", 60, 20), a("FSDP::all_gather_copy_out (layers.0)", 61, 2),
        x("aten::copy_", 62, 1),  # inside an FSDP range: not compute
        a("FSDP::all_gather (layers.1)", 65, 5), ag(66),
        *([a("Work.wait (blocking)", 68, 1)] if blocking_issue else []),
        *([a("Work.is_completed (polled until true)", 75, 0)] if polled_at_once else []),  # after the issue's range
        *([a("FSDP::all_gather_copy_out (layers.1)", 72, 2)] if wait_at_once else []),
        x("aten::mm", 90, 5),
        *([] if wait_at_once else [a("FSDP::all_gather_copy_out (layers.1)", 101, 2)]),
        a("FSDP::post_backward (layers.1)", 400, 20), a("FSDP::post_backward_reduce (layers.1)", 405, 10), rs(406),
        *([a("FSDP::reduce_scatter_done (layers.1)", 416, 1)] if reduce_done_at_once else []),
        x("aten::mm", 430, 5),
        a("FSDP::post_backward (layers.0)", 440, 30),
        *([] if reduce_done_at_once else [a("FSDP::reduce_scatter_wait (layers.1)", 441, 4)]),
        a("FSDP::post_backward_reduce (layers.0)", 446, 4), rs(447),
        a("FSDP::reduce_scatter_wait (layers.0)", 452, 4),
    ]}


def tagged(trace: dict, asked: bool) -> dict:
    """schedule_trace with marked_waits' tags: each collective's own Work tagged after its issue and, when
    asked, where the FSDP's wait range asks for it; else no Work method ever asks (a program that learnt the
    result was there another way, polling the output's contents)."""
    a = lambda name, ts: x(name, ts, 0, cat="user_annotation")
    issued = [(24.5, 0), (33.5, 1), (68.5, 2), (408.5, 3), (449.5, 4)]
    waits = [(26.5, schedule.FOUND_DONE, 0), (101.5, schedule.WAITED, 2), (61.5, schedule.WAITED, 1),
             (441.5, schedule.WAITED, 3), (452.5, schedule.WAITED, 4)]
    return {"traceEvents": trace["traceEvents"] + [a(f"{schedule.ISSUED}{w}", ts) for ts, w in issued] +
            ([a(f"{what}{w}", ts) for ts, what, w in waits] if asked else [])}


def test_a_collective_never_asked_for_was_waited_for_at_once():
    """A Work that no Work method asked for while it ran (its issue tagged, no wait tagged before that address is
    issued again) was waited for where it was issued: the program learnt it was done another way, so an empty wait
    range after compute proves nothing."""
    for kind, phase, groups in (("all_gather", "forward", ["layers.0", "layers.1"]), ("reduce_scatter", "backward", ["layers.1"])):
        assert overlapped(tagged(schedule_trace(), asked=True), kind, phase) == groups
        assert overlapped(tagged(schedule_trace(), asked=False), kind, phase) == []


def test_a_reduce_scatter_said_done_but_waited_for_while_running_is_not_overlapped():
    """An empty `reduce_scatter_done` range (the FSDP's word that the work had finished) before a blocking wait of its
    own Work, with no compute between, is a wait at once; found done there, it stays overlapped."""
    a = lambda name, ts: x(name, ts, 0, cat="user_annotation")
    for tag, groups in ((schedule.WAITED, []), (schedule.FOUND_DONE, ["layers.1"])):
        trace = schedule_trace()  # layers.1's: issued at 406 in its post-backward (400-420), compute at 430
        trace["traceEvents"] += [a("FSDP::reduce_scatter_done (layers.1)", 422), a(f"{schedule.ISSUED}3", 408.5),
                                 a(f"{tag}3", 423)]
        assert overlapped(trace, "reduce_scatter", "backward") == groups, tag


def test_a_collective_is_released_where_its_own_work_was_waited_for():
    """A group's all-gather waited for (its Work's tag), then the next group's issued, then its copy-out range opened:
    one in flight at a time, as the Work's own tags say, however late the program opens its range (a wait range
    alone, with no tag of its own Work, still releases it only where it opens)."""
    trace = tagged(schedule_trace(), asked=True)
    for e in trace["traceEvents"]:  # layers.0's copy-out range and its copy after layers.1's issue (66), its wait before
        if e["name"] == "FSDP::all_gather_copy_out (layers.0)" or e["name"] == "aten::copy_" and e["ts"] == 62:
            e["ts"] += 8
    gathers = [s for s in schedule.schedule(trace) if (s.kind, s.phase) == ("all_gather", "forward")]
    assert [s.released for s in gathers] == [26.5, 61.5, 101.5], gathers
    assert schedule.most_in_flight(gathers)[0] == 1


def overlapped(trace: dict, kind: str, phase: str) -> list[str]:
    return [s.group for s in schedule.must_overlap([s for s in schedule.schedule(trace) if (s.kind, s.phase) == (kind, phase)])
            if s.overlapped]


def test_only_another_groups_compute_overlaps():
    """With the model's compute marked, a collective is overlapped only by compute of a group other than its own: its
    own group's (a view node of its backward, a leaf whose weight came another way) runs without its data."""
    mark = "## model compute 1 ##"
    for leaf, groups in (("layers.0.attention.wq", ["layers.0", "layers.1"]), ("layers.1.attention.wq", ["layers.0"])):
        trace = schedule_trace()
        trace["traceEvents"] += [x(schedule.marked_name(mark, "tok_embeddings"), 49, 7, cat="user_annotation"),
                                 x(schedule.marked_name(mark, leaf), 89, 7, cat="user_annotation")]
        got = [s.group for s in schedule.must_overlap([s for s in schedule.schedule(trace, mark)
                                                       if (s.kind, s.phase) == ("all_gather", "forward")]) if s.overlapped]
        assert got == groups, (leaf, got)


def test_most_in_flight():
    """Per pass, the most issued and not yet released at once (never waited: still in flight), and which."""
    def ag(group, issued, released, pass_start=0.0, rank=0):
        return schedule.Scheduled(rank, 1, "forward", pass_start, "all_gather", group, issued, released, True, True,
                                  released)

    one_ahead = [ag("root", 0, 1), ag("a", 2, 3), ag("b", 3.5, 5), ag("c", 5.5, 7)]
    assert schedule.most_in_flight(one_ahead)[0] == 1
    own_and_next = [ag("a", 0, 3), ag("b", 1, 5), ag("c", 4, 7)]
    assert schedule.most_in_flight(own_and_next)[0] == 2
    at_once = [ag("a", 0, 3), ag("b", 1, 5), ag("c", 2, None), ag("d", 10, 11, pass_start=9)]
    count, flying = schedule.most_in_flight(at_once)
    assert count == 3 and [s.group for s in flying] == ["a", "b", "c"]
    # a copy-out range opened early (waited) does not end it: its own Work's wait does (released)
    early = [ag("a", 0, 3), dataclasses.replace(ag("b", 1, 5), waited=1.5)]
    assert schedule.most_in_flight(early)[0] == 2


def test_most_ahead():
    """Per pass, the i-th all-gather is i - k groups ahead, k being how many of the groups that gather had begun
    computing by the first compute after it (Scheduled.started); a group that gathers nothing (the root in backward)
    does not count, and an all-gather after which nothing computed is not judged."""
    def ag(group, issued, started, pass_start=0.0):
        return schedule.Scheduled(0, 1, "forward", pass_start, "all_gather", group, issued, issued + 1, True, True,
                                  issued + 1, started)

    gathered = {"root", "a", "b", "c"}
    one_ahead = [ag("root", 0, ("root",)), ag("a", 1, ("root",)), ag("b", 2, ("root", "a")),
                 ag("c", 3, ("root", "a", "b"))]
    assert schedule.most_ahead(one_ahead, gathered)[0] == 1
    mid_block = [ag("root", 0, ("root",)), ag("a", 1, ("root",)), ag("b", 1.5, ("root",)),
                 ag("c", 3, ("root", "a")), ag("d", 10, None, pass_start=9)]
    most, where = schedule.most_ahead(mid_block, gathered)
    assert most == 2 and where.group == "b"
    backward = [ag("c", 0, ("root",)), ag("b", 1, ("root", "c")), ag("a", 2, ("root", "c", "b"))]
    assert schedule.most_ahead(backward, {"a", "b", "c"})[0] == 1
    assert schedule.most_ahead(backward, gathered)[0] == 0


def test_schedule():
    """Overlap by order: compute between issue and wait, the pass's first all-gather and last
    reduce-scatter exempt; waiting in the issuing hook or inside the issue range is no overlap."""
    assert overlapped(schedule_trace(), "all_gather", "forward") == ["layers.0", "layers.1"]
    assert overlapped(schedule_trace(), "reduce_scatter", "backward") == ["layers.1"]
    assert overlapped(schedule_trace(wait_at_once=True), "all_gather", "forward") == ["layers.0"]
    assert overlapped(schedule_trace(blocking_issue=True), "all_gather", "forward") == ["layers.0"]
    assert overlapped(schedule_trace(polled_at_once=True), "all_gather", "forward") == ["layers.0"]
    assert overlapped(schedule_trace(reduce_done_at_once=True), "reduce_scatter", "backward") == []


def test_schedule_reads_the_hsdp_names():
    """On a 2-D mesh the reference names each collective's process group (`FSDP::all_gather (layers.0) [shard]`,
    the replica all-reduce `[replicate]`): the same groups and verdicts as the 1-D names, which FSDP2 keeps."""
    collective = ("FSDP::all_gather", "FSDP::post_backward_reduce", "FSDP::reduce_scatter_")
    for variant in ({}, {"wait_at_once": True}, {"reduce_done_at_once": True}):
        plain = schedule_trace(**variant)
        named = {"traceEvents": [dict(e, name=e["name"] + " [shard]") if e["name"].startswith(collective) else e
                                 for e in plain["traceEvents"]]}
        assert any(e["name"].endswith("[shard]") for e in named["traceEvents"])
        assert [(s.group, s.kind, s.waited, s.overlapped) for s in schedule.schedule(named)] == \
            [(s.group, s.kind, s.waited, s.overlapped) for s in schedule.schedule(plain)]
    assert GROUP_RANGE.match("FSDP::all_gather (layers.0) [shard]")["fqn"] == "layers.0"


def gates() -> dict[str, list]:
    """What each gated place holds (the gates once put there)."""
    schedule.gate_collectives()
    return {route: [getattr(owner, name) for owner in owners] for route, owners, name in schedule._gated_places()}


def test_marked_waits_routes_the_gates_only_inside():
    """The ranks run other jobs after a profiled one: Work's ways to wait, the issues and the barrier are marked
    only inside the `with`, through gates that never move and are named as the plain methods (a program cannot
    tell from an object or a name that it runs under the marks)."""
    held = gates()
    plain = {route: schedule.current(route) for route in held}
    with pytest.raises(RuntimeError, match="training failed"), schedule.marked_waits():
        # every gate but the collective log's (below): the storage's resize, and a tensor's printing and values
        assert [route for route in held if schedule.current(route) is plain[route]] == [
            "UntypedStorage.resize_", "_tensor_str._str", "Tensor.tolist", "Tensor.numpy"]
        assert gates() == held
        raise RuntimeError("training failed")
    assert {route: schedule.current(route) for route in held} == plain and gates() == held
    for route, places in held.items():
        assert all(p.__qualname__ == plain[route].__qualname__
                   and getattr(p, "__module__", None) == getattr(plain[route], "__module__", None) for p in places), route


def test_collective_log_routes_the_gates_only_inside():
    """The collective log watches the ways to wait, through the marks' gates, and puts their routes back however
    it ends."""
    from harness.tools.grading.jobs import CommLog

    held = gates()
    plain = {name: schedule.current(f"Work.{name}") for name in schedule.WORK_WAITS}
    with pytest.raises(RuntimeError, match="training failed"), CommLog():
        # every way to wait, not is_completed(), which lets nothing be read ([Note: a collective's result read ...])
        assert [name for name in plain if schedule.current(f"Work.{name}") is plain[name]] == ["is_completed"]
        assert gates() == held
        raise RuntimeError("training failed")
    assert {name: schedule.current(f"Work.{name}") for name in plain} == plain and gates() == held
    reads = {route: schedule.current(route) for route in ("_tensor_str._str", "Tensor.tolist", "Tensor.numpy")}
    with CommLog():  # a tensor's printing and values, whose reads past the dispatcher the log names
        assert [route for route, plain_read in reads.items() if schedule.current(route) is plain_read] == []
    assert {route: schedule.current(route) for route in reads} == reads
    resize = schedule.current("UntypedStorage.resize_")
    with CommLog():  # the storage's resize only where the data is followed (a mark)
        assert schedule.current("UntypedStorage.resize_") is resize
    with pytest.raises(RuntimeError, match="training failed"), CommLog("## model compute 5 ##"):
        assert schedule.current("UntypedStorage.resize_") is not resize
        raise RuntimeError("training failed")
    assert schedule.current("UntypedStorage.resize_") is resize and gates() == held


def test_the_marks_fail_on_a_foreign_receiver_as_the_plain_methods_do():
    """Called on something that is not a Work, a way to wait fails with the plain method's own message under the
    marks too (the marks' wait asked is_completed() first, whose name in the error told a program it was marked)."""
    import torch.distributed as dist

    gates()

    def errors() -> list[str]:
        out = []
        for name in schedule.WORK_WAITS:
            try:
                getattr(dist.Work, name)(0)
            except TypeError as e:
                out.append(str(e))
        return out

    plain = errors()
    assert len(plain) == len(schedule.WORK_WAITS) and all(n in e for n, e in zip(schedule.WORK_WAITS, plain))
    with schedule.marked_waits():
        assert errors() == plain


def test_a_method_kept_from_before_goes_through_the_instruments():
    """A file that keeps Work.wait from its import (before any instrument was on) still waits through the
    instrument on at the time of the call ([Note: gates put in place before the file])."""
    import torch.distributed as dist

    gates()
    kept = dist.Work.wait
    seen = []
    with schedule.routed({"Work.wait": lambda work: seen.append(work)}):
        kept("the work")
    assert seen == ["the work"]


def on_one_gloo_rank(script: str):
    """`script` run by a Python of its own (a process group of one gloo rank, at $PORT), which must exit 0."""
    import subprocess
    import sys

    from harness.distributed import free_port

    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PORT": str(free_port())})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


MOVED_OUTPUT = """
import os, torch, torch.distributed as dist
from harness.tools.grading.jobs import CommLog
from harness.tools.traces import schedule
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
x, out = torch.ones(1 << 16), torch.zeros(1 << 16)
log = CommLog()
done = schedule.current("Work.is_completed")  # the plain method, which the log does not see
with log:
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    while not done(work):  # finished before its output moves: gloo would write where it no longer is
        pass
    before = out.data_ptr()
    out.untyped_storage().resize_(out.untyped_storage().nbytes())  # the same size, elsewhere
    assert out.data_ptr() != before, "the storage did not move"
    out[-1].item()
    work.wait()
print(log.problems)
"""


BLIND_READS = """
import logging, os, time, torch, torch.distributed as dist
from harness.tools.grading.jobs import CommLog
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
calls = {
    "repr": lambda x: repr(x), "format": lambda x: f"{x}", "logging": lambda x: logging.getLogger("q").warning("%s", x),
    "tolist in torch's Python": lambda x: torch.tensordot(torch.zeros(1), torch.zeros(1), dims=x[:2].view(2, 1)),
    "a packed sequence": lambda x: torch.rnn_tanh(torch.zeros(1, 1), x[:1], torch.zeros(1, 1, 1),
                                                  [torch.zeros(1, 1)] * 2, False, 1, 0.0, False, False),
    "tensor of its elements": lambda x: torch.tensor([x[0], x[1]]),
    "views": lambda x: (x.view(2, -1), x[1:], torch.split(x, 2), x.narrow(0, 0, 1), x.detach(), x.reshape(-1)),
    "what describes it": lambda x: (x.size(), x.shape, x.numel(), x.data_ptr(), x.is_contiguous(), x.dtype, len(x)),
}
for name, call in calls.items():
    log = CommLog()
    with log:
        out = torch.zeros(4, dtype=torch.int64)
        work = dist.all_gather_into_tensor(out, torch.full((4,), 3), async_op=True)
        time.sleep(0.02)
        try:
            call(out)
        except (RuntimeError, IndexError, TypeError):
            pass
        work.wait()
    print(name, "->", "READ" if any("reads the output of an asynchronous" in p for p in log.problems) else "none")
log = CommLog()
with log:
    torch.tensor([torch.ones(()), torch.zeros(())])
print("made from tensors ->", log.problems)
import collections
for kind in (collections.deque, collections.UserList):  # any sequence torch reads, a list's subclass too
    log = CommLog()
    with log:
        torch.tensor(kind(torch.ones(2).unbind()))
    print(f"made from a {kind.__name__} ->", log.problems)
log = CommLog()
with log:  # Python's numbers: what torch.tensor is for
    torch.tensor([[1, 2.5], (True, 3)]), torch.tensor(range(3)), torch.as_tensor(torch.ones(2)), torch.tensor(2)
print("made from numbers ->", log.problems)
import gc
seen = []


class Size:  # code torch runs inside a call (not a file's: no refusal), as a collection's finalizer would be run
    def __index__(self):
        seen.append(gc.isenabled())
        return 2


with CommLog():
    torch.zeros(Size())
print("collecting inside a call ->", seen[-1], gc.isenabled())  # the last: torch's, inside the mode's handler
"""


def test_collective_log_sees_reads_past_the_dispatcher():
    """A pending all-gather's output read by code that runs past the dispatcher (printed with every mode off, turned
    into numbers in torch's own Python or in C++, copied by torch.tensor) is named as a read; its views and what
    describes it are not ([Note: reads the dispatcher does not show]). A tensor made from tensors is refused."""
    said = dict(line.split(" -> ", 1) for line in on_one_gloo_rank(BLIND_READS).stdout.splitlines() if " -> " in line)
    for name in ("repr", "format", "logging", "tolist in torch's Python", "a packed sequence", "tensor of its elements"):
        assert said.get(name) == "READ", said
    assert said["views"] == said["what describes it"] == "none", said
    assert "torch.tensor makes a tensor from tensors" in said["made from tensors"], said
    assert "torch.tensor makes a tensor from a deque" in said["made from a deque"], said
    assert "torch.tensor makes a tensor from a UserList" in said["made from a UserList"], said
    assert said["made from numbers"] == "[]", said
    assert said["collecting inside a call"] == "False True", said  # off inside, on again after


FILE_READ_BY_TORCH = '''
import os, sys, time, torch, torch.distributed as dist
from pathlib import Path
from harness import impl
from harness.tools.grading.jobs import CommLog
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
path = Path(sys.argv[1])
path.write_text(
    "import typing\\nimport torch\\n\\n\\nclass MixedPrecisionPolicy:\\n    pass\\n\\n\\ndef fully_shard(m):\\n"
    "    return m\\n\\n\\nSEEN = []\\nOUT = []\\n\\n\\nclass Size(typing.NamedTuple):\\n    n: int\\n\\n"
    "    def __iter__(self):\\n        SEEN.append(repr(OUT[0]))\\n        return iter([self.n])\\n\\n\\n"
    "def poll(out):\\n    OUT.append(out)\\n    return torch.zeros(Size(2))\\n")
module = impl.load(str(path))
log = CommLog()
with log:
    out = torch.zeros(4, dtype=torch.int64)
    work = dist.all_gather_into_tensor(out, torch.full((4,), 3), async_op=True)
    module.poll(out)
    work.wait()
print("read ->", module.SEEN, log.problems)
'''


def test_collective_log_runs_no_code_of_the_file_in_its_own_walk(tmp_path):
    """A file's NamedTuple whose `__iter__` reads a pending output (run by the log's walk of a call's arguments, or
    by torch's, where the function mode is off) is never called by the log, and torch handed it is named."""
    proc = on_one_gloo_rank(FILE_READ_BY_TORCH.replace("sys.argv[1]", repr(str(tmp_path / "read_by_torch.py"))))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("read -> "))
    assert line.startswith("read -> [] ") and "torch's zeros is handed a Size, which torch reads by the file's own" \
        in line, line


FREED_BY_ANOTHER_THREAD = '''
import os, sys, threading, torch, torch.distributed as dist
from pathlib import Path
from harness import impl
from harness.tools.grading.jobs import CommLog
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
path = Path(sys.argv[1])
path.write_text("import torch\\n\\n\\nclass MixedPrecisionPolicy:\\n    pass\\n\\n\\ndef fully_shard(m):\\n"
                "    return m\\n\\n\\ndef step():\\n    return 1\\n")
module = impl.load(str(path))


class Reads:  # a finalizer of Python's own, set up by a program (not the file's code: nothing names it)
    def __init__(self, out, seen):
        self.out, self.seen = out, seen

    def __del__(self):
        self.seen.append("the loop's" if threading.current_thread() is threading.main_thread() else "another")
        self.out.sum()


def hung(x, out, seen, where):
    """The tensor to hand a broadcast, with the reader hung on it, on its storage, or on the base of the view handed."""
    (x.untyped_storage() if where == "storage" else x).reader = Reads(out, seen)
    return x[1:] if where == "base" else x


for where in ("tensor", "storage", "base"):
    log, seen = CommLog(), []
    with log:
        out = torch.zeros(4)
        work = dist.all_gather_into_tensor(out, torch.full((4,), 3.0), async_op=True)  # pending until waited for
        box = [dist.broadcast(hung(torch.ones(4), out, seen, where), 0, async_op=True)]
        box[0].wait()
        # its work's last holder is another thread, as gloo's worker is where a program drops the handle first
        other = threading.Thread(target=box.clear)
        other.start()
        other.join()
        module.step()  # the file's code starts
        work.wait()
    print(where, "->", seen, any("reads the output of an asynchronous all-gather" in p for p in log.problems))
'''


def test_what_a_collectives_work_held_is_freed_where_the_log_sees(tmp_path):
    """A tensor handed to a collective, whose work another thread frees (gloo's worker does, where a program dropped
    the handle first), is not freed there with what hangs on it (an attribute, its storage's, its view's base's):
    the log holds it until only its Python object does and lets go on the training loop's thread, with its modes
    on, where the file's code next starts ([Note: what a collective's work holds]). A finalizer reading a pending
    output there is named; freed on the other thread, it would be unseen."""
    proc = on_one_gloo_rank(FREED_BY_ANOTHER_THREAD.replace("sys.argv[1]", repr(str(tmp_path / "steps.py"))))
    said = dict(line.split(" -> ", 1) for line in proc.stdout.splitlines() if " -> " in line)
    assert said == dict.fromkeys(("tensor", "storage", "base"), "[\"the loop's\"] True"), proc.stdout


FREED_BEFORE_THE_OPTIMIZER_STEP = """
import os, time, weakref, torch, torch.distributed as dist
from harness.tools.grading.jobs import CommLog
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
p = torch.nn.Parameter(torch.ones(2))
p.grad = torch.ones(2)
optimizer = torch.optim.SGD([p], lr=0.1)
log = CommLog()
with log:
    x = torch.ones(1 << 16)
    gone = weakref.ref(x)
    dist.all_reduce(x, async_op=True).wait()
    del x  # the program's last reference: only the log holds it, and gloo's worker until it lets the work go
    while any(t._use_count() > 1 for t in log.held.values()):
        time.sleep(0.01)
    seen = []
    handle = optimizer.register_step_pre_hook(lambda *args: seen.append(gone() is None))
    optimizer.step()
    handle.remove()
print("freed before the step ->", seen)
"""


def test_what_only_the_log_held_is_freed_before_the_optimizer_step():
    """The training loop's optimizer step allocates (its state, in step 1) after the file's last code of a step: a
    collective's tensor that only the log still held is freed before it, as it would have been without the log, so
    the log adds nothing to the peak memory it judges ([Note: what a collective's work holds])."""
    said = dict(line.split(" -> ", 1) for line in on_one_gloo_rank(FREED_BEFORE_THE_OPTIMIZER_STEP).stdout.splitlines()
                if " -> " in line)
    assert said == {"freed before the step": "[True]"}, said


def test_collective_log_follows_an_output_that_moved():
    """A collective's output whose storage was resized in place (its bytes moved, which no op shows) is still its
    output: reading it before the wait is named there ([Note: a collective's result read before its wait])."""
    proc = on_one_gloo_rank(MOVED_OUTPUT)
    assert "reads the output of an asynchronous all-gather before its work handle" in proc.stdout, proc.stdout


FOUND_DONE_AT_ONCE = """
import os, torch, torch.distributed as dist
from harness.tools.traces import schedule
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
x, out = torch.ones(8), torch.zeros(8)
unseen = schedule.current("Work.wait")  # the plain method: a wait the marks do not see (a guess, in a file)
with torch.profiler.profile() as prof, schedule.marked_waits():
    for ask in ("synchronize", "get_future", "result", "wait"):
        work = dist.all_gather_into_tensor(out, x, async_op=True)
        unseen(work)
        getattr(work, ask)()
print(sum(e.name.startswith(schedule.FOUND_DONE) for e in prof.events()))
"""


def test_a_work_found_done_at_once_is_tagged_where_it_was_asked():
    """A program that learnt by other means (a guess: spinning in Python) that a collective is done, then waits for
    its Work, may read the result from there: each way of waiting is tagged there when it finds the work done,
    which the schedule takes as the all-gather's wait, not only wait() (a later wait() would otherwise look
    overlapped)."""
    proc = on_one_gloo_rank(FOUND_DONE_AT_ONCE)
    assert proc.stdout.split()[-1] == "4", proc.stdout


COMPLETED_THEN_READ = """
import os, torch, torch.distributed as dist
from harness.tools.grading.jobs import CommLog
from harness.tools.traces import schedule
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["PORT"])
x, out = torch.ones(8), torch.zeros(8)
unseen = schedule.current("Work.wait")  # the plain method: done by then, as after a guessed while
log = CommLog()
with log:
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    unseen(work)
    assert work.is_completed()
    out.sum().item()
    work.wait()
print(log.problems)
"""


def test_is_completed_is_no_wait_for_the_collective_log():
    """is_completed() saying True lets no result be read: a program that spun for a guessed while, asked it and
    read the all-gather's output (then computed its own group, and waited later, where it looked overlapped) is
    named ([Note: a collective's result read before its wait])."""
    proc = on_one_gloo_rank(COMPLETED_THEN_READ)
    assert "reads the output of an asynchronous all-gather before its work handle" in proc.stdout, proc.stdout


def test_an_op_run_through_a_dispatch_mode_counts_once():
    """Under a dispatch mode (the collective log, on in graded profiled runs) the profiler records an op, the
    mode's range, then the op again: the trace keeps the outer op and what it ran inside, so a collective is one
    issue, not two (see [Note: an op run through a dispatch mode])."""
    def x(name, ts, dur, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "cat": cat}

    events = [x("ProfilerStep#1", 0, 100, "user_annotation"), x("c10d::allgather_", 10, 40),
              x("PythonDispatchMode", 11, 38), x("c10d::allgather_", 12, 36), x("aten::empty", 13, 1),
              x("aten::mul", 60, 20), x("PythonDispatchMode", 61, 18), x("aten::mul", 62, 16),
              x("aten::mul", 63, 1)]  # an op that runs itself inside (FSDP2's and torch's do): kept
    t = Trace({"traceEvents": events})
    assert [e["name"] for e in t.ops] == ["c10d::allgather_"] and t.c10d_calls == {"c10d::allgather_": 1}
    assert sorted((e["name"], e["ts"]) for e in t.ranges) == [
        ("ProfilerStep#1", 0), ("aten::empty", 13), ("aten::mul", 60), ("aten::mul", 63), ("c10d::allgather_", 10)]
    # A program's record_function ranges so named (user annotations) are neither an op nor a mode: they hide no op.
    forged = [x("ProfilerStep#1", 0, 100, "user_annotation"), x("c10d::allgather_", 10, 40, "user_annotation"),
              x("PythonDispatchMode", 11, 38, "user_annotation"), x("c10d::allgather_", 12, 36)]
    t = Trace({"traceEvents": forged})
    assert [(e["name"], e["ts"]) for e in t.ops] == [("c10d::allgather_", 12)] and t.c10d_calls == {"c10d::allgather_": 1}


def test_marked_compute_counts_only_the_models(tmp_path):
    """With a mark, compute is the model's: its own leaf modules' forwards (inside the secret-named range, which names
    the leaf's FSDP group) and the backward nodes of their ops (linked by the profiler's sequence number); a token op,
    one in a range named like a backward node, one in a range under another name, a leaf the program made, one whose
    parameters sit behind its code, or the node of a graph the program built itself (or of an op outside the leaves)
    is not. The leaf classes' forwards are put back however the run ends."""
    import torch
    import torch.nn as nn

    class Sub(nn.Linear):  # a subclass may add code around the forward: never marked
        pass

    class Table(dict):  # a leaf's parameters behind code of the program's: its forward would run that code
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Sub(8, 8), nn.Linear(8, 8))
    model[3]._parameters = Table(model[3]._parameters)
    model[1].register_forward_hook(lambda *_: None)  # hooks on a leaf: Module.__call__ runs it one frame deeper
    private = nn.Linear(8, 8)  # a leaf the program made for itself, not the model's
    plain = nn.Linear.forward
    mark = "## model compute 1234 ##"

    def token(name):
        with torch.profiler.record_function(name):
            torch.zeros(1).add_(1)

    with torch.profiler.profile() as prof:
        with pytest.raises(RuntimeError, match="stopped"), schedule.marked_compute(model, mark):
            assert nn.Linear.forward is not plain
            model(torch.randn(4, 8)).sum().backward()
            torch.zeros(1).add_(1)
            private(torch.randn(4, 8))
            model[0](torch.randn(4, 8))  # the model's leaf, called by something else than its parent's forward
            token("MmBackward0")
            token("## model compute 9999 ##")
            own = torch.ones(4, requires_grad=True)
            (own * 3).sum().backward()  # MulBackward0: a backward node, not the model's
            raise RuntimeError("stopped")
    assert nn.Linear.forward is plain
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    on = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    by_ts = {e["ts"]: e["name"] for e in on if e.get("cat") == "cpu_op"}
    computed = schedule.compute_ops(on, [], [], mark)
    counted = [by_ts[t] for t, _ in computed]
    assert {group for _, group in computed} == {ROOT_GROUP}  # nn.Sequential's leaves are all the root's
    # compute: model[0]'s and the ReLU's; Sub's and Table's counted, not compute; private's neither
    assert [e["name"] for e in on if e["name"].startswith(mark)] == [
        schedule.marked_name(mark, "0"), schedule.marked_name(mark, "1"), schedule.marked_name(mark, "2", False),
        schedule.marked_name(mark, "3", False), schedule.marked_name(mark, "0" + schedule.FROM_OUTSIDE, False)]
    assert schedule.model_order(on, mark) == ["0", "1", "2", "3", "0" + schedule.FROM_OUTSIDE]
    assert schedule.model_calls(on, mark)[0] == 5
    assert "aten::addmm" in counted and "aten::mm" in counted  # forward in the leaf, backward in AddmmBackward0
    assert "aten::threshold_backward" in counted  # ReluBackward0, linked to the ReLU's forward
    assert "aten::add_" not in counted and "aten::zeros" not in counted, counted
    assert "aten::mul" not in counted  # MulBackward0's: a node, but of the program's own graph
    assert any(e["name"] == "MulBackward0" for e in on) and any(e["name"] == "SumBackward0" for e in on)
    unmarked = [by_ts[t] for t, _ in schedule.compute_ops(on, [], [], None)]
    assert "aten::add_" in unmarked  # what a student's own trace counts


def test_sources_follow_the_all_gathers_data_into_the_parameters(tmp_path):
    """A graded profiled run's collective log follows each all-gather's data (jobs.Sources, see jobs.py's [Note: where
    the model's parameters came from]): its number goes with its bytes through a copy-out (copy_, an out= op, a
    view's), through arithmetic, and adds up where data of two meet; a read of a leaf's parameters names the numbers
    its bytes hold, and NONE_GATHERED where some hold none (zero_, a tensor made from a list). A write through a
    strided view numbers only the bytes it writes, a tensor of another class without a dispatch of its own is followed
    as any, and bytes a resize moves take their numbers with them and leave none where they were. Constants (zeros)
    beside gathered data are that data; a write through an index that sets every element is a copy-out, one that sets
    some keeps what the rest held."""
    import torch
    import torch.nn as nn

    from harness.tools.grading.jobs import CONSTANT, CommLog

    mark = "## model compute 77 ##"
    log = CommLog(mark)
    leaf = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    none = schedule.NONE_GATHERED
    with torch.profiler.profile() as prof, log:
        first, second = torch.arange(32.0), torch.arange(32.0) * 2
        log.sources.landed(*log.sources.gathered([first]))  # number 1 (gloo writes it where no op shows)
        log.sources.landed(*log.sources.gathered([second]))  # number 2
        weight = torch.empty(4, 4)
        leaf._parameters["weight"] = nn.Parameter(weight)
        log.sources.called(leaf)
        weight.copy_(first[:16].view(4, 4))
        leaf(x)  # 1
        a, b = torch.empty(8), torch.empty(8)
        torch.split_with_sizes_copy(second.view(2, 16)[:, :8], [4, 4], dim=1, out=[a.view(2, 4), b.view(2, 4)])
        weight.view(-1)[:8].copy_(a)
        leaf(x)  # 1 (the second half) and 2
        weight.zero_()
        leaf(x)  # none
        weight.copy_(torch.tensor(first[:16].tolist()).view(4, 4))
        leaf(x)  # none: a list holds no gathered bytes
        weight.copy_(first[:16].view(4, 4) * 1)
        weight.add_(second[16:].view(4, 4))
        leaf(x)  # 1 and 2
        weight.copy_(first[:16].view(4, 4))
        weight.view(-1)[::15].copy_(second[:2])  # two elements, the first and the last: the rest holds 1 still
        strided = log.sources.held(weight)
        weight.copy_(torch.empty(4, 4) + first[:16].view(4, 4))  # fresh memory holds what was there: none gathered
        mixed = log.sources.held(weight)
        weight.copy_(torch.zeros(4, 4) * first[:1])  # constants beside one gathered number: that number's data
        zeros = log.sources.held(weight)
        spaced = log.sources.held(torch.linspace(first[1], first[2], 16))  # a factory that reads tensors reads them
        flat = torch.empty(16)
        flat.index_copy_(0, torch.arange(16), second[:16])  # every element written through an index: a copy-out
        indexed = log.sources.held(flat)
        flat = torch.empty(16)
        flat[torch.arange(8)] = second[:8]  # half of them: the rest holds what fresh memory held
        partly = log.sources.held(flat)
        others = [log.sources.held(write(torch.empty(16))) for write in (  # put_, masked_scatter_, scatter_: as well
            lambda t: t.put_(torch.arange(16), second[:16]),
            lambda t: t.masked_scatter_(torch.ones(16, dtype=torch.bool), second[:16]),
            lambda t: t.scatter_(0, torch.arange(16), second[:16]),
            lambda t: t.scatter_(0, torch.zeros(16, dtype=torch.long), second[:16]))]  # one element written
        other = nn.parameter.UninitializedBuffer()
        other.data = weight
        other.copy_(second[:16].view(4, 4))  # through a tensor of another class
        through = log.sources.held(weight)
        moved = first.clone()
        storage, left = moved.untyped_storage(), moved.data_ptr()
        storage.resize_(storage.nbytes() * 64)  # its bytes copied into new memory where no op shows it
        resized = log.sources.held(moved[:32])
        behind = [span for span in log.sources.spans if span[3] == log.sources._token(storage) and left <= span[0] < left + 128]
        stats = first[:16].clone()
        torch.nn.functional.batch_norm(torch.randn(2, 16), stats, torch.ones(16), training=True, momentum=1.0)
        normed = log.sources.held(stats)  # running statistics a batch norm wrote (its schema does not say so)
        lifted = first[:8].clone()
        torch.ops.aten.lift_fresh(lifted)  # what torch.tensor(values) runs on its new memory: values from Python numbers
        fresh = log.sources.held(lifted)
        grown = second.clone()
        grown.resize_(1 << 16)  # a tensor's resize_, growing its storage
        grew = log.sources.held(grown[:32])
    assert moved.data_ptr() != left and grown.data_ptr() != second.data_ptr()
    assert (strided, mixed, zeros, spaced, indexed, partly, through, resized, behind, grew, fresh, normed) == \
        ({1, 2}, {none, 1}, {1}, {1}, {2}, {none, 2}, {2}, {1}, [], {2}, {CONSTANT}, {none, 1}), \
        (strided, mixed, zeros, spaced, indexed, partly, through, resized, behind, grew, fresh, normed)
    assert others == [{2}, {2}, {2}, {none, 2}], others
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    names = [e["name"] for e in sorted(json.loads((tmp_path / "t.json").read_text())["traceEvents"],
                                       key=lambda e: e.get("ts", 0)) if e.get("ph") == "X"]
    tag = lambda *numbers: schedule.read_tag(mark, numbers)  # noqa: E731
    # add_ reads the parameter too (outside the model's compute: the analysis keeps only what compute read)
    assert [n for n in names if n.startswith(mark + schedule.READ_TAG)] == [
        tag(1), tag(1, 2), tag(none), tag(none), tag(1), tag(1, 2)]
    assert [n for n in names if n.startswith(mark + schedule.GATHER_TAG)] == [
        schedule.gather_tag(mark, 1), schedule.gather_tag(mark, 2)]


def test_a_storage_made_again_on_the_same_memory_holds_nothing_gathered():
    """What a storage's bytes held dies with it: a storage made where no op the log sees made it (torch.frombuffer
    here; torch.UntypedStorage(n) as well), on the same memory and at the same StorageImpl address as one that died,
    holds no all-gather's data."""
    import torch

    from harness.tools.grading.jobs import CommLog

    log = CommLog("## model compute 5 ##")
    memory = bytearray(4096)  # outlives the storages made on it
    gathered, kept = torch.arange(1024.0), torch.frombuffer(memory, dtype=torch.float32)
    with log:
        log.sources.landed(*log.sources.gathered([gathered]))
        kept.copy_(gathered)
    key, at, first = kept.untyped_storage()._cdata, kept.data_ptr(), log.sources.held(kept)
    del kept
    seen = []
    for _ in range(100):  # until a new StorageImpl takes the dead one's address (at once, on most allocators)
        again = torch.frombuffer(memory, dtype=torch.float32)
        assert again.data_ptr() == at
        seen.append((again.untyped_storage()._cdata == key, log.sources.held(again)))
        if seen[-1][0]:
            break
        del again
    assert first == {1} and all(held == {schedule.NONE_GATHERED} for _, held in seen), (first, seen)


def test_bytes_an_op_moves_take_their_numbers_with_them():
    """An op that moves a storage inside it (set_ to a size beyond its source's storage, an out= too small) moves the
    numbers with the bytes and leaves none behind; a storage that lands on memory it held once finds nothing of that
    there; and what a random generator draws holds no all-gather's data, whatever the tensor it fills held."""
    import torch

    from harness.tools.grading.jobs import CommLog

    log = CommLog("## model compute 9 ##")
    none = schedule.NONE_GATHERED
    with log:
        first = torch.arange(64.0)
        log.sources.landed(*log.sources.gathered([first]))  # number 1
        grown = first[:16].clone()
        key, left = log.sources._token(grown.untyped_storage()), grown.data_ptr()
        wide = torch.empty(0).set_(grown, 0, (1 << 14,), (1,))  # grows grown's storage: its bytes move
        behind_set = [span for span in log.sources.spans if span[3] == key and left <= span[0] < left + 64]
        moved_by_set = log.sources.held(wide[:16])
        out = first[:8].clone()
        key, left = log.sources._token(out.untyped_storage()), out.data_ptr()
        torch.add(torch.zeros(1 << 14), 1, out=out)  # resized inside the op: no op shows its bytes moving
        behind_out = [span for span in log.sources.spans if span[3] == key and left <= span[0] < left + 32]
        drawn = log.sources.held(torch.zeros(16).random_())
        redrawn = log.sources.held(first[:16].clone().random_())

    class Storage:  # one whose run moves its bytes back to memory it held once
        _cdata, at, size = 1, 1 << 20, 64

        def data_ptr(self):
            return self.at

        def nbytes(self):
            return self.size

    sources, storage = log.sources, Storage()
    key = sources._token(storage)
    sources._replace(1 << 20, (1 << 20) + 32, frozenset({1}), key)  # its first 32 bytes hold 1's data
    sources._replace(1 << 21, (1 << 21) + 64, frozenset({2}), key)  # 2's, where it was before
    sources.moving((storage,), lambda: setattr(storage, "at", 1 << 21))
    landed = [numbers for _, _, numbers in sources._held(1 << 21, (1 << 21) + 64, key)]
    assert (behind_set, moved_by_set, behind_out, drawn, landed) == ([], {1}, [], {none}, [{1}, {none}]), \
        (behind_set, moved_by_set, behind_out, drawn, landed)
    assert none in redrawn


def test_an_all_gathers_data_lands_at_its_wait():
    """An all-gather's outputs hold its data once a wait for it returned (Sources.landed, which the collective log's
    gate for Work.wait calls when the wait returns): read before, they hold none of it, however the program
    learnt it was done (a tensor swapped for another, synchronize(), a wait that timed out); bytes the program wrote
    into them meanwhile stay its own; a storage moved before the wait gets the data where it is now."""
    import torch

    from harness.tools.grading.jobs import CommLog

    log = CommLog("## model compute 11 ##")
    none = schedule.NONE_GATHERED
    with log:
        out, moved = torch.empty(32), torch.empty(16)
        number, regions = log.sources.gathered([out])
        early = out.clone()  # read before it landed
        out[:8].copy_(torch.randn(8))  # the program's own bytes, written before the wait
        second = log.sources.gathered([moved])
        moved.untyped_storage().resize_(1 << 16)  # moved before its wait: it lands where it is now
        log.sources.landed(number, regions)
        log.sources.landed(*second)
        found = [log.sources.held(t) for t in (early, out[:8], out[8:], moved[:16])]
    assert found == [{none}, {none}, {number}, {second[0]}], found


def test_an_index_or_a_mask_is_none_of_what_an_op_copies_out():
    """An integer index or a boolean mask says which values an op takes, not what they are: a copy-out through
    index_select, gather, take or masked_select holds the all-gather's data however the index was made
    (torch.tensor(rows) as arange: values from Python numbers, constants); an index or a condition made from memory's
    data carries it, memory that holds nothing gathered too (torch.empty's may hold a freed tensor's bytes)."""
    import torch

    from harness.tools.grading.jobs import CommLog

    log = CommLog("## model compute 12 ##")
    none = schedule.NONE_GATHERED
    with log:
        out = torch.empty(2, 8)
        number, regions = log.sources.gathered([out])
        log.sources.landed(number, regions)
        rows, mask = torch.tensor([1, 0]), torch.tensor([True] * 8)
        found = [log.sources.held(t) for t in (
            out.index_select(0, rows), out.gather(0, torch.tensor([[1] * 8, [0] * 8])), out.take(torch.tensor([3, 1])),
            out[rows], out[0].masked_select(mask), torch.where(mask, out[0], out[1]), out * torch.tensor(2.0))]
        # an index or a condition made from the data carries it: a table of constants looked up by another memory's
        # bits is that memory (a copy laundered), a where() whose condition is the data holds a bit of it
        elsewhere = torch.empty(8)
        other, regions = log.sources.gathered([elsewhere])
        log.sources.landed(other, regions)
        table = torch.arange(65536, dtype=torch.int32).to(torch.int16)
        bits = elsewhere.view(torch.int16).to(torch.int32) & 65535
        laundered = table[bits].view(torch.float32)
        reused = torch.empty(8, dtype=torch.int64) & 0  # new memory may hold a freed tensor's bytes: nothing gathered
        found += [log.sources.held(t) for t in (
            laundered, torch.where(torch.zeros(8, dtype=torch.bool), out[0], laundered),
            torch.where(out[0] > 0, torch.tensor(1.0), torch.tensor(0.0)), out[0][reused])]
    assert found == [{number}] * 7 + [{other}, {number, other}, {number}, {none, number}], found


def test_a_parameter_holds_its_own_groups_gathered_data():
    """The graded check of the reads above: each read of a leaf's parameters in the phase held data of its own group's
    all-gathers only, and in each pass of each step as many reads as FSDP2's held data from the passes FSDP2's did (a
    block kept from forward is not backward's all-gather; a pass whose reads the log did not see, memory put in the
    parameters' place after the leaf's forward, is not one whose data is known)."""
    from types import SimpleNamespace

    from harness.tools.grading import checks

    this = schedule.THIS_PASS
    wq = "layers.0.attention.wq"
    forward, backward = (1, "forward", 0, wq, (("layers.0", "forward", this),)), \
        (1, "backward", 0, wq, (("layers.0", "backward", this),))
    second = (1, "backward", 1, wq, (("layers.0", "backward", this),))
    fsdp2 = [forward, backward, second, second]

    def judged(*reads, phase="forward"):
        checks.assert_parameters_gathered(SimpleNamespace(what="w", fsdp2=SimpleNamespace(reads=[fsdp2]),
                                                          effdl=SimpleNamespace(reads=[list(reads)])), phase)

    judged(*fsdp2)
    judged(*fsdp2, phase="backward")
    for sources, message in (
            ((), r"rank 0, step 1, forward: layers\.0\.attention\.wq's parameters, as the model read them, held "
                 r"bytes that no all-gather brought"),
            ((("layers.0", "forward", this), ("", "", "")), r"held bytes that no all-gather brought"),
            ((("layers.1", "forward", this),), r"held data of the all-gather issued as layers\.1's, not layers\.0's"),
            (((None, "", ""),), r"issued as no group's \(outside the groups' ranges, or before the profiled steps\)"),
    ):
        with pytest.raises(AssertionError, match=message):
            judged((1, "forward", 0, wq, sources))
    with pytest.raises(AssertionError, match=r"rank 0, step 1, backward pass 1: layers\.0\.attention\.wq's parameters, "
                                             r"as the model read them, held data of the all-gathers of forward's \(an "
                                             r"earlier pass of this step\) in 1 read; under FSDP2 of backward's \(this "
                                             r"pass\) in 1 read"):
        judged((1, "backward", 0, wq, (("layers.0", "forward", schedule.EARLIER_PASS),)), second, second,
               phase="backward")
    with pytest.raises(AssertionError, match=r"step 1, forward pass 1: layers\.0\.attention\.wq's parameters, as the "
                                             r"model read them, held data of the all-gathers of none in 0 reads; under "
                                             r"FSDP2 of forward's \(this pass\) in 1 read"):
        judged(phase="forward")
    # the second backward pass read one of its two reads through memory the log did not see: the first pass's
    # honest reads do not stand for it
    with pytest.raises(AssertionError, match=r"step 1, backward pass 2: .* in 1 read; under FSDP2 of backward's "
                                             r"\(this pass\) in 2 reads"):
        judged(backward, second, phase="backward")


def test_every_collective_op_of_a_profiled_run_is_compared(tmp_path):
    """Beside the all-gathers and reduce-scatters the schedule reads, every collective op the dispatcher ran in
    the profiled steps is counted (a functional collective, a broadcast; not a wait), and the graded check
    compares the whole with FSDP2's: data sent another way beside decoy collectives differs."""
    from harness.tools.grading import checks

    plain = schedule_trace()
    extra = {"traceEvents": plain["traceEvents"] + [
        x("_c10d_functional::all_gather_into_tensor", 40, 1), x("_c10d_functional::wait_tensor", 42, 1),
        x("c10d::broadcast_", 44, 1)]}
    for name, trace in (("fsdp2", plain), ("effdl", extra)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.json").write_text(json.dumps(trace))
    fsdp2, effdl = (analysis.analyze_run(tmp_path / name) for name in ("fsdp2", "effdl"))
    assert effdl.c10d_calls == {**fsdp2.c10d_calls, "_c10d_functional::all_gather_into_tensor": 1, "c10d::broadcast_": 1}
    checks.assert_same_collectives(checks.Profiles("same", fsdp2, fsdp2))
    with pytest.raises(AssertionError, match=r"collective ops differ from FSDP2's \(_c10d_functional::all_gather_into_tensor: "
                                             r"effdl 1, FSDP2 0, c10d::broadcast_: effdl 1, FSDP2 0\)"):
        checks.assert_same_collectives(checks.Profiles("decoys", fsdp2, effdl))

"""harness.tools.traces.pictures: the overlap picture and the memory plot, checked on what they drew (the
bars and lines the functions return), from a real profiled run of FSDP2; and `pytest --artifacts`."""

import struct
import subprocess
import sys
from pathlib import Path

import pytest

import train
from harness.impl import task1_undone
from harness.tools.traces import pictures
from harness.tools.grading import policy

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ["<root>"] + [f"layers.{i}" for i in range(6)]  # the debug model: the root, then 6 blocks
MICRO = 2  # policy.config's micro-steps: two forward and two backward passes per step


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG file; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def passes(panel: pictures.Panel, kind: str, phase: str) -> list[list[pictures.Bar]]:
    """The collectives of one kind issued in each `phase` pass of the step, in issue order."""
    spans = [(s, e) for s, e, p in panel.phases if p == phase]
    return [sorted((b for b in panel.collectives(kind, phase) if s <= b.start <= e), key=lambda b: b.start)
            for s, e in spans]


def assert_drawn(drawing: pictures.Overlap, overlapped: tuple[bool, ...]) -> None:
    """What the overlap picture must show: both panels on one time axis, every group's compute, and
    per panel, forward all-gathers that overlap compute (all but each pass's first, which none can)
    or none that do (FSDP2 on CPU waits at once)."""
    drawn = [p for p in drawing.panels if not p.note]
    assert drawing.xlim == (0.0, max(p.length for p in drawn))
    assert drawing.axes_xlim == [drawing.xlim] * len(drawing.panels), "the panels do not share the time axis"
    for panel, overlaps in zip(drawing.panels, overlapped):
        assert panel.groups == GROUPS, panel.title
        for group in GROUPS:
            for kind in ("forward", "backward", "hook"):
                assert any(b.group == group and b.kind == kind for b in panel.bars), f"{panel.title}: no {kind} of {group}"
        for b in panel.bars:
            assert 0 <= b.start <= b.end <= panel.length, (panel.title, b)
        forward = passes(panel, "all_gather", "forward")
        assert len(forward) == MICRO and all([b.group for b in p] == GROUPS for p in forward), (panel.title, forward)
        for p in forward:
            assert not p[0].required and all(b.required for b in p[1:]), panel.title  # as schedule.must_overlap
            assert all(b.ran is not None for b in p), f"{panel.title}: a collective not found running on gloo's thread"
            late = [b.group for b in p[1:] if b.overlapped != overlaps]
            assert not late, (f"{panel.title}: the forward all-gathers of {late} "
                              f"{'do not overlap' if overlaps else 'overlap'} another group's compute")


@pytest.fixture(scope="module")
def fsdp2_traces(pool2, tmp_path_factory) -> Path:
    """One profiled step pair of FSDP2 (3 steps, the last two profiled)."""
    folder = tmp_path_factory.mktemp("fsdp2") / "traces"
    pool2.run(train.train, policy.config(num_steps=3, profile_steps=2, traces_dir=folder, profile_memory=False,
                                       snapshots_dir=None))
    return folder


def test_overlap_picture_of_fsdp2(fsdp2_traces, tmp_path):
    out = tmp_path / "overlap.png"
    drawing = pictures.overlap_png(fsdp2_traces, fsdp2_traces, out, title="FSDP2 twice")
    width, height = png_size(out)
    assert width >= 1000 and height >= 600 and out.stat().st_size > 30_000, (width, height)
    assert_drawn(drawing, (False, False))  # FSDP2 on CPU waits for each all-gather at once
    assert [p.title for p in drawing.panels] == ["FSDP2: rank 0, step 2", "effdl: rank 0, step 2"]
    # The same trace twice: the same bars, so a difference between the panels is the runs' own.
    assert drawing.panels[0].bars == drawing.panels[1].bars


def test_overlap_check_fails_when_it_should(fsdp2_traces, tmp_path):
    """assert_drawn can fail: FSDP2's all-gathers claimed overlapped, or the panels' axes apart."""
    drawing = pictures.overlap_png(fsdp2_traces, None, tmp_path / "overlap.png")
    with pytest.raises(AssertionError, match="do not overlap another group's compute"):
        assert_drawn(drawing, (True,))
    drawing.axes_xlim[0] = (0.0, 1.0)
    with pytest.raises(AssertionError, match="do not share the time axis"):
        assert_drawn(drawing, (False,))


def test_a_run_without_trace_gets_a_panel_saying_why(fsdp2_traces, tmp_path):
    out = tmp_path / "overlap.png"
    drawing = pictures.overlap_png(fsdp2_traces, tmp_path / "none", out, notes={"effdl": "TodoError: TODO(task1)"})
    assert png_size(out)[0] >= 1000
    assert drawing.panels[1].note == "no trace: TodoError: TODO(task1)" and not drawing.panels[1].bars
    with pytest.raises(ValueError, match="no trace to draw"):
        pictures.overlap_png(None, None, tmp_path / "nothing.png")


def test_memory_plot_draws_peaks_and_the_allowance(tmp_path):
    MiB = 2**20
    cases = {"case a": {"fsdp2": [[50 * MiB, 80 * MiB, 79 * MiB], [50 * MiB, 81 * MiB, 80 * MiB]],
                        "effdl": [[51 * MiB, 84 * MiB, 83 * MiB], [51 * MiB, 84 * MiB, 85 * MiB]], "margin": 6 * MiB,
                        "judged": [2, 3]},
             "case b": {"fsdp2": [[40 * MiB, 60 * MiB, 58 * MiB]], "effdl": None, "margin": 2 * MiB, "judged": [2]}}
    out = tmp_path / "memory.png"
    drawn = pictures.memory_png(cases, out)
    assert png_size(out)[0] >= 800 and out.stat().st_size > 20_000
    # The check's rule: effdl's least peak of the judged steps against FSDP2's plus the margin.
    assert drawn["case a"]["allowed"] == [85.0, 86.0]
    assert drawn["case a"]["effdl"][1] == [51.0, 84.0, 85.0]
    assert drawn["case b"] == {"fsdp2": [[40.0, 60.0, 58.0]], "effdl": None, "allowed": [62.0]}


def test_artifacts_say_why_nothing_was_drawn(tmp_path):
    lines = pictures.draw_artifacts(tmp_path, "fsdp.py")
    assert lines[0].startswith("overlap.png: not drawn: tasks 2 and 3 did not run"), lines
    assert lines[1].startswith("memory.png: not drawn: no memory check ran"), lines
    assert (tmp_path / "pictures.txt").read_text().splitlines() == lines
    (tmp_path / "memory.json").write_text("not json")  # a broken input: said, never raised
    assert pictures.draw_artifacts(tmp_path, "fsdp.py")[1].startswith("memory.png: not drawn: JSONDecodeError")


@pytest.mark.skipif(not task1_undone(ROOT / "fsdp.py"), reason="fsdp.py has task 1 done")
def test_pytest_artifacts_with_the_skeleton(tmp_path):
    """`pytest test.py -m task2 --artifacts DIR` on the skeleton: its run stops at TODO(task1), so
    overlap.png shows FSDP2 alone with the reason, and the session's outcome is the test's own."""
    folder = tmp_path / "artifacts"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test.py", "--impl", "fsdp.py", "-m", "task2",
                           "--artifacts", str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "task 2           0 / 2" in proc.stdout, proc.stdout[-3000:]
    said = (folder / "pictures.txt").read_text()
    assert "overlap.png: drawn; effdl: no trace: " in said and "TODO(task1)" in said, said
    assert "memory.png: not drawn" in said, said
    assert png_size(folder / "overlap.png")[0] >= 1000
    assert (folder / "profiles" / "fsdp2" / "traces" / "rank0.json").is_file()


def test_cli_draws_train_py_traces_and_refuses_a_folder_without_them(fsdp2_traces, tmp_path, capsys):
    """`python -m harness.tools.traces.pictures traces/fsdp2 traces/effdl`, as the README gives it (FSDP2's
    traces on both sides here), and a folder train.py did not profile into: one error line, exit 2."""
    out = tmp_path / "overlap.png"
    pictures.cli([str(fsdp2_traces), str(fsdp2_traces), "--out", str(out)])
    assert png_size(out)[0] > 0 and f"wrote {out}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        pictures.cli([str(fsdp2_traces), str(tmp_path), "--out", str(tmp_path / "other.png")])
    assert stopped.value.code == 2 and f"no rank0.json in {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "other.png").exists()


def test_overlap_picture_shows_the_replica_all_reduce(tmp_path):
    """HSDP (synthetic trace, no training run): the reference's replica all-reduces, issued in
    `FSDP::all_reduce (G) [replicate]` and waited in `all_reduce_wait (G) [replicate]`, are drawn in their group's
    row from issue to wait, where gloo ran them, and named in the legend; the loss's all-reduce is not drawn; a
    trace without them has no such bar or legend entry."""
    import json

    from harness.tests.test_analysis import schedule_trace, x

    a = lambda name, ts, dur: x(name, ts, dur, cat="user_annotation")
    ar = lambda ts: x("c10d::allreduce_", ts, 2, **{"Input Dims": [[4]]})
    plain = schedule_trace()
    hsdp = {"traceEvents": plain["traceEvents"] + [
        a("FSDP::all_reduce (layers.1) [replicate]", 460, 4), ar(461),
        x("gloo:all_reduce", 462, 20, tid=2, cat="user_annotation", **{"Input Dims": [[4]]}),
        x("aten::mm", 470, 5),
        a("FSDP::all_reduce_wait (layers.1) [replicate]", 485, 3),
        ar(920),  # the loss's, outside every FSDP range
    ]}
    drawn = {}
    for name, trace in (("plain", plain), ("hsdp", hsdp)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.json").write_text(json.dumps(trace))
        drawn[name] = pictures.overlap_png(tmp_path / name, tmp_path / name, tmp_path / f"{name}.png")
    bars = [b for b in drawn["hsdp"].panels[1].bars if b.kind == "all_reduce"]
    ((group, start, end, ran),) = [(b.group, b.start, b.end, b.ran) for b in bars]
    step_start = 0  # step_and_phases: the step starts at ts 0
    assert group == "layers.1" and (start, end) == ((461 - step_start) / 1e3, (485 - step_start) / 1e3), bars
    assert ran == (462 / 1e3, 482 / 1e3)
    label = "HSDP replica all-reduce (across replicas): issued to waited for"
    assert label in drawn["hsdp"].legend and label not in drawn["plain"].legend
    assert not [b for p in drawn["plain"].panels for b in p.bars if b.kind == "all_reduce"]
    assert (tmp_path / "hsdp.png").stat().st_size > 10_000

"""Pictures of a run: FSDP's collectives against compute (overlap.png), and peak memory per step (memory.png).

    uv run python -m harness.tools.traces.pictures traces/fsdp2 traces/effdl --out overlap.png

`overlap_png`: one profiled step of one rank, FSDP2 above effdl, on one time axis
(milliseconds from each step's start). One row per FSDP group (the root, then each block, in forward
order), and in each row:
  * the group's compute: aten ops outside FSDP's own ranges and c10d ops (what the graded overlap
    check counts as compute, harness/tools/traces/schedule.py), inside the group's `FSDP::pre_forward` ..
    `post_forward` (forward) or `pre_backward` .. `post_backward` (backward) and no inner group's
    (on CUDA the CPU side: when the ops were launched);
  * its all-gathers (upper half of the row) and reduce-scatters (lower half, hatched) as bars from
    issued to waited for (schedule.py), green where another group's compute ran in between, red where
    none did though FSDP's schedule could have (what the graded check flags, schedule.must_overlap),
    grey where none can (a pass's first all-gather, its last reduce-scatter);
  * a black line where the work itself ran (gloo's worker thread, or the NCCL kernel: collectives.py);
  * HSDP: its replica all-reduces (gold, cross-hatched, over the lower half), from issued to waited for:
    effdl's inside `FSDP::all_reduce (G) [replicate]` up to `all_reduce_wait` / `_done (G)`,
    FSDP2's inside its `post_backward_reduce (G)` range (to where the op returned). Drawn, and in the
    legend, only where a trace has them.

`memory_png`: per precision case, each rank's peak memory per step for FSDP2 and
effdl, and the most the memory check allows (FSDP2's least peak of the judged steps plus its margin).

Both return what they drew, so tests check the data rather than pixels. `draw_artifacts` is what
`pytest test.py --artifacts DIR` runs at the end of the session (conftest.py).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from harness.cli import parse
from harness.errors import BAD_INPUT, stop
from harness.tools.traces.collectives import work_intervals
from harness.tools.traces.schedule import must_overlap, schedule
from harness.tools.traces.trace import C10D_OPS, LINK, ROOT_GROUP, Trace, inside, union

MiB = 2**20
# A group's forward and backward windows, FSDP2's range names (effdl shares them).
# FSDP2 ends a group's backward with `post_backward_accumulate` / `_reshard` / `_reduce`, the
# reference with `post_backward` around `post_backward_reduce`: the first after pre_backward closes it.
WINDOW = re.compile(r"^FSDP::(?P<when>pre|post)_(?P<direction>forward|backward)(?:_accumulate|_reshard|_reduce)?"
                    r"(?: \((?P<fqn>.*)\))?$")
# HSDP's replica all-reduce in the reference: issued inside ALL_REDUCE, waited for inside ALL_REDUCE_WAIT.
ALL_REDUCE = re.compile(r"^FSDP::all_reduce(?: \((?P<fqn>.*?)\))?" + LINK + "$")
ALL_REDUCE_WAIT = re.compile(r"^FSDP::all_reduce_(?:wait|done)(?: \((?P<fqn>.*?)\))?" + LINK + "$")
# Compute ops closer than this share of the step are drawn as one bar (thousands of slivers otherwise).
MERGE_GAP = 0.002
# A collective waited for at once still shows as a bar this share of the axis wide.
MIN_WIDTH = 0.004
COLOURS = {"forward": "#9ecae1", "backward": "#fdd0a2", "overlapped": "#2ca02c", "missed": "#d62728",
           "exempt": "#969696", "hook": "#6a51a3", "all_reduce": "#e6ab02"}
# What pytest --artifacts writes into its folder (removed when a session starts, so nothing stale remains).
ARTIFACTS = ("profiles", "memory.json", "overlap.png", "memory.png", "pictures.txt")


@dataclass(frozen=True)
class Bar:
    """One drawn bar: a group's compute, or one of its collectives. Times in ms from the step's start."""

    group: str
    kind: str
    """forward, backward (compute); hook (FSDP's own code); all_gather, reduce_scatter, all_reduce (collectives;
    all_reduce: HSDP's replica all-reduce)."""
    start: float
    end: float
    phase: str = ""
    """collectives: the phase it was issued in."""
    overlapped: bool | None = None
    """collectives: another group's compute ran between issue and wait (schedule.Scheduled)."""
    required: bool = False
    """collectives: FSDP's schedule can overlap it (schedule.must_overlap)."""
    ran: tuple[float, float] | None = None
    """collectives: where its work ran, if found."""


@dataclass
class Panel:
    title: str
    bars: list[Bar] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    """rows, top to bottom: groups in the order their forward began."""
    phases: list[tuple[float, float, str]] = field(default_factory=list)
    length: float = 0.0
    """the step's length, ms."""
    note: str = ""
    """why nothing is drawn (no trace)."""

    def collectives(self, kind: str, phase: str) -> list[Bar]:
        return [b for b in self.bars if (b.kind, b.phase) == (kind, phase)]


@dataclass
class Overlap:
    """What overlap_png drew: the panels top to bottom, and the x-axis limits they share."""

    panels: list[Panel]
    xlim: tuple[float, float]
    axes_xlim: list[tuple[float, float]] = field(default_factory=list)
    """each drawn axis's x-limits, read back from the figure."""
    legend: list[str] = field(default_factory=list)
    """the legend's labels, as drawn."""


# --------------------------------------------------------------------------- reading one step


def step_panel(traces: str | Path, title: str, rank: int = 0, step: int | None = None) -> Panel:
    """One rank's profiled step (default: the last, the steadiest) of the run in `traces`."""
    path = Path(traces) / f"rank{rank}.json"
    t = Trace(path)
    steps = t.steps.ranges if step is None else [r for r in t.steps.ranges if r[2] == step]
    if not steps:
        raise ValueError(f"{path} has no profiled step {step}")
    begin, end, step = steps[-1]
    ms = lambda ts: (ts - begin) / 1e3
    panel = Panel(f"{title}: rank {rank}, step {step}", length=ms(end))
    panel.phases = [(ms(s), ms(e), p) for s, e, p in t.phases.ranges if begin <= s <= end]

    # Each group's windows, on the thread that ran them: (start, end, group, forward|backward).
    # The hooks themselves (FSDP's own code: gathers, copies, waits) are drawn too, outermost ranges only.
    opened: dict[tuple, list] = {}
    windows: dict[tuple, list[tuple[float, float, str, str]]] = {}
    hooks: list[tuple[float, float, str]] = []
    for e in sorted((e for e in t.ranges if e.get("cat") == "user_annotation" and begin <= e["ts"] <= end),
                    key=lambda e: e["ts"]):
        if m := WINDOW.match(e["name"]):
            thread, group, direction = (e["pid"], e["tid"]), m["fqn"] or ROOT_GROUP, m["direction"]
            if not hooks or e["ts"] >= hooks[-1][1]:
                hooks.append((e["ts"], e["ts"] + e["dur"], group))
            if m["when"] == "pre":
                opened.setdefault((thread, group, direction), []).append(e["ts"])
            elif starts := opened.get((thread, group, direction)):
                windows.setdefault(thread, []).append((starts.pop(0), e["ts"] + e["dur"], group, direction))
    first = {}
    for thread, wins in windows.items():
        on = [e for e in t.ranges if (e["pid"], e["tid"]) == thread and begin <= e["ts"] <= end]
        skip = union((e["ts"], e["ts"] + e["dur"]) for e in on if e["name"].startswith(("FSDP::", "c10d::", "_c10d_functional::")))
        spans: dict[tuple[str, str], list] = {}
        for e in on:
            if e.get("cat") != "cpu_op" or not e["name"].startswith("aten::") or inside(e["ts"], skip):
                continue
            holding = [w for w in wins if w[0] <= e["ts"] <= w[1]]
            if holding:
                _, _, group, direction = max(holding, key=lambda w: w[0])  # the innermost group's
                spans.setdefault((group, direction), []).append((e["ts"], e["ts"] + e["dur"]))
        for s, _, group, direction in wins:
            first[group] = min(first.get(group, float("inf")), s if direction == "forward" else float("inf"))
        gap = MERGE_GAP * (end - begin)
        for (group, direction), intervals in spans.items():
            merged: list[list[float]] = []
            for s, e in union(intervals):
                if merged and s - merged[-1][1] < gap:
                    merged[-1][1] = e
                else:
                    merged.append([s, e])
            panel.bars += [Bar(group, direction, ms(s), ms(e)) for s, e in merged]

    panel.bars += [Bar(group, "hook", ms(s), ms(min(e, end))) for s, e, group in hooks]
    scheduled = [s for s in schedule(t) if s.step == step]
    required = {id(s) for kind, phase in {(s.kind, s.phase) for s in scheduled}
                for s in must_overlap([s for s in scheduled if (s.kind, s.phase) == (kind, phase)])}
    ops = {op["ts"]: op for op in t.ops}
    ran = {op["ts"]: span for op, span in work_intervals(t)}
    for s in scheduled:
        op = ops[s.issued]
        stop_at = s.waited if s.waited is not None else op["ts"] + op["dur"]
        work = ran.get(s.issued)
        panel.bars.append(Bar(s.group, s.kind, ms(s.issued), ms(stop_at), s.phase, s.overlapped, id(s) in required,
                              (ms(work[0]), ms(work[1])) if work else None))
        first.setdefault(s.group, float("inf"))
    for group, issued, waited, work in replica_all_reduces(t, begin, end):
        panel.bars.append(Bar(group, "all_reduce", ms(issued), ms(waited), t.phases.at(issued, ""),
                              ran=(ms(work[0]), ms(work[1])) if work else None))
        first.setdefault(group, float("inf"))
    panel.groups = sorted(first, key=lambda g: (first[g], g != ROOT_GROUP, _block_number(g), g))
    return panel


def replica_all_reduces(t: Trace, begin: float, end: float) -> list[tuple[str, float, float, tuple | None]]:
    """(group, issued, waited for, where the work ran) of every HSDP replica all-reduce issued in [begin, end]:
    a `c10d::allreduce_` inside the reference's `FSDP::all_reduce (G)` range, or inside a group's range
    (FSDP2 all-reduces inside `post_backward_reduce (G)`); the loss's and grad norm's are in neither."""
    ran = {id(op): span for op, span in work_intervals(t)}
    out = []
    for thread in {(op["pid"], op["tid"]) for op in t.ops}:
        named = [e for e in t.ranges if (e["pid"], e["tid"]) == thread and e.get("cat") == "user_annotation"]
        issues = [(e["ts"], e["ts"] + e["dur"], m["fqn"] or ROOT_GROUP) for e in named if (m := ALL_REDUCE.match(e["name"]))]
        waits = sorted((e["ts"], m["fqn"] or ROOT_GROUP) for e in named if (m := ALL_REDUCE_WAIT.match(e["name"])))
        for op in t.ops:
            if ((op["pid"], op["tid"]) != thread or C10D_OPS[op["name"]][0] != "all_reduce"
                    or not begin <= op["ts"] <= end):
                continue
            group = next((g for s, e, g in issues if s <= op["ts"] <= e), None) or t.group_of(op)
            if group is None:
                continue
            done = op["ts"] + op["dur"]
            waited = next((ts for ts, g in waits if g == group and ts >= done), done)
            out.append((group, op["ts"], waited, ran.get(id(op))))
    return sorted(out, key=lambda r: r[1])


def _block_number(group: str) -> int:
    m = re.search(r"(\d+)$", group)
    return int(m[1]) if m else -1


# --------------------------------------------------------------------------- overlap.png


def overlap_png(fsdp2_traces: str | Path | None, effdl_traces: str | Path | None, out: str | Path,
                title: str = "", rank: int = 0, notes: dict[str, str] | None = None,
                names: tuple[str, str] = ("FSDP2", "effdl")) -> Overlap:
    """FSDP2's schedule above effdl's, one step of `rank` each, written to `out`.
    A run with no traces (None, or no rank file) gets a panel saying so: `notes[fsdp2|effdl]`
    gives the reason."""
    notes = notes or {}
    panels = []
    for key, traces, name in (("fsdp2", fsdp2_traces, names[0]), ("effdl", effdl_traces, names[1])):
        if traces is not None and (Path(traces) / f"rank{rank}.json").is_file():
            panels.append(step_panel(traces, name, rank))
        else:
            panels.append(Panel(name, note="no trace: " + notes.get(key, f"no rank{rank}.json in {traces}")))
    drawn = [p for p in panels if not p.note]
    if not drawn:
        raise ValueError("no trace to draw: " + "; ".join(p.note for p in panels))
    groups = list(dict.fromkeys(g for p in drawn for g in p.groups))
    xlim = (0.0, max(p.length for p in drawn))
    return Overlap(panels, xlim, *_draw_overlap(panels, groups, xlim, Path(out), title))


def _summary(panel: Panel) -> str:
    """How many of the collectives FSDP's schedule can overlap did, per phase and kind."""
    parts = []
    for phase in ("forward", "backward"):
        for kind in ("all_gather", "reduce_scatter"):
            could = [b for b in panel.collectives(kind, phase) if b.required]
            if could:
                parts.append(f"{phase} {kind.replace('_', '-')}s {sum(b.overlapped for b in could)}/{len(could)}")
    return ("overlapped: " + ", ".join(parts)) if parts else ""


def _draw_overlap(panels: list[Panel], groups: list[str], xlim: tuple[float, float], out: Path,
                  title: str) -> tuple[list[tuple[float, float]], list[str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = {g: i for i, g in enumerate(groups)}
    legend_in = 0.7  # the legend below the panels, whatever their height
    height = 0.8 + legend_in + len(panels) * (0.5 + 0.38 * max(len(groups), 3))
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(14, height))
    for ax, panel in zip(axes, panels):
        ax.set_title(f"{panel.title}    {_summary(panel)}", fontsize=10, loc="left", pad=12)
        ax.set_ylim(len(groups) - 0.5, -0.5)  # first group on top
        ax.set_yticks(range(len(groups)), [("root" if g == ROOT_GROUP else g) for g in groups], fontsize=8)
        ax.set_ylabel("FSDP group")
        if panel.note:
            ax.text(0.5, 0.5, panel.note, transform=ax.transAxes, ha="center", va="center", fontsize=10,
                    color=COLOURS["missed"], wrap=True)
            continue
        for s, e, phase in panel.phases:
            ax.axvspan(s, e, color="0.5", alpha=0.06 if phase != "backward" else 0.12, lw=0)
            ax.text((s + e) / 2, -0.5, phase, ha="center", va="bottom", fontsize=7, color="0.35")
        for b in panel.bars:
            y = rows[b.group]
            if b.kind in ("forward", "backward"):
                ax.broken_barh([(b.start, b.end - b.start)], (y - 0.45, 0.9), color=COLOURS[b.kind], lw=0)
                continue
            if b.kind == "hook":
                ax.broken_barh([(b.start, b.end - b.start)], (y - 0.03, 0.06), color=COLOURS["hook"], lw=0)
                continue
            if b.kind == "all_reduce":
                ax.broken_barh([(b.start, max(b.end - b.start, MIN_WIDTH * xlim[1]))], (y + 0.1, 0.22),
                               facecolor=COLOURS["all_reduce"], edgecolor="k", lw=0.3, hatch="xx", alpha=0.9)
                if b.ran:
                    ax.plot(b.ran, (y + 0.21, y + 0.21), color="k", lw=1.6, solid_capstyle="butt")
                continue
            colour = COLOURS["overlapped" if b.overlapped else "missed" if b.required else "exempt"]
            low = y - 0.38 if b.kind == "all_gather" else y + 0.04
            ax.broken_barh([(b.start, max(b.end - b.start, MIN_WIDTH * xlim[1]))], (low, 0.34), facecolor=colour, edgecolor="k",
                           lw=0.3, hatch="///" if b.kind == "reduce_scatter" else None, alpha=0.9)
            if b.ran:
                ax.plot(b.ran, (low + 0.17, low + 0.17), color="k", lw=1.6, solid_capstyle="butt")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(*xlim)
    axes[-1].set_xlabel("ms from the step's start")
    legend = [Patch(color=COLOURS["forward"], label="forward compute"),
              Patch(color=COLOURS["backward"], label="backward compute"),
              Patch(color=COLOURS["hook"], label="in FSDP's hooks (thin: gathering, copying, waiting)"),
              Patch(facecolor="white", edgecolor="k", label="all-gather (upper half): issued to waited for"),
              Patch(facecolor="white", edgecolor="k", hatch="///", label="reduce-scatter (lower half): issued to waited for"),
              Patch(color=COLOURS["overlapped"], label="another group computed meanwhile (overlapped)"),
              Patch(color=COLOURS["missed"], label="not overlapped, though it could be"),
              Patch(color=COLOURS["exempt"], label="not overlapped, none can be (first all-gather / last reduce-scatter of a pass)"),
              Line2D([], [], color="k", lw=1.6, label="where the work ran (gloo thread / NCCL kernel)")]
    if any(b.kind == "all_reduce" for p in panels for b in p.bars):
        legend.insert(5, Patch(facecolor=COLOURS["all_reduce"], edgecolor="k", hatch="xx",
                               label="HSDP replica all-reduce (across replicas): issued to waited for"))
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, legend_in / height, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [tuple(ax.get_xlim()) for ax in axes], [h.get_label() for h in legend]


# --------------------------------------------------------------------------- memory.png


def memory_png(cases: dict[str, dict], out: str | Path, title: str = "Peak memory per step") -> dict[str, dict]:
    """Per case (a subplot each): {"fsdp2": [[bytes per step] per rank], "effdl": same or None,
    "margin": bytes the check allows above FSDP2, "judged": the steps it compares (from 1)}. Returns per
    case what was drawn, in MiB: each rank's peaks per run and the allowance (FSDP2's least peak of the
    judged steps plus the margin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not cases:
        raise ValueError("no memory case to draw")
    cols = min(len(cases), 3)
    nrows = -(-len(cases) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows + 0.5), squeeze=False)
    drawn = {}
    for ax, (case, runs) in zip(axes.flat, cases.items()):
        ref, got = runs["fsdp2"], runs.get("effdl")
        d = drawn[case] = {"fsdp2": [[p / MiB for p in r] for r in ref],
                           "effdl": [[p / MiB for p in r] for r in got] if got else None,
                           "allowed": [(min(r[s - 1] for s in runs["judged"]) + runs["margin"]) / MiB for r in ref]}
        for rank, peaks in enumerate(d["fsdp2"]):
            ax.plot(range(1, len(peaks) + 1), peaks, "o-", color="tab:blue", alpha=0.9 - 0.25 * rank,
                    label="FSDP2" if rank == 0 else None)
        for rank, peaks in enumerate(d["effdl"] or []):
            ax.plot(range(1, len(peaks) + 1), peaks, "x--", color="tab:orange", alpha=0.9 - 0.25 * rank,
                    label="effdl" if rank == 0 else None)
        steps = len(d["fsdp2"][0])
        judged = runs["judged"]
        for rank, allowed in enumerate(d["allowed"]):
            ax.hlines(allowed, min(judged), max(judged) + (min(judged) == max(judged)) * 0.2, colors="tab:red",
                      linestyles=":", label="allowed (FSDP2's least of the judged steps + margin)" if rank == 0 else None)
        if not got:
            ax.text(0.5, 0.5, "no run of effdl", transform=ax.transAxes, ha="center", color="tab:red")
        ax.set_title(case, fontsize=8)
        ax.set(xlabel="step", ylabel="peak MiB (each rank a line)")
        ax.set_xticks(range(1, steps + 1))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


# --------------------------------------------------------------------------- pytest --artifacts


def clear_artifacts(folder: Path) -> None:
    """Remove what an earlier session wrote into the artifacts folder (only those names)."""
    for name in ARTIFACTS:
        path = folder / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def record_memory(folder: Path, case: str, fsdp2: list[list[int]], effdl: list[list[int]] | None, margin: int,
                  judged: tuple[int, ...]) -> None:
    """Add one memory case to folder/memory.json (written each time: a session cut short keeps what it saw)."""
    path = folder / "memory.json"
    cases = json.loads(path.read_text()) if path.exists() else {}
    cases[case] = {"fsdp2": fsdp2, "effdl": effdl, "margin": margin, "judged": list(judged)}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cases, indent=1))


def failure_reason(text: str) -> str:
    """One line from a failed test's report: the TODO a rank stopped at, else its last error line."""
    from harness.impl import todo_reached

    if todo := todo_reached(RuntimeError(text)):
        return f"the run stopped at {todo}"
    lines = [line.strip() for line in text.splitlines() if "Error" in line]
    return re.sub(r"^E\s+", "", lines[-1])[:300] if lines else ""


def draw_artifacts(folder: Path, impl: str, failed: str = "") -> list[str]:
    """folder/overlap.png from folder/profiles (tasks 2 and 3's runs) and folder/memory.png from
    folder/memory.json. A picture that cannot be drawn is said in folder/pictures.txt instead, with
    why; `failed` is why effdl's profiled run left no trace, if it failed. Never
    raises: the pictures must not change a test session's outcome. Returns the lines written."""
    lines = []
    profiles = folder / "profiles"
    try:
        if not (profiles / "fsdp2" / "traces").is_dir():
            lines.append("overlap.png: not drawn: tasks 2 and 3 did not run (select them: -m task2, -m task3)")
        else:
            notes = {"effdl": failed or "the run left none (see the test output)"}
            drawn = overlap_png(profiles / "fsdp2" / "traces", profiles / "effdl" / "traces", folder / "overlap.png",
                                title=f"Overlap: FSDP2 and {impl}", notes=notes)
            lines.append("overlap.png: drawn" + "".join(f"; {p.title}: {p.note}" for p in drawn.panels if p.note))
    except Exception as e:  # a picture is a by-product: say why it is missing, keep the session's result
        lines.append(f"overlap.png: not drawn: {type(e).__name__}: {e}")
    try:
        path = folder / "memory.json"
        if not path.exists():
            lines.append("memory.png: not drawn: no memory check ran to the end of both runs (task 3's memory test, the bonuses)")
        else:
            memory_png(json.loads(path.read_text()), folder / "memory.png", f"Peak memory per step: FSDP2 and {impl}")
            lines.append("memory.png: drawn")
    except Exception as e:
        lines.append(f"memory.png: not drawn: {type(e).__name__}: {e}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pictures.txt").write_text("\n".join(lines) + "\n")
    except OSError:
        pass
    return lines


# --------------------------------------------------------------------------- CLI


@dataclass(frozen=True)
class Args:
    """Draw the overlap picture of two profiled runs: FSDP2's schedule above effdl's."""

    traces: Annotated[tuple[Path, Path], tyro.conf.Positional, tyro.conf.arg(metavar="FSDP2_TRACES EFFDL_TRACES")]
    """trace directories with rank{r}.json, e.g. traces/fsdp2 traces/effdl."""
    out: Path = Path("overlap.png")
    """PNG file to write."""
    rank: int = 0
    """the rank whose step is drawn."""


def main(args: Args) -> None:
    for traces in args.traces:
        if not (traces / f"rank{args.rank}.json").is_file():
            stop(f"no rank{args.rank}.json in {traces}: give the trace directories train.py --profile-steps "
                 "writes (traces/fsdp2 traces/effdl)", BAD_INPUT)
    try:
        overlap_png(*args.traces, args.out, rank=args.rank)
    except ValueError as e:  # a trace not written by train.py's profiler
        stop(str(e), BAD_INPUT)
    print(f"wrote {args.out}")


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.traces.pictures"))


if __name__ == "__main__":
    cli()

"""Overlap and memory of a whole run, measured from the traces and snapshots that `train.py` writes.

    uv run python -m harness.tools.traces.analysis traces/fsdp2 traces/effdl    # memory from snapshots/fsdp2, snapshots/effdl

Instead of reading Perfetto and memory_viz by eye, this computes for every profiled step
(`ProfilerStep#N`) of every rank, then averages over steps and ranks:

  * how many all-gathers / reduce-scatters / all-reduces were issued, per phase, and how long
    they ran and which part of that was hidden behind compute (harness/tools/traces/collectives.py);
  * which FSDP group's collectives compute overlapped, by order (harness/tools/traces/schedule.py: what the
    graded overlap checks judge);
  * from the memory snapshot: the peak over the window, within forward and within backward,
    and what each step leaves allocated (growth) (harness/tools/traces/memory_analysis.py).

Each rank's trace is read once (harness/tools/traces/trace.py); this module puts the ranks of one run together
(`analyze_run`) and prints runs side by side.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from harness.cli import parse
from harness.tools.traces.collectives import StepStats, analyze_trace, mean
from harness.errors import BAD_INPUT, stop
from harness.tools.traces.memory_analysis import MemoryStats, analyze_memory, tensor_peaks
from harness.tools.traces.schedule import (Scheduled, linked_nodes, model_calls, model_order, must_overlap, node_leaves,
                                           parameter_reads, schedule)
from harness.tools.traces.trace import KINDS, OTHER, PHASES, Trace, rank_files


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
    model_calls: tuple[int, int] | None = None
    """forwards of the model's leaf modules, and runs of their backward nodes, over every rank's profiled steps
    (schedule.model_calls), when marked."""
    model_order: list[list[str]] = field(default_factory=list)
    """per rank, when marked: the model's leaves whose forwards ran in its profiled steps, in order (schedule.model_order)."""
    reads: list[list[tuple]] = field(default_factory=list)
    """per rank, when marked: every read of a leaf's parameters by the model's compute, with the all-gathers whose data
    they held (schedule.parameter_reads)."""
    c10d_calls: dict[str, int] = field(default_factory=dict)
    """collective op -> how many times the dispatcher ran it, over every rank's profiled steps (Trace.c10d_calls)."""
    peaks: list[list[int]] = field(default_factory=list)
    """per rank, a trace with allocation events: tensor memory's peak per profiled step (memory_analysis.tensor_peaks;
    exact where the run counted allocations on every thread, as the graded profiled runs do)."""
    peaks_problem: str = ""
    """why a trace with allocation events gave no peaks (tensor_peaks refused it), else empty"""

    def overlap(self, kind: str, phase: str) -> tuple[int, int, list[Scheduled]]:
        """(overlapped, that could be, the ones that could be and were not) for one kind and phase."""
        could = must_overlap([s for s in self.scheduled if (s.kind, s.phase) == (kind, phase)])
        missed = [s for s in could if not s.overlapped]
        return len(could) - len(missed), len(could), missed


def analyze_run(traces: str | Path, snapshots: str | Path | None = None, *, snapshots_optional: bool = False,
                mark: str | None = None) -> RunStats:
    """rank{r}.json in `traces` and, when given, rank{r}.pickle in `snapshots` (each read once).
    A trace profiled without allocation events (train.py --no-profile-memory) has no snapshot of its
    own: one found beside it is an older run's, refused (or, with snapshots_optional, not read). mark: the
    name of the ranges a graded run put around the model's compute (schedule.marked_compute)."""
    with without_cycle_collection():
        return _analyze_run(traces, snapshots, snapshots_optional, mark)


@contextlib.contextmanager
def without_cycle_collection():
    """Python's cycle collector off while traces are read: a trace is hundreds of thousands of small
    objects without cycles, and each collection the reading sets off walks every object of the
    process again (in a grader's long-lived process, more than half the time of an analysis)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _analyze_run(traces, snapshots, snapshots_optional: bool, mark: str | None) -> RunStats:
    steps, memories, scheduled, calls, c10d, peaks, problem, order, reads = [], [], [], (0, 0), {}, [], "", [], []
    for path in rank_files(traces, ".json"):
        t = Trace(path)
        if t.data.get("profile_memory") and not t.cuda:  # torch's mark of a trace with allocation events
            try:
                peaks.append(tensor_peaks(t))
            except ValueError as e:  # what reads them says so (checks.assert_profiled_memory); the rest stands
                problem = problem or f"{path.name}: {e}"
        for name, n in t.c10d_calls.items():
            c10d[name] = c10d.get(name, 0) + n
        steps += analyze_trace(t)
        mine = schedule(t, mark)
        scheduled += mine
        if mark is not None:
            reads.append(parameter_reads(t, mark, mine))
            nodes = linked_nodes(t.ranges, mark, leaves=node_leaves(t, mark))
            calls = tuple(a + b for a, b in zip(calls, model_calls(t.ranges, mark, nodes)))
            order.append(model_order(t.ranges, mark))
        if snapshots is None:
            continue
        snapshot = Path(snapshots) / f"{path.stem}.pickle"
        if t.data.get("profile_memory") and snapshot.is_file():  # torch's mark of a trace with allocation events
            memories.append(analyze_memory(snapshot, t))
        elif snapshots_optional:  # --traces-dir and --snapshots-dir apart, or the snapshot deleted: no memory rows
            continue
        elif t.data.get("profile_memory"):
            raise ValueError(f"no {snapshot.name} in {snapshots} for {path}: name the folder train.py wrote it to "
                             "(its --snapshots-dir) with --snapshots, or leave --snapshots out to analyse the traces alone")
        else:
            raise ValueError(f"{path} was profiled with --no-profile-memory, so no snapshot in {snapshots} is "
                             "from its run: profile again without that flag, or analyse the traces alone")
    return RunStats(mean(steps), MemoryStats.worst(memories) if memories else None, steps, memories, scheduled,
                    model_calls=calls if mark is not None else None, model_order=order, reads=reads, c10d_calls=c10d, peaks=peaks,
                    peaks_problem=problem)


# --------------------------------------------------------------------------- CLI


def snapshots_dir_for(traces: Path) -> Path | None:
    """train.py's layout: traces/<fsdp> next to snapshots/<fsdp> (None for a folder outside a traces/:
    its snapshots, if any, are wherever --snapshots-dir put them)."""
    parts = list(traces.parts)
    if "traces" not in parts:
        return None
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
            runs[name] = analyze_run(traces, snaps if snaps is not None and snaps.is_dir() else None,
                                     snapshots_optional=not args.snapshots)
        except ValueError as e:  # traces or snapshots not written as train.py writes them
            stop(str(e), BAD_INPUT)
    print(table(runs))


def cli(argv: list[str] | None = None) -> None:
    main(parse(Args, argv, prog="python -m harness.tools.traces.analysis"))


if __name__ == "__main__":
    cli()

"""What the writeup report measures, as typed results, and the checks on them.

harness/tools/lab/report.py measures into a `Report`; harness/tools/lab/report_render.py writes it as markdown and
plots; `check` and `timing_warnings` judge it; `to_json` is report.json. Memory parts are keyed by
field name here and labelled (`LABELS`) only where they are written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from harness.memory_model import PerRank, sent_bytes

# Field name -> the label report.md and report.json use.
LABELS = {"sharded_params": "sharded params", "optimizer_state": "optimizer state", "gathered_params": "gathered params",
          "comm_buffers": "comm buffers", "optimizer_steps": "optimizer steps"}


def label(name: str) -> str:
    return LABELS.get(name, name)


def labelled(obj) -> dict:
    return {label(f.name): getattr(obj, f.name) for f in dataclasses.fields(obj)}


@dataclass(frozen=True)
class Plan:
    """What each section runs: sizes and repeats."""

    model: dict
    seq_len: int
    batch_size: int
    steps: int
    repeats: int
    worlds: tuple[int, ...]
    sizes: tuple[int, ...]
    iters: int
    weak_layers: int
    bench_worlds: tuple[int, ...]


@dataclass(frozen=True)
class Parts:
    """Bytes of each part of one rank's training memory, measured (harness/report_jobs.Components)."""

    sharded_params: int
    grads: int
    optimizer_state: int
    gathered_params: int
    activations: int
    params_numel: int
    optimizer_steps: int
    """bytes of AdamW's `step` scalars, apart from its state."""

    @staticmethod
    def over_ranks(parts: list[Parts], how=max) -> Parts:
        return Parts(*(how(getattr(p, f.name) for p in parts) for f in dataclasses.fields(Parts)))


@dataclass(frozen=True)
class MemoryRow:
    """One run at one world size: the peak and its parts, measured, and the analytic model."""

    world: int
    run: str
    measured: int
    """peak above the rank's baseline, worst rank."""
    parts: Parts
    """worst rank (rank 0 holds chunk 0 of every parameter, the padded size)."""
    rank_sums: Parts
    model: PerRank


@dataclass(frozen=True)
class CommBench:
    """One collective at one size (nccl-tests' definitions)."""

    kind: str
    world: int
    bytes: int
    seconds: float
    """the slowest rank's mean time per call."""

    @property
    def algbw(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def busbw(self) -> float:
        return self.algbw * (self.world - 1) / self.world


@dataclass(frozen=True)
class Volume:
    """Collectives per training step, measured from the traces and analytic."""

    run: str
    kind: str
    measured_count: float
    measured_bytes: float
    analytic_count: int
    analytic_bytes: int


@dataclass(frozen=True)
class StepTime:
    run: str
    step_ms: float
    ratio: float
    """to FSDP2's."""
    comm_share: float
    hidden_share: float
    ag_hidden: float
    rs_hidden: float


@dataclass(frozen=True)
class Reshard:
    """One run with reshard_after_forward True or False."""

    run: str
    reshard_after_forward: bool
    all_gathers: float
    all_gather_bytes: float
    analytic_all_gathers: int
    peak: int


@dataclass(frozen=True)
class Weak:
    world: int
    run: str
    n_layers: int
    step_ms: float
    tokens_per_s_per_rank: float


@dataclass(frozen=True)
class Timeline:
    """Rank 0's memory sampled every millisecond, with each step's phase ranges."""

    samples: list[tuple[float, int]]
    """(seconds, bytes above the baseline)."""
    phases: list[tuple[float, float, str]]
    """(start, end, forward / backward / optimizer)."""
    peaks: list[int]


@dataclass(frozen=True)
class LinkVolume:
    """HSDP section: one collective on one link (a rank's shard group or its replicate group) per step,
    per rank, measured (the collectives' tensors, mean over steps and ranks) and analytic."""

    run: str
    replicate: int
    """1: FSDP over every rank (a 1-D mesh); R: HSDP, R replicas of world/R shards."""
    link: str
    """memory_model.SHARD_LINK or REPLICATE_LINK (a group that is neither: its ranks)."""
    group_size: int
    kind: str
    measured_count: float
    measured_bytes: float
    """the tensor each rank puts in (all-gather: its shard; reduce-scatter: its full gradient buffer;
    all-reduce: its reduced shard), summed over the step."""
    analytic_count: int
    analytic_bytes: int
    closed_form: float
    """sent per rank from the parameter count alone (memory_model.closed_form_sent)."""

    @property
    def sent(self) -> float:
        """bytes this rank sends, ring algorithms (memory_model.sent_bytes), from the measured tensors."""
        return sent_bytes(self.kind, self.group_size, self.measured_bytes)

    @property
    def analytic_sent(self) -> float:
        return sent_bytes(self.kind, self.group_size, self.analytic_bytes)


@dataclass(frozen=True)
class MeshTime:
    """HSDP section: one run's step time on its mesh."""

    run: str
    replicate: int
    step_ms: float
    ratio: float
    """to the same FSDP's step on the 1-D mesh (replicate 1)."""


@dataclass(frozen=True)
class Environment:
    python: str
    torch: str
    torchtitan: str
    os: str
    cpu: str
    cores: int | None
    gpus: list[str]


@dataclass
class Report:
    command: str
    impl: str
    device: str
    plan: Plan
    n_params: int
    environment: Environment
    memory: list[MemoryRow] = field(default_factory=list)
    comm_bench: list[CommBench] = field(default_factory=list)
    comm_volume: list[Volume] = field(default_factory=list)
    step_time: list[StepTime] = field(default_factory=list)
    reshard: list[Reshard] = field(default_factory=list)
    weak: list[Weak] = field(default_factory=list)
    losses: dict[str, list[float]] = field(default_factory=dict)
    """run -> loss per step, W=2."""
    hsdp_volume: list[LinkVolume] = field(default_factory=list)
    hsdp_time: list[MeshTime] = field(default_factory=list)
    hsdp_losses: dict[str, list[float]] = field(default_factory=dict)
    """"run replicate" (e.g. "effdl 2") -> loss per step, at the HSDP section's world size."""
    timeline: Timeline | None = None


# --------------------------------------------------------------------------- checks


def check(report: Report) -> list[str]:
    """What must hold in every report, whatever the machine's load: facts, not timings. Each
    problem says what differs."""
    problems = []
    for row in report.comm_volume:
        if row.measured_count != row.analytic_count or row.measured_bytes != row.analytic_bytes:
            problems.append(f"{row.run} {row.kind}: measured {row.measured_count:g} collectives, "
                            f"{row.measured_bytes:,.0f} B per step; analytic {row.analytic_count}, "
                            f"{row.analytic_bytes:,} B")
    for row in report.hsdp_volume:
        if row.measured_count != row.analytic_count or row.measured_bytes != row.analytic_bytes:
            problems.append(f"HSDP {row.run} replicate={row.replicate} {row.kind} on the {row.link} group: measured "
                            f"{row.measured_count:g} collectives, {row.measured_bytes:,.0f} B per step per rank; "
                            f"analytic {row.analytic_count}, {row.analytic_bytes:,} B")
    for key, curve in report.hsdp_losses.items():
        run, replicate = key.split()
        if not all(math.isfinite(x) and x > 0 for x in curve):
            problems.append(f"HSDP replicate={replicate} {run}: non-finite or non-positive loss {curve}")
        elif run != "fsdp2" and curve != report.hsdp_losses.get(f"fsdp2 {replicate}"):
            problems.append(f"HSDP replicate={replicate} {run}: losses {curve} are not bit-identical to FSDP2's "
                            f"{report.hsdp_losses.get(f'fsdp2 {replicate}')}")
    for row in report.reshard:
        if row.all_gathers != row.analytic_all_gathers:
            problems.append(f"{row.run} reshard_after_forward={row.reshard_after_forward}: "
                            f"{row.all_gathers:g} all-gathers per step, analytic {row.analytic_all_gathers}")
    losses = report.losses
    for run, curve in losses.items():
        if not all(math.isfinite(x) and x > 0 for x in curve):
            problems.append(f"{run}: non-finite or non-positive loss {curve}")
        elif run != "fsdp2" and curve != losses["fsdp2"]:
            problems.append(f"{run}: losses {curve} are not bit-identical to FSDP2's {losses['fsdp2']}")
    for row in report.memory:
        where = f"memory W={row.world} {row.run}"
        if not row.measured > 0:
            problems.append(f"{where}: measured peak {row.measured} B")
        # Rank 0 holds chunk 0 of every parameter, the padded size, so the largest shard is the model's.
        for name in ("sharded_params", "grads", "optimizer_state"):
            measured, model = getattr(row.parts, name), getattr(row.model, name)
            if measured != model:
                problems.append(f"{where}: measured {label(name)} {measured:,} B on the largest rank, analytic {model:,} B")
        if row.rank_sums.params_numel != report.n_params:
            problems.append(f"{where}: the ranks' shards hold {row.rank_sums.params_numel:,} elements, the model has "
                            f"{report.n_params:,}")
        if not row.parts.gathered_params > 0 or not row.parts.activations > 0:
            problems.append(f"{where}: gathered params {row.parts.gathered_params} B, activations {row.parts.activations} B")
    return problems


def timing_warnings(report: Report) -> list[str]:
    """Timings that look surprising; printed and written, never failed on (a loaded machine can do this)."""
    hidden = {r.run: r.hidden_share for r in report.step_time}
    warnings = []
    if "noprefetch" in hidden and "effdl" in hidden and not hidden["noprefetch"] < hidden["effdl"]:
        warnings.append(f"hidden share without prefetch ({hidden['noprefetch']:.0%}) is not below with prefetch "
                        f"({hidden['effdl']:.0%}): a loaded machine, or set_prefetch(False) does not stop prefetching")
    return warnings


# --------------------------------------------------------------------------- report.json


def to_json(report: Report, checks: list[str], warnings: list[str]) -> dict:
    """The numbers, as report.json has them (the timeline's samples left out)."""
    return dict(
        command=report.command, impl=report.impl, device=report.device, plan=dataclasses.asdict(report.plan),
        n_params=report.n_params,
        memory=[dict(world=r.world, run=r.run, measured=r.measured, parts=labelled(r.parts),
                     rank_sums=labelled(r.rank_sums), model=labelled(r.model)) for r in report.memory],
        comm_bench=[dict(dataclasses.asdict(r), algbw=r.algbw, busbw=r.busbw) for r in report.comm_bench],
        comm_volume=[dataclasses.asdict(r) for r in report.comm_volume],
        step_time=[dataclasses.asdict(r) for r in report.step_time],
        reshard=[dataclasses.asdict(r) for r in report.reshard],
        weak=[dataclasses.asdict(r) for r in report.weak],
        hsdp_volume=[dict(dataclasses.asdict(r), sent=r.sent, analytic_sent=r.analytic_sent) for r in report.hsdp_volume],
        hsdp_time=[dataclasses.asdict(r) for r in report.hsdp_time], hsdp_losses=report.hsdp_losses,
        losses=report.losses, checks=checks, warnings=warnings,
    )

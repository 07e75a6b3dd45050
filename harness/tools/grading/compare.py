"""Comparisons of effdl's run (the FSDP under test) with FSDP2's: each raises AssertionError saying exactly what
differs, where, and by how much (numbers, parameter shards, collectives)."""

from __future__ import annotations

from typing import Callable

import torch

import train
from harness.tools.grading.jobs import Run


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How many elements differ, the max abs difference and the max distance in ulps."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"FSDP2's is {a.dtype} {tuple(a.shape)}, effdl's {b.dtype} {tuple(b.shape)}"
    differ = a.reshape(-1) != b.reshape(-1)
    x, y = a.reshape(-1)[differ], b.reshape(-1)[differ]
    if not x.numel():
        return "equal when measured again (is the run deterministic?)"
    text = f"{x.numel()} of {a.numel()} elements differ, max abs {(x.double() - y.double()).abs().max().item():.3g}"
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(a.dtype)
    if bits is not None:
        def ordered(t):  # sign-magnitude bit patterns onto a line where neighbouring floats differ by 1
            i = t.view(bits).long()
            return torch.where(i < 0, -(i & (2 ** (torch.iinfo(bits).bits - 1) - 1)), i)
        text += f", max {(ordered(x) - ordered(y)).abs().max().item()} ulps of {str(a.dtype).removeprefix('torch.')}"
    return text


def ulps(a: float, b: float) -> str:
    """How far apart two float32 values are, in units in the last place."""
    x, y = torch.tensor([a, b], dtype=torch.float32).view(torch.int32).tolist()
    return f"{abs(x - y)} ulp{'s' if abs(x - y) != 1 else ''} of float32 apart"


def assert_same_numbers(ref: train.TrainResult, got: train.TrainResult, what: str) -> None:
    __tracebackhide__ = True
    for metric, label in (("losses", "loss"), ("grad_norms", "grad norm")):
        a, b = getattr(ref, metric), getattr(got, metric)
        if len(a) != len(b):
            raise AssertionError(f"{what}: FSDP2 ran {len(a)} steps, effdl {len(b)}")
        for step, (x, y) in enumerate(zip(a, b), start=1):
            if x != y:
                raise AssertionError(
                    f"{what}: {label} differs at step {step}: FSDP2 {x!r}, "
                    f"effdl {y!r}, {ulps(x, y)} (steps before it were equal: {step - 1}). Bitwise equality "
                    "needs FSDP2's padding, casts and ReduceOp.AVG inside the reduce-scatter."
                )


def assert_same_parameters(ref: list[list[dict]], got: list[list[dict]], what: str,
                           measure: Callable[[int, int, str], str] | None = None) -> None:
    """Every rank's shard of every parameter (digests), after wrapping and after every step.
    `measure(rank, step, name)`, if given, says by how much the first difference differs."""
    __tracebackhide__ = True
    for rank, (ref_steps, got_steps) in enumerate(zip(ref, got)):
        for step, (a, b) in enumerate(zip(ref_steps, got_steps)):
            for name in a:
                if a[name] != b.get(name):
                    when = "after wrapping" if step == 0 else f"after step {step}"
                    size = measure(rank, step, name) if measure is not None and name in b else ""
                    raise AssertionError(
                        f"{what}: rank {rank}'s shard of {name} differs from FSDP2's {when}{size} (the "
                        "optimizer saw different gradients, even if losses and grad norms agree)")


def assert_same_comm(ref: list[Run], got: list[Run], phase: str, what: str, by_group: bool = False) -> str:
    """Per phase, every collective (kind, dtype and bytes of each: jobs.CommLog) equal FSDP2's, a kind
    FSDP2 does not issue named first; by_group (HSDP): also each one's process group. At world size 1 (one Run)
    nothing is compared: FSDP2 exchanges nothing with itself, and an effdl that still issues
    its collectives there does no harm."""
    __tracebackhide__ = True
    if len(ref) == 1:
        return f"{phase}: world size 1, no collectives compared"
    def show(sent: dict) -> str:
        return ", ".join(f"{n} x {k[0].replace('_', '-')}{f' over ranks {k[1]}' if by_group else ''} {k[-2]} {k[-1]:,} B"
                         for k, n in sorted(sent.items(), key=str)) or "nothing"

    for rank, (a, b) in enumerate(zip(ref, got)):
        sa, sb = (a.comm.sent_by_group(phase), b.comm.sent_by_group(phase)) if by_group else \
            (a.comm.sent(phase), b.comm.sent(phase))
        if by_group and sa != sb and {(k[0], k[1]) for k in sa} != {(k[0], k[1]) for k in sb}:
            raise AssertionError(
                f"{what}: rank {rank}'s {phase} collectives differ from FSDP2's in kind or process group: "
                f"effdl sent {show(sb)}; FSDP2 sent {show(sa)}. HSDP: all-gathers and reduce-scatters "
                "within the shard group (mesh dim 1), the all-reduce across the replicate group (mesh dim 0) (H12)")
        if extra := sorted({k[0] for k in sb} - {k[0] for k in sa}):
            raise AssertionError(
                f"{what}: rank {rank} issues collectives FSDP2 does not in {phase} "
                f"({', '.join(k.replace('_', '-') for k in extra)}): effdl sent {show(sb)}; FSDP2 sent {show(sa)}. "
                "An FSDP moves parameters and gradients with all-gathers and reduce-scatters only (and HSDP's "
                "all-reduce across replicas)")
        if sa != sb:
            wrong_dtype = {k[-2] for k in sb} - {k[-2] for k in sa}
            hint = (f" The wire carries {', '.join(sorted(wrong_dtype))} where FSDP2 sends "
                    f"{', '.join(sorted({k[-2] for k in sa}))}: cast before the all-gather (H6) and reduce "
                    "in the reduce dtype (H8)." if wrong_dtype else
                    " One collective per group and phase, each the group's padded shards (H1, H5).")
            raise AssertionError(f"{what}: rank {rank}'s {phase} collectives differ from FSDP2's: effdl "
                                 f"sent {show(sb)}; FSDP2 sent {show(sa)}.{hint}")
    sent = ref[0].comm.sent_by_group(phase) if by_group else ref[0].comm.sent(phase)
    total = sum(n * k[-1] for k, n in sent.items())
    return f"{phase}: {sum(sent.values())} collectives, {total / 2**20:.1f} MiB as FSDP2"


def fmt(counts: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in counts.items()) + "}" if counts else "none"

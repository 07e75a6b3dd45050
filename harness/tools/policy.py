"""Grading policy: the runs the checks make and the rules they apply.

The precision cases, the small training run every check compares (`config`), what each bonus mode
promises about the collectives of a step (`MODES`), and which collectives must overlap compute
(`OVERLAP`). The checks (checks.py) apply these; the rank jobs (jobs.py) measure; the comparisons
(compare.py) say what differs. A grader tuning the course changes this file.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import train

if TYPE_CHECKING:
    from harness.tools.collectives import StepStats


PRECISIONS = [(p, r) for p in ("float32", "bfloat16") for r in ("float32", "bfloat16")]

# train.py's default (no mixed precision) and a reduce dtype left to FSDP2's clamping.
UNSET_PRECISIONS = [("none", "none"), ("bfloat16", "none")]


def config(impl: str | None = None, **overrides) -> train.Config:
    """A small, fast run: debug model, 4 steps of 2 micro-steps, no profiling."""
    base = dict(model="debug", num_steps=4, seq_len=64, batch_size=2, num_gradient_accumulation_steps=2,
                profile_steps=0, log=False)
    if impl is not None:
        base.update(fsdp="effdl", impl=impl)
    return train.Config(**{**base, **overrides})


def as_fsdp2(cfg: train.Config) -> train.Config:
    """The same run under PyTorch's FSDP2."""
    return dataclasses.replace(cfg, fsdp="fsdp2", impl="student")


def mode_flags(modes: list[str]) -> dict:
    """train.py flags of one or more bonus modes."""
    return {k: v for m in modes for k, v in MODES[m].flags.items()}


def describe(cfg: train.Config, world: int) -> str:
    return (f"world {world}, param_dtype={cfg.param_dtype}, reduce_dtype={cfg.reduce_dtype}, "
            f"{cfg.num_gradient_accumulation_steps} micro-steps")


# Overlap is judged by schedule, not by time: a collective is overlapped when the main thread ran
# compute of another group between issuing it and waiting for it (analysis.schedule), which is
# the same on every run of a program however busy the machine. Time fractions (how much of the
# collectives' time compute ran) depend on thread scheduling (under load the reference's fell
# from 30-58 % to 7 %) and are only shown as evidence. FSDP2 on CPU waits for each right away.
OVERLAP = {
    "forward": [("all_gather", "forward", "task 2: start the next group's all-gather asynchronously "
                 "in pre-forward and wait for it only when that group runs")],
    "backward": [("all_gather", "backward", "task 3: in pre-backward start gathering the group that "
                  "runs backward next, before this group computes"),
                 ("reduce_scatter", "backward", "task 3: leave each reduce-scatter in flight while the "
                  "next group runs its backward")],
}


@dataclasses.dataclass(frozen=True)
class Mode:
    """A bonus mode: train.py flags, and what it promises about the collectives of a step."""

    name: str
    flags: dict
    promise: str
    holds: "Callable[[StepStats, int], bool]"
    """(mean counts per step, number of groups) -> whether the promise holds."""


def _count(stats, kind: str, phase: str) -> float:
    return stats.kind(kind).by_phase[phase].count


MODES = {
    "bonus1": Mode("bonus 1 (reshard_after_forward=False)", dict(reshard_after_forward=False),
                   "no all-gather in backward",
                   lambda s, groups: _count(s, "all_gather", "backward") == 0),
    "bonus2": Mode("bonus 2 (set_reshard_after_backward(False) before the last micro-step)",
                   dict(reshard_after_backward_before_last_backward=False),
                   "all-gathers in forward only in the first micro-step (one per group)",
                   lambda s, groups: _count(s, "all_gather", "forward") == groups),
    "bonus3": Mode("bonus 3 (set_requires_gradient_sync(False) before the last micro-step)",
                   dict(reduce_grads_before_last_backward=False),
                   "reduce-scatters only in the last backward (one per group)",
                   lambda s, groups: _count(s, "reduce_scatter", "backward") == groups),
}

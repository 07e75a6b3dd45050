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
    from harness.tools.traces.collectives import StepStats


PRECISIONS = [(p, r) for p in ("float32", "bfloat16") for r in ("float32", "bfloat16")]

# train.py's default (no mixed precision) and a reduce dtype left to FSDP2's clamping.
UNSET_PRECISIONS = [("none", "none"), ("bfloat16", "none")]


# Tasks 2 and 3's profiled runs: 3 steps, the last 2 profiled (train.py profiles the last profile_steps).
PROFILED = dict(num_steps=3, profile_steps=2)


def profiled_steps(cfg: train.Config) -> tuple[int, ...]:
    """The steps a profiled run of `cfg` profiles (its last `profile_steps`), where its overlap is judged: the
    memory checks judge peaks on the same steps, so that no judged step is one only a memory run has (a
    program counts its steps: lean only from a step the profiled run never reaches, it would pass both)."""
    return tuple(range(cfg.num_steps - cfg.profile_steps + 1, cfg.num_steps + 1))


def config(impl: str | None = None, **overrides) -> train.Config:
    """A small, fast run: debug model, 4 steps of 2 micro-steps, no profiling."""
    base = dict(model="debug", num_steps=4, seq_len=64, batch_size=2, num_gradient_accumulation_steps=2,
                profile_steps=0, log=False)
    if impl is not None:
        base.update(fsdp="effdl", impl=impl)
    return train.Config(**{**base, **overrides})


# Bonus 4 (HSDP) runs on 4 ranks: a 2-block, dim-64 Llama on 32-token sequences, 2 steps of 2 micro-steps
# (3 in the memory check, which compares steps 2 and 3), so that its cases stay quick on 2 cores: a CPU
# without bfloat16 instructions multiplies bfloat16 matrices tens of times slower than float32 ones, and
# the debug model's width made each bfloat16 case 11 s. What HSDP adds (the placements, the groups, the
# replica all-reduce) does not depend on the width.
HSDP = dict(n_layers=2, dim=64, n_heads=4, seq_len=32, num_steps=2)
HSDP_MEMORY_STEPS = 3


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
IN_FLIGHT = 1
"""collectives of one kind and pass in flight at once (issued, not yet waited for): FSDP2 waits for a group's own
all-gather, then starts the next group's, and waits for the previous group's reduce-scatter before issuing the next"""
AHEAD = 1
"""groups an all-gather may run ahead of the groups computing (schedule.most_ahead): FSDP2 gathers a group as it
starts, then the next; wherever a program waits, gathering further ahead holds more groups' parameters"""

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


# What is compared: per rank, the least over the judged steps of each step's peak: those whose overlap the
# matching profiled run judges (profiled_steps), never step 1 (it also pays one-time allocations: the
# optimizer's state). On CPU that is tensor memory, the bytes c10's allocator held
# (memory.TensorPeaks), the same measure on every platform, so a file gets the same verdict on a
# student's Mac as on the grader's Linux. (The peak resident set with --exact-cpu-memory, which this
# check used before, exists on Linux only, varies between runs, and also sees what no
# FSDP decides: malloc's overhead, gloo's transport buffers, Python objects; train.py still logs it.)
# A step's peak is what the schedule holds at its fullest plus, in some steps, a buffer that gloo's
# worker thread is still releasing (a finished collective's buffers are freed by whichever thread
# drops the work last, and the main thread does not wait for gloo's): the least over steps leaves
# those out and keeps whatever the FSDP holds in every step; each judged step on its own may hold one late buffer
# more than that (so a file cannot hold a whole model in one judged step and stay lean in another). effdl may
# exceed FSDP2 by:
#   * what overlapping costs on gloo: gloo copies a reduce-scatter's input when it is issued and
#     keeps the copy while it runs, i.e. during the next block's backward (FSDP2 on CPU waits at
#     once): one block's reduce-scatter input;
#   * LATE_BUFFERS collective buffers still on their way out in every step compared (at most one
#     block in the larger of the parameter and reduce dtypes each).
# FSDP2's peak is one number per configuration, run after run; single steps exceed it only by whole
# late buffers. The allowance covers the reference's spread above FSDP2 in every precision case and
# bonus mode, while keeping every block gathered from forward to backward (the
# `no-reshard-after-forward` mutant) exceeds it and fails (the instructors' mutant tests).
LATE_BUFFERS = 1
# Leaks: the bytes of Python-visible tensors are the same at the end of every step from step 2 on,
# which finds a list or attribute that keeps tensors; the bytes the allocator holds at the end of each
# step also see tensors only C++ keeps (an autograd graph, a collective's work). Both stay equal from
# step to step for FSDP2 and the reference, except that the latter may grow by a late buffer
# (LATE_BUFFERS), so only growth beyond it counts.

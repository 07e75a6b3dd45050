"""The checks behind test.py, as plain functions over one world size's ranks (ranks.Ranks).

Each `check_*` runs FSDP2 and effdl, the FSDP under test (`impl`: student or a .py path) on one world
size's spawned ranks (ranks.Ranks: FSDP2 on the trusted pool, the file under test on the sandboxed
one, whose results come back as data; the rank jobs: jobs.py; FSDP2's side from fsdp2_cache when
the same run was made before: `run_fsdp2`), compares what they did (compare.py) by the
course's rules (policy.py), and raises AssertionError saying exactly what differs. Every check
has been run against deliberately broken variants of a correct FSDP and fails there
(the instructors' mutant tests).
"""

from __future__ import annotations

import dataclasses

import torch

import train
from harness.memory_model import group_of
from harness.tools.grading import fsdp2_cache, handwritten
from harness.tools.traces.analysis import RunStats, analyze_run
from harness.tools.traces.schedule import drawn_mark, most_ahead, most_in_flight
from harness.tools.grading.compare import (assert_same_comm, assert_same_numbers, assert_same_parameters, fmt,
                                   tensor_difference, ulps)
from harness.tools.grading.jobs import Run, block_bytes, forward_job, memory_job, odd_shapes_job, shard_job, train_job
from harness.tools.grading.policy import (AHEAD, HSDP, HSDP_MEMORY_STEPS, IN_FLIGHT, LATE_BUFFERS, MODES, OVERLAP,
                                          PRECISIONS, PROFILED, as_fsdp2, config, describe, mode_flags,
                                          profiled_steps)
from harness.tools.grading.ranks import RankError, RankPool, Ranks


# --------------------------------------------------------------------------- running both

# FSDP2 runs on trusted ranks: its compute mark needs no secret, and a fixed one keeps its runs storable.
FSDP2_MARK = "## model compute ##"


def run(pool: Ranks | RankPool, fn, *args):
    """pool.run (on Ranks: the sandboxed pool for a job of the file under test, the trusted one for
    FSDP2's), with a check that failed on the ranks raised here as an AssertionError."""
    __tracebackhide__ = True  # the student's line is in the ranks' traceback, not here
    cfg = next((a for a in args if isinstance(a, train.Config)), None)
    where = f"[{describe(cfg, pool.world_size)}, {cfg.fsdp}] " if cfg else ""
    try:
        return pool.run(fn, *args, timeout=300)
    except RankError as e:
        if "AssertionError: " in str(e) and "hung" not in str(e):
            raise AssertionError(where + str(e)) from None
        raise type(e)(where + str(e)) from None


def run_fsdp2(pool: Ranks, job, *args, fresh: bool = False, analysed: bool = False, mark: str | None = None):
    """FSDP2's side of a comparison, `run(pool, job, *args)` (fresh: on fresh ranks like the pool's),
    or what the same run gave before (fsdp2_cache, keyed by everything it depends on). A profiled
    run's traces (and snapshots) are written to its folders either way; analysed: (the runs, the
    traces' RunStats), stored together, so a stored run's traces are not analysed again; mark: the name of
    the ranges the job put around the model's compute (schedule.marked_compute), for the analysis."""
    __tracebackhide__ = True

    def compute(fresh: bool = fresh):
        if not fresh:
            runs = run(pool.trusted, job, *args)
        else:
            with RankPool(pool.world_size, device=pool.device, role="trusted") as ranks:
                runs = run(ranks, job, *args)
        return (runs, analyze_run(cfg.traces_dir, mark=mark)) if analysed else runs

    cfg = next((a for a in args if isinstance(a, train.Config)), None)
    if pool.device != "cpu" or (cfg and ((cfg.profile_steps and (cfg.traces_dir is None or (
            cfg.profile_memory and cfg.snapshots_dir is None))) or cfg.checkpoint_dir is not None)):
        return compute()  # CPU runs only (see fsdp2_cache), and outputs only into folders named here
    outputs = {"traces": cfg.traces_dir, "snapshots": cfg.snapshots_dir} if cfg and cfg.profile_steps else {}
    kind = job.__name__.removesuffix("_job").replace("_", "-") + ("-fresh" if fresh else "") + \
        ("-analysed" if analysed else "")
    parts = fsdp2_cache.case(job, args, pool.world_size, pool.device, pool.threads)
    # What is stored serves every later submission: it is computed on trusted ranks, which never import
    # a file under test (ranks.RankPool's roles).
    return fsdp2_cache.get(kind, parts, compute, outputs)


def run_graded(pool: Ranks, job, cfg: train.Config) -> tuple[list[Run], list[Run]]:
    """FSDP2's and effdl's runs of `job`; fails at once if the latter is FSDP2."""
    __tracebackhide__ = True
    ref = run_fsdp2(pool, job, as_fsdp2(cfg))
    got = run(pool, job, cfg)
    for rank, r in enumerate(got):
        if r.uses_fsdp2:
            raise AssertionError(f"{cfg.impl}: {handwritten.verdict(r.uses_fsdp2)} [rank {rank}]")
    return ref, got


def measure_shard(pool: Ranks, cfg: train.Config):
    """For assert_same_parameters: train both again up to the step where a shard first differs and
    say by how much (the runs are deterministic: the same bits again)."""
    def measure(rank: int, step: int, name: str) -> str:
        try:
            x = run(pool, shard_job, as_fsdp2(cfg), step, name)[rank]
            y = run(pool, shard_job, cfg, step, name)[rank]
            return f": {tensor_difference(x, y)}"
        except (AssertionError, RankError) as e:
            return f" (could not measure by how much: {str(e).splitlines()[0][:200]})"
    return measure


# --------------------------------------------------------------------------- task 1


def assert_no_problems(runs: list, what: str) -> None:
    """The first rank whose run found problems (the collective log's, the probes'), up to three of them."""
    __tracebackhide__ = True
    for rank, r in enumerate(runs):
        if r.problems:
            raise AssertionError(f"{what}: rank {rank}: " + "; ".join(r.problems[:3]))


def check_forward(pool: Ranks, impl: str, param_dtype: str, reduce_dtype: str) -> str:
    """Task 1, forward: the first forward's loss bit-identical to FSDP2's on every rank, parameters
    Shard(0) DTensors before and the blocks' after, each block's gathered parameters holding data this
    forward's all-gathers brought (jobs.Probes.brought) and freed after its forward, and the forward's
    all-gathers (dtype, bytes) FSDP2's. Returns the evidence."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    what = describe(cfg, pool.world_size) + ", first forward"
    ref, got = run_graded(pool, forward_job, cfg)
    assert_no_problems(got, what)
    for rank, (a, b) in enumerate(zip(ref, got)):
        if a.forward_loss != b.forward_loss:
            raise AssertionError(f"{what}: rank {rank}'s loss is {b.forward_loss!r}, FSDP2's {a.forward_loss!r} "
                                 f"({ulps(a.forward_loss, b.forward_loss)}): the gathered parameters differ "
                                 "from FSDP2's (rows, padding, casts: H1, H6)")
    return assert_same_comm(ref, got, "forward", what)


def check_step(pool: Ranks, impl: str, param_dtype: str, reduce_dtype: str, **overrides) -> str:
    """Task 1, step: every loss, grad norm and shard bit-identical to FSDP2's; gathered parameters
    and full gradients freed by the end of each step; every collective's dtype and bytes FSDP2's."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    what = describe(cfg, pool.world_size)
    got, evidence = compare_step(pool, cfg, what)
    return f"{len(got[0].result.losses)} steps bit-identical; " + "; ".join(evidence)


def compare_step(pool: Ranks, cfg, what: str) -> tuple[list, list[str]]:
    """The graded run of `cfg` and FSDP2's: no rank's problems, every loss, grad norm and shard
    bit-identical, every collective FSDP2's (by process group on a 2-D mesh). effdl's
    runs, and the evidence of each phase's collectives."""
    __tracebackhide__ = True
    ref, got = run_graded(pool, train_job, cfg)
    assert_no_problems(got, what)
    assert_same_numbers(ref[0].result, got[0].result, what)
    assert_same_parameters([r.digests for r in ref], [r.digests for r in got], what, measure_shard(pool, cfg))
    return got, [assert_same_comm(ref, got, phase, what, by_group=cfg.replicate > 1) for phase in ("forward", "backward")]


def check_odd_shapes(pool: Ranks, impl: str) -> str:
    """Rows that do not divide by the world size, and empty shards: every parameter and gradient,
    after every step, equal to FSDP2's. Returns the evidence."""
    __tracebackhide__ = True
    ref = run_fsdp2(pool, odd_shapes_job, None)[0]
    got = run(pool, odd_shapes_job, impl)[0]
    for name, values in ref.items():
        if name not in got:
            raise AssertionError(f"odd shapes, world {pool.world_size}: {name.removesuffix('.grad')} has no "
                                 f"{'gradient' if name.endswith('.grad') else 'value'} in effdl's run")
        for step, (a, b) in enumerate(zip(values, got[name]), start=1):
            if not torch.equal(a, b):
                raise AssertionError(f"odd shapes, world {pool.world_size}: {name} differs from FSDP2's "
                                     f"at step {step} (max abs diff {(a - b).abs().max().item():.3g}); "
                                     "check padding of shards that torch.chunk leaves short or empty")
    return f"odd shapes: {len(ref)} parameters and gradients equal over {len(next(iter(ref.values())))} steps"


# --------------------------------------------------------------------------- memory (task 3, bonuses)


# Called as memory_seen(case, runs, judged) with each memory check's runs ({"FSDP2": [...], "effdl": [...]},
# jobs.Memory per rank) and the steps it compares, before it judges them: `pytest --artifacts` records the
# peaks (conftest.py).
memory_seen = None


def allowance(m) -> int:
    """The bytes effdl's peak per step may exceed FSDP2's: one block's reduce-scatter
    input and one collective's buffer freed late (jobs.Memory's block sizes)."""
    return m.block_reduce + LATE_BUFFERS * m.block_largest


def check_memory(pool: Ranks, impl: str, param_dtype: str, reduce_dtype: str, judged: tuple[int, ...] | None = None,
                 **overrides) -> str:
    """Peak memory per step (tensor memory on CPU) within one reduce-scatter input and a late buffer of
    FSDP2's, the least over the `judged` steps (the steps whose overlap the matching profiled run judges; by
    default tasks 2 and 3's), and no growth over every step.

    Each run gets fresh ranks forked from the same preloaded image, so absolute numbers compare
    (in a long-lived process, what earlier jobs left behind shifts them); FSDP2's, measured so once,
    comes from fsdp2_cache while its key holds."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, **overrides)
    judged = judged or profiled_steps(config(**PROFILED))
    if max(judged) > cfg.num_steps or min(judged) < 2:
        raise ValueError(f"judged steps {judged}: from step 2 (step 1 creates the optimizer's state) to {cfg.num_steps}")
    what = describe(cfg, pool.world_size)
    runs = {"FSDP2": run_fsdp2(pool, memory_job, as_fsdp2(cfg), fresh=True)}
    with RankPool(pool.world_size, device=pool.device, role="sandboxed") as fresh:
        runs["effdl"] = run(fresh, memory_job, cfg)
    if memory_seen is not None:
        memory_seen(what + "".join(f", {k}={v}" for k, v in overrides.items()), runs, judged)
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    worst, margin = -float("inf"), 0
    for rank, (ref, got) in enumerate(zip(runs["FSDP2"], runs["effdl"])):
        if any(n != got.live[1] for n in got.live[1:]):  # step 1 may still create state (the optimizer's)
            raise AssertionError(f"{what}: rank {rank} holds {', '.join(mib(n) for n in got.live)} of tensors at the "
                                 f"end of steps 1 to {len(got.live)} (each distinct storage a Python-visible tensor "
                                 "holds): something leaks every step (a list or attribute that keeps tensors)")
        late = LATE_BUFFERS * got.block_largest
        if (growth := got.held[-1] - got.held[1]) > late:
            raise AssertionError(f"{what}: rank {rank} holds {mib(growth)} more tensor memory at the end of step "
                                 f"{len(got.held)} than at the end of step 2 ({', '.join(mib(x) for x in got.held)}): "
                                 "something leaks every step (tensors kept by a collective's work, an autograd "
                                 "graph or a buffer that is never freed)")
        margin = allowance(got)
        worst = max(worst, _assert_peak(
            f"{what}: rank {rank}", [ref.peaks[step - 1] for step in judged], [got.peaks[step - 1] for step in judged],
            margin, late, judged, f"the least of steps {', '.join(map(str, judged))}, the steps whose overlap is judged",
            "gathered parameters", f"Per step: effdl {', '.join(mib(x) for x in got.peaks)}; FSDP2 "
            f"{', '.join(mib(x) for x in ref.peaks)}"))
    return f"peak {worst / 2**20:+.1f} MiB over FSDP2 (allowed +{margin / 2**20:.1f})"


def _assert_peak(who: str, ref: list[int], got: list[int], margin: int, late: int, steps: tuple[int, ...],
                 judged: str, kept: str, shown: str) -> int:
    """effdl's least peak of the judged steps (`got`, of `steps`) at most FSDP2's (`ref`) plus `margin`, and each
    judged step's at most FSDP2's plus `margin` and one more late buffer (`late`: a step may hold one more than the
    leanest, whose buffer gloo's thread is still releasing; never a group more in one step, lean in another);
    returns the least excess. The message: `who` (the case and rank), which steps (`judged`), what is typically kept
    (`kept`), the peaks."""
    __tracebackhide__ = True
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    steady_ref, steady = min(ref), min(got)
    if steady > steady_ref + margin:
        raise AssertionError(
            f"{who}'s peak memory per step is {mib(steady)}, FSDP2's {mib(steady_ref)} (+{mib(steady - steady_ref)}, "
            f"allowed {mib(margin)}: one block's reduce-scatter input and one collective's buffer freed late; "
            f"{judged}; tensor memory): something is kept longer than FSDP2 keeps it ({kept}, gradients, "
            f"communication buffers). {shown}")
    for step, r, g in zip(steps, ref, got):
        if g > r + margin + late:
            raise AssertionError(
                f"{who}'s peak memory in step {step} is {mib(g)}, FSDP2's {mib(r)} (+{mib(g - r)}, allowed in any judged "
                f"step {mib(margin + late)}: the allowance and one more buffer freed late; tensor memory): something "
                f"is kept in that step longer than FSDP2 keeps it ({kept}), however lean another step is. {shown}")
    return steady - steady_ref


# --------------------------------------------------------------------------- overlap (tasks 2, 3) and the bonuses


@dataclasses.dataclass
class Profiles:
    """One profiled run of FSDP2 and of effdl, analysed."""

    what: str
    fsdp2: RunStats
    effdl: RunStats
    cfg: train.Config | None = None
    """effdl's configuration (FSDP2's the same otherwise)"""
    world_size: int = 0


def assert_profiled_memory(p: Profiles) -> str:
    """The peak memory per step of the profiled run itself (its trace's allocation events: run_profiled with
    memory=True) within task 3's allowance of FSDP2's, the least of its profiled steps: the run whose overlap
    is judged is the one whose memory is judged, so no schedule passes by being lean only where memory is
    measured (a program that times its own ops could tell a memory run from a profiled one) and prefetching
    every group at once where overlap is."""
    __tracebackhide__ = True
    steps = profiled_steps(p.cfg)
    for who, stats in (("FSDP2", p.fsdp2), ("effdl", p.effdl)):
        fail = AssertionError if who == "effdl" else RuntimeError
        if stats.peaks_problem:
            raise fail(f"{p.what}: {who}'s profiled run's tensor memory cannot be read: {stats.peaks_problem}")
        if len(stats.peaks) != p.world_size or any(len(peaks) != len(steps) for peaks in stats.peaks):
            raise fail(f"{p.what}: {who}'s profiled run shows tensor memory for {len(stats.peaks)} ranks, steps per "
                       f"rank {[len(x) for x in stats.peaks]}; expected {p.world_size} ranks of {len(steps)} profiled "
                       "steps (a trace with allocation events from each rank)")
    block_reduce, block_largest = block_bytes(p.cfg, p.world_size)
    margin = block_reduce + LATE_BUFFERS * block_largest
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    worst = max(_assert_peak(
        f"{p.what}, profiled: rank {rank}", ref, got, margin, LATE_BUFFERS * block_largest, tuple(steps),
        f"the least of the profiled steps {', '.join(map(str, steps))}, in the run whose overlap is judged",
        "gathered parameters prefetched more than one group ahead",
        f"Per profiled step: effdl {', '.join(mib(x) for x in got)}; FSDP2 {', '.join(mib(x) for x in ref)}")
        for rank, (ref, got) in enumerate(zip(p.fsdp2.peaks, p.effdl.peaks)))
    return f"profiled peak {worst / 2**20:+.1f} MiB over FSDP2 (allowed +{margin / 2**20:.1f})"


def profile_both(pool: Ranks, impl: str, folder, memory: bool = False, **overrides) -> Profiles:
    __tracebackhide__ = True
    cfg = config(impl, **{**PROFILED, **overrides})
    return run_profiled(pool, cfg, folder, describe(cfg, pool.world_size), memory=memory)[0]


def run_profiled(pool: Ranks, cfg_effdl: train.Config, folder, what: str, memory: bool = False):
    """Profiled runs of FSDP2 and effdl (same config otherwise): their analysed
    traces under folder/<fsdp2|effdl>/traces, and per implementation each rank's Run (train_job). The overlap checks
    read the schedule and the collectives only, so by default there are no allocation events and no snapshots
    (memory=True: allocation events, counted on every thread, whose peaks assert_profiled_memory judges, and
    snapshots in folder/<...>/snapshots; FSDP2's run then on fresh ranks too, so absolute totals compare)."""
    __tracebackhide__ = True
    results, stats = {}, {}
    for name, cfg in (("fsdp2", as_fsdp2(cfg_effdl)), ("effdl", cfg_effdl)):
        cfg = dataclasses.replace(cfg, traces_dir=folder / name / "traces", profile_memory=memory,
                                  snapshots_dir=folder / name / "snapshots" if memory else None)
        # without Probes (the collective log alone: see train_job): the trace as the program runs. The model's
        # compute is marked under a name the file
        # under test cannot know (drawn here for each run), so it cannot mark its own ops as compute.
        if name == "fsdp2":
            results[name], stats[name] = run_fsdp2(pool, train_job, cfg, False, FSDP2_MARK, analysed=True,
                                                   mark=FSDP2_MARK, fresh=memory)
        else:
            mark = drawn_mark()
            # On fresh ranks, as the memory job runs: a program cannot tell the run its overlap is judged on from
            # the one its memory is by its own history (the first model it wraps in its process, say) and prefetch
            # everything in one and nothing in the other.
            with RankPool(pool.world_size, device=pool.device, role="sandboxed") as fresh:
                results[name] = run(fresh, train_job, cfg, False, mark)
            assert_no_problems(results[name], f"{what}, profiled")  # the collective log's, on in a profiled run too
            stats[name] = analyze_run(cfg.traces_dir, mark=mark)
    return Profiles(what, stats["fsdp2"], stats["effdl"], cfg_effdl, pool.world_size), results


def assert_same_collectives(p: Profiles, promise: str = "") -> None:
    """The same number of all-gathers and reduce-scatters as FSDP2, phase by phase, and the same
    collective ops as FSDP2's over the profiled steps (a decoy beside data sent another way differs)."""
    __tracebackhide__ = True
    if p.fsdp2.c10d_calls != p.effdl.c10d_calls:
        a, b = p.fsdp2.c10d_calls, p.effdl.c10d_calls
        diff = ", ".join(f"{k}: effdl {b.get(k, 0)}, FSDP2 {a.get(k, 0)}" for k in sorted(set(a) | set(b))
                         if a.get(k, 0) != b.get(k, 0))
        raise AssertionError(f"{p.what}: the profiled steps' collective ops differ from FSDP2's ({diff}): an FSDP "
                             "issues FSDP2's all-gathers and reduce-scatters through torch.distributed's "
                             "collectives, one per group and pass, and nothing else")
    for kind in ("all_gather", "reduce_scatter"):
        a, b = p.fsdp2.comm.kind(kind).count_by_phase, p.effdl.comm.kind(kind).count_by_phase
        if a != b:
            raise AssertionError(
                f"{p.what}: {kind.replace('_', '-')}s per step by phase: FSDP2 {fmt(a)}, effdl "
                f"{fmt(b)}{promise}. Expected one per group and micro-step where FSDP2 has one; an extra "
                "all-gather in backward often means the root was resharded after forward (FSDP2 keeps "
                "it gathered), a missing one a prefetch that was never waited for")


def first_difference(ref: list[list[str]], got: list[list[str]]) -> tuple | None:
    """Per rank, FSDP2's sequence and effdl's: where the first rank whose two differ first differs, as (rank, index,
    effdl's item, FSDP2's item ('none' past an end), (FSDP2's length, effdl's)); None if every rank's are equal."""
    for rank, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return rank, n, b[n] if n < len(b) else "none", a[n] if n < len(a) else "none", (len(a), len(b))
    return None


def issue_order(stats: RunStats, kind: str, phase: str) -> list[list[str]]:
    """Per rank, the groups whose collectives of this kind and phase were issued, in order (by their ranges)."""
    ranks: dict[int, list] = {}
    for s in sorted((s for s in stats.scheduled if (s.kind, s.phase) == (kind, phase)), key=lambda s: s.issued):
        ranks.setdefault(s.rank or 0, []).append(s.group)
    return [ranks[r] for r in sorted(ranks)]


def gathered_from(reads: list[tuple], phase: str) -> dict[tuple[str, int, int], tuple[int, set[tuple[str, str]]]]:
    """Of one rank's parameter reads in `phase`, per (leaf, step, pass of the step): how many the logs saw, and the
    (phase, pass) of the all-gathers their data came from. A read no log saw (of memory the program put in the
    parameters' place after the leaf's forward) is missing from its pass, however many passes read as FSDP2's."""
    out: dict[tuple[str, int, int], tuple[int, set[tuple[str, str]]]] = {}
    for step, ph, pass_no, leaf, sources in reads:
        if ph == phase:
            count, found = out.get((leaf, step, pass_no), (0, set()))
            out[leaf, step, pass_no] = count + 1, found | {(src_phase, relation) for _, src_phase, relation in sources}
    return out


def assert_parameters_gathered(p: Profiles, phase: str) -> None:
    """In `phase`, every parameter the model's compute read held data of its own group's all-gathers only (whatever
    the program named them: see jobs.py's [Note: where the model's parameters came from]), from the passes FSDP2's
    came from (the last block's kept aside from forward is not this pass's all-gather)."""
    __tracebackhide__ = True
    for rank, (ref, got) in enumerate(zip(p.fsdp2.reads, p.effdl.reads)):
        for step, ph, _, leaf, sources in got:
            if ph != phase:
                continue
            where = f"{p.what}: rank {rank}, step {step}, {phase}: {leaf}'s parameters, as the model read them,"
            if not sources or any(g == "" for g, _, _ in sources):
                raise AssertionError(
                    f"{where} held bytes that no all-gather brought (made or changed another way after it): a group's "
                    "parameters are what its own all-gather brought, read once its work handle's wait() returned (not "
                    "when synchronize() did, nor from a tensor swapped for its output before), copied out as they are "
                    "(copy_, or an op's out=; an op that writes part of a tensor, index_copy_ or index_put_, keeps what "
                    "the rest held; memory made by torch.empty or torch.tensor(values) holds no all-gather's data, but "
                    "as an index or a mask)")
            if others := [g for g, _, _ in sources if g != group_of(leaf)]:
                raise AssertionError(
                    f"{where} held data of the all-gather issued as " +
                    (f"{others[0]}'s" if others[0] is not None else
                     "no group's (outside the groups' ranges, or before the profiled steps)") +
                    f", not {group_of(leaf)}'s: each group's all-gather carries that group's parameters and no other's, "
                    "issued in its `FSDP::all_gather (name)` range")
        want, have = gathered_from(ref, phase), gathered_from(got, phase)
        for leaf, step, pass_no in sorted(set(want) | set(have)):
            (n_want, srcs_want), (n_have, srcs_have) = (
                found.get((leaf, step, pass_no), (0, set())) for found in (want, have))
            if (n_want, srcs_want) != (n_have, srcs_have):
                show = lambda n, found: (" and ".join(f"{ph}'s ({rel})" for ph, rel in sorted(found)) or "none") + \
                    f" in {n} read{'s' if n != 1 else ''}"  # noqa: E731
                raise AssertionError(
                    f"{p.what}: rank {rank}, step {step}, {phase} pass {pass_no + 1}: {leaf}'s parameters, as the model "
                    f"read them, held data of the all-gathers of {show(n_have, srcs_have)}; under FSDP2 of "
                    f"{show(n_want, srcs_want)}: a group computes with what its own all-gather of the pass brought, in "
                    "the parameters the model called it with (kept from an earlier pass, it is one more group held "
                    "gathered; memory put in their place after the leaf's forward holds no all-gather's data the log "
                    "sees)")


def assert_overlap(p: Profiles, which: str) -> str:
    """Every collective of the phase that FSDP's schedule can overlap (all but the first all-gather
    and the last reduce-scatter of a pass, see schedule.must_overlap) is issued before, and waited
    for after, compute of another group."""
    __tracebackhide__ = True
    assert_same_collectives(p)
    if differs := first_difference(p.fsdp2.model_order, p.effdl.model_order):
        rank, n, got, ref, lengths = differs
        raise AssertionError(
            f"{p.what}: rank {rank}: the model's leaves ran in another order than under FSDP2 (forward {n + 1} of the "
            f"profiled steps': {got}, under FSDP2 {ref}; {lengths[1]} forwards, under FSDP2 {lengths[0]}): an FSDP "
            "never calls the model's modules itself, nor moves or swaps them (the grader tells which group computes "
            "by which of the model's leaves runs, see docs/measuring.md)")
    if p.effdl.model_calls != p.fsdp2.model_calls:
        (forwards, nodes), (ref_forwards, ref_nodes) = p.effdl.model_calls, p.fsdp2.model_calls
        raise AssertionError(
            f"{p.what}: the model's layers ran {forwards} forwards and {nodes} backward nodes in the profiled steps, "
            f"under FSDP2 {ref_forwards} and {ref_nodes}: an FSDP never calls the model's modules, or their "
            "autograd nodes (`grad_fn`), itself (only compute the model does counts as overlap, see docs/measuring.md)")
    assert_parameters_gathered(p, which)
    shown = []
    for kind, phase, fix in OVERLAP[which]:
        if not p.effdl.comm.kind(kind).by_phase[phase].count:
            continue  # a mode without such collectives (no all-gather in backward, say)
        done, could, missed = p.effdl.overlap(kind, phase)
        ref_done, ref_could, _ = p.fsdp2.overlap(kind, phase)
        name = f"{kind.replace('_', '-')}s in {phase}"
        issued = sum(s.kind(kind).by_phase[phase].count for s in p.effdl.steps)
        if (placed := sum((s.kind, s.phase) == (kind, phase) for s in p.effdl.scheduled)) < issued:
            raise AssertionError(
                f"{p.what}: {name}: {issued - placed:g} of {issued:g} were issued outside a group's "
                f"`FSDP::{'all_gather' if kind == 'all_gather' else 'post_backward_reduce'} (name)` range, so "
                "where they are waited for cannot be told: issue them in FSDPGroup.unshard / reduce_scatter.")
        if differs := first_difference(issue_order(p.fsdp2, kind, phase), issue_order(p.effdl, kind, phase)):
            rank, n, got, ref, _ = differs
            raise AssertionError(
                f"{p.what}: {name}: rank {rank}: issued for the groups in another order than FSDP2's (number "
                f"{n + 1} of the profiled steps': {got}'s, under FSDP2 {ref}'s): an FSDP issues one per group, "
                "as FSDP2 does, each in its group's `FSDP::all_gather (name)` / `FSDP::post_backward_reduce (name)` "
                "range")
        if missed:
            s = missed[0]
            where = (f"rank {s.rank}, step {s.step}: {s.group}'s was waited for before any other group computed"
                     if s.waited is not None else
                     f"rank {s.rank}, step {s.step}: {s.group}'s was never waited for in FSDP's ranges "
                     "(all_gather_copy_out / PendingReduce.finish)")
            raise AssertionError(
                f"{p.what}: {name}: {done} of the {could} that can overlap compute did ({where}; FSDP2 on "
                f"CPU: {ref_done} of {ref_could}, it waits at once). They are not overlapped: {fix}.")
        # one in flight, not every group's at once (which also overlaps)
        count, flying = most_in_flight([s for s in p.effdl.scheduled if (s.kind, s.phase) == (kind, phase)])
        if count > IN_FLIGHT:
            raise AssertionError(
                f"{p.what}: {name}: {count} were in flight at once (rank {flying[-1].rank}, step "
                f"{flying[-1].step}: {', '.join(o.group for o in flying)}'s issued before any of them was waited "
                "for; " + (
                    f"FSDP2 waits for a group's own all-gather, then starts the next group's, one in flight at a "
                    f"time). Gathering groups further ahead holds more parameters than FSDP2: {fix}, and only that "
                    "group, after this group's own was waited for." if kind == "all_gather" else
                    "FSDP2 waits for the previous group's reduce-scatter before it issues the next, one in flight at "
                    "a time). Leaving more running holds more groups' gradient buffers than FSDP2: finish the "
                    "previous group's reduce-scatter, then issue this group's."))
        if kind == "all_gather":  # one group ahead
            gathered = {s.group for s in p.fsdp2.scheduled if (s.kind, s.phase) == (kind, phase)}
            ahead, s = most_ahead([s for s in p.effdl.scheduled if (s.kind, s.phase) == (kind, phase)], gathered)
            if ahead > AHEAD:
                began = [g for g in s.started if g in gathered]
                raise AssertionError(
                    f"{p.what}: {name}: issued {ahead} groups ahead of the groups computing (rank {s.rank}, step "
                    f"{s.step}: when {s.group}'s was issued, {len(began)} of the groups that gather had begun computing "
                    f"({', '.join(began) or 'none'}) and {len(began) + ahead} all-gathers of the pass had been issued; "
                    "FSDP2 gathers a group as it starts, then the next: one ahead). "
                    f"Gathering groups further ahead holds more parameters than FSDP2, wherever the program waits: "
                    f"{fix}, and only that group, after this group's own was waited for.")
        hidden = p.effdl.comm.kind(kind).by_phase[phase].hidden_fraction
        shown.append(f"{phase} {kind.replace('_', '-')}s {done}/{could} overlapped ({hidden:.0%} of their time hidden)")
    return ", ".join(shown)


def check_mode(pool: Ranks, impl: str, modes: list[str], param_dtype: str, reduce_dtype: str, folder,
               memory: bool = False) -> str:
    """One profiled run each of FSDP2 and effdl in the given bonus modes: the
    collectives per phase equal FSDP2's and keep each mode's promise, overlap still holds, and
    every loss, grad norm and parameter shard equals FSDP2's; memory: and the peak memory of this profiled run
    itself (assert_profiled_memory), and of a memory run on the same steps, with its leaks (check_memory)."""
    __tracebackhide__ = True
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, num_steps=3, profile_steps=1,
                 **mode_flags(modes))
    label = " + ".join(MODES[m].name for m in modes)
    what = f"{label}, {describe(cfg, pool.world_size)}"
    profiles, results = run_profiled(pool, cfg, folder, what, memory=memory)
    stats = {"fsdp2": profiles.fsdp2, "effdl": profiles.effdl}
    # FSDP groups as FSDP2 labels them (each block and the root; the model is never built here)
    groups = len({s.group for s in profiles.fsdp2.scheduled if s.kind == "all_gather"})
    if not groups:
        raise RuntimeError(f"{what}: FSDP2's trace shows no `FSDP::all_gather (name)` range: this torch "
                           "labels FSDP2's phases differently; update GROUP_RANGE in harness/tools/traces/trace.py")
    for m in modes:
        for who in ("fsdp2", "effdl"):
            s = stats[who].comm
            if not MODES[m].holds(s, groups):
                shown = {k: fmt(s.kind(k).count_by_phase) for k in ("all_gather", "reduce_scatter")}
                raise AssertionError(
                    f"{what}: {'FSDP2' if who == 'fsdp2' else 'effdl'} breaks the promise of "
                    f"{MODES[m].name}: {MODES[m].promise}; the trace shows per step all-gathers "
                    f"{shown['all_gather']}, reduce-scatters {shown['reduce_scatter']} ({groups} groups, "
                    f"{cfg.num_gradient_accumulation_steps} micro-steps)")
    assert_same_collectives(profiles, f" (in {label})")
    hidden = [assert_overlap(profiles, which) for which in ("forward", "backward")]
    ref, got = results["fsdp2"], results["effdl"]
    assert_same_numbers(ref[0].result, got[0].result, what)
    assert_same_parameters([r.digests for r in ref], [r.digests for r in got], what, measure_shard(pool, cfg))
    if memory:  # in this profiled run, and on the same steps of a memory run (leaks too)
        hidden.append(assert_profiled_memory(profiles))
        check_memory(pool, impl, param_dtype, reduce_dtype, judged=profiled_steps(cfg), **mode_flags(modes))
    return f"{MODES[modes[-1]].promise}; " + ", ".join(h for h in hidden if h)


# --------------------------------------------------------------------------- HSDP (bonus 4)


def check_hsdp(pool: Ranks, impl: str, param_dtype: str, reduce_dtype: str, folder, replicate: int = 2) -> str:
    """Bonus 4: HSDP on a (replicate, world/replicate) mesh, FSDP2's HSDP against effdl
    (policy.HSDP: a 2-block, dim-64 Llama, to keep 4 ranks on a small machine quick): every loss, grad norm and
    shard bit-identical, the collectives of each phase FSDP2's in count, dtype, bytes and process group
    (all-gathers and reduce-scatters within the shard group, the all-reduce across the replicate group);
    in the first precision case also, in a profiled run, tasks 2 and 3's overlap kept (FSDP2 on CPU
    waits for its all-reduce at once, as for everything else: the all-reduce may overlap, nothing
    requires it) and the peak memory per step within task 3's allowance of FSDP2's. A file that only supports 1-D meshes fails here alone, with
    its own error and a line saying so."""
    __tracebackhide__ = True
    shape = f"{replicate} x {pool.world_size // replicate}"
    cfg = config(impl, param_dtype=param_dtype, reduce_dtype=reduce_dtype, replicate=replicate, **HSDP)
    what = f"HSDP on a {shape} mesh, {describe(cfg, pool.world_size)}"
    try:
        got, sent = compare_step(pool, cfg, what)  # replicate > 1: collectives compared by process group
        overlap = []
        if (param_dtype, reduce_dtype) == PRECISIONS[0]:
            # Overlap and memory once, in the first precision case (4 ranks on a small machine are slow; the
            # schedule and the buffers a 2-D mesh adds do not depend on the dtypes, which tasks 2 and 3 grade).
            # The overlap from a profiled run of its own: the graded run's Probes would show in its trace.
            profiled = dataclasses.replace(cfg, num_steps=2, profile_steps=1)  # step 1 initialises
            profiles = run_profiled(pool, profiled, folder, what, memory=True)[0]
            overlap = [assert_overlap(profiles, which) for which in ("forward", "backward")]
            overlap.append(assert_profiled_memory(profiles))
            check_memory(pool, impl, param_dtype, reduce_dtype, judged=profiled_steps(profiled), replicate=replicate,
                         **{**HSDP, "num_steps": HSDP_MEMORY_STEPS})
    except (AssertionError, RankError) as e:
        first = str(e)
        hint = ("; the file does not support a 2-D mesh (HSDP): bonus 4 asks for it, the other lines do not"
                if any(w in first for w in ("2-D mesh", "2D mesh", "TODO(bonus4)", "have 2 dimensions",
                                            "mesh_dim", "1-D mesh")) else "")
        raise type(e)(f"bonus 4 (HSDP on a {shape} mesh): {first}{hint}") from None
    return f"{shape} mesh: {len(got[0].result.losses)} steps bit-identical; " + "; ".join(sent) + "; " + \
        ", ".join(o for o in overlap if o)


# --------------------------------------------------------------------------- effdl, not FSDP2


_NOT_FSDP2: dict[str, str | None] = {}


def check_not_fsdp2(pool: Ranks, impl: str) -> None:
    """The file is not PyTorch's FSDP2: its source (static_problem) and one wrapped forward on the
    ranks (classes, state, hooks, ops, stack). Once per file and process."""
    __tracebackhide__ = True
    if impl not in _NOT_FSDP2:
        from harness.impl import impl_path

        problem = handwritten.static_problem(impl_path(impl))
        if problem is None:
            cfg = config(impl)
            try:
                problem = next((r.uses_fsdp2 for r in run(pool, forward_job, cfg) if r.uses_fsdp2), None)
            except RankError:
                problem = None  # its forward crashes: the graded tests say where
        _NOT_FSDP2[impl] = problem
    if _NOT_FSDP2[impl]:
        raise AssertionError(f"{impl}: {handwritten.verdict(_NOT_FSDP2[impl])}")

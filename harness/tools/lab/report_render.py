"""The writeup report's markdown, plots and JSON, rendered from its typed results (harness/tools/lab/report_results.py).

Nothing here measures: `render` writes DIR/report.md, DIR/*.png and DIR/report.json from a Report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from harness.memory_model import PerRank
from harness.tools.lab.report_results import Report, label, to_json

MiB = 2**20
NAMES = {"none": "DDP (no sharding)", "noprefetch": "effdl, no prefetch",
         "effdl": "effdl, prefetch", "fsdp2": "FSDP2"}


def mib(x: float) -> str:
    return f"{x / MiB:.1f}"


def render(out: Path, report: Report, checks: list[str], warnings: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    cmd = report.command
    md = header(report)
    md += memory_section(out, report, cmd)
    md += communication_section(out, report, cmd)
    md += step_time_section(report)
    md += overlap_section(out, cmd)
    md += reshard_section(report)
    md += hsdp_section(report)
    md += weak_section(out, report, cmd)
    md += loss_section(out, report, cmd)
    md += timeline_section(out, report, cmd)
    md += ["## Checks", ""] + ([f"- FAILED: {p}" for p in checks] or
                               ["- measured collective counts and bytes equal the analytic volume",
                                "- all-gathers per step equal the analytic count, reshard_after_forward True and False",
                                "- HSDP: collectives and bytes per step on each link (shard group, replicate group) "
                                "equal the analytic ones, FSDP and HSDP; losses bit-identical to FSDP2's on each mesh",
                                "- losses bit-identical: FSDP2, effdl with and without prefetch",
                                "- measured shards, gradients and optimizer state equal the analytic bytes; the "
                                "ranks' shards hold every parameter element once",
                                "- every loss finite and positive, every memory peak and part positive"])
    md += [f"- warning (timing, not a failure): {w}" for w in warnings]
    (out / "report.md").write_text("\n".join(md) + "\n")
    (out / "report.json").write_text(json.dumps(to_json(report, checks, warnings), indent=1, default=str))


def header(report: Report) -> list[str]:
    plan, env = report.plan, report.environment
    model = ", ".join(f"{k} {v}" for k, v in plan.model.items()) or "debugmodel (dim 256, 6 blocks, 16 heads)"
    return [f"# FSDP report: `{Path(report.impl).name}`", "",
            f"Reproduce: `{report.command}`. Model: {model}, {report.n_params:,} parameters (float32, AdamW), "
            f"seq {plan.seq_len}, batch {plan.batch_size} per rank, {plan.steps} steps (the first is warm-up).", "",
            "## Environment", "",
            "| what | value |", "| --- | --- |",
            f"| python | {env.python} |", f"| torch | {env.torch} |",
            f"| torchtitan | {env.torchtitan} |", f"| OS | {env.os} |",
            f"| CPU | {env.cpu}, {env.cores} cores |", f"| GPU | {', '.join(env.gpus) or 'none'} |",
            f"| device / backend | {report.device} / {'nccl' if report.device == 'cuda' else 'gloo'} |",
            f"| FSDP under test | `{report.impl}` |", f"| world sizes | {', '.join(map(str, plan.worlds))} |", ""]


def memory_section(out: Path, report: Report, cmd: str) -> list[str]:
    import matplotlib.pyplot as plt

    md = ["## Memory per rank", "",
          "Per rank, worst rank, MiB. **Measured** (m): the peak over steps 2.. of the resident set with "
          "`--exact-cpu-memory` above the rank's resident set before the model was built (CUDA: peak "
          "allocated), and, in the same run, each part: the local parameter shards; the local gradients at "
          "the optimizer step; AdamW's exp_avg and exp_avg_sq (its `step` scalars apart); the most bytes of "
          "gathered (unsharded) parameters registered on modules at once, read whenever autograd saves or "
          "unpacks a tensor (a prefetched group is not registered until it is waited on, so this counts one block "
          "where the model counts two); the unique storages autograd saved for backward in one forward, parameters "
          "excluded. **Analytic** (a): 4N/W sharded parameters, 4N/W gradients, 8N/W AdamW state (N padded "
          "as torch.chunk pads), the root kept gathered plus two blocks gathered (current and prefetched), "
          "the activations FSDP2 saved at W=1 (they do not depend on W), and communication buffers: one "
          "block's reduce-scatter input plus gloo's copy of it (**analytic only**: gloo's internal buffers "
          "cannot be read from Python). The check holds measured shards, gradients and optimizer state "
          "equal to the analytic ones exactly.", ""]
    keys = [f.name for f in dataclasses.fields(PerRank)]
    md += ["| W | FSDP | " + " | ".join(f"{label(k)} m / a" if k != "comm_buffers" else f"{label(k)} (a)" for k in keys)
           + " | analytic total | measured peak | peak / analytic |",
           "| --- | --- | " + " | ".join("---" for _ in keys) + " | --- | --- | --- |"]
    for row in report.memory:
        total = row.model.total
        cells = [f"{mib(getattr(row.parts, k))} / {mib(getattr(row.model, k))}" if hasattr(row.parts, k)
                 else mib(getattr(row.model, k)) for k in keys]
        md.append(f"| {row.world} | {NAMES[row.run]} | " + " | ".join(cells)
                  + f" | {mib(total)} | {mib(row.measured)} | {row.measured / total:.2f} |")
    md += ["", "(MiB per rank.)", ""]
    fig, ax = plt.subplots(figsize=(7, 4))
    worlds = sorted({r.world for r in report.memory})
    bottom = [0.0] * len(worlds)
    for k in keys:
        vals = [next(getattr(r.model, k) for r in report.memory if r.world == w) / MiB for w in worlds]
        ax.bar([str(w) for w in worlds], vals, bottom=bottom, label=f"model: {label(k)}", alpha=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for name, marker in (("fsdp2", "o"), ("effdl", "x")):
        ax.plot([str(w) for w in worlds], [next(r.measured for r in report.memory if r.world == w and r.run == name) / MiB
                                            for w in worlds], marker, color="k", markersize=9, label=f"measured: {NAMES[name]}")
    ax.set(xlabel="world size W", ylabel="MiB per rank", title="Peak memory per rank")
    ax.legend(fontsize=7)
    _save(fig, out / "memory.png")
    return md + [f"![memory](memory.png)  \n`{cmd}` (memory.png)", ""]


def communication_section(out: Path, report: Report, cmd: str) -> list[str]:
    import matplotlib.pyplot as plt

    bench = report.comm_bench
    bench_worlds = sorted({r.world for r in bench})
    md = ["## Communication", "", f"### Collective microbenchmark (W={', '.join(map(str, bench_worlds))}, float32)", "",
          "nccl-tests definitions: size is the all-gather's output / the reduce-scatter's input; "
          "latency the slowest rank's mean time per call; algbw = size / time; busbw = algbw x (W-1)/W "
          "with the W the collective ran at (what each rank's link carries).", "",
          "| collective | W | size | latency (us) | algbw (GB/s) | busbw (GB/s) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in bench:
        md.append(f"| {r.kind} | {r.world} | {_size(r.bytes)} | {r.seconds * 1e6:,.0f} | {r.algbw:.3f} | {r.busbw:.3f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, w in ((k, w) for k in ("all_gather", "reduce_scatter") for w in bench_worlds):
        rows = [r for r in bench if r.kind == kind and r.world == w]
        ax.plot([r.bytes for r in rows], [r.busbw for r in rows], "o-", label=f"{kind}, W={w}")
    ax.set(xscale="log", xlabel="size (bytes)", ylabel="busbw (GB/s)", title="Collective bus bandwidth")
    ax.legend()
    _save(fig, out / "comm_bandwidth.png")
    md += ["", f"![bandwidth](comm_bandwidth.png)  \n`{cmd}` (comm_bandwidth.png)", "",
           "### Bytes per training step (W=2)", "",
           "Measured from the profiled steps' c10d ops (all-gather: output buffer; reduce-scatter: input "
           "buffer; mean over steps and ranks) against the analytic volume: every group's padded flat "
           "buffer, all-gathered in forward and again in backward for the blocks (the root stays gathered), "
           "reduce-scattered once. Each rank sends and receives (W-1)/W of it.", "",
           "| FSDP | collective | count measured | count analytic | MiB measured | MiB analytic |", "| --- | --- | --- | --- | --- | --- |"]
    for r in report.comm_volume:
        md.append(f"| {NAMES[r.run]} | {r.kind} | {r.measured_count:g} | {r.analytic_count} | "
                  f"{r.measured_bytes / MiB:.3f} | {r.analytic_bytes / MiB:.3f} |")
    return md


def step_time_section(report: Report) -> list[str]:
    md = ["", "## Step time (W=2)", "",
          f"Median over {report.plan.repeats} interleaved runs of each run's median step; ratio to FSDP2. Communication "
          "share: collective wall time (union of intervals per kind) / step time; hidden share: the part of "
          "the model's collectives (DDP: all-reduces; FSDP: all-gathers and reduce-scatters) during which "
          "compute ran (harness/tools/traces/collectives.py, one profiled run each).", "",
          "| run | step (ms) | / FSDP2 | comm share | hidden share | all-gather hidden | reduce-scatter hidden |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report.step_time:
        md.append(f"| {NAMES[r.run]} | {r.step_ms:.0f} | {r.ratio:.2f} | {r.comm_share:.0%} | "
                  f"{r.hidden_share:.0%} | {r.ag_hidden:.0%} | {r.rs_hidden:.0%} |")
    return md


def overlap_section(out: Path, cmd: str) -> list[str]:
    """The profiled runs' schedules (out/traces/<fsdp2|effdl>, written by report.Sections.traces)."""
    from harness.tools.traces import pictures

    md = ["", "## Overlap (W=2, rank 0)", "",
          "One profiled step of FSDP2 above the same step of effdl, each from its step's start: "
          "per FSDP group its forward and backward compute, and its all-gathers and reduce-scatters from issued "
          "to waited for (green: another group computed meanwhile), with where gloo ran them "
          "(harness/tools/traces/pictures.py).", ""]
    try:
        pictures.overlap_png(out / "traces" / "fsdp2", out / "traces" / "effdl", out / "overlap.png",
                             title="Overlap: FSDP2 and effdl")
    except (OSError, ValueError) as e:  # traces missing or not train.py's: the rest of the report stands
        return md + [f"Not drawn: {e}", ""]
    return md + [f"![overlap](overlap.png)  \n`{cmd}` (overlap.png)", ""]


def reshard_section(report: Report) -> list[str]:
    md = ["", "## reshard_after_forward (W=2)", "",
          "| FSDP | reshard_after_forward | all-gathers per step (measured / analytic) | all-gather MiB per step | peak (MiB) |",
          "| --- | --- | --- | --- | --- |"]
    for r in report.reshard:
        md.append(f"| {NAMES[r.run]} | {r.reshard_after_forward} | {r.all_gathers:g} / {r.analytic_all_gathers} | "
                  f"{r.all_gather_bytes / MiB:.3f} | {mib(r.peak)} |")
    return md


def hsdp_section(report: Report) -> list[str]:
    """FSDP on a 1-D mesh against HSDP on a (replicate, shard) mesh, same world size."""
    if not report.hsdp_volume:
        return []
    rows, times = report.hsdp_volume, report.hsdp_time
    w = next(r.group_size for r in rows if r.replicate == 1 and r.link == "shard")
    hsdp = max(r.replicate for r in rows)
    s = w // hsdp
    md = ["", f"## HSDP (W={w}): FSDP over {w} ranks against {hsdp} replicas of {s}", "",
          f"FSDP shards every parameter over all {w} ranks (a 1-D mesh); HSDP (`train.py --replicate {hsdp}`) "
          f"shards it over the {s} ranks of a shard group and keeps {hsdp} replicas of those shards: all-gathers and "
          "reduce-scatters run within the shard group, then each rank all-reduces its reduced 1/S shard of the "
          "gradients with the ranks at its place in the other replicas (its replicate group). **Measured**: every "
          "collective of one observed run each (the graded checks' CommLog: the tensor each rank puts in and the "
          "ranks of its process group; all-reduces in backward only, so the loss's and grad norm's are left out), "
          "per step, mean over steps and ranks. **Analytic**: the padded shards of every FSDP group "
          "(harness/memory_model.py `link_volume`); the check holds count and bytes equal exactly. **Sent per rank** "
          "is the tensor times the ring algorithms' factor, nccl-tests' bus-bandwidth factors (all-gather: the shard "
          "to each of the S-1 others; reduce-scatter: (S-1)/S of its input; all-reduce: 2(R-1)/R of its tensor), "
          "applied to the measured and the analytic tensors alike: what NCCL sends; gloo on CPU runs a "
          "reduce-scatter as an all-reduce of the whole buffer, so it sends about twice the reduce-scatter's share. "
          "**Closed form**: with P parameters (P_b in the blocks), b = 4 bytes, S ranks per shard group and R "
          "replicas, per step: all-gathers (S-1)/S x (P + P_b) x b (forward, and the blocks again in backward), "
          "reduce-scatters (S-1)/S x P x b, replica all-reduces 2(R-1)/R x P/S x b; it leaves out the padding.", "",
          "| FSDP | mesh | link (group size) | collective | count m / a | tensor MiB m / a | sent MiB per rank m / a "
          "| closed form MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        mesh = f"1-D ({w})" if r.replicate == 1 else f"{r.replicate} x {w // r.replicate}"
        md.append(f"| {NAMES[r.run]} | {mesh} | {r.link} ({r.group_size}) | {r.kind} | {r.measured_count:g} / "
                  f"{r.analytic_count} | {r.measured_bytes / MiB:.3f} / {r.analytic_bytes / MiB:.3f} | "
                  f"{r.sent / MiB:.3f} / {r.analytic_sent / MiB:.3f} | {r.closed_form / MiB:.3f} |")
    md += ["", "Sent per rank per step, by link (MiB, measured):", "",
           "| FSDP | mesh | within the shard group | across replicas | total |", "| --- | --- | --- | --- | --- |"]
    for run in dict.fromkeys(r.run for r in rows):
        for rep in sorted({r.replicate for r in rows if r.run == run}):
            mine = [r for r in rows if r.run == run and r.replicate == rep]
            shard = sum(r.sent for r in mine if r.link == "shard")
            across = sum(r.sent for r in mine if r.link != "shard")
            mesh = f"1-D ({w})" if rep == 1 else f"{rep} x {w // rep}"
            md.append(f"| {NAMES[run]} | {mesh} | {shard / MiB:.3f} | {across / MiB:.3f} | {(shard + across) / MiB:.3f} |")
    md += ["", f"Step time: median over {report.plan.repeats} interleaved run(s) of each run's median step "
           "(the first step left out), the slowest rank; ratio to the same FSDP on the 1-D mesh. Timings only "
           "ever warn.", "", "| FSDP | mesh | step (ms) | / 1-D |", "| --- | --- | --- | --- |"]
    for t in times:
        mesh = f"1-D ({w})" if t.replicate == 1 else f"{t.replicate} x {w // t.replicate}"
        md.append(f"| {NAMES[t.run]} | {mesh} | {t.step_ms:.0f} | {t.ratio:.2f} |")
    sent = {(r.run, rep): (sum(x.sent for x in rows if (x.run, x.replicate) == (r.run, rep) and x.link == "shard"),
                           sum(x.sent for x in rows if (x.run, x.replicate) == (r.run, rep) and x.link != "shard"))
            for r in rows for rep in (1, hsdp)}
    run = "effdl" if ("effdl", 1) in sent else rows[0].run
    (flat, _), (inner, across) = sent[run, 1], sent[run, hsdp]
    md += ["", f"What it means: within its shard group a rank sends (S-1)/S of each gathered or reduced buffer, so "
           f"going from S = {w} to S = {s} shrinks that share from {w - 1}/{w} to {s - 1}/{s}: here "
           f"{flat / MiB:.3f} MiB per rank per step within the shard group on the 1-D mesh, {inner / MiB:.3f} MiB "
           f"with HSDP. HSDP adds the cross-replica traffic, but only as one all-reduce per group of the reduced "
           f"1/S shard of the gradients (2(R-1)/R x P/S x b per step, {across / MiB:.3f} MiB here); the parameters' "
           f"all-gathers never leave the shard group. In all HSDP sends {(inner + across) / MiB:.3f} MiB per rank "
           f"per step against {flat / MiB:.3f} MiB, and keeps the heavy, latency-bound traffic (every all-gather, "
           f"forward and backward) inside the smaller group: on a cluster, inside a node, with only the all-reduce "
           f"crossing the slower links between nodes. The price is memory: each rank holds 1/{s} of the model's "
           f"state instead of 1/{w}. Here all ranks share one machine, so the step times show the collectives' "
           "count and size, not a slower link between replicas."]
    return md


def weak_section(out: Path, report: Report, cmd: str) -> list[str]:
    import matplotlib.pyplot as plt

    plan = report.plan
    md = ["", "## Weak scaling", "",
          f"The model grows with W ({plan.weak_layers} blocks per rank); batch per rank fixed; median over "
          f"{plan.repeats} interleaved runs of each run's median step. On a machine "
          "with fewer cores than ranks the ranks share cores, so tokens/s per rank falls for that reason too.", "",
          "| W | blocks | FSDP | step (ms) | tokens/s per rank |", "| --- | --- | --- | --- | --- |"]
    for r in report.weak:
        md.append(f"| {r.world} | {r.n_layers} | {NAMES[r.run]} | {r.step_ms:.0f} | {r.tokens_per_s_per_rank:,.0f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("fsdp2", "effdl"):
        rows = [r for r in report.weak if r.run == name]
        ax.plot([r.world for r in rows], [r.tokens_per_s_per_rank for r in rows], "o-", label=NAMES[name])
    ax.set(xlabel="world size W (model grows with W)", ylabel="tokens/s per rank", title="Weak scaling")
    ax.legend()
    _save(fig, out / "weak_scaling.png")
    return md + ["", f"![weak scaling](weak_scaling.png)  \n`{cmd}` (weak_scaling.png)", ""]


def loss_section(out: Path, report: Report, cmd: str) -> list[str]:
    import matplotlib.pyplot as plt

    losses = report.losses
    diff = max(abs(a - b) for k in losses for a, b in zip(losses["fsdp2"], losses[k]))
    md = ["## Loss curves (W=2)", "",
          f"{'Bit-identical' if diff == 0 else 'NOT identical'} across " + ", ".join(NAMES[k] for k in losses)
          + f": max |difference| from FSDP2 {diff:.3g}.", "",
          "| step | " + " | ".join(NAMES[k] for k in losses) + " |", "| --- |" + " --- |" * len(losses)]
    for i, vals in enumerate(zip(*losses.values()), 1):
        md.append(f"| {i} | " + " | ".join(f"{v:.6f}" for v in vals) + " |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, curve), style in zip(losses.items(), ("-", "--", ":")):
        ax.plot(range(1, len(curve) + 1), curve, style, marker="o", label=NAMES[name])
    ax.set(xlabel="step", ylabel="loss", title="Loss, W=2 (the curves lie on top of each other)")
    ax.legend()
    _save(fig, out / "loss.png")
    return md + ["", f"![loss](loss.png)  \n`{cmd}` (loss.png)", ""]


def timeline_section(out: Path, report: Report, cmd: str) -> list[str]:
    import matplotlib.pyplot as plt

    tl = report.timeline
    fig, ax = plt.subplots(figsize=(9, 4))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
    for start, end, phase in tl.phases:
        ax.axvspan(start, end, color=colors.get(phase, "grey"), alpha=0.15)
    ax.plot([t for t, _ in tl.samples], [m / MiB for _, m in tl.samples], lw=0.8, color="k")
    for phase, c in colors.items():
        ax.axvspan(0, 0, color=c, alpha=0.3, label=phase)
    ax.set(xlabel="seconds", ylabel="MiB above baseline",
           title=f"Memory of rank 0, {NAMES['effdl']}, W=2 ({'allocated' if report.device == 'cuda' else 'RSS, exact CPU memory'})")
    ax.legend(fontsize=8)
    _save(fig, out / "memory_timeline.png")
    return ["## Memory timeline (rank 0, W=2)", "",
            "Sampled every millisecond during 3 steps of effdl: on CPU the resident set with "
            "`--exact-cpu-memory` (the whole process; the graded tests compare tensor memory), on CUDA the allocated bytes; forward, backward and "
            "optimizer phases shaded. Per-step peaks (MiB): " + ", ".join(mib(p) for p in tl.peaks) + ". "
            "The CPU memory snapshot in snapshots/ shows allocations only (gloo's frees are not recorded), so "
            "its peak is not this one.", "",
            f"![timeline](memory_timeline.png)  \n`{cmd}` (memory_timeline.png)", ""]


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 2**10:g} KiB"


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)

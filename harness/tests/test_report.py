"""harness.tools.lab.report: the quick report end to end, and its checks against doctored numbers."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.optim.optimizer as optim_hooks

import train
from harness import fit, memory_model, model_setup
from harness.tools.lab import report, report_jobs
from harness import impl as impl_module
from harness.memory_model import PerRank
from harness.tools.lab.report_results import (
    Environment, LinkVolume, MemoryRow, MeshTime, Parts, Report, Reshard, StepTime, Volume, check, timing_warnings,
)
from harness.errors import ConfigError
from harness.tests.test_platform import skip_unfinished

ROOT = Path(__file__).resolve().parents[2]


def good_report() -> Report:
    model = PerRank(sharded_params=40, grads=40, optimizer_state=80, gathered_params=100, activations=50, comm_buffers=20)
    parts = Parts(sharded_params=40, grads=40, optimizer_state=80, gathered_params=90, activations=50,
                  params_numel=10, optimizer_steps=8)
    return Report(
        command="", impl="fsdp.py", device="cpu", plan=report.QUICK, n_params=19,
        environment=Environment("3", "2", "0", "Linux", "cpu", 2, []),
        comm_volume=[Volume("effdl", "all_gather", measured_count=13.0, measured_bytes=100.0, analytic_count=13,
                            analytic_bytes=100)],
        reshard=[Reshard("effdl", True, all_gathers=13.0, all_gather_bytes=1.0, analytic_all_gathers=13, peak=1),
                 Reshard("effdl", False, all_gathers=7.0, all_gather_bytes=1.0, analytic_all_gathers=7, peak=1)],
        step_time=[StepTime("effdl", 1.0, 1.0, 0.5, hidden_share=0.5, ag_hidden=0.5, rs_hidden=0.5),
                   StepTime("noprefetch", 1.0, 1.0, 0.5, hidden_share=0.1, ag_hidden=0.1, rs_hidden=0.1)],
        losses={"fsdp2": [8.0, 7.5], "effdl": [8.0, 7.5], "noprefetch": [8.0, 7.5]},
        memory=[MemoryRow(world=2, run="effdl", measured=1000, model=model, parts=parts,
                          rank_sums=dataclasses.replace(parts, params_numel=19))],
        hsdp_volume=[LinkVolume("effdl", 2, "replicate", 2, "all_reduce", measured_count=3.0, measured_bytes=64.0,
                                analytic_count=3, analytic_bytes=64, closed_form=64.0),
                     LinkVolume("effdl", 2, "shard", 2, "all_gather", measured_count=5.0, measured_bytes=96.0,
                                analytic_count=5, analytic_bytes=96, closed_form=96.0)],
        hsdp_time=[MeshTime("effdl", 1, 10.0, 1.0), MeshTime("effdl", 2, 9.0, 0.9)],
        hsdp_losses={"fsdp2 2": [8.0, 7.5], "effdl 2": [8.0, 7.5]},
    )


def changed(r: Report, section: str, **fields) -> Report:
    """The report with its section's first row changed (fields may be a callable of the row's value)."""
    row = getattr(r, section)[0]
    new = {k: v(getattr(row, k)) if callable(v) else v for k, v in fields.items()}
    getattr(r, section)[0] = dataclasses.replace(row, **new)
    return r


def parts(**fields):
    return lambda p: dataclasses.replace(p, **fields)


def test_check_passes_good_numbers():
    assert check(good_report()) == []
    assert timing_warnings(good_report()) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: changed(r, "comm_volume", measured_bytes=150.0), "all_gather: measured 13 collectives, 150 B"),
    (lambda r: changed(r, "comm_volume", measured_count=12.0), "measured 12 collectives"),
    # the no-reshard-after-forward mutant: blocks stay gathered, backward gathers nothing
    (lambda r: changed(r, "reshard", all_gathers=7.0), "reshard_after_forward=True: 7 all-gathers per step, analytic 13"),
    (lambda r: r.losses["effdl"].__setitem__(1, math.nan), "non-finite"),
    (lambda r: r.losses["noprefetch"].__setitem__(1, 7.5000001), "noprefetch: losses [8.0, 7.5000001] are not bit-identical"),
    (lambda r: changed(r, "memory", measured=0), "measured peak 0 B"),
    # HSDP: the replica all-reduce of the whole gradient buffer instead of the 1/S shard; one all-reduce missing
    (lambda r: changed(r, "hsdp_volume", measured_bytes=128.0),
     "HSDP effdl replicate=2 all_reduce on the replicate group: measured 3 collectives, 128 B"),
    (lambda r: changed(r, "hsdp_volume", measured_count=2.0), "measured 2 collectives"),
    (lambda r: r.hsdp_losses["effdl 2"].__setitem__(1, 7.25), "HSDP replicate=2 effdl: losses [8.0, 7.25] are not"),
    (lambda r: changed(r, "memory", parts=parts(grads=80)), "measured grads 80 B on the largest rank, analytic 40 B"),
    (lambda r: changed(r, "memory", parts=parts(optimizer_state=120)), "measured optimizer state 120 B"),
    (lambda r: changed(r, "memory", rank_sums=parts(params_numel=20)), "shards hold 20 elements, the model has 19"),
    (lambda r: changed(r, "memory", parts=parts(activations=0)), "activations 0 B"),
])
def test_check_catches_mutants(mutate, expected):
    r = good_report()
    mutate(r)
    problems = check(r)
    assert len(problems) == 1 and expected in problems[0], problems


def test_timings_only_warn():
    """A loaded machine can hide more without prefetch: said, never failed on."""
    r = good_report()
    r.step_time[1] = dataclasses.replace(r.step_time[1], hidden_share=0.6)  # noprefetch
    assert check(r) == []
    (warning,) = timing_warnings(r)
    assert "hidden share without prefetch (60%) is not below with prefetch (50%)" in warning


def test_analytic_volume_pads_like_torch_chunk():
    # 5 rows on 4 ranks: chunks of 2 rows, so every rank sends 2 x 3 elements: 4 x 6 x 4 bytes.
    assert memory_model.group_bytes([(5, 3)], 4) == 4 * 6 * 4
    groups = {"<root>": [(5, 3)], "layers.0": [(4,)]}
    # forward gathers both groups, backward the block again; one reduce-scatter each.
    assert memory_model.comm_volume(groups, 4) == {"all_gather": (3, 96 + 16 + 16), "reduce_scatter": (2, 96 + 16)}
    assert (memory_model.all_gathers(groups, True), memory_model.all_gathers(groups, False)) == (3, 2)
    # torch.chunk's rows, the helper model_setup's layout check uses too: 5 rows on 4 ranks are 2, 2, 1, 0.
    assert [model_setup.chunk_rows(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    assert memory_model.reduce_scatter_input_bytes([(5, 3), (4,)], 4, torch.bfloat16) == 4 * (6 + 1) * 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_report_and_fit_share_one_memory_model(world):
    """Where they overlap (the sharded state; the gathered groups, which fit doubles for their full
    gradients), the report's analytic model and fit's estimate are the same numbers. W=3 pads."""
    cfg = train.Config(fsdp="fsdp2", seq_len=64, dim=96, n_layers=3, n_heads=8)
    estimate = fit.estimate(cfg, world, 2047)
    groups = memory_model.model_groups("debug", 64, 2047, dim=96, n_layers=3, n_heads=8)
    model = memory_model.per_rank(groups, world, activations=0)
    assert estimate["parameters, gradients, AdamW state (float32)"] == model.sharded_state
    assert estimate["gathered groups and their full gradients"] == 2 * model.gathered_params
    assert model.comm_buffers == 2 * memory_model.reduce_scatter_input_bytes(groups["layers.0"], world, torch.float32)


def test_analytic_link_volume():
    """Per rank per step on a (replicate, world/replicate) mesh: all-gathers and reduce-scatters within the shard
    group, the replica all-reduce of the 1/S shard across replicas; the ring factors turn tensors into bytes sent."""
    groups = {"<root>": [(5, 3)], "layers.0": [(4,)]}
    # 1-D over 4 ranks: shards of 2 x 3 and 1 elements (5 rows pad to 2 per rank), 4 bytes each.
    assert memory_model.link_volume(groups, 4) == {("shard", "all_gather"): (3, 4 * (6 + 1 + 1)),
                                                    ("shard", "reduce_scatter"): (2, 4 * 4 * 7)}
    # 2 x 2: shards of 3 x 3 and 2 elements; one all-reduce per group of the reduced shard.
    assert memory_model.link_volume(groups, 4, 2) == {("shard", "all_gather"): (3, 4 * (9 + 2 + 2)),
                                                       ("shard", "reduce_scatter"): (2, 2 * 4 * 11),
                                                       ("replicate", "all_reduce"): (2, 4 * 11)}
    assert memory_model.sent_bytes("all_gather", 4, 10) == 30
    assert memory_model.sent_bytes("reduce_scatter", 4, 40) == 30
    assert memory_model.sent_bytes("all_reduce", 2, 40) == 40
    # Without padding (4 rows on 2 ranks) the closed form is the padded model's bytes sent.
    even = {"<root>": [(4, 3)], "layers.0": [(8,)]}
    for (link, kind), (_, nbytes) in memory_model.link_volume(even, 4, 2).items():
        size = 2  # S = R = 2
        assert memory_model.closed_form_sent(even, 4, 2, link, kind) == memory_model.sent_bytes(kind, size, nbytes)


def test_hsdp_bytes_measured_equal_analytic(impl):
    """A tiny HSDP run (2 replicas of 2 ranks, one block): the collectives the report's link_job records per link
    equal memory_model.link_volume's exactly, and a doctored measurement fails the report's check."""
    from harness.tools.grading.ranks import RankPool

    skip_unfinished(impl)
    cfg = train.Config(fsdp="effdl", impl=str(impl_module.impl_path(impl)), model="debug", seq_len=32, batch_size=1,
                       num_steps=2, log=False, device="cpu", n_layers=1, dim=64, n_heads=4, replicate=2)
    groups = memory_model.model_groups("debug", 32, 2048, n_layers=1, dim=64, n_heads=4)
    with RankPool(4, device="cpu", role="own") as pool:
        per_rank = pool.run(report_jobs.link_job, cfg)
    analytic = memory_model.link_volume(groups, 4, 2)
    assert all(measured == {k: (float(c), float(b)) for k, (c, b) in analytic.items()} for measured in per_rank), per_rank
    r = good_report()
    (count, nbytes) = per_rank[0]["replicate", "all_reduce"]
    r.hsdp_volume = [LinkVolume("effdl", 2, "replicate", 2, "all_reduce", count, nbytes,
                                *analytic["replicate", "all_reduce"], 0.0)]
    assert check(r) == []
    r.hsdp_volume[0] = dataclasses.replace(r.hsdp_volume[0], measured_bytes=nbytes * 2)  # the whole buffer all-reduced
    assert len(check(r)) == 1 and "on the replicate group" in check(r)[0]


def test_measuring_leaves_torch_as_it_was():
    """A rank runs other jobs after a report's: the optimizer hooks, the saved-tensor hooks and the
    record_function wrapper of a measurement end with it, also when training fails."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch wraps AdamW.step once, at the first AdamW
    adamw, adamw_step, record_function = torch.optim.AdamW, torch.optim.AdamW.step, torch.profiler.record_function
    hooks = (dict(optim_hooks._global_optimizer_pre_hooks), dict(optim_hooks._global_optimizer_post_hooks))
    parts = report_jobs.Components()
    with pytest.raises(RuntimeError, match="training failed"), parts.measuring():
        model = torch.nn.Linear(2, 2)
        parts.attach(model, 0)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
        optimizer.step()
        raise RuntimeError("training failed")
    assert parts.result().optimizer_state == 2 * 6 * 4 and parts.result().grads == 6 * 4
    with pytest.raises(RuntimeError, match="training failed"), report_jobs.phase_ranges(0.0, phases := []):
        with torch.profiler.record_function("## forward ##"):
            pass
        raise RuntimeError("training failed")
    assert [p[2] for p in phases] == ["forward"]
    assert torch.optim.AdamW is adamw and torch.optim.AdamW.step is adamw_step
    assert torch.profiler.record_function is record_function
    assert (optim_hooks._global_optimizer_pre_hooks, optim_hooks._global_optimizer_post_hooks) == hooks
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no saved-tensor hooks left open


def test_no_prefetch_needs_the_hand_written_fsdp():
    for fsdp in ("fsdp2", "none"):
        with pytest.raises(ConfigError, match="--no-prefetch .* needs --fsdp effdl"):
            train.validate(train.Config(fsdp=fsdp, prefetch=False))


def test_model_overrides():
    args = model_setup.model_args("debug", 64, 2048, dim=64, n_layers=3, n_heads=4)
    assert (args.dim, args.n_layers, args.n_heads) == (64, 3, 4)
    with pytest.raises(ConfigError, match="--dim 100 / --n-heads 3 must give a whole, even head size"):
        model_setup.model_args("debug", 64, 2048, dim=100, n_heads=3)
    with pytest.raises(ConfigError, match="--n-layers must be >= 1"):
        model_setup.model_args("debug", 64, 2048, n_layers=0)


def test_quick_report_end_to_end(impl, tmp_path):
    skip_unfinished(impl)
    path = impl_module.impl_path(impl)
    proc = subprocess.run([sys.executable, "-m", "harness.tools.lab.report", "--impl", str(path), "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[13/13]" in proc.stdout  # the progress display ran to the end
    md = (tmp_path / "report.md").read_text()
    for section in ("## Environment", "## Memory per rank", "### Collective microbenchmark", "### Bytes per training step",
                    "## Step time", "## Overlap", "## reshard_after_forward", "## HSDP", "## Weak scaling", "## Loss curves", "## Memory timeline"):
        assert section in md
    for png in ("memory", "comm_bandwidth", "overlap", "weak_scaling", "loss", "memory_timeline"):
        assert (tmp_path / f"{png}.png").stat().st_size > 10_000, png
        assert f"({png}.png)" in md  # each figure names its command
    data = json.loads((tmp_path / "report.json").read_text())
    # Facts only: timings (step times, hidden shares) are printed, never asserted; a loaded machine moves them.
    assert data["checks"] == []
    for row in data["comm_volume"]:
        assert (row["measured_count"], row["measured_bytes"]) == (row["analytic_count"], row["analytic_bytes"])
    assert set(data["losses"]) == {"fsdp2", "effdl", "noprefetch"}
    assert data["losses"]["fsdp2"] == data["losses"]["effdl"] == data["losses"]["noprefetch"]
    keep = {(r["run"], r["reshard_after_forward"]): r["all_gathers"] for r in data["reshard"]}
    for run in ("fsdp2", "effdl"):
        assert keep[run, False] < keep[run, True]  # kept gathered: backward gathers nothing
    assert sorted({r["world"] for r in data["memory"]}) == [1, 2, 4]
    for row in data["memory"]:
        for key in ("sharded params", "grads", "optimizer state"):
            assert row["parts"][key] == row["model"][key], (row["world"], row["run"], key)
        assert row["rank_sums"]["params_numel"] == data["n_params"]
        assert row["parts"]["gathered params"] > 0 and row["parts"]["activations"] > 0
    # The activations FSDP2 and effdl save are the same tensors.
    act = {(r["world"], r["run"]): r["parts"]["activations"] for r in data["memory"]}
    assert len(set(act.values())) == 1, act
    for row in data["hsdp_volume"]:
        assert (row["measured_count"], row["measured_bytes"]) == (row["analytic_count"], row["analytic_bytes"])
    assert {(r["replicate"], r["link"], r["kind"]) for r in data["hsdp_volume"]} == {
        (1, "shard", "all_gather"), (1, "shard", "reduce_scatter"),
        (2, "shard", "all_gather"), (2, "shard", "reduce_scatter"), (2, "replicate", "all_reduce")}
    assert sorted({r["world"] for r in data["comm_bench"]}) == [2, 4]
    for r in data["comm_bench"]:
        assert r["busbw"] == pytest.approx(r["algbw"] * (r["world"] - 1) / r["world"])
    assert "m / a" in md and "comm buffers (a)" in md  # measured and analytic said apart
    positive = ([r["measured"] for r in data["memory"]] + [r["step_ms"] for r in data["step_time"]]
                + [r["seconds"] for r in data["comm_bench"]] + [r["tokens_per_s_per_rank"] for r in data["weak"]]
                + [r["peak"] for r in data["reshard"]])
    assert all(math.isfinite(x) and x > 0 for x in positive), positive

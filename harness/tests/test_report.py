"""harness.report: the quick report end to end, and its checks against doctored numbers."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import train
from harness import impl as impl_module
from harness import model_setup, report
from harness.errors import ConfigError
from harness.tests.test_platform import skip_unfinished

ROOT = Path(__file__).resolve().parents[2]


def good_data() -> dict:
    model = {"sharded params": 40, "grads": 40, "optimizer state": 80, "gathered params": 100,
             "activations": 50, "comm buffers": 20}
    parts = dict(model, **{"gathered params": 90, "params_numel": 10, "optimizer steps": 8})
    return dict(
        n_params=19,
        comm_volume=[dict(run="effdl", kind="all_gather", measured_count=13.0, measured_bytes=100.0,
                          analytic_count=13, analytic_bytes=100)],
        reshard=[dict(run="effdl", reshard_after_forward=True, all_gathers=13.0, analytic_all_gathers=13),
                 dict(run="effdl", reshard_after_forward=False, all_gathers=7.0, analytic_all_gathers=7)],
        step_time=[dict(run="effdl", hidden_share=0.5), dict(run="noprefetch", hidden_share=0.1)],
        losses={"fsdp2": [8.0, 7.5], "effdl": [8.0, 7.5], "noprefetch": [8.0, 7.5]},
        memory=[dict(world=2, run="effdl", measured=1000, model=model, parts=parts,
                     rank_sums=dict(parts, params_numel=19))],
    )


def test_check_passes_good_numbers():
    assert report.check(good_data()) == []
    assert report.timing_warnings(good_data()) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["comm_volume"][0].update(measured_bytes=150.0), "all_gather: measured 13 collectives, 150 B"),
    (lambda d: d["comm_volume"][0].update(measured_count=12.0), "measured 12 collectives"),
    # the no-reshard-after-forward mutant: blocks stay gathered, backward gathers nothing
    (lambda d: d["reshard"][0].update(all_gathers=7.0), "reshard_after_forward=True: 7 all-gathers per step, analytic 13"),
    (lambda d: d["losses"]["effdl"].__setitem__(1, math.nan), "non-finite"),
    (lambda d: d["losses"]["noprefetch"].__setitem__(1, 7.5000001), "noprefetch: losses [8.0, 7.5000001] are not bit-identical"),
    (lambda d: d["memory"][0].update(measured=0), "measured peak 0 B"),
    (lambda d: d["memory"][0]["parts"].update(grads=80), "measured grads 80 B on the largest rank, analytic 40 B"),
    (lambda d: d["memory"][0]["parts"].update({"optimizer state": 120}), "measured optimizer state 120 B"),
    (lambda d: d["memory"][0]["rank_sums"].update(params_numel=20), "shards hold 20 elements, the model has 19"),
    (lambda d: d["memory"][0]["parts"].update(activations=0), "activations 0 B"),
])
def test_check_catches_mutants(mutate, expected):
    data = copy.deepcopy(good_data())
    mutate(data)
    problems = report.check(data)
    assert len(problems) == 1 and expected in problems[0], problems


def test_timings_only_warn():
    """A loaded machine can hide more without prefetch: said, never failed on."""
    data = good_data()
    data["step_time"][1]["hidden_share"] = 0.6
    assert report.check(data) == []
    (warning,) = report.timing_warnings(data)
    assert "hidden share without prefetch (60%) is not below with prefetch (50%)" in warning


def test_analytic_volume_pads_like_torch_chunk():
    # 5 rows on 4 ranks: chunks of 2 rows, so every rank sends 2 x 3 elements: 4 x 6 x 4 bytes.
    assert report.group_bytes([(5, 3)], 4) == 4 * 6 * 4
    groups = {"<root>": [(5, 3)], "layers.0": [(4,)]}
    # forward gathers both groups, backward the block again; one reduce-scatter each.
    assert report.comm_volume(groups, 4) == {"all_gather": (3, 96 + 16 + 16), "reduce_scatter": (2, 96 + 16)}
    assert (report.all_gathers(groups, True), report.all_gathers(groups, False)) == (3, 2)


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
    proc = subprocess.run([sys.executable, "-m", "harness.report", "--impl", str(path), "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[12/12]" in proc.stdout  # the progress display ran to the end
    md = (tmp_path / "report.md").read_text()
    for section in ("## Environment", "## Memory per rank", "### Collective microbenchmark", "### Bytes per training step",
                    "## Step time", "## reshard_after_forward", "## Weak scaling", "## Loss curves", "## Memory timeline"):
        assert section in md
    for png in ("memory", "comm_bandwidth", "weak_scaling", "loss", "memory_timeline"):
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
    # The activations FSDP2 and the hand-written FSDP save are the same tensors.
    act = {(r["world"], r["run"]): r["parts"]["activations"] for r in data["memory"]}
    assert len(set(act.values())) == 1, act
    assert sorted({r["world"] for r in data["comm_bench"]}) == [2, 4]
    for r in data["comm_bench"]:
        assert r["busbw"] == pytest.approx(r["algbw"] * (r["world"] - 1) / r["world"])
    assert "m / a" in md and "comm buffers (a)" in md  # measured and analytic said apart
    positive = ([r["measured"] for r in data["memory"]] + [r["step_ms"] for r in data["step_time"]]
                + [r["seconds"] for r in data["comm_bench"]] + [r["tokens_per_s_per_rank"] for r in data["weak"]]
                + [r["peak"] for r in data["reshard"]])
    assert all(math.isfinite(x) and x > 0 for x in positive), positive

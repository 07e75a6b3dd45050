"""The CUDA path on real GPUs (NCCL), at world size 1 and 2: `uv run pytest -m cuda`.

Skipped where there are not enough GPUs. Each world size gets its own spawned pool (one GPU per
rank) and checks: every precision case bit-identical to FSDP2 (deterministic algorithms, see
harness/distributed.py), the same run twice bit-identical, a profiled run whose NCCL collectives
the analysis finds (none at world size 1, which it must call "no communication"), and a CUDA
memory snapshot that `python -m torch.cuda._memory_viz` reads. The last test runs without a GPU: the
parity body on one CPU rank, so that these tests cannot drift from the pools and checks unseen.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from harness.tools.traces import analysis
from harness.tools.grading import checks, policy
from harness.tests.test_platform import skip_unfinished

ROOT = Path(__file__).resolve().parents[2]
WORLDS = [1, 2]

pytestmark = pytest.mark.cuda


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def cuda_pool(request):
    world = request.param
    if gpus() < world:
        pytest.skip(f"needs {world} CUDA GPU(s), found {gpus()}")
    with ranks_for(world, "cuda") as ranks:
        yield ranks


def ranks_for(world: int, device: str):
    """The ranks these tests run on (test_the_path_on_one_cpu_rank walks them on one CPU rank)."""
    from harness.tools.grading.ranks import Ranks

    return Ranks(world, device=device)


def test_ranks_use_their_own_gpu_with_nccl(cuda_pool):
    devices = cuda_pool.run(rank_device)
    assert devices == [(r, "nccl", f"cuda:{r}", True) for r in range(cuda_pool.world_size)], devices


def rank_device():
    import torch.distributed as dist

    from harness.distributed import current_device

    device = current_device("auto")
    return dist.get_rank(), dist.get_backend(), str(device), torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("param_dtype, reduce_dtype", policy.PRECISIONS)
def test_parity_with_fsdp2(cuda_pool, impl, param_dtype, reduce_dtype):
    skip_unfinished(impl)
    checks.check_step(cuda_pool, impl, param_dtype, reduce_dtype)


def test_same_run_twice_is_bit_identical(cuda_pool):
    cfg = policy.config(param_dtype="bfloat16", reduce_dtype="float32")
    first = [(r.losses, r.grad_norms) for r in cuda_pool.run(train.train, cfg)]
    again = [(r.losses, r.grad_norms) for r in cuda_pool.run(train.train, cfg)]
    assert first == again, f"two identical CUDA runs differ: {first} vs {again}"


def test_trace_and_snapshot(cuda_pool, impl, tmp_path):
    skip_unfinished(impl)
    profiles = checks.profile_both(cuda_pool, impl, tmp_path, memory=True)
    world = cuda_pool.world_size
    for name, run in (("fsdp2", profiles.fsdp2), ("effdl", profiles.effdl)):
        ag = run.comm.all_gather
        if world > 1:
            assert ag.count_by_phase.get("forward") and ag.total.timed and ag.time_ms > 0, (
                f"{name}: NCCL all-gathers not found in the trace: {ag}")
            assert run.comm.reduce_scatter.count_by_phase.get("backward"), f"{name}: no reduce-scatter found"
    if world > 1:
        checks.assert_same_collectives(profiles)
    else:  # FSDP2 skips its reduce-scatter at world size 1 (_fsdp_collectives.py: `if world_size > 1`)
        assert profiles.fsdp2.comm.reduce_scatter.hidden_text == "no communication", profiles.fsdp2.comm.reduce_scatter
        table = analysis.table({"fsdp2": profiles.fsdp2, "effdl": profiles.effdl})
        assert re.search(r"reduce-scatter hidden +no communication", table), table
    snapshot = tmp_path / "effdl" / "snapshots" / "rank0.pickle"
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(snapshot),
                           "-o", str(tmp_path / "rank0.html")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and (tmp_path / "rank0.html").stat().st_size > 0, proc.stderr[-4000:]


def test_the_path_on_one_cpu_rank(impl):
    """Runs everywhere, GPU or not: the parity body above on the ranks its fixture makes, on one CPU
    rank (gloo), so that a change of the pools or checks these tests call breaks here, not first on a
    GPU."""
    skip_unfinished(impl)
    with ranks_for(1, "cpu") as ranks:
        [(rank, backend, device, _)] = ranks.run(rank_device)
        assert (rank, backend, device) == (0, "gloo", "cpu"), (rank, backend, device)
        test_parity_with_fsdp2(ranks, impl, "float32", "float32")

"""Platforms without a GPU or without Linux, proven here.

* CUDA rank pools: the start method that works with CUDA, shown by what a rank would inherit
  (a fork after torchtitan's import is marked as unable to use CUDA, even on a machine without
  a GPU), and device choice with mocked GPUs.
* macOS by simulation (`FSDP_PLATFORM=darwin`, harness/compat.py): triton unimportable, no
  /proc (opening it from this repository's code raises), no glibc, loopback chosen for gloo; a
  train.py run (memory check on) and graded checks (parity, peak memory) pass under it.
  What only a real Mac shows: its kernel and libc (ru_maxrss in bytes), Accelerate's BLAS, gloo
  on lo0 itself, and installed packages' macOS code (psutil's).
* The graded memory measure (memory.TensorPeaks), which needs no /proc, on Linux as well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from harness import compat, distributed, memory
from harness.tools.traces import analysis, collectives
from harness.errors import ConfigError
from harness.tools.grading.ranks import PRELOAD, start_method

ROOT = Path(__file__).resolve().parents[2]
DARWIN = {**os.environ, compat.SIMULATE: "darwin", "COLUMNS": "200"}


def python(*args: str, env=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env or DARWIN, capture_output=True, text=True,
                          timeout=timeout)


def show(proc: subprocess.CompletedProcess) -> str:
    return f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"


# --------------------------------------------------------------------------- CUDA rank pools


def bad_fork(results) -> None:
    """In a rank: would `torch.cuda.set_device` raise "Cannot re-initialize CUDA in forked subprocess"?"""
    results.put(torch.cuda._is_in_bad_fork())


def started_in_bad_fork(method: str, preload: list[str]) -> bool:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(preload)
    results = ctx.Queue()
    p = ctx.Process(target=bad_fork, args=(results,))
    p.start()
    try:
        return results.get(timeout=300)
    finally:
        p.join(timeout=60)


def test_cpu_ranks_fork_from_the_preloaded_forkserver():
    assert start_method("cpu") == ("forkserver", PRELOAD)


@pytest.mark.skipif(not torch.cuda._is_compiled(), reason="this torch has no CUDA: nothing to poison")
def test_cuda_ranks_do_not_inherit_a_poisoned_fork():
    """torchtitan's import calls torch.cuda.is_available() (cudaGetDeviceCount), after which
    every fork is marked bad, GPU or not: the CPU pools' forkserver would hand CUDA ranks that."""
    assert started_in_bad_fork(*start_method("cpu")), "expected the preloaded forkserver's children to be marked"
    method, preload = start_method("cuda")
    assert not started_in_bad_fork(method, preload), f"CUDA ranks started by {method} cannot use CUDA"


def test_auto_ranks_on_a_gpu_machine_are_spawned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert start_method("auto")[0] == "spawn"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert start_method("auto") == ("forkserver", PRELOAD)


def gpus(monkeypatch, count: int, visible: str | None, local_rank: int, local_world: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


@pytest.mark.parametrize("flag", ["auto", "cuda"])
def test_one_gpu_bound_to_each_process(monkeypatch, flag):
    gpus(monkeypatch, 1, "3", local_rank=1, local_world=2)  # e.g. a scheduler gave rank 1 GPU 3
    assert distributed.pick_device(flag) == torch.device("cuda", 0)


@pytest.mark.parametrize("visible", [None, "0,1,2,3"])
def test_every_gpu_visible(monkeypatch, visible):
    gpus(monkeypatch, 4, visible, local_rank=3, local_world=4)
    assert distributed.pick_device("auto") == torch.device("cuda", 3)
    assert distributed.pick_device("cuda") == torch.device("cuda", 3)


@pytest.mark.parametrize("visible", [None, "0,1"])
def test_one_gpu_shared_by_two_ranks_is_refused(monkeypatch, visible):
    """One GPU and no binding (or a binding that lists more GPUs than are usable): not enough."""
    gpus(monkeypatch, 1, visible, local_rank=1, local_world=2)
    with pytest.raises(ConfigError, match="found 1 GPU"):
        distributed.pick_device("cuda")
    assert distributed.pick_device("auto") == torch.device("cpu")


def test_deterministic_cuda_settings():
    """Global switches (deterministic algorithms would refuse some CPU ops of other tests), so
    in a process of its own."""
    code = """
import os, torch
from harness import distributed
from torch.nn.attention import SDPBackend
from torchtitan.models.attention import ScaledDotProductAttentionWrapper as W
distributed.deterministic_cuda()
assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8", os.environ["CUBLAS_WORKSPACE_CONFIG"]
assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
assert W().sdpa_backends == [SDPBackend.MATH], W().sdpa_backends
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    proc = python("-c", code, env=env)
    assert proc.returncode == 0 and "ok" in proc.stdout, show(proc)


# --------------------------------------------------------------------------- analysis without communication


def test_no_communication_is_not_zero_percent_hidden():
    none, some = collectives.Comm(), collectives.Comm(count=2, time_ms=4.0, hidden_ms=1.0, timed=2)
    assert none.hidden_text == "no communication" and some.hidden_text == "25%"
    run = analysis.RunStats(comm=collectives.StepStats(rank=None, step=None, step_ms=10.0), memory=None,
                            steps=[], memories=[])
    table = analysis.table({"fsdp2": run})
    assert re.search(r"reduce-scatter hidden +no communication", table), table
    assert "0%" not in table, table


# --------------------------------------------------------------------------- macOS, simulated


def test_simulation_switch_is_validated(monkeypatch):
    monkeypatch.setenv(compat.SIMULATE, "windows")
    with pytest.raises(RuntimeError, match="FSDP_PLATFORM=darwin"):
        compat.platform()


def test_without_the_stand_in_torchtitan_does_not_import():
    """The blocker really hides triton, and the stand-in is what makes torchtitan importable:
    taken away, the import fails as it does on a Mac."""
    code = ("import sys; from harness import compat; del sys.modules[compat.KERNELS]; "
            "import torchtitan.models.llama3")
    proc = python("-c", code)
    assert proc.returncode != 0 and "No module named 'triton'" in proc.stderr, show(proc)


@pytest.mark.parametrize("simulate", [True, False])
def test_platform_paths(simulate):
    """Simulated: every non-Linux path; not simulated (Linux): the real kernel module and /proc.
    Either way every question to the operating system (memory available, resident set, CPU name,
    the report's environment table) is answered without this repository opening /proc."""
    code = """
import sys, torch
import train
from harness import compat, fit, memory
from harness.tools.lab import report
import torchtitan.models.llama3
stub = getattr(sys.modules[compat.KERNELS], "__harness_stub__", False)
try:
    import triton
    triton_ok = True
except ImportError:
    triton_ok = False
cpu = torch.device("cpu")
env = report.environment()
asked = fit.available_bytes(cpu) > 2**20 and memory.resident_bytes() > 2**20 and len(compat.cpu_name()) > 0
print(compat.platform(), stub, triton_ok, memory.per_step_peaks(), memory.note(cpu) is not None,
      memory.exact_available() is None, memory.peak(cpu) > 2**20, asked, len(env.cpu) > 0)
"""
    env = DARWIN if simulate else {k: v for k, v in os.environ.items() if k != compat.SIMULATE}
    proc = python("-c", code, env=env)
    assert proc.returncode == 0, show(proc)
    got = proc.stdout.split()
    if simulate:
        assert got == ["darwin", "True", "False", "False", "True", "False", "True", "True", "True"], got
    elif compat.triton_importable():
        assert got == ["linux", "False", "True", "True", "False", "True", "True", "True", "True"], got


PROC_OPENS = """
import os, sys
from pathlib import Path
import psutil
from harness import compat
for how, opens in [("open", lambda: open("/proc/meminfo").read()),
                   ("pathlib", lambda: Path("/proc/self/status").read_text()),
                   ("os.open", lambda: os.close(os.open("/proc/self/status", os.O_RDONLY))),
                   ("os.listdir", lambda: os.listdir("/proc/self")),
                   ("relative", lambda: (os.chdir("/proc"), open("meminfo").read()))]:
    try:
        opens()
        print(how, "opened")
    except compat.NoProcfs as e:
        print(how, "raised:", e)
print("psutil", psutil.virtual_memory().available > 0)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="needs a /proc to block")
def test_proc_is_blocked_under_simulated_macos():
    """A spot that forgets harness/compat.py fails here, not on a student's Mac: under simulation
    every way of opening /proc from this repository's code raises, naming FSDP_PLATFORM and the
    fix; an installed package's own Linux backend (psutil) still reads it. Without simulation
    nothing is blocked."""
    proc = python("-c", PROC_OPENS)
    assert proc.returncode == 0, show(proc)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["open", "pathlib", "os.open", "os.listdir", "relative", "psutil"]
    for line in lines[:-1]:
        assert "raised: <string>:" in line and "FSDP_PLATFORM=darwin simulates macOS, which has no /proc" in line \
            and "ask harness/compat.py" in line, line
    assert lines[-1] == "psutil True", show(proc)

    linux = {k: v for k, v in os.environ.items() if k != compat.SIMULATE}
    proc = python("-c", PROC_OPENS, env=linux)
    assert proc.returncode == 0 and proc.stdout.count(" opened") == 5, show(proc)


def test_triton_line_filter():
    """Exactly torch's flop counter's "triton not found" line is dropped, nothing else it logs."""
    import logging

    flt = compat._NoTritonLine()
    record = lambda msg: logging.LogRecord(compat.FLOP_COUNTER, logging.WARNING, __file__, 1, msg, None, None)
    assert not flt.filter(record(compat.TRITON_LINE))
    assert flt.filter(record("flop counting: some other warning"))
    if not compat.triton_importable():
        assert any(isinstance(f, compat._NoTritonLine) for f in logging.getLogger(compat.FLOP_COUNTER).filters)


def test_ru_maxrss_units():
    assert compat.rusage_bytes(3, kernel="darwin") == 3 and compat.rusage_bytes(3, kernel="linux") == 3 * 1024


def test_loopback_interface(monkeypatch):
    monkeypatch.setattr(compat.socket, "if_nameindex", lambda: [(1, "lo0"), (2, "en0")])
    monkeypatch.setenv(compat.SIMULATE, "darwin")
    assert compat.gloo_interface("127.0.0.1") == "lo0" and compat.gloo_interface("localhost") == "lo0"
    assert compat.gloo_interface("10.1.2.3") is None, "across machines gloo (or GLOO_SOCKET_IFNAME) chooses"
    if sys.platform == "linux":
        monkeypatch.delenv(compat.SIMULATE)
        monkeypatch.setattr(compat.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0")])
        monkeypatch.setattr(compat.socket, "gethostbyname", lambda name: "10.0.0.5")
        assert compat.gloo_interface("127.0.0.1") is None, "Linux with a resolvable host name: gloo's choice"

        def unresolvable(name):
            raise OSError("no such host")

        monkeypatch.setattr(compat.socket, "gethostbyname", unresolvable)
        assert compat.gloo_interface("127.0.0.1") == "lo"


def test_train_py_under_simulated_macos(tmp_path):
    """No triton, no /proc, no glibc: train.py trains with its defaults (the memory check on: it
    asks compat for the memory available), says once what its peak means, profiles, prints no
    line about triton, and refuses --exact-cpu-memory clearly. At world size 1, so the analysis has
    no reduce-scatter."""
    import train

    assert train.Config().memory_check, "the memory check is on by default: this run exercises it"
    proc = python("train.py", "--num-steps", "3", "--seq-len", "32", "--profile-steps", "1",
                  "--traces-dir", str(tmp_path / "t"), "--snapshots-dir", str(tmp_path / "s"))
    assert proc.returncode == 0, show(proc)
    assert proc.stdout.count(memory.NOTE) == 1 and proc.stdout.count("| loss ") == 3, show(proc)
    assert "triton" not in proc.stdout + proc.stderr, show(proc)
    table = analysis.table({"fsdp2": analysis.analyze_run(tmp_path / "t", tmp_path / "s")})
    assert re.search(r"reduce-scatter hidden +no communication", table), table

    proc = python("train.py", "--num-steps", "1", "--profile-steps", "0", "--exact-cpu-memory")
    assert proc.returncode == 2, show(proc)
    assert "error: --exact-cpu-memory: exact per-step CPU memory needs Linux's /proc" in proc.stderr, show(proc)


def ranks_platform() -> tuple:
    try:
        open("/proc/self/status").close()
        proc = "opened"
    except compat.NoProcfs:
        proc = "blocked"
    return (compat.platform(), os.environ.get("GLOO_SOCKET_IFNAME"), "triton" in sys.modules,
            getattr(sys.modules.get(compat.KERNELS), "__harness_stub__", False), proc)


def skip_unfinished(impl: str) -> None:
    """Checks against FSDP2 need an effdl that trains: not the skeleton's task 1 TODOs."""
    from harness.impl import impl_path, task1_undone

    path = impl_path(impl)
    if task1_undone(path):
        pytest.skip(f"{path} has task 1 to do; this compares a working FSDP with FSDP2")


def test_graded_checks_under_simulated_macos(impl):
    """The graded parity check and peak-memory check at world size 2 (gloo over loopback, chosen
    explicitly) in ranks that take every non-Linux path: the memory check compares peaks there too."""
    skip_unfinished(impl)
    code = f"""
from harness.tools.grading import checks
from harness.tools.grading.ranks import Ranks
from harness.tests.test_platform import ranks_platform
with Ranks(2) as pool:
    print("ranks", pool.trusted.run(ranks_platform))
    checks.check_step(pool, {impl!r}, "bfloat16", "float32")
    print("parity ok")
    print("memory:", checks.check_memory(pool, {impl!r}, "float32", "float32"))
"""
    proc = python("-c", code)
    assert proc.returncode == 0 and "parity ok" in proc.stdout, show(proc)
    assert "ranks [('darwin', 'lo', False, True, 'blocked'), ('darwin', 'lo', False, True, 'blocked')]" \
        in proc.stdout, show(proc)
    assert re.search(r"memory: peak [-+]\d+\.\d MiB over FSDP2 \(allowed \+\d+\.\d\)", proc.stdout), show(proc)
    assert "triton" not in proc.stdout + proc.stderr, show(proc)


def uv() -> list[str] | None:
    import shutil

    if exe := shutil.which("uv"):
        return [exe]
    probe = subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True)
    return [sys.executable, "-m", "uv"] if probe.returncode == 0 else None


@pytest.mark.skipif(uv() is None, reason="uv is not installed")
@pytest.mark.parametrize("target, installs", [
    ("aarch64-apple-darwin", True), ("aarch64-unknown-linux-gnu", True), ("x86_64-unknown-linux-gnu", True),
    ("x86_64-apple-darwin", False),  # torch 2.11 has no Intel-Mac wheel: proves the check can fail
])
def test_lock_installs_on(target, installs, tmp_path):
    """`uv sync --frozen` for another platform, planned from uv.lock alone (offline, installs nothing)."""
    env = {**os.environ, "UV_OFFLINE": "1", "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")}
    proc = subprocess.run([*uv(), "sync", "--frozen", "--dry-run", "--python-platform", target], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if installs:
        assert proc.returncode == 0 and "+ torch==2.11.0" in proc.stderr + proc.stdout, show(proc)
        assert ("+ triton==" in proc.stderr + proc.stdout) == target.endswith("linux-gnu"), show(proc)
    else:
        assert proc.returncode != 0 and "torch" in proc.stderr, show(proc)


# --------------------------------------------------------------------------- the graded memory measure


def _drop(tensors: list) -> None:
    tensors.clear()


def test_tensor_peaks_count_every_thread():
    """memory.TensorPeaks, which needs no /proc and so runs on Linux too: exact peaks and end
    levels per interval, and a free on another thread (gloo frees buffers on its worker threads)
    counted, which the profiler alone misses."""
    import threading

    MiB = 2**20
    with memory.TensorPeaks() as tp:
        tp.mark()  # 0
        x = torch.empty(4 * MiB, dtype=torch.uint8)
        y = torch.empty(2 * MiB, dtype=torch.uint8)
        del y
        tp.mark()  # 1: peak +6 MiB, holds +4 MiB
        held = [x]
        del x
        worker = threading.Thread(target=_drop, args=(held,))
        worker.start()
        worker.join()
        after = torch.empty(64, dtype=torch.uint8)  # the next event carries the other thread's free
        tp.mark()  # 2: holds +64 B
    del after
    (_, peak1, peak2), (base, level1, level2) = tp.peaks, tp.levels
    assert (peak1 - base, level1 - base) == (6 * MiB, 4 * MiB), (tp.peaks, tp.levels)
    assert level2 - base == 64 and peak2 == level1, (tp.peaks, tp.levels)
    assert not memory.allocator_flag().value, "the allocator's flag is put back"


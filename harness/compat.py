"""What differs between the platforms the course runs on, in one place.

* **triton** is installed with torch on Linux only. torchtitan imports its MoE kernel module
  (`torchtitan.models.moe.kernels`, a triton kernel for routing tokens to experts) whenever
  `torchtitan.models` is imported, although the Llama model never calls it. Where triton
  cannot be imported, `install()` puts a stand-in for that one module in `sys.modules`: same
  names, each raising if ever called. No other torchtitan or torch code is replaced, so the
  model's numerics are those of the real modules. torch's flop counter then logs "triton not
  found" once per process (a CUDA build without triton: the Linux wheel under simulation); that
  one line is filtered out, since nothing here counts flops of triton kernels.
* **The operating system** is asked here and nowhere else: memory available (`available_memory`,
  psutil), resident and peak resident set (`resident_bytes`, `peak_rss`, `reset_peak_rss`), the
  CPU's name (`cpu_name`), glibc (`glibc`). Only the Linux branches touch `/proc`.
* **Platform**: `platform()` is `sys.platform`, unless `FSDP_PLATFORM=darwin` asks to simulate
  macOS on Linux. The simulation takes every non-Linux code path here: triton is made
  unimportable (a meta-path blocker, so `import triton` fails as where it is not installed),
  there is no `/proc` and no glibc's `mallopt` (harness/memory.py), and gloo is bound to the
  loopback interface explicitly (harness/distributed.py). `/proc` is blocked at the file level:
  an audit hook makes any open (`open`, `io.open`, `pathlib`, `os.open`, `os.listdir`,
  `os.scandir`) of a path under `/proc` by this repository's code raise `NoProcfs`, so a spot
  that forgets to ask this module fails a test instead of a student's Mac.
  What it cannot simulate: the macOS kernel and libc themselves (e.g. `ru_maxrss` in bytes,
  which is read by the real platform's rules), Apple's Accelerate BLAS, and installed packages'
  own macOS code: they still see `sys.platform == "linux"` and may read `/proc` (psutil's Linux
  backend does, for `available_memory` and `resident_bytes`); that is allowed, because on a Mac
  the same calls take the package's macOS path (psutil asks the kernel through sysctl and mach),
  which the package's own tests cover.

`install()` runs when the `harness` package is imported, so it precedes torchtitan in
train.py, in every rank a RankPool starts, and in the tools and tests.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.util
import logging
import os
import platform as py_platform
import resource
import shutil
import socket
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

SIMULATE = "FSDP_PLATFORM"
KERNELS = "torchtitan.models.moe.kernels"


def platform() -> str:
    """`sys.platform`, or the one `FSDP_PLATFORM` simulates (only `darwin` is supported)."""
    forced = os.environ.get(SIMULATE, "")
    if forced not in ("", "darwin", sys.platform):
        raise RuntimeError(f"{SIMULATE}={forced!r} is not supported: use {SIMULATE}=darwin (simulate macOS) or unset it")
    return forced or sys.platform


def simulated() -> bool:
    return platform() != sys.platform


class _BlockTriton(importlib.abc.MetaPathFinder):
    """Makes `import triton` fail as it does where triton is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} ({SIMULATE}={platform()} blocks it)", name=name)
        return None


def triton_importable() -> bool:
    try:  # find_spec looks without importing (importing triton costs time in every process)
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def _kernels_stub() -> types.ModuleType:
    module = types.ModuleType(KERNELS, f"Stand-in for {KERNELS} where triton is absent (harness/compat.py).")

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{KERNELS} needs triton, which this platform lacks; the Llama model never "
                           "calls it (only torchtitan's mixture-of-experts models do)")

    module.generate_permute_indices = module.fill_indices_wrapper = unavailable
    module.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    module.__harness_stub__ = True
    return module


def install() -> None:
    """Idempotent: under simulation block triton and /proc; where triton is absent stand in for
    torchtitan's triton kernel module and silence torch's flop counter's line about it."""
    global _proc_blocked
    if simulated() and not any(isinstance(f, _BlockTriton) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockTriton())
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            del sys.modules[name]  # imported before the switch: forget it
    if simulated() and not _proc_blocked:
        sys.addaudithook(_block_procfs)  # for the life of the process: hooks cannot be removed
        _proc_blocked = True
    if not triton_importable():
        if KERNELS not in sys.modules:
            sys.modules[KERNELS] = _kernels_stub()
        flops = logging.getLogger(FLOP_COUNTER)
        if not any(isinstance(f, _NoTritonLine) for f in flops.filters):
            flops.addFilter(_NoTritonLine())


# torch/utils/flop_counter.py logs this once when imported in a CUDA build of torch without triton;
# torch imports it lazily in the first training step (through torch._dynamo), once per rank.
FLOP_COUNTER = "torch.utils.flop_counter"
TRITON_LINE = "triton not found; flop counting will not work for triton kernels"


class _NoTritonLine(logging.Filter):
    """Drops exactly the flop counter's "triton not found" line: expected where triton is absent,
    and about flop counting of triton kernels, which nothing here does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TRITON_LINE)


# --------------------------------------------------------------------------- /proc under simulation


class NoProcfs(RuntimeError):
    """Raised under FSDP_PLATFORM=darwin when this repository's code opens a path under /proc."""


_proc_blocked = False
_STDLIB = tuple({sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")})
_PACKAGES = tuple({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
_PROC_EVENTS = {"open", "os.listdir", "os.scandir"}


def _block_procfs(event: str, args: tuple) -> None:
    """Audit hook (simulation only): an open of /proc by code of this repository raises.

    The caller is the innermost frame outside the standard library (so `Path.read_text` and
    `io.open` count as their caller's). Installed packages are let through: they still take
    their Linux code under simulation (psutil's Linux backend reads /proc), and on a Mac their
    macOS code, which reads none."""
    if event not in _PROC_EVENTS or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return  # os.scandir(fd), open(fd): no path
    path = os.path.normpath(os.path.abspath(os.fsdecode(args[0])))
    if path != "/proc" and not path.startswith("/proc/"):
        return
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(_PACKAGES):  # (a virtual environment's packages lie inside its stdlib prefix)
            return
        if not (file.startswith(_STDLIB) or file.startswith("<frozen ")):
            break
        frame = frame.f_back
    if frame is None:
        return  # the standard library alone, on a thread of its own
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    raise NoProcfs(f"{where} opens {path}, but {SIMULATE}=darwin simulates macOS, which has no /proc: "
                   "ask harness/compat.py (available_memory, resident_bytes, cpu_name, ...) instead, "
                   f"which knows what each platform offers; unset {SIMULATE} to run as Linux")


# --------------------------------------------------------------------------- asking the operating system


def available_memory() -> int:
    """Bytes of memory this machine can still give (psutil: MemAvailable on Linux; free plus
    inactive pages on macOS, from the kernel through mach)."""
    import psutil

    return psutil.virtual_memory().available


def resident_bytes() -> int:
    """This process's resident set size now (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss


_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def peak_rss_resettable() -> bool:
    """Whether the peak resident set can be reset (Linux: /proc/self/clear_refs); elsewhere the
    only peak there is is the one since the process started (getrusage)."""
    return platform() == "linux" and _CLEAR_REFS.exists()


def reset_peak_rss() -> None:
    """Linux: reset this process's peak resident set (VmHWM); a no-op where it cannot be reset."""
    if peak_rss_resettable():
        libc = ctypes.CDLL(None, use_errno=True)
        # A process that changed user (a sandboxed rank, harness/tools/grading/sandbox.py) is not dumpable, so that
        # other processes of its user cannot read or trace it, and its /proc/self is root's: dumpable only while
        # it writes there (PR_GET_DUMPABLE 3, PR_SET_DUMPABLE 4).
        was = libc.prctl(3, 0, 0, 0, 0)
        if was == 0:
            libc.prctl(4, 1, 0, 0, 0)
        try:
            _CLEAR_REFS.write_text("5")
        finally:
            if was == 0:
                libc.prctl(4, 0, 0, 0, 0)


def peak_rss() -> int:
    """Bytes: the peak resident set since the last reset_peak_rss (Linux), else since the process
    started (getrusage)."""
    if peak_rss_resettable():
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return rusage_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rusage_bytes(maxrss: int, kernel: str = sys.platform) -> int:
    """ru_maxrss in bytes: macOS reports bytes, Linux KiB. The real kernel decides, not the simulation."""
    return maxrss if kernel == "darwin" else maxrss * 1024


def glibc() -> ctypes.CDLL | None:
    """glibc (for mallopt) on Linux; None elsewhere (macOS's libc, musl)."""
    if platform() != "linux":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # e.g. musl
        return None


def cpu_name() -> str:
    """The CPU's model name as the platform's own tool reports it (macOS: `sysctl -n
    machdep.cpu.brand_string`, e.g. "Apple M2"; Linux: lscpu's "Model name"), else what the
    platform module knows (an architecture such as "arm" or "x86_64")."""
    if platform() == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"]).strip()
    else:
        name = next((line.split(":", 1)[1].strip() for line in _run(["lscpu"]).splitlines()
                     if line.startswith("Model name:")), "")
    return name or py_platform.processor() or py_platform.machine() or "unknown"


def _run(command: list[str]) -> str:
    """A tool's output, or "" where it is missing or fails (then the caller falls back)."""
    if shutil.which(command[0]) is None:
        return ""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def gloo_interface(master_addr: str) -> str | None:
    """The network interface gloo should use, or None for gloo's own choice.

    gloo binds to the address the host name resolves to. With every rank on this machine
    (MASTER_ADDR a loopback address) that must be the loopback interface: on macOS the host
    name often resolves to Wi-Fi's address or not at all, so the interface is named there
    (`lo0`); on Linux only when the host name does not resolve. Across machines (any other
    MASTER_ADDR) gloo chooses, or GLOO_SOCKET_IFNAME does."""
    if not _is_loopback(master_addr):
        return None
    if platform() != "darwin":
        try:
            socket.gethostbyname(socket.gethostname())
            return None
        except OSError:
            pass
    names = {name for _, name in socket.if_nameindex()}
    # macOS calls it lo0, Linux lo (the simulation on Linux gets lo: the name is the real one).
    return next((n for n in ("lo0", "lo") if n in names), None)


def _is_loopback(addr: str) -> bool:
    try:
        return addr == "localhost" or socket.inet_aton(addr)[0] == 127
    except OSError:
        return False

"""Peak memory per training step: CUDA's peak allocated, or on CPU the process's peak resident set.

On Linux the peak resident set (VmHWM in /proc/self/status) is reset before every step through
/proc/self/clear_refs, so each step reports its own peak. Elsewhere (macOS, or FSDP_PLATFORM=darwin,
see harness/compat.py) the best the platform offers is `getrusage`'s peak since the process
started, which cannot be reset: each step then reports the largest peak so far (`NOTE`).
"""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path

import torch

from harness import compat
from harness.errors import ConfigError

LINUX = compat.platform() == "linux"
# None where the platform has no /proc: the code below never touches it then.
_CLEAR_REFS, _STATUS = (Path("/proc/self/clear_refs"), Path("/proc/self/status")) if LINUX else (None, None)

NOTE = ("note: peak rss is the peak since the process started (getrusage): this platform has no "
        "/proc to reset it, so each step shows the largest peak so far, not its own")


def per_step_peaks() -> bool:
    """Whether CPU peaks are reset per step (Linux with /proc)."""
    return _CLEAR_REFS is not None and _CLEAR_REFS.exists()


def exact_available() -> str | None:
    """None where --exact-cpu-memory works (per-step peaks and glibc); else why not."""
    if not per_step_peaks():
        return f"exact per-step CPU memory needs Linux's /proc (this platform: {compat.platform()})"
    if not _glibc():
        return "exact per-step CPU memory needs glibc's mallopt (this C library is not glibc)"
    return None


def note(device: torch.device) -> str | None:
    """What the logged peak means where it is not the step's own; printed once per run."""
    return NOTE if device.type == "cpu" and not per_step_peaks() else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif per_step_peaks():
        _CLEAR_REFS.write_text("5")  # Linux: resets this process's peak RSS (VmHWM)


def peak(device: torch.device) -> int:
    """Bytes: CUDA's peak allocated; on CPU the step's peak resident set size (exact only with
    exact_cpu_memory(), see there; the peak since start where it cannot be reset, see NOTE)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if (value := _status_bytes("VmHWM")) is not None:
        return value
    return rusage_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def rusage_bytes(maxrss: int, kernel: str = sys.platform) -> int:
    """ru_maxrss in bytes: macOS reports bytes, Linux KiB. The real kernel decides, not the simulation."""
    return maxrss if kernel == "darwin" else maxrss * 1024


def resident_bytes() -> int:
    """Bytes resident now (Linux; 0 where /proc is missing)."""
    return _status_bytes("VmRSS") or 0


def label(device: torch.device) -> str:
    return "peak alloc" if device.type == "cuda" else "peak rss"


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (Linux), in bytes; None where there is none."""
    if _STATUS is not None and _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _glibc() -> ctypes.CDLL | None:
    if not LINUX:
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # e.g. musl
        return None


def exact_cpu_memory() -> None:
    """Make peak RSS a faithful CPU memory measure (--exact-cpu-memory): with a fixed mmap
    threshold (glibc), every allocation of 64 KiB or more gets its own mapping and goes back to
    the OS when freed, on whichever thread frees it (gloo frees buffers on its own threads, which
    the profiler's memory events miss). Without it glibc keeps freed blocks for reuse, so RSS
    shows the most the process ever held. The setting lasts for the life of the process.
    Refused where it cannot work (no /proc to reset the peak, or no glibc)."""
    if why := exact_available():
        raise ConfigError(f"--exact-cpu-memory: {why}; run without it (the logged peak rss is then "
                          "coarser) or on Linux")
    _glibc().mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD

"""Peak memory per training step: CUDA's peak allocated, or on CPU the process's peak resident set."""

from __future__ import annotations

import ctypes
import resource
import sys
from pathlib import Path

import torch

_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _CLEAR_REFS.exists():
        _CLEAR_REFS.write_text("5")  # Linux: resets this process's peak RSS (VmHWM)


def peak(device: torch.device) -> int:
    """Bytes: CUDA's peak allocated; on CPU the step's peak resident set size (exact only with
    exact_cpu_memory(), see there)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if (value := _status_bytes("VmHWM")) is not None:
        return value
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # elsewhere: the peak since start
    return value if sys.platform == "darwin" else value * 1024  # macOS reports bytes, Linux KiB


def resident_bytes() -> int:
    """Bytes resident now (Linux; 0 where /proc is missing)."""
    return _status_bytes("VmRSS") or 0


def label(device: torch.device) -> str:
    return "peak alloc" if device.type == "cuda" else "peak rss"


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (Linux), in bytes; None where there is none."""
    if _STATUS.exists():
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def exact_cpu_memory() -> None:
    """Make peak RSS a faithful CPU memory measure (--exact-cpu-memory): with a fixed mmap
    threshold (glibc), every allocation of 64 KiB or more gets its own mapping and goes back to
    the OS when freed, on whichever thread frees it (gloo frees buffers on its own threads, which
    the profiler's memory events miss). Without it glibc keeps freed blocks for reuse, so RSS
    shows the most the process ever held. The setting lasts for the life of the process."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass  # not glibc: peak RSS is then coarser

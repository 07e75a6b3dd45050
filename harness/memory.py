"""Memory per training step: CUDA's peak allocated; on CPU the process's peak resident set, and
(any platform) the peak bytes of tensors, `TensorPeaks`.

Peak resident set (what train.py logs): on Linux it is reset before every step through
/proc/self/clear_refs, so each step reports its own peak. Elsewhere (macOS, or FSDP_PLATFORM=darwin,
see harness/compat.py) the best the platform offers is `getrusage`'s peak since the process
started, which cannot be reset: each step then reports the largest peak so far (`NOTE`).
harness/compat.py asks the operating system; this module never touches /proc itself.

TensorPeaks (what the graded memory check compares, on every platform): the most bytes c10's CPU
allocator held at once in each step, counted on every thread, from the profiler's allocation
events. See its docstring for what it sees and misses beside the resident set.
"""

from __future__ import annotations

import contextlib

from pathlib import Path

import torch

from harness import compat
from harness.errors import ConfigError

NOTE = ("note: peak rss is the peak since the process started (getrusage): this platform has no "
        "/proc to reset it, so each step shows the largest peak so far, not its own")


def per_step_peaks() -> bool:
    """Whether CPU peaks are reset per step (Linux with /proc)."""
    return compat.peak_rss_resettable()


def exact_available() -> str | None:
    """None where --exact-cpu-memory works (per-step peaks and glibc); else why not."""
    if not per_step_peaks():
        return f"exact per-step CPU memory needs Linux's /proc (this platform: {compat.platform()})"
    if not compat.glibc():
        return "exact per-step CPU memory needs glibc's mallopt (this C library is not glibc)"
    return None


def note(device: torch.device) -> str | None:
    """What the logged peak means where it is not the step's own; printed once per run."""
    return NOTE if device.type == "cpu" and not per_step_peaks() else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        compat.reset_peak_rss()


def peak(device: torch.device) -> int:
    """Bytes: CUDA's peak allocated; on CPU the step's peak resident set size (exact only with
    exact_cpu_memory(), see there; the peak since start where it cannot be reset, see NOTE)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return compat.peak_rss()


def resident_bytes() -> int:
    """Bytes resident now (any platform)."""
    return compat.resident_bytes()


def label(device: torch.device) -> str:
    return "peak alloc" if device.type == "cuda" else "peak rss"


def exact_cpu_memory() -> None:
    """Make peak RSS a faithful CPU memory measure (--exact-cpu-memory): with a fixed mmap
    threshold (glibc), every allocation of 64 KiB or more gets its own mapping and goes back to
    the OS when freed, on whichever thread frees it (gloo frees buffers on its own threads). Without
    it glibc keeps freed blocks for reuse, so RSS shows the most the process ever held. The setting
    lasts for the life of the process. Refused where it cannot work (no /proc to reset the peak,
    or no glibc)."""
    if why := exact_available():
        raise ConfigError(f"--exact-cpu-memory: {why}; run without it (the logged peak rss is then "
                          "coarser) or on Linux")
    compat.glibc().mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


# --------------------------------------------------------------------------- tensor memory, any platform


class TensorPeaks:
    """Tensor memory: the most bytes c10's CPU allocator held at once between marks, counted on
    every thread. What the graded memory check compares, the same on every platform (no /proc, no
    glibc, no CUDA).

        with TensorPeaks() as tp:
            train.train(cfg, inspect=lambda model, step: tp.mark())
        tp.peaks   # bytes, per interval: the most held at once since the previous mark (the first
                   # interval starts at __enter__)
        tp.levels  # bytes held at each mark

    Two pieces of torch: c10's CPU allocator keeps a running total of the bytes it handed out, on
    every thread under one mutex, while its flag `caffe2_report_cpu_memory_usage` is set (exported by
    libc10 as FLAGS_caffe2_report_cpu_memory_usage, set here through ctypes and put back on exit; the
    lines it logs are below c10's default log level); and the profiler (profile_memory=True) records
    that total at every allocation and free on the threads it watches. Without the flag the total
    drops only on watched threads, and gloo frees buffers on its own worker threads (the last
    reference to a finished collective's work is often dropped there): the total drifts up by every
    such buffer, by tens of MiB over 4 steps of the debug model. The profiler's
    `_ExperimentalConfig(profile_all_threads=True)` is no cure in torch 2.11: it records no
    allocation events at all. With the flag a free counts wherever it happens, and the next recorded
    event carries it; each mark allocates and frees one byte, so the total at a mark is exact.

    Seen: every tensor storage from c10's CPU allocator allocated after __enter__, whoever allocates
    or frees it (parameters, gradients, optimizer state, activations, communication buffers, gloo's
    copy of a collective's input), to the byte. Not seen, where the resident set sees it: memory that
    is not a tensor (gloo's transport buffers, Python objects, oneDNN/BLAS scratch), what malloc keeps
    or wastes (freed memory kept for reuse, fragmentation), and a peak that an allocation on an
    unwatched thread reaches and leaves before the next recorded event.

    The profiler runs for its whole extent (it records every op meanwhile), so it cannot be nested
    in another torch.profiler: train.py's --profile-steps must be 0.
    """

    FLAG = "FLAGS_caffe2_report_cpu_memory_usage"
    MARK = "## tensor memory mark ##"

    def __init__(self):
        self.peaks: list[int] = []
        self.levels: list[int] = []
        self._prof = None
        self._flag = None
        self._was = False

    def __enter__(self) -> TensorPeaks:
        from torch.profiler import ProfilerActivity

        from harness import profiling

        self._flag = allocator_flag()
        self._was, self._flag.value = self._flag.value, True
        profiling._quiet_cpu_profiler()
        self._prof = torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with profiling._no_cycle_warning():
            self._prof.__enter__()
        self.mark()
        return self

    def mark(self) -> None:
        """The end of a step (and the start of the next). A byte allocated and freed at once inside
        the mark makes the allocator report its total there, whatever happened on other threads."""
        with torch.profiler.record_function(self.MARK):
            torch.empty(1, dtype=torch.uint8)

    def __exit__(self, *exc) -> None:
        from harness import profiling

        try:
            with profiling._no_cycle_warning():
                self._prof.__exit__(*exc)
        finally:
            self._flag.value = self._was
        if exc[0] is None:
            self.peaks, self.levels = _peaks(self._prof.profiler.kineto_results.experimental_event_tree(), self.MARK)


@contextlib.contextmanager
def allocations_counted():
    """c10's CPU allocator counts bytes on every thread (TensorPeaks' flag) for the extent, put back after: a
    profile with allocation events then carries the exact total at each event, frees on other threads
    included (what harness/tools/traces/memory_analysis.tensor_peaks reads)."""
    flag = allocator_flag()
    was, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = was


def allocator_flag():
    """c10's flag that makes its CPU allocator count bytes on every thread, as a ctypes bool."""
    import ctypes

    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libc10.*"))  # libc10.so (Linux), libc10.dylib (macOS)
    if not found:
        raise RuntimeError(f"no libc10 library in {lib}: this torch is laid out differently; "
                           "harness/memory.py's allocator_flag needs updating")
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(str(found[0])), TensorPeaks.FLAG)
    except ValueError:
        raise RuntimeError(f"{found[0].name} has no {TensorPeaks.FLAG}: this torch counts CPU memory "
                           "differently; harness/memory.py's TensorPeaks needs updating") from None


def _peaks(tree, mark: str) -> tuple[list[int], list[int]]:
    """(peak per interval between marks, the total at each mark but the first) from a profile's
    event tree: allocation events carry the allocator's total after them; a mark's own byte is
    not part of any peak."""
    from torch._C._profiler import _EventType

    def allocations(node) -> list:
        found, stack = [], [node]
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                found.append((e.start_time_ns, e.extra_fields.total_allocated))
        return sorted(found)

    events, stack = [], list(tree)
    while stack:
        e = stack.pop()
        if e.name == mark:
            at_mark = allocations(e)
            events.append((e.start_time_ns, 0, at_mark[-1][1] if at_mark else None))
            continue
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, 1, e.extra_fields.total_allocated))
    events.sort(key=lambda x: x[:2])
    peaks, levels, level, peak, started = [], [], 0, 0, False
    for _, kind, total in events:
        if kind == 0:
            level = level if total is None else total
            if started:
                peaks.append(max(peak, level))
                levels.append(level)
            started, peak = True, level
        else:
            level = total
            peak = max(peak, total)
    return peaks, levels

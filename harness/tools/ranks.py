"""A pool of spawned ranks that stays up between jobs.

Tests and the benchmark need a process group without an external launcher, and
importing torchtitan costs ~10 s per process, so the ranks are spawned once and
then run many jobs:

    with RankPool(world_size=2) as pool:
        results = pool.run(train.train, cfg)   # one result per rank

CPU ranks fork from a forkserver that has imported train.py and torchtitan once, so a
new pool costs well under a second instead of an import per rank. CUDA ranks cannot: importing
torchtitan asks `torch.cuda.is_available()` (torchtitan/tools/utils.py), whose
`cudaGetDeviceCount` marks every later fork as unable to use CUDA ("Cannot re-initialize CUDA
in forked subprocess", torch/cuda/__init__.py), so they are spawned and import it themselves.
A job is any importable function; it runs on every rank inside the already initialised
process group. If a rank raises, `run` raises `RankError` with that
rank's traceback. If ranks do not answer in time (usually a collective waiting
on a rank that went another way), `run` raises `RankTimeout` naming them. When
every rank answered (even with an error) the pool stays up; when some rank hangs it
is shut down, since a half-finished collective cannot be recovered.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from harness import impl
from harness.distributed import free_port, init_distributed, shutdown_distributed
from harness.errors import BAD_INPUT, FAILED, ConfigError, stop


# Imported once by the forkserver; every rank forks with them loaded. The forkserver is a
# clean single-threaded process (nothing ran in it), which makes forking it safe.
PRELOAD = ["train", "torchtitan.models.llama3", "torchtitan.hf_datasets.text_datasets",
           "torchtitan.components.tokenizer"]


def start_method(device: str) -> tuple[str, list[str]]:
    """(multiprocessing start method, modules the forkserver preloads) for ranks on `device`."""
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.device_count() > 0)
    return ("spawn", []) if cuda else ("forkserver", PRELOAD)


def start_forkserver() -> None:
    """Start the CPU ranks' forkserver now: it imports PRELOAD (seconds) in the background while
    the caller goes on (pytest collecting, say), and the first RankPool forks from it at once."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def rank_threads(world_size: int) -> int:
    """Intra-op threads of each CPU rank: the cores shared out (how a reduction splits its work, and so
    its rounding, can depend on it)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class RankError(RuntimeError):
    """A job raised on some rank."""


class RankTimeout(RankError):
    """Some ranks did not finish a job in time."""



def _worker(rank: int, world_size: int, port: int, device: str, threads: int, jobs, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(threads)
        init_distributed(device)
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while (job := jobs.get()) is not None:
        fn, args, kwargs = job
        torch.set_num_threads(threads)  # whatever an earlier job (a file under test) set
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    shutdown_distributed()


class RankPool:
    def __init__(self, world_size: int, *, device: str = "cpu", start_timeout: float = 180.0):
        method, preload = start_method(device)
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(preload)
        self.world_size = world_size
        self.device = device
        self.threads = threads = rank_threads(world_size)
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker, args=(r, world_size, port, device, threads, self._jobs[r], self._results),
                daemon=True, name=f"rank{r}",
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up", start_timeout, expect="ready")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results."""
        if self._procs is None:
            raise RankError("the rank pool was shut down after an earlier failure; start a new one")
        for q in self._jobs:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout, expect="ok")

    def _collect(self, what: str, timeout: float, expect: str, grace: float = 30.0) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world_size:
            if errors:  # the other ranks get a grace period, then are presumed stuck
                deadline = min(deadline, time.monotonic() + grace)
            try:
                rank, status, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    self.close()
                    codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in dead)
                    raise RankError(f"{what}: a rank process died ({codes}) without a Python traceback "
                                    "(killed for memory, or a crash in native code)") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in out and r not in errors]
                    self.close()
                    if errors:
                        raise RankError(self._report(what, errors) + f"\n(rank(s) {missing} then hung: "
                                        "the pool was shut down)") from None
                    raise RankTimeout(
                        f"{what}: rank(s) {missing} did not finish within {timeout:.0f} s. Usually a "
                        "collective is waiting for a rank that skipped it or issued a different one "
                        "(check that every rank runs the same all-gathers and reduce-scatters in the "
                        "same order)."
                    ) from None
                continue
            (errors if status == "error" else out)[rank] = value
        if errors:  # every rank answered, so none is stuck: the pool stays usable
            raise RankError(self._report(what, errors))
        return [out[r] for r in range(self.world_size)]

    @staticmethod
    def _report(what: str, errors: dict[int, str]) -> str:
        first = min(errors)
        same = [r for r in errors if errors[r].splitlines()[-1:] == errors[first].splitlines()[-1:]]
        return f"{what} failed on rank(s) {sorted(errors)}; traceback of rank {first}" + \
            (f" (ranks {same} ended the same way)" if len(same) > 1 else "") + f":\n{errors[first]}"

    def close(self) -> None:
        if self._procs is None:
            return
        for q, p in zip(self._jobs, self._procs):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_tool(main: Callable[[Any], Any], args: Any, what: str) -> None:
    """A tool's `main(args)` on ranks it starts: input that cannot run as given (ConfigError) and a
    file under test that stops at a TODO each end in one error line, saying how to go on."""
    try:
        main(args)
    except ConfigError as e:  # --impl or --device as given cannot run; the message says how to fix it
        stop(str(e), BAD_INPUT)
    except RankError as e:
        if not (todo := impl.todo_reached(e)):
            raise
        stop(f"{todo} (in {impl.impl_path(args.impl)}): {what} needs a file that trains (task 1 done)", FAILED)

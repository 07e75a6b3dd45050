"""Pools of spawned ranks that stay up between jobs.

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

The trust boundary: a pool has one role, for its whole life.
- "trusted": FSDP2 and the harness's own jobs. Its ranks refuse to import a file under test
  (harness.impl.refuse_files), so nothing a submission did can be in a process whose results
  the grader keeps (the FSDP2 store) or unpickles.
- "sandboxed": the file under test. Its ranks become the unprivileged sandbox user when the grader
  is root (harness/tools/grading/sandbox.py), before any job runs, and send results as data only
  (harness/tools/grading/wire.py: JSON and safetensors, decoded against the job's return annotation, with
  a size cap), each rank on its own pipe, so the rank a result is from is never taken from the
  message. After every job a rank checks that nothing of torch's, Python's or the harness's code or
  settings was left changed (harness/tools/grading/tamper.py); a job after which something was is void.
  What its runs write (traces, snapshots, checkpoints) goes to the sandbox's own folder
  and is copied back as plain files. When it closes, `sandbox.sweep` kills what its ranks left, and
  `sandbox.sweep_files` removes what they left in /tmp, /var/tmp and /dev/shm (not what another live pool holds).
- "own": a student's own tools (benchmark, report, handin's profiled runs), both FSDPs in one
  pool, as the user who runs them: no boundary, nothing of anyone else's to protect.
`Ranks` holds one world size's trusted and sandboxed pools for the graded checks.
"""

from __future__ import annotations

import os
import pickle
import secrets
import time
import traceback
from collections.abc import Callable
from pathlib import Path
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

    from harness.tools.grading import sandbox

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with sandbox.launching():  # [Note: what a rank starts with]
        forkserver.ensure_running()


def rank_threads(world_size: int) -> int:
    """Intra-op threads of each CPU rank: the cores shared out (how a reduction splits its work, and so
    its rounding, can depend on it)."""
    return max(1, (os.cpu_count() or 1) // world_size)


class RankError(RuntimeError):
    """A job raised on some rank."""


class RankTimeout(RankError):
    """Some ranks did not finish a job in time."""


class Refused(RankError):
    """A rank of a file under test sent something that is not a result of the job's declared type."""


ROLES = ("trusted", "sandboxed", "own")
TRUSTED_ONLY = ("this rank trains FSDP2 for the grader (a trusted pool): a file under test is never imported "
                "into it; run it on a sandboxed pool (checks.run, Ranks.run)")


def _worker(role: str, rank: int, world_size: int, port: int, device: str, threads: int, conn, private) -> None:
    # Become the sandbox user first: in the target, after multiprocessing rebuilt what it was handed
    # (this connection), before any job (a file under test) is unpickled or imported.
    from harness.tools.grading import wire

    data = role == "sandboxed"

    def send(job: int, status: str, value: Any = None, fn: Callable | None = None, tb: str = "") -> None:
        if not data:
            conn.send_bytes(pickle.dumps((job, status, value, tb)))
            return
        try:
            message = wire.encode(job, status, value, wire.result_type(fn) if status == "ok" else None, tb)
        except BaseException:
            message = wire.encode(job, "error", traceback=f"{getattr(fn, '__qualname__', fn)}'s result cannot be "
                                  f"sent as data:\n{traceback.format_exc()}")
        conn.send_bytes(message)

    try:
        if data:
            from harness.tools.grading import sandbox

            conn.recv_bytes()  # the pool's go-ahead: this rank is in the registry of live ranks (sandbox.py)
            sandbox.enter(private)
        elif role == "trusted":
            impl.refuse_files(TRUSTED_ONLY)
    except BaseException:
        send(0, "error", tb=traceback.format_exc())
        return

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch

        torch.set_num_threads(threads)
        init_distributed(device)
        from harness.tools.traces.schedule import gate_collectives

        gate_collectives()  # before any job, so before any file under test is imported (its [Note])
        if data:  # what the process runs before any file under test is imported (tamper.py)
            from harness.tools.grading import jobs, tamper  # noqa: F401  (the jobs' code is in the baseline)

            impl.guard_enum_api()  # the loader's, in place before the baseline is read
            baseline = tamper.Baseline()
            extend, changes, void = baseline.extend, baseline.changes, tamper.void
        send(0, "ready")
    except BaseException:
        send(0, "error", tb=traceback.format_exc())
        return
    while True:
        try:
            job = pickle.loads(conn.recv_bytes())
        except EOFError:  # the pool's side is gone
            break
        if job is None:
            break
        number, fn, args, kwargs = job
        torch.set_num_threads(threads)  # whatever an earlier job (a file under test) set
        try:
            if data:
                extend()
            value, failed = fn(*args, **kwargs), None
        except BaseException:
            value, failed = None, traceback.format_exc()
        try:  # after a failed job too: what it changed stays changed for the jobs after it
            changed = changes() if data else []
        except BaseException:
            changed = [f"(the check itself failed: {traceback.format_exc()})"]
        if changed:  # the job ran beside code of the file's own in torch's or the harness's place
            send(number, "error", tb=void(changed))
        elif failed is not None:
            send(number, "error", tb=failed)
        else:
            send(number, "ok", value, fn)
    shutdown_distributed()


# train.Config's folders a run writes into: a sandboxed run writes them in the sandbox's own folder
OUTPUTS = ("traces_dir", "snapshots_dir", "checkpoint_dir")


class RankPool:
    def __init__(self, world_size: int, *, device: str = "cpu", start_timeout: float = 180.0, role: str = "trusted"):
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        method, preload = start_method(device)
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(preload)
        self.world_size = world_size
        self.device = device
        self.role = role
        self.threads = threads = rank_threads(world_size)
        self._jobs = 0
        self.private = None
        self._staged_as: dict[Path, str] = {}  # a file under test -> its folder in the pool's impl/
        if role == "sandboxed":
            from harness import assets
            from harness.tools.grading import sandbox

            assets.ensure(impl.ROOT)  # the data and tokenizer, which a sandboxed rank cannot write
            self.private = sandbox.Private.make()
        self._conns, self._procs, self._registered = [], [], None
        try:
            pipes = [ctx.Pipe(duplex=True) for _ in range(world_size)]
            self._conns = [ours for ours, _ in pipes]
            port = free_port()
            try:
                from harness.tools.grading import sandbox

                with sandbox.launching():  # the forkserver too, if this starts it: [Note: what a rank starts with]
                    for r, (_, theirs) in enumerate(pipes):
                        p = ctx.Process(target=_worker, args=(role, r, world_size, port, device, threads, theirs,
                                                              self.private), daemon=True, name=f"rank{r}")
                        p.start()
                        self._procs.append(p)  # only a started process: close() joins each
            finally:
                for _, theirs in pipes:
                    theirs.close()
            if self.private is not None:  # live ranks, which every sweep leaves running while the pool is open
                self._registered = sandbox.register([p.pid for p in self._procs])
                for conn in self._conns:
                    conn.send_bytes(b"registered")  # now each may become the sandbox user
            self._collect("start-up", None, start_timeout)
        except BaseException:  # a rank that could not start, or an interrupt: nothing of the pool outlives it
            self.close()  # (its private folder and namespace holder included)
            raise

    @property
    def closed(self) -> bool:
        return self._procs is None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results."""
        if self._procs is None:
            raise RankError("the rank pool was shut down after an earlier failure; start a new one")
        if self.role == "sandboxed":
            from harness.tools.grading import wire

            wire.result_type(fn)  # refused here, before it runs, if it declares no result type
            staged, args = self._stage(args)
        self._jobs += 1
        job = pickle.dumps((self._jobs, fn, args, kwargs))
        for conn in self._conns:
            conn.send_bytes(job)
        try:
            results = self._collect(getattr(fn, "__qualname__", repr(fn)), fn, timeout)
        except RankError as e:
            if self.role != "sandboxed":
                raise
            text = str(e)
            for inside, outside in staged:  # messages name the files and folders as the caller knows them
                text = text.replace(str(inside), str(outside))
            raise type(e)(text) from None
        finally:
            if self.role == "sandboxed" and self._procs is not None:
                self._unstage(staged)
        if self.role == "sandboxed":
            from harness.tools.grading.fsdp2_cache import rebase

            for inside, outside in staged:
                results = [rebase(r, inside, outside) for r in results]
        return results

    def _stage(self, args: tuple) -> tuple[list[tuple[Path, Path]], tuple]:
        """args with the file under test copied into the sandbox's own folder (a sandboxed rank may not
        be able to read where it lies: a grader's temporary folder), and each output folder of a
        train.Config moved there too (what a checkpoint folder holds copied in); [(in the sandbox,
        where it was)], the folders to copy back and the paths to say in messages."""
        import dataclasses
        import shutil

        import train
        from harness.tools.grading import sandbox

        if self.private.uid is not None:
            # A grader may close a folder on the way (pytest closes its own temporary folder to its user
            # when a test first asks for tmp_path): opened again before every job, not once per pool.
            sandbox.reachable(self.private.root)
        staged = []

        def file(name: str) -> str:
            path = impl.impl_path(name)
            # under a name no other grading finds, the same for each job of the pool (a rank imports it once)
            inside = self.private.impl / self._staged_as.setdefault(path, secrets.token_hex(16)) / path.name
            inside.parent.mkdir(mode=0o755, exist_ok=True)
            shutil.copyfile(path, inside)
            if self.private.uid is not None:  # the sandbox user's group reads it, no other user of the machine
                for made, mode in ((inside.parent, 0o750), (inside, 0o640)):
                    os.chown(made, 0, self.private.gid)
                    os.chmod(made, mode)
            staged.append((inside, path))
            return str(inside)

        out = []
        for a in args:
            if isinstance(a, train.Config):
                moved = {}
                for name in OUTPUTS:
                    if (outside := getattr(a, name)) is not None:
                        inside = self.private.output(f"{self._jobs + 1}-{name}", Path(outside))
                        staged.append((inside, Path(outside)))
                        moved[name] = inside
                if a.fsdp == "effdl":
                    moved["impl"] = file(a.impl)
                a = dataclasses.replace(a, **moved)
            elif isinstance(a, str) and a.endswith(".py") or a == "student":
                a = file(a)
            out.append(a)
        return staged, tuple(out)

    def _unstage(self, staged: list[tuple[Path, Path]]) -> None:
        import shutil

        from harness.tools.grading import sandbox

        for inside, outside in staged:
            if inside.is_dir() and inside.is_relative_to(self.private.out):
                sandbox.copy_back(inside, outside)
                shutil.rmtree(inside, ignore_errors=True)

    def _receive(self, conn, rank: int, fn) -> tuple[int, str, Any, str]:
        """One message from `rank`: (job, status, value, traceback). Refused if it is not one."""
        from harness.tools.grading import wire

        if self.role != "sandboxed":
            return pickle.loads(conn.recv_bytes())  # a trusted rank, which ran no file under test
        try:
            data = conn.recv_bytes(wire.MAX_MESSAGE)
        except OSError:
            raise Refused(f"rank {rank} sent a message over {wire.MAX_MESSAGE} bytes; it was refused") from None
        tp = wire.result_type(fn) if fn is not None else None
        try:
            job, status, value, tb = wire.decode(data, tp)
        except wire.Malformed as e:
            what = getattr(fn, "__qualname__", "start-up")
            raise Refused(f"the result of rank {rank} ({what}) was refused: {e}. A rank of the file under test "
                          "sends data of the job's declared type only") from None
        if job != self._jobs:
            raise Refused(f"rank {rank} answered job {job}, not job {self._jobs}; its result was refused")
        return job, status, value, tb

    def _collect(self, what: str, fn, timeout: float, grace: float = 30.0) -> list[Any]:
        from multiprocessing.connection import wait

        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while waiting:
            if errors:  # the other ranks get a grace period, then are presumed stuck
                deadline = min(deadline, time.monotonic() + grace)
            ready = wait(list(waiting), timeout=1.0)
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    _, status, value, tb = self._receive(conn, rank, fn)
                except EOFError:
                    self.close()
                    p = self._procs_at_close[rank]
                    raise RankError(f"{what}: a rank process died ({p.name} exit code {p.exitcode}) without a "
                                    "Python traceback (killed for memory, or a crash in native code)") from None
                except Refused as e:
                    self.close()  # its channel may be mid-message, and the file under test is hostile
                    raise Refused(f"{what}: {e}") from None
                if status == "error":
                    errors[rank] = tb
                else:
                    out[rank] = value
            if not ready and time.monotonic() > deadline:
                missing = sorted(waiting.values())
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
        if errors:  # every rank answered, so none is stuck: the pool stays usable
            if fn is None:
                self.close()
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
        for conn, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
        for p in self._procs:
            p.join(timeout=10)
        if self.role == "sandboxed":
            from harness.tools.grading import sandbox

            sandbox.unregister([p.pid for p in self._procs], self._registered)
            # the ranks still running, and whatever they started that outlived them
            sandbox.sweep([p.pid for p in self._procs if p.is_alive()])
            sandbox.sweep_files()  # and what they left in the folders every user may write
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()
        for conn in self._conns:
            conn.close()
        self._procs_at_close, self._procs = self._procs, None
        if self.private is not None:
            self.private.remove()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def under_test(args: tuple) -> bool:
    """Whether a job with these arguments runs the file under test: one of them is a train.Config of
    effdl (fsdp="effdl"), or, with no Config, one of them is text (the --impl a job
    such as odd_shapes_job loads itself)."""
    import train

    configs = [a for a in args if isinstance(a, train.Config)]
    if configs:
        return any(c.fsdp == "effdl" for c in configs)
    return any(isinstance(a, str) for a in args)


class Ranks:
    """One world size's ranks for the graded checks: a trusted pool for FSDP2 and a sandboxed one for
    the file under test, each started when first used and again after a failure shut it down."""

    def __init__(self, world_size: int, device: str = "cpu"):
        self.world_size = world_size
        self.device = device
        self.threads = rank_threads(world_size)
        self._pools: dict[str, RankPool] = {}

    def pool(self, role: str) -> RankPool:
        if (p := self._pools.get(role)) is None or p.closed:
            p = self._pools[role] = RankPool(self.world_size, device=self.device, role=role)
        return p

    @property
    def trusted(self) -> RankPool:
        return self.pool("trusted")

    @property
    def sandboxed(self) -> RankPool:
        return self.pool("sandboxed")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
        """fn on the sandboxed pool if it runs the file under test (`under_test`), else the trusted one."""
        return self.pool("sandboxed" if under_test(args) else "trusted").run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for p in self._pools.values():
            p.close()

    def __enter__(self) -> Ranks:
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

"""What the writeup report runs on every rank (harness/tools/lab/report.py sends these to a RankPool).

Each job measures through hooks that it removes, or a patch that it restores, before it returns:
the ranks of a pool run other jobs afterwards, which must see plain torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

import train
from harness import memory
from harness.tools.lab.report_results import CommBench, Parts, Timeline


@dataclass(frozen=True)
class TrainRun:
    """One rank's training run."""

    losses: list[float]
    step_times: list[float]
    peak: int
    """peak memory over steps 2.. (1 if only one) above this rank's baseline (see memory)."""
    components: Parts | None


def train_job(cfg: train.Config, components: bool = False) -> TrainRun:
    """One training run: per-step numbers, and the peak memory above this rank's baseline.
    components: also measure what the memory holds, part by part (see Components)."""
    base = 0 if cfg.device == "cuda" else memory.resident_bytes()
    parts = Components() if components else None
    with parts.measuring() if parts else contextlib.nullcontext():
        result = train.train(cfg, inspect=parts.attach if parts else None)
    return TrainRun(result.losses, result.step_times, max(result.peak_memory[1:] or result.peak_memory) - base,
                    parts.result() if parts else None)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Components:
    """Measures, on this rank, the bytes of each part of training memory:

    sharded params / grads: the local shards of the parameters, and of their gradients at the
    optimizer step (after backward, before they are freed); optimizer state: every AdamW state
    tensor (exp_avg, exp_avg_sq; `step` scalars counted apart); gathered params: the most bytes of
    unsharded parameters registered on modules at once (unique storages, read whenever autograd saves
    or unpacks a tensor: through forward and backward); activations: the unique storages autograd
    saved for backward in one forward, parameters excluded.

    Inside `measuring()` only: the optimizer's step hooks and the saved-tensor hooks are removed
    when it ends, however training ends."""

    def __init__(self):
        self.params = self.params_numel = self.grads = self.optim = self.steps = 0
        self.gathered = self.activations = 0
        self._forward: dict[int, int] = {}  # storage -> bytes saved in the current forward
        self._saved: contextlib.ExitStack | None = None
        self._model = None

    @contextlib.contextmanager
    def measuring(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        # train() builds its optimizer inside: global step hooks see it (the only one) without a subclass.
        handles = [register_optimizer_step_pre_hook(self._before_step),
                   register_optimizer_step_post_hook(self._after_step)]
        with contextlib.ExitStack() as self._saved:
            try:
                yield self
            finally:
                for handle in handles:
                    handle.remove()

    def attach(self, model, step: int) -> None:
        """train()'s inspect: step 0 after wrapping, then after every optimizer step."""
        if step == 0:
            self._model = model
            local = [_local(p) for p in model.parameters()]
            self.params = _nbytes(local)
            self.params_numel = sum(t.numel() for t in local)
            # From here to the end of measuring(): the model's own forwards and backwards.
            self._saved.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        self.activations = max(self.activations, sum(self._forward.values()))
        self._forward.clear()

    def _gathered_now(self) -> set[int]:
        from torch.distributed.tensor import DTensor

        storages = {}
        for m in self._model.modules():
            for _, p in m.named_parameters(recurse=False):  # what each module computes with right now
                if not isinstance(p, DTensor) and p.untyped_storage().nbytes():
                    storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        self.gathered = max(self.gathered, sum(storages.values()))
        return set(storages)

    def _pack(self, t):
        gathered = self._gathered_now()
        storage = t.untyped_storage()
        if not isinstance(t, torch.nn.Parameter) and storage.data_ptr() not in gathered:
            self._forward[storage.data_ptr()] = storage.nbytes()
        return t

    def _unpack(self, t):
        self._gathered_now()
        return t

    def _before_step(self, optimizer, args, kwargs) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads = max(self.grads, _nbytes(_local(p.grad) for p in params if p.grad is not None))

    def _after_step(self, optimizer, args, kwargs) -> None:
        state = [_local(v) for s in optimizer.state.values() for k, v in s.items() if hasattr(v, "numel")]
        steps = [_local(v) for s in optimizer.state.values() for k, v in s.items() if k == "step"]
        self.optim, self.steps = _nbytes(state) - _nbytes(steps), _nbytes(steps)

    def result(self) -> Parts:
        self.activations = max(self.activations, sum(self._forward.values()))
        return Parts(sharded_params=self.params, grads=self.grads, optimizer_state=self.optim,
                     gathered_params=self.gathered, activations=self.activations,
                     params_numel=self.params_numel, optimizer_steps=self.steps)


@contextlib.contextmanager
def phase_ranges(t0: float, phases: list):
    """Appends (start, end, phase) for every `## phase ##` range train_step opens, in seconds from
    t0. torch has no Python callback for record_function ranges without a profiler (which would
    change the memory this measures), so torch.profiler.record_function is wrapped, and only while
    the `with` lasts."""
    real = torch.profiler.record_function

    class phase_range(real):
        def __enter__(self):
            self._start = time.perf_counter() - t0
            return super().__enter__()

        def __exit__(self, *exc):
            if self.name.startswith("## "):
                phases.append((self._start, time.perf_counter() - t0, self.name.strip("# ")))
            return super().__exit__(*exc)

    torch.profiler.record_function = phase_range
    try:
        yield
    finally:
        torch.profiler.record_function = real


def timeline_job(cfg: train.Config) -> Timeline:
    """Memory sampled every millisecond while training, with the phase ranges of every step."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else None
    base = 0 if device is not None else memory.resident_bytes()
    read = (lambda: torch.cuda.memory_allocated(device)) if device is not None else memory.resident_bytes
    t0 = time.perf_counter()
    samples, phases, stop = [], [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, read() - base))
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    with phase_ranges(t0, phases):
        thread.start()
        try:
            result = train.train(cfg)
        finally:
            stop.set()
            thread.join()
    return Timeline(samples, phases, [p - base for p in result.peak_memory])


def comm_job(sizes: tuple[int, ...], iters: int) -> list[CommBench]:
    """All-gather and reduce-scatter of `size` bytes (nccl-tests' size: the gathered output, the
    reduce-scatter's input), float32; the slowest rank's mean time per call."""
    import torch.distributed as dist

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rows = []
    for size in sizes:
        n = max(world, size // 4 // world * world)
        big, small = torch.ones(n, device=device), torch.ones(n // world, device=device)
        for kind, run in (("all_gather", lambda: dist.all_gather_into_tensor(big, small)),
                          ("reduce_scatter", lambda: dist.reduce_scatter_tensor(small, big))):
            for _ in range(2):  # warm-up
                run()
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            _sync(device)
            t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append(CommBench(kind, world, n * 4, t.item()))
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_job(cfg: train.Config) -> dict[tuple[str, str], tuple[float, float]]:
    """This rank's collectives per step, by the link they run on: (link, kind) -> (count, bytes of the
    tensor this rank puts in), mean over the steps. Recorded by the graded checks' CommLog, which logs
    every collective: kept are the FSDP's, every all-gather and reduce-scatter and every all-reduce in
    backward (HSDP's replica all-reduce, not the loop's for the loss and the grad norm), with its process
    group's ranks: the shard group (this rank's row of the
    (replicate, world/replicate) mesh; the whole world on a 1-D mesh) is memory_model.SHARD_LINK, the
    replicate group (its column) REPLICATE_LINK, any other group its ranks."""
    import torch.distributed as dist

    from harness.memory_model import REPLICATE_LINK, SHARD_LINK
    from harness.tools.grading.jobs import CommLog

    log = CommLog()

    def inspect(model, step: int) -> None:
        log.step = step + 1

    with log:
        train.train(cfg, inspect=inspect)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = world // cfg.replicate
    row = tuple(range(rank // shard * shard, rank // shard * shard + shard))
    column = tuple(range(rank % shard, world, shard))
    out: dict[tuple[str, str], list[float]] = {}
    for (step, phase, kind, _, nbytes), ranks in zip(log.events, log.groups):
        fsdp = kind in ("all_gather", "reduce_scatter") or (kind == "all_reduce" and phase == "backward")
        if fsdp and 1 <= step <= cfg.num_steps:
            link = SHARD_LINK if ranks == row else REPLICATE_LINK if ranks == column else f"ranks {ranks}"
            count = out.setdefault((link, kind), [0, 0])
            count[0] += 1
            count[1] += nbytes
    return {key: (c / cfg.num_steps, b / cfg.num_steps) for key, (c, b) in out.items()}

"""What runs on the ranks: the jobs a RankPool runs in every rank, each returning what one rank saw.

`train_job` trains exactly as train.py does (it calls `train.train`) and records, per rank, what
the checks compare with FSDP2's run: the losses and grad norms, a digest of every parameter shard
after wrapping and after every step, the gathered parameters and full gradients still alive when
they should be freed (Probes), every all-gather and reduce-scatter with its dtype and bytes
(CommLog), and whether FSDP2 itself ran. `forward_job` stops after the first forward.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import math
import threading
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import train
from harness import assets, impl, memory, memory_model, model_setup
from harness.distributed import agree, current_device
from harness.tools.grading import handwritten
from harness.tools.grading.policy import config
from harness.tools.traces.schedule import (NONE_GATHERED, WORK_WAITS, current, drawn_mark, gather_tag, marked_compute,
                                           marked_waits, read_tag, routed, uncollected)


# --------------------------------------------------------------------------- parameter shards


def digest(p: torch.Tensor) -> str:
    local = p.to_local() if isinstance(p, DTensor) else p
    return hashlib.sha256(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def assert_sharded(model: nn.Module, step: int, replicate: int = 1) -> None:
    """Every parameter is a Shard(0) DTensor on the world mesh with torch.chunk's rows (replicate > 1,
    HSDP: a (Replicate(), Shard(0)) DTensor on the (replicate, world/replicate) mesh)."""
    agree(sharding_error(model, step, replicate))


def sharding_error(model: nn.Module, step: int, replicate: int = 1) -> str | None:
    when = "after wrapping" if step == 0 else f"after step {step}"
    world = dist.get_world_size()
    placements, shape = ((Shard(0),), (world,)) if replicate == 1 else \
        ((Replicate(), Shard(0)), (replicate, world // replicate))
    if why := handwritten.override_problem(model):  # before any read of it by its methods
        return f"{when}: {why}"
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            return (f"{when}: parameter {name} is a {type(p).__name__}, not a DTensor "
                    "(between steps every parameter must be sharded)")
        if tuple(p.placements) != placements or tuple(p.device_mesh.shape) != shape:
            return (f"{when}: parameter {name} has placements {p.placements} on a mesh of shape "
                    f"{tuple(p.device_mesh.shape)}; expected {placements} on {shape}")
    return model_setup.row_layout_error(model, when)


# --------------------------------------------------------------------------- what a rank observes


# Collective ops as the dispatcher sees them (eager c10d and functional), by kind; the input
# tensor is what each rank puts on the wire.
_COLLECTIVES = {
    "_allgather_base_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "allreduce_": ("all_reduce", 0), "all_reduce": ("all_reduce", 0),
}
# Every other op of these namespaces moves data between ranks too (broadcast, all-to-all, send, gather,
# a list all-gather, a coalesced all-reduce, a barrier, ...): each is logged under its own name with the
# bytes of all its tensors, so nothing travels beside the logged collectives unseen (a program that
# issues one FSDP2 does not differs from FSDP2 there). Waits move nothing (the collective was logged), nor
# does wrapping a functional collective's output for autograd.
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem")
_MOVE_NOTHING = ("wait_tensor", "wait", "_wrap_tensor_autograd")


def _leaves(value) -> list:
    """What an op's arguments hold, through lists, tuples and dicts, and each of their subclasses' objects itself:
    read by list's, tuple's and dict's own methods, never by a subclass's (a file's NamedTuple with an `__iter__`
    would run its code where the log cannot see it). Asked for every call of torch's where a file is loaded: one
    list, filled by one function, no generator per level."""
    found: list = []
    _collect(value, found)
    return found


def _collect(value, found: list) -> None:
    kind = type(value)
    if kind is not list and kind is not tuple and kind is not dict:  # (the common cases by identity first)
        if not isinstance(value, (list, tuple, dict)):
            found.append(value)
            return
        found.append(value)  # a subclass's object itself, then its items by its base's methods
    items = dict.values(value) if isinstance(value, dict) else \
        list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
    for v in items:
        _collect(v, found)


def _tensors(value):
    """The tensors in an op's arguments (lists, tuples and dicts of them)."""
    return (v for v in _leaves(value) if isinstance(v, torch.Tensor))


def group_ranks(func, args) -> tuple[int, ...] | None:
    """The global ranks of the process group a c10d op runs over (None where it cannot be told)."""
    for arg, value in zip(func._schema.arguments, args):
        try:
            if arg.name == "process_group":
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(value)))
            if arg.name == "group_name":
                return tuple(dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(value)))
        except (RuntimeError, ValueError, TypeError, AttributeError):
            return None
    return None


_NO_DISPATCH = torch.Tensor.__torch_dispatch__  # a plain tensor's: torch's own kernels


def _followed(t: torch.Tensor) -> bool:
    """A tensor whose ops run torch's own kernels: of any class without a dispatch of its own (a parameter, a buffer,
    an uninitialized one: each reads and writes memory as a plain tensor). A DTensor's ops come back to the log as
    its local tensors'."""
    return type(t).__torch_dispatch__ is _NO_DISPATCH


def _memory_of(t: torch.Tensor) -> list[torch.Tensor]:
    """The followed tensors whose memory `t` reads: itself, or those a tensor subclass wraps (a DTensor's local
    tensor), which torch's Python reads past their ops (a DTensor formatted prints its local tensor, every mode off)."""
    if _followed(t):
        return [t]
    if not is_traceable_wrapper_subclass(t):
        return []
    names, _ = t.__tensor_flatten__()
    return [m for name in names for m in _memory_of(getattr(t, name))]

# [Note: a collective's result read before its wait]
# An op that reads what an asynchronous all-gather, reduce-scatter or all-reduce writes before its work
# handle was waited for (wait, synchronize, get_future, result, block_current_stream) reads a result that may
# not be there yet: a race, and, polled until it is, a wait that no mark in a profiled trace shows (the
# overlap check would count the compute after it as overlapped). `is_completed()` saying True is not such a
# wait: on gloo, wait() may copy the result into place itself, and a program that spun until a guessed
# moment, asked is_completed() and read would wait where nothing marks it (a red-team file did, and its own
# group's compute then looked overlapped by the all-gather it had already used). FSDP2 never does; the collective log
# names such a read as a problem. Each collective's Work is the object its caller gets (pybind keeps one
# Python object per Work while it lives), so the handle's own methods say when it was waited for. Compared
# by bytes (another part of the same buffer may be used meanwhile); views and ops that read only a
# tensor's shape (empty_like, new_zeros...) read nothing. `Tensor.tolist()` and `.numpy()` read without
# the dispatcher, where the log cannot see them: the source check refuses both.
_SHAPE_ONLY = {getattr(torch.ops.aten, n) for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty", "new_zeros",
    "new_ones", "new_full", "new_empty_strided", "is_pinned", "record_stream", "set_", "resize_", "size", "stride",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type")
    if hasattr(torch.ops.aten, n)}


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor spans in memory, [start, end); None when it spans none."""
    if t.numel() == 0 or t.is_meta or (start := t.data_ptr()) == 0:
        return None
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.size(), t.stride()))
    return start, start + (last + 1) * t.element_size()


def _runs(t: torch.Tensor, most: int = 4096) -> list[tuple[int, int]] | None:
    """The bytes a tensor's elements occupy, as [start, end) runs in order (one for a dense tensor, one per row of a
    column slice...); None when it spans none, or in more than `most` runs."""
    if not (extent := _extent(t)):
        return None
    if t.is_contiguous():
        return [extent]
    dims = sorted(((n, s) for n, s in zip(t.size(), t.stride()) if n > 1), key=lambda d: d[1])
    block = 1  # elements in one run: the innermost dimensions laid out densely
    while dims and dims[0][1] == block:
        block *= dims[0][0]
        dims.pop(0)
    if math.prod(n for n, _ in dims) > most:
        return None
    offsets = [0]
    for n, stride in dims:
        offsets = [o + i * stride for o in offsets for i in range(n)]
    size, start = t.element_size(), t.data_ptr()
    runs: list[tuple[int, int]] = []
    for o in sorted(offsets):
        a, b = start + o * size, start + (o + block) * size
        if runs and a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(b, runs[-1][1]))
        else:
            runs.append((a, b))
    return runs


# [Note: where the model's parameters came from]
# Which group an all-gather is for, the overlap checks read from the range the program issued it in: its own
# name. A program that named its collectives in FSDP2's order while each carried another group's parameters (the
# next block's under this block's name, or the last block's kept aside from forward and one group's carried in
# each later collective) held two groups gathered ahead with every count FSDP2's. So, in a graded profiled run,
# the data is followed: each all-gather is numbered where it is issued (a range `gather_tag` names, inside the
# c10d op); its outputs hold its data once a wait for it returned (its Work's wait(), through the gate; wait_tensor
# for a functional collective's), wherever their storages are then: read before (through a tensor swapped for them,
# once synchronize() returned at once, after a wait that timed out), they hold none of it, and what the program
# wrote into them meanwhile stays its own (`Sources.landed`). The bytes every op writes carry the numbers of the
# all-gathers whose data the op read (a copy-out, a cast, a view's reshaping copy, a sum with them), or
# NONE_GATHERED where it read bytes that hold no all-gather's data (a fresh tensor, a copy from elsewhere, a random
# draw: an op that reads none writes none). Constants
# (CONSTANT: what zeros, arange or fill_ make from a number or two, torch.tensor from Python numbers, and what ops make
# of them alone) are no memory's
# data: beside an all-gather's, they are nothing (a sum of zeros and a copy-out holds the copy-out's); alone,
# nothing gathered.
#
# Where an op reads the parameters of one of the model's leaves (as the model last called it: `marked_compute`
# tells), a range (`read_tag`) says which all-gathers' data its bytes hold; the analysis (schedule.parameter_reads)
# takes the leaf from the compute the read is in (the leaf's marked forward, or a node of its ops), ties each
# number to the collective it was issued as, and the checks (checks.assert_parameters_gathered) require each leaf's
# parameters to hold only data of its own group's collectives, every byte of them, from the passes FSDP2's come
# from, with as many such reads of each leaf in each pass of each step as FSDP2's: a read of memory the program put
# in the parameters' place after the leaf's forward is no read of the parameters the log knows, and leaves its pass
# short (an honest pass elsewhere does not stand for it).
#
# Bytes are followed by address, each run of a strided tensor's for itself (a write through a strided view, an
# all-gather's included, numbers only the bytes it writes; one in more runs than are followed adds its numbers to
# what each byte held, and NONE_GATHERED where it held none); and by storage: what a storage's bytes hold is what
# was written through that storage (the same memory freed and allocated again for another holds nothing gathered
# until written). What a storage wrote dies with it: spans name the storage by a token its Python object keeps
# (`_token`), so a StorageImpl made again at a dead one's address, by a way no op shows, holds nothing. Bytes a
# storage's move takes along (`untyped_storage().resize_()` through its gate, a tensor's `resize_`, set_ to a size
# beyond its source's storage, an out= an op resizes inside) carry their numbers; none stay where they were, and
# nothing the memory they land on held before survives (a storage moved away and back again finds nothing it held
# there). An op that writes part of a tensor (index_copy_, index_put_, masked_scatter_) keeps what the rest held:
# into fresh memory, NONE_GATHERED; index_copy_ and index_put_ through an index that sets every element are
# copy-outs (`_sets_every_element`).


class Sources:
    """The all-gathers whose data each byte range of memory holds, and the model's leaves' parameters (see [Note:
    where the model's parameters came from]): one rank's, under a drawn mark."""

    def __init__(self, mark: str):
        self.mark = mark
        self.gathers = 0
        self.starts: list[int] = []  # sorted, ranges not overlapping
        self.spans: list[tuple[int, int, frozenset, int]] = []  # (start, end, numbers, the storage that wrote them)
        self.params: dict[int, list[weakref.ref]] = {}  # storage -> the leaves' parameters on it
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # StorageImpl address -> (its storage, its token)
        self._tokens = 0
        self._layouts: dict = {}

    def _token(self, storage: torch.UntypedStorage) -> int:
        """A live storage's token, which spans name as the storage that wrote them. A storage's Python object lives
        as long as its StorageImpl does, so a StorageImpl freed and another made at its address (by a way no op
        shows: `torch.UntypedStorage(n)`, a factory run inside another op) gets a new token, and nothing the first's
        bytes held."""
        key = storage._cdata
        if (found := self._storages.get(key)) is not None and found[0]() is storage:
            return found[1]
        self._tokens += 1
        self._storages[key] = (weakref.ref(storage), self._tokens)
        return self._tokens

    def _overlapping(self, a: int, b: int) -> tuple[int, int]:
        i = bisect.bisect_right(self.starts, a) - 1
        if i < 0 or self.spans[i][1] <= a:
            i += 1
        j = bisect.bisect_left(self.starts, b, lo=i)
        return i, j

    def _held(self, a: int, b: int, storage: int) -> list[tuple[int, int, frozenset]]:
        """[a, b) as pieces (start, end, numbers), NONE_GATHERED's where `storage` wrote none there."""
        i, j = self._overlapping(a, b)
        pieces, at = [], a
        for s, e, numbers, by in self.spans[i:j]:
            if by != storage:
                continue  # another storage's bytes once: not this one's
            if s > at:
                pieces.append((at, s, _UNGATHERED))
            pieces.append((max(s, a), min(e, b), numbers))
            at = min(e, b)
        if at < b:
            pieces.append((at, b, _UNGATHERED))
        return pieces

    def held(self, t: torch.Tensor) -> frozenset:
        """The numbers of the all-gathers whose data `t`'s bytes hold (NONE_GATHERED among them where some hold none)."""
        if (runs := _runs(t) or ([extent] if (extent := _extent(t)) else None)) is None:
            return _NONE
        if not self.spans:
            return _UNGATHERED
        storage = self._token(t.untyped_storage())
        return _NONE.union(*(numbers for a, b in runs for _, _, numbers in self._held(a, b, storage)))

    def _replace(self, a: int, b: int, numbers: frozenset, storage: int) -> None:
        i, j = self._overlapping(a, b)
        kept = []
        if i < j and self.spans[i][0] < a:
            kept.append((self.spans[i][0], a, *self.spans[i][2:]))
        if numbers and numbers != _UNGATHERED:
            kept.append((a, b, numbers, storage))
        if i < j and self.spans[j - 1][1] > b:
            kept.append((b, self.spans[j - 1][1], *self.spans[j - 1][2:]))
        self.spans[i:j] = kept
        self.starts[i:j] = [s for s, *_ in kept]

    def write(self, t: torch.Tensor, numbers: frozenset) -> None:
        """`t`'s bytes now hold those all-gathers' data (none: what was there is gone)."""
        if not self.spans and numbers in (_NONE, _UNGATHERED) or not (extent := _extent(t)):
            return
        storage = self._token(t.untyped_storage())
        if (runs := _runs(t)) is not None:
            for a, b in runs:
                self._replace(a, b, numbers, storage)
        else:  # which of its bytes it wrote is not followed: each may hold what it held, or these (a landing mark
            # kept as it is, to land on what holds it)
            landing = numbers and min(numbers) < CONSTANT
            for a, b, old in self._held(*extent, storage):
                self._replace(a, b, old | numbers if landing else _joined(old | numbers), storage)

    def moving(self, storages, run):
        """Run what may move storages' bytes (`run()`: a resize, which copies what fits into new memory, or an op that
        resizes its out= or set_'s source inside): the numbers a moved storage's bytes held move with them, none stay
        where they were, and what the memory it moved into held is gone."""
        places = {id(st): (st, st.data_ptr(), st.nbytes()) for st in storages}
        out = run()
        for storage, before, size in places.values():
            if (after := storage.data_ptr(), now := storage.nbytes()) != (before, size) and self.spans:
                key = self._token(storage)
                i, j = self._overlapping(before, before + size)
                kept = [(s - before, e - before, numbers) for s, e, numbers, by in self.spans[i:j] if by == key]
                for s, e, _, by in self.spans[i:j]:
                    if by == key:
                        self._replace(s, e, _NONE, key)
                if after and now:
                    self._replace(after, after + now, _NONE, key)
                    for s, e, numbers in kept:
                        if s < now:
                            self._replace(after + s, after + min(e, now), numbers, key)
        return out

    def resizing(self, plain):
        """UntypedStorage.resize_ as `moving` runs it (through its gate: schedule's [Note: gates put in place before
        the file])."""
        def resize(storage, *args, **kwargs):
            if not isinstance(storage, torch.UntypedStorage):
                return plain(storage, *args, **kwargs)
            with uncollected():
                return self.moving((storage,), lambda: plain(storage, *args, **kwargs))
        return resize

    def gathered(self, outputs: list[torch.Tensor]) -> tuple[int, list]:
        """An all-gather issued, writing `outputs`: numbered in the trace where it is issued. In memory its outputs
        hold its landing mark until a wait for it returns (`landed`): what is read of them before (no all-gather's
        data yet), or written into them meanwhile (the program's), is not its data. Returns (its number, where its
        outputs are: each storage and the runs of bytes it writes there, from the storage's start)."""
        self.gathers += 1
        with torch.profiler.record_function(gather_tag(self.mark, self.gathers)):
            pass
        regions = []
        for t in outputs:
            if _followed(t) and (runs := _runs(t) or ([extent] if (extent := _extent(t)) else None)):
                self.write(t, _landing(self.gathers))
                storage = t.untyped_storage()
                base = storage.data_ptr()
                regions.append((weakref.ref(storage), self._token(storage), [(a - base, b - base) for a, b in runs]))
        return self.gathers, regions

    def landed(self, number: int, regions: list) -> None:
        """A wait for all-gather `number` returned: the bytes of its outputs that still hold its landing mark, wherever
        their storages are now, hold its data."""
        mark, data = _landing(number), frozenset((number,))
        with uncollected():  # what it found marked is what it labels (see `uncollected`)
            self._land(mark, data, regions)

    def _land(self, mark: frozenset, data: frozenset, regions: list) -> None:
        for ref, token, runs in regions:
            if (storage := ref()) is None or self._token(storage) != token or not (base := storage.data_ptr()):
                continue
            size = storage.nbytes()
            for a, b in runs:
                for s, e, held in self._held(base + a, base + min(b, size), token) if a < size else ():
                    if not mark.isdisjoint(held):
                        self._replace(s, e, held - mark | data, token)

    def called(self, module: nn.Module) -> None:
        """The model called one of its leaves: its parameters as it is called are the ones to follow."""
        with torch._C.DisableTorchFunctionSubclass(), uncollected():  # as the log reads tensors
            for p in module._parameters.values():
                if isinstance(p, torch.Tensor) and _followed(p):
                    on = self.params.setdefault(p.untyped_storage()._cdata, [])
                    if not any(r() is p for r in on):
                        on[:] = [r for r in on if r() is not None] + [weakref.ref(p)]

    def _a_parameter(self, t: torch.Tensor) -> bool:
        """Whether `t` is (in) the memory of a parameter of the model's leaves, as one was last called."""
        storage = t.untyped_storage()._cdata
        return any((p := r()) is not None and p.untyped_storage()._cdata == storage for r in self.params.get(storage, ()))

    def _arguments(self, func) -> tuple:
        """(position, name, keyword-only, how: READ, WRITTEN (read, then written) or OVERWRITTEN (all its bytes
        written, none read)) of each of the op's arguments that can hold tensors; once per op."""
        found = self._layouts.get(func)
        if found is None:
            found = []
            for i, arg in enumerate(func._schema.arguments):
                if "Tensor" not in str(arg.type):
                    continue
                writes = arg.alias_info is not None and arg.alias_info.is_write or arg.name in _UNDECLARED_WRITES.get(func, ())
                how = OVERWRITTEN if writes and (arg.is_out or (i == 0 and func.overloadpacket in _OVERWRITE)) \
                    else WRITTEN if writes else READ
                found.append((i, arg.name, arg.kwarg_only, how))
            self._layouts[func] = found = tuple(found)
        return found

    def ran(self, func, args, kwargs, run):
        """Run an op (`run()`), the numbers its inputs' bytes hold written to its outputs', and its reads of the
        model's leaves' parameters marked in the trace."""
        written, read = [], []
        whole = func.overloadpacket in _INDEXED and _sets_every_element(func, args, kwargs)
        for i, name, kwarg_only, how in self._arguments(func):
            value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
            if value is None or whole and i == 0 and how is READ:
                continue  # (an out-of-place indexed write that sets every element reads nothing of its first argument)
            if whole and i == 0:
                how = OVERWRITTEN
            tensors = [t for t in ((value,) if isinstance(value, torch.Tensor) else _tensors(value)) if _followed(t)]
            if how is not READ:
                written.extend(tensors)
            if how is not OVERWRITTEN:
                read.extend((t, name in _SELECTORS and not (t.is_floating_point() or t.is_complex())) for t in tensors)
        numbers = _CONSTANT if func in _FILLS else _NONE
        for t, selects in read:
            held = self.held(t)
            # an index or a mask made from numbers alone (arange's, torch.tensor(rows)'s) says where the values come
            # from, not what they are; one made from memory's data carries it (a table of constants looked up by a
            # tensor's bits is that tensor; a where() whose condition is the data, a bit of it), memory that holds
            # nothing gathered too (torch.empty's may hold a freed tensor's bytes)
            numbers = numbers | (held - _CONSTANT if selects else held)
            if self.params and self._a_parameter(t):
                with torch.profiler.record_function(read_tag(self.mark, _gathered(held))):
                    pass
        if _draws(func):  # what a generator draws is no memory's data (a generator's state is the program's to set)
            numbers = numbers | _UNGATHERED
        numbers = _joined(numbers)
        out = self.moving([t.untyped_storage() for t in written], run) if written else run()  # out= may be resized
        for t in written:
            self.write(t, numbers)
        inputs = {t.untyped_storage()._cdata for t, _ in read} if read else set()
        for t in (out,) if isinstance(out, torch.Tensor) else _tensors(out):
            # a new tensor, not one sharing an input's memory (`_unsafe_view`, which no schema calls a view, writes none)
            if _followed(t) and t.untyped_storage()._cdata not in inputs:
                self.write(t, numbers)
        return out


_SELECTORS = frozenset({"index", "indices", "mask", "condition"})
"""an op's arguments that, integer or boolean, pick which of its other arguments' values it takes (index_select's,
gather's, take's, an indexing's, masked_select's, where's): made from numbers alone (arange, torch.tensor(values)),
their bytes are none of the output's data; made from memory's data (an all-gather's, or memory that holds none, such
as torch.empty's, which may hold a freed tensor's bytes), they carry it into the output (a lookup by its bits is a
copy of it)."""
_NONE: frozenset = frozenset()
_UNGATHERED = frozenset((NONE_GATHERED,))
CONSTANT = -1
"""what bytes hold that a factory made from no memory (zeros, arange, full) or fill_ or zero_ wrote, or an op computed
from such bytes only: no data of any all-gather's, nor any other memory's; beside an all-gather's data, nothing (a sum
of zeros and a copy-out). Never what a random generator drew (`_draws`): its state may be the program's data."""
_CONSTANT = frozenset((CONSTANT,))


def _landing(number: int) -> frozenset:
    """What the outputs of all-gather `number` hold from its issue until a wait for it returns (`Sources.landed`)."""
    return frozenset((CONSTANT - number,))


def _joined(numbers: frozenset) -> frozenset:
    """What bytes made from these sources hold: constants beside data are nothing; an all-gather's output read
    before a wait for it returned (its landing mark) holds none of its data."""
    if numbers and min(numbers) < CONSTANT:
        numbers = frozenset(n for n in numbers if n >= CONSTANT) | _UNGATHERED
    return numbers - _CONSTANT if CONSTANT in numbers and len(numbers) > 1 else numbers


def _gathered(held: frozenset) -> frozenset:
    """A read's numbers as `read_tag` names them: constants alone, NONE_GATHERED (no all-gather brought them)."""
    held = _joined(held)
    return _UNGATHERED if held == _CONSTANT else held

READ, WRITTEN, OVERWRITTEN = "read", "written", "overwritten"
_OVERWRITE = {getattr(torch.ops.aten, n) for n in ("copy_", "fill_", "zero_") if hasattr(torch.ops.aten, n)}
"""in-place ops whose first argument's bytes are all written and none read."""
_UNDECLARED_WRITES = {getattr(getattr(torch.ops.aten, n), o): ("running_mean", "running_var")
                      for n in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm") for o in ("default", "out")
                      if hasattr(torch.ops.aten, n) and o in getattr(torch.ops.aten, n).overloads()}
"""arguments ops write that their schemas do not say they write (batch norm's running statistics, in training)."""
_FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default}
"""in-place ops that write constants (`CONSTANT`): one number given to them."""
_FRESH = {getattr(torch.ops.aten, n) for n in (
    "lift_fresh", "lift_fresh_copy", "empty_like", "rand_like", "randn_like", "randint_like", "new_empty",
    "new_empty_strided") if hasattr(torch.ops.aten, n)}
"""ops that return new memory the collective log does not otherwise see written: `torch.tensor(values)` (its
`lift_fresh`), and the shape-only factories that leave it as it was or fill it at random."""
_FROM_PYTHON = {getattr(torch.ops.aten, n) for n in ("lift_fresh", "lift_fresh_copy") if hasattr(torch.ops.aten, n)}
"""`torch.tensor(values)`: new memory holding values from Python numbers, constants (`CONSTANT`) as a factory's; a
tensor's data reaches Python numbers only through `.item()` (the source check refuses the other ways out)."""
_MADE = {overload for n in ("zeros", "ones", "full", "arange", "eye", "linspace", "scalar_tensor", "zeros_like",
                             "ones_like", "full_like", "new_zeros", "new_ones", "new_full") if hasattr(torch.ops.aten, n)
         for overload in (getattr(getattr(torch.ops.aten, n), o) for o in getattr(torch.ops.aten, n).overloads())
         if {a.name for a in overload._schema.arguments if "Tensor" in str(a.type)} <= {"self", "out"}}
"""factories whose new memory holds constants (`CONSTANT`): values a few numbers given to them make (a `_like`'s
tensor gives its shape only; linspace from tensors reads them, as any op)."""
_RESIZING = {getattr(torch.ops.aten, n) for n in ("resize_", "resize_as_") if hasattr(torch.ops.aten, n)}
"""tensor ops that may move their storage's bytes (growing it)."""
_INDEXED = {getattr(torch.ops.aten, n) for n in ("index_copy_", "index_copy", "index_put_", "index_put", "put_", "put",
                                                "scatter_", "scatter", "masked_scatter_", "masked_scatter")}
"""ops that write their first argument's elements at an index or a mask (a copy-out through one): partly, or every
one."""


@functools.cache
def _draws(func) -> bool:
    """Whether an op draws from a random generator (random_, normal_, bernoulli...: a `Generator?` argument)."""
    return any("Generator" in str(a.type) for a in func._schema.arguments)


def _sets_every_element(func, args, kwargs) -> bool:
    """Whether an indexed write (`_INDEXED`) sets every element of its first argument from the others: then nothing
    that argument held survives it, as after a copy_. Told by writing True through the same index into a mask over
    the dimensions it indexes (none made where the answer is no at once: fewer indices than rows, or a sum)."""
    self, aten, packet = args[0], torch.ops.aten, func.overloadpacket
    if not isinstance(self, torch.Tensor) or self.numel() == 0:
        return False
    try:
        if packet in (aten.masked_scatter_, aten.masked_scatter):  # (self, mask, source)
            return bool(args[1].all())
        if packet in (aten.scatter_, aten.scatter):  # (self, dim, index, src or value[, reduce])
            if len(args) > 4 or "reduce" in kwargs or args[2].numel() < self.size(args[1]):
                return False
            hit = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
            aten.scatter_.value(hit, args[1], args[2], True)
            return bool(hit.all())
        if packet in (aten.index_copy_, aten.index_copy, aten.put_, aten.put):  # (self, dim, index, ...), (self, index, ...)
            index, rows = (args[2], self.size(args[1]) if self.dim() else 1) if packet in (aten.index_copy_, aten.index_copy) \
                else (args[1], self.numel())
            if packet in (aten.put_, aten.put) and (args[3] if len(args) > 3 else kwargs.get("accumulate", False)):
                return False  # a sum with what was there
            if not isinstance(index, torch.Tensor) or index.numel() < rows:
                return False
            hit = torch.zeros(rows, dtype=torch.bool, device=self.device)
            aten.index_put_.default(hit, [index.reshape(-1)], torch.ones((), dtype=torch.bool, device=self.device))
            return bool(hit.all())
        if args[3] if len(args) > 3 else kwargs.get("accumulate", False):  # index_put: (self, indices, values, accumulate)
            return False  # a sum with what was there
        shape, at = [], 0  # the mask's: each dimension an index names (None: all of it, as one row)
        for index in args[1]:
            taken = 1 if index is None or index.dtype not in (torch.bool, torch.uint8) else index.dim()
            shape += [1] if index is None else self.shape[at:at + taken]
            at += taken
        hit = torch.zeros(shape, dtype=torch.bool, device=self.device)
        aten.index_put_.default(hit, list(args[1]), torch.ones((), dtype=torch.bool, device=self.device))
    except (RuntimeError, IndexError, TypeError):
        return False  # not an index the op takes: it says so itself
    return bool(hit.all())


# [Note: reads the dispatcher does not show]
# The log sees what reaches the dispatcher, and some of torch's code reads a tensor's values where it does not: a
# kernel reading another argument's memory in C++ (tensor_split's indices, a packed sequence's batch sizes), torch's
# own Python turning a tensor into numbers (tolist: tensordot's dims, a DeviceMesh's), the printing of a tensor
# (which runs with every dispatch mode off), a tensor made from tensors (torch.tensor([t[0], t[1]]): copied with the
# dispatcher's Python key off). So beside its dispatch mode the log holds a function mode, which sees every call of
# torch's API with its arguments as given. While an asynchronous collective is pending, a call handed a tensor over
# its output reads it, unless it only describes it (_DESCRIBE_ONLY: its size, its address) or what it returns is a
# view of it (a split, an index, a detach); the ops the call dispatches are judged as ever. A tensor made by
# torch.tensor and its kin from anything but Python's numbers in lists and tuples (tensors, a deque of them) is
# refused outright: their values are copied where the data verdict cannot label them (clone(), torch.cat and
# torch.stack copy where it can). The mode runs none of the file's code (torch runs the mode's handler with the
# mode off): it walks a call's arguments by list's, tuple's and dict's own methods, and a call handed an object that
# torch reads by the file's methods (a NamedTuple of the file's with an `__iter__`: impl.READ_AS_DATA) is refused.
# So is a call handed anything by which torch could call the file back inside it (impl.runs_files_code: a function
# of the file's for apply_, an object of its classes whose `__eq__` torch compares): that code would run with the
# mode off, and read unseen. Only the calls that keep a hook for later take one (_KEEPS_CALLABLES): it runs with the
# modes on. The backward the training loop starts runs the file's hooks, and torch would run it with the mode off
# too: the mode runs it with itself on, by the engine, as torch.autograd.backward does (_backward).
# Whatever holds a tensor torch reads past both modes (a set, an exception's arguments: torch formats them into its
# messages), its printing and its values turned into Python's or numpy's (tolist, numpy) go through gates that the log
# routes while it is on (schedule's [Note: gates put in place before the file]): a read of a pending output there is
# named wherever it runs, every mode off or not.
_DESCRIBE_ONLY = frozenset({
    "__get__", "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "data_ptr",
    "untyped_storage", "is_contiguous", "element_size", "__len__", "__hash__", "register_hook", "requires_grad_",
    "is_floating_point", "is_complex", "is_signed", "get_device", "is_pinned", "is_shared", "record_stream",
    "__setitem__", "copy_", "fill_", "zero_", "type", "is_set_to", "__torch_function__"})
"""calls that describe a tensor without reading its values, or write it (judged by the ops they dispatch)"""
_FROM_DATA = {"tensor": 0, "as_tensor": 0, "asarray": 0, "new_tensor": 1}
"""torch.tensor and its kin: where their data is (its position among the arguments)"""
_KEEPS_CALLABLES = frozenset({"register_hook", "register_post_accumulate_grad_hook"})
"""calls that keep a callable of the file's for later, and call none inside"""
_BACKWARD = inspect.signature(torch.Tensor.backward)
_INERT = impl._INERT  # the types runs_files_code found to hold no code (one table, read here without a call)
_BOUND, _WRAPPER = types.BuiltinMethodType, types.MethodWrapperType  # read as runs_files_code reads them: by __self__


class _TorchCalls(TorchFunctionMode):
    """The log's function mode ([Note: reads the dispatcher does not show])."""

    def __init__(self, log: CommLog):
        super().__init__()
        self.log = log
        self.handling: list = []  # the calls of torch's this mode is handling (itself off), innermost last
        self.thread = threading.get_ident()  # the thread whose calls it sees (the training loop's)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:  # run with this mode on: a collection there is seen as any other code
            return self._backward(args, kwargs or {})
        # No garbage collection meanwhile, as in the log's dispatch: the mode is off while it handles a call, and a
        # collection would run the file's weakref callbacks and finalizers here, their calls unseen.
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        self.handling.append(func)
        try:
            return self._judged(func, args, kwargs or {})
        finally:
            self.handling.pop()
            if collecting:
                gc.enable()

    def file_code_runs(self) -> None:
        """Asked wherever the file's code starts or resumes running ([Note: where the file's code runs], impl.py): where
        this mode is not on (enabled, and on the running thread's stack of modes), a problem. That is inside a call of
        torch's it handles (it is off meanwhile), inside an op the log's dispatch mode handles (every mode off), and on
        a thread of torch's own that runs Python where an object goes (gloo's, freeing a collective's work and what it
        held), whose stacks are empty. (Autograd's threads run with the stacks of the thread that began backward.)"""
        if self.log.problems:
            return
        if torch._C._is_torch_function_mode_enabled() and any(
                torch._C._get_function_stack_at(i) is self for i in range(torch._C._len_torch_function_stack())):
            if self.log.held:  # where the log sees what freeing them runs (autograd's device thread: its stacks)
                self.log.settle()
            return
        if threading.get_ident() != self.thread:
            where = "on a thread of torch's own (what a collective's work held, freed there)"
        elif self.handling or self.log.dispatching:
            func = self.handling[-1] if self.handling else self.log.dispatching[-1]
            where = f"inside torch's {getattr(func, '__qualname__', getattr(func, '__name__', repr(func)))}"
        else:
            where = "where the log's function mode is off"
        self.log.problems.append(
            f"step {self.log.step} ({_phase()}): code of the file ran {where} (torch called it back: an object, "
            "iterator or generator of the file's handed to it, or freed there), where the log cannot see what it "
            "reads: hand torch tensors, numbers and torch's own objects, and run your code yourself")

    def _backward(self, args, kwargs):
        """Tensor.backward, as torch.autograd.backward runs it, with this mode on while the engine runs the file's
        hooks ([Note: reads the dispatcher does not show])."""
        given = _BACKWARD.bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments
        if torch._C._are_functorch_transforms_active():
            raise RuntimeError("backward() called inside a functorch transform. This is not supported, please use "
                               "functorch.grad or functorch.vjp instead or call backward() outside of functorch "
                               "transforms.")
        tensors = (a["self"],)
        grads = torch.autograd._make_grads(tensors, torch.autograd._tensor_or_tensors_to_tuple(a["gradient"], 1),
                                           is_grads_batched=False)
        single = (torch.Tensor, torch.autograd.graph.GradientEdge)
        inputs = () if a["inputs"] is None else (a["inputs"],) if isinstance(a["inputs"], single) \
            else tuple(a["inputs"])
        if a["inputs"] is not None and not inputs:
            raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
        retain = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
        with self:
            torch.autograd.graph._engine_run_backward(tensors, grads, retain, a["create_graph"], inputs,
                                                      allow_unreachable=True, accumulate_grad=True)

    def _judged(self, func, args, kwargs):
        log = self.log
        if log.problems:
            return func(*args, **kwargs)
        kind = type(func)  # (torch's own functions and methods: known by their type, with no call)
        if _INERT.get(id(kind)) is not kind and not (  # torch's method of an object of a type known to hold no code
                (kind is _BOUND or kind is _WRAPPER) and (_INERT.get(id(bound := type(func.__self__))) is bound or
                                                          issubclass(bound, types.ModuleType))) \
                and impl.runs_files_code(func):  # the file's, handed as a call of torch's
            log.problems.append(f"step {log.step} ({_phase()}): {_called_back(func)} is run as a call of torch's, where "
                                "the log cannot see what it reads: call your code yourself")
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        for held in () if impl.inert(args) and (not kwargs or impl.inert(kwargs.values())) else _leaves((args, kwargs)):
            if impl.read_as_data(held):
                log.problems.append(
                    f"step {log.step} ({_phase()}): torch's {name} is handed a {type(held).__qualname__}, which torch "
                    "reads by the file's own methods (its __iter__, __getitem__, __index__...), run where the log "
                    "cannot see them: hand torch numbers, lists, tuples and tensors (list(x), int(x))")
                break
            if name not in _KEEPS_CALLABLES and impl.runs_files_code(held):
                log.problems.append(
                    f"step {log.step} ({_phase()}): torch's {name} is handed {_called_back(held)}, which torch may call "
                    "inside the call, where the log cannot see what the file's code reads: hand torch tensors, numbers "
                    "and torch's own objects, and run your code yourself")
                break
        if name in _FROM_DATA:
            data = kwargs.get("data", kwargs.get("obj", args[_FROM_DATA[name]] if len(args) > _FROM_DATA[name] else None))
            if not isinstance(data, torch.Tensor) and (made_from := _not_numbers(data)):
                log.problems.append(
                    f"step {log.step} ({_phase()}): torch.{name} makes a tensor from {made_from}, copying their values "
                    "where the log cannot see them: give it Python numbers (in lists or tuples) or a tensor, and copy "
                    "tensors with clone(), torch.cat or torch.stack")
        if not log.pending or name in _DESCRIBE_ONLY:
            return func(*args, **kwargs)
        # only tensors in the memory of a pending output (its storage's), each read at most once per call
        held = log.pending_storages()
        given = [m for t in _tensors((args, kwargs)) for m in _memory_of(t) if m.untyped_storage().data_ptr() in held]
        if not given:
            return func(*args, **kwargs)
        what = f"torch's {getattr(func, '__qualname__', name)}"
        try:
            out = func(*args, **kwargs)
        except BaseException:  # what it read, it read (an error can tell what it found)
            log.read_pending(given, what)
            raise
        # unless what it returns is a view
        log.read_pending(given, what, [r for t in _tensors(out) for m in _memory_of(t) if (r := _extent(m))])
        return out


def _called_back(held) -> str:
    """How a message names what torch could call back: the file's function by its name, else the object's class."""
    return f"the file's {held.__qualname__}" if hasattr(held, "__code__") else f"a {type(held).__qualname__}"


_NUMBERS = (int, float, bool, complex)


def _not_numbers(data) -> str | None:
    """What in the data of torch.tensor and its kin is not Python's numbers in lists and tuples (of exactly those
    types: torch reads any sequence, a subclass's items by its own __getitem__), or None: "tensors", or the class."""
    if data is None or type(data) in _NUMBERS or type(data) is range:
        return None
    if type(data) not in (list, tuple, torch.Size):
        return "tensors" if isinstance(data, torch.Tensor) else f"a {type(data).__qualname__}"
    return next((found for item in data if (found := _not_numbers(item))), None)


# [Note: what a collective's work holds]
# A collective's work holds the tensors it was handed until it is freed, and the thread that frees it is the one that
# drops it last: gloo's worker (NCCL's watchdog on CUDA) once the collective is done, when the program let go of its
# handle first. A tensor whose Python object the program dropped lives on in C++ (torch keeps the object for it), so
# freeing the work there frees the object too, and what hangs on it: its attributes, its view's base, its hooks.
# Freeing them runs Python where an object goes (a generator's finally, a weak container's removal), on a thread
# whose stacks hold neither of the log's modes: the file's code is named there ([Note: where the file's code runs]),
# Python's own code that the file set up is not, and its reads of a pending output would go unseen (a red-team file
# hung a suspended generator, and another a weak container's iteration guard, on a tensor only an async broadcast's
# work held). So the log holds the Python object of every tensor a collective is handed or returns, and lets go of it
# (`settle`) where nothing but that object holds it any more (the work is gone), with both modes on: where the file's
# code next starts (on the loop's thread, or autograd's device thread, which runs with its stacks), before the loop's
# optimizer step, at the grader's hooks and step boundaries, and at the log's exit. Whatever the object's freeing runs
# then runs where the log sees it. The tensor lives no longer for it than until then: a collective's work holds its
# tensors until it is freed anyway. (A storage's own Python object is not held: gloo's work keeps views of an
# all-gather's output that hold its storage and not the tensor, but nothing of the file's can hang on a storage: the
# source check lets a file use `untyped_storage()` only in place, to resize and measure it.)


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


class CommLog(TorchDispatchMode):
    """Every collective a rank issues (all-gathers, reduce-scatters, all-reduces: HSDP's and the loop's,
    and any other, under its op's name): (step, phase, kind, dtype, bytes) and the ranks of its
    process group, and whether FSDP2 issued it (its ops or its source on the stack). With a mark (a graded
    profiled run), it also follows the all-gathers' data into the model's parameters (`Sources`)."""

    def __init__(self, mark: str | None = None):
        super().__init__()
        self.sources = Sources(mark) if mark is not None else None
        self.step = 0  # set by the job: 0 is wrapping, then the optimizer step under way
        self.events: list[tuple[int, str, str, str, int]] = []
        self.groups: list[tuple[int, ...] | None] = []  # each event's process group
        self.uses_fsdp2: str | None = None
        self.problems: list[str] = []
        # id(work) -> (work, the tensors its collective writes, kind): see [Note: a collective's result read
        # before its wait]. The tensors, not their addresses: a storage resized in place moves its bytes, and
        # its tensors with them, where no op shows it.
        self.pending: dict[int, tuple[object, list[torch.Tensor], str]] = {}
        # id(work) -> (work, number, regions) of an all-gather whose data lands at a wait for its Work (Sources.gathered);
        # and a functional all-gather's, by its output's storage token, at its wait_tensor
        self.landing: dict[int, tuple] = {}
        self.landing_tensors: dict[int, list[tuple]] = {}
        self._entered: contextlib.ExitStack | None = None  # what __enter__ entered besides the mode itself
        self.dispatching: list = []  # the ops this mode is handling (itself and every function mode off), innermost last
        # id -> every tensor a collective was handed or returned, held until only its Python object holds it, where
        # a file is loaded ([Note: what a collective's work holds])
        self.held: dict[int, torch.Tensor] = {}
        self.holds = False
        self._settling = False

    def __enter__(self):
        pending, landing, sources = self.pending, self.landing, self.sources

        def waiting(name):
            original = current(f"Work.{name}")

            def asked(work, *args, **kwargs):
                entry = pending.pop(id(work), None)  # asked first: a wait may copy the result into place itself (gloo's)
                try:
                    out = original(work, *args, **kwargs)
                except BaseException:  # a wait that timed out: the work may still run
                    if entry is not None:
                        pending[id(work)] = entry
                    raise
                # An all-gather's data is in its outputs once a wait for it returned: not where a way of asking
                # returned at once (synchronize(), result() on gloo), nor a wait that raised. (Gloo writes them on
                # its own threads, which no mode sees; a write the log saw inside the wait would have replaced the
                # landing mark, and the data would not land: a failure, never a label on bytes it did not bring.)
                if name == "wait" and (landed := landing.pop(id(work), None)) is not None:
                    sources.landed(*landed[1:])
                return out

            return asked

        # Through the gates, as the marks: a method a file kept from before still tells the log (schedule's
        # [Note: gates put in place before the file]). Not is_completed(): see the Note above.
        def reading(route: str, what: str):
            original = current(route)

            def read(t, *args, **kwargs):  # wherever it runs: inside a call of torch's, every mode is off
                if pending and isinstance(t, torch.Tensor):
                    self.read_pending(_memory_of(t), what)
                return original(t, *args, **kwargs)

            return read

        routes = {f"Work.{name}": waiting(name) for name in WORK_WAITS if name != "is_completed"}
        routes.update({"_tensor_str._str": reading("_tensor_str._str", "torch's printing of a tensor"),
                       "Tensor.tolist": reading("Tensor.tolist", "torch's Tensor.tolist"),
                       "Tensor.numpy": reading("Tensor.numpy", "torch's Tensor.numpy")})
        if self.sources is not None:
            routes["UntypedStorage.resize_"] = self.sources.resizing(current("UntypedStorage.resize_"))
        with contextlib.ExitStack() as entered:
            entered.enter_context(routed(routes))
            # not in a rank that trains FSDP2 only: torch's own code there needs no such eye, and the function mode
            # costs Python on every call
            if not impl.files_refused():
                calls = entered.enter_context(_TorchCalls(self))
                entered.enter_context(impl.watching(calls.file_code_runs))
                self.holds = True
                # the loop's optimizer step allocates (its state, in step 1) after the file's last code of a step:
                # what only the log still held goes first, as it would have without the log
                entered.callback(register_optimizer_step_pre_hook(
                    lambda optimizer, args, kwargs: self.settle()).remove)
            out = super().__enter__()
            self._entered = entered.pop_all()
        return out

    def __exit__(self, *exc):
        try:
            # with both modes still on: what freeing the held tensors runs, the log sees (the rest is the works')
            self.settle()
            self.held.clear()
            return super().__exit__(*exc)
        finally:
            self._entered.close()

    def settle(self) -> None:
        """Let go of each held tensor that nothing but its Python object holds (its collective's work is gone): freed
        here, if the program dropped it, with what hangs on it ([Note: what a collective's work holds]). Asked where
        both of the log's modes are on (the training loop's thread, or autograd's device thread, which runs with its
        stacks); not again inside (a finalizer that starts the file's code)."""
        if self._settling or not self.held:
            return
        self._settling = True  # (autograd's other thread settling meanwhile skips: holding longer is safe)
        try:
            with torch._C.DisableTorchFunction():  # the log's reads: no call of torch's to judge
                free = [key for key, t in list(self.held.items()) if t._use_count() == 1]
            for key in free:
                self.held.pop(key, None)
        finally:
            self._settling = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A tensor subclass with a dispatch of its own (DTensor) first: it runs with this mode still on, so the
        # ops it issues inside (a redistribution's all-gather) come back here. Run by this mode instead, they
        # would run with it off (a mode is popped while it handles an op), unseen. Not torch's tracing tensors
        # (fake, functional: DTensor's sharding propagation), which hold no data and move none.
        if any(t.__torch_dispatch__ is not _NO_DISPATCH and not t.__module__.startswith("torch._subclasses.")
               for t in types):
            return NotImplemented
        # What the log reads of a tensor (its size, strides, storage) it reads as torch's own, past every function
        # mode and subclass: a class of torch's (an uninitialized buffer) may refuse such reads in Python, and the
        # log's own function mode has nothing to judge in the log's code (it would judge each read, a call of
        # Python's each). No garbage collection meanwhile: this mode is off while it handles an op, and a collection
        # would run the program's weakref callbacks and finalizers here, their ops unseen (a program can count its
        # allocations to the one that collects). Code of the file that runs here all the same (a generator of its
        # freed by the op) is named where it starts ([Note: where the file's code runs], `dispatching`).
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        self.dispatching.append(func)
        try:
            with torch._C.DisableTorchFunction():
                return self._dispatch(func, args, kwargs or {})
        finally:
            self.dispatching.pop()
            if collecting:
                gc.enable()

    def _dispatch(self, func, args, kwargs):
        ns, name = func.namespace, func.__name__.split(".")[0]
        if ns == "fsdp" and self.uses_fsdp2 is None:
            self.uses_fsdp2 = f"it runs FSDP2's op fsdp::{name}"
        if ns in _COMM_NAMESPACES and name not in _MOVE_NOTHING:
            if name in _COLLECTIVES:
                kind, index = _COLLECTIVES[name]
                tensors = args[index] if isinstance(args[index], (list, tuple)) else [args[index]]
                sent = [(t.dtype, t.numel() * t.element_size()) for t in tensors]
            else:  # one event: the first tensor's dtype, the bytes of all its tensors
                tensors = list(_tensors((args, kwargs)))
                sent = [(tensors[0].dtype if tensors else None, sum(t.numel() * t.element_size() for t in tensors))]
                kind = name.strip("_")
            # outside backward: forward, and the loop's own all-reduces (the loss, the grad norm), FSDP2's too
            phase = _phase()
            ranks = group_ranks(func, args)
            for dtype, nbytes in sent:
                self.events.append((self.step, phase, kind, str(dtype).removeprefix("torch."), nbytes))
                self.groups.append(ranks)
            if self.uses_fsdp2 is None:
                self.uses_fsdp2 = handwritten.stack_problem()
            out = func(*args, **kwargs)
            if self.holds:  # until its work lets go of them ([Note: what a collective's work holds])
                for t in _tensors((args, kwargs, out)):
                    self.held[id(t)] = t
            landing = None
            if self.sources is not None:  # all-gathers numbered; what another collective writes holds none's data
                if kind == "all_gather":
                    landing = self.sources.gathered(list(_tensors(args[0] if index == 1 else out)))
                else:
                    for t in _tensors((args, kwargs, out)):
                        self.sources.write(t, frozenset())
            works = [w for w in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(w, torch.ScriptObject)]
            if works and ns == "c10d" and name in _COLLECTIVES:  # their first argument is what they write
                work = dist.Work.unbox(works[0])
                self.pending[id(work)] = (work, list(_tensors(args[0])), kind)
                if landing is not None:
                    self.landing[id(work)] = (work, *landing)
            elif landing is not None:  # a functional collective's: waited for by wait_tensor on its output
                for t in _tensors(out):
                    self.landing_tensors.setdefault(self.sources._token(t.untyped_storage()), []).append(landing)
            return out
        if self.sources is not None and name == "wait_tensor" and self.landing_tensors and \
                isinstance(args[0], torch.Tensor) and _followed(args[0]):
            out = func(*args, **kwargs)
            for landed in self.landing_tensors.pop(self.sources._token(args[0].untyped_storage()), ()):
                self.sources.landed(*landed)
            return out
        if self.pending and not self.problems and not func.is_view and func.overloadpacket not in _SHAPE_ONLY:
            self.read_pending(_tensors((args, kwargs)), str(func))
        if self.sources is not None and (func in _MADE or func.overloadpacket in _FRESH):
            # new memory (a factory, or a tensor made from Python values): whatever a storage freed there held is gone
            out = self.sources.moving([t.untyped_storage() for t in _tensors(kwargs) if _followed(t)],
                                      lambda: func(*args, **kwargs))  # an out= resized
            for t in _tensors(out):
                if _followed(t):
                    self.sources.write(t, _CONSTANT if func in _MADE or func.overloadpacket in _FROM_PYTHON else _NONE)
            return out
        if self.sources is not None and func.overloadpacket in _RESIZING and isinstance(args[0], torch.Tensor):
            return self.sources.moving((args[0].untyped_storage(),), lambda: func(*args, **kwargs))
        if self.sources is not None and func.overloadpacket is torch.ops.aten.set_ and len(args) > 1:
            # set_ to a size beyond its source's storage grows that storage, moving its bytes
            source = args[1].untyped_storage() if isinstance(args[1], torch.Tensor) and _followed(args[1]) else \
                args[1] if isinstance(args[1], torch.UntypedStorage) else None
            return self.sources.moving((source,) if source is not None else (), lambda: func(*args, **kwargs))
        if self.sources is not None and not func.is_view and func.overloadpacket not in _SHAPE_ONLY:
            return self.sources.ran(func, args, kwargs, lambda: func(*args, **kwargs))
        return func(*args, **kwargs)

    def pending_storages(self) -> set[int]:
        """Where the storages of the pending collectives' outputs are now (a storage resized in place moves)."""
        return {t.untyped_storage().data_ptr() for _, outputs, _ in self.pending.values() for t in outputs}

    def read_pending(self, tensors, what: str, views=()) -> None:
        """A problem if `tensors` (read by `what`) overlap the output of a pending collective, but where they are its
        views, `views` ([Note: a collective's result read before its wait])."""
        read = [r for t in tensors if _followed(t) and (r := _extent(t))]
        for work, outputs, kind in self.pending.values():
            written = [r for t in outputs if (r := _extent(t))]  # where they are now
            if any(a < d and c < b for a, b in read for c, d in written) and not any(
                    a < d and c < b for a, b in views for c, d in written):
                self.problems.append(
                    f"step {self.step} ({_phase()}): {what} reads the output of an asynchronous "
                    f"{kind.replace('_', '-')} before its work handle was waited for: wait (work.wait()) before using a "
                    "collective's result (read before, it may not be there yet; polled until it is, it is a wait the "
                    "overlap check cannot see)")
                return

    def record(self) -> Comm:
        return Comm(list(self.events), self.uses_fsdp2, list(self.groups))


@dataclasses.dataclass
class Comm:
    """What a CommLog saw, as data: every (step, phase, kind, dtype, bytes), and whether FSDP2 issued
    a collective."""

    events: list[tuple[int, str, str, str, int]]
    uses_fsdp2: str | None
    groups: list[tuple[int, ...] | None] = dataclasses.field(default_factory=list)  # each event's process group

    def sent(self, phase: str) -> dict:
        """{(kind, dtype, bytes): count} of one phase, over all steps after wrapping."""
        out: dict = {}
        for step, ph, kind, dtype, nbytes in self.events:
            if step > 0 and ph == phase:
                out[(kind, dtype, nbytes)] = out.get((kind, dtype, nbytes), 0) + 1
        return out

    def sent_by_group(self, phase: str) -> dict:
        """{(kind, process group's ranks, dtype, bytes): count} of one phase, over all steps after wrapping."""
        out: dict = {}
        for (step, ph, kind, dtype, nbytes), ranks in zip(self.events, self.groups):
            if step > 0 and ph == phase:
                out[(kind, ranks, dtype, nbytes)] = out.get((kind, ranks, dtype, nbytes), 0) + 1
        return out


def fsdp2_problem(model: nn.Module, cfg: train.Config) -> str | None:
    if cfg.fsdp != "effdl":
        return None
    return handwritten.module_problem(train.fsdp_module(cfg)) or handwritten.model_problem(model)


class Probes:
    """Hooks on every block: its gathered (non-DTensor) parameters must be freed after its
    forward (when it reshards after forward) and, with their full gradients, by the end of
    each step. Freed means dropped, or storage resized to zero (tensors autograd still holds)."""

    def __init__(self, model: nn.Module, reshard_after_forward: bool, settle=lambda: None,
                 sources: Sources | None = None):
        self.problems: list[str] = []
        self.settle = settle  # the log's: what only it still held is freed before anything is counted alive
        # the log's data following (the first forward's): each block's gathered parameters must hold all-gathered data
        self.sources = sources
        self.gathered: dict[str, list[weakref.ref]] = {}
        self.grads: dict[str, list[weakref.ref]] = {}
        self._hooked: set[int] = set()
        self._sharded_at_forward: set[str] = set()
        self.blocks: list[str] = []
        self.ran: set[tuple[str, str]] = set()  # (block, "pre" or "post") since the last step
        for name, block in model.layers.named_children():
            self._probe(f"layers.{name}", block, reshard_after_forward)
        # every leaf's own parameters, the root's too, where the model computes with them (`computing`)
        self.names = {id(m): name or "the root" for name, m in handwritten.module_tree(model)}

    def computing(self, module: nn.Module) -> None:
        """The model calls one of its leaves (schedule.marked_compute, in its forward: after every pre-hook, the
        file's own too): the log follows its parameters, and they must hold what this forward's all-gathers brought."""
        self.sources.called(module)
        if (name := self.names.get(id(module))) is not None:
            with uncollected():
                if self.honest(name, module):
                    self.brought(name, module, recurse=False)

    def honest(self, name: str, block: nn.Module) -> bool:
        """The block is read by nn.Module's own methods ([Note: the grader reads a model by nn.Module's own methods]);
        else a problem, once."""
        if why := handwritten.override_problem(block):
            if not any(why in p for p in self.problems):
                self.problems.append(f"{name}: {why}")
            return False
        return True

    def brought(self, name: str, block: nn.Module, recurse: bool = True) -> None:
        """Each of the module's gathered (full) parameters holds, in every byte, data that an all-gather of this
        forward brought ([Note: where the model's parameters came from]): not a copy kept from wrapping, nor one
        made otherwise (the collectives' sizes alone would let a program gather zeros beside it)."""
        with torch._C.DisableTorchFunction():  # as the log reads tensors
            for pname, p in block.named_parameters(recurse=recurse):
                if isinstance(p, DTensor) or _extent(p) is None:
                    continue
                found = _gathered(self.sources.held(p)) if _followed(p) else _UNGATHERED
                if NONE_GATHERED in found or not found:
                    self.problems.append(
                        f"{name}: its gathered parameter {pname} holds data no all-gather of this forward brought (a "
                        "copy kept from wrapping, or made otherwise): fill a block's full parameters from the "
                        "all-gather of its shards, in its pre-forward")
                    return

    @staticmethod
    def alive(refs: list[weakref.ref]) -> int:
        return sum(t.untyped_storage().nbytes() for r in refs if (t := r()) is not None)

    def _probe(self, name: str, block: nn.Module, reshard_after_forward: bool) -> None:
        # Registered after fully_shard: the pre-hook runs after FSDP's (prepended) pre-forward,
        # the post-hook after FSDP's post-forward.
        def pre(module, args):
            self.ran.add((name, "pre"))
            with uncollected():
                if not self.honest(name, module):
                    return
                full = [p for p in module.parameters() if not isinstance(p, DTensor)]
                held = any(True for _ in module.parameters())
            if not full and held and name not in self._sharded_at_forward:
                # FSDP2 gathers a block's parameters in its pre-forward; gathered inside its layers instead,
                # they would never be seen here, nor their freeing checked
                self._sharded_at_forward.add(name)
                self.problems.append(f"{name}: its parameters were still DTensors when its forward began: gather a "
                                     "block's parameters in its pre-forward hook, before any of its layers runs")
            self.gathered[name] = [weakref.ref(p) for p in full]
            for p in full:
                if p.requires_grad and id(p) not in self._hooked:
                    self._hooked.add(id(p))
                    p.register_hook(lambda g, n=name: self.grads.setdefault(n, []).append(weakref.ref(g)) or g)

        def post(module, args, output):
            self.ran.add((name, "post"))
            self.settle()
            with uncollected():
                if not self.honest(name, module):
                    return
            if reshard_after_forward and (n := self.alive(self.gathered.get(name, []))):
                self.problems.append(f"{name}: {n / 2**20:.2f} MiB of gathered parameters still alive after its "
                                     "forward (reshard_after_forward=True: free them in post-forward)")

        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
        self.blocks.append(name)

    def ran_every_hook(self, when: str) -> None:
        """Every block ran forward since the last time asked, each of these hooks with it (else what they check went
        unseen), and some block computed with full parameters."""
        if missed := [f"{name} ({hook})" for name in self.blocks for hook in ("pre", "post")
                      if (name, hook) not in self.ran]:
            self.problems.append(f"{when}: the grader's forward hooks on {', '.join(missed)} did not run (a "
                                 "block's forward must run its hooks: call the block, and leave its hook tables be)")
        self.ran.clear()
        if not self.gathered:
            self.problems.append(f"{when}: no block computed with full (non-DTensor) parameters")

    def after_step(self, step: int) -> None:
        self.ran_every_hook(f"step {step}")
        self.settle()
        for name, refs in self.gathered.items():
            if n := self.alive(refs):
                self.problems.append(f"{name}: {n / 2**20:.2f} MiB of gathered parameters still alive after "
                                     f"step {step} (free them after backward)")
            kept = sum(g.untyped_storage().nbytes() for r in refs if (p := r()) is not None and (g := p.grad) is not None)
            kept += self.alive(self.grads.pop(name, []))
            if kept:
                self.problems.append(f"{name}: {kept / 2**20:.2f} MiB of full gradients still alive after step "
                                     f"{step} (free them once they are laid out for the reduce-scatter)")


@dataclasses.dataclass
class Run:
    """What one rank saw of one run: numbers, shard digests, memory problems, collectives."""

    result: "train.TrainResult | None"
    digests: list[dict[str, str]]
    problems: list[str]
    comm: Comm
    uses_fsdp2: str | None
    forward_loss: float | None = None


# --------------------------------------------------------------------------- the jobs


def train_job(cfg: train.Config, observe: bool = True, mark: str | None = None) -> Run:
    """Train as train.py does; every shard checked (Shard(0), torch.chunk's rows) and digested after
    wrapping and after every step. observe: under a CommLog with Probes on every block (what the
    graded step checks); False for a profiled run, whose trace should show the program as it runs, and for
    a compiled one (no Python dispatch mode around the compiled code). The
    log is on in a profiled run all the same: a collective's output polled until it is there would pass for
    overlap in the trace (see [Note: a collective's result read before its wait]), and a program could
    poll only where no log is on; the trace reads the same with it (see [Note: an op run through a
    dispatch mode], trace.py). A profiled run also marks where collectives were waited for,
    for the overlap checks (schedule.marked_waits), and, given `mark`, the model's own compute
    (schedule.marked_compute). Without FSDP (--fsdp none) there are no shards
    and nothing to free: only the numbers count."""
    log, digests, holder = CommLog(mark if cfg.profile_steps else None), [], {}
    sharded = cfg.fsdp != "none"

    def inspect(model: nn.Module, step: int) -> None:
        # checked before anything reads the model ([Note: the grader reads a model by nn.Module's own methods]), with
        # no collection between the check and the reads (a finalizer of the file's could change the model there)
        with uncollected():
            log.settle()
            if sharded:
                assert_sharded(model, step, cfg.replicate)
            if step == 0:
                if mark is not None:
                    marks.enter_context(marked_compute(model, mark, log.sources.called if log.sources else None))
                holder["uses_fsdp2"] = fsdp2_problem(model, cfg)
                holder["probes"] = Probes(model, cfg.reshard_after_forward, log.settle) if sharded and observe else None
            elif holder["probes"] is not None:
                holder["probes"].after_step(step)
            digests.append({name: digest(p) for name, p in model.named_parameters()})
        log.step = step + 1

    # A profiled run with allocation events on CPU counts tensor memory as the memory job does (memory.TensorPeaks'
    # flag: frees on gloo's threads counted too), so its trace's totals are exact: the peaks judged on the very run
    # whose overlap is judged (checks.assert_profiled_memory).
    counted = cfg.profile_steps and cfg.profile_memory and current_device(cfg.device).type == "cpu"
    try:
        with marked_waits(mark) if cfg.profile_steps else contextlib.nullcontext(), \
                log if observe or cfg.profile_steps else contextlib.nullcontext(), contextlib.ExitStack() as marks, \
                memory.allocations_counted() if counted else contextlib.nullcontext():
            result = train.train(cfg, inspect=inspect)
    except BaseException as e:
        e.add_note(f"(in step {min(log.step, cfg.num_steps)} of {cfg.num_steps}, rank {dist.get_rank()})" if log.step else
                   "(while wrapping the model with fully_shard)")
        raise
    problems = (holder["probes"].problems if holder.get("probes") else []) + log.problems
    return Run(result, digests, problems, log.record(), holder.get("uses_fsdp2") or log.uses_fsdp2)


def forward_job(cfg: train.Config) -> Run:
    """Set up as train.py does and run the first micro-step's forward and loss only (no backward)."""
    model, device = train.setup(cfg)
    assert_sharded(model, 0, cfg.replicate)
    problem = fsdp2_problem(model, cfg)
    # the data followed where a file is loaded: where each leaf's gathered parameters came from (FSDP2's need no such
    # check, and the following costs Python on every op)
    log = CommLog(None if impl.files_refused() else drawn_mark())
    log.step = 1
    probes = Probes(model, cfg.reshard_after_forward, log.settle, log.sources)
    inputs, labels = next(train.build_data(cfg, dist.get_rank(), dist.get_world_size()))
    with log, marked_compute(model, log.sources.mark, probes.computing) if log.sources else contextlib.nullcontext():
        logits = model(inputs["input"].to(device))
    loss = train.loss_fn(logits, labels.to(device), cfg.num_gradient_accumulation_steps)
    when = "after the first forward"
    probes.ran_every_hook(when)
    if why := handwritten.override_problem(model):
        probes.problems.append(f"{when}: {why}")
    for name, p in () if why else model.layers.named_parameters():
        if not isinstance(p, DTensor):
            probes.problems.append(f"{when}: layers.{name} is a {type(p).__name__}, not its sharded DTensor "
                                   "(a block that reshards after forward puts its sharded parameters back)")
            break
    return Run(None, [], probes.problems + log.problems, log.record(), problem or log.uses_fsdp2,
               forward_loss=loss.item())


def shard_job(cfg: train.Config, step: int, name: str) -> torch.Tensor:
    """Train again (deterministic: same bits) and return this rank's shard of `name` at `step`."""
    kept = {}

    def inspect(model: nn.Module, at: int) -> None:
        if at == step:
            agree(handwritten.override_problem(model))
            p = dict(model.named_parameters())[name]
            kept["shard"] = (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()

    train.train(dataclasses.replace(cfg, num_steps=max(step, 1), profile_steps=0), inspect=inspect)
    return kept["shard"]


class OddMLP(nn.Module):
    """Rows that do not divide by 2 or 3, and a layer with fewer rows than ranks."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 7)      # 7 rows: 3/3/1 on 3 ranks, 4/3 on 2
        self.down = nn.Linear(7, 2)    # 2 rows: 1/1/0 on 3 ranks (an empty shard)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))

    def forward(self, x):
        return self.down(torch.relu(self.up(x * self.scale)))


def odd_shapes_job(impl: str | None, steps: int = 3) -> dict[str, list[torch.Tensor]]:
    """Train OddMLP a few steps; return every parameter (full) and its gradient at each step."""
    cfg = config(impl) if impl else config()
    fsdp = train.fsdp_module(cfg)
    device = current_device("cpu")
    torch.manual_seed(0)
    model = OddMLP().to(device)
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (model.up, model.down):
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    assert_sharded(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    seen: dict[str, list[torch.Tensor]] = {}
    for step in range(1, steps + 1):
        x = torch.randn(4, 5, generator=gen).to(device)
        model(x).pow(2).mean().backward()
        agree(handwritten.override_problem(model))
        for name, p in model.named_parameters():
            if p.grad is None:
                raise AssertionError(f"odd shapes: {name} has no gradient after backward (step {step})")
            seen.setdefault(name + ".grad", []).append(p.grad.full_tensor().cpu())
        opt.step()
        opt.zero_grad()
        assert_sharded(model, step)
        for name, p in model.named_parameters():
            seen.setdefault(name, []).append(p.full_tensor().detach().cpu())
    return seen


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage that a Python-visible tensor holds (parameters, DTensors'
    local tensors, optimizer state, anything a list or attribute keeps): exact, whatever the
    allocator or the threads did. A leak of tensors that Python keeps shows here to the byte."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # isinstance would query proxies for __class__
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        if t.device.type != "cpu" or type(t) not in (torch.Tensor, nn.Parameter):
            continue
        s = t.untyped_storage()
        storages[s.data_ptr(), s.nbytes()] = s.nbytes()
    return sum(storages.values())


@dataclasses.dataclass
class Memory:
    """One rank's memory in one run (bytes; per step from step 1): peaks, the bytes held at the end
    of each step, and the bytes of Python-visible tensors then; and the model's block sizes."""

    peaks: list[int]
    held: list[int]
    live: list[int]
    block_reduce: int
    """one block's parameters in the reduce dtype: its reduce-scatter input"""
    block_largest: int
    """one block's parameters in the larger of the parameter and reduce dtypes: the largest
    buffer of one collective"""


def memory_job(cfg: train.Config) -> Memory:
    """This rank's memory per step: on CPU what memory.TensorPeaks counts (the same on every
    platform), on CUDA the caching allocator's peak and current allocated bytes. Under the same
    instruments as a profiled run (the collective log, the marks of waits and of the model's compute,
    under a mark drawn here), so that a program cannot tell the run its memory is judged on from the one
    its overlap is judged on (and prefetch everything in one, nothing in the other); a read of a
    collective's output before its wait fails here too."""
    live, held = [], []
    device = current_device(cfg.device)
    log = CommLog()
    mark = drawn_mark()
    with marked_waits(), log, contextlib.ExitStack() as marks:
        def instrument(model: nn.Module, step: int) -> None:
            if step == 0:
                with uncollected():  # before marked_compute reads it, and the loop's optimizer takes its parameters
                    agree(handwritten.override_problem(model))
                    marks.enter_context(marked_compute(model, mark))
            log.settle()
            log.step = step + 1

        if device.type == "cuda":
            def inspect(model: nn.Module, step: int) -> None:
                instrument(model, step)
                if step:
                    live.append(live_tensor_bytes())
                    held.append(torch.cuda.memory_allocated(device))

            peaks = train.train(cfg, inspect=inspect).peak_memory
        else:
            with memory.TensorPeaks() as tp:
                def inspect(model: nn.Module, step: int) -> None:
                    instrument(model, step)
                    tp.mark()  # step 0: the model is built and wrapped
                    if step:
                        live.append(live_tensor_bytes())

                train.train(cfg, inspect=inspect)
            peaks, held = tp.peaks[1:], tp.levels[1:]
    if log.problems:
        raise AssertionError("; ".join(log.problems[:3]))
    # After training, which makes the tokenizer whose vocabulary this reads on a fresh checkout.
    return Memory(peaks, held, live, *block_bytes(cfg, dist.get_world_size()))


def block_bytes(cfg: train.Config, world_size: int) -> tuple[int, int]:
    """(Memory.block_reduce, Memory.block_largest) of `cfg` on `world_size` ranks, from the analytic model the
    report and the fit estimate share: one block's padded flat buffer, in the reduce dtype (its
    reduce-scatter input) and in the larger of the two dtypes."""
    groups = memory_model.model_groups(cfg.model, cfg.seq_len, assets.vocab_size(),
                                       dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads)
    world = world_size // cfg.replicate  # HSDP: the shard group's
    block = memory_model.largest_block(groups, world)
    reduce = train.DTYPES[cfg.reduce_dtype] or train.DTYPES[cfg.param_dtype] or torch.float32
    compute = train.DTYPES[cfg.param_dtype] or torch.float32
    larger = max(reduce, compute, key=lambda d: d.itemsize)
    return (memory_model.reduce_scatter_input_bytes(block, world, reduce),
            memory_model.group_bytes(block, world, larger.itemsize))

"""Overlap by order, what the graded overlap checks judge (harness/tools/grading/checks.py).

`schedule` places each FSDP group's all-gather and reduce-scatter in the issuing thread's order:
issued by the c10d op inside `FSDP::all_gather (G)` / `FSDP::post_backward_reduce (G)`, waited
for at the next `FSDP::all_gather_copy_out (G)` / `FSDP::reduce_scatter_wait (G)` (the reference's
PendingReduce.finish; `reduce_scatter_done` when it had already finished), or at once when a
`Work.wait` range (`marked_waits`) follows the op inside its group range, or its own wait comes in
the same FSDP hook. It is overlapped when aten compute outside `FSDP::` ranges ran in between.
Unlike hidden time (harness/tools/traces/collectives.py), this depends only on the program, never on how
threads were scheduled.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import re
import secrets
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from harness.memory_model import group_of
from harness.tools.traces.trace import C10D_OPS, LINK, OTHER, ROOT_GROUP, Ranges, Trace, inside, span_at, union

# Where the main thread waited for a group's collective: the all-gather's copy-out (FSDP2's name),
# and PendingReduce.finish's two ranges: `reduce_scatter_wait` when the reduce-scatter was still
# running (the thread blocks), `reduce_scatter_done` when it had already finished (no wait). On a 2-D
# mesh the reference's names end in the process group, ` [shard]` (trace.LINK).
WAIT_RANGE = re.compile(r"^FSDP::(?P<what>all_gather_copy_out|reduce_scatter_wait|reduce_scatter_done)"
                        r"(?: \((?P<fqn>.*?)\))?" + LINK + "$")


@dataclass
class Scheduled:
    """One all-gather or reduce-scatter of an FSDP group, placed in the main thread's order."""

    rank: int | None
    step: int | None
    phase: str
    pass_start: float
    """start of the `## forward ##` / `## backward ##` range it was issued in: one pass."""
    kind: str
    group: str
    issued: float
    waited: float | None
    """start of the range where the thread waited for it; None if it never did (or not via FSDP's ranges)."""
    blocked: bool
    """the thread had to wait (False: a reduce-scatter found already finished, see WAIT_RANGE)."""
    overlapped: bool
    """compute of another group ran on the thread between issue and wait, or it never blocked."""
    released: float | None = None
    """when it stopped being in flight: the later of `waited` and its own Work's first wait (a copy-out range
    opened early, its Work waited for later, was still in flight meanwhile); None: never waited for."""
    started: tuple[str, ...] | None = None
    """in a marked trace, the groups whose model compute had begun in this pass by the first compute after its issue
    (in the order they began; see `most_ahead`); None: unmarked, or nothing computed after it in the pass."""
    number: int | None = None
    """in a marked trace, an all-gather's number on its rank (`gather_tag`: whose data a leaf's parameters held)."""


BLOCKING_WAIT, DONE_WAIT = "Work.wait (blocking)", "Work.wait (done)"
POLLED_DONE, OTHER_WAIT = "Work.is_completed (polled until true)", "Work.wait (other)"
"""a Work that `is_completed()` found running, then finished (a loop that polls it waits as much as
`wait()`), and the other ways to wait for one (get_future, synchronize, result, a barrier): each marked where it
happened, so that no way of waiting goes unseen. Unlike `wait()`, which an FSDP may call for another
group's collective in the hook that issued this one, an FSDP never needs either for its own: found in
the hook that issued a collective, after the issue, they are a wait at once."""
WAIT_MARKS = (BLOCKING_WAIT, DONE_WAIT, POLLED_DONE, OTHER_WAIT)
HOOK_WAIT_MARKS = (POLLED_DONE, OTHER_WAIT)
ISSUED, WAITED, FOUND_DONE = "Work issued #", "Work waited #", "Work found done #"
"""Each collective's own Work, tagged where it was issued, where the program waited for it while it ran (a
blocking wait(), a poll that ended, get_future...) and where it asked it once done (wait(), get_future...,
each of which lets the result be read; an is_completed() that says True at once does not, see jobs.py's
[Note: a collective's result read before its wait]): a wait the
FSDP's own ranges do not show (a program can open an empty `FSDP::all_gather_copy_out` range later) is
still the collective's wait. An all-gather's first tag after its issue, of either kind, is where its result
was asked for; a reduce-scatter found done was not waited for (FSDP2's and the reference's `reduce_scatter_done`)."""
ASKED = "Work asked #"
"""A Work asked while it ran by a way of waiting that returns at once on gloo, the work still running (synchronize,
get_future...): where it was asked, as WAITED, for the overlap check (a program may read its result from there);
never where it was released (`Scheduled.released`): only a wait that found or made it done releases it."""
_ISSUING = ("_allgather_base", "allgather", "allgather_into_tensor_coalesced", "_reduce_scatter_base",
            "reduce_scatter", "reduce_scatter_tensor_coalesced", "allreduce")
"""the ProcessGroup methods behind every public all-gather, reduce-scatter and all-reduce."""


WORK_WAITS = ("wait", "is_completed", "get_future", "synchronize", "result", "block_current_stream")
"""the ways a `Work` tells its caller that the collective is done (or makes the stream wait for it):
what `marked_waits` marks as a wait, and what the collective log takes as one."""


def named_as(plain, marking):
    """`marking` named as the method it stands in for, so that a program cannot tell from its name
    (`Work.wait.__qualname__`) that it runs under the grader's marks."""
    for name in ("__name__", "__qualname__", "__module__", "__doc__"):
        try:
            setattr(marking, name, getattr(plain, name, None))  # a C method has no __module__: nor has the gate one
        except (AttributeError, TypeError):
            pass
    return marking


# [Note: gates put in place before the file]
# The marks (marked_waits) and the collective log (jobs.CommLog) stand in for Work's ways to wait, the
# process group's ways to issue and the barrier, each for its own extent. Were they set on the classes for
# that extent only, a file could keep the plain method it found at import (`_wait = dist.Work.wait`), wait
# with it where no mark shows, then call wait() again later, where the wait looks overlapped (a red-team
# file earned every point of tasks 2 and 3 so, with no prefetch at all). So each of these places holds a
# gate, put there before any file under test is imported (`gate_collectives`, a rank's first act after its
# process group is up) and never taken away, and an instrument routes the gates for its extent (`routed`):
# whatever object a file kept, its call goes through what is installed at the time of the call. A gate is
# named as the method it stands for; the plain methods are held here only, where a file cannot reach.

_ROUTES: dict[str, Callable] = {}
"""per gated place ("Work.wait", "ProcessGroup.allgather", "barrier"): what its gate calls now."""


def _gated_places() -> list[tuple[str, tuple, str]]:
    """(route, the objects that hold it, attribute name) for every place an instrument stands in for."""
    dist = torch.distributed
    return ([(f"Work.{name}", (dist.Work,), name) for name in WORK_WAITS]
            + [(f"ProcessGroup.{name}", (dist.ProcessGroup,), name) for name in _ISSUING]
            + [("barrier", (dist, dist.distributed_c10d), "barrier")]  # one function under two names
            # a storage's bytes moved where no op shows it (jobs.py's [Note: where the model's parameters came from])
            + [("UntypedStorage.resize_", (torch.UntypedStorage,), "resize_")]
            # what reads a tensor's values past the dispatcher, every mode off or not (jobs.py's [Note: reads the
            # dispatcher does not show]): its printing, and its values turned into Python's or numpy's
            + [("_tensor_str._str", (torch._tensor_str,), "_str")]
            + [(f"Tensor.{name}", (torch.Tensor,), name) for name in ("tolist", "numpy")])


def gate_collectives() -> None:
    """Put a gate in every place an instrument stands in for (once per process; see [Note: gates put in
    place before the file])."""
    if _ROUTES:
        return

    def gate_of(route: str):
        def gate(*args, **kwargs):
            return _ROUTES[route](*args, **kwargs)
        return gate

    for route, owners, name in _gated_places():
        _ROUTES[route] = plain = getattr(owners[0], name)
        gate = named_as(plain, gate_of(route))
        for owner in owners:
            setattr(owner, name, gate)


def current(route: str) -> Callable:
    """What the gate of `route` calls now (the plain method when no instrument is on)."""
    gate_collectives()
    return _ROUTES[route]


@contextlib.contextmanager
def routed(routes: dict[str, Callable]):
    """Inside the `with`, each gate named in `routes` calls what `routes` gives it; afterwards what it
    called before, however the `with` ends (the ranks run other jobs afterwards)."""
    gate_collectives()
    before = {route: _ROUTES[route] for route in routes}
    _ROUTES.update(routes)
    try:
        yield
    finally:
        _ROUTES.update(before)


@contextlib.contextmanager
def uncollected():
    """No garbage collection inside: the grader's own code in a program's process (a gate's, the collective log's)
    reads, then writes, what it keeps, or marks the trace in order, and a collection between would run the program's
    weakref callbacks and finalizers there (a program can count its allocations to the one that collects): their
    ops unseen by the log, their ranges among the grader's."""
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def marked_waits(mark: str | None = None):
    """Every `Work.wait()` of the process shows in the trace as a range, named for whether the
    work was still running: a wait right after the issue, inside the same FSDP range (a blocking
    all-gather, `async_op=False`), is then seen even when no FSDP range marks it. So do the other
    ways to learn that a collective is done: `is_completed()` saying True after it said False (a loop
    polling it waits as much as `wait()`), `get_future()`, `synchronize()`, `result()`,
    `block_current_stream()`, and a barrier; each collective's own Work is tagged where it was issued and
    where it was waited for (ISSUED, WAITED, FOUND_DONE). Only inside the `with` (through the gates: see
    [Note: gates put in place before the file]). mark: in a graded run, the secret every one of these names
    begins with (`schedule` reads no other), so that a program cannot forge them with a `record_function` of
    its own (a tag that a Work was done, or another Work's issue in its place). No garbage collection runs
    inside a gate (`uncollected`): a program's weakref callback cannot range among its marks."""
    return _marked_waits(mark or "")


@contextlib.contextmanager
def _marked_waits(prefix: str):
    plain = {name: current(f"Work.{name}") for name in WORK_WAITS}

    running: set[int] = set()  # the Works is_completed() found running and nothing has waited for since

    def tag(what: str, work) -> None:
        with torch.profiler.record_function(f"{prefix}{what}{id(work)}"):
            pass

    def marked(name: str):
        return torch.profiler.record_function(prefix + name)

    work_type = torch.distributed.Work

    def wait(self, *args, **kwargs):
        if not isinstance(self, work_type):  # fails as the plain method does, naming nothing of the marks'
            return plain["wait"](self, *args, **kwargs)
        with uncollected():
            running.discard(id(self))  # waited for: a later Work at this address starts unpolled
            done = plain["is_completed"](self)
            with marked(DONE_WAIT if done else BLOCKING_WAIT):
                try:
                    out = plain["wait"](self, *args, **kwargs)
                except BaseException:  # timed out, the work maybe running still: asked, not released
                    tag(ASKED, self)
                    raise
            tag(FOUND_DONE if done else WAITED, self)  # once it returned: a wait that raised released nothing
            return out

    def is_completed(self):
        with uncollected():
            done = plain["is_completed"](self)
            if not done:
                running.add(id(self))
            elif id(self) in running:
                running.discard(id(self))
                tag(WAITED, self)
                with marked(POLLED_DONE):
                    pass
            return done

    def other(name):
        def waits(self, *args, **kwargs):
            if not isinstance(self, work_type):
                return plain[name](self, *args, **kwargs)
            with uncollected():
                running.discard(id(self))
                tag(FOUND_DONE if plain["is_completed"](self) else ASKED, self)
                with marked(OTHER_WAIT):
                    return plain[name](self, *args, **kwargs)
        return waits

    plain_barrier = current("barrier")

    def barrier(*args, **kwargs):  # every rank waits for every other: a wait for whatever is in flight
        with uncollected(), marked(OTHER_WAIT):
            return plain_barrier(*args, **kwargs)

    def issues(name):
        issue_plainly = current(f"ProcessGroup.{name}")

        def issue(self, *args, **kwargs):
            with uncollected():
                out = issue_plainly(self, *args, **kwargs)
                tag(ISSUED, out)
                return out
        return issue

    routes = {"Work.wait": wait, "Work.is_completed": is_completed, "barrier": barrier,
              **{f"Work.{name}": other(name) for name in WORK_WAITS[2:]},
              **{f"ProcessGroup.{name}": issues(name) for name in _ISSUING}}
    with routed(routes):
        yield


# [Note: what counts as compute]
# Between a collective's issue and its wait, "compute" must be the model's, never a token op a program
# runs for show (`torch.zeros(1).add_(1)` between the two proves nothing). Unmarked traces (a student's
# own, analysed by harness/tools/traces/analysis.py) count every aten op outside FSDP's ranges. A graded
# run marks what only the model computes and the program cannot imitate:
# - forward: the bodies of the model's leaf modules (nn.Linear, nn.Embedding, the norms), each run inside
#   a range whose name holds a secret the grader drew (`marked_compute`): nothing of an FSDP runs inside a
#   leaf's forward, and a program cannot name a range it does not know;
# - backward: the autograd engine's own nodes, the `cpu_op` ranges named `<Op>Backward<N>` (an
#   autograd.Function's node is named `<Class>Backward`, a hook runs outside its node's range, and a
#   `record_function` range is a `user_annotation`, whatever its name), of the ops a leaf's marked forward ran:
#   a node carries the sequence number of the forward op that made it (the profiler's "Sequence number"), so
#   a node of a graph the program built for itself, or of an op outside the model's leaves, is not compute.
# Each range also names the leaf (its name in the model, hence its FSDP group: memory_model.group_of), and so does
# each node, through its forward op: which group computes when, whatever the program names its own ranges
# (`most_ahead`). The leaves that ran, in order, are compared with FSDP2's (`model_order`): a leaf is named by the
# instance called, so a program that moves the model's leaves between blocks, or calls one itself, runs another
# order; and how many nodes ran (`model_calls`): a program that calls a model's node itself runs one more.
MODEL_BACKWARD = re.compile(r"^\w+Backward\d+$")
NOT_COMPUTE = " (not compute)"
"""after the mark: a forward of the model's own leaf whose class or tables were changed, counted, not compute."""
SEQUENCE = "Sequence number"
"""the profiler's link between a forward op and the backward node it made (both carry it)."""


def marked_name(mark: str, leaf: str, compute: bool = True) -> str:
    """The name of one of `marked_compute`'s ranges: the mark, whether it is compute, and the leaf's name in the
    model (as the model was wrapped)."""
    return f"{mark}{'' if compute else NOT_COMPUTE} @{leaf}"


def marked_leaf(name: str, mark: str) -> tuple[str, bool] | None:
    """(leaf, whether it is compute) of a range `marked_name` named; None for any other name."""
    if not name.startswith(mark):
        return None
    rest = name[len(mark):]
    for tail, compute in ((" @", True), (NOT_COMPUTE + " @", False)):
        if rest.startswith(tail):
            return rest[len(tail):], compute
    return None


GATHER_TAG, READ_TAG = " gathered #", " read parameters #"
NONE_GATHERED = 0
"""the number, in a `read_tag`, of bytes that hold no all-gather's data (jobs.Sources)."""


def gather_tag(mark: str, number: int) -> str:
    """The range inside the n-th all-gather a rank issued in a graded profiled run (jobs.Sources)."""
    return f"{mark}{GATHER_TAG}{number}"


def read_tag(mark: str, numbers) -> str:
    """The range inside an op that read a leaf's parameters, whose bytes held those all-gathers' data (jobs.Sources)."""
    return f"{mark}{READ_TAG}{','.join(map(str, sorted(numbers)))}"


def drawn_mark() -> str:
    """A name for `marked_compute`'s ranges that the file under test cannot know: drawn for each run."""
    return f"## model compute {secrets.token_hex(16)} ##"


WRAPPED_CALL = torch.nn.Module._wrapped_call_impl.__code__
FROM_OUTSIDE = " (called from outside the model)"
"""after a leaf's name: a call of the model's leaf that its own parent's forward did not make (`marked_compute`)."""


@contextlib.contextmanager
def marked_compute(model: torch.nn.Module, mark: str, called: Callable[[torch.nn.Module], None] | None = None):
    """Every forward of one of `model`'s leaf modules runs inside a range named `mark` (see
    [Note: what counts as compute]): the forward of each leaf class that torch or torchtitan defines,
    for the model's own instances of exactly that class (a subclass may add code around it). Which leaves
    ran, in order, is compared with FSDP2's (`model_order`): an FSDP never calls the model's modules itself,
    nor moves them; a call its parent's forward (the model's code, in torch or torchtitan) did not make through
    `Module.__call__` is named so (FROM_OUTSIDE), and is no compute. called: told of each leaf the model calls
    (jobs.Sources: whose parameters to follow). Put back however it ends."""
    import torchtitan

    homes = tuple(str(Path(m.__file__).parent) + "/" for m in (torch, torchtitan))
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    # the model's own leaves, each with its name and its parent as wrapped: a Linear the FSDP makes for itself is
    # not the model
    mine = {id(m): name for name, m in model.named_modules() if next(m.children(), None) is None}
    parents = {id(m): model.get_submodule(name.rpartition(".")[0]) for name, m in model.named_modules()
               if id(m) in mine}
    call_impl = torch.nn.Module._call_impl.__code__
    # Module.__call__'s frames: with hooks on the module, _call_impl runs its forward from a nested `inner`
    hooked = next(c for c in call_impl.co_consts if isinstance(c, types.CodeType) and c.co_name == "inner")
    plain = {}
    for cls in {type(m) for m in leaves}:
        forward = cls.__dict__.get("forward")
        if getattr(getattr(forward, "__code__", None), "co_filename", "").startswith(homes):
            plain[cls] = forward

    def marked(cls, forward):
        def run(self, *args, **kwargs):
            if id(self) not in mine:
                return forward(self, *args, **kwargs)
            # Every call of the model's own leaf is counted; its ops are compute only while the module is as
            # the model built it: its attribute tables plain dicts, so that reading self.weight in its forward
            # runs nothing of the FSDP's.
            plain_module = type(self) is cls and all(
                type(self.__dict__.get(table)) is dict for table in ("_parameters", "_buffers", "_modules"))
            # Called by the model: Module.__call__'s frames, and above them its parent's forward, in the model's
            # code (a leaf moved to another block, or called by the FSDP, even from a hook whose argument it named
            # `self`, is not; see [Note: what counts as compute]).
            frame = sys._getframe(1)
            if frame.f_code is hooked:
                frame = frame.f_back
            wrapped = frame.f_back if frame.f_code is call_impl else None
            caller = wrapped.f_back if wrapped is not None and wrapped.f_code is WRAPPED_CALL else None
            by_model = (caller is not None and caller.f_code.co_filename.startswith(homes)
                        and caller.f_locals.get("self") is parents[id(self)])
            del frame, wrapped, caller
            name = mine[id(self)] if by_model else mine[id(self)] + FROM_OUTSIDE
            if called is not None and by_model and plain_module:
                called(self)
            with torch.profiler.record_function(marked_name(mark, name, plain_module and by_model)):
                return forward(self, *args, **kwargs)
        return run

    for cls, forward in plain.items():
        cls.forward = named_as(forward, marked(cls, forward))
    try:
        yield
    finally:
        for cls, forward in plain.items():
            cls.forward = forward


def model_order(events: list[dict], mark: str) -> list[str]:
    """The model's leaves whose forwards ran in these events (`marked_compute`), compute or not, in order."""
    return [leaf[0] for e in sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
            if (leaf := marked_leaf(e["name"], mark))]


def model_calls(events: list[dict], mark: str, nodes: dict[int, str] | None = None) -> tuple[int, int]:
    """(forwards of the model's leaf modules, compute or not; runs of their ops' backward nodes) in these events.
    nodes: `linked_nodes` of these events (default: read here)."""
    forwards = sum(1 for e in events if e.get("cat") == "user_annotation" and marked_leaf(e["name"], mark))
    nodes = linked_nodes(events, mark) if nodes is None else nodes
    return forwards, sum(1 for e in events if e.get("cat") == "cpu_op" and e.get("args", {}).get(SEQUENCE) in nodes
                         and MODEL_BACKWARD.match(e["name"]))


def linked_nodes(events: list[dict], mark: str, by: Callable[[str], str] = group_of,
                 leaves: dict[int, set[str]] | None = None) -> dict[int, str]:
    """Sequence number -> group (`by` the leaf's name: its group; or the leaf itself), of every op that ran inside a
    leaf's marked forward which is compute, whatever thread: the backward nodes those ops made carry the same number
    (see [Note: what counts as compute]). A number found in two groups (two threads' counters) links neither.
    leaves: `node_leaves` of these events, read once per trace (default: read here)."""
    out: dict[int, str] = {}
    for n, named in (node_leaves(events, mark) if leaves is None else leaves).items():
        groups = {group for leaf in named if (group := by(leaf)) is not None}
        if len(groups) == 1 and (group := groups.pop()):
            out[n] = group
    return out


def node_leaves(events: list[dict] | Trace, mark: str) -> dict[int, set[str]]:
    """Sequence number -> the leaves inside whose marked forward (compute) an op of that number ran, on any thread
    (what `linked_nodes` groups). Given a Trace, its ranges', read once per trace and mark."""
    if isinstance(events, Trace):
        if (key := ("node_leaves", mark)) not in events.memo:
            events.memo[key] = node_leaves(events.ranges, mark)
        return events.memo[key]
    spans: dict[tuple, list] = defaultdict(list)  # thread -> the compute ranges of leaf forwards on it
    for e in events:
        if e.get("cat") == "user_annotation" and (marked := marked_leaf(e["name"], mark)) and marked[1]:
            spans[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], marked[0]))
    at = {thread: Ranges(ranges) for thread, ranges in spans.items()}
    out: dict[int, set[str]] = defaultdict(set)
    for e in events:
        if e.get("cat") == "cpu_op" and (n := e.get("args", {}).get(SEQUENCE)) is not None \
                and e["name"].startswith("aten::") and (thread := at.get((e["pid"], e["tid"]))) \
                and (leaf := thread.at(e["ts"])) is not None:
            out[n].add(leaf)
    return out


def compute_ops(on: list[dict], fsdp: list, c10d: list, mark: str | None,
                nodes: dict[int, str] | None = None) -> list[tuple[float, str | None]]:
    """(start, group) of every op on one thread that counts as compute (see [Note: what counts as compute]), in
    order; group None where unmarked. nodes: `linked_nodes` of the whole trace (default: of these events)."""
    ops = [e for e in on if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
           and not inside(e["ts"], fsdp) and not inside(e["ts"], c10d)]
    if mark is None:
        return sorted((e["ts"], None) for e in ops)
    computing = compute_at(on, mark, linked_nodes(on, mark) if nodes is None else nodes)
    return sorted((e["ts"], group) for e in ops if (group := computing(e["ts"])) is not None)


def compute_at(on: list[dict], mark: str, nodes: dict[int, str], by: Callable[[str], str] = group_of
               ) -> Callable[[float], str | None]:
    """On one thread: what computes at a time, `by` the leaf's name (its group, or the leaf itself; `nodes`:
    `linked_nodes` by the same), inside a leaf's marked forward which is compute or a node of its ops (see [Note:
    what counts as compute]); None outside both."""
    leaves = Ranges((e["ts"], e["ts"] + e["dur"], by(marked[0])) for e in on if e.get("cat") == "user_annotation"
                    and (marked := marked_leaf(e["name"], mark)) and marked[1])
    backward = Ranges((e["ts"], e["ts"] + e["dur"], nodes[n]) for e in on if e.get("cat") == "cpu_op"
                      and MODEL_BACKWARD.match(e["name"]) and (n := e.get("args", {}).get(SEQUENCE)) in nodes)
    # a leaf's forward recomputed inside a node's (activation checkpointing) is looked up first
    return lambda ts: (leaves.at(ts) or backward.at(ts))


def schedule(trace: Trace | str | Path | dict, mark: str | None = None) -> list[Scheduled]:
    """Every collective issued inside an FSDP group's range, with whether compute ran between its
    issue and its wait. Compute: aten ops on the issuing thread outside every `FSDP::` range and
    c10d op, i.e. what modules compute (another group's: this group's parameters are not gathered
    yet, or its gradients already reduced); with `mark`, the model's compute only (see [Note: what
    counts as compute]). Only order counts, not durations: for a given program the verdict does not
    depend on how threads were scheduled."""
    t = trace if isinstance(trace, Trace) else Trace(trace)
    out = []
    nodes = linked_nodes(t.ranges, mark, leaves=node_leaves(t, mark)) if mark is not None else None
    for thread in {(op["pid"], op["tid"]) for op in t.ops}:
        on = t.by_thread[thread]
        fsdp = union((e["ts"], e["ts"] + e["dur"]) for e in on
                     if e.get("cat") == "user_annotation" and e["name"].startswith("FSDP::"))
        c10d = union((e["ts"], e["ts"] + e["dur"]) for e in on if e["name"].startswith(("c10d::", "_c10d_functional::")))
        computed = compute_ops(on, fsdp, c10d, mark, nodes)
        compute = [ts for ts, _ in computed]
        began: dict[tuple, list[tuple[float, str]]] = {}  # pass -> (first compute, group) of each group in it

        def others_between(start: float, stop: float, group: str) -> bool:
            """Whether compute of a group other than `group` ran between the two times (any compute, unmarked): a
            collective's own group's compute (a view node of its backward, a leaf whose weight came earlier) runs
            without its data, and hides nothing of what FSDP overlaps."""
            return any(g != group for _, g in computed[bisect.bisect_left(compute, start):
                                                      bisect.bisect_left(compute, stop)])

        def started(pass_range: tuple[float, float], issued: float) -> tuple[str, ...] | None:
            """Scheduled.started: the groups whose compute began in the pass by the first compute after `issued`."""
            if pass_range not in began:
                first: dict[str, float] = {}
                for ts, group in computed[bisect.bisect_left(compute, pass_range[0]):
                                          bisect.bisect_right(compute, pass_range[1])]:
                    first.setdefault(group, ts)
                began[pass_range] = sorted((ts, group) for group, ts in first.items() if group is not None)
            k = bisect.bisect_left(compute, issued)
            if mark is None or k == len(compute) or compute[k] > pass_range[1]:
                return None
            return tuple(group for ts, group in began[pass_range] if ts <= compute[k])
        waits: dict[tuple[str, str], list[tuple[float, str]]] = defaultdict(list)  # (kind, group) -> (ts, what)
        for e in on:
            if e.get("cat") == "user_annotation" and (m := WAIT_RANGE.match(e["name"])):
                kind = "all_gather" if m["what"] == "all_gather_copy_out" else "reduce_scatter"
                waits[kind, m["fqn"] or ROOT_GROUP].append((e["ts"], m["what"]))
        for ranges in waits.values():
            ranges.sort()
        issues: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for op in (op for op in t.ops if (op["pid"], op["tid"]) == thread):
            if (group := t.group_of(op)) is not None and C10D_OPS[op["name"]][0] in ("all_gather", "reduce_scatter"):
                issues[C10D_OPS[op["name"]][0], group].append(op)
        # the marks' names, in a graded run behind its secret (marked_waits)
        marks = mark or ""
        any_wait = sorted(e["ts"] for e in on if e["name"] in {marks + m for m in WAIT_MARKS})
        issued_tags = sorted((e["ts"], e["name"][len(marks + ISSUED):]) for e in on
                             if e["name"].startswith(marks + ISSUED))
        waited_tags: dict[str, list[float]] = defaultdict(list)  # Work -> when it was waited for while running
        done_tags: dict[str, list[float]] = defaultdict(list)  # Work -> when wait() found it done
        asked_tags: dict[str, list[float]] = defaultdict(list)  # Work -> when a way that returns at once asked it
        tagged_as = [(marks + what, tags) for what, tags in ((WAITED, waited_tags), (FOUND_DONE, done_tags),
                                                              (ASKED, asked_tags))]
        for e in on:
            for prefix, tags in tagged_as:
                if e["name"].startswith(prefix):
                    tags[e["name"][len(prefix):]].append(e["ts"])
        thread_ops = sorted(op["ts"] for op in t.ops if (op["pid"], op["tid"]) == thread)

        def own_wait(op: dict) -> tuple[float | None, float | None]:
            """(when the program first waited for this collective's own Work (see ISSUED): while it ran, or, for an
            all-gather, once it was done (its result may be read from there); its issue's end where no Work method
            ever asked for it (the program learnt it was done another way: polling the output's contents, say),
            which is a wait at once; when it was first found or made done, its release: None where it was only
            asked by a way that returns at once (ASKED), which releases nothing). (None, None): not issued through
            a method the marks tag."""
            end = op["ts"] + op["dur"]
            i = bisect.bisect_left(issued_tags, (end, ""))
            later = bisect.bisect_right(thread_ops, op["ts"])
            if i == len(issued_tags) or later < len(thread_ops) and thread_ops[later] < issued_tags[i][0]:
                return None, None  # not issued through a ProcessGroup method marked_waits tags
            tagged, work = issued_tags[i]
            # the same address tagged again later is a new Work: this one's waits come before that issue
            until = min((ts for ts, w in issued_tags[i + 1:] if w == work), default=float("inf"))
            within = lambda *tags: [ts for ts in tags if tagged < ts < until]  # noqa: E731
            waited, done, asked = (within(*t.get(work, ())) for t in (waited_tags, done_tags, asked_tags))
            if not (waited or done or asked):
                return end, end
            release = min(waited + done, default=None)
            found = waited + asked + (done if C10D_OPS[op["name"]][0] == "all_gather" else [])
            return min(found, default=None), release
        hook_wait = sorted(e["ts"] for e in on if e["name"] in {marks + m for m in HOOK_WAIT_MARKS})
        numbers = sorted((e["ts"], int(e["name"][len(mark) + len(GATHER_TAG):])) for e in on if mark is not None
                         and e.get("cat") == "user_annotation" and e["name"].startswith(mark + GATHER_TAG)
                         and e["name"][len(mark) + len(GATHER_TAG):].isdigit())
        group_ranges = t.groups.get(thread)
        for (kind, group), ops in issues.items():
            for k, op in enumerate(ops):
                end = op["ts"] + op["dur"]
                before = ops[k + 1]["ts"] if k + 1 < len(ops) else float("inf")  # its wait precedes the next issue
                candidates = waits[kind, group]
                i = bisect.bisect_left(candidates, (end, ""))
                waited, what = candidates[i] if i < len(candidates) and candidates[i][0] < before else (None, None)
                # Waited at once: any Work.wait before its group range ends (a blocking collective), or
                # its own wait in the same FSDP hook (outermost FSDP range) that issued it.
                issuing = next(((s, e) for s, e, _ in group_ranges.ranges if s <= op["ts"] <= e), None)
                j = bisect.bisect_left(any_wait, end)
                hook = span_at(fsdp, op["ts"])
                h = bisect.bisect_left(hook_wait, end)
                if issuing and j < len(any_wait) and any_wait[j] <= issuing[1]:
                    waited, what = any_wait[j], "at once"
                elif hook and h < len(hook_wait) and hook_wait[h] <= hook[1]:
                    waited, what = hook_wait[h], "at once"
                elif waited is not None and hook and waited <= hook[1]:
                    what = "at once"
                # Its own Work waited for, while it ran, before any compute and before FSDP's ranges say so: at once.
                own, release = own_wait(op)
                # released where its own Work was first found or made done (its tags carry the run's secret), however
                # much later the program opens its copy-out range (a wait, the next group's issue, then the copy-out)
                released = None if waited is None or own is not None and release is None else \
                    waited if own is None else release
                if own is not None and what != "at once" and (waited is None or own < waited) \
                        and not others_between(end, own, group):
                    waited, what = own, "at once"
                if what == "reduce_scatter_done" and own is not None:
                    # said done, yet its own Work was waited for while it ran (an empty `reduce_scatter_done` range
                    # before a blocking wait): it was waited for there, as a `reduce_scatter_wait`
                    waited, what = own, "at once" if not others_between(end, own, group) else "reduce_scatter_wait"
                blocked = what != "reduce_scatter_done"
                ran = waited is not None and what != "at once" and others_between(end, waited, group)
                phase_range = next(((s, e) for s, e, _ in t.phases.ranges if s <= op["ts"] <= e), None)
                out.append(Scheduled(t.rank, t.steps.at(op["ts"]), t.phases.at(op["ts"], OTHER),
                                     phase_range[0] if phase_range else -1.0, kind, group, op["ts"], waited,
                                     blocked, ran or what == "reduce_scatter_done", released,
                                     started(phase_range, end) if phase_range else None,
                                     number_in(numbers, op) if kind == "all_gather" else None))
    return sorted(out, key=lambda s: (s.rank or 0, s.issued))


def number_in(numbers: list[tuple[float, int]], op: dict) -> int | None:
    """The number of the one `gather_tag` range inside this c10d op (sorted (start, number) of a thread's)."""
    i = bisect.bisect_left(numbers, (op["ts"], -1))
    inside_op = [n for ts, n in numbers[i:i + 2] if ts <= op["ts"] + op["dur"]]
    return inside_op[0] if len(inside_op) == 1 else None


THIS_PASS, EARLIER_PASS, EARLIER_STEP = "this pass", "an earlier pass of this step", "an earlier step"


def parameter_reads(t: Trace, mark: str, scheduled: list[Scheduled]) -> list[tuple]:
    """Every read of the model's leaves' parameters by its compute in this rank's trace (jobs.Sources' `read_tag`
    ranges inside a leaf's marked forward, or inside a node of its ops: see [Note: what counts as compute]), in order,
    as (step, phase, pass, leaf, sources), pass counting the step's passes of that phase from 0; the leaf is the one
    computing (the range's, or the node's forward op's), whatever
    the program registered, and sources, for each all-gather whose data the bytes read held, (the group it was issued
    as, its phase, and whether it was issued in the read's pass (THIS_PASS), an earlier one of its step, or an earlier
    step); (None, "", "") for one issued outside any group's range, or before the profiled steps; ("", "", "") where
    some bytes held no all-gather's data. `scheduled`: this trace's."""
    numbered = {s.number: s for s in scheduled if s.number is not None and s.rank == t.rank}
    nodes = linked_nodes(t.ranges, mark, by=lambda leaf: leaf, leaves=node_leaves(t, mark))
    passes = Ranges((s, e, s) for s, e, _ in t.phases.ranges)
    ordinal: dict[float, int] = {}  # a pass's start -> its place among its step's passes of its phase
    counted: dict[tuple, int] = defaultdict(int)
    for s, _, phase in sorted(t.phases.ranges, key=lambda r: r[0]):
        ordinal[s] = counted[t.steps.at(s), phase]
        counted[t.steps.at(s), phase] += 1
    prefix = mark + READ_TAG
    out = []
    for on in t.by_thread.values():
        tags = [e for e in on if e.get("cat") == "user_annotation" and e["name"].startswith(prefix)]
        if not tags:
            continue
        computing = compute_at(on, mark, nodes, by=lambda leaf: leaf)
        for e in tags:
            if (leaf := computing(e["ts"])) is None:
                continue  # not the model's compute: the FSDP's own copies
            held = e["name"][len(prefix):]
            step, phase, at = t.steps.at(e["ts"]), t.phases.at(e["ts"], OTHER), passes.at(e["ts"])
            sources = set()
            for n in held.split(",") if held else ():
                s = numbered.get(int(n)) if n.isdigit() else None
                if n == str(NONE_GATHERED):
                    sources.add(("", "", ""))
                elif s is None:
                    sources.add((None, "", ""))
                else:
                    sources.add((s.group, s.phase, THIS_PASS if s.pass_start == at else
                                 EARLIER_PASS if s.step == step else EARLIER_STEP))
            out.append((e["ts"], step, phase, ordinal.get(at, -1), leaf, tuple(sorted(sources, key=str))))
    return [read[1:] for read in sorted(out, key=lambda r: r[0])]


def must_overlap(scheduled: list[Scheduled]) -> list[Scheduled]:
    """Those of one kind and phase that FSDP's schedule can overlap: per pass, every all-gather but
    the first issued (no group ran before it in that pass to hide it; FSDP2 prefetches only within
    a pass) and every reduce-scatter but the last (the last group's: backward ends with it)."""
    passes: dict[tuple, list[Scheduled]] = defaultdict(list)
    for s in scheduled:
        passes[s.rank, s.pass_start].append(s)
    out = []
    for ops in passes.values():
        ops.sort(key=lambda s: s.issued)
        out += ops[1:] if ops[0].kind == "all_gather" else ops[:-1]
    return out


def most_ahead(scheduled: list[Scheduled], gathered: set[str]) -> tuple[int, Scheduled | None]:
    """Of one kind and phase, marked: how many groups the most all-gathers issued in a pass ran ahead of the groups
    that compute, and the all-gather where it was reached. The i-th all-gather of a pass is i - k groups ahead, where
    k of the groups that gather in this pass (`gathered`: FSDP2's, by its own ranges) had begun computing by the
    first compute after it (`Scheduled.started`). FSDP2 gathers a group as it starts, then the next: one ahead.
    Unlike `most_in_flight`, this does not depend on where the program waits: a group whose all-gather was waited
    for early (mid-block, from a hook on a block's child) and the next issued then holds one more group gathered
    with one all-gather in flight; and unlike a count of groups between an all-gather and its wait, not on the names
    the program gives its ranges."""
    passes: dict[tuple, list[Scheduled]] = defaultdict(list)
    for s in scheduled:
        passes[s.rank, s.pass_start].append(s)
    most, where = 0, None
    for ops in passes.values():
        for i, s in enumerate(sorted(ops, key=lambda o: o.issued), 1):
            if s.started is not None and (ahead := i - len(gathered.intersection(s.started))) > most:
                most, where = ahead, s
    return most, where


def most_in_flight(scheduled: list[Scheduled]) -> tuple[int, list[Scheduled]]:
    """Of one kind and phase: the most issued and not yet released at once within one pass (`Scheduled.released`:
    a never-waited one stays in flight), and those collectives, at the issue where it was reached. FSDP2 waits for
    a group's own all-gather, then starts the next group's: one in flight at a time. Issuing two groups ahead, or
    every group's at the start of a pass, would also pass for overlap, holding more groups gathered."""
    passes: dict[tuple, list[Scheduled]] = defaultdict(list)
    for s in scheduled:
        passes[s.rank, s.pass_start].append(s)
    most: list[Scheduled] = []
    for ops in passes.values():
        for s in ops:
            flying = [o for o in ops if o.issued <= s.issued and (o.released is None or o.released > s.issued)]
            if len(flying) > len(most):
                most = sorted(flying, key=lambda o: o.issued)
    return len(most), most

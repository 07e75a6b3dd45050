"""The sandboxed rank's backstop (harness/tools/grading/tamper.py), in this process: each kind of change is
named, undone it is not, and what torch does by itself as it runs is not a change."""

from __future__ import annotations

import contextlib
import os
import sys
import types
import typing

import torch
import torch._dynamo  # noqa: F401  (it wraps torch.manual_seed when first imported, by itself)
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from harness.tools.grading import jobs, tamper


@contextlib.contextmanager
def changed(namespace: dict, name: str, value):
    missing = object()
    old = namespace.get(name, missing)
    namespace[name] = value
    try:
        yield
    finally:
        if old is missing:
            del namespace[name]
        else:
            namespace[name] = old


def test_each_kind_of_change_is_named_and_undone_is_not():
    baseline = tamper.Baseline()
    assert baseline.changes() == []
    with changed(vars(dist), "all_gather_into_tensor", print):
        assert baseline.changes() == ["torch.distributed.all_gather_into_tensor (replaced)"]
    with changed(vars(jobs), "a_new_name", print):
        assert baseline.changes() == ["harness.tools.grading.jobs.a_new_name (added)"]
    with changed(vars(jobs), "_COMM_NAMESPACES", ()):  # the harness's data too
        assert baseline.changes() == ["harness.tools.grading.jobs._COMM_NAMESPACES (replaced)"]
    type.__setattr__(torch.Tensor, "add_", torch.Tensor.sub_)  # inherited from TensorBase: added to Tensor
    try:
        assert baseline.changes() == ["torch.Tensor.add_ (added)"]
    finally:
        type.__delattr__(torch.Tensor, "add_")
    outside: dict = {}  # a function of a file under test, wrapped by torch's own code
    exec(compile("def extra_repr(self):\n    return 'x'\n", "/submissions/fsdp.py", "exec"), outside)
    original = vars(torch.nn.Linear)["extra_repr"]
    type.__setattr__(torch.nn.Linear, "extra_repr", torch.compiler.disable(outside["extra_repr"]))
    try:
        assert baseline.changes() == ["torch.nn.modules.linear.Linear.extra_repr (replaced)"]
    finally:
        type.__setattr__(torch.nn.Linear, "extra_repr", original)
    # torch's own code written onto a class of torch's: torch.compiler.disable handed a class wraps its methods
    # (Linear.__init__ replaced, __call__ and _call_impl added), typing.final marks it; neither is torch running
    for cls, apply, named in ((torch.nn.Linear, torch.compiler.disable,
                               ["torch.nn.modules.linear.Linear.__init__ (replaced)",
                                "torch.nn.modules.linear.Linear.__call__ (added)",
                                "torch.nn.modules.linear.Linear._call_impl (added)"]),
                              (torch.nn.ReLU, __import__("typing").final,
                               ["torch.nn.modules.activation.ReLU.__final__ (added)"])):
        original = dict(vars(cls))
        apply(cls)
        try:
            assert sorted(baseline.changes()) == sorted(named)
        finally:
            for k in vars(cls).keys() - original.keys():
                type.__delattr__(cls, k)
            for k, v in original.items():
                if vars(cls)[k] is not v:
                    type.__setattr__(cls, k, v)
    code = jobs.digest.__code__
    jobs.digest.__code__ = (lambda p: "0").__code__
    try:
        assert baseline.changes() == ["harness.tools.grading.jobs.digest's code (replaced)"]
        baseline.extend()  # before the next job: a swap is still a change
        assert baseline.changes() == ["harness.tools.grading.jobs.digest's code (replaced)"]
    finally:
        jobs.digest.__code__ = code
    # an object of the file's (not code) in torch's place
    file = types.ModuleType("effdl_fsdp_test")
    file.__file__ = "/submissions/fsdp.py"
    exec(compile("class Dispatcher:\n    pass\n", file.__file__, "exec"), vars(file))
    sys.modules[file.__name__] = file
    original = vars(DTensor)["_op_dispatcher"]
    type.__setattr__(DTensor, "_op_dispatcher", file.Dispatcher())
    try:
        assert baseline.changes() == ["torch.distributed.tensor.DTensor._op_dispatcher (replaced)"]
    finally:
        type.__setattr__(DTensor, "_op_dispatcher", original)
        del sys.modules[file.__name__]
    assert baseline.changes() == []


def test_what_torch_changes_as_it_runs_is_not_a_change():
    """An optimizer class's first instance wraps its step (torch.optim's step hooks): its own, or the one it
    inherits (AdamW's, Adam's); a new op namespace; torch.compile's generation tags on nn.Module."""

    class Own(torch.optim.Optimizer):  # fresh classes of torch's (an earlier test may have hooked torch's own)
        def step(self, closure=None):
            return None

    class Inherits(Own):
        pass

    module = types.ModuleType("torch.optim._optimizers_of_this_test")
    for cls in (Own, Inherits):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[module.__name__] = module
    try:
        baseline = tamper.Baseline()
        assert Own in baseline.classes and Inherits in baseline.classes
        for cls in (Inherits, Own):
            cls([torch.zeros(1, requires_grad=True)], {})
            assert getattr(vars(cls)["step"], "hooked", False)  # what the baseline must tell from a replaced method
            assert baseline.changes() == [], cls
    finally:
        del sys.modules[module.__name__]
    baseline = tamper.Baseline()
    torch.ops.a_namespace_made_on_first_use  # noqa: B018
    fresh = next(c for c in vars(typing).values() if isinstance(c, type) and c.__module__ == "typing"
                 and "__annotations__" not in vars(c))
    fresh.__annotations__  # noqa: B018  (read first: Python adds an empty dict, as torch.compile's tracing makes it)
    assert "__annotations__" in vars(fresh) and baseline.changes() == []
    # what torch.compile patches into nn.Module once, as it first compiles (a no-op once done in this process)
    torch._dynamo.mutation_guard.install_generation_tagging_init()
    assert baseline.changes() == []


def test_a_context_left_on_is_named():
    """A context entered and never left (a `with` in a generator never resumed) changes a process-wide setting."""
    baseline = tamper.Baseline()

    def held():
        with torch.no_grad():
            yield

    generator = held()
    next(generator)
    try:
        assert baseline.changes() == ["torch.is_grad_enabled() (False, was True)"]
    finally:
        generator.close()
    assert baseline.changes() == []
    here = os.getcwd()
    os.chdir("/")  # contextlib.chdir held open the same way
    try:
        assert baseline.changes() == [f"os.getcwd() ('/', was {here!r})"]
    finally:
        os.chdir(here)
    for name, (on, off, named) in {"set_deterministic_debug_mode": (1, 0, "torch.get_deterministic_debug_mode()"),
                                   "set_autocast_xla_enabled": (True, False, "torch.is_autocast_enabled('xla')")}.items():
        getattr(torch, name)(on)  # settings that no context changes, but a call the source check refuses does
        try:
            assert any(c.startswith(named) for c in baseline.changes()), baseline.changes()
        finally:
            getattr(torch, name)(off)
    assert baseline.changes() == []


def test_void_names_the_changes():
    message = tamper.void([f"x.y{i} (replaced)" for i in range(10)])
    assert "x.y0 (replaced)" in message and "and 2 more" in message and "void" in message

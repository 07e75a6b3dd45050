"""The sandboxed rank's backstop (harness/tools/grading/tamper.py), in this process: each kind of change is
named, undone it is not, and what torch does by itself as it runs is not a change."""

from __future__ import annotations

import contextlib
import os
import sys
import types

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
    """An optimizer class's first instance wraps its step (torch.optim's step hooks); a new op namespace."""
    fresh = next(c for c in (torch.optim.Adagrad, torch.optim.Adamax, torch.optim.ASGD, torch.optim.Rprop)
                 if not getattr(c.step, "hooked", False))
    baseline = tamper.Baseline()
    fresh([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert getattr(fresh.step, "hooked", False)  # what the baseline must tell from a replaced method
    torch.ops.a_namespace_made_on_first_use  # noqa: B018
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

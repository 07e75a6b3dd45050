"""Whether a file under test changed what its process runs: a backstop behind the source check.

The detectors of a graded run (the collective log, the probes, the wait and compute marks, the FSDP2
checks) run inside the sandboxed rank, beside the file they watch. The source check
(handwritten.py) and the loader's guards (harness/impl.py) keep the file from reaching them; this is
the wall behind those two. Before a sandboxed rank's first job, a `Baseline` holds the modules the
detectors stand on (torch, the harness, train.py, the standard modules they use): each module's and
each of its classes' namespace, each function's code, defaults and the code its closure holds, and the
process-wide settings a context changes (grad mode, autocast, anomaly mode, the mode stacks, warnings'
filters, the standard streams). After every job the rank compares, and the job's result is void (the
rank reports an error that names each change), however the change was made:
- in the harness's and train.py's namespaces, anything replaced, added or deleted;
- in torch's and Python's, code replaced, added or deleted, unless torch did it itself: torch registers
  and wraps its own functions as they first run (torch.optim's step hooks, torch.compile's tags on
  nn.Module.__init__), so code written in torch that holds nothing from outside torch, Python and the
  harness is torch's; code from anywhere else (the file), or torch's wrapper around it, is not. Their
  data (settings, counters, caches) is torch's own state. torch's compilers (UNWATCHED), which patch
  themselves most and on which no detector stands, are not compared;
- a function's code, defaults or the code in its closure swapped, a module in `sys.modules` swapped, a
  class's metaclass or bases;
- a setting not back to what it was: a context entered and never left.

What it cannot see, by design: a change made and undone inside one job (the source check's and the
loaders' part). Its own code is in the baseline too, and the check is bound before the first job, so
replacing the method afterwards does not replace the check.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
import types

# What the detectors stand on; a module is watched when its name is one of these or under one.
WATCHED = ("torch", "torchtitan", "train", "harness", "builtins", "functools", "contextlib", "weakref", "threading",
           "gc", "pickle", "copyreg", "multiprocessing", "socket", "os", "posixpath", "sys", "io", "operator", "types",
           "typing", "enum", "dataclasses", "collections", "abc", "inspect", "traceback", "json", "struct",
           "hashlib", "warnings", "logging", "math", "itertools", "re")

CODE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
        types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType,
        types.GetSetDescriptorType, types.MemberDescriptorType, property, staticmethod, classmethod)
"""What runs: compared by identity (with anything callable)."""

# What Python adds to a namespace as it runs, by itself: warnings' once-registries, copy's slot names; and the
# harness's own once-flags.
ADDED_BY_PYTHON = frozenset({"__warningregistry__", "__slotnames__"})
HARNESS_STATE = {"harness.profiling": {"_cpu_profiler_quiet"}, "harness.compat": {"_proc_blocked"},
                 "harness.impl": {"_REFUSED"}}


# torch's compilers and tracers, which register, cache and wrap their own functions as they first run (and
# which no detector stands on).
UNWATCHED = ("torch._dynamo", "torch._inductor", "torch.compiler", "torch._functorch", "torch.fx", "torch._decomp",
             "torch._subclasses", "torch._export", "torch.export", "torch._higher_order_ops", "torch._prims",
             "torch._prims_common", "torch._refs", "torch._lazy", "torch.onnx", "torch.jit", "torch._library",
             "torch.utils._sympy")


def _ours(module: str) -> bool:
    """Torch's (its compilers too), torchtitan's, Python's or the harness's."""
    return module.split(".", 1)[0] in WATCHED


def watched(name: str) -> bool:
    return name.split(".", 1)[0] in WATCHED and not (name + ".").startswith(tuple(u + "." for u in UNWATCHED))


# What a function runs besides its closure, each compared by identity.
_PARTS = (("code", operator.attrgetter("__code__")), ("defaults", operator.attrgetter("__defaults__")),
          ("keyword defaults", operator.attrgetter("__kwdefaults__")))


def _cells(f: types.FunctionType) -> list:
    """The code a function's closure holds (its other variables may change as it runs)."""
    held = []
    for cell in f.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: a variable assigned later in the enclosing function
            continue
        if issubclass(type(value), CODE):
            held.append((cell, value))
    return held


def settings() -> dict[str, object]:
    """The process-wide settings a context changes while it is on (grad mode, autocast, anomaly mode, the
    default dtype, the mode stacks, warnings' filters, the standard streams, the tracer): between jobs each is
    as it was before the first, unless a context was entered and never left (a `with` in a generator never
    resumed, an ExitStack never closed)."""
    import threading
    import warnings

    import torch
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    found = {"torch.is_grad_enabled()": torch.is_grad_enabled(),
             "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
             "torch.is_anomaly_enabled()": torch.is_anomaly_enabled(),
             "torch.get_default_dtype()": torch.get_default_dtype(),
             "torch.get_default_device()": torch.get_default_device(),
             "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
             "torch.get_deterministic_debug_mode()": torch.get_deterministic_debug_mode(),
             "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
             "torch function modes": len(_get_current_function_mode_stack()),
             "torch dispatch modes": len(_get_current_dispatch_mode_stack()),
             "warnings.filters": tuple(warnings.filters),
             "sys.stdout": sys.stdout, "sys.stderr": sys.stderr, "sys.stdin": sys.stdin,
             "sys.gettrace()": sys.gettrace(), "sys.getprofile()": sys.getprofile(),
             "threading.gettrace()": threading.gettrace(), "threading.getprofile()": threading.getprofile(),
             "os.getcwd()": os.getcwd()}
    for device in ("cpu", "cuda", "xla", "ipu"):
        found[f"torch.is_autocast_enabled({device!r})"] = torch.is_autocast_enabled(device)
        found[f"torch.get_autocast_dtype({device!r})"] = torch.get_autocast_dtype(device)
    return found


class Baseline:
    """Every watched module's namespace and its classes', as the rank holds them before any job.

    Compared by identity, fast: each namespace is kept with the ids of its values in order (the copy
    keeps those objects alive, so an equal id is the same object), and a namespace whose keys and ids
    are unchanged is passed over at C speed; the others are walked."""

    def __init__(self):
        self.modules: dict[str, types.ModuleType] = {}
        self.namespaces: dict[object, tuple[dict, list[int]]] = {}  # module name or class -> copy, ids
        self.classes: dict[type, tuple[type, tuple]] = {}  # class -> its metaclass and bases
        self.functions: list[types.FunctionType] = []
        self.held: list[list] = []  # per function: its code, defaults, keyword defaults (alive), then their ids
        self.cells: list[tuple] = []  # (function, cell, the code it held)
        self.settings = settings()
        self.extend()

    def extend(self) -> None:
        """Add the watched modules imported since (a job's own modules arrive with the job), before the
        job runs."""
        classes, seen = [], set(self.functions)
        for name, module in list(sys.modules.items()):
            if name in self.modules or module is None or not watched(name):
                continue
            self.modules[name] = module
            namespace = getattr(module, "__dict__", None)
            if namespace is not None:
                self._keep(name, namespace, seen)
                classes += [v for v in namespace.values() if issubclass(type(v), type) and watched(_module_of(v))]
        for cls in classes:
            for c in cls.__mro__:
                if c not in self.classes and watched(_module_of(c)):
                    self.classes[c] = (type(c), c.__bases__)
                    self._keep(c, vars(c), seen)
        # what each function ran when first seen (never refreshed: a swap stays a change at every later job)
        new = self.functions[len(self.held[0]) if self.held else 0:]
        if not self.held:
            self.held = [[] for _ in range(2 * len(_PARTS))]
        for i, (_, get) in enumerate(_PARTS):
            self.held[i] += map(get, new)
            self.held[len(_PARTS) + i] += map(id, self.held[i][-len(new):] if new else ())

    def _keep(self, owner, namespace, seen: set) -> None:
        copy = dict(namespace)
        self.namespaces[owner] = (copy, [*map(id, copy.values())])
        for v in copy.values():
            if type(v) is types.FunctionType and v not in seen:
                seen.add(v)
                self.functions.append(v)
                self.cells += [(v, cell, held) for cell, held in _cells(v)]

    def changes(self) -> list[str]:
        """What differs from the baseline, each as `where.name (how)`; [] when nothing does."""
        now = settings()
        found = [f"{name} ({now[name]!r}, was {was!r})" if name != "warnings.filters" else f"{name} (changed)"
                 for name, was in self.settings.items() if not _same(now[name], was)]
        found += [f"sys.modules[{name!r}] (replaced)" for name, module in self.modules.items()
                  if sys.modules.get(name, module) is not module]
        found += [f"{_where(c)}.{what} (replaced)" for c, (meta, bases) in self.classes.items()
                  for what, now, was in (("__class__", type(c), meta), ("__bases__", c.__bases__, bases)) if now is not was]
        for owner, (old, ids) in self.namespaces.items():
            now = vars(self.modules[owner]) if isinstance(owner, str) else vars(owner)
            if now.keys() == old.keys() and [*map(id, now.values())] == ids:
                continue
            state = HARNESS_STATE.get(owner, ()) if isinstance(owner, str) else ()
            harness = (owner if isinstance(owner, str) else _module_of(owner)).split(".", 1)[0] in ("harness", "train")
            cls = not isinstance(owner, str)
            for k, v in old.items():
                if k not in now:
                    found.append(f"{_where(owner)}.{k} (deleted)")
                elif now[k] is not v and (k not in state and not _compiled(owner, k) if harness
                                          else _changed(owner, k, now[k], v) or cls and _runs(now[k]) and
                                          not _patched_by_torch(owner, k, now[k], v)):
                    found.append(f"{_where(owner)}.{k} (replaced)")
            for k in now.keys() - old.keys():
                if k not in ADDED_BY_PYTHON and not _submodule(owner, k, now[k]) and not _compiled(owner, k) and \
                        (harness or cls and not _patched_by_torch(owner, k, now[k], None) and
                         not _annotations_read(k, now[k]) or
                         _changed(owner, k, now[k], None)):
                    found.append(f"{_where(owner)}.{k} (added)")
        for (part, get), ids in zip(_PARTS, self.held[len(_PARTS):]):
            if [*map(id, map(get, self.functions))] != ids:
                found += [f"{_where_function(f)}'s {part} (replaced)" for f, was in zip(self.functions, ids)
                          if id(get(f)) != was]
        found += [f"{_where_function(f)}'s closure (replaced)" for f, cell, held in self.cells
                  if _filled_with(cell) is not held]
        return found



def _annotations_read(name: str, value) -> bool:
    """What Python adds to a class whose `__annotations__` is first read (typing's inspection, torch.compile's
    tracing): an empty dict."""
    return name == "__annotations__" and type(value) is dict and not value


def _patched_by_torch(owner: type, name: str, value, before) -> bool:
    """The code torch writes onto a class of its own as it runs, each known by name: torch.optim's step hook (an
    optimizer class's first instance wraps the class's `step` in its profiling wrapper, functools.wraps of the
    step it replaced or inherited) and torch.compile's generation tags (nn.Module's __init__ and __setstate__ wrapped by
    torch._dynamo.mutation_guard, once, with a flag saying so). Anything else new on a class, torch's own wrapper
    around its own method included (what torch.compiler.disable(nn.Linear) writes), is a change."""
    import torch

    if name == "step" and issubclass(owner, torch.optim.Optimizer):  # AdamW's: where there was none, Adam's
        inherited = next((vars(c)["step"] for c in owner.__mro__[1:] if "step" in vars(c)), None)
        wrapped = getattr(value, "__wrapped__", None)
        return _torch_code(value) and wrapped is not None and (
            wrapped is before if before is not None else wrapped in (inherited, getattr(inherited, "__wrapped__", None)))
    if owner is torch.nn.Module and name in ("__init__", "__setstate__"):
        return type(value) is types.FunctionType and value.__code__.co_filename == _GENERATION_TAGS and \
            any(_filled_with(cell) is before for cell in value.__closure__ or ())
    return owner is torch.nn.Module and name == "___needs_generation_tag_patch" and before is None and value is False


def _submodule(owner, name: str, value) -> bool:
    """A package's submodule, imported since (its parent gets it as an attribute)."""
    return isinstance(owner, str) and isinstance(value, types.ModuleType) and value.__name__ == f"{owner}.{name}"


def _compiled(owner, name: str) -> bool:
    """A global torch.compile made for the code it compiled from a module (`__compiled_fn_1_...`, `__import_x`,
    `__builtins_dict___0`: new names, never a module's own), the harness's modules included."""
    return isinstance(owner, str) and name.startswith("__") and not name.endswith("__")


def _runs(value) -> bool:
    return callable(value) or issubclass(type(value), CODE)


def _changed(owner, name: str, value, before) -> bool:
    """In torch's or Python's namespace, `value` (in place of `before`, or added where it is None) is a change:
    anything from outside (the file's function, class or object), or code torch did not put there itself."""
    return _from_outside(value) or (_runs(value) or _runs(before)) and not _made_by_torch(owner, name, value, before)


def _made_by_torch(owner, name: str, value, before) -> bool:
    """Whether torch put `value` there itself as it runs: torch.compile's globals for the code it compiled from
    a module (`__compiled_fn_1_...`, `__import_x`: new names, never a module's own), a submodule imported since,
    and code of torch's that holds nothing from outside torch, Python and the harness (torch registers and wraps
    its own functions lazily: torch.optim's step hooks, torch.compile's generation tags on nn.Module.__init__,
    its optimizer and cache patches), or an instance of torch's where there was no code (a cache made on first
    use)."""
    if _compiled(owner, name) or _submodule(owner, name, value):
        return True
    if not callable(before) and not issubclass(type(before), CODE) and not issubclass(type(value), CODE) and \
            _ours(type(value).__module__) and not _from_outside(value):
        return True
    return _torch_code(value) and not _from_outside(value)


def _torch_code(value) -> bool:
    """`value` is a function written in torch (or a method, property or partial of such)."""
    if type(value) is types.FunctionType:
        return value.__code__.co_filename.startswith(_TORCH)
    inner = _inner(value)
    return bool(inner) and not isinstance(value, functools.partial) and all(map(_torch_code, inner))


def _inner(value) -> list:
    """What a callable holds that may be called in its place: a method's function, a descriptor's functions,
    a partial's function, a wrapper's wrapped (`__wrapped__`) and its closure's callables."""
    if isinstance(value, types.MethodType):  # and what it is bound to, which may be called (a module's __call__)
        return [value.__func__, value.__self__]
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if f is not None]
    if isinstance(value, functools.partial):
        return [value.func, *value.args, *value.keywords.values()]
    if type(value) is types.FunctionType:
        wrapped = value.__dict__.get("__wrapped__")
        return [c for c in (*(_filled_with(cell) for cell in value.__closure__ or ()), wrapped)
                if c is not None and callable(c)]
    return []


def _from_outside(value, depth: int = 3) -> bool:
    """Whether `value` is, or holds, code or an object from a file outside what is installed and the harness
    (the file's): a function written there, a class defined there, an instance of such a class."""
    if type(value) is types.FunctionType:
        if not value.__code__.co_filename.startswith(_INSTALLED):
            return True
    elif isinstance(value, type):
        return _outside_module(_module_of(value))
    elif _outside_module(type(value).__module__):
        return True
    return depth > 0 and any(_from_outside(v, depth - 1) for v in _inner(value))


def _folders() -> tuple[str, tuple[str, ...]]:
    """torch's folder; and the folders whose code is installed (torch, its dependencies, Python's library) or the
    harness's. A file under test is loaded from anywhere else."""
    import sysconfig

    import torch

    from harness.impl import ROOT

    paths = sysconfig.get_paths()
    return os.path.dirname(torch.__file__) + os.sep, tuple(
        {paths[k] + os.sep for k in ("purelib", "platlib", "stdlib", "platstdlib")}
        | {str(ROOT / "harness") + os.sep, str(ROOT / "train.py")})


_TORCH, _INSTALLED = _folders()
_GENERATION_TAGS = os.path.join(_TORCH, "_dynamo", "mutation_guard.py")


def _outside_module(name: str) -> bool:
    """Whether the module `name` is loaded from a file outside what is installed and the harness."""
    where = getattr(sys.modules.get(name), "__file__", None)
    return isinstance(where, str) and not where.startswith(_INSTALLED)


def _module_of(cls: type) -> str:
    module = cls.__dict__.get("__module__")
    return module if isinstance(module, str) else ""


def _same(a, b) -> bool:
    """The same setting: the same object, or an equal value of Python's or torch's own kinds (never a call into
    an object's own __eq__, which a file's stream could answer)."""
    if type(a) is tuple and type(b) is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    return a is b or type(a) is type(b) and type(a) in _VALUES and a == b


def _values() -> tuple[type, ...]:
    import re

    import torch

    return bool, int, float, str, type(None), torch.dtype, torch.device, re.Pattern


_VALUES = _values()


def _filled_with(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _where_function(f: types.FunctionType) -> str:
    return f"{f.__module__}.{f.__qualname__}"


def _where(owner) -> str:
    return owner if isinstance(owner, str) else f"{_module_of(owner)}.{owner.__qualname__}"


def void(changes: list[str]) -> str:
    """A rank's error for a job after which `changes` were found."""
    shown = ", ".join(changes[:8]) + (f" and {len(changes) - 8} more" if len(changes) > 8 else "")
    return ("the file under test changed what this process runs: " + shown + ". An FSDP changes nothing "
            "of torch's, Python's or the grader's code or settings (that is how a program hides what it does from the "
            "checks), so this rank's results are void: set attributes on your own objects, modules and tensors only, "
            "and leave every context you enter (a `with` block, not held open)")

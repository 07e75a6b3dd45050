"""The hand-written FSDP must be hand-written: no route through PyTorch's FSDP2.

Two layers, because each closes what the other cannot:

- `static_problem(path)` reads the submission's source (never runs it) and rejects imports
  of FSDP2 and everything a file could use to reach FSDP2 or the harness by a computed name
  (`__import__`, importlib, sys.modules, getattr with a built string, frames, globals) or to
  patch the checks that run next to it in the same process. A real FSDP needs none of it.
- At run time, whatever route was taken: FSDP2's classes, module state or hooks on the
  wrapped model (`model_problem`), FSDP2's custom ops (`fsdp::...`) or FSDP2's source files
  on the Python stack of any collective (`stack_problem`, called by jobs.CommLog).

Either one fails every graded test with FSDP2_USED.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import torch

FSDP2_USED = "uses PyTorch's FSDP2, not your own"
OUTSIDE = "reaches beyond a hand-written FSDP"


class Outside(str):
    """A source problem that is not FSDP2 itself: a construct a hand-written FSDP does not need."""


def verdict(problem: str) -> str:
    """The failure message for a problem found by any check here."""
    return f"{OUTSIDE if isinstance(problem, Outside) else FSDP2_USED} ({problem})"

# Source folders of FSDP2 (and FSDP1, which shares the package): code running from here is FSDP2.
_FSDP_DIRS = tuple(os.path.join(os.path.dirname(torch.__file__), "distributed", d) + os.sep
                   for d in ("fsdp", os.path.join("_composable", "fsdp")))
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable")

# Modules (exactly these; torch and its submodules too) an FSDP may import. Not importlib, sys,
# inspect, gc, ctypes, builtins, subprocess, pickle, logging.config: each reaches modules, frames
# or files by computed names.
ALLOWED_IMPORTS = {"__future__", "math", "dataclasses", "enum", "typing", "collections", "collections.abc",
                   "functools", "itertools", "contextlib", "weakref", "abc", "operator", "warnings", "logging",
                   "time", "os", "torch"}
OS_ATTRS = {"environ", "getenv", "getpid", "cpu_count"}  # reading settings; not files, not processes
# Names that reach modules, frames, globals or code objects, i.e. FSDP2 or the harness by a
# computed route, or that run code the file does not show; each with what to do instead.
_COMPUTED = "import what you need with a plain `import torch...` at the top and use it by name"
_ARGS = "pass what you need as arguments or keep it on your objects"
ADVICE = {
    **dict.fromkeys(("fsdp", "_composable", "_composable_state", "_fully_shard"),
                    "write the FSDP yourself: torch.distributed's collectives and DTensor are all it needs"),
    **dict.fromkeys(("harness", "train", "checks", "handwritten"),
                    "the FSDP must not reach the harness that grades it; nothing in it is needed"),
    **dict.fromkeys(("sys", "importlib", "import_module", "builtins", "__builtins__", "__import__",
                     "attrgetter", "methodcaller"), _COMPUTED),
    **dict.fromkeys(("exec", "eval", "compile", "cpp_extension", "load_inline"), "write the code out in the file"),
    **dict.fromkeys(("globals", "locals", "vars", "f_globals", "f_locals", "f_back", "tb_frame", "gi_frame",
                     "cr_frame", "_getframe", "currentframe", "gc", "ctypes", "inspect"), _ARGS),
    **dict.fromkeys(("open", "subprocess", "serialization", "_open_file", "_open_zipfile_reader",
                     "_open_zipfile_writer", "save", "load"),
                    "the FSDP computes its results; it reads no files and runs no programs"),
    # Storage outside torch's CPU allocator, which the graded memory check counts (harness/memory.py).
    **dict.fromkeys(("share_memory_", "from_file", "_share_filename_", "_share_fd_", "_new_shared",
                     "_new_shared_filename", "_new_shared_fd"),
                    "allocate with torch's ordinary allocator (torch.empty, new_zeros...): the graded memory "
                    "check counts its tensors, and shared or file-backed storage would hide from it"),
}
FORBIDDEN_NAMES = set(ADVICE)
ALLOWED_DUNDERS = {"__init__", "__class__", "__name__", "__qualname__", "__module__", "__enter__", "__exit__",
                   "__call__", "__post_init__", "__repr__", "__str__", "__len__", "__iter__", "__next__",
                   "__getitem__", "__setitem__", "__contains__", "__bool__", "__eq__", "__ne__", "__lt__", "__le__",
                   "__gt__", "__ge__", "__hash__", "__slots__", "__doc__", "__all__", "__future__", "__annotations__",
                   "__match_args__", "__main__"}


def static_problem(path: Path) -> str | None:
    """Why the file at `path` is not a hand-written FSDP, or None. FSDP2 itself is a plain str;
    any other refused construct an `Outside`, naming the line and what to write instead."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except SyntaxError:
        return None  # importing it reports the syntax error where it is
    os_names = set()  # what `os` is called in this file
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        where = f"{Path(path).name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for mod in mods:
                if mod.startswith(_FSDP_MODULES):
                    return f"{where} imports {mod}"
                if mod not in ALLOWED_IMPORTS and mod.split(".")[0] != "torch":
                    return Outside(f"{where} imports {mod}: an FSDP needs only torch and "
                                   f"{', '.join(sorted(ALLOWED_IMPORTS - {'torch', '__future__'}))}; "
                                   "remove the import")
            if isinstance(node, ast.Import):
                os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
            elif node.module == "os" and (bad := [a.name for a in node.names if a.name not in OS_ATTRS]):
                return Outside(f"{where} imports os.{bad[0]}: of os an FSDP may read only "
                               f"{', '.join(sorted(OS_ATTRS))}")
            names = [a.name for a in node.names] + [a.asname for a in node.names if a.asname]
            if bad := [n for n in names if n in FORBIDDEN_NAMES]:
                return _refuse(f"{where} imports `{bad[0]}`", bad[0])
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in os_names \
                and node.attr not in OS_ATTRS:
            return Outside(f"{where} uses os.{node.attr}: of os an FSDP may read only "
                           f"{', '.join(sorted(OS_ATTRS))} (settings, not files or processes)")
        if isinstance(node, ast.Name) and node.id in ("getattr", "hasattr") and id(node) not in called:
            return Outside(f"{where}: {node.id} passed around (not called with a written-out name): call it "
                           f"as {node.id}(obj, \"name\"), or write obj.name")
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
        if name is not None:
            if name in FORBIDDEN_NAMES:
                return _refuse(f"{where} uses `{name}`", name)
            if name.startswith("__") and name.endswith("__") and name not in ALLOWED_DUNDERS \
                    and not isinstance(node, ast.FunctionDef):
                return Outside(f"{where} uses `{name}`: it reaches modules, globals or code objects, which a "
                               "hand-written FSDP does not need; " + _ARGS)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2:
            key = node.args[1]
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return Outside(f"{where}: {node.func.id} with a computed attribute name: write the name "
                               f"out, e.g. {node.func.id}(obj, \"name\") or obj.name")
            if key.value in FORBIDDEN_NAMES or (key.value.startswith("__") and key.value not in ALLOWED_DUNDERS):
                return _refuse(f"{where}: {node.func.id}(..., {key.value!r})", key.value)
    return None


def _refuse(text: str, name: str) -> str:
    advice = ADVICE.get(name, _ARGS)
    if name in ("fsdp", "_composable", "_composable_state", "_fully_shard"):
        return f"{text}: {advice}"
    return Outside(f"{text}, which a hand-written FSDP does not need: {advice}")


def _from_fsdp2(obj) -> bool:
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    if code is not None and code.co_filename.startswith(_FSDP_DIRS):
        return True
    module = getattr(obj, "__module__", None) or ""
    return isinstance(module, str) and module.startswith(_FSDP_MODULES)


def module_problem(module) -> str | None:
    """The loaded submission exports FSDP2's objects (a re-export, however it got them)."""
    for name in ("fully_shard", "MixedPrecisionPolicy", "FSDPModule"):
        obj = getattr(module, name, None)
        if obj is not None and (_from_fsdp2(obj) or any(_from_fsdp2(c) for c in getattr(obj, "__mro__", ()))):
            return f"its {name} is {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', name)}"
    return None


def model_problem(model: torch.nn.Module) -> str | None:
    """The wrapped model carries FSDP2's classes, state or hooks."""
    from torch.distributed import _composable_state

    for name, m in model.named_modules():
        where = name or "the root"
        if bad := [c for c in type(m).__mro__ if _from_fsdp2(c)]:
            return f"{where} is a {bad[0].__module__}.{bad[0].__qualname__} after wrapping"
        state = _composable_state._module_state_mapping.get(m)
        if state is not None and _from_fsdp2(type(state)):
            return f"{where} carries FSDP2's state {type(state).__qualname__}"
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
            for hook in getattr(m, attr, {}).values():
                fn = getattr(hook, "func", hook)  # functools.partial
                if _from_fsdp2(fn):
                    return f"{where} has FSDP2's hook {getattr(fn, '__qualname__', fn)}"
    return None


def stack_problem() -> str | None:
    """FSDP2's source is on the current Python stack (called at every collective)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_FSDP_DIRS):
            return f"a collective was issued from FSDP2's {frame.f_code.co_name} ({Path(frame.f_code.co_filename).name})"
        frame = frame.f_back
    return None

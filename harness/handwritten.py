"""The hand-written FSDP must be hand-written: no route through PyTorch's FSDP2.

Two layers, because each closes what the other cannot:

- `static_problem(path)` reads the submission's source (never runs it) and rejects imports
  of FSDP2 and everything a file could use to reach FSDP2 or the harness by a computed name
  (`__import__`, importlib, sys.modules, getattr with a built string, frames, globals) or to
  patch the checks that run next to it in the same process. A real FSDP needs none of it.
- At run time, whatever route was taken: FSDP2's classes, module state or hooks on the
  wrapped model (`model_problem`), FSDP2's custom ops (`fsdp::...`) or FSDP2's source files
  on the Python stack of any collective (`stack_problem`, called by checks.CommLog).

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


def verdict(problem: str) -> str:
    """The failure message for a problem found by any check here."""
    fsdp2 = any(w in problem for w in ("fsdp", "FSDP2", "_composable", "_fully_shard"))
    return f"{FSDP2_USED if fsdp2 else OUTSIDE} ({problem})"

# Source folders of FSDP2 (and FSDP1, which shares the package): code running from here is FSDP2.
_FSDP_DIRS = tuple(os.path.join(os.path.dirname(torch.__file__), "distributed", d) + os.sep
                   for d in ("fsdp", os.path.join("_composable", "fsdp")))
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable")

HARMLESS_FSDP2_NAMES = {"OffloadPolicy", "CPUOffloadPolicy"}  # plain dataclasses, no FSDP in them
ALLOWED_IMPORTS = {"__future__", "math", "dataclasses", "enum", "typing", "collections", "functools",
                   "itertools", "contextlib", "weakref", "abc", "operator", "torch"}
# Names that reach modules, frames, globals or code objects, i.e. FSDP2 or the harness by a
# computed route, or that run code the file does not show.
FORBIDDEN_NAMES = {
    "fsdp", "_composable", "_composable_state", "_fully_shard", "harness", "train", "checks", "handwritten",
    "sys", "os", "importlib", "import_module", "builtins", "__builtins__", "__import__", "exec",
    "eval", "compile", "globals", "locals", "vars", "open", "gc", "ctypes", "inspect", "subprocess",
    "attrgetter", "methodcaller", "cpp_extension", "load_inline", "f_globals", "f_locals", "f_back",
    "tb_frame", "gi_frame", "cr_frame", "_getframe", "currentframe",
}
ALLOWED_DUNDERS = {"__init__", "__class__", "__name__", "__qualname__", "__module__", "__enter__", "__exit__",
                   "__call__", "__post_init__", "__repr__", "__len__", "__iter__", "__getitem__", "__all__",
                   "__future__", "__annotations__"}


def static_problem(path: Path) -> str | None:
    """Why the file at `path` is not a hand-written FSDP, or None."""
    try:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
    except SyntaxError:
        return None  # importing it reports the syntax error where it is
    for node in ast.walk(tree):
        where = f"{Path(path).name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed.fsdp" \
                    and {a.name for a in node.names} <= HARMLESS_FSDP2_NAMES and not any(a.asname for a in node.names):
                continue  # FSDP2's offload policy types, to recognise the arguments train code passes
            for mod in mods:
                if mod.startswith(_FSDP_MODULES):
                    return f"{where} imports {mod}"
                if mod.split(".")[0] not in ALLOWED_IMPORTS:
                    return (f"{where} imports {mod}: an FSDP needs only torch and the standard helpers "
                            f"({', '.join(sorted(ALLOWED_IMPORTS))})")
            names = [a.name for a in node.names] + [a.asname for a in node.names if a.asname]
            if bad := [n for n in names if n in FORBIDDEN_NAMES]:
                return f"{where} imports {bad[0]}"
            continue
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
        if name is not None:
            if name in FORBIDDEN_NAMES:
                return f"{where} uses `{name}`, which a hand-written FSDP does not need"
            if name.startswith("__") and name.endswith("__") and name not in ALLOWED_DUNDERS \
                    and not isinstance(node, ast.FunctionDef):
                return f"{where} uses `{name}`, which a hand-written FSDP does not need"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2:
            key = node.args[1]
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return f"{where}: {node.func.id} with a computed attribute name (write the attribute out)"
            if key.value in FORBIDDEN_NAMES or (key.value.startswith("__") and key.value not in ALLOWED_DUNDERS):
                return f"{where}: {node.func.id}(..., {key.value!r})"
    return None


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

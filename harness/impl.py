"""The FSDP under test: `student` (fsdp.py) or the path of any file that defines
`fully_shard` and `MixedPrecisionPolicy` (a submission, a reference, a variant)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from harness.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STUDENT = ROOT / "fsdp.py"


def impl_path(impl: str) -> Path:
    """The file --impl names."""
    if impl == "student":
        path = STUDENT
    else:
        path = Path(impl)
        if path.suffix != ".py":
            raise ConfigError(f"--impl must be student or the path of a .py file, got {impl!r}")
        if not path.is_absolute() and not path.exists():
            path = ROOT / path  # relative to the repository, wherever the command runs
    if not path.exists():
        fix = "restore it with `git checkout fsdp.py`" if impl == "student" else "check the path"
        raise ConfigError(f"--impl {impl}: the hand-written FSDP is not there ({path} is missing); {fix}")
    return path.resolve()


def run_name(fsdp: str, impl: str) -> str:
    """Folder name for one implementation's traces and snapshots: fsdp2, none, effdl (fsdp.py),
    effdl-<path> for another file, so runs of different files never overwrite each other."""
    if fsdp != "effdl":
        return fsdp
    path = impl_path(impl)
    if path == STUDENT.resolve():
        return "effdl"
    if path.is_relative_to(ROOT):
        return "effdl-" + "-".join(path.relative_to(ROOT).with_suffix("").parts)
    return f"effdl-{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def load(impl: str) -> ModuleType:
    """Import the hand-written FSDP (once per file) and check it has what train.py calls."""
    path = impl_path(impl)
    name = f"effdl_fsdp_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    module = sys.modules[name]
    missing = [n for n in ("fully_shard", "MixedPrecisionPolicy") if not hasattr(module, n)]
    if missing:
        raise ConfigError(f"--impl {impl}: {path} defines no {' or '.join(missing)}")
    return module


def fsdp2() -> ModuleType:
    return importlib.import_module("torch.distributed.fsdp")

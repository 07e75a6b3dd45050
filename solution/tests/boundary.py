"""What the boundary tests compare before and after a hostile file ran: files' bytes, and the processes
of the sandbox user."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import psutil

from harness.tools.grading import sandbox


def digest_tree(*roots: Path) -> dict[str, str]:
    """sha256 of every file under the roots (a file alone is its own root), but the bytecode Python
    caches beside the sources (written by the grader's own imports)."""
    out = {}
    for root in roots:
        for p in [root] if root.is_file() else sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts:
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def sandbox_processes() -> list[int]:
    """The live processes of the sandbox user, but another checkout's: a grading run beside this one on
    the same machine (its ranks, or what they started, run another environment's Python)."""
    if not sandbox.wanted():
        return []
    uid, _ = sandbox.account()
    return [p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] and p.info["uids"].real == uid
            and (p.info["status"] != psutil.STATUS_ZOMBIE or sandbox.any_thread_runs(p.pid))
            and not _another_checkouts(p)]


def _another_checkouts(proc: psutil.Process) -> bool:
    """Whether `proc` or a process above it runs a Python of another environment than this one's."""
    ours = sys.prefix + os.sep
    try:
        for p in [proc, *proc.parents()]:
            program = (p.cmdline() or [""])[0]
            if f"{os.sep}bin{os.sep}python" in program and os.path.isabs(program) and not program.startswith(ours) \
                    and Path(program).parent.parent.joinpath("pyvenv.cfg").exists():
                return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    return False

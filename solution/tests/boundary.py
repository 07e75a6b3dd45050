"""What the boundary tests compare before and after a hostile file ran: files' bytes, and the processes
of the sandbox user."""

from __future__ import annotations

import hashlib
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
    if not sandbox.wanted():
        return []
    uid, _ = sandbox.account()
    return [p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE]

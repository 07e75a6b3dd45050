"""FSDP2's side of every graded comparison, computed once per machine and code, then reused.

Every check compares effdl with FSDP2 in the same case, and FSDP2's run is the same
for every submission: same configuration, code, torch and machine. `get` returns what an earlier
run of FSDP2 gave in exactly that case, or computes and stores it:

    value = fsdp2_cache.get("train", fsdp2_cache.case(train_job, (cfg,), 2, "cpu", 1),
                            lambda: run(pool, train_job, cfg), outputs={"traces": cfg.traces_dir})

The value is what the ranks returned (a list of per-rank results); `outputs` names folders the run
writes files into (a profiled run's traces): they are stored with it and written back on a hit.

What decides the key, and why
- The case (`case`): the job (module and name), its arguments with the whole train.Config (every
  field but `impl`, which FSDP2 never reads; output folders such as `traces_dir` reduced to whether
  they are set, so a fresh tmp folder per test still finds its entry), the world size, the device
  and the ranks' intra-op threads (RankPool shares the cores out; another number of threads can
  sum in another order).
- The machine and software (`environment`, read once per process): python, torch (with its git
  revision), torchtitan, the platform (`sys.platform`, machine, `FSDP_PLATFORM`), the CPU's model,
  its core count and the SIMD kernels torch picked (`get_cpu_capability`: other kernels, other bits);
  and the bytes of everything that produces the result: train.py, every .py under harness/ but its
  tests (the tools too: simpler and safer than deciding which cannot matter; harness/tests/ holds no
  job whose result is stored, checks.py's are, so editing a test trains FSDP2 no more), uv.lock (every
  package's exact version), the data and the tokenizer. The file under test (fsdp.py, --impl) is not
  in it, nor pyproject.toml (pytest's options, which the released student repository and the
  Gradescope bundle rewrite, change no number; its dependencies are pinned in uv.lock): the three
  repositories share entries.
Only CPU runs are cached: a GPU's kernels and model would need keys of their own, and some CUDA
kernels are not deterministic; a CUDA pool always runs FSDP2.

Trust
An entry is used only if everything checks out; otherwise it is recomputed and overwritten, with one
line on stderr saying why. Each entry file holds its full key (not only the hash its name comes
from), a SHA-256 of its payload, and an HMAC of both under a random secret made once per cache
folder (mode 0600): a stale entry (another key), one copied from another folder (another secret),
an altered, truncated or unreadable one, or one whose stored files are missing or damaged is never
used. The payload is a pickle, unpickled only after the HMAC verifies and then only into what FSDP2's
results are made of (`_Unpickler`), so even a forged entry could not run anything. The folder is its
owner's alone (0700): where the grader is root, the ranks of a file under test run as an
unprivileged user (harness/tools/grading/sandbox.py), which can neither read the secret nor write an entry;
on a student's own machine the secret is the student's. What is stored is computed on trusted ranks,
which never import a file under test (ranks.RankPool's roles; checks.run_fsdp2). A failed store only prints why. Stored files (traces) live beside the entries as zlib blobs named by the
SHA-256 of their content, which the entry lists and a load checks. Every write is a temporary file
and an os.replace, so processes running side by side (a grader's pytest processes) never read half
an entry, and two that compute the same entry both write a whole one.

Where and when
`<repo>/.cache/fsdp2/` (gitignored), or `FSDP2_CACHE_DIR`. `FSDP2_CACHE`: `on` (the default), `off`
(never read nor write) or `refresh` (compute and overwrite); pytest's `--fsdp2-cache` sets it.
Delete the folder to drop everything (old entries and blobs are never removed on their own).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import io
import json
import os
import pickle
import platform
import secrets
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[3]  # the repository: harness/tools/grading/fsdp2_cache.py
FORMAT = b"FSDP2-CACHE 1\n"
MODES = ("on", "off", "refresh")
SOURCES = ("train.py", "uv.lock")
OUTPUT = "<output folder>"  # what a set output folder is in the key


def mode() -> str:
    value = os.environ.get("FSDP2_CACHE", "on").strip().lower() or "on"
    if value not in MODES:
        raise ValueError(f"FSDP2_CACHE={value!r} is not one of {', '.join(MODES)}: set one of them or unset it")
    return value


def folder() -> Path:
    return Path(os.environ.get("FSDP2_CACHE_DIR") or ROOT / ".cache" / "fsdp2")


# --------------------------------------------------------------------------- the key


def _plain(value: Any) -> Any:
    """A JSON-able form of a job's argument that says everything about it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": f"{type(value).__module__}.{type(value).__qualname__}",
                **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)  # Path and the like: their text is what they are


def config_key(cfg) -> dict:
    """A train.Config as the key sees it: `impl` left out (FSDP2 never imports it), output folders
    only as set or not (they differ on every run but change no number)."""
    key = _plain(cfg)
    del key["impl"]
    for name in ("traces_dir", "snapshots_dir"):
        key[name] = OUTPUT if key[name] is not None else None
    return key


def case(job: Callable, args: tuple, world_size: int, device: str, threads: int) -> dict:
    """The part of the key that is one check's case: job(*args) on `world_size` ranks."""
    import train

    plain = [config_key(a) if isinstance(a, train.Config) else _plain(a) for a in args]
    return {"job": f"{job.__module__}.{job.__qualname__}", "args": plain, "world_size": world_size,
            "device": device, "threads": threads}


def _digest_files(paths: list[Path]) -> dict[str, str]:
    out = {}
    for path in sorted(paths):
        name = path.relative_to(ROOT).as_posix()
        out[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
    return out


@functools.cache
def environment() -> dict:
    """What every FSDP2 result depends on besides its case: software, machine, and code and data bytes."""
    import torch
    from importlib.metadata import PackageNotFoundError, version

    from harness import assets, compat

    assets.ensure(ROOT, log=lambda msg: print(msg, file=sys.stderr, flush=True))  # hash what the ranks will read
    try:
        titan = version("torchtitan")
    except PackageNotFoundError:
        titan = "missing"
    code = [ROOT / name for name in SOURCES] + [p for p in (ROOT / "harness").rglob("*.py")
                                                if p.relative_to(ROOT / "harness").parts[0] != "tests"]
    return {
        "python": sys.version, "torch": torch.__version__, "torch_git": torch.version.git_version,
        "torchtitan": titan, "platform": [sys.platform, platform.machine(), os.environ.get(compat.SIMULATE, "")],
        "cpu": [compat.cpu_name(), os.cpu_count(), torch.backends.cpu.get_cpu_capability()],
        "files": _digest_files(code + [ROOT / f for f in assets.FILES]),
    }


def full_key(kind: str, parts: dict) -> bytes:
    return json.dumps({"kind": kind, "case": parts, "environment": environment()}, sort_keys=True).encode()


# --------------------------------------------------------------------------- the secret and the files


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _private(where: Path) -> None:
    """The folder itself, made or kept its owner's alone (0700): the ranks of a file under test run as
    another user when the grader is root (harness/tools/grading/sandbox.py), and must neither read the secret
    nor write an entry."""
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = where.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(where, 0o700)


def _secret(where: Path) -> bytes:
    """This folder's signing secret, made once (readable by its owner only)."""
    path = where / "secret"
    _private(where)
    try:
        data, st = path.read_bytes(), path.stat()
        if len(data) == 32 and not st.st_mode & 0o077:
            return data
        print(f"FSDP2 cache: {path} is not a private 32-byte secret; making a new one (every entry will be "
              "recomputed)", file=sys.stderr, flush=True)
    except FileNotFoundError:
        pass
    tmp = where / f".secret.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)  # atomic and never over another process's secret made meanwhile
    except FileExistsError:
        if path.stat().st_mode & 0o077 or len(path.read_bytes()) != 32:
            os.replace(tmp, path)  # the bad one found above
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


class Refused(Exception):
    """An entry that must not be used; the message says why."""


def _store_files(where: Path, outputs: dict[str, Path | None]) -> dict[str, dict[str, str]]:
    """Each output folder's files as blobs: {output: {relative path: sha256}}."""
    listed: dict[str, dict[str, str]] = {}
    (where / "blobs").mkdir(parents=True, exist_ok=True)
    for name, root in outputs.items():
        listed[name] = {}
        if root is None or not Path(root).is_dir():
            continue
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
            data = path.read_bytes()
            sha = hashlib.sha256(data).hexdigest()
            if not (blob := where / "blobs" / sha).exists():
                _write_atomic(blob, zlib.compress(data, 1))
            listed[name][path.relative_to(root).as_posix()] = sha
    return listed


def _restore_files(where: Path, listed: dict[str, dict[str, str]], outputs: dict[str, Path | None]) -> None:
    """Write the stored files into this run's output folders, each checked against its digest first."""
    if set(listed) != set(outputs):
        raise Refused(f"stores the folders {sorted(listed)}, not {sorted(outputs)}")
    files = []
    for name, entries in listed.items():
        for rel, sha in entries.items():
            try:
                data = zlib.decompress((where / "blobs" / sha).read_bytes())
            except (OSError, zlib.error):
                raise Refused(f"its stored file {name}/{rel} is missing or damaged") from None
            if hashlib.sha256(data).hexdigest() != sha:
                raise Refused(f"its stored file {name}/{rel} does not match its digest")
            files.append((Path(outputs[name]) / rel, data))
    for path, data in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def rebase(value: Any, old: Path, new: Path) -> Any:
    """Paths under `old` (the stored run's output folder) moved under `new`, as this run's would be."""
    if isinstance(value, Path):
        return new / value.relative_to(old) if value.is_relative_to(old) else value
    if isinstance(value, list):
        value[:] = [rebase(v, old, new) for v in value]
    elif isinstance(value, dict):
        for k in value:
            value[k] = rebase(value[k], old, new)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            object.__setattr__(value, f.name, rebase(getattr(value, f.name), old, new))
    return value


# --------------------------------------------------------------------------- get


def _load(path: Path, key: bytes, secret: bytes, outputs: dict[str, Path | None]) -> Any:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Refused(f"cannot be read ({e.strerror})") from None
    if not data.startswith(FORMAT) or data.count(b"\n") < 4:
        raise Refused("is not a whole entry (truncated, or another format)")
    mac, body = data[len(FORMAT):].split(b"\n", 1)
    stored_key, digest, payload = body.split(b"\n", 2)
    if stored_key != key:
        raise Refused("was written for another key (other code, data, versions or machine)")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise Refused("does not match its digest (truncated or altered)")
    if not hmac.compare_digest(mac, hmac.new(secret, body, "sha256").hexdigest().encode()):
        raise Refused("is not signed with this folder's secret (copied from elsewhere, or altered)")
    try:
        stored = _Unpickler(io.BytesIO(payload)).load()
    except Exception as e:
        raise Refused(f"cannot be unpickled ({type(e).__name__}: {e})") from None
    _restore_files(path.parent, stored["files"], outputs)
    for name, root in outputs.items():
        if root is not None and stored["roots"].get(name):
            rebase(stored["value"], Path(stored["roots"][name]), Path(root))
    return stored["value"]


def _load_storage(data: bytes):
    """torch.storage._load_from_bytes, which a pickled tensor calls, without its full unpickler."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


class _Unpickler(pickle.Unpickler):
    """Only what FSDP2's results are made of: the harness's and train.py's dataclasses, containers,
    paths and CPU tensors, so that even an entry signed by someone who had the secret runs nothing."""

    SAFE = {("collections", "OrderedDict"), ("collections", "deque"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
            ("torch._utils", "_rebuild_tensor_v2")}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        obj = super().find_class(module, name)
        ours = (module == "train" or module.startswith("harness.")) and dataclasses.is_dataclass(obj)
        if (module, name) in self.SAFE or (ours and isinstance(obj, type)):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of an FSDP2 result")


def get(kind: str, parts: dict, compute: Callable[[], T], outputs: dict[str, Path | None] | None = None) -> T:
    """FSDP2's result in the case `parts` (see `case`): stored, or `compute()`d and stored.

    kind names the entry (e.g. "train", "memory"); outputs: folders compute() writes files into,
    stored with the result and written back into this call's folders on a hit."""
    outputs = outputs or {}
    if (how := mode()) == "off":
        return compute()
    where = folder()
    secret = _secret(where)
    key = full_key(kind, parts)
    path = where / f"{kind}-{hashlib.sha256(key).hexdigest()[:40]}.entry"
    if how == "on" and path.exists():
        try:
            return _load(path, key, secret, outputs)
        except Refused as e:
            print(f"FSDP2 cache: the {kind} entry {path.name} {e}; recomputing", file=sys.stderr, flush=True)
    value = compute()
    try:
        stored = {"value": value, "files": _store_files(where, outputs),
                  "roots": {name: str(root) if root is not None else None for name, root in outputs.items()}}
        payload = pickle.dumps(stored, protocol=pickle.HIGHEST_PROTOCOL)
        body = key + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        _write_atomic(path, FORMAT + hmac.new(secret, body, "sha256").hexdigest().encode() + b"\n" + body)
    except OSError as e:  # a full or read-only disk costs the store, never the check that asked
        print(f"FSDP2 cache: could not store the {kind} entry in {where} ({e}); going on without it",
              file=sys.stderr, flush=True)
    return value

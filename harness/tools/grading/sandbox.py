"""The unprivileged user that runs files under test when the grader is root.

Gradescope runs its autograder as root, and so do CI and a `grade` started by root. There the ranks
that import a file under test (RankPool's "sandboxed" role) become the user `fsdp-sandbox` right
after they are forked, before the file is imported: no supplementary groups, its own group, no way
back (`PR_SET_NO_NEW_PRIVS`: no setuid program raises it again), a private HOME and TMPDIR, no
bytecode written. The files the grader keeps (the FSDP2 store and its secret, the repository,
results.json, the points JSON, pytest's temporary folders) are root's and not writable by others,
so such a rank can neither read the secret nor write any of them. What a sandboxed run must write
(a profiled run's traces and snapshots, a checkpoint) goes to a folder of the sandbox user's own
(`Private.out`), from which the grader copies regular files back, size-capped, never following a
link (`copy_back`). When a sandboxed pool closes, `sweep` kills what its ranks left running.

Not root (a student's laptop), nothing changes: the student's own code runs as the student, and
there is nothing of anyone else's to protect.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import resource
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness import compat

USER = "fsdp-sandbox"
MAX_FILE = 1 << 30
"""bytes of one file a sandboxed rank wrote that the grader copies back (a trace is megabytes)"""
MAX_FILES = 4096
MAX_BYTES = 4 << 30
"""bytes of all the files one job of a sandboxed rank wrote that the grader copies back (a profiled run: tens of MB)"""
MAX_PROCESSES = 4096
"""processes and threads the sandbox user may hold at once (RLIMIT_NPROC), every pool's ranks together"""


KEPT = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "CXX", "CC", "CUDA_HOME", "CUDA_PATH",
                  "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED",
                  "PYTHONUNBUFFERED", "PYTHONWARNINGS", "FSDP_PLATFORM"})
"""the grader's environment variables a sandboxed rank keeps (with those starting KEPT_PREFIXES):
the run's settings, never a credential or a path into the grader's own files"""
KEPT_PREFIXES = ("LC_", "CUDA_VISIBLE", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "KINETO_")


LAUNCH_KEPT = frozenset({"HOME", "USER", "LOGNAME", "TMPDIR", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "HF_HOME",
                         "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"})
LAUNCH_PREFIXES = ("PYTHON", "XDG_", "TORCHINDUCTOR_", "TRITON_", "FSDP", "CUDA_")
"""what else of the grader's environment a rank starts with (LAUNCH_KEPT, LAUNCH_PREFIXES, with KEPT and
KEPT_PREFIXES): where things are, for the trusted ranks, which the forkserver also starts"""
CREDENTIAL_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
"""a variable whose name holds one of these is kept by no rank, whatever its prefix (HF_TOKEN, say)"""


class SandboxError(RuntimeError):
    """Root cannot run a file under test as the unprivileged user; the text says how to fix it."""


def wanted() -> bool:
    """Whether files under test must run as the sandbox user: the grader is root (on Linux)."""
    return sys.platform.startswith("linux") and os.geteuid() == 0


def account() -> tuple[int, int]:
    """(uid, gid) of the sandbox user, created (a system user, no home, no shell) when missing."""
    import pwd

    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                               "--shell", "/usr/sbin/nologin", USER], capture_output=True, text=True)
        try:
            pw = pwd.getpwnam(USER)
        except KeyError:
            raise SandboxError(
                f"running as root, files under test run as the unprivileged user {USER}, which is missing and could "
                f"not be made ({(made.stderr or made.stdout).strip()[:200] or 'useradd failed'}): create it with "
                f"`useradd --system --user-group {USER}`, or grade as another user than root") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise SandboxError(f"the user {USER} has uid or gid 0: it must be an unprivileged user")
    return pw.pw_uid, pw.pw_gid


@dataclass(frozen=True)
class Private:
    """A sandboxed pool's own folder. Its root, the folder in it named by `token` and that one's out/ and impl/ are
    the grader's (passable, not listable by the sandbox user: nothing in them can be renamed or replaced by a link
    under the grader's writes); home/ (HOME) and tmp/ (TMPDIR) are the sandbox user's. out/ holds one folder per
    output of a run, under a name no one else knows, handed to the sandbox user; impl/ the file under test, in a
    folder so named too. The root's name is seen by anyone who lists the temporary folder, the token's by no one
    but the grader and the pool's ranks: the ranks of another grading on the machine, run as the same user, can
    neither read what is staged here nor write in its home."""

    root: Path
    uid: int | None
    gid: int | None
    namespaces: int | None = None
    """pid of the process holding this pool's network and IPC namespaces (`Namespaces`), which its ranks join;
    None: they share the machine's (not root, or namespaces not allowed here)"""
    lock: int | None = None
    """descriptor holding the lock on root/.lock while the pool is open ([Note: which processes of the sandbox
    user are live ranks]); None when not root"""
    token: str = ""

    @property
    def home(self) -> Path:
        return self.root / self.token / "home"

    @property
    def tmp(self) -> Path:
        return self.root / self.token / "tmp"

    @property
    def out(self) -> Path:
        return self.root / self.token / "out"

    @property
    def impl(self) -> Path:
        return self.root / self.token / "impl"

    @classmethod
    def make(cls) -> Private:
        uid, gid = account() if wanted() else (None, None)
        if uid is not None:
            from harness.impl import ROOT

            reachable()
            made_closed(ROOT / PYTEST_CACHE)
            hide(*hidden(ROOT))
            # what gradings no longer running left (killed: none of their pools closed), before this one's file is
            # staged: their processes (no live rank of an open pool's) and their folders
            sweep()
            sweep_files()
            remove_dead_roots()
        root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))  # whose: see `remove_dead_roots`
        lock, token = None, secrets.token_hex(16)
        try:
            if uid is not None:  # held while the pool is open: a later pool removes the folder once it is not
                lock = _locked(root / ".lock")
            (root / token).mkdir(mode=0o711)
            for sub, mode in (("home", 0o700), ("tmp", 0o700), ("out", 0o711), ("impl", 0o711)):
                (root / token / sub).mkdir()
                os.chmod(root / token / sub, mode)
                if uid is not None and sub in ("home", "tmp"):
                    os.chown(root / token / sub, uid, gid)
            os.chmod(root / token, 0o711)
            os.chmod(root, 0o711)
            namespaces = Namespaces.start(root) if uid is not None and not compat.simulated() else None
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            if lock is not None:
                os.close(lock)
            raise
        return cls(root, uid, gid, namespaces, lock, token)

    def output(self, name: str, src: Path | None) -> Path:
        """A new folder in out/ for one output of a run, holding a copy of `src`'s files (the grader's,
        e.g. a checkpoint to resume), then handed to the sandbox user."""
        folder = self.out / f"{name}-{secrets.token_hex(8)}"
        folder.mkdir(mode=0o700)
        if src is not None and src.is_dir():
            shutil.copytree(src, folder, symlinks=False, dirs_exist_ok=True)
        if self.uid is not None:
            for path in [folder, *folder.rglob("*")]:
                os.lchown(path, self.uid, self.gid)
        return folder

    def remove(self) -> None:
        Namespaces.stop(self.root)
        shutil.rmtree(self.root, ignore_errors=True)  # never follows a link the sandbox left in it
        if self.lock is not None:
            os.close(self.lock)


ROOT_PREFIX = "fsdp-sandbox-"


def _pid_exists(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def remove_dead_roots() -> list[str]:
    """The private folders of every grading that no longer runs (killed: a time limit, a signal, out of memory), each
    named for the process that made it: they hold its files under test (a copy of the reference, when instructors
    graded it), which a later grading's ranks, run as the same user, would read otherwise. Removed before a pool makes
    its own, and by `grade` once it stopped a submission's pytest; a live grading's folders are never touched."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{ROOT_PREFIX}*-*"):
        pid = path.name[len(ROOT_PREFIX):].partition("-")[0]
        try:
            info = path.lstat()
        except OSError:
            continue
        if not (pid.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()):
            continue
        held = _held_open(path / ".lock")  # the pool's lock, let go when its grading died
        if held is False or held is None and not _pid_exists(int(pid)):  # (no lock: a pool that died being made)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


# [Note: namespaces of the pool's own]
# The ranks of one sandboxed pool talk to each other over TCP on 127.0.0.1 (their TCPStore and gloo).
# On the machine's own loopback they could equally reach the trusted pool's store and gloo ports, which
# take no password: a rank under test could join the trusted ranks' rendezvous (every new process group
# FSDP2's mesh makes goes through it) and feed FSDP2's collectives its own bytes, which the FSDP2 store
# would then hand every later submission. So a sandboxed pool gets a network namespace of its own that
# holds only a loopback. It gets an IPC namespace of its own too: System V shared memory, message queues and
# semaphores and POSIX message queues are no files and no processes, and outlive both (a segment handed to
# another owner by IPC_SET, a queue where no /dev/mqueue is mounted to list it); in a namespace of the pool's
# own they reach no later submission, and go with the namespace once its last process is gone (the pool's
# close kills every one). A small process (root's, started here) unshares both and waits; each rank joins
# them (setns, while still root) before it drops to the sandbox user. Where namespaces are not allowed (a
# container without CAP_SYS_ADMIN), one line on stderr says so and the ranks keep the machine's loopback and
# IPC (`sweep_files` removes what System V objects the sandbox user made or owns); docs/grading.md says what that
# leaves open. Under FSDP_PLATFORM=darwin (harness/compat.py) there are none either: macOS has no such
# namespaces, and its ranks no /proc to join one.
NAMESPACES = {"net": 0x40000000, "ipc": 0x08000000}  # CLONE_NEWNET, CLONE_NEWIPC

_NAMESPACE_HOLDER = r"""
import ctypes, fcntl, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(%d) != 0:
    print(f"unshare(CLONE_NEWNET | CLONE_NEWIPC) failed: errno {ctypes.get_errno()}", flush=True)
    sys.exit(1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS: IFF_UP
print("ready", flush=True)
sys.stdin.read()  # until the pool closes (or the grader is gone)
""" % (NAMESPACES["net"] | NAMESPACES["ipc"])


class Namespaces:
    """The network and IPC namespaces of one sandboxed pool ([Note: namespaces of the pool's own])."""

    _holders: dict[Path, subprocess.Popen] = {}
    _said = False

    @classmethod
    def start(cls, root: Path) -> int | None:
        """pid of new namespaces' holder process, or None (said once) where they cannot be made."""
        proc = subprocess.Popen([sys.executable, "-I", "-c", _NAMESPACE_HOLDER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={"PATH": os.defpath})
        try:
            line = proc.stdout.readline().strip()
        except BaseException:  # interrupted: the holder goes with it
            proc.kill()
            proc.wait()
            raise
        if line != "ready":
            proc.kill()
            proc.wait()
            if not cls._said:
                cls._said = True
                print(f"sandbox: no network and IPC namespaces of their own for the ranks under test "
                      f"({line or 'no answer'}): they share this machine's loopback with the grader's FSDP2 ranks, "
                      "and its System V and POSIX IPC with later submissions", file=sys.stderr, flush=True)
            return None
        cls._holders[root] = proc
        return proc.pid

    @classmethod
    def stop(cls, root: Path) -> None:
        if (proc := cls._holders.pop(root, None)) is not None:
            proc.kill()
            proc.wait()

    @staticmethod
    def join(pid: int) -> None:
        """In a rank, while still root: enter the pool's namespaces."""
        libc = ctypes.CDLL(None, use_errno=True)
        for name, kind in NAMESPACES.items():
            fd = os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, kind) != 0:
                    raise SandboxError(f"could not join the pool's {name} namespace: errno {ctypes.get_errno()}")
            finally:
                os.close(fd)


def reachable(*more: Path) -> None:
    """Let other users pass through (o+x: enter, not list) every folder above Python's library, the
    environment, the repository and `more` that does not let them, so the sandbox user can import what a
    rank imports after it dropped root (pyenv and uv keep Python under root's 0700 home). Said once on
    stderr per folder changed."""
    from harness.impl import ROOT

    for top in {Path(sys.base_prefix), Path(sys.prefix), Path(os.__file__).resolve().parent, ROOT, *more}:
        for folder in [*reversed(top.resolve().parents), top.resolve()]:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
                print(f"sandbox: {folder} is now passable by other users (o+x, its entries still unlisted), so that "
                      f"{USER} can import Python's library from under it", file=sys.stderr, flush=True)


def hidden(root: Path) -> tuple[Path, ...]:
    """What the repository holds that no file under test may read: the files that define an FSDP (a `fully_shard` at
    their top level) but the skeleton every student holds, the mutant registry (snippets of the reference, the lines a
    student writes among them), the bytecode Python compiled of them (the whole module, in `__pycache__`), pytest's
    cache (the failed tests of the run before), and the history (`.git`). In the instructors' checkout, where `grade`
    runs, that is the reference, the second solution, the mutants and any submission kept there; a released copy and
    the Gradescope bundle hold none of them. Not the harness, nor a hidden folder (the environment, the store). Every
    sandboxed pool's start closes them: bytecode compiled later takes its source's mode, closed by then."""
    sources = _defining(root)
    compiled = [c for source in sources for c in sorted((source.parent / "__pycache__").glob(f"{source.stem}.*.pyc"))]
    return (root / ".git", root / PYTEST_CACHE, *sources, *compiled)


@functools.cache
def _defining(root: Path) -> tuple[Path, ...]:
    """The mutant registry and the files that define an FSDP but the skeleton (`hidden`): read once per process."""
    import ast

    found = [p for p in (root / "solution" / "tests" / "mutation.py",) if p.exists()]
    for folder, folders, files in os.walk(root):
        folders[:] = [f for f in folders if not f.startswith(".") and f not in ("__pycache__", "harness")]
        for name in files:
            path = Path(folder) / name
            if not name.endswith(".py") or path == root / "fsdp.py":
                continue
            try:
                tree = ast.parse(path.read_bytes())
            except (SyntaxError, ValueError, OSError):
                continue
            if any(isinstance(n, ast.FunctionDef) and n.name == "fully_shard" for n in tree.body):
                found.append(path)
    return tuple(found)


PYTEST_CACHE = ".pytest_cache"
"""pytest's cache folder at the repository's root: made by the first run that writes to it, which may come after a
pool's start (a fresh clone holds none), so the pool makes it first, closed (`made_closed`)"""


def made_closed(folder: Path) -> None:
    """Make `folder` where it is missing, closed to other users from the start: what a later process writes in it
    (pytest writes in a cache folder that exists as it finds it) no file under test reads."""
    try:
        folder.mkdir(mode=0o750)
    except FileExistsError:
        pass
    except OSError as e:  # a read-only checkout: whoever grades here cannot make it either (said once)
        if folder not in _NOT_MADE:
            _NOT_MADE.add(folder)
            print(f"sandbox: could not make {folder} ({e.strerror})", file=sys.stderr, flush=True)


_NOT_MADE: set[Path] = set()


def hide(*paths: Path) -> None:
    """Close each path to other users (o-rwx), so the sandbox user can neither read nor enter it, said once on
    stderr per path changed. Never a folder every user shares, nor one above what a rank imports."""
    from harness.impl import ROOT

    above = {p for top in (Path(sys.prefix), ROOT) for p in (top.resolve(), *top.resolve().parents)}
    for path in paths:
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode) or not mode & 0o007 or path.resolve() in above or str(path.resolve()) in SHARED_FOLDERS:
            continue
        os.chmod(path, stat.S_IMODE(mode) & ~0o007)
        print(f"sandbox: {path} is now closed to other users (o-rwx), so that no file under test run as {USER} reads "
              "it", file=sys.stderr, flush=True)


def environment(grader: dict[str, str], private: Private) -> dict[str, str]:
    """A sandboxed rank's environment: of the grader's (tokens, its own paths) only what configures
    the run (KEPT, KEPT_PREFIXES), and its caches in its private home, not where root's are (the
    forkserver, root, may have set inductor's cache folder in the environment already)."""
    cache = private.home / ".cache"
    return {**{k: v for k, v in grader.items() if (k in KEPT or k.startswith(KEPT_PREFIXES))
               and not any(w in k.upper() for w in CREDENTIAL_WORDS)},
            "USER": USER, "LOGNAME": USER, "HOME": str(private.home), "TMPDIR": str(private.tmp),
            "XDG_CACHE_HOME": str(cache), "HF_HOME": str(cache / "huggingface"),
            "HF_DATASETS_CACHE": str(cache / "huggingface" / "datasets"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"), "TRITON_CACHE_DIR": str(cache / "triton")}


# [Note: what a rank starts with]
# A rank is a fork of the forkserver (CPU) or a fresh interpreter (CUDA: spawn), and starts with the environment
# that process was started with: on its stack, where clearing os.environ (`enter`) leaves it to be read by a rank
# that reads its own memory. So where the sandbox is wanted, ranks and the forkserver start while the grader's
# environment holds only what a run needs (`launching`): the grader's credentials (a CI token, Gradescope's) are in
# no rank's memory at all.
def launch_environment(grader: dict[str, str]) -> dict[str, str]:
    """Of the grader's environment, what a rank starts with ([Note: what a rank starts with])."""
    return {k: v for k, v in grader.items() if not any(w in k.upper() for w in CREDENTIAL_WORDS)
            and (k in KEPT or k in LAUNCH_KEPT or k.startswith(KEPT_PREFIXES) or k.startswith(LAUNCH_PREFIXES))}


@contextlib.contextmanager
def launching():
    """While ranks or their forkserver start: the grader's environment is `launch_environment`'s, then all of it
    again. Not root: as it is (the student's own run)."""
    if not wanted():
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(launch_environment(saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def enter(private: Private) -> None:
    """In a freshly forked rank, before any file under test is imported: become the sandbox user for
    good, with the private HOME and TMPDIR. Not root: nothing changes (the student's own run)."""
    if private.uid is None:
        return
    if private.namespaces is not None:
        Namespaces.join(private.namespaces)
    # The grader's resource tracker (root's, whose pipe every fork of the forkserver holds) unlinks at its end each
    # shared memory segment a line on that pipe names, anyone's: a rank gets a tracker of its own when it needs one.
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    # A bound on the sandbox user's processes (threads count too: a rank has dozens), so that a fork storm can
    # neither exhaust the machine's process table nor outrun `sweep`.
    resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    os.setgroups([])
    os.setgid(private.gid)
    os.setuid(private.uid)
    if os.getuid() != private.uid or os.geteuid() != private.uid or os.getegid() != private.gid:
        raise SandboxError(f"could not become {USER}")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise SandboxError(f"{USER} could become root again")
    libc = ctypes.CDLL(None, use_errno=True)
    # PR_SET_NO_NEW_PRIVS: no setuid program (su, sudo) gives privileges back
    if libc.prctl(38, 1, 0, 0, 0) != 0:
        raise SandboxError("prctl(PR_SET_NO_NEW_PRIVS) failed")
    # Not dumpable (PR_GET_DUMPABLE), as changing user left it: a process of the same user, a pool of another
    # grading on this machine, can neither trace it nor read its memory (harness/compat.py's reset_peak_rss makes it
    # dumpable only while it writes its own /proc/self/clear_refs)
    if libc.prctl(3, 0, 0, 0, 0) != 0:
        raise SandboxError(f"a rank became {USER} and stayed dumpable")
    # A session keyring of its own (the forkserver's was root's, shared by every rank): what a rank keeps there goes
    # with its processes (KEYCTL_JOIN_SESSION_KEYRING, anonymous); the user's own keyrings every sweep empties. Where
    # keyrings are closed to processes (Docker's seccomp profile) or absent, there is none to share.
    import errno
    import platform

    if (number := KEYCTL.get(platform.machine())) is not None and \
            libc.syscall(ctypes.c_long(number), ctypes.c_long(1), ctypes.c_void_p(None)) < 0 and \
            ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS, errno.EACCES):
        raise SandboxError(f"a rank became {USER} and could not leave root's session keyring: errno "
                           f"{ctypes.get_errno()}")
    kept = environment(os.environ, private)
    os.environ.clear()
    os.environ.update(kept)
    tempfile.tempdir = None  # read TMPDIR again
    if (codecache := sys.modules.get("torch._inductor.codecache")) is not None:
        # imported by the forkserver, which put inductor's precompiled headers in root's cache
        codecache._HEADER_DIR = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
    if (datasets_config := sys.modules.get("datasets.config")) is not None:
        # imported by the forkserver (torchtitan's dataset), which read root's HOME: the prepared data
        # goes to this rank's own cache, where no other submission's run reads it
        datasets_config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
    sys.dont_write_bytecode = True  # nothing the grader later imports is written by this process


# --------------------------------------------------------------------------- files written in the sandbox


def copy_back(src: Path, dest: Path) -> None:
    """Copy the regular files under `src` (a folder a sandboxed rank wrote) to `dest`: links and
    anything but regular files and folders skipped, each file opened without following a link and
    at most MAX_FILE bytes, at most MAX_FILES files and MAX_BYTES in all, copied a chunk at a time."""
    count = total = 0

    def walk(dir_fd: int, into: Path) -> None:
        nonlocal count, total
        into.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(dir_fd):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                try:
                    walk(fd, into / name)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                count += 1
                if count > MAX_FILES:
                    raise SandboxError(f"more than {MAX_FILES} files written by the run under test")
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
                with os.fdopen(fd, "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        continue
                    with open(into / name, "wb") as out:
                        size = 0
                        while chunk := f.read(1 << 20):
                            size, total = size + len(chunk), total + len(chunk)
                            if size > MAX_FILE:
                                raise SandboxError(f"{into / name}: the run under test wrote more than {MAX_FILE} "
                                                   "bytes")
                            if total > MAX_BYTES:
                                raise SandboxError(f"the run under test wrote more than {MAX_BYTES} bytes in all")
                            out.write(chunk)

    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        walk(fd, Path(dest))
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- processes left behind


def _sandboxed(uid: int) -> dict[int, int]:
    """{pid: parent pid} of every process of `uid`."""
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "ppid", "uids", "status"]):
        try:  # a zombie is dead already, its parent has yet to reap it: unless a thread of it still runs
            if p.info["uids"] and p.info["uids"].real == uid and (p.info["status"] != psutil.STATUS_ZOMBIE
                                                                 or any_thread_runs(p.info["pid"])):
                out[p.info["pid"]] = p.info["ppid"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def any_thread_runs(pid: int) -> bool:
    """Whether a thread of a process reads as other than dead (a process whose first thread ended while another
    runs on reads as a zombie: the sweep must kill it all the same). Through psutil, as every platform offers it."""
    import psutil

    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return False
    for thread in threads:
        try:
            if psutil.Process(thread.id).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return True
        except psutil.Error:
            continue
    return False


# [Note: the signaller of the sweep]
# Only a process of the sandbox user may signal all of that user's processes in one system call (kill(-1) as
# root would stop the grader too), and kill(-1) is what no chain of forks outruns. A process of that user may
# in turn be signalled by every other: a chain that kills every process of its user each generation would kill
# the signaller before it stopped anything (a red-team file's did, and outlived its grading). So the signaller
# is a fresh interpreter started by root that takes the sandbox user as its effective uid only, with a real and
# saved uid that no process holds (a bystander's): kill(-1) reaches every process whose uid is the sandbox
# user's, and no process of the sandbox user may signal or trace it (its real and saved uids are not theirs).
# It execs nothing after (exec would make the saved uid the effective one). Where no such uid can be taken (a
# user namespace that maps few), a process of the sandbox user signals, said once on stderr, and a sweep that
# could not stop them all reads the processes one by one.


@functools.lru_cache(maxsize=None)
def _bystander_uid(uid: int) -> int | None:
    """A uid no account names and no process holds (the signaller's real and saved uid), or None."""
    import pwd

    import psutil

    held = set()
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"]:
            held.update(p.info["uids"])
    for candidate in range(65533, 60000, -1):
        if candidate == uid or candidate in held:
            continue
        try:
            pwd.getpwuid(candidate)
        except KeyError:
            return candidate
    return None


_SIGNALLER = """
import os, sys
uid, gid, bystander, sig = map(int, sys.argv[1:])
os.setgroups([])
os.setresgid(gid, gid, gid)
os.setresuid(bystander, uid, bystander)  # and no exec after: the saved uid stays the bystander's
if sig:
    try:
        os.kill(-1, sig)  # every process of the sandbox user, none of which may signal this one back
    except ProcessLookupError:
        pass
else:
    sys.stdin.read()  # a test's: held until its stdin closes
"""

_SIGNAL_EVERY = """
import os, sys
try:
    os.kill(-1, int(sys.argv[1]))  # every process this user may signal, but this one
except ProcessLookupError:
    pass
"""


def signaller(uid: int, gid: int, sig: int, **popen) -> subprocess.Popen | None:
    """Start the sandbox user's signaller ([Note: the signaller of the sweep]), which sends `sig` (0: none, it
    waits for its stdin to close); None where no bystander uid can be taken."""
    if (bystander := _bystander_uid(uid)) is None:
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _SIGNALLER, str(uid), str(gid), str(bystander),
                             str(int(sig))], env={"PATH": os.defpath}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, **popen)


_said_signaller = False


def _signal_every(uid: int, gid: int, sig: int) -> bool:
    """Send `sig` to every process of the sandbox user at once ([Note: the signaller of the sweep]). Whether it
    was sent."""
    global _said_signaller
    try:
        if (proc := signaller(uid, gid, sig, stdin=subprocess.DEVNULL)) is not None and proc.wait(timeout=30) == 0:
            return True
    except (OSError, subprocess.SubprocessError):
        pass
    if not _said_signaller:
        _said_signaller = True
        print(f"sandbox: no uid that no process holds could be taken to signal {USER}'s processes from: a process "
              f"of {USER} signals them, which another could kill first", file=sys.stderr, flush=True)
    try:  # a process of the sandbox user, which the others could kill first
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _SIGNAL_EVERY, str(int(sig))], user=uid, group=gid,
                              extra_groups=[], env={"PATH": os.defpath}, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


# [Note: which processes of the sandbox user are live ranks]
# A sweep kills every process of the sandbox user but the live ranks of the pools still open, this grading's and
# any other's on the machine (a grading nested in another, as the bundle's tests run one; two at once). It cannot
# tell them by their parent: a rank can make a process whose parent is its own (clone with CLONE_PARENT: a sibling,
# as another pool's rank is), and an orphan goes to the nearest subreaper above it, not always to pid 1. So a pool
# writes its ranks where every grading's sweep reads them, in a folder only root writes (/run, never /tmp, where
# the sandbox user could make it first): one file per pool, each rank by its pid and its start (in clock ticks
# since boot, which no clock change moves: a pid the kernel gives again is another process), and a rank becomes
# the sandbox user only once it is written. The pool holds a lock on its file while it is open, which the kernel
# lets go when the grading dies however it dies: a file whose lock can be taken is a dead grading's, its ranks
# leftovers. The same lock on a pool's private folder says whether its grading still runs (remove_dead_roots).
# Where no such folder can be made (not root, a read-only /run), or where a rank's start cannot be read (under
# FSDP_PLATFORM=darwin, harness/compat.py: macOS has no /proc), the sweep falls back to this process's own pools
# (LIVE_RANKS): what descends from this process and is no live rank of it, what lost its parent, goes. Every
# grading on a machine runs one version of this protocol: the ranks of a grading that writes no locked file are
# leftovers to every other's sweep.
REGISTRY = Path("/run/fsdp-sandbox")
LIVE_RANKS: set[int] = set()
"""the pids of the live ranks of this process's sandboxed pools"""


def _started(pid: int) -> str | None:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat's starttime), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _registry() -> Path | None:
    """The folder of live ranks, root's own (made when missing), or None where it cannot be."""
    if compat.simulated():
        return None
    try:
        REGISTRY.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(REGISTRY)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
        return None
    return REGISTRY


def _held_open(path: Path) -> bool | None:
    """Whether a live process holds `path`'s lock (a live grading's); None if there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _locked(path: Path) -> int:
    """A new file at `path` (root's alone), locked by this process while the returned descriptor is open."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


@dataclass(frozen=True)
class Registration:
    """A pool's entry in the registry of live ranks: its file, and the descriptor holding the file's lock."""

    path: Path
    fd: int


def register(pids: list[int]) -> Registration | None:
    """Write a new pool's ranks in the registry ([Note: which processes of the sandbox user are live ranks]),
    before they become the sandbox user; `unregister` takes them out when the pool closes."""
    LIVE_RANKS.update(pids)
    if not wanted() or (folder := _registry()) is None:
        return None
    path = folder / f"{os.getpid()}-{secrets.token_hex(8)}"
    part = path.with_name(path.name + ".part")  # read by no sweep until whole
    fd = _locked(part)
    os.write(fd, "".join(f"{pid} {_started(pid)}\n" for pid in pids).encode())
    os.replace(part, path)
    return Registration(path, fd)


def unregister(pids: list[int], registration: Registration | None) -> None:
    """The pool's ranks are no live ranks any more (it is closing)."""
    LIVE_RANKS.difference_update(pids)
    if registration is not None:
        registration.path.unlink(missing_ok=True)
        os.close(registration.fd)


def _live_ranks() -> set[int] | None:
    """The pids of every live grading's live ranks, or None where there is no registry."""
    if (folder := _registry()) is None:
        return None
    live = set(LIVE_RANKS)
    for path in folder.iterdir():
        if path.name.endswith(".part"):  # a pool writing its file
            continue
        held = _held_open(path)
        if held is False:  # a grading that died: its ranks are leftovers now
            path.unlink(missing_ok=True)
        if not held:
            continue
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:  # its pool closed meanwhile
            continue
        for line in lines:
            pid, _, started = line.partition(" ")
            if pid.isdigit() and _started(int(pid)) == started:
                live.add(int(pid))
    return live


def _descends_from_here(pid: int) -> bool:
    """Whether `pid` is this process or descends from it (a forkserver, a rank)."""
    import psutil

    try:
        return pid == os.getpid() or any(p.pid == os.getpid() for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def sweep(ranks: list[int] = (), timeout: float = 10.0) -> list[int]:
    """As root: kill the given ranks and every process of the sandbox user that is no live rank of an open
    pool ([Note: which processes of the sandbox user are live ranks]), and all that descends from them, until
    none is left; the live ranks of the pools still open (this grading's and others') go on. Returns the pids
    killed. Not root: kills the ranks only.

    Every process of the sandbox user is stopped while the processes are read and the doomed killed
    (`_signal_every`), then the rest continue: read one by one, a chain of processes that each fork the next
    and exit would always be a step ahead of the reading (a red-team file's outlived its grading so, and
    killed a later submission's ranks)."""
    import signal

    killed: list[int] = []
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    if not wanted():
        return killed
    try:
        uid, gid = account()
    except SandboxError:
        return killed
    doomed = set(ranks)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        frozen = _signal_every(uid, gid, signal.SIGSTOP)
        try:
            procs = _sandboxed(uid)
            live = _live_ranks()
            roots = {pid for pid, parent in procs.items() if parent <= 1 or parent in doomed or (
                parent not in procs and pid not in (LIVE_RANKS if live is None else live)
                and (live is not None or _descends_from_here(parent)))}
            tree, grew = set(roots), True
            while grew:
                grew = False
                for pid, parent in procs.items():
                    if parent in tree and pid not in tree:
                        tree.add(pid)
                        grew = True
            # unfrozen (the user's processes could not be stopped at once), each stopped first, so that none
            # forks while the rest die
            for sig in (signal.SIGKILL,) if frozen else (signal.SIGSTOP, signal.SIGKILL):
                for pid in tree:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        finally:
            if frozen:
                _signal_every(uid, gid, signal.SIGCONT)  # other live pools' ranks go on
        if not tree:
            return killed
        killed += sorted(tree)
        doomed |= tree
        time.sleep(0.05)
    raise SandboxError(f"processes of {USER} still running after {timeout:.0f} s of killing them")


# --------------------------------------------------------------------------- files left behind

# Folders every user may write into: what the sandbox user leaves there outlives its pool, and can stand in
# a later root process's way (a /tmp/pytest-of-root made first makes root's pytest refuse its temporary
# folder; a /tmp/torchinductor_root would hand code to root's torch.compile).
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")


def _held(uid: int) -> set[str]:
    """The paths that live processes of `uid` hold: open, mapped, or their working folder. After `sweep`
    killed a closing pool's ranks and what they started, those are other live pools' (a test's fresh
    pool closing beside a long-lived one, a grading nested in another)."""
    import psutil

    held = set()
    for pid in _sandboxed(uid):
        try:
            proc = psutil.Process(pid)
            held.add(proc.cwd())
            held.update(f.path for f in proc.open_files())
            held.update(_mapped(pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):  # gone meanwhile
            pass
    return held


def _mapped(pid: int) -> set[str]:
    """The files a process maps, by /proc/PID/maps on Linux (its paths only: psutil's memory_maps reads smaps, whose
    page counts the kernel walks each mapping's pages for, a tenth of a second per rank); elsewhere, and under the
    simulated macOS, which has no /proc, by psutil."""
    if compat.simulated() or not sys.platform.startswith("linux"):
        import psutil

        return {m.path for m in psutil.Process(pid).memory_maps() if m.path.startswith("/")}
    fields = (line.split(maxsplit=5) for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {f[5].removesuffix(" (deleted)") for f in fields if len(f) == 6 and f[5].startswith("/")}


def _sweep_ipc(uid: int) -> list[str]:
    """Remove the System V shared memory segments, message queues and semaphore sets `uid` made or owns: they are
    no files, and outlive every process (a segment of gigabytes would stay pinned for every later submission). Made
    too: its owner may hand one to another user (IPC_SET), and its creator keeps the owner's rights. A segment still
    attached goes once its last process detaches. Not under the simulated macOS (no /proc)."""
    if compat.simulated():
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    remove = {"shm": lambda i: libc.shmctl(i, 0, None), "msg": lambda i: libc.msgctl(i, 0, None),
              "sem": lambda i: libc.semctl(i, 0, 0)}  # IPC_RMID
    removed = []
    for kind, rmid in remove.items():
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        header = lines[0].split() if lines else []
        if "uid" not in header or "cuid" not in header or len(header) < 2:
            continue
        for line in lines[1:]:
            fields = line.split()
            if len(fields) == len(header) and uid in (int(fields[header.index("uid")]), int(fields[header.index("cuid")])):
                ident = int(fields[1])
                if rmid(ident) == 0:
                    removed.append(f"System V {kind} {ident}")
    return removed


# The keyrings a user's keys outlive its processes in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING, and
# the persistent keyring KEYCTL_GET_PERSISTENT links into the process keyring), emptied by the user itself:
# keyctl(2) by its number on each architecture (no keyutils library on most machines).
KEYCTL = {"x86_64": 250, "aarch64": 219}
_CLEAR_KEYS = r"""
import ctypes, os, sys
number, uid, gid = map(int, sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
keyctl = lambda *a: libc.syscall(ctypes.c_long(number), *[ctypes.c_long(x) for x in a])
# root until here, then the user for good, with no exec after it: not dumpable, so no process of the user traces it
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, PR_GET_DUMPABLE
    sys.exit("not dumpable and no new privileges: not so")
persistent = keyctl(22, -1, -2)  # KEYCTL_GET_PERSISTENT, this user, into KEY_SPEC_PROCESS_KEYRING
for ring in (-4, -5, *([persistent] if persistent > 0 else [])):
    keyctl(7, ring)  # KEYCTL_CLEAR
"""


def _clear_keys(uid: int, gid: int) -> list[str]:
    """Empty the keyrings of `uid` that outlive its processes (the kernel keeps a user's keyrings with no process of
    it alive): a key left there is read by every later submission. By a root interpreter that becomes that user
    itself (no exec after: not dumpable, so a live rank cannot trace it), within seconds; not under the simulated
    macOS (no keyrings there)."""
    import platform

    if compat.simulated() or (number := KEYCTL.get(platform.machine())) is None:
        return []
    why = "no try"
    for _ in range(10):  # a process of the sandbox user's: another grading's sweep may kill it (it is no live rank)
        try:
            done = subprocess.run([sys.executable, "-I", "-S", "-c", _CLEAR_KEYS, str(number), str(uid), str(gid)],
                                  env={}, cwd="/", capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError) as e:  # stopped by a live rank (SIGSTOP), say
            why = str(e)
            continue
        if done.returncode == 0:
            return [f"the keyrings of {USER}"]
        why = f"exit code {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"
        if done.returncode > 0:
            break
    # said, and the sweep goes on: what else it removes matters as much
    print(f"sandbox: could not empty the keyrings of {USER} ({why}): a key a rank left there stays for later "
          "submissions", file=sys.stderr, flush=True)
    return []


def sweep_files(folders: tuple[str, ...] = SHARED_FOLDERS) -> list[str]:
    """As root: remove every entry of the shared folders that the sandbox user owns (a folder with all in
    it; no link is followed), except what a live process of that user holds (`_held`: another pool's,
    whose own close sweeps it), the System V IPC objects it made or owns (in the machine's IPC namespace: a pool's
    own goes with it, [Note: namespaces of the pool's own]), and the keys in its keyrings. Returns what was removed.
    Not root: nothing (the student's own run)."""
    if not wanted():
        return []
    try:
        uid, gid = account()
    except SandboxError:
        return []
    held = None  # read once an entry of the user's is found (the common case is none: no process is asked)
    removed = _sweep_ipc(uid) + _clear_keys(uid, gid)
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if held is None:
                    held = _held(uid)
                if any(path == entry.path or path.startswith(entry.path + "/") for path in held):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:
                pass
    return removed

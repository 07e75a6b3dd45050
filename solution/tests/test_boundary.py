"""The process and user boundary between the grader and a file under test, tested without the source
check: hostile jobs and the boundary mutants of solution/tests/mutation.py are run on sandboxed ranks
directly (checks.check_forward and RankPool.run never read the source), as if a file had found a way
past it. The grader must unpickle nothing such a rank sent, refuse a malformed result naming what was
wrong, keep the store, the repository and the points JSON byte-identical, and leave no process behind.
The user half (sandbox.py) holds where the grader is root, as in CI and on Gradescope; elsewhere its
tests skip (a student's own run has nothing of anyone else's to protect)."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import py_compile
import pickle
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest

from harness.tools.grading import checks, handwritten, jobs, policy, sandbox
from harness.tools.grading.ranks import RankError, RankPool, Ranks, Refused
from solution.tests.boundary import digest_tree, sandbox_processes

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "solution" / "fsdp.py"
as_root = pytest.mark.skipif(not sandbox.wanted(), reason="the sandbox user is taken only when the grader is root")


# --------------------------------------------------------------------------- hostile jobs (run in the ranks)


MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"fsdp-boundary-{os.getpid()}"


class RunsCode:
    """Unpickled, it runs code: it creates the file named."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path, 0o777, True))


def _channel() -> Connection:
    return next(o for o in gc.get_objects() if type(o) is Connection and not o.closed)


def forge_pickle_job(job: int, path: str) -> int:
    """Sends, on this rank's channel, a pickled result whose unpickling would run code."""
    _channel().send_bytes(pickle.dumps((job, "ok", RunsCode(path), "")))
    return 0


def forge_fields_job(job: int) -> jobs.Run:
    """Sends a Run whose comm log holds text where numbers belong."""
    header = ('{"job": %d, "status": "ok", "value": {"result": null, "digests": [], "problems": [], "comm": '
              '{"events": [[1, "forward", "all_gather", "float32", "many"]], "uses_fsdp2": null, "groups": []}, "uses_fsdp2": null, '
              '"forward_loss": 4.09}, "traceback": ""}' % job).encode()
    _channel().send_bytes(struct.pack("<Q", len(header)) + header)
    return None


def wrong_type_job() -> jobs.Run:
    return "passed"


def undeclared_job():
    return 0


@dataclass
class Identity:
    uid: int
    gid: int
    groups: list[int]
    home: str
    tmp: str
    refused: list[str]
    """the protected paths this rank could not read or write"""
    dumpable: int
    """PR_GET_DUMPABLE: 0, so that no other process of its user may trace it or read its memory"""


def identity_job(reads: list[str], writes: list[str]) -> Identity:
    import tempfile

    refused = []
    for path in reads:
        try:
            Path(path).read_bytes()
        except OSError:
            refused.append(path)
    for path in writes:
        try:
            with open(path, "ab"):
                pass
        except OSError:
            refused.append(path)
    import ctypes

    return Identity(os.getuid(), os.getgid(), os.getgroups(), os.environ["HOME"], tempfile.gettempdir(), refused,
                    ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))


def background_job(leader_exits: bool = False) -> int:
    """Leaves a process in its own session that would outlive the rank; returns its pid. leader_exits: its first
    thread ends (the exit system call, not the process's), another runs on: the process reads as a zombie."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if (pid := os.fork()) == 0:
            if leader_exits:
                import ctypes
                import threading

                threading.Thread(target=time.sleep, args=(600,)).start()
                ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[os.uname().machine], 0)  # SYS_exit
            time.sleep(600)
            os._exit(0)
        os.write(w, str(pid).encode())
        os._exit(0)
    return int(os.read(r, 32))


def pid_job() -> int:
    return os.getpid()


def sibling_job() -> int:
    """Leaves a process made as the rank's sibling (clone with CLONE_PARENT: a child of the rank's own parent, the
    forkserver, as a live rank of another pool is); returns its pid."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    pid = libc.syscall(clone, 0x00008000 | 17, 0, 0, 0, 0)  # CLONE_PARENT | SIGCHLD
    if pid == 0:  # the child: only what a raw clone of a threaded process may do
        os.execv("/bin/sleep", ["sleep", "600"])
    return pid


def fork_chain_job(beat: str, seconds: float = 60.0) -> None:
    """Leaves a chain of processes in a session of its own, each forking the next and exiting at once: none lives
    long enough to be found by a reading of the processes one by one. It writes the time to `beat` (its heart
    beat) now and then, and ends by itself after `seconds`."""
    if os.environ["RANK"] == "0" and os.fork() == 0:
        os.setsid()
        # a small process (a rank's, torch's memory mapped, forks slowly enough to be found)
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", CHAIN, beat, str(seconds)])


CHAIN = """
import os, sys, time
beat, end, last = sys.argv[1], time.monotonic() + float(sys.argv[2]), 0.0
while time.monotonic() < end:
    if time.monotonic() - last > 0.01:
        last = time.monotonic()
        with open(beat, "w") as f:
            f.write(str(time.time_ns()))
    try:
        if os.fork():
            os._exit(0)
    except OSError:  # out of processes for a moment: the next try
        time.sleep(0.0005)
"""


def beats(path: Path, within: float = 0.5) -> bool:
    """Whether a chain writes its heart beat to `path`: a beat seen to change within `within` seconds."""
    def read() -> str:
        try:
            return path.read_text()
        except OSError:
            return ""

    first, end = read(), time.monotonic() + within
    while time.monotonic() < end:
        time.sleep(0.05)
        if read() not in ("", first):
            return True
    return False


def plant_ipc_job(key: int, path: str) -> int:
    """Leaves what is no file (a System V shared memory segment) and a file in /run/lock; the segment's id."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if os.environ["RANK"] != "0":
        return -1
    Path(path).write_bytes(b"left")
    return libc.shmget(key, 1 << 20, 0o1000 | 0o666)  # IPC_CREAT


def plant_kernel_objects_job(key: int, name: str) -> list[int]:
    """Leaves what is no file and no process (rank 0): a System V segment handed to root (IPC_SET: its creator keeps
    the owner's rights), a POSIX message queue, a key in the user keyring and one in the session keyring; their ids
    (each >= 0: made)."""
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    if os.environ["RANK"] != "0":
        return []
    shmid = libc.shmget(key, 1 << 20, 0o1000 | 0o600)  # IPC_CREAT
    perm = ctypes.create_string_buffer(512)
    handed = libc.shmctl(shmid, 2, perm)  # IPC_STAT
    struct.pack_into("I", perm, 4, 0)  # ipc_perm.uid (after the key): root
    handed = min(handed, libc.shmctl(shmid, 1, perm))  # IPC_SET
    queue = libc.mq_open(name.encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
    keys = [libc.syscall(ctypes.c_long(add_key), b"user", name.encode(), b"left", ctypes.c_long(4),
                         ctypes.c_long(ring)) for ring in (-4, -3)]  # KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING
    for key_id in keys:  # found by any process of the user, possessed or not (KEYCTL_SETPERM: all to the user)
        libc.syscall(ctypes.c_long(sandbox.KEYCTL[platform.machine()]), ctypes.c_long(5), ctypes.c_long(key_id),
                     ctypes.c_long(0x3F3F0000))
    return [shmid, handed, queue, *keys]


def find_kernel_objects_job(key: int, name: str) -> list[bool]:
    """Whether a rank finds each of `plant_kernel_objects_job`'s objects."""
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    search = ctypes.c_long(sandbox.KEYCTL[platform.machine()])
    return [libc.shmget(key, 0, 0) >= 0, libc.mq_open(name.encode(), os.O_RDONLY) >= 0,
            *(libc.syscall(search, ctypes.c_long(10), ctypes.c_long(ring), b"user", name.encode(), ctypes.c_long(0)) >= 0
              for ring in (-4, -3))]


def process_limit_job() -> list[int]:
    import resource

    return list(resource.getrlimit(resource.RLIMIT_NPROC))


_HELD = []


def hold_job(path: str) -> int:
    """Creates `path` (rank 0) and keeps it open after the job, as a live pool's rank holds its files."""
    if os.environ["RANK"] == "0":
        _HELD.append(open(path, "w"))
    return 0


def connect_job(port: int) -> bool:
    """Whether this rank can open a TCP connection to 127.0.0.1:port (the trusted pool's store, say)."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return False
    return True


def plant_job(cfg) -> int:
    """Writes a trace, a link to a file it may not read, and a link out of its folder."""
    folder = Path(cfg.traces_dir)
    if os.environ["RANK"] != "0":
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rank0.json").write_text('{"traceEvents": []}')
    (folder / "secret.json").symlink_to("/etc/shadow")
    (folder / "out").symlink_to("/")
    return 0


# --------------------------------------------------------------------------- helpers


def protected() -> list[Path]:
    """What a file under test must never change: the repository's code and the FSDP2 store."""
    return [ROOT / "test.py", ROOT / "train.py", ROOT / "conftest.py", ROOT / "harness", ROOT / "solution",
            Path(os.environ.get("FSDP2_CACHE_DIR") or ROOT / ".cache" / "fsdp2")]


@pytest.fixture
def ranks():
    with Ranks(2) as r:
        yield r


# --------------------------------------------------------------------------- results are data


def test_pickled_result_is_refused_and_never_unpickled(ranks, tmp_path):
    """A rank that sends a pickle (whose unpickling would run code) gets its result refused, and the
    code never runs in the grader. On a pool that unpickles (a student's own tools), it would."""
    marker = tmp_path / "unpickled"
    pool = ranks.sandboxed
    with pytest.raises(Refused, match=r"the result of rank \d \(forge_pickle_job\) was refused: .*header"):
        pool.run(forge_pickle_job, 1, str(marker), timeout=60)
    assert not marker.exists(), "the grader unpickled a rank's result"
    assert pool.closed, "a pool whose rank sent garbage must be shut down"
    with RankPool(2, role="own") as own:  # the channel this boundary replaces: the same bytes run code
        own.run(forge_pickle_job, 1, str(marker), timeout=60)
    assert marker.exists(), "the control: unpickling this result runs code"


def test_malformed_result_names_what_is_wrong(ranks):
    with pytest.raises(Refused, match=r"result\.comm\.events\[0\]\[4\] is str, not int"):
        ranks.sandboxed.run(forge_fields_job, 1, timeout=60)


def test_result_of_another_type_fails_that_job(ranks):
    with pytest.raises(RankError, match=r"(?s)wrong_type_job's result cannot be sent as data.*str where Run is declared"):
        ranks.sandboxed.run(wrong_type_job, timeout=60)
    assert not ranks.sandboxed.closed  # an honest error: the pool goes on
    with pytest.raises(TypeError, match="has no return annotation"):
        ranks.sandboxed.run(undeclared_job)


def test_trusted_ranks_never_import_a_file_under_test(ranks):
    with pytest.raises(RankError, match="a file under test is never imported into it"):
        ranks.trusted.run(jobs.forward_job, policy.config(str(SOLUTION)))


def test_graded_jobs_go_to_the_sandbox(ranks):
    """The same check as test.py's: FSDP2 on the trusted pool, the file under test in the sandbox."""
    checks.check_forward(ranks, str(SOLUTION), "float32", "float32")
    assert "sandboxed" in ranks._pools and not ranks.sandboxed.closed


def test_written_files_come_back_as_plain_files(ranks, tmp_path):
    cfg = policy.config(str(SOLUTION), traces_dir=tmp_path / "traces")
    ranks.sandboxed.run(plant_job, cfg, timeout=60)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank0.json"]


# --------------------------------------------------------------------------- the unprivileged user


def test_sandboxed_environment_keeps_only_the_runs_settings(tmp_path):
    """A sandboxed rank sees none of the grader's credentials or paths, and has its caches (inductor's
    too, which the root forkserver may have pointed at root's folder) in its own home."""
    private = sandbox.Private(tmp_path, None, None)
    grader = {"PATH": "/usr/bin", "LC_ALL": "C", "GLOO_SOCKET_IFNAME": "lo", "AWS_SECRET_ACCESS_KEY": "k",
              "GITHUB_TOKEN": "t", "HOME": "/root", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root",
              "FSDP2_CACHE_DIR": "/root/store", "VIRTUAL_ENV": "/root/.venv"}
    env = sandbox.environment(grader, private)
    assert {k: env[k] for k in ("PATH", "LC_ALL", "GLOO_SOCKET_IFNAME")} == {k: grader[k] for k in ("PATH", "LC_ALL",
                                                                                                 "GLOO_SOCKET_IFNAME")}
    assert not {"AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "FSDP2_CACHE_DIR", "VIRTUAL_ENV"} & set(env), sorted(env)
    assert env["USER"] == sandbox.USER and env["HOME"] == str(private.home)
    assert all(Path(env[k]).is_relative_to(private.home) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                                                                   "HF_DATASETS_CACHE", "XDG_CACHE_HOME")), env


@as_root
def test_no_rank_starts_with_the_graders_credentials():
    """[Note: what a rank starts with]: a variable of the grader's that a run does not need is in no rank's initial
    environment (which clearing os.environ leaves on its stack), nor the forkserver's; PATH is (the control)."""
    code = """
from pathlib import Path
import psutil
from harness.tools.grading.ranks import RankPool
from solution.tests.test_boundary import pid_job
with RankPool(1, role="sandboxed") as pool:
    rank = pool.run(pid_job, timeout=60)[0]
    for pid in (rank, psutil.Process(rank).ppid()):
        block = Path(f"/proc/{pid}/environ").read_bytes().split(bytes(1))
        print(pid, any(v.startswith((b"GRADER_TOKEN=", b"HF_TOKEN=")) for v in block),
              any(v.startswith(b"PATH=") for v in block))
"""
    env = {**os.environ, "GRADER_TOKEN": "secret", "HF_TOKEN": "secret"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    assert [line[1:] for line in lines] == [["False", "True"]] * 2, lines


@as_root
def test_sandboxed_ranks_run_unprivileged(ranks, tmp_path):
    private = tmp_path / "points.json"
    private.write_text("{}")
    store = Path(os.environ.get("FSDP2_CACHE_DIR") or ROOT / ".cache" / "fsdp2")
    checks.run_fsdp2(ranks, jobs.forward_job, policy.config())  # the store holds a secret and an entry
    reads = [str(store / "secret"), *map(str, store.glob("*.entry")), str(private)]
    writes = [*reads, str(ROOT / "test.py"), str(ROOT / "harness" / "tools" / "grading" / "checks.py"), str(store / "forged.entry")]
    before = digest_tree(*protected(), private)
    identity = ranks.sandboxed.run(identity_job, reads, writes, timeout=60)[0]
    uid, gid = sandbox.account()
    assert (identity.uid, identity.gid, identity.groups) == (uid, gid, []), identity
    assert identity.home.startswith(str(ranks.sandboxed.private.root)) and \
        identity.tmp.startswith(str(ranks.sandboxed.private.root)), identity
    assert sorted(identity.refused) == sorted(reads + writes), identity
    assert identity.dumpable == (0 if sandbox.wanted() else 1), identity  # a pool beside it cannot read its memory
    assert digest_tree(*protected(), private) == before


@as_root
def test_sandboxed_ranks_cannot_reach_the_graders_loopback(ranks):
    """[Note: namespaces of the pool's own]: a port the grader listens on (as the trusted pool's TCPStore
    and gloo do) is out of reach of the ranks under test, which still reach each other (the job's
    process group works); a pool without the boundary reaches it (the control)."""
    import socket

    if ranks.sandboxed.private.namespaces is None:
        pytest.skip("network namespaces are not allowed on this machine (the stderr line says why)")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert ranks.sandboxed.run(connect_job, port, timeout=60) == [False, False]
        with RankPool(2, role="own") as own:
            assert own.run(connect_job, port, timeout=60) == [True, True]
    checks.check_forward(ranks, str(SOLUTION), "float32", "float32")  # collectives within the namespace


def read_job(path: str) -> int:
    return len(Path(path).read_bytes())


@as_root
def test_a_folder_closed_between_jobs_is_passable_again(ranks):
    """A grader's folder closed to other users mid-run (pytest closes its temporary folder to its user
    when a test first asks for tmp_path; here the repository itself): the next sandboxed job opens it
    again (o+x), so the ranks still read the repository's data."""
    data = ROOT / "c4_test" / "data.json"
    size = data.stat().st_size
    assert ranks.sandboxed.run(read_job, str(data), timeout=60) == [size, size]
    mode = ROOT.stat().st_mode
    try:
        os.chmod(ROOT, 0o700)
        assert ranks.sandboxed.run(read_job, str(data), timeout=60) == [size, size]
        assert ROOT.stat().st_mode & 0o001, "the repository was not made passable again"
    finally:
        os.chmod(ROOT, mode & 0o7777)


def probe_job(root: str) -> list[str]:
    """What a rank finds in another pool's folder, knowing its name only (as whoever lists /tmp does)."""
    found = []
    for path in (root, *(f"{root}/{sub}" for sub in ("impl", "home", "tmp", "out"))):
        try:
            found.append(f"{path}: {sorted(os.listdir(path))}")
        except OSError as e:
            found.append(type(e).__name__)
    return found


def read_error_job(paths: list[str]) -> list[str]:
    """What reading each path (a file's bytes, a folder's entries) raised, by its class's name ("" if nothing)."""
    errors = []
    for path in map(Path, paths):
        try:
            list(path.iterdir()) if path.is_dir() else path.read_bytes()
            errors.append("")
        except OSError as e:
            errors.append(type(e).__name__)
    return errors


def test_what_a_rank_wrote_comes_back_within_bounds(tmp_path, monkeypatch):
    """copy_back copies regular files only (a link is left where it is), a chunk at a time, and refuses a file over
    MAX_FILE bytes and a run over MAX_BYTES in all, naming the bound."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_bytes(b"a" * 3000)
    (src / "sub" / "b.json").write_bytes(b"b" * 3000)
    (src / "link").symlink_to(src / "a.json")
    sandbox.copy_back(src, dest)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == ["a.json", "sub/b.json"]
    assert (dest / "sub" / "b.json").read_bytes() == b"b" * 3000 and not (dest / "link").exists()
    monkeypatch.setattr(sandbox, "MAX_FILE", 2000)
    with pytest.raises(sandbox.SandboxError, match="wrote more than 2000 bytes"):
        sandbox.copy_back(src, tmp_path / "dest2")
    monkeypatch.setattr(sandbox, "MAX_FILE", 4000)
    monkeypatch.setattr(sandbox, "MAX_BYTES", 5000)
    with pytest.raises(sandbox.SandboxError, match="more than 5000 bytes in all"):
        sandbox.copy_back(src, tmp_path / "dest3")


@as_root
def test_a_pool_cannot_find_what_another_pool_staged(ranks):
    """Two gradings at once run as the same user: the ranks of one, knowing the other pool's folder (anyone lists
    /tmp), can list nothing in it, so they find neither its file under test nor its home (their names are the
    grader's secret); the pool's own staged file is read (the control)."""
    checks.check_forward(ranks, str(SOLUTION), "float32", "float32")  # a file staged in the open pool
    other = ranks.sandboxed.private
    assert list(other.impl.rglob("*.py")), "no file staged"
    with RankPool(1, role="sandboxed") as pool:
        found = pool.run(probe_job, str(other.root), timeout=60)[0]
    assert found == ["PermissionError"] + ["FileNotFoundError"] * 4, found


@as_root
def test_a_rank_holds_no_pipe_to_the_graders_resource_tracker(ranks):
    """The grader's resource tracker (root's) unlinks each shared memory segment named on its pipe when it ends: no
    rank under test holds that pipe (a trusted rank does: the control)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    pipe = os.readlink(f"/proc/self/fd/{resource_tracker._resource_tracker._fd}")

    def link(path: str) -> str:
        try:
            return os.readlink(path)
        except FileNotFoundError:  # closed meanwhile
            return ""

    def held(pool) -> list[bool]:
        return [any(link(f"/proc/{pid}/fd/{fd}") == pipe for fd in os.listdir(f"/proc/{pid}/fd"))
                for pid in pool.run(pid_job, timeout=60)]

    assert pipe.startswith("pipe:") and held(ranks.trusted) == [True, True]
    assert held(ranks.sandboxed) == [False, False]


@as_root
def test_what_only_instructors_read_is_closed_to_a_submission(tmp_path):
    """In the instructors' checkout (where `grade` runs as root) a rank under test cannot read the reference, the
    second solution, the mutants (snippets of the reference), the bytecode compiled of them or the history that holds
    them; nor the folder of the other submissions (`grade` closes it)."""
    hidden = list(sandbox.hidden(ROOT))
    assert SOLUTION in hidden and ROOT / "solution" / "tests" / "variant_fsdp.py" in hidden, hidden
    assert ROOT / "solution" / "tests" / "mutation.py" in hidden, hidden
    cache = ROOT / sandbox.PYTEST_CACHE
    assert cache in hidden, hidden  # whether or not a run has made it yet (a fresh clone holds none)
    if cache.exists() and not any(cache.iterdir()):
        cache.rmdir()  # made by an earlier pool: the pool's start makes it again, closed
    for path in hidden:  # as a fresh clone has them: the pool's start closes them
        if path.exists():
            os.chmod(path, path.stat().st_mode & 0o7777 | (0o005 if path.is_dir() else 0o004))
    # bytecode compiled of them while they were open (a run that imported them first): the whole module
    sources = (SOLUTION, ROOT / "solution" / "tests" / "mutation.py")
    compiled = [Path(importlib.util.cache_from_source(str(source))) for source in sources]
    for source, pyc in zip(sources, compiled):
        py_compile.compile(str(source), cfile=str(pyc), doraise=True)
        assert pyc.stat().st_mode & 0o004, oct(pyc.stat().st_mode)
    hidden = list(sandbox.hidden(ROOT))
    assert all(pyc in hidden for pyc in compiled), hidden
    batch = tmp_path / "batch"
    batch.mkdir()
    (batch / "other.py").write_text("x = 1\n")
    os.chmod(batch, 0o755)
    sandbox.hide(batch)
    with RankPool(1, role="sandboxed") as pool:
        assert cache.is_dir()  # what pytest writes later lands in a folder already closed
        hidden = [p for p in hidden if p.exists()]
        got = pool.run(read_error_job, [str(p) for p in hidden] + [str(batch / "other.py"), str(ROOT / "train.py")],
                       timeout=60)[0]
    assert got == ["PermissionError"] * (len(hidden) + 1) + [""], got


@as_root
@pytest.mark.parametrize("leader_exits", [False, True])
def test_background_process_does_not_outlive_its_pool(leader_exits):
    """A process a rank left in its own session is killed when the pool closes, one whose first thread ended while
    another runs on (it reads as a zombie) too."""
    pool = RankPool(2, role="sandboxed")
    left = pool.run(background_job, leader_exits, timeout=60)
    time.sleep(0.5)  # the first thread's exit
    assert all(psutil.pid_exists(pid) and sandbox.any_thread_runs(pid) for pid in left)
    pool.close()
    assert not [pid for pid in left if psutil.pid_exists(pid) and sandbox.any_thread_runs(pid)]
    assert not sandbox_processes(), sandbox_processes()


@as_root
def test_a_chain_of_processes_does_not_outlive_its_pool():
    """A chain of processes that each fork the next and exit (always a step ahead of a reading of the processes)
    is gone once the pool closes: the sweep stops every process of the sandbox user while it reads them."""
    beat = Path(f"/dev/shm/fsdp-chain-{uuid.uuid4().hex}")
    pool = RankPool(2, role="sandboxed")
    try:
        pool.run(fork_chain_job, str(beat), timeout=60)
        # the chain's first process starts a Python after the job returns: on a loaded machine that takes a while
        assert beats(beat, within=30), "the chain is not running"
    finally:
        pool.close()
    assert not beats(beat, within=1), "the chain outlived its pool"


@as_root
def test_a_sibling_of_the_ranks_does_not_outlive_its_pool():
    """A process a rank made as its own sibling (a child of the forkserver, as another live pool's ranks are) is
    killed when the pool closes, while a live pool's ranks go on."""
    with RankPool(1, role="sandboxed") as live:
        pool = RankPool(1, role="sandboxed")
        left = pool.run(sibling_job, timeout=60)
        assert all(psutil.pid_exists(pid) and psutil.Process(pid).ppid() == psutil.Process(pool._procs[0].pid).ppid()
                   for pid in left), "the sibling is not running"
        pool.close()
        assert not [pid for pid in left if psutil.pid_exists(pid) and sandbox.any_thread_runs(pid)]
        assert live.run(pid_job) == [live._procs[0].pid]
    assert not sandbox_processes(), sandbox_processes()


SUBREAPER = r"""
import ctypes, subprocess, sys, time
from pathlib import Path
from harness.tools.grading import sandbox

GRADING = (
    "import sys\n"
    "from pathlib import Path\n"
    "from harness.tools.grading.ranks import RankPool\n"
    "from solution.tests import test_boundary\n"
    "with RankPool(1, role='sandboxed') as pool:\n"
    "    Path(sys.argv[1]).write_text(' '.join(map(str, pool.run(test_boundary.background_job, timeout=60))))\n")
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans below come here, not to pid 1
subprocess.run([sys.executable, "-c", GRADING, sys.argv[1]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
               check=True)  # (no pipe a leftover would hold open)
left = Path(sys.argv[1]).read_text().split()
time.sleep(0.5)
print(*[pid for pid in left if sandbox.any_thread_runs(int(pid))])
"""


@as_root
def test_an_orphan_under_a_subreaper_does_not_outlive_its_pool(tmp_path):
    """Where the grading runs below a child subreaper (a desktop session's systemd, tini -s), what a rank forked into
    the background goes to that subreaper, not to pid 1: it is no live rank, so the sweep kills it all the same."""
    done = subprocess.run([sys.executable, "-c", SUBREAPER, str(tmp_path / "left")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"left running under the subreaper: {done.stdout}"
    assert not sandbox_processes(), sandbox_processes()


@as_root
def test_the_sweeps_signaller_is_out_of_the_sandbox_users_reach(monkeypatch):
    """The process that stops every process of the sandbox user for the sweep cannot be killed by one of them (a
    chain that kills its user's processes each generation would otherwise kill it first)."""
    uid, gid = sandbox.account()
    proc = sandbox.signaller(uid, gid, 0, stdin=subprocess.PIPE)  # sends nothing: waits for its stdin to close
    assert proc is not None, "no bystander uid could be taken here"
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(proc.pid).uids().effective != uid:  # until it has become the signaller
            assert time.monotonic() < deadline and proc.poll() is None, "the signaller did not start"
            time.sleep(0.01)
        tried = subprocess.run([sys.executable, "-I", "-S", "-c", f"import os; os.kill({proc.pid}, 9)"], user=uid,
                               group=gid, extra_groups=[], capture_output=True, text=True, timeout=60)
        assert "PermissionError" in tried.stderr, (tried.returncode, tried.stderr)
        assert proc.poll() is None, "the sandbox user killed the signaller"
    finally:
        proc.communicate(b"", timeout=30)
    assert proc.returncode == 0
    real, started = sandbox.signaller, []  # and it is what the sweep signals by

    def recorded(*args, **kwargs):
        started.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox, "signaller", recorded)
    assert sandbox._signal_every(uid, gid, signal.SIGCONT) and started == [signal.SIGCONT]


@as_root
def test_what_a_killed_grading_left_running_is_gone_before_a_pool_starts():
    """A process of the sandbox user that no open pool's ranks are (what a grading killed by a time limit left: none
    of its pools closed) is killed when the next pool starts, before that pool's file under test is staged."""
    uid, gid = sandbox.account()
    left = subprocess.Popen(["sleep", "600"], user=uid, group=gid, extra_groups=[], start_new_session=True)
    try:
        with RankPool(1, role="sandboxed") as pool:
            assert left.wait(timeout=30) is not None, "the leftover outlived the next pool's start"
            assert pool.run(pid_job) == [pool._procs[0].pid]
    finally:
        left.kill()
        left.wait()


@as_root
def test_a_killed_gradings_folder_is_removed_and_a_staged_file_is_the_sandbox_groups():
    """The private folder of a grading that was killed (its files under test in it) is gone before a pool makes its
    own; a file under test is staged readable by the sandbox user's group only, no other user of the machine."""
    import train

    dead = subprocess.Popen(["true"])
    dead.wait()
    left = Path(tempfile.gettempdir()) / f"{sandbox.ROOT_PREFIX}{dead.pid}-left"
    (left / "impl" / "x").mkdir(parents=True)
    (left / "impl" / "x" / "fsdp.py").write_text("# a killed grading's file under test\n")
    with RankPool(1, role="sandboxed") as pool:
        assert not left.exists()
        staged, _ = pool._stage((train.Config(fsdp="effdl", impl=str(SOLUTION)),))
        (inside, _), = staged
        for path, mode in ((inside, 0o640), (inside.parent, 0o750)):
            info = path.stat()
            assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (mode, 0, sandbox.account()[1]), path


@as_root
def test_a_pool_closing_beside_a_live_one_leaves_its_files():
    """A pool that closes sweeps what its own ranks left in the shared folders, never what a live pool's
    ranks hold there (a test's fresh pool closes beside the long-lived one); that pool's close removes it."""
    path = Path(f"/dev/shm/fsdp-held-{uuid.uuid4().hex}")
    live = RankPool(2, role="sandboxed")
    try:
        live.run(hold_job, str(path), timeout=60)
        assert path.exists() and path.stat().st_uid == sandbox.account()[0]
        RankPool(2, role="sandboxed").close()
        assert path.exists(), "a closing pool removed a file a live pool's rank holds open"
    finally:
        live.close()
    assert not path.exists(), "the pool that held it left it behind"


@as_root
def test_what_is_no_file_or_lies_in_run_lock_is_removed_too():
    """A System V segment (it outlives every process) and a file in /run/lock (world-writable, as /tmp) that a
    pool's rank left are gone once it closes; the sandbox user holds a bounded number of processes."""
    import ctypes

    key, path = 0x7F000000 | (os.getpid() & 0xFFFF), Path(f"/run/lock/fsdp-left-{uuid.uuid4().hex}")
    with RankPool(2, role="sandboxed") as pool:
        shmid = pool.run(plant_ipc_job, key, str(path), timeout=60)[0]
        assert shmid >= 0 and path.exists()
        assert pool.run(process_limit_job, timeout=60) == [[sandbox.MAX_PROCESSES] * 2] * 2
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.shmget(key, 0, 0) == -1, "the segment outlived its pool"
    assert not path.exists(), "the file in /run/lock outlived its pool"


@as_root
@pytest.mark.parametrize("namespaces", ["the pool's own", "the machine's"])
def test_what_is_no_file_and_no_process_reaches_no_later_pool(namespaces, monkeypatch):
    """[Note: namespaces of the pool's own]: a System V segment handed to root, a POSIX message queue and keys in
    the user and session keyrings that a rank left reach no rank of a later pool; in the machine's IPC namespace
    (where a pool gets none of its own) the sweep removes the segment and the user's keys (a queue there, only where
    /dev/mqueue is mounted to list it), and every rank has a session keyring of its own."""
    import ctypes
    import platform

    if platform.machine() not in sandbox.KEYCTL:
        pytest.skip(f"keyctl's number on {platform.machine()} is not known here")
    if not hasattr(ctypes.CDLL(None), "mq_open"):
        pytest.skip("this C library has no mq_open (glibc before 2.34)")
    if namespaces == "the machine's":
        monkeypatch.setattr(sandbox.Namespaces, "start", classmethod(lambda cls, root: None))
    key, name = 0x7E000000 | (uuid.uuid4().int & 0xFFFFFF), f"/fsdp-left-{uuid.uuid4().hex[:12]}"
    with RankPool(1, role="sandboxed") as pool:
        if namespaces == "the pool's own" and pool.private.namespaces is None:
            pytest.skip("namespaces are not allowed on this machine (the stderr line says why)")
        planted = pool.run(plant_kernel_objects_job, key, name, timeout=60)[0]
        if min(planted[3:]) < 0:
            pytest.skip("keyrings are closed to processes here (a seccomp profile): none to leave a key in")
        assert min(planted) >= 0, planted
        assert pool.run(find_kernel_objects_job, key, name, timeout=60)[0] == [True] * 4  # the control
    with RankPool(1, role="sandboxed") as pool:
        found = pool.run(find_kernel_objects_job, key, name, timeout=60)[0]
    if namespaces == "the machine's" and not Path("/dev/mqueue").is_dir():
        ctypes.CDLL(None).mq_unlink(name.encode())  # (root removes the test's queue)
        found[1] = False
    assert found == [False] * 4, f"a later pool's rank found the segment, queue, user key, session key: {found}"


def test_a_pool_that_cannot_start_leaves_nothing(monkeypatch):
    """A rank that fails to start (out of processes, say) takes the ranks already started, the pool's
    private folder and its namespace holder with it."""
    import multiprocessing.context

    started, start = [], multiprocessing.context.ForkServerProcess.start

    def second_fails(self):
        if started:
            raise OSError("no more processes")
        start(self)
        started.append(self)

    roots = lambda: set(Path(tempfile.gettempdir()).glob(f"{sandbox.ROOT_PREFIX}{os.getpid()}-*"))  # noqa: E731
    before = roots()
    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", second_fails)
    with pytest.raises(OSError, match="no more processes"):
        RankPool(2, role="sandboxed")
    assert started and not started[0].is_alive(), "the rank that started outlived the pool"
    assert roots() == before, "the pool's private folder was left"
    assert not sandbox.Namespaces._holders, "the pool's namespace holder was left"


# --------------------------------------------------------------------------- the boundary mutants


@pytest.fixture(scope="module")
def boundary_mutant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("boundary_mutants")
    from solution.tests.mutation import write_mutant  # here, not above: ranks import this module for its jobs, and
    # mutation.py (snippets of the reference) is closed to them

    return lambda name: write_mutant(folder, name)


def test_forged_rank_result_is_refused(boundary_mutant):
    before = {name: getattr(checks, name) for name in dir(checks) if name.startswith("check_")}
    with Ranks(2) as ranks, pytest.raises(Refused, match="was refused"):
        checks.check_forward(ranks, boundary_mutant("forged-rank-result"), "float32", "float32")
    assert {name: getattr(checks, name) for name in before} == before, "the grader's checks were replaced"


def test_detectors_switched_off_stay_on_in_the_grader(boundary_mutant):
    """Run past the source check (which refuses this file), the detectors' switch-off is refused inside the
    file's ranks too: the loader's guard (harness/impl.py) writes nothing onto the harness's modules. And the
    grader's own processes never saw it: what the file's ranks report about themselves is theirs to forge,
    so the verdict on FSDP2 rests on the source check, the loader and the trusted side computing FSDP2's numbers."""
    path = boundary_mutant("detectors-off-fsdp2")
    assert handwritten.static_problem(Path(path)) is not None
    originals = (handwritten.model_problem, handwritten.stack_problem, jobs.CommLog.__torch_dispatch__)
    before = digest_tree(*protected())
    with Ranks(2) as ranks, pytest.raises(RankError, match="changes only its own objects"):
        checks.run(ranks, jobs.forward_job, policy.config(path))
    assert (handwritten.model_problem, handwritten.stack_problem, jobs.CommLog.__torch_dispatch__) == originals
    assert digest_tree(*protected()) == before


def test_detectors_switched_off_past_the_loader_void_the_run(boundary_mutant):
    """Switched off by ways the loader's guard does not see (the module's namespace written as a dict,
    type.__setattr__), the detectors report FSDP2's own run as the file's; the rank's backstop finds torch's
    and the harness's code changed after the job and voids it, naming each change."""
    path = boundary_mutant("detectors-off-past-the-loader")
    assert handwritten.static_problem(Path(path)) is not None
    with Ranks(2) as ranks, pytest.raises(RankError) as failed:
        checks.check_forward(ranks, path, "float32", "float32")
    for changed in ("harness.tools.grading.handwritten.model_problem (replaced)",
                    "harness.tools.grading.jobs.fsdp2_problem (replaced)",
                    "harness.tools.grading.jobs.CommLog.__torch_dispatch__ (replaced)"):
        assert changed in str(failed.value), str(failed.value)
    assert "the file under test changed what this process runs" in str(failed.value)


@as_root
def test_store_rewrite_changes_no_later_verdict(boundary_mutant):
    """A batch graded with the store-rewriting file first: the store the session grades with (the one
    the file's ranks find, as the grader's) stays byte-identical, and the reference's verdict is the
    one it gets alone."""
    store = Path(os.environ.get("FSDP2_CACHE_DIR") or ROOT / ".cache" / "fsdp2")
    with Ranks(2) as ranks:
        alone = checks.check_forward(ranks, str(SOLUTION), "float32", "float32")  # the store is filled
        before = digest_tree(store)
        assert any(name.endswith(".entry") for name in before) and str(store / "secret") in before
        with pytest.raises(RankError, match="NotImplementedError: a stub"):
            checks.check_forward(ranks, boundary_mutant("store-rewrite"), "float32", "float32")
        assert digest_tree(store) == before
        assert checks.check_forward(ranks, str(SOLUTION), "float32", "float32") == alone
        assert digest_tree(store) == before


@as_root
def test_protected_files_cannot_be_written(boundary_mutant, tmp_path):
    """The repository, the store and a points JSON whose path the file reads from a command line."""
    folder = Path(__import__("tempfile").mkdtemp())  # root's 0700, as grade's points folder
    points = folder / "points.json"
    points.write_text('{"rows": []}')
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--points-json", str(points)])
    try:
        before = digest_tree(*protected(), points)
        with Ranks(2) as ranks, pytest.raises(RankError, match="NotImplementedError: a stub"):
            checks.check_forward(ranks, boundary_mutant("write-protected"), "float32", "float32")
        assert digest_tree(*protected(), points) == before
    finally:
        holder.kill()
        holder.wait()


@as_root
def test_background_process_of_a_file_is_killed(boundary_mutant):
    with Ranks(2) as ranks, pytest.raises(RankError, match="NotImplementedError: a stub"):
        checks.check_forward(ranks, boundary_mutant("background-process"), "float32", "float32")
    assert not sandbox_processes(), sandbox_processes()


@as_root
def test_files_a_file_leaves_in_shared_folders_are_removed(boundary_mutant):
    """What a file's ranks leave in /tmp, /var/tmp or /dev/shm (a folder named like root's pytest temporary
    folder, made first) is gone once its pool closes; what others own there stays."""
    planted = [Path("/tmp/pytest-of-root-planted"), Path("/dev/shm/fsdp-planted")]
    kept = Path(tempfile.mkstemp(prefix="fsdp-root-kept-", dir="/tmp")[1])
    try:
        with Ranks(2) as ranks, pytest.raises(RankError, match="NotImplementedError: a stub"):
            checks.check_forward(ranks, boundary_mutant("plant-shared-tmp"), "float32", "float32")
        assert not [p for p in planted if os.path.lexists(p)], planted
        assert kept.exists()
    finally:
        kept.unlink()


# --------------------------------------------------------------------------- as graders run them


# One end-to-end run: every boundary mutant takes the same path through test.py (refused by its source
# before any rank starts; test_source_check_refuses covers each), and each one's own attack is run on
# the ranks by the tests above.
@pytest.mark.parametrize("name", ["write-protected"])
def test_boundary_mutant_scores_zero(boundary_mutant, name, tmp_path):
    """`pytest test.py --impl FILE` as graders run it: every line 0, each saying why the file was
    refused, the protected files byte-identical, nothing left running."""
    from solution.tests.test_gradescope import left_running

    points = tmp_path / "points.json"
    marker = uuid.uuid4().hex
    before = digest_tree(*protected())
    running = set(sandbox_processes())  # this session's own sandboxed pools stay up meanwhile
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "test.py"),
                           "--impl", boundary_mutant(name), "--points-json", str(points)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "AUTOGRADER_TEST_RUN": marker})
    rows = json.loads(points.read_text())["rows"]
    assert all(r["earned"] == 0 for r in rows), rows
    refusal = handwritten.verdict(handwritten.static_problem(Path(boundary_mutant(name))))
    assert all(refusal.split(" (")[0] in r["evidence"] for r in rows), (rows, proc.stdout[-2000:])
    assert digest_tree(*protected()) == before
    assert not set(sandbox_processes()) - running, sorted(set(sandbox_processes()) - running)
    # The forkserver pytest started leaves once it has finished importing torchtitan (a refused file
    # can end the session first): seconds on an idle machine, more on a loaded one.
    deadline = time.monotonic() + 120
    while left_running(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left_running(marker), left_running(marker)

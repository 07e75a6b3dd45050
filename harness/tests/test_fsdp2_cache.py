"""harness/tools/grading/fsdp2_cache.py: a stored FSDP2 result is the one a fresh run gives, is used only under
its exact key and signature, and anything else is recomputed."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from harness import assets
from harness.tools.grading import checks, fsdp2_cache
from harness.tools.traces.analysis import analyze_run
from harness.tools.grading.jobs import forward_job, memory_job, odd_shapes_job, train_job
from harness.tools.grading.policy import LATE_BUFFERS, as_fsdp2, config


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of the test's own, switched on whatever the caller's environment says."""
    monkeypatch.setenv("FSDP2_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FSDP2_CACHE", "on")
    return tmp_path / "cache"


class Job:
    """A stand-in for FSDP2's run: counts its calls and writes a trace into its output folder."""

    def __init__(self):
        self.calls = 0

    def __call__(self, traces: Path | None = None):
        self.calls += 1
        if traces is not None:
            (traces / "sub").mkdir(parents=True, exist_ok=True)
            (traces / "rank0.json").write_text('{"traceEvents": []}')
            (traces / "sub" / "rank1.json").write_bytes(bytes(range(256)))
        return [{"losses": [1.5, 2.25], "trace": traces / "rank0.json" if traces else None}, {"rank": 1}]


def parts(**overrides) -> dict:
    return fsdp2_cache.case(train_job, (as_fsdp2(config("x", **overrides)),), 2, "cpu", 1)


def entry(cache: Path) -> Path:
    (path,) = cache.glob("*.entry")
    return path


def test_hit_returns_what_was_stored_and_restores_files(tmp_path, cache):
    job = Job()
    cold = fsdp2_cache.get("train", parts(), lambda: job(tmp_path / "a"), {"traces": tmp_path / "a"})
    warm = fsdp2_cache.get("train", parts(), lambda: job(tmp_path / "b"), {"traces": tmp_path / "b"})
    assert job.calls == 1, "the hit ran the job again"
    assert warm[1] == cold[1] and warm[0]["losses"] == cold[0]["losses"]
    assert warm[0]["trace"] == tmp_path / "b" / "rank0.json", "a path into the stored run's folder was not moved"
    for rel in ("rank0.json", "sub/rank1.json"):
        assert (tmp_path / "b" / rel).read_bytes() == (tmp_path / "a" / rel).read_bytes()
    assert (cache / "secret").stat().st_mode & 0o777 == 0o600


def test_output_folder_and_impl_are_not_in_the_key():
    a = as_fsdp2(config("one.py", traces_dir=Path("/tmp/x"), profile_steps=1))
    b = as_fsdp2(config("two.py", traces_dir=Path("/elsewhere/y"), profile_steps=1))
    assert fsdp2_cache.config_key(a) == fsdp2_cache.config_key(b)
    assert "impl" not in fsdp2_cache.config_key(a)
    assert fsdp2_cache.config_key(a) != fsdp2_cache.config_key(dataclasses.replace(a, traces_dir=None))


@pytest.mark.parametrize("changed", [dict(lr=1e-3), dict(param_dtype="bfloat16"), dict(num_steps=5)])
def test_another_config_misses(changed):
    job = Job()
    fsdp2_cache.get("train", parts(), job)
    fsdp2_cache.get("train", parts(**changed), job)
    assert job.calls == 2


def test_case_parts_miss():
    job = Job()
    base = parts()
    for other in (dict(base, world_size=3), dict(base, threads=2), dict(base, job="harness.tools.grading.jobs.forward_job")):
        fsdp2_cache.get("train", base, job)
        fsdp2_cache.get("train", other, job)
    assert job.calls == 4  # the base once, each other case once


def test_a_changed_code_byte_misses(tmp_path, monkeypatch):
    """A copy of the repository's code and data: one byte of a harness module changes the key, one of
    a harness test does not (no stored result comes from harness/tests/)."""
    root = tmp_path / "repo"
    shutil.copytree(fsdp2_cache.ROOT / "harness", root / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    for name in [*fsdp2_cache.SOURCES, *map(str, assets.FILES)]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(fsdp2_cache.ROOT / name, root / name)
    monkeypatch.setattr(fsdp2_cache, "ROOT", root)
    fsdp2_cache.environment.cache_clear()
    try:
        job = Job()
        fsdp2_cache.get("train", parts(), job)
        fsdp2_cache.get("train", parts(), job)
        assert job.calls == 1
        test = root / "harness" / "tests" / "test_fsdp2_cache.py"
        test.write_bytes(test.read_bytes() + b"\n")
        fsdp2_cache.environment.cache_clear()
        fsdp2_cache.get("train", parts(), job)
        assert job.calls == 1, "a changed harness test changed the key"
        jobs = root / "harness" / "tools" / "grading" / "jobs.py"
        jobs.write_bytes(jobs.read_bytes() + b"\n")
        fsdp2_cache.environment.cache_clear()
        fsdp2_cache.get("train", parts(), job)
        assert job.calls == 2, "a changed harness file did not change the key"
    finally:
        fsdp2_cache.environment.cache_clear()


def tamper_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def cut_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:30])


def foreign_secret(path: Path) -> None:
    (path.parent / "secret").unlink()  # the entries now belong to another secret


def drop_trace(path: Path) -> None:
    for blob in (path.parent / "blobs").iterdir():
        blob.unlink()


def replace_key(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"lr": 0.0003', b'"lr": 0.0004', 1))


@pytest.mark.parametrize("damage, message", [
    (tamper_payload, "does not match its digest"),
    (truncate, "does not match its digest"),
    (cut_header, "is not a whole entry"),
    (foreign_secret, "is not signed with this folder's secret"),
    (drop_trace, "is missing or damaged"),
    (replace_key, "was written for another key"),
])
def test_damaged_or_foreign_entries_are_recomputed(tmp_path, cache, capsys, damage, message):
    job = Job()
    outputs = {"traces": tmp_path / "t"}
    fsdp2_cache.get("train", parts(), lambda: job(tmp_path / "t"), outputs)
    damage(entry(cache))
    value = fsdp2_cache.get("train", parts(), lambda: job(tmp_path / "t"), outputs)
    assert job.calls == 2, "a damaged or foreign entry was used"
    err = capsys.readouterr().err
    assert "FSDP2 cache: the train entry" in err and message in err and "recomputing" in err, err
    assert value[0]["losses"] == [1.5, 2.25]
    fsdp2_cache.get("train", parts(), lambda: job(tmp_path / "t"), outputs)
    assert job.calls == 2, "the recomputed entry was not stored in place of the damaged one"


def test_a_secret_others_can_read_is_replaced(cache, capsys):
    job = Job()
    fsdp2_cache.get("train", parts(), job)
    (cache / "secret").chmod(0o644)
    fsdp2_cache.get("train", parts(), job)
    assert job.calls == 2 and "is not a private 32-byte secret" in capsys.readouterr().err
    assert (cache / "secret").stat().st_mode & 0o777 == 0o600


def test_off_never_reads_or_writes(cache, monkeypatch):
    job = Job()
    fsdp2_cache.get("train", parts(), job)
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    monkeypatch.setenv("FSDP2_CACHE", "off")
    fsdp2_cache.get("train", parts(), job)
    fsdp2_cache.get("train", parts(lr=1e-3), job)
    assert job.calls == 3
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before


def test_off_makes_no_folder(cache, monkeypatch):
    monkeypatch.setenv("FSDP2_CACHE", "off")
    fsdp2_cache.get("train", parts(), Job())
    assert not cache.exists()


def test_refresh_recomputes_and_stores(monkeypatch):
    job = Job()
    fsdp2_cache.get("train", parts(), job)
    monkeypatch.setenv("FSDP2_CACHE", "refresh")
    fsdp2_cache.get("train", parts(), job)
    monkeypatch.setenv("FSDP2_CACHE", "on")
    fsdp2_cache.get("train", parts(), job)
    assert job.calls == 2


def test_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv("FSDP2_CACHE", "sometimes")
    with pytest.raises(ValueError, match="FSDP2_CACHE='sometimes' is not one of on, off, refresh"):
        fsdp2_cache.get("train", parts(), Job())


# --------------------------------------------------------------------------- FSDP2 itself, on ranks


@pytest.fixture
def computed(monkeypatch) -> list[str]:
    """The kinds of FSDP2 run the checks actually trained (a hit adds nothing)."""
    calls: list[str] = []
    real = fsdp2_cache.get

    def get(kind, parts, compute, outputs=None):
        return real(kind, parts, lambda: calls.append(kind) or compute(), outputs)

    monkeypatch.setattr(fsdp2_cache, "get", get)
    return calls


def three_ways(monkeypatch, computed: list[str], fn):
    """fn() with the cache off, then cold (computes), then warm (must not)."""
    monkeypatch.setenv("FSDP2_CACHE", "off")
    off = fn()
    monkeypatch.setenv("FSDP2_CACHE", "on")
    cold = fn()
    assert len(computed) == 2, computed
    warm = fn()
    assert len(computed) == 2, f"a warm cache trained FSDP2 again: {computed}"
    return off, cold, warm


def same_runs(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        if x.result is not None:
            assert (x.result.losses, x.result.grad_norms) == (y.result.losses, y.result.grad_norms)
        assert (x.digests, x.problems, x.comm.events, x.uses_fsdp2, x.forward_loss) == \
            (y.digests, y.problems, y.comm.events, y.uses_fsdp2, y.forward_loss)


def test_train_and_forward_equal_fresh_runs(pool2, monkeypatch, computed):
    cfg = as_fsdp2(config("x", num_steps=2, param_dtype="bfloat16", reduce_dtype="float32"))
    for job in (train_job, forward_job):
        computed.clear()
        off, cold, warm = three_ways(monkeypatch, computed, lambda: checks.run_fsdp2(pool2, job, cfg))
        same_runs(off, cold)
        same_runs(cold, warm)
        assert off[0].comm.events, "nothing was compared"


def test_odd_shapes_equal_fresh_runs(pool2, monkeypatch, computed):
    off, cold, warm = three_ways(monkeypatch, computed, lambda: checks.run_fsdp2(pool2, odd_shapes_job, None))
    for a, b in ((off, cold), (cold, warm)):
        assert [{k: [t.tolist() for t in v] for k, v in r.items()} for r in a] == \
            [{k: [t.tolist() for t in v] for k, v in r.items()} for r in b]


def test_memory_equals_a_fresh_pool(pool2, monkeypatch, computed):
    cfg = as_fsdp2(config("x", num_steps=3))
    off, cold, warm = three_ways(monkeypatch, computed, lambda: checks.run_fsdp2(pool2, memory_job, cfg, fresh=True))
    assert cold == warm
    # What check_memory compares: the least peak of some steps from 2 on, which may differ between fresh pools by
    # a buffer gloo's thread is still releasing in every step compared (LATE_BUFFERS, policy.py; seen
    # on a loaded machine, 0.5 MiB over 2 steps), and the live tensors and block sizes, to the byte.
    for a, b in zip(off, cold):
        assert abs(min(a.peaks[1:]) - min(b.peaks[1:])) <= LATE_BUFFERS * a.block_largest, (a.peaks, b.peaks)
        assert (a.live[1:], a.block_reduce, a.block_largest) == (b.live[1:], b.block_reduce, b.block_largest)


def test_profiled_run_restores_its_traces(pool2, monkeypatch, computed, tmp_path):
    runs = iter(range(3))

    def profiled():
        folder = tmp_path / f"run{next(runs)}" / "traces"
        cfg = as_fsdp2(config("x", num_steps=3, profile_steps=2, profile_memory=False, traces_dir=folder))
        return folder, checks.run_fsdp2(pool2, train_job, cfg, False), analyze_run(folder)

    (_, off, off_stats), (cold_dir, cold, cold_stats), (warm_dir, warm, warm_stats) = \
        three_ways(monkeypatch, computed, profiled)
    same_runs(off, cold)
    same_runs(cold, warm)
    assert sorted(p.name for p in warm_dir.iterdir()) == ["rank0.json", "rank1.json"]
    for p in cold_dir.iterdir():
        assert (warm_dir / p.name).read_bytes() == p.read_bytes()
    assert warm_stats == cold_stats, "the restored traces analyse differently"
    assert [r.result.trace_path for r in warm] == [warm_dir / f"rank{r}.json" for r in range(2)]
    # A fresh run's schedule (what the overlap checks judge) is the cached one's; its times are its own.
    for kind in ("all_gather", "reduce_scatter"):
        assert off_stats.comm.kind(kind).count_by_phase == cold_stats.comm.kind(kind).count_by_phase
    key = lambda s: [(x.rank, x.step, x.kind, x.phase, x.group, x.overlapped) for x in s.scheduled]
    assert key(off_stats) == key(cold_stats) and off_stats.scheduled


def test_profiled_run_keeps_its_analysis(pool2, monkeypatch, computed, tmp_path):
    """run_profiled's FSDP2 side (analysed=True): the RunStats stored with the run are what the
    restored traces analyse to, and a hit analyses no trace again."""
    runs = iter(range(4))

    def profiled():
        folder = tmp_path / f"run{next(runs)}" / "traces"
        cfg = as_fsdp2(config("x", num_steps=3, profile_steps=2, profile_memory=False, traces_dir=folder))
        got, stats = checks.run_fsdp2(pool2, train_job, cfg, False, analysed=True)
        return folder, got, stats

    (_, off, off_stats), (_, cold, cold_stats), (warm_dir, warm, warm_stats) = \
        three_ways(monkeypatch, computed, profiled)
    same_runs(cold, warm)
    assert warm_stats == cold_stats == analyze_run(warm_dir), "the stored analysis is not the traces'"
    assert off_stats.scheduled and len(off_stats.scheduled) == len(cold_stats.scheduled)

    def analyse_again(*args, **kwargs):
        raise AssertionError("a stored run's traces were analysed again")

    monkeypatch.setattr(checks, "analyze_run", analyse_again)
    _, again, again_stats = profiled()
    assert again_stats == cold_stats and len(computed) == 2


class Forged:
    """What a forged entry could hold to run code in the grader when unpickled."""

    def __reduce__(self):
        import os
        return (os.system, ("touch forged-entry-ran",))


def test_a_signed_entry_runs_nothing_when_unpickled(cache, capsys, monkeypatch, tmp_path):
    """The secret is a file that code of the same user can read: an entry signed with it must still
    hold only what FSDP2's results are made of; anything else is refused and recomputed, never run."""
    import hashlib
    import hmac
    import pickle

    monkeypatch.chdir(tmp_path)
    job = Job()
    fsdp2_cache.get("train", parts(), job)
    path, secret = entry(cache), (cache / "secret").read_bytes()
    key = path.read_bytes()[len(fsdp2_cache.FORMAT):].split(b"\n", 2)[1]
    payload = pickle.dumps({"value": Forged(), "files": {}, "roots": {}})
    body = key + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    path.write_bytes(fsdp2_cache.FORMAT + hmac.new(secret, body, "sha256").hexdigest().encode() + b"\n" + body)
    value = fsdp2_cache.get("train", parts(), job)
    assert not (tmp_path / "forged-entry-ran").exists(), "a signed entry ran code when unpickled"
    assert job.calls == 2 and value[0]["losses"] == [1.5, 2.25]
    assert "posix.system is not part of an FSDP2 result" in capsys.readouterr().err


def test_a_store_that_fails_costs_only_the_store(cache, capsys, monkeypatch):
    """A full or read-only disk: the check that asked still gets FSDP2's result."""
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsdp2_cache, "_write_atomic", full)
    job = Job()
    assert fsdp2_cache.get("train", parts(), job)[0]["losses"] == [1.5, 2.25]
    assert "could not store the train entry" in capsys.readouterr().err and not list(cache.glob("*.entry"))


def test_what_is_stored_is_trained_on_fresh_ranks(pool2, monkeypatch, computed):
    """A stored FSDP2 result serves every later submission, so it never comes from ranks a file under
    test ran in (the pool the checks share): the pool given is not used to compute it."""
    def tainted(*args, **kwargs):
        raise AssertionError("FSDP2's stored run was trained in the shared pool")

    monkeypatch.setattr(pool2, "run", tainted)
    runs = checks.run_fsdp2(pool2, forward_job, as_fsdp2(config("x", num_steps=1)))
    assert computed == ["forward"] and runs[0].forward_loss > 0

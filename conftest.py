"""Shared pytest set-up: which file effdl (the FSDP under test) imports, the spawned rank pools, and the
handout's points table at the end of every run of test.py."""

from __future__ import annotations

import json
import sys

import pytest

def pytest_addoption(parser):
    parser.addoption(
        "--impl", default="student",
        help="the FSDP under test (effdl): student (fsdp.py, the default) or the path of a .py file",
    )
    parser.addoption("--points-json", default=None, metavar="FILE",
                     help="also write the points table of test.py as JSON to FILE")
    parser.addoption("--artifacts", default=None, metavar="DIR",
                     help="keep tasks 2 and 3's profiled traces in DIR/profiles and each memory check's peaks in "
                          "DIR/memory.json, and draw DIR/overlap.png and DIR/memory.png at the end")
    parser.addoption("--fsdp2-cache", choices=("on", "off", "refresh"), default=None,
                     help="FSDP2's side of each check from harness/tools/grading/fsdp2_cache.py: on (the default, or "
                          "the FSDP2_CACHE environment variable), off (always train FSDP2), refresh (train and store)")


def pytest_configure(config):
    import os

    from harness.tools.submissions.points import MARKERS

    if cache := config.getoption("--fsdp2-cache"):
        os.environ["FSDP2_CACHE"] = cache  # read where FSDP2's results are looked up, in this process

    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line("markers", "cuda: needs CUDA GPUs (NCCL); skipped with the reason where too few")
    config._points = {}  # test function -> {nodeid: (outcome, text)}: passed + evidence, skipped + reason,
    # failed + its first line
    config._cases = {}  # test function -> every collected case of test.py, selected or not
    config._details = {}  # nodeid of a failed case -> its report (the rank's traceback), for the points JSON


def pytest_collection(session):
    """Start the CPU ranks' forkserver, which imports torch, train.py and torchtitan, while pytest
    collects (a few seconds off the first test; a session without CPU ranks pays it in the
    background). Under pytest's capture: the ranks inherit its output, so what a rank prints shows
    with the test that ran it."""
    if session.config.option.collectonly:
        return
    from harness.tools.grading.ranks import start_forkserver

    capture = session.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.resume_global_capture()
    try:
        start_forkserver()
    finally:
        if capture is not None:
            capture.suspend_global_capture()


def _collected(config, items) -> None:
    for item in items:
        if item.module.__name__ == "test":
            config._cases.setdefault(getattr(item, "originalname", item.name), set()).add(item.nodeid)


def pytest_deselected(items):
    if items:
        _collected(items[0].config, items)


def pytest_collection_finish(session):
    _collected(session.config, session.items)


def pytest_report_header(config):
    from harness import impl
    from harness.errors import ConfigError

    try:
        path = impl.impl_path(config.getoption("--impl"))
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    return f"effdl (the FSDP under test): {path}"


def pytest_sessionstart(session):
    """--artifacts: clear what an earlier session left in the folder, and record every memory check's peaks."""
    if (folder := session.config.getoption("--artifacts")) is None or session.config.option.collectonly:
        return
    from pathlib import Path

    from harness.tools.grading import checks
    from harness.tools.traces import pictures

    folder = Path(folder).resolve()
    pictures.clear_artifacts(folder)

    def seen(case, runs, judged):
        effdl = runs.get("effdl")
        try:
            pictures.record_memory(folder, case, [m.peaks for m in runs["FSDP2"]], effdl and [m.peaks for m in effdl],
                                   checks.allowance(runs["FSDP2"][0]), judged)
        except Exception as e:  # a picture never costs a graded check; pictures.txt says it is missing
            print(f"--artifacts: could not record {case}'s peaks: {type(e).__name__}: {e}", file=sys.stderr)
    checks.memory_seen = seen


def pytest_sessionfinish(session):
    """--artifacts: draw overlap.png and memory.png (or say in pictures.txt why not)."""
    config = session.config
    if (folder := config.getoption("--artifacts")) is None or config.option.collectonly:
        return
    from pathlib import Path

    from harness.tools.grading import checks
    from harness.tools.traces import pictures

    checks.memory_seen = None
    # Why effdl's profiled run left no trace, if tasks 2 and 3 failed in their fixture.
    pictures.draw_artifacts(Path(folder), config.getoption("--impl"),
                            pictures.failure_reason(getattr(config, "_profiles_failed", "")))


@pytest.fixture(scope="session")
def artifacts(request):
    """--artifacts DIR as a Path, or None."""
    from pathlib import Path

    folder = request.config.getoption("--artifacts")
    return Path(folder).resolve() if folder else None


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--impl")


@pytest.fixture
def evidence(request):
    """evidence(text): one line of what a passing test measured, for the points table."""
    return lambda text: request.node.user_properties.append(("evidence", text))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if item.module.__name__ == "test" and (report.when == "call" or report.failed or report.skipped):
        name = getattr(item, "originalname", item.name)
        if report.passed:
            outcome = ("passed", next((v for k, v in item.user_properties if k == "evidence"), ""))
        elif report.skipped:  # pytest.skip in the body or a fixture, or a skip mark: not a failure
            outcome = ("skipped", _skip_reason(report))
        else:
            outcome = ("failed", _todo(call) or _first_line(report))
            item.config._details[item.nodeid] = _details(report)
            if name in ("test_task2", "test_task3"):  # --artifacts: why overlap.png may lack a panel
                item.config._profiles_failed = report.longreprtext
        item.config._points.setdefault(name, {})[item.nodeid] = outcome
    return report


def _todo(call) -> str | None:
    """Where a file under test stopped at one of the skeleton's TODOs (a rank's traceback holds
    it, deep under the error's first line), so the points table names what is left to write."""
    from harness.impl import todo_reached

    todo = todo_reached(call.excinfo.value) if call.excinfo is not None else None
    return f"stopped at {todo}"[:160] if todo else None


DETAILS = 12_000
"""characters of a failed case's report kept for the points JSON (its end: the rank's traceback)"""


def _details(report) -> str:
    """A failed case's whole report (the failing rank's traceback within it), its last DETAILS characters:
    what a student on Gradescope reads under the line's one-line evidence."""
    text = report.longreprtext.strip()
    return text if len(text) <= DETAILS else "[...]\n" + text[-DETAILS:]


def _first_line(report) -> str:
    exc = getattr(report.longrepr, "reprcrash", None)
    text = exc.message if exc is not None else str(report.longrepr)
    for line in text.splitlines():
        if line.strip():
            return line.strip().removeprefix("AssertionError: ")[:160]
    return "failed"


def _skip_reason(report) -> str:
    """A skip's reason as text: pytest keeps it as (path, line, "Skipped: reason")."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.strip().removeprefix("Skipped: ")[:160] or "skipped"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from harness.tools.submissions import points

    if not config._points:
        return
    rows = points.table(config._points, config._cases, config._details)
    terminalreporter.section("points")
    for line in points.render(rows):
        terminalreporter.write_line(line)
    if path := config.getoption("--points-json"):
        with open(path, "w") as f:
            json.dump({"impl": config.getoption("--impl"), "rows": rows}, f, indent=1)


def _pool(world_size: int):
    """One world size's trusted (FSDP2) and sandboxed (the file under test) pools, each started when
    first used (with FSDP2's side stored, the trusted one often never is)."""
    from harness.tools.grading.ranks import Ranks

    with Ranks(world_size, device="cpu") as ranks:
        yield ranks


@pytest.fixture(scope="module")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool3():
    yield from _pool(3)


@pytest.fixture(scope="module")
def pool4():
    """Bonus 4's (HSDP on a 2 x 2 mesh): one pool of 4 ranks for all its cases."""
    yield from _pool(4)

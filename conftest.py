"""Shared pytest set-up: which hand-written FSDP is under test, and the spawned rank pools."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--impl", default="student",
        help="hand-written FSDP under test: student (fsdp.py, the default) or the path of a .py file",
    )


def pytest_report_header(config):
    from harness import impl
    from harness.errors import ConfigError

    try:
        path = impl.impl_path(config.getoption("--impl"))
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    return f"hand-written FSDP under test: {path}"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs CUDA GPUs (NCCL); skipped with the reason where too few")


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--impl")


def _pool(world_size: int):
    from harness.ranks import RankPool

    pool = RankPool(world_size, device="cpu")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool3():
    yield from _pool(3)

"""Shared pytest set-up: which hand-written FSDP is under test, and the spawned rank pools."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--impl", default=None,
        help="hand-written FSDP under test: student (fsdp.py), solution (solution/fsdp.py) or a .py path; "
             "default: solution when solution/ exists, else student",
    )


def impl_under_test(config) -> str:
    import train

    return config.getoption("--impl") or train.default_impl()


def pytest_report_header(config):
    import train

    impl = impl_under_test(config)
    try:
        path = train.impl_path(impl)
    except train.ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    return f"hand-written FSDP under test: {impl} ({path})"


@pytest.fixture(scope="session")
def impl(request) -> str:
    return impl_under_test(request.config)


def _pool(world_size: int):
    from ranks import RankPool

    pool = RankPool(world_size, device="cpu")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def pool2():
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool3():
    yield from _pool(3)

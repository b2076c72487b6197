"""Shared fixtures: replay implementations, paths to shared data."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

from bearsdk.replay import IMPLEMENTATION, implementations

if TYPE_CHECKING:
    from bearsdk.cluster.local import LocalRedis

# `HYPOTHESIS_PROFILE=soak pytest tests/test_replay_property.py` searches much
# longer than CI does (run it after touching the replay loop).
settings.register_profile(
    "soak", max_examples=20_000, deadline=None, suppress_health_check=list(HealthCheck)
)
# CI replays the same examples on every run (a red build is then reproducible);
# local runs explore new ones, and the soak profile explores many more.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "default")
)

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("BEARSDK_SHARED", REPO.parent / "shared"))

IMPLS = sorted(implementations())


def pytest_report_header(config: pytest.Config) -> str:
    return f"bearsdk replay implementations: {', '.join(IMPLS)} (default {IMPLEMENTATION})"


def pytest_sessionstart(session: pytest.Session) -> None:
    # CI must exercise the compiled loop: a silent fallback to the twin would
    # make every "both implementations" test test one of them twice.
    no_ext = os.environ.get("BEARSDK_NO_EXTENSIONS", "").lower() not in ("", "0", "false", "no")
    if os.environ.get("CI") == "true" and not no_ext and "cython" not in IMPLS:
        raise pytest.UsageError(
            "CI=true but the compiled replay (bearsdk.replay._replay_c) is not built"
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-impl",
        action="append",
        default=[],
        metavar="NAME",
        help="deselect the tests run once per replay implementation for NAME (CI's "
        "pure-Python pass: the compiled pass ran them already, with the same examples)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = set(config.getoption("--skip-impl"))
    if not skip:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        (dropped if spec is not None and spec.params.get("impl") in skip else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    """Each available replay implementation in turn."""
    return str(request.param)


def _redis_unavailable(why: str) -> None:
    # CI installs and starts redis-server (.ci/run): there a missing server is a failure.
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, but {why}")
    pytest.skip(why)


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    """A redis-server of the test's own on a free loopback port, in a temp dir; killed after.

    Skips (outside CI only) when redis-py or the redis-server binary is missing.
    """
    from bearsdk.cluster.local import LocalRedis, LocalRedisError

    try:
        import redis  # noqa: F401
    except ImportError:
        _redis_unavailable("redis-py is not installed (pip install -e '.[redis]')")
    try:
        server = LocalRedis().start()
    except LocalRedisError as exc:
        _redis_unavailable(f"redis-server cannot be started: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A Redis server's URL for tests that only read and write (use a key prefix of your own).

    CI starts one server for all of them (``BEARSDK_TEST_REDIS_URL``, .ci/run);
    elsewhere the test gets its own (:func:`redis_server`).
    """
    url = os.environ.get("BEARSDK_TEST_REDIS_URL")
    if url:
        yield url
    else:
        server: LocalRedis = request.getfixturevalue("redis_server")
        yield server.url

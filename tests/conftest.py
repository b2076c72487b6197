"""Shared fixtures: replay implementations, paths to shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from bearsdk.replay import IMPLEMENTATION, implementations

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


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    """Each available replay implementation in turn."""
    return str(request.param)

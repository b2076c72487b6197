"""The Redis bus lives in bearsdk.cluster; its old homes keep working (issue 18)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import bearsdk.cluster as cluster
import bearsdk.io as io


def test_bearsdk_io_loads_no_redis_code() -> None:
    code = (
        "import sys, bearsdk.io\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('bearsdk.cluster') "
        "or m == 'bearsdk.io.redis' or m.split('.')[0] == 'redis')\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "name",
    ["EVENT_KINDS", "BusStats", "DispatchEvent", "RedisBus", "RedisSnapshotBridge", "RedisSource"],
)
def test_bearsdk_io_re_exports_the_cluster_names(name: str) -> None:
    assert getattr(io, name) is getattr(cluster, name)
    assert name in io.__all__
    assert name in dir(io)


def test_bearsdk_io_still_refuses_unknown_names() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = io.no_such_name  # type: ignore[attr-defined]


def test_the_old_module_is_a_warning_shim() -> None:
    sys.modules.pop("bearsdk.io.redis", None)
    with pytest.warns(DeprecationWarning, match=r"bearsdk\.io\.redis moved to bearsdk\.cluster"):
        old = importlib.import_module("bearsdk.io.redis")
    from bearsdk.cluster import bus, redis_source, wire

    assert old.RedisBus is bus.RedisBus
    assert old.RedisSource is redis_source.RedisSource
    assert old.RedisSnapshotBridge is redis_source.RedisSnapshotBridge
    assert old.DispatchEvent is wire.DispatchEvent
    assert old.key_name is wire.key_name
    assert old.redact_url is wire.redact_url
    for name in old.__all__:
        assert hasattr(old, name)

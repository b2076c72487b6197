"""I/O edges: where snapshots enter the router (and leave an engine).

Router side, one source per instance, each an anyio task feeding that
instance's :class:`~bearsdk.state.SnapshotCache` (:class:`SnapshotSource`):

* :class:`PollSource`: ``GET /bear/snapshot`` at an interval;
* :class:`PushSource`: the ``GET /bear/snapshots`` NDJSON stream;
* :class:`ShmSource`: the shared-memory seqlock segment (same host);
* :class:`MetricsSource`: unmodified vLLM, ``/metrics`` into a
  :class:`~bearsdk.state.ShadowView`;
* :class:`~bearsdk.cluster.RedisSource`: the Redis bus router replicas share
  (``redis`` extra), fed by a :class:`~bearsdk.cluster.RedisSnapshotBridge`.
  It is scale-out code and lives in :mod:`bearsdk.cluster`; its names are
  re-exported here, loaded on first use (PEP 562), so importing this package
  loads no Redis code.

Engine side: :class:`SnapshotPublisher` (the HTTP endpoints) and
:class:`ShmWriter`. Transports are specified in ``docs/protocol.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bearsdk.io.base import Backoff, SnapshotSource, SourceStats
from bearsdk.io.http import PollSource, PushSource
from bearsdk.io.metrics import EngineMetrics, MetricsSource, parse_vllm_metrics
from bearsdk.io.publish import SnapshotPublisher, empty_snapshot
from bearsdk.io.shm import (
    ReadResult,
    ShmError,
    ShmReader,
    ShmSource,
    ShmWriter,
    segment_path,
)

if TYPE_CHECKING:
    from bearsdk.cluster.bus import BusStats, RedisBus
    from bearsdk.cluster.redis_source import RedisSnapshotBridge, RedisSource
    from bearsdk.cluster.wire import EVENT_KINDS, DispatchEvent

__all__ = [
    "EVENT_KINDS",
    "Backoff",
    "BusStats",
    "DispatchEvent",
    "EngineMetrics",
    "MetricsSource",
    "PollSource",
    "PushSource",
    "ReadResult",
    "RedisBus",
    "RedisSnapshotBridge",
    "RedisSource",
    "ShmError",
    "ShmReader",
    "ShmSource",
    "ShmWriter",
    "SnapshotPublisher",
    "SnapshotSource",
    "SourceStats",
    "empty_snapshot",
    "parse_vllm_metrics",
    "segment_path",
]

# The cluster package depends on this one (sources, backoff), never the
# reverse at import time: these names load their module on first access.
_CLUSTER: dict[str, str] = {
    "EVENT_KINDS": "bearsdk.cluster.wire",
    "BusStats": "bearsdk.cluster.bus",
    "DispatchEvent": "bearsdk.cluster.wire",
    "RedisBus": "bearsdk.cluster.bus",
    "RedisSnapshotBridge": "bearsdk.cluster.redis_source",
    "RedisSource": "bearsdk.cluster.redis_source",
}


def __getattr__(name: str) -> Any:
    home = _CLUSTER.get(name)
    if home is None:
        raise AttributeError(f"module 'bearsdk.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

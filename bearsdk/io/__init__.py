"""I/O edges: where snapshots enter the router (and leave an engine).

Router side, one source per instance, each an anyio task feeding that
instance's :class:`~bearsdk.state.SnapshotCache` (:class:`SnapshotSource`):

* :class:`PollSource`: ``GET /bear/snapshot`` at an interval;
* :class:`PushSource`: the ``GET /bear/snapshots`` NDJSON stream;
* :class:`ShmSource`: the shared-memory seqlock segment (same host);
* :class:`MetricsSource`: unmodified vLLM, ``/metrics`` into a
  :class:`~bearsdk.state.ShadowView`;
* :class:`RedisSource`: the Redis bus router replicas share (``redis`` extra),
  fed by a :class:`RedisSnapshotBridge`.

Engine side: :class:`SnapshotPublisher` (the HTTP endpoints) and
:class:`ShmWriter`. Transports are specified in ``docs/protocol.md``.
"""

from bearsdk.io.base import Backoff, SnapshotSource, SourceStats
from bearsdk.io.http import PollSource, PushSource
from bearsdk.io.metrics import EngineMetrics, MetricsSource, parse_vllm_metrics
from bearsdk.io.publish import SnapshotPublisher, empty_snapshot
from bearsdk.io.redis import (
    EVENT_KINDS,
    BusStats,
    DispatchEvent,
    RedisBus,
    RedisSnapshotBridge,
    RedisSource,
)
from bearsdk.io.shm import (
    ReadResult,
    ShmError,
    ShmReader,
    ShmSource,
    ShmWriter,
    segment_path,
)

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

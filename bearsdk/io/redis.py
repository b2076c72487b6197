"""Former home of the Redis bus, now in :mod:`bearsdk.cluster` (importing this warns).

The bus is scale-out code, not one of the generic I/O edges: it lives in
:mod:`bearsdk.cluster.bus` (:class:`RedisBus`), :mod:`bearsdk.cluster.redis_source`
(:class:`RedisSource`, :class:`RedisSnapshotBridge`) and
:mod:`bearsdk.cluster.wire` (:class:`DispatchEvent`, key names). Every name this
module had is re-exported here for one release; import them from
:mod:`bearsdk.cluster` instead.
"""

from __future__ import annotations

import warnings

from bearsdk.cluster.bus import BusStats, EventCallback, RedisBus, SnapshotCallback
from bearsdk.cluster.redis_source import RedisSnapshotBridge, RedisSource
from bearsdk.cluster.wire import (
    EVENT_KINDS,
    MAX_EVENT_BYTES,
    MAX_NAME,
    MAX_TOKENS,
    DispatchEvent,
    key_name,
    redact_url,
)

__all__ = [
    "EVENT_KINDS",
    "MAX_EVENT_BYTES",
    "MAX_NAME",
    "MAX_TOKENS",
    "BusStats",
    "DispatchEvent",
    "EventCallback",
    "RedisBus",
    "RedisSnapshotBridge",
    "RedisSource",
    "SnapshotCallback",
    "key_name",
    "redact_url",
]

warnings.warn(
    "bearsdk.io.redis moved to bearsdk.cluster (RedisBus, RedisSource, RedisSnapshotBridge, "
    "DispatchEvent); import them from there",
    DeprecationWarning,
    stacklevel=2,
)

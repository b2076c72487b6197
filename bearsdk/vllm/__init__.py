"""Snapshot publisher for real vLLM servers: the ``--scheduler-cls`` plugin.

An optional extra: :mod:`bearsdk.vllm.scheduler` imports vLLM (0.33), and no
other part of bearsdk imports this package. Launch vLLM with::

    BEARSDK_PUBLISH_SHM=1 BEARSDK_PUBLISH_HTTP=0.0.0.0:8100 \\
        vllm serve MODEL --scheduler-cls bearsdk.vllm.BearScheduler

and every engine step publishes a ``bear.snapshot/1`` of the resident requests
(and a ``bear.batch/1`` record of each executed batch) to the shared-memory
segment and the HTTP endpoints of ``docs/protocol.md``. ``docs/vllm-plugin.md``
has the details.

The scheduler classes load vLLM on first access; the rest (configuration,
publisher, transports) works without it.
"""

from __future__ import annotations

from typing import Any

from bearsdk.vllm.config import PublisherConfig, PublisherConfigError
from bearsdk.vllm.publisher import IMPLEMENTATION, Publisher, PublisherStats, implementations
from bearsdk.vllm.transports import (
    BatchTuple,
    FileTransport,
    RecordingTransport,
    ShmTransport,
    Transport,
    batch_record,
)

__all__ = [
    "IMPLEMENTATION",
    "BatchTuple",
    "BearAsyncScheduler",
    "BearScheduler",
    "BearSyncScheduler",
    "FileTransport",
    "Publisher",
    "PublisherConfig",
    "PublisherConfigError",
    "PublisherStats",
    "RecordingTransport",
    "ShmTransport",
    "Transport",
    "batch_record",
    "implementations",
    "publisher_of",
]

_SCHEDULER_NAMES = frozenset(
    {"BearAsyncScheduler", "BearScheduler", "BearSyncScheduler", "publisher_of"}
)


def __getattr__(name: str) -> Any:
    # vLLM is imported only when a scheduler class is asked for (vLLM resolves
    # --scheduler-cls bearsdk.vllm.BearScheduler through this).
    if name in _SCHEDULER_NAMES:
        from bearsdk.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

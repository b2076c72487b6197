"""Router-side state per instance: the snapshot cache and staleness handling.

* :class:`SnapshotCache`: the latest valid snapshot, prepared for replay,
  swapped atomically; rejections counted and logged.
* :class:`InstanceState`: TTFT estimates from the cache, with the dispatch
  overlay, fast-forward of stale snapshots and the fallback estimator
  (:class:`StalenessRules`).
* :class:`ShadowView`: a synthesized snapshot for unmodified vLLM, from the
  router's own requests reconciled with ``/metrics``.

The I/O edges feeding the caches are in :mod:`bearsdk.io`.
"""

from bearsdk.state.cache import CachedSnapshot, CacheStats, Outcome, Reject, SnapshotCache
from bearsdk.state.fastforward import FastForward
from bearsdk.state.instance import Estimate, InstanceState, StalenessPolicy, StalenessRules
from bearsdk.state.overlay import Dispatch, DispatchOverlay
from bearsdk.state.shadow import ShadowView

__all__ = [
    "CacheStats",
    "CachedSnapshot",
    "Dispatch",
    "DispatchOverlay",
    "Estimate",
    "FastForward",
    "InstanceState",
    "Outcome",
    "Reject",
    "ShadowView",
    "SnapshotCache",
    "StalenessPolicy",
    "StalenessRules",
]

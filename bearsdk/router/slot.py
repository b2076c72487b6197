"""What the router keeps per instance, and what it reads off it to price a request.

An :class:`InstanceSlot` holds one instance's configuration, snapshot cache,
state, statistics, breaker and learned corrections (its first-token
overhead and margin, speed, KV-event index); :class:`~bearsdk.router.core.RouterCore`
keeps one per instance of its pool.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import attrs

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.registry import InstanceEstimator
from bearsdk.estimators.stats import InstanceStats
from bearsdk.prompts.approx import BLOCK_CHARS, DispatchIndex
from bearsdk.router.breaker import CircuitBreaker
from bearsdk.router.config import InstanceConfig
from bearsdk.router.margin import MarginTracker
from bearsdk.schedulers.spec import BoundScheduler
from bearsdk.snapshot import Snapshot
from bearsdk.state import InstanceState, ShadowView, SnapshotCache
from bearsdk.state.speed import SpeedTracker

if TYPE_CHECKING:
    from bearsdk.kvevents.index import PrefixIndex

__all__ = [
    "OVERHEAD_MAX_S",
    "OVERHEAD_MEMORY_S",
    "InstanceSlot",
    "block_size",
    "cached_tokens",
    "dispatch_index",
    "first_token_overhead",
]

OVERHEAD_MAX_S: Final = 0.25
"""Largest first-token overhead the router learns (seconds)."""

OVERHEAD_MEMORY_S: Final = 60.0
"""Time constant over which an unobserved overhead fades to 0 (seconds).

An overhead learned from a few unlucky first tokens makes every prediction for
that instance miss, the router stops choosing it, and no first token would ever
correct it (issue 17's lock-out): so what is not confirmed fades, and after this
long without a first token the residuals start over."""


@attrs.define
class InstanceSlot:
    """Everything the router keeps for one instance of its pool."""

    config: InstanceConfig
    model_index: int
    batch_time: BatchTimeModel
    scheduler: BoundScheduler
    cache: SnapshotCache
    state: InstanceState
    stats: InstanceStats
    breaker: CircuitBreaker
    shadow: ShadowView | None = None
    draining: bool = False
    inflight: int = 0
    ttft_abs_err_sum: float = 0.0
    ttft_rel_err_sum: float = 0.0
    ttft_err_n: int = 0
    # What the replay cannot see: the HTTP round trip to the engine, its request
    # handling and token delivery. Learned from observed minus predicted TTFT.
    overhead_s: float = 0.0
    residuals: deque[float] = attrs.Factory(lambda: deque(maxlen=64))
    # The first tokens the residuals came from: no fixed overhead exceeds the
    # fastest of them.
    observed_ttfts: deque[float] = attrs.Factory(lambda: deque(maxlen=64))
    overhead_at: float = -math.inf
    # How much later than predicted its first tokens come, at a quantile.
    margin: MarginTracker | None = None
    # One per estimator name a selector asked for, built on first use.
    estimators: dict[str, InstanceEstimator] = attrs.Factory(dict)
    # Its cached blocks from its KV events (InstanceConfig.kv_events; the runtime feeds it).
    kv_index: PrefixIndex | None = None
    # What the router sent here, by character blocks (RouterCore(dispatch_prefixes=True)).
    dispatches: DispatchIndex | None = None
    # The TPOT targets of the requests sent here and not finished (by request id):
    # the residents an admission must not push past theirs (issue 21).
    tpot_targets: dict[str, float] = attrs.Factory(dict)
    # The instance's real speed against its base coefficients, from its snapshots.
    speed: SpeedTracker | None = None
    speed_anchor: Snapshot | None = None

    @property
    def name(self) -> str:
        """The instance's name."""
        return self.config.name


def first_token_overhead(s: InstanceSlot, now: float) -> float:
    """The overhead learned at ``s``, faded by the time since a first token confirmed it."""
    o = s.overhead_s
    if o <= 0.0:
        return 0.0
    idle = now - s.overhead_at
    return o if idle <= 0.0 else o * math.exp(-idle / OVERHEAD_MEMORY_S)


def cached_tokens(s: InstanceSlot, keys: Sequence[int], bs: int) -> tuple[int, str]:
    """The prompt tokens ``s`` last said it held and how it said it (its KV events,
    else its snapshot's block pool; ``-1``: unknown)."""
    if s.kv_index is not None:
        return s.kv_index.hit_blocks(keys) * bs, "events"
    entry = s.cache.entry
    if entry is None or entry.prepared is None or entry.snapshot.prefix_cache is None:
        return -1, ""
    return entry.prepared.cached_blocks(keys) * bs, "snapshot"


def dispatch_index(sched: BoundScheduler) -> DispatchIndex:
    """An LRU model of the instance's cache: its KV capacity in character blocks
    (about four characters a token; an unlimited pool: a million blocks)."""
    tokens = sched.num_blocks * sched.block_size if sched.num_blocks > 0 else 1 << 24
    return DispatchIndex(max(1, tokens * 4 // BLOCK_CHARS))


def block_size(s: InstanceSlot) -> int:
    """The block size the instance's snapshots count in (else its scheduler's)."""
    entry = s.cache.entry
    kv = None if entry is None else entry.snapshot.kv
    return s.scheduler.block_size if kv is None else kv.block_size

"""Scale-out: router replicas that share snapshots and dispatches over Redis (``redis`` extra).

::

    from bearsdk import BEAR, AsyncRouter
    from bearsdk.cluster import Cluster, PowerOfD

    cluster = Cluster.from_url("redis://10.0.0.9:6379/0")
    async with AsyncRouter("pool.toml", PowerOfD(BEAR()), cluster=cluster) as router:
        ...

* :class:`Cluster`: one replica's membership; the router runs its
  :class:`RedisBus` (:mod:`bearsdk.cluster.bus`), builds a
  :class:`RedisSource` (:mod:`bearsdk.cluster.redis_source`) (with the engine's push stream as
  fallback) for every instance configured with ``snapshots = "redis"``, and
  shares its dispatches (:class:`SharedOverlay`).
* :class:`PowerOfD`: any policy with ties among near-equal instances drawn at
  random, so that replicas do not herd.

Engines' snapshots reach Redis through a
:class:`RedisSnapshotBridge` (or an engine publishing itself); what travels on
the bus is in :mod:`bearsdk.cluster.wire`. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v
from bearsdk.cluster.bus import BusStats, RedisBus
from bearsdk.cluster.overlay import DispatchBus, OverlayStats, SharedOverlay
from bearsdk.cluster.redis_source import RedisSnapshotBridge, RedisSource
from bearsdk.cluster.tiebreak import PowerOfD
from bearsdk.cluster.wire import EVENT_KINDS, DispatchEvent
from bearsdk.io.base import SnapshotSource

if TYPE_CHECKING:
    from bearsdk.router.router import AsyncRouter

__all__ = [
    "EVENT_KINDS",
    "BusStats",
    "Cluster",
    "DispatchBus",
    "DispatchEvent",
    "OverlayStats",
    "PowerOfD",
    "RedisBus",
    "RedisSnapshotBridge",
    "RedisSource",
    "SharedOverlay",
]


@attrs.define
class Cluster:
    """One router replica's share of state with the others, over one Redis bus.

    Pass it to the router (``AsyncRouter(..., cluster=cluster)``): the router
    runs it in its task group before any snapshot source starts.

    Args:
        bus: This replica's bus, not yet running (the router runs it).
        share_dispatches: Publish this replica's dispatches and add the other
            replicas' to its view (:class:`SharedOverlay`).
        replica: This replica's id (unique among the replicas; default random).
        stale_after_s: :class:`RedisSource` argument: silence
            of an instance's snapshot stream that counts as a lost writer.
        recover_after_s: :class:`RedisSource` argument.
    """

    bus: RedisBus
    share_dispatches: bool = True
    replica: str = attrs.field(factory=lambda: secrets.token_hex(4))
    stale_after_s: float = attrs.field(default=1.0, validator=_v.positive)
    recover_after_s: float = attrs.field(default=0.5, validator=_v.positive)
    _overlay: SharedOverlay | None = attrs.field(init=False, default=None)
    _sources: dict[str, RedisSource] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.share_dispatches:
            self._overlay = SharedOverlay(self.bus, self.replica)

    @classmethod
    def from_url(cls, url: str, *, prefix: str = "bear", **kwargs: Any) -> Cluster:
        """A cluster on its own bus to ``url`` (further arguments: :class:`Cluster`'s)."""
        return cls(RedisBus(url, prefix=prefix), **kwargs)

    @property
    def overlay(self) -> SharedOverlay | None:
        """The shared overlay (``None`` when dispatches are not shared)."""
        return self._overlay

    @property
    def sources(self) -> dict[str, RedisSource]:
        """The Redis sources built so far, by instance (a copy)."""
        return dict(self._sources)

    def source(self, instance: str, fallback: SnapshotSource | None) -> RedisSource:
        """The snapshot source of ``instance`` (``snapshots = "redis"``)."""
        src = RedisSource(
            self.bus,
            instance,
            fallback,
            stale_after_s=self.stale_after_s,
            recover_after_s=self.recover_after_s,
        )
        self._sources[instance] = src
        return src

    async def run(
        self,
        router: AsyncRouter,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the bus and share ``router``'s dispatches until cancelled.

        Ready once the bus made its first connection attempt.
        """
        async with anyio.create_task_group() as tg:
            await tg.start(self.bus.run)
            if self._overlay is not None:
                self._overlay.attach(router)
            try:
                task_status.started()
                await anyio.sleep_forever()
            finally:
                if self._overlay is not None:
                    self._overlay.detach()

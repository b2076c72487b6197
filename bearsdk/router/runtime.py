"""The instance runtime: each instance's snapshot source and batch calibration, as tasks.

For every instance of a :class:`~bearsdk.router.core.RouterCore`'s pool the
runtime runs the snapshot source its ``snapshots`` setting names (a registered
kind, :mod:`bearsdk.router.sources`) and, with calibration on, follows the
engine's ``/bear/batches`` stream to keep its batch-time coefficients current.
Each instance's tasks live in one cancel scope inside the caller's task group,
started with ``tg.start`` (ready after the source's first attempt), so
removing an instance stops exactly its tasks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import aiohttp
import anyio
import anyio.abc
import attrs

from bearsdk.estimators.batch_time import BatchDataError, OnlineBatchTime, read_batches
from bearsdk.router.core import RouterCore
from bearsdk.router.slot import InstanceSlot
from bearsdk.router.sources import SourceContext, get_snapshot_source

if TYPE_CHECKING:
    from bearsdk.cluster import Cluster
    from bearsdk.io.base import SnapshotSource, SourceStats
    from bearsdk.io.hop import HopSession
    from bearsdk.prefix_cache import PrefixCacheState

__all__ = ["REBASE_EVERY", "InstanceRuntime"]

log = logging.getLogger("bearsdk.router")

REBASE_EVERY = 32
"""Accepted batch records between two rebases of an instance's coefficients on
its online fit (each rebase prices the speed evidence again on the new base:
:meth:`~bearsdk.state.speed.SpeedTracker.rebase`)."""


@attrs.define
class InstanceRuntime:
    """Runs the instances' sources and calibration for a core.

    Args:
        core: The core whose caches the sources feed.
        calibrate: Follow each engine's batch records (online eq. 12 calibration).
        cluster: The router's cluster, for sources that need one.

    ``session`` and ``hop`` are the router's HTTP clients while it runs.
    """

    core: RouterCore
    calibrate: bool = True
    cluster: Cluster | None = None
    session: aiohttp.ClientSession | None = None
    hop: HopSession | None = None
    _scopes: dict[str, anyio.CancelScope] = attrs.field(factory=dict)
    _online: dict[str, OnlineBatchTime] = attrs.field(factory=dict)
    _sources: dict[str, SnapshotSource] = attrs.field(factory=dict)

    async def run_instance(
        self, slot: InstanceSlot, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Run ``slot``'s source (and calibration) until cancelled or stopped.

        Ready after the source's first attempt.
        """
        assert self.session is not None
        kind = get_snapshot_source(slot.config.snapshots)
        source = kind.factory(
            SourceContext(
                slot.config, self.session, cluster=self.cluster, shadow=slot.shadow, hop=self.hop
            )
        )
        with anyio.CancelScope() as scope:
            self._scopes[slot.name] = scope
            self._sources[slot.name] = source
            try:
                async with anyio.create_task_group() as tg:
                    if slot.config.kv_events is not None:
                        await tg.start(self._follow_kv_events, slot)
                    if self.calibrate:
                        online = self._online.setdefault(
                            slot.name, OnlineBatchTime(slot.batch_time)
                        )
                        tg.start_soon(self._follow_batches, slot, online)
                    await source.run(slot.cache, task_status=task_status)
                    # The source stopped: so do the tasks that followed the instance.
                    tg.cancel_scope.cancel()
            finally:
                if self._scopes.get(slot.name) is scope:
                    del self._scopes[slot.name]
                if self._sources.get(slot.name) is source:
                    del self._sources[slot.name]

    def source_stats(self, name: str) -> SourceStats | None:
        """Counters of ``name``'s snapshot source while it runs."""
        source = self._sources.get(name)
        return None if source is None else source.stats()

    def stop(self, name: str) -> None:
        """Stop ``name``'s tasks (it left the pool)."""
        scope = self._scopes.pop(name, None)
        if scope is not None:
            scope.cancel()

    async def _follow_kv_events(
        self, slot: InstanceSlot, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Keep ``slot.kv_index`` from the engine's KV events (``InstanceConfig.kv_events``).

        Without the ``kvevents`` extra it logs why and routes on without them.
        """
        try:
            from bearsdk.kvevents.index import PrefixIndex
            from bearsdk.kvevents.transport import KVEventSubscriber
        except ImportError as exc:
            log.error(
                "%s: kv_events needs the kvevents extra (pip install 'bearsdk[kvevents]'): %s",
                slot.name,
                exc,
            )
            task_status.started()
            return

        pol = slot.scheduler
        # Bounded by the pool (twice it: a block is stored again only after removal).
        index = PrefixIndex(pol.block_size, max(2 * pol.num_blocks, 1 << 20))
        slot.kv_index = index

        def latest() -> PrefixCacheState | None:
            entry = slot.cache.entry
            return None if entry is None else entry.snapshot.prefix_cache

        sub = KVEventSubscriber(
            index, slot.config.kv_events or "", slot.config.kv_events_replay, snapshots=latest
        )
        await sub.run(task_status=task_status)

    async def _follow_batches(self, slot: InstanceSlot, online: OnlineBatchTime) -> None:
        """Online recalibration from the engine's batch records (``GET /bear/batches``)."""
        assert self.session is not None
        url = slot.config.bear_url + "/bear/batches"
        failures = 0
        while True:
            try:
                async with self.session.get(
                    url, timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0)
                ) as resp:
                    if resp.status == 404:
                        log.info(
                            "%s: no /bear/batches: keeping the profile's coefficients", slot.name
                        )
                        return
                    resp.raise_for_status()
                    failures = 0
                    await self._consume_batches(slot, online, resp)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                failures += 1
                log.debug("%s: batch stream: %s", slot.name, exc)
            await anyio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))

    async def _consume_batches(
        self, slot: InstanceSlot, online: OnlineBatchTime, resp: aiohttp.ClientResponse
    ) -> None:
        accepted = 0
        async for line in resp.content:
            line = line.strip()
            if not line:
                continue
            try:
                (obs,) = read_batches([line.decode("utf-8", "replace")])
            except (BatchDataError, ValueError):
                continue  # counted by the engine's format; never folded in
            if online.observe_batch(obs):
                accepted += 1
                # The engine's own batch times beat snapshot evidence: they
                # become the base; the speed evidence is priced again on them.
                if accepted % REBASE_EVERY == 0 and self.core.find(slot.name) is slot:
                    self.core.rebase(slot.name, online.model)

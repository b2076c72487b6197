"""Snapshots from the Redis bus: the router's source and the engines' bridge.

:class:`RedisSource` is an instance's snapshot source in the
``snapshots = "redis"`` mode: it feeds the instance's cache from the bus
(:class:`~bearsdk.cluster.bus.RedisBus`) and falls back to a direct source (the
engine's push stream) while the bus is down or silent, and back when it
recovers. :class:`RedisSnapshotBridge` is the writer: it follows engines
directly and publishes every snapshot it accepts on the bus, for every replica.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v
from bearsdk.cluster.bus import RedisBus
from bearsdk.errors import SnapshotError
from bearsdk.io.base import SnapshotSource, SourceStats
from bearsdk.snapshot import MAX_SNAPSHOT_BYTES, decode_snapshot
from bearsdk.state.cache import Outcome, Reject, SnapshotCache

if TYPE_CHECKING:
    import aiohttp

    from bearsdk.router.config import InstanceConfig

log = logging.getLogger("bearsdk.cluster")

__all__ = ["RedisSnapshotBridge", "RedisSource"]


@attrs.define(on_setattr=attrs.setters.NO_OP)
class RedisSource:
    """An instance's snapshots from a :class:`RedisBus`, with a direct source as fallback.

    The cache is fed from the instance's snapshot stream. While the bus is down,
    or the stream has been silent for ``stale_after_s`` (its writer is gone:
    writers re-send the latest snapshot every ``keepalive_s``), the ``fallback``
    source (the engine's push stream, typically) runs and feeds the cache
    directly; once the bus has been up and the stream alive for
    ``recover_after_s``, the fallback stops. Both may feed the cache for a
    moment: the cache keeps the newest snapshot by ``seq`` and epoch, and
    documents from Redis that are behind it are skipped without counting as
    rejections.

    ``tg.start(source.run, cache)`` returns after the first attempt: the latest
    snapshot read from Redis, or else the fallback's first attempt.

    Args:
        bus: The running bus (started before the source).
        instance: The instance's name on the bus.
        fallback: The direct source used while Redis is unusable (``None``:
            none; the instance then ages into its fallback estimator).
        stale_after_s: Silence of the stream that counts as a lost writer.
        recover_after_s: How long Redis must be healthy again before the
            fallback stops.
        check_s: How often health is checked.
        max_bytes: Larger documents are rejected (``too-large``).
        name: Label in logs (default: ``redis:{instance}``).
    """

    bus: RedisBus
    instance: str
    fallback: SnapshotSource | None = None
    stale_after_s: float = attrs.field(default=1.0, validator=_v.positive)
    recover_after_s: float = attrs.field(default=0.5, validator=_v.positive)
    check_s: float = attrs.field(default=0.05, validator=_v.positive)
    max_bytes: int = attrs.field(default=MAX_SNAPSHOT_BYTES, validator=_v.count)
    _name: str = attrs.field(default="", alias="name")
    _last: float = attrs.field(init=False, default=-math.inf)
    _alive_since: float = attrs.field(init=False, default=math.inf)
    _fb_scope: anyio.CancelScope | None = attrs.field(init=False, default=None)
    _fb_since: float = attrs.field(init=False, default=0.0)
    _takeovers: int = attrs.field(init=False, default=0)
    _failovers: int = attrs.field(init=False, default=0)
    _documents: int = attrs.field(init=False, default=0)
    _behind: int = attrs.field(init=False, default=0)
    _last_error: str | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._name = self._name or f"redis:{self.instance}"

    @property
    def name(self) -> str:
        """Label used in logs and :attr:`CachedSnapshot.source`."""
        return self._name

    @property
    def using_fallback(self) -> bool:
        """The fallback source is running now."""
        return self._fb_scope is not None

    @property
    def failovers(self) -> int:
        """Switches to the fallback so far."""
        return self._failovers

    @property
    def behind(self) -> int:
        """Documents from Redis skipped because the cache already had a newer one."""
        return self._behind

    def stats(self) -> SourceStats:
        """The counters so far: ``connects`` counts the times Redis took over (the
        first included), ``failures`` the switches to the fallback, ``documents``
        the documents read from Redis."""
        return SourceStats(
            connects=self._takeovers,
            failures=self._failovers,
            documents=self._documents,
            last_error=self._last_error,
        )

    def _deliver(self, cache: SnapshotCache, data: bytes) -> None:
        now = time.monotonic()
        if self._last < now - self.stale_after_s:
            self._alive_since = now
        self._last = now
        self._documents += 1
        if len(data) > self.max_bytes:
            cache.reject(
                Reject.TOO_LARGE,
                f"snapshot: must be <= {self.max_bytes} bytes (got {len(data)})",
                source=self._name,
            )
            return
        try:
            snap = decode_snapshot(data)
        except SnapshotError:
            cache.offer_bytes(data, source=self._name)  # rejects it, classified and counted
            return
        cur = cache.entry
        if (
            cur is not None
            and snap.epoch is not None
            and snap.epoch == cur.snapshot.epoch
            and snap.seq < cur.snapshot.seq
        ):
            # The fallback delivered newer ones meanwhile: the writer is behind.
            self._behind += 1
            return
        cache.offer(snap, source=self._name)

    def _alive(self, now: float) -> bool:
        return self.bus.connected and now - self._last <= self.stale_after_s

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Feed ``cache`` until cancelled; ready after the first attempt."""
        unsubscribe = self.bus.subscribe_snapshots(self.instance, lambda d: self._deliver(cache, d))
        try:
            async with anyio.create_task_group() as tg:
                data = await self.bus.latest_snapshot(self.instance)
                if data is not None:
                    self._deliver(cache, data)
                    self._takeovers += 1
                elif self.fallback is not None:
                    await self._start_fallback(tg, cache, "no snapshot in Redis")
                task_status.started()
                while True:
                    await anyio.sleep(self.check_s)
                    now = time.monotonic()
                    alive = self._alive(now)
                    if self._fb_scope is None:
                        if not alive and self.fallback is not None:
                            why = "bus down" if not self.bus.connected else "stream silent"
                            await self._start_fallback(tg, cache, why)
                    elif (
                        alive
                        and now - self._alive_since >= self.recover_after_s
                        and now - self.bus.up_since >= self.recover_after_s
                    ):
                        self._fb_scope.cancel()
                        self._fb_scope = None
                        self._takeovers += 1
                        log.info(
                            "%s: Redis healthy again: stopped %s after %.1f s",
                            self._name,
                            self.fallback.name if self.fallback is not None else "?",
                            now - self._fb_since,
                        )
        finally:
            unsubscribe()
            if self._fb_scope is not None:
                self._fb_scope.cancel()
                self._fb_scope = None

    async def _start_fallback(
        self, tg: anyio.abc.TaskGroup, cache: SnapshotCache, why: str
    ) -> None:
        assert self.fallback is not None
        self._failovers += 1
        self._last_error = why
        self._fb_since = time.monotonic()
        # The first one (no snapshot in Redis yet) is routine at startup.
        level = logging.INFO if self._takeovers == 0 else logging.WARNING
        log.log(level, "%s: %s: using %s until it recovers", self._name, why, self.fallback.name)
        self._fb_scope = await tg.start(self._run_fallback, cache)

    async def _run_fallback(
        self, cache: SnapshotCache, *, task_status: anyio.abc.TaskStatus[anyio.CancelScope]
    ) -> None:
        assert self.fallback is not None
        with anyio.CancelScope() as scope:
            # The fallback reports its own first attempt; the scope goes with it.
            async with anyio.create_task_group() as tg:
                await tg.start(self.fallback.run, cache)
                task_status.started(scope)


@attrs.define(on_setattr=attrs.setters.NO_OP)
class _TeeCache(SnapshotCache):
    """A cache (without estimator) that hands every accepted document to a bus."""

    bus: RedisBus | None = None

    def offer_bytes(
        self,
        data: bytes | bytearray | memoryview | str,
        *,
        source: str = "",
        fresh_connection: bool = False,
        received: float | None = None,
    ) -> Outcome:
        out = super().offer_bytes(
            data, source=source, fresh_connection=fresh_connection, received=received
        )
        if out is Outcome.ACCEPTED and self.bus is not None:
            raw = data.encode() if isinstance(data, str) else bytes(data)
            self.bus.publish_snapshot(self.instance, raw)
        return out


@attrs.define
class RedisSnapshotBridge:
    """Follows engines directly and writes their snapshots to a bus, for every replica.

    Each instance's source (a :class:`~bearsdk.io.PushSource`, typically) feeds
    a validating cache; every accepted document is published on the bus as it
    arrived (replicas decode it themselves). While a source keeps failing, its
    instance's keep-alives stop, so replicas see the stream fall silent and use
    their own direct sources.

    ``await tg.start(bridge.run)`` starts the bus and every source (ready once
    each made its first attempt).

    Args:
        bus: A bus not yet running (the bridge runs it).
        sources: The direct source of each instance, by instance name.
    """

    bus: RedisBus
    sources: Mapping[str, SnapshotSource]
    _caches: dict[str, _TeeCache] = attrs.field(init=False, factory=dict)

    @classmethod
    def for_pool(
        cls,
        bus: RedisBus,
        configs: Sequence[InstanceConfig],
        *,
        session: aiohttp.ClientSession | None = None,
        **push: Any,
    ) -> RedisSnapshotBridge:
        """A bridge following each instance's push stream.

        Args:
            bus: A bus not yet running.
            configs: :class:`~bearsdk.router.InstanceConfig` values (their name and
                ``bear_url``, where the ``/bear/*`` endpoints are).
            session: A shared aiohttp session for the push sources.
            push: Further :class:`~bearsdk.io.PushSource` arguments.
        """
        from bearsdk.io.http import PushSource

        return cls(
            bus,
            {
                c.name: PushSource(c.bear_url, session=session, name=f"bridge:{c.name}", **push)
                for c in configs
            },
        )

    def cache(self, instance: str) -> SnapshotCache:
        """The bridge's validating cache of ``instance`` (after start)."""
        return self._caches[instance]

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the bus and every source until cancelled."""
        async with anyio.create_task_group() as tg:
            await tg.start(self.bus.run)
            for inst, source in self.sources.items():
                cache = _TeeCache(inst, bus=self.bus)
                self._caches[inst] = cache
                await tg.start(source.run, cache)
            tg.start_soon(self._watch)
            task_status.started()

    async def _watch(self) -> None:
        """Hold an instance's keep-alives while its source fails without delivering."""
        seen: dict[str, tuple[int, int]] = {}
        while True:
            await anyio.sleep(self.bus.keepalive_s / 2)
            for inst, source in self.sources.items():
                s = source.stats()
                cache = self._caches.get(inst)
                mark = (s.failures, 0 if cache is None else cache.version)
                prev = seen.get(inst)
                if prev is not None and mark[0] > prev[0] and mark[1] == prev[1]:
                    self.bus.hold(inst)
                seen[inst] = mark

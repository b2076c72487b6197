"""HTTP snapshot sources: poll ``GET /bear/snapshot``, or follow the ``GET /bear/snapshots`` stream.

Both are I/O edges of the router (see :mod:`bearsdk.io.base`): one task each in
the router's task group, feeding one :class:`~bearsdk.state.cache.SnapshotCache`.
They share an :class:`aiohttp.ClientSession` when given one (the router's) and
otherwise open and close their own inside :meth:`run`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import aiohttp
import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v
from bearsdk.io.base import Backoff, _Health, _Tracked
from bearsdk.snapshot import MAX_SNAPSHOT_BYTES
from bearsdk.state.cache import Outcome, Reject

if TYPE_CHECKING:
    from bearsdk.io.hop import HopSession
    from bearsdk.state.cache import SnapshotCache


class _Body(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class _Response(Protocol):
    """A polled response: aiohttp's, or the hop's."""

    @property
    def status(self) -> int: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> _Body: ...


__all__ = ["PollSource", "PushSource"]

# Transport failures a source retries; anything else is a bug and propagates.
_RETRY = (aiohttp.ClientError, OSError, TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError)


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https:// (got {url!r})")
    return url.rstrip("/")


@contextlib.asynccontextmanager
async def _session(shared: aiohttp.ClientSession | None) -> AsyncIterator[aiohttp.ClientSession]:
    if shared is not None:
        yield shared
        return
    async with aiohttp.ClientSession() as session:
        yield session


class _Failure(Exception):
    """A non-transport failure of one attempt (bad status, oversized body)."""


@attrs.define
class PollSource(_Tracked):
    """Polls ``GET {url}/bear/snapshot`` every ``interval_s``.

    Args:
        url: The engine's base URL (``http://host:port``).
        interval_s: Time between polls while the engine answers.
        timeout_s: Limit on one poll (connect, response and body).
        backoff: Delays between failed polls.
        max_bytes: Larger responses are rejected (``too-large``) unread.
        session: A shared client session (default: an own one per :meth:`run`).
        name: Label in logs (default: ``poll:{url}``).
        hop: The router's own client (:class:`~bearsdk.io.hop.HopSession`):
            polls go by it instead of ``session``, at a fraction of the CPU
            (a router polls every instance 20 times a second).
    """

    url: str = attrs.field(converter=_base)
    interval_s: float = attrs.field(default=0.05, validator=_v.positive)
    timeout_s: float = attrs.field(default=1.0, validator=_v.positive)
    backoff: Backoff = attrs.field(factory=Backoff)
    max_bytes: int = MAX_SNAPSHOT_BYTES
    session: aiohttp.ClientSession | None = None
    hop: HopSession | None = attrs.field(default=None, kw_only=True)
    _name: str = attrs.field(default="", alias="name")
    _health: _Health = attrs.field(init=False)
    _rng: random.Random = attrs.field(init=False, factory=random.Random)

    def __attrs_post_init__(self) -> None:
        self._name = self._name or f"poll:{self.url}"
        self._health = _Health(self._name)

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Poll until cancelled; ready after the first poll (answered or failed)."""
        started = False
        fresh = True  # the first answer after a failure may come from a restarted engine
        async with _session(self.session) as session:
            while True:
                try:
                    if self.hop is not None:
                        # (Its own deadline covers the body too: no cancel scope.)
                        data = await self._fetch_hop(self.hop, cache)
                    else:
                        with anyio.fail_after(self.timeout_s):
                            data = await self._fetch(session, cache)
                except (*_RETRY, _Failure) as exc:
                    streak = self._health.fail(exc)
                    fresh = True
                    delay = self.backoff.delay(streak, self._rng)
                else:
                    self._health.ok()
                    delay = self.interval_s
                    if data is not None:
                        self._health.documents += 1
                        out = cache.offer_bytes(data, source=self._name, fresh_connection=fresh)
                        if out is not Outcome.REJECTED:
                            fresh = False
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(delay)

    async def _fetch(self, session: aiohttp.ClientSession, cache: SnapshotCache) -> bytes | None:
        async with session.get(f"{self.url}/bear/snapshot") as resp:
            return await self._body(resp, cache)

    async def _fetch_hop(self, hop: HopSession, cache: SnapshotCache) -> bytes | None:
        resp = await hop.get(f"{self.url}/bear/snapshot", total_s=self.timeout_s)
        try:
            data = await self._body(resp, cache)
        except BaseException:
            resp.close()
            raise
        resp.release()  # (kept for the next poll only if read to its end)
        return data

    async def _body(self, resp: _Response, cache: SnapshotCache) -> bytes | None:
        """The snapshot's bytes, or ``None`` when its size was refused."""
        if resp.status != 200:
            raise _Failure(f"GET /bear/snapshot: HTTP {resp.status}")
        if resp.content_length is not None and resp.content_length > self.max_bytes:
            cache.reject(
                Reject.TOO_LARGE,
                f"snapshot body: must be <= {self.max_bytes} bytes (got {resp.content_length})",
                source=self._name,
            )
            return None
        data = await resp.content.read(self.max_bytes + 1)
        while len(data) <= self.max_bytes:
            more = await resp.content.read(self.max_bytes + 1 - len(data))
            if not more:
                break
            data += more
        if len(data) > self.max_bytes:
            cache.reject(
                Reject.TOO_LARGE,
                f"snapshot body: must be <= {self.max_bytes} bytes (got more)",
                source=self._name,
            )
            return None
        return data


@attrs.define
class PushSource(_Tracked):
    """Follows the NDJSON stream ``GET {url}/bear/snapshots`` over one persistent connection.

    Every line is a snapshot (an empty line is a heartbeat). Silence for
    ``3 * heartbeat_s`` means a dead connection: the source reconnects, with
    backoff after failures. The first snapshot of each connection may have a
    lower ``seq`` than the cached one (a restarted engine); the cache accepts it.

    Args:
        url: The engine's base URL.
        heartbeat_s: The engine's heartbeat interval.
        connect_timeout_s: Limit on connecting and receiving the response head.
        min_interval_ms: Ask the engine for at most one snapshot per this many
            milliseconds (coalesced, latest wins); 0: every one.
        backoff: Delays between failed connections.
        max_line_bytes: Longer lines are rejected (``too-large``) and skipped.
        session: A shared client session (default: an own one per :meth:`run`).
        name: Label in logs (default: ``push:{url}``).
    """

    url: str = attrs.field(converter=_base)
    heartbeat_s: float = attrs.field(default=1.0, validator=_v.positive)
    connect_timeout_s: float = attrs.field(default=2.0, validator=_v.positive)
    min_interval_ms: int = 0
    backoff: Backoff = attrs.field(factory=Backoff)
    max_line_bytes: int = MAX_SNAPSHOT_BYTES
    session: aiohttp.ClientSession | None = None
    _name: str = attrs.field(default="", alias="name")
    _health: _Health = attrs.field(init=False)
    _rng: random.Random = attrs.field(init=False, factory=random.Random)

    def __attrs_post_init__(self) -> None:
        self._name = self._name or f"push:{self.url}"
        self._health = _Health(self._name)
        if self.min_interval_ms < 0:
            raise ValueError(f"min_interval_ms must be >= 0 (got {self.min_interval_ms!r})")

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Follow the stream until cancelled; ready after the first connection attempt.

        The first attempt counts as done when the connection delivered its first
        line, or failed.
        """
        ready = anyio.Event()

        async def signal_ready() -> None:
            await ready.wait()
            task_status.started()

        async with _session(self.session) as session, anyio.create_task_group() as tg:
            # Readiness is signalled from a child so that the stream can report
            # it from deep inside the read loop without threading a callback.
            tg.start_soon(signal_ready)
            while True:
                try:
                    delivered = await self._stream(session, cache, ready)
                except (*_RETRY, _Failure) as exc:
                    streak = self._health.fail(exc)
                    ready.set()
                    await anyio.sleep(self.backoff.delay(streak, self._rng))
                    continue
                # The engine closed the stream (restarting, shutting down):
                # reconnect soon, and back off if it stays away.
                streak = 1
                if not delivered:
                    streak = self._health.fail("stream closed before any snapshot")
                    ready.set()
                await anyio.sleep(self.backoff.delay(streak, self._rng))

    async def _stream(
        self, session: aiohttp.ClientSession, cache: SnapshotCache, ready: anyio.Event
    ) -> bool:
        params = {"min_interval_ms": str(self.min_interval_ms)} if self.min_interval_ms else None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        with anyio.fail_after(self.connect_timeout_s):
            resp = await session.get(f"{self.url}/bear/snapshots", params=params, timeout=timeout)
        async with resp:
            if resp.status != 200:
                raise _Failure(f"GET /bear/snapshots: HTTP {resp.status}")
            self._health.ok()
            fresh = True
            delivered = False
            skipping = False
            buf = bytearray()
            while True:
                with anyio.fail_after(3 * self.heartbeat_s):
                    chunk = await resp.content.readany()
                if not chunk:
                    return delivered
                buf += chunk
                start = 0
                while True:
                    end = buf.find(b"\n", start)
                    if end < 0:
                        break
                    if skipping:
                        skipping = False
                    elif end > start:
                        # A copy: the buffer is compacted below, so no view may outlive it.
                        line = bytes(buf[start:end])
                        if not line.isspace():  # else a heartbeat (maybe with CR)
                            out = cache.offer_bytes(line, source=self._name, fresh_connection=fresh)
                            self._health.documents += 1
                            delivered = True
                            if out is not Outcome.REJECTED:
                                fresh = False
                            ready.set()
                    start = end + 1
                del buf[:start]
                if len(buf) > self.max_line_bytes:
                    cache.reject(
                        Reject.TOO_LARGE,
                        f"stream line: must be <= {self.max_line_bytes} bytes (got more)",
                        source=self._name,
                    )
                    buf.clear()
                    skipping = True

"""The Redis bus router replicas share: snapshots in, dispatch events both ways (``redis`` extra).

Several processes each embedding an :class:`~bearsdk.router.AsyncRouter` (the
*replicas*) should neither each follow every engine, nor each see only their
own requests. :class:`RedisBus` is one process's connection to a Redis server
that they all share. Everything on it is a Redis stream (``prefix`` defaults
to ``bear``):

``{prefix}:snap:{instance}``
    The instance's latest ``bear.snapshot/1`` document (field ``d``), the
    stream capped at one entry (``instance`` with ``%`` and ``:``
    percent-encoded, so that no two prefix and instance pairs share a key).
    A writer (:class:`~bearsdk.cluster.RedisSnapshotBridge`, which follows
    engines' push or poll endpoints, or an engine calling
    :meth:`RedisBus.publish_snapshot` after each step) appends every new
    snapshot, and re-appends the latest every ``keepalive_s`` while nothing
    changes, so that readers can tell an idle engine from a dead writer. The
    key expires ``snapshot_ttl_s`` after the last write.
``{prefix}:dispatch``
    Dispatch events of every replica (field ``e``: a :class:`DispatchEvent`),
    trimmed to the last ``dispatch_ttl_s`` on every append and expiring with it.

Router side, :class:`~bearsdk.cluster.RedisSource` is the instance's snapshot
source (the ``snapshots = "redis"`` mode): it feeds the cache from the stream
and falls back to a direct source (the engine's push stream) while the bus is
down or silent, and back when it recovers. The cross-replica dispatch overlay built on the
dispatch stream is :class:`bearsdk.cluster.SharedOverlay`.

Nothing on the routing path waits for Redis: :meth:`~RedisBus.publish_snapshot`
and :meth:`~RedisBus.publish_dispatch` only queue (snapshots coalesce, latest
wins; events go to a bounded queue whose oldest entries are dropped when it is
full), and one writer task sends what is queued, pipelined. Every command runs
under ``timeout_s``: a slow server counts as a down one. Readers and the writer
retry with backoff and resume where they were (the streams keep recent entries,
so a short outage loses nothing still relevant).

The bus needs the asyncio backend of anyio (redis-py's client is asyncio's).
What travels on it (key names, dispatch events) is in :mod:`bearsdk.cluster.wire`;
the snapshot source and the bridge are in :mod:`bearsdk.cluster.redis_source`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v
from bearsdk.cluster.wire import (
    DispatchEvent,
    _prefix,
    _url,
    key_name,
    redact_url,
)
from bearsdk.errors import BearError
from bearsdk.io.base import Backoff, _Health

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("bearsdk.cluster")

__all__ = ["BusStats", "EventCallback", "RedisBus", "SnapshotCallback"]


@attrs.frozen
class BusStats:
    """Counters of one :class:`RedisBus`.

    Attributes:
        connected: The latest command succeeded.
        connects: Times the bus came up (the first time included).
        failures: Failed or timed-out commands.
        last_error: The latest failure, if any.
        snapshots_written: Snapshot appends sent (keep-alives included).
        snapshots_read: Snapshot entries read and handed to subscribers.
        events_written: Dispatch events sent.
        events_read: Dispatch events read and handed to subscribers.
        events_dropped: Events never sent: the queue was full, or they were
            older than ``dispatch_ttl_s`` when Redis came back.
        events_malformed: Entries of the dispatch stream that did not decode.
        callback_errors: Entries a subscriber raised on (a bug, logged with
            its traceback; the reader goes on).
    """

    connected: bool
    connects: int
    failures: int
    last_error: str | None
    snapshots_written: int
    snapshots_read: int
    events_written: int
    events_read: int
    events_dropped: int
    events_malformed: int
    callback_errors: int = 0


def _retry_errors() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError)


SnapshotCallback = Callable[[bytes], None]
EventCallback = Callable[[DispatchEvent], None]


# Validators run at init only: a hook on every private-state write costs
# microseconds on every event.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class RedisBus:
    """One process's connection to the Redis server its router replicas share.

    ``await tg.start(bus.run)`` connects (readiness after the first attempt,
    successful or not) and runs the reader and writer tasks until cancelled.
    Subscribers and publishers may be added before or while it runs.

    Args:
        url: The server (``redis://host:port/db``, ``rediss://``, ``unix://``).
        prefix: Namespace of every key (several pools can share one server).
        timeout_s: Limit on one command, connecting included; a slower server
            counts as down (the bus reconnects with backoff).
        block_s: How long one stream read waits for new entries.
        keepalive_s: The latest snapshot of each instance published here is
            appended again after this long without a new one.
        snapshot_ttl_s: Snapshot streams expire this long after their last write.
        dispatch_ttl_s: Dispatch events are kept (and sent after an outage) for
            this long.
        max_queue: Dispatch events waiting to be sent; beyond it, the oldest go.
        max_read: Entries read per stream per read.
        backoff: Delays between attempts while the server is down.
        name: Label in logs (default: ``redis:{url}``, the password masked).
    """

    url: str = attrs.field(default="redis://127.0.0.1:6379/0", validator=_url, repr=redact_url)
    prefix: str = attrs.field(default="bear", validator=_prefix)
    timeout_s: float = attrs.field(default=0.25, validator=_v.positive)
    block_s: float = attrs.field(default=0.1, validator=_v.positive)
    keepalive_s: float = attrs.field(default=0.25, validator=_v.positive)
    snapshot_ttl_s: float = attrs.field(default=5.0, validator=_v.positive)
    dispatch_ttl_s: float = attrs.field(default=5.0, validator=_v.positive)
    max_queue: int = attrs.field(default=4096, validator=_v.count)
    max_read: int = attrs.field(default=1000, validator=_v.count)
    backoff: Backoff = attrs.field(factory=lambda: Backoff(initial_s=0.05, max_s=1.0))
    _name: str = attrs.field(default="", alias="name")
    _client: redis.asyncio.Redis | None = attrs.field(init=False, default=None)
    _running: bool = attrs.field(init=False, default=False)
    _health: _Health = attrs.field(init=False)
    _up: bool = attrs.field(init=False, default=False)
    _up_since: float = attrs.field(init=False, default=math.inf)
    _rng: random.Random = attrs.field(init=False, factory=random.Random)
    # writer side
    _wake: anyio.Event | None = attrs.field(init=False, default=None)
    _snap_out: dict[str, bytes] = attrs.field(init=False, factory=dict)
    _snap_last: dict[str, tuple[bytes, float]] = attrs.field(init=False, factory=dict)
    _events: deque[tuple[float, bytes]] = attrs.field(init=False)
    # reader side
    _snap_subs: dict[str, list[SnapshotCallback]] = attrs.field(init=False, factory=dict)
    _snap_ids: dict[str, bytes] = attrs.field(init=False, factory=dict)
    _event_subs: list[EventCallback] = attrs.field(init=False, factory=list)
    _event_id: bytes = attrs.field(init=False, default=b"0-0")
    _subscribed: anyio.Event | None = attrs.field(init=False, default=None)
    # counters
    _snapshots_written: int = attrs.field(init=False, default=0)
    _snapshots_read: int = attrs.field(init=False, default=0)
    _events_written: int = attrs.field(init=False, default=0)
    _events_read: int = attrs.field(init=False, default=0)
    _events_dropped: int = attrs.field(init=False, default=0)
    _events_malformed: int = attrs.field(init=False, default=0)
    _callback_errors: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        # The name goes into logs and errors: never with the password.
        self._name = self._name or f"redis:{redact_url(self.url)}"
        self._health = _Health(self._name)
        self._events = deque(maxlen=self.max_queue)

    # ------------------------------------------------------------------ state

    @property
    def name(self) -> str:
        """Label used in logs."""
        return self._name

    @property
    def connected(self) -> bool:
        """The latest command succeeded (``False`` before the first one)."""
        return self._up

    @property
    def up_since(self) -> float:
        """``time.monotonic()`` when the bus last came up (``inf`` while down)."""
        return self._up_since if self._up else math.inf

    def snapshot_key(self, instance: str) -> str:
        """The stream holding ``instance``'s latest snapshot (the name as :func:`key_name`)."""
        return f"{self.prefix}:snap:{key_name(instance)}"

    @property
    def dispatch_key(self) -> str:
        """The stream of dispatch events."""
        return f"{self.prefix}:dispatch"

    def stats(self) -> BusStats:
        """The counters so far."""
        h = self._health
        return BusStats(
            connected=self._up,
            connects=h.connects,
            failures=h.failures,
            last_error=h.last_error,
            snapshots_written=self._snapshots_written,
            snapshots_read=self._snapshots_read,
            events_written=self._events_written,
            events_read=self._events_read,
            events_dropped=self._events_dropped,
            events_malformed=self._events_malformed,
            callback_errors=self._callback_errors,
        )

    def _ok(self) -> None:
        if not self._up:
            self._up = True
            self._up_since = time.monotonic()
            self._health.ok()

    def _fail(self, exc: BaseException) -> int:
        self._up = False
        if isinstance(exc, TimeoutError):
            return self._health.fail(f"no answer within {self.timeout_s} s")
        return self._health.fail(exc)

    # ------------------------------------------------------------------ publishing

    def publish_snapshot(self, instance: str, data: bytes) -> None:
        """Queue ``data`` as ``instance``'s latest snapshot (never blocks; latest wins).

        From then on it is re-sent every ``keepalive_s`` until a newer one is
        published or :meth:`hold` is called.
        """
        self._snap_out[instance] = bytes(data)
        self._snap_last[instance] = (self._snap_out[instance], time.monotonic())
        self._kick()

    def hold(self, instance: str) -> None:
        """Stop re-sending ``instance``'s latest snapshot (its engine stopped answering).

        Readers then see the stream fall silent and use their fallback.
        """
        self._snap_last.pop(instance, None)

    def publish_dispatch(self, event: DispatchEvent) -> None:
        """Queue a dispatch event (never blocks; the oldest are dropped when the queue is full)."""
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append((time.monotonic(), event.encode()))
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ subscribing

    def subscribe_snapshots(self, instance: str, callback: SnapshotCallback) -> Callable[[], None]:
        """Call ``callback(document)`` for every snapshot entry of ``instance`` read.

        Runs on the event loop; must not block. Returns the function that
        unsubscribes.
        """
        subs = self._snap_subs.setdefault(instance, [])
        subs.append(callback)
        self._wake_reader()

        def unsubscribe() -> None:
            if callback in subs:
                subs.remove(callback)
            if not subs and self._snap_subs.get(instance) is subs:
                del self._snap_subs[instance]
                self._snap_ids.pop(instance, None)

        return unsubscribe

    def subscribe_dispatches(self, callback: EventCallback) -> Callable[[], None]:
        """Call ``callback(event)`` for every dispatch event read (every replica's, own included).

        Returns the function that unsubscribes.
        """
        self._event_subs.append(callback)
        self._wake_reader()

        def unsubscribe() -> None:
            if callback in self._event_subs:
                self._event_subs.remove(callback)

        return unsubscribe

    def _wake_reader(self) -> None:
        # An idle reader (nothing followed yet) starts following at once.
        if self._subscribed is not None:
            self._subscribed.set()

    async def latest_snapshot(self, instance: str) -> bytes | None:
        """The snapshot document of ``instance`` in Redis now (one read, ``None``: none or down)."""
        client = self._client
        if client is None or not self._up:
            return None
        got: Any  # redis-py's reply types are unions; RESP2 replies are lists
        try:
            with anyio.fail_after(self.timeout_s):
                got = await client.xrevrange(self.snapshot_key(instance), count=1)
        except _retry_errors() as exc:
            self._fail(exc)
            return None
        self._ok()
        if not got:
            return None
        _, fields = got[0]
        data = fields.get(b"d")
        return bytes(data) if isinstance(data, bytes) else None

    # ------------------------------------------------------------------ running

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Connect, then read and write until cancelled; ready after the first attempt.

        Raises:
            BearError: The bus is already running, or redis-py is not installed.
        """
        if self._running:
            raise BearError(f"{self._name}: already running (one bus per task group)")
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:
            raise BearError("RedisBus needs redis-py >= 5: pip install 'bearsdk[redis]'") from None
        self._running = True
        # The bus retries and backs off itself: redis-py's own retries would
        # hold a command past timeout_s.
        client = aioredis.Redis.from_url(
            self.url,
            # RESP2: every redis-py >= 5 shapes stream replies the same way.
            protocol=2,
            socket_connect_timeout=self.timeout_s,
            socket_timeout=self.block_s + self.timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._client = client
        self._wake = anyio.Event()
        try:
            await self._ping(client)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_loop, client)
                tg.start_soon(self._write_loop, client)
                task_status.started()
        finally:
            self._client = None
            self._wake = None
            self._up = False
            self._running = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout_s):
                await client.aclose()

    async def _ping(self, client: redis.asyncio.Redis) -> bool:
        try:
            with anyio.fail_after(self.timeout_s):
                await client.ping()
        except _retry_errors() as exc:
            self._fail(exc)
            return False
        self._ok()
        return True

    async def _read_loop(self, client: redis.asyncio.Redis) -> None:
        errors = _retry_errors()
        while True:
            if not self._up and not await self._ping(client):
                await anyio.sleep(self.backoff.delay(self._health.streak, self._rng))
                continue
            keys: dict[str, bytes] = {}
            names: dict[bytes, str] = {}
            for inst in self._snap_subs:
                key = self.snapshot_key(inst)
                keys[key] = self._snap_ids.get(inst, b"0-0")
                names[key.encode()] = inst
            if self._event_subs:
                keys[self.dispatch_key] = self._event_id
            if not keys:
                # Nothing to follow: check the server now and then, so that
                # ``connected`` stays true to it, until something is subscribed.
                self._subscribed = anyio.Event()
                with anyio.move_on_after(self.keepalive_s):
                    await self._subscribed.wait()
                self._subscribed = None
                await self._ping(client)
                continue
            got: Any
            try:
                with anyio.fail_after(self.block_s + self.timeout_s):
                    got = await client.xread(
                        keys,  # type: ignore[arg-type]
                        count=self.max_read,
                        block=max(1, int(self.block_s * 1000)),
                    )
            except errors as exc:
                streak = self._fail(exc)
                await anyio.sleep(self.backoff.delay(streak, self._rng))
                continue
            self._ok()
            replies = got.items() if isinstance(got, dict) else (got or ())
            for key, entries in replies:
                if not entries:
                    continue
                if key == self.dispatch_key.encode():
                    self._event_id = entries[-1][0]
                    self._deliver_events(entries)
                    continue
                owner = names.get(key)
                if owner is None or owner not in self._snap_subs:
                    continue  # unsubscribed during the read
                last_id, fields = entries[-1]
                self._snap_ids[owner] = last_id
                data = fields.get(b"d")
                if isinstance(data, bytes):
                    self._snapshots_read += 1
                    for cb in list(self._snap_subs.get(owner, ())):
                        self._call(cb, data)

    def _deliver_events(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for _, fields in entries:
            raw = fields.get(b"e")
            try:
                if raw is None:
                    raise ValueError("dispatch event: no field 'e'")
                ev = DispatchEvent.decode(raw)
            except ValueError:
                self._events_malformed += 1
                continue
            self._events_read += 1
            for cb in list(self._event_subs):
                self._call(cb, ev)

    def _call(self, cb: Callable[[Any], None], arg: object) -> None:
        # Entries are any peer's: a subscriber tripping over one must not end
        # the reader (and with it the router's task group). The bug is logged
        # with its traceback, and counted.
        try:
            cb(arg)
        except Exception:
            self._callback_errors += 1
            if self._callback_errors == 1 or self._callback_errors % 1000 == 0:
                log.exception(
                    "%s: a subscriber failed on an entry [%d so far]",
                    self._name,
                    self._callback_errors,
                )

    async def _write_loop(self, client: redis.asyncio.Redis) -> None:
        errors = _retry_errors()
        snap_ttl = max(1, int(self.snapshot_ttl_s * 1000))
        disp_ttl = max(1, int(self.dispatch_ttl_s * 1000))
        while True:
            wake = self._wake
            if wake is not None and not (self._snap_out or self._events):
                with anyio.move_on_after(self.keepalive_s):
                    await wake.wait()
            # Publications from here on set the new event; earlier ones are read below.
            self._wake = anyio.Event()
            now = time.monotonic()
            snaps = dict(self._snap_out)
            for inst, (data, at) in self._snap_last.items():
                if inst not in snaps and now - at >= self.keepalive_s:
                    snaps[inst] = data
            # Events older than their time to live are of no use to anyone any more.
            events = [(t, e) for t, e in self._events if now - t <= self.dispatch_ttl_s]
            self._events_dropped += len(self._events) - len(events)
            self._events.clear()
            if not snaps and not events:
                continue
            self._snap_out.clear()
            pipe = client.pipeline(transaction=False)
            for inst, data in snaps.items():
                key = self.snapshot_key(inst)
                pipe.xadd(key, {"d": data}, maxlen=1, approximate=False)
                pipe.pexpire(key, snap_ttl)
            if events:
                minid = int(time.time() * 1000) - disp_ttl
                for _, e in events:
                    pipe.xadd(self.dispatch_key, {"e": e}, minid=minid, approximate=True)
                pipe.pexpire(self.dispatch_key, disp_ttl)
            try:
                with anyio.fail_after(self.timeout_s):
                    await pipe.execute()
            except errors as exc:
                # Put everything back (newer publications win), then back off.
                for inst, data in snaps.items():
                    self._snap_out.setdefault(inst, data)
                kept = deque(events, maxlen=self.max_queue)
                kept.extend(self._events)
                self._events_dropped += len(events) + len(self._events) - len(kept)
                self._events = kept
                streak = self._fail(exc)
                await anyio.sleep(self.backoff.delay(streak, self._rng))
                continue
            finally:
                # Return the connection to the pool even when cancelled mid-command.
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout_s):
                    await pipe.reset()  # type: ignore[no-untyped-call]
            self._ok()
            sent = time.monotonic()
            for inst in snaps:
                if inst in self._snap_last:
                    self._snap_last[inst] = (self._snap_last[inst][0], sent)
            self._snapshots_written += len(snaps)
            self._events_written += len(events)

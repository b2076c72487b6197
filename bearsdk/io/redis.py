"""A Redis bus shared by router replicas: snapshots in, dispatch events both ways (``redis`` extra).

Several processes each embedding an :class:`~bearsdk.router.AsyncRouter` (the
*replicas*) should neither each follow every engine, nor each see only their
own requests. :class:`RedisBus` is one process's connection to a Redis server
that they all share. Everything on it is a Redis stream (``prefix`` defaults
to ``bear``):

``{prefix}:snap:{instance}``
    The instance's latest ``bear.snapshot/1`` document (field ``d``), the
    stream capped at one entry (``instance`` with ``%`` and ``:``
    percent-encoded, so that no two prefix and instance pairs share a key).
    A writer (:class:`RedisSnapshotBridge`, which follows engines' push or
    poll endpoints, or an engine calling :meth:`RedisBus.publish_snapshot`
    after each step) appends every new snapshot, and re-appends the latest
    every ``keepalive_s`` while nothing changes, so that readers can tell an
    idle engine from a dead writer. The key expires ``snapshot_ttl_s`` after
    the last write.
``{prefix}:dispatch``
    Dispatch events of every replica (field ``e``: a :class:`DispatchEvent`),
    trimmed to the last ``dispatch_ttl_s`` on every append and expiring with it.

Router side, :class:`RedisSource` is the instance's snapshot source (the
``snapshots = "redis"`` mode): it feeds the cache from the stream and falls back
to a direct source (the engine's push stream) while the bus is down or silent,
and back when it recovers. The cross-replica dispatch overlay built on the
dispatch stream is :class:`bearsdk.cluster.SharedOverlay`.

Nothing on the routing path waits for Redis: :meth:`~RedisBus.publish_snapshot`
and :meth:`~RedisBus.publish_dispatch` only queue (snapshots coalesce, latest
wins; events go to a bounded queue whose oldest entries are dropped when it is
full), and one writer task sends what is queued, pipelined. Every command runs
under ``timeout_s``: a slow server counts as a down one. Readers and the writer
retry with backoff and resume where they were (the streams keep recent entries,
so a short outage loses nothing still relevant).

The bus needs the asyncio backend of anyio (redis-py's client is asyncio's).
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import attrs
import orjson

from bearsdk.errors import BearError, SnapshotError
from bearsdk.io.base import Backoff, SnapshotSource, SourceStats, _Health
from bearsdk.snapshot import MAX_SNAPSHOT_BYTES, decode_snapshot
from bearsdk.state.cache import Outcome, Reject, SnapshotCache

if TYPE_CHECKING:
    import aiohttp
    import redis.asyncio

    from bearsdk.router.config import InstanceConfig

log = logging.getLogger("bearsdk.io.redis")

__all__ = [
    "EVENT_KINDS",
    "BusStats",
    "DispatchEvent",
    "RedisBus",
    "RedisSnapshotBridge",
    "RedisSource",
    "key_name",
    "redact_url",
]

EVENT_KINDS: Final = ("dispatch", "token", "complete")
"""What a :class:`DispatchEvent` reports: a request sent to an instance, its first
token seen, or its end (finished, failed or abandoned)."""


MAX_EVENT_BYTES: Final = 4096
"""Larger dispatch entries are malformed (a real one is about 100 bytes)."""
MAX_NAME: Final = 512
"""Longest replica, instance or request id a dispatch event may carry."""
MAX_TOKENS: Final = 1 << 24
"""Largest prompt or output length a dispatch event may carry (beyond any model's context)."""

# The password of a URL's user info, and password=... in its query string.
# Greedy up to the netloc's last '@', as URL parsers split it: a password may hold '@'.
_USERINFO_PW: Final = re.compile(r"^([a-z0-9+.-]+://[^/?#@:]*):[^/?#]*@", re.IGNORECASE)
_QUERY_PW: Final = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs, names and errors).

    ``redis://:secret@host:6379/0`` becomes ``redis://:***@host:6379/0``;
    ``redis://user:secret@host`` becomes ``redis://user:***@host``; a
    ``password=`` query parameter is masked the same way.
    """
    return _QUERY_PW.sub(r"\1***", _USERINFO_PW.sub(r"\1:***@", url))


def key_name(name: str) -> str:
    """``name`` as one component of a Redis key: ``%`` and ``:`` percent-encoded.

    Without it, prefix ``bear:snap:x`` and instance ``y`` would share a key with
    prefix ``bear`` and instance ``x:snap:y``. Names without either character
    are unchanged.
    """
    if "%" not in name and ":" not in name:
        return name
    return name.replace("%", "%25").replace(":", "%3A")


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{att.name} must be a finite number > 0 (got {value!r})")


def _count(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{att.name} must be an integer >= 1 (got {value!r})")


def _prefix(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(
            f"{att.name} must be a non-empty string without spaces (got {value!r:.200})"
        )
    if value.endswith(":snap"):
        # {prefix}:dispatch would be the snapshot key of an instance named
        # "dispatch" under the prefix one level up.
        raise ValueError(f"{att.name} must not end with ':snap' (got {value!r:.200})")


def _url(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        shown = redact_url(value) if isinstance(value, str) else value
        raise ValueError(
            f"{att.name} must start with redis://, rediss:// or unix:// (got {shown!r:.200})"
        )


def _short(v: object) -> str:
    """A bounded repr of an untrusted JSON value (containers by type and size only)."""
    if isinstance(v, list | dict):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{v!r:.80}"


@attrs.frozen
class DispatchEvent:
    """One replica's dispatch event, as it travels on ``{prefix}:dispatch``.

    Attributes:
        replica: The replica that sent the request.
        kind: One of :data:`EVENT_KINDS`.
        instance: Where the request went.
        rid: The replica's request id (engines' ids contain it).
        time: When it happened, on the replica's clock (wall time).
        prompt_tokens: Prompt length (``dispatch`` only; else 0).
        output_tokens: Predicted output length (``dispatch`` only).
    """

    replica: str
    kind: str
    instance: str
    rid: str
    time: float
    prompt_tokens: int = 0
    output_tokens: int | None = None

    def encode(self) -> bytes:
        """The wire form: a JSON array."""
        return orjson.dumps(
            [
                self.replica,
                self.kind,
                self.instance,
                self.rid,
                self.time,
                self.prompt_tokens,
                self.output_tokens,
            ]
        )

    @classmethod
    def decode(cls, data: bytes | str) -> DispatchEvent:
        """Parse the wire form strictly.

        Entries come from any peer with access to the server: they are
        untrusted, so sizes and numbers are bounded (:data:`MAX_EVENT_BYTES`,
        :data:`MAX_NAME`, :data:`MAX_TOKENS`).

        Raises:
            ValueError: Too large, not a 7-element array, or a field of the wrong
                type or out of bounds (the message names the field and the value).
        """
        if len(data) > MAX_EVENT_BYTES:
            raise ValueError(
                f"dispatch event: must be <= {MAX_EVENT_BYTES} bytes (got {len(data)})"
            )
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"dispatch event: not JSON ({exc})") from None
        if not isinstance(doc, list) or len(doc) != 7:
            # Not the repr of doc: a deeply nested value has no repr (RecursionError).
            what = f"a {len(doc)}-element array" if isinstance(doc, list) else type(doc).__name__
            raise ValueError(f"dispatch event: must be a 7-element array (got {what})")
        replica, kind, instance, rid, t, prompt, out = doc
        for name, v in (("replica", replica), ("instance", instance), ("rid", rid)):
            if not isinstance(v, str) or not v or len(v) > MAX_NAME:
                raise ValueError(
                    f"dispatch event {name}: must be a non-empty string of at most "
                    f"{MAX_NAME} characters (got {_short(v)})"
                )
        if kind not in EVENT_KINDS:
            raise ValueError(
                f"dispatch event kind: must be one of {EVENT_KINDS} (got {_short(kind)})"
            )
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ValueError(f"dispatch event time: must be a finite number (got {_short(t)})")
        lo = 1 if kind == "dispatch" else 0
        bad = isinstance(prompt, bool) or not isinstance(prompt, int)
        if bad or not lo <= prompt <= MAX_TOKENS:
            raise ValueError(
                f"dispatch event prompt_tokens: must be an integer in [{lo}, {MAX_TOKENS}] "
                f"(got {_short(prompt)})"
            )
        if out is not None and (
            isinstance(out, bool) or not isinstance(out, int) or not 1 <= out <= MAX_TOKENS
        ):
            raise ValueError(
                f"dispatch event output_tokens: must be an integer in [1, {MAX_TOKENS}] or null "
                f"(got {_short(out)})"
            )
        return cls(replica, kind, instance, rid, float(t), prompt, out)


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
    timeout_s: float = attrs.field(default=0.25, validator=_positive)
    block_s: float = attrs.field(default=0.1, validator=_positive)
    keepalive_s: float = attrs.field(default=0.25, validator=_positive)
    snapshot_ttl_s: float = attrs.field(default=5.0, validator=_positive)
    dispatch_ttl_s: float = attrs.field(default=5.0, validator=_positive)
    max_queue: int = attrs.field(default=4096, validator=_count)
    max_read: int = attrs.field(default=1000, validator=_count)
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
    stale_after_s: float = attrs.field(default=1.0, validator=_positive)
    recover_after_s: float = attrs.field(default=0.5, validator=_positive)
    check_s: float = attrs.field(default=0.05, validator=_positive)
    max_bytes: int = attrs.field(default=MAX_SNAPSHOT_BYTES, validator=_count)
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

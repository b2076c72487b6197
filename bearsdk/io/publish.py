"""Engine side of the HTTP snapshot transports (``docs/protocol.md``).

:class:`SnapshotPublisher` holds an engine's latest snapshot and serves it over
aiohttp: ``GET /bear/snapshot`` (the latest) and ``GET /bear/snapshots`` (an
NDJSON stream of every new one, coalescing for slow readers, with heartbeats).
An engine (the emulated one, or the vLLM plugin) calls :meth:`~SnapshotPublisher.
publish` after each step; the test suite uses it to stand in for an engine and
to inject malformed, stale or torn documents (it sends whatever bytes it is given).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Mapping
from typing import Any, Final

import anyio
import attrs
import orjson
from aiohttp import web

from bearsdk.snapshot import SCHEMA, Snapshot

__all__ = ["SnapshotPublisher", "empty_snapshot"]


MAX_MIN_INTERVAL_MS: Final = 60_000.0
"""Longest ``min_interval_ms`` a stream client may ask for (a minute between snapshots)."""


def empty_snapshot(
    instance: str, *, epoch: str | None = None, time_s: float | None = None
) -> bytes:
    """The ``seq`` 0 snapshot an engine publishes as soon as it starts."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "instance": instance,
        "seq": 0,
        "time": time.time() if time_s is None else time_s,
        "requests": [],
    }
    if epoch is not None:
        doc["epoch"] = epoch
    return orjson.dumps(doc)


@attrs.define(eq=False)
class _Subscriber:
    """One stream connection: only the latest unsent document is kept (coalescing)."""

    pending: bytes | None = None
    wake: anyio.Event = attrs.field(factory=anyio.Event)
    closed: bool = False

    def push(self, data: bytes) -> None:
        self.pending = data
        self.wake.set()

    def close(self) -> None:
        self.closed = True
        self.wake.set()


def _line(data: bytes) -> bytes:
    # A document must stay on one line; orjson never emits newlines.
    return data.replace(b"\n", b" ") + b"\n"


@attrs.define
class SnapshotPublisher:
    """Serves an engine's snapshots over HTTP.

    Args:
        instance: The engine instance name.
        heartbeat_s: An empty line after this long without a snapshot.
        epoch: This engine run's id (default: random hex; see :meth:`restart`).
    """

    instance: str
    heartbeat_s: float = 1.0
    epoch: str | None = attrs.field(factory=lambda: secrets.token_hex(8))
    _latest: bytes = attrs.field(init=False, default=b"")
    _subs: set[_Subscriber] = attrs.field(init=False, factory=set)
    _published: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be a finite number > 0 (got {self.heartbeat_s!r})")
        self._latest = empty_snapshot(self.instance, epoch=self.epoch)

    @property
    def latest(self) -> bytes:
        """The document ``GET /bear/snapshot`` serves."""
        return self._latest

    @property
    def published(self) -> int:
        """Documents published so far."""
        return self._published

    @property
    def connections(self) -> int:
        """Open stream connections."""
        return len(self._subs)

    def publish(self, snapshot: Snapshot | Mapping[str, Any] | bytes) -> None:
        """Make ``snapshot`` the latest and push it to every stream.

        Bytes are sent as they are (a publisher trusts its engine; tests use this
        to inject broken documents). Call from the event loop thread.
        """
        if isinstance(snapshot, Snapshot):
            data = snapshot.to_json()
        elif isinstance(snapshot, bytes):
            data = snapshot
        else:
            data = orjson.dumps(snapshot)
        self._latest = data
        self._published += 1
        for sub in self._subs:
            sub.push(data)

    def restart(self, epoch: str | None = None) -> None:
        """Act as a restarted engine: drop every stream, new epoch, ``seq`` 0 again."""
        self.epoch = epoch if epoch is not None else secrets.token_hex(8)
        self._latest = empty_snapshot(self.instance, epoch=self.epoch)
        for sub in list(self._subs):
            sub.close()

    def close(self) -> None:
        """End every open stream (before the server shuts down)."""
        for sub in list(self._subs):
            sub.close()

    def add_routes(self, app: web.Application) -> None:
        """Register ``GET /bear/snapshot`` and ``GET /bear/snapshots`` on ``app``."""
        app.router.add_get("/bear/snapshot", self.handle_snapshot)
        app.router.add_get("/bear/snapshots", self.handle_stream)

    async def handle_snapshot(self, request: web.Request) -> web.Response:
        """``GET /bear/snapshot``: the latest snapshot."""
        return web.Response(body=self._latest, content_type="application/json")

    async def handle_stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /bear/snapshots``: NDJSON, the current snapshot then every new one."""
        raw = request.query.get("min_interval_ms", "0")
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        # inf would park the stream after its next snapshot for good; NaN fails this too.
        if not 0.0 <= ms <= MAX_MIN_INTERVAL_MS:
            return web.json_response(
                {
                    "error": {
                        "message": (
                            f"min_interval_ms must be a number in [0, {MAX_MIN_INTERVAL_MS:g}] "
                            f"(got {raw!r:.80})"
                        ),
                        "type": "BadRequestError",
                    }
                },
                status=400,
            )
        min_interval = ms / 1000.0
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        sub = _Subscriber()
        self._subs.add(sub)
        try:
            await resp.write(_line(self._latest))
            while True:
                with anyio.move_on_after(self.heartbeat_s):
                    await sub.wake.wait()
                sub.wake = anyio.Event()
                if sub.closed:
                    break
                data, sub.pending = sub.pending, None
                await resp.write(b"\n" if data is None else _line(data))
                if min_interval and data is not None:
                    await anyio.sleep(min_interval)
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._subs.discard(sub)
        return resp

"""The router's hop to its engines: a lean HTTP/1.1 client on asyncio and llhttp.

Every routed request crosses one HTTP hop, router to engine, and a router's
own added latency is mostly that hop's client: aiohttp's general-purpose
client spends about 0.1 ms of CPU per request before the first byte comes
back (cookies, tracing, redirects, timers, a stream reader per response).
:class:`HopSession` does only what the hop needs: ``POST`` a JSON body (or
``GET`` a snapshot) on a kept-alive connection and hand back the response's
body pieces as they come, parsed by llhttp (the ``httptools`` package, the
parser uvicorn uses), with the surface of :class:`aiohttp.ClientSession` the
dispatcher and the snapshot poller use (``post(...)``, ``get(...)``,
``status``, ``content_length``, ``content.readany()``, ``content.read(n)``,
``close()``, ``release()``) and its error types (:class:`aiohttp.ClientError`,
:class:`OSError`, :class:`TimeoutError`). Its own timers bound a response's
head and a stream's silences (``head_s``, :meth:`HopResponse.readany_within`):
cheaper than a cancel scope around every request and every read.

Connections are kept per host and reused last-in first-out, for at most
:data:`KEEP_IDLE_S` idle (below the 5 s after which uvicorn, vLLM's server,
closes an idle one: a request never races the server's close), at most
:data:`MAX_IDLE_PER_HOST` of them. A response's head is bounded (its status
line and each header line to :data:`MAX_HEAD_BYTES` in all); its body is
buffered up to :data:`MAX_BUFFER_BYTES` before the connection stops reading.
The router uses it, for its requests and its snapshot polls, when
``httptools`` is installed (the ``gateway`` extra) and the caller gave no
session of its own.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Final, cast
from urllib.parse import urlsplit

import aiohttp
import anyio
import httptools

__all__ = ["HopResponse", "HopSession"]

KEEP_IDLE_S: Final = 2.0
MAX_IDLE_PER_HOST: Final = 256
MAX_HEAD_BYTES: Final = 64 << 10
MAX_BUFFER_BYTES: Final = 1 << 20
_CONNECT_S: Final = 5.0
_MAX_URLS: Final = 1024


class HopError(aiohttp.ClientPayloadError):
    """The engine's response broke the protocol, or the connection broke mid-body."""


class _Conn(asyncio.Protocol):
    """One connection to an engine, and the response being read on it."""

    def __init__(self, session: HopSession, key: tuple[str, str, int]) -> None:
        self._session = session
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        # One per connection: llhttp parses its responses one after another (a
        # connection whose response was not read to its end is closed, not kept).
        self._parser = httptools.HttpResponseParser(self)
        # Weak: a response its reader dropped is collected, and closes us.
        self._resp_ref: weakref.ref[HopResponse] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, only alike.)
        self.transport = cast(asyncio.Transport, transport)

    @property
    def _resp(self) -> HopResponse | None:
        ref = self._resp_ref
        return None if ref is None else ref()

    def data_received(self, data: bytes) -> None:
        resp = self._resp
        if resp is None:  # bytes nobody asked for: the connection is not reusable
            self._abort()
            return
        resp._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            resp._fail(HopError("the engine upgraded the connection"))
            self._abort()
        except httptools.HttpParserError as exc:
            resp._fail(HopError(f"malformed response from the engine: {exc}"))
            self._abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._session._forget(self)
        resp = self._resp
        if resp is not None and not resp._complete:
            if resp._head is not None and resp._until_close:
                resp._end()  # a body delimited by the connection's close
            else:
                why = str(exc) if exc else "the engine closed the connection"
                resp._fail(aiohttp.ServerDisconnectedError(why))

    def pause_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    # -- llhttp callbacks (the parser calls them from feed_data)

    def on_message_begin(self) -> None:
        resp = self._resp
        assert resp is not None
        resp._head_size = 0

    def on_status(self, status: bytes) -> None:
        self._count(len(status))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        n = name.lower()
        resp = self._resp
        assert resp is not None
        if n == b"content-length":
            resp._until_close = False
            if not value.strip().isdigit():  # (llhttp refuses it first: kept as a guard)
                raise httptools.HttpParserError("its Content-Length is not a number")
            resp.content_length = int(value)
        elif n == b"transfer-encoding" and b"chunked" in value.lower():
            resp._until_close = False

    def on_headers_complete(self) -> None:
        resp = self._resp
        assert resp is not None
        status = self._parser.get_status_code()
        if status < 200:  # informational (100 Continue...): the answer comes after it
            resp._interim = True
            return
        resp._keep = self._parser.should_keep_alive()
        resp._got_head(status)

    def on_body(self, body: bytes) -> None:
        resp = self._resp
        assert resp is not None
        resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self._resp
        assert resp is not None
        if resp._interim:
            resp._interim = False
            return
        resp._end()

    def _count(self, n: int) -> None:
        resp = self._resp
        assert resp is not None
        resp._head_size += n
        if resp._head_size > MAX_HEAD_BYTES:
            raise httptools.HttpParserError(f"its head is larger than {MAX_HEAD_BYTES} bytes")

    # -- the session's side

    def start(self, resp: HopResponse, request: bytes) -> None:
        self._resp_ref = weakref.ref(resp)
        assert self.transport is not None
        self.transport.write(request)

    def done(self, reuse: bool) -> None:
        """The response is finished with: back to the pool, or closed."""
        self._resp_ref = None
        if reuse and not self.lost and self.transport is not None:
            self._session._keep(self)
        else:
            self._abort()

    def _abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.close()


class HopResponse:
    """A response of the hop: the status once its head came, its body as it comes."""

    def __init__(self, conn: _Conn, deadline: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._conn = conn
        self.status = 0
        self.content_length: int | None = None
        self._head: int | None = None
        self._head_size = 0
        self._head_wait: asyncio.Future[None] = loop.create_future()
        self._pieces: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[bool | None] | None = None
        self._exc: BaseException | None = None
        self._complete = False
        self._keep = False
        self._until_close = True
        self._released = False
        self._got_bytes = False
        self._interim = False
        self._timer = (
            None
            if deadline is None
            else loop.call_at(deadline, _expire, weakref.ref(self), loop.time())
        )

    def __del__(self) -> None:
        # Dropped without close() or release(): its connection must not stay open.
        if not getattr(self, "_released", True):
            self._finish(reuse=False)

    @property
    def content(self) -> HopResponse:
        """The body reader (this object: ``readany()``, ``read(n)``), as aiohttp names it."""
        return self

    async def _wait_head(self, by: float | None) -> None:
        if self._head is None and self._exc is None:
            timer = (
                None
                if by is None
                else asyncio.get_running_loop().call_at(by, _head_late, weakref.ref(self))
            )
            try:
                await self._head_wait
            finally:
                if timer is not None:
                    timer.cancel()
        if self._exc is not None:
            raise self._exc

    async def readany_within(self, idle_s: float) -> bytes | None:
        """:meth:`readany`, or ``None`` when nothing came for ``idle_s`` seconds
        (the response stays open: the caller decides)."""
        if not self._pieces and not self._complete and self._exc is None:
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(idle_s, _idle, waiter)
            try:
                idle = await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if idle and not self._pieces and not self._complete and self._exc is None:
                return None
        return await self.readany()

    async def readany(self) -> bytes:
        """The body bytes that came since the last read (``b""``: the body ended)."""
        while not self._pieces:
            if self._exc is not None:
                raise self._exc
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._pieces.popleft() if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces.clear()
        self._consumed(len(data))
        return data

    async def read(self, n: int = -1) -> bytes:
        """At most ``n`` bytes of the body (all of it: ``n < 0``), waiting for some
        (``b""``: the body ended)."""
        if n < 0:
            parts = []
            while piece := await self.readany():
                parts.append(piece)
            return b"".join(parts)
        data = await self.readany()
        if len(data) > n:
            self._pieces.appendleft(data[n:])
            self._buffered += len(data) - n
            data = data[:n]
        return data

    def close(self) -> None:
        """Stop reading: the connection is closed (the engine aborts the request)."""
        self._finish(reuse=False)

    def release(self) -> None:
        """Done with it: a fully read response's connection is kept for the next request."""
        self._finish(reuse=self._complete and self._keep and self._exc is None)

    # -- fed by the connection

    def _got_head(self, status: int) -> None:
        self.status = status
        self._head = status
        if not self._head_wait.done():
            self._head_wait.set_result(None)

    def _feed(self, body: bytes) -> None:
        self._pieces.append(body)
        self._buffered += len(body)
        if self._buffered > MAX_BUFFER_BYTES and not self._paused:
            self._paused = True
            self._conn.pause_reading()
        self._wake()

    def _consumed(self, n: int) -> None:
        self._buffered -= n
        if self._paused and self._buffered <= MAX_BUFFER_BYTES // 2:
            self._paused = False
            self._conn.resume_reading()

    def _end(self) -> None:
        self._complete = True
        self._cancel_timer()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._complete:
            self._exc = exc
        self._cancel_timer()
        if not self._head_wait.done():
            self._head_wait.set_result(None)
        self._wake()

    def _expire(self, started: float) -> None:
        self._timer = None
        self._fail(TimeoutError(f"the request's total timeout ran out after {_elapsed(started)}"))
        self._finish(reuse=False)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _finish(self, reuse: bool) -> None:
        if self._released:
            return
        self._released = True
        self._cancel_timer()
        if self._exc is None and not self._complete:
            self._exc = aiohttp.ClientConnectionError("the response was closed")
        self._conn.done(reuse)


def _expire(ref: weakref.ref[HopResponse], started: float) -> None:
    resp = ref()
    if resp is not None:
        resp._expire(started)


def _head_late(ref: weakref.ref[HopResponse]) -> None:
    resp = ref()
    if resp is not None and resp._head is None:
        resp._fail(TimeoutError("the response's head did not come in time"))


def _idle(waiter: asyncio.Future[bool | None]) -> None:
    if not waiter.done():
        waiter.set_result(True)


def _elapsed(started: float) -> str:
    return f"{asyncio.get_running_loop().time() - started:.3f} s"


class HopSession:
    """Kept-alive HTTP/1.1 connections to engines: ``POST`` and ``GET`` (see the module).

    Args:
        ssl_context: For ``https`` engines (default: the system's trust store).
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._idle: dict[tuple[str, str, int], deque[_Conn]] = {}
        self._urls: dict[str, tuple[tuple[str, str, int], bytes]] = {}
        self._ssl = ssl_context
        self.closed = False

    async def post(
        self,
        url: str,
        *,
        data: bytes,
        headers: Mapping[str, str],
        total_s: float | None = None,
        head_s: float | None = None,
        on_dispatch: Callable[[], None] | None = None,
    ) -> HopResponse:
        """Send ``data`` to ``url``; return once the response's head came.

        ``on_dispatch`` is called once, where the call would first wait: right
        after the request is written to a kept connection (so bookkeeping there
        does not delay it), or before connecting a new one.

        Raises:
            aiohttp.ClientError: The connection broke or the response is malformed.
            OSError: Connecting failed.
            TimeoutError: ``total_s`` (the whole request's budget, body
                included: later reads raise it too) ran out first, or the head
                took longer than ``head_s`` from the request's start.
        """
        return await self._request(b"POST", url, data, headers, total_s, head_s, on_dispatch)

    async def get(
        self, url: str, *, headers: Mapping[str, str] | None = None, total_s: float | None = None
    ) -> HopResponse:
        """``GET`` ``url`` (a snapshot poll); return once the response's head came.

        Raises:
            As :meth:`post`.
        """
        return await self._request(b"GET", url, None, headers or {}, total_s, None)

    async def _request(
        self,
        method: bytes,
        url: str,
        data: bytes | None,
        headers: Mapping[str, str],
        total_s: float | None,
        head_s: float | None,
        on_dispatch: Callable[[], None] | None = None,
    ) -> HopResponse:
        if self.closed:
            raise aiohttp.ClientConnectionError("the session is closed")
        key, target = self._target(url)
        lines = [method, target]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if data is None:
            lines.append(b"\r\n")
        else:
            lines.append(b"Content-Length: %d\r\n\r\n" % len(data))
            lines.append(data)
        request = b"".join(lines)
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = None if total_s is None else start + total_s
        # (A timer on the loop rather than a cancel scope around the call: the
        # head's wait is on every request's way to its first byte.)
        head_by = None if head_s is None else start + head_s
        connect_by = min((t for t in (deadline, head_by) if t is not None), default=None)
        conn = self._reuse(key)
        reused = conn is not None
        while True:
            if conn is None:
                if on_dispatch is not None:
                    told: Callable[[], None] = on_dispatch
                    on_dispatch = None
                    told()
                conn = await self._connect(key, connect_by)
            resp = HopResponse(conn, deadline)
            conn.start(resp, request)
            if on_dispatch is not None:
                told = on_dispatch
                on_dispatch = None
                try:
                    told()
                except BaseException:
                    resp.close()
                    raise
            try:
                await resp._wait_head(head_by)
            except aiohttp.ServerDisconnectedError:
                resp.close()
                # A kept connection the engine closed as it was reused gives nothing
                # back: the engine never saw the request, so it goes once more on a
                # new one.
                if not reused or resp._got_bytes:
                    raise
                reused, conn = False, None
                continue
            except BaseException:
                resp.close()
                raise
            return resp

    def _target(self, url: str) -> tuple[tuple[str, str, int], bytes]:
        got = self._urls.get(url)
        if got is None:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise aiohttp.InvalidURL(url)
            port = u.port or (443 if u.scheme == "https" else 80)
            path = (u.path or "/") + (f"?{u.query}" if u.query else "")
            host = u.hostname if u.port is None else f"{u.hostname}:{u.port}"
            if ":" in u.hostname:  # an IPv6 literal
                host = f"[{u.hostname}]" if u.port is None else f"[{u.hostname}]:{u.port}"
            target = f" {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
            got = ((u.scheme, u.hostname, port), target)
            if len(self._urls) >= _MAX_URLS:
                self._urls.clear()
            self._urls[url] = got
        return got

    def _reuse(self, key: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since <= KEEP_IDLE_S:
                return conn
            conn._abort()
        return None

    async def _connect(self, key: tuple[str, str, int], deadline: float | None) -> _Conn:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        limit = _CONNECT_S if deadline is None else min(_CONNECT_S, deadline - loop.time())
        ctx: ssl.SSLContext | None = None
        if scheme == "https":
            if self._ssl is None:  # (loading the trust store takes milliseconds: once)
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        with anyio.move_on_after(max(limit, 0.0)) as scope:
            _, proto = await loop.create_connection(lambda: _Conn(self, key), host, port, ssl=ctx)
            return proto
        assert scope.cancelled_caught
        if limit < _CONNECT_S:
            # The caller's budget ran out, not the engine's time to accept.
            raise TimeoutError(f"the request's time ran out connecting to {host}:{port}")
        raise aiohttp.ServerTimeoutError(f"connecting to {host}:{port} timed out")

    def _keep(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        now = time.monotonic()
        # The oldest first: kept too long, they are closed rather than left open.
        while idle and now - idle[0].idle_since > KEEP_IDLE_S:
            idle.popleft()._abort()
        if self.closed or len(idle) >= MAX_IDLE_PER_HOST:
            conn._abort()
            return
        conn.idle_since = now
        idle.append(conn)

    def _forget(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every idle connection; responses still open keep theirs until closed."""
        self.closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn._abort()
        self._idle.clear()

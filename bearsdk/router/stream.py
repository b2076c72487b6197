"""Streamed and whole responses: :class:`ChatStream` (incremental SSE) and :class:`ChatResponse`."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import anyio
import orjson

from bearsdk.router.decision import Decision
from bearsdk.router.errors import DispatchError, short

if TYPE_CHECKING:
    from bearsdk.router.dispatch import Dispatcher
    from bearsdk.router.slot import InstanceSlot

__all__ = ["ChatResponse", "ChatStream", "EngineResponse", "exc_text"]


class _Body(Protocol):
    async def readany(self) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


class EngineResponse(Protocol):
    """What the router reads of an engine's response: aiohttp's, or the hop's
    (:class:`bearsdk.io.hop.HopResponse`)."""

    @property
    def status(self) -> int: ...

    @property
    def content(self) -> _Body: ...

    def close(self) -> None: ...

    def release(self) -> Any: ...


def exc_text(exc: BaseException) -> str:
    """An exception's message, at most 200 characters."""
    text = str(exc) or "no details"
    return text if len(text) <= 200 else text[:200] + "..."


class ChatResponse(dict[str, Any]):
    """A whole (not streamed) response: the engine's JSON object, as a dict.

    Attributes:
        decision: The routing decision.
        instance: The instance that answered (after retries, maybe not the
            decision's first choice).
        latency_s: Time from sending to the whole answer.
    """

    decision: Decision
    instance: str
    latency_s: float


class ChatStream:
    """A streamed response: the engine's chunks, as they arrive.

    Iterate it (``async for chunk in stream``) for parsed chunk objects, or
    :meth:`raw` for the SSE bytes as the engine sent them (proxies). Closing it
    early (``await stream.aclose()``, or leaving ``async with``) closes the
    connection, which aborts the request at the engine. A stream that breaks,
    stalls longer than the router's ``idle_timeout_s``, sends an event that is
    not a JSON object or one larger than ``max_event_bytes`` raises
    :class:`DispatchError`; the connection is closed and the request ends.

    Attributes:
        decision: The routing decision.
        instance: The instance answering.
        ttft_s: Observed time to the first chunk, once it arrived.
        usage: The engine's usage report, once it arrived.
    """

    def __init__(
        self,
        dispatch: Dispatcher,
        inst: InstanceSlot,
        decision: Decision,
        resp: EngineResponse,
        sent_at: float,
        caller_usage: bool,
        prompt_text: str = "",
        caller_deadline: bool = False,
    ) -> None:
        self._sender = dispatch
        self._core = dispatch.core
        self._prompt_text = prompt_text
        self._inst = inst
        self.decision = decision
        self.instance = inst.name
        self._resp = resp
        self._sent_at = sent_at
        self._caller_usage = caller_usage
        self._caller_deadline = caller_deadline
        self.ttft_s: float | None = None
        # When the first chunk arrived; reported to the router once the caller
        # has it (its bookkeeping must not delay the first byte a proxy sends on).
        self._first_at: float | None = None
        self.usage: dict[str, Any] | None = None
        self._tokens = 0
        self._told = 0  # tokens reported to the router (after the first)
        self._done = False
        self._eof = False
        # Incremental SSE parsing: bytes not yet consumed, from where the line
        # search resumes (each byte is searched once, whatever the pieces' sizes).
        self._buf = bytearray()
        self._scan = 0
        self._data: list[bytes] = []  # the current event's data lines
        self._event_size = 0
        self._limit = dispatch.max_event_bytes
        self._idle_s = dispatch.idle_timeout_s
        # Parsed-out events not yet handed over: (data, object). The stream is its
        # own iterator (no async-generator layers): a chunk costs a few microseconds.
        self._ready: deque[tuple[bytes, dict[str, Any]]] = deque()

    async def __aenter__(self) -> ChatStream:
        return self

    def __del__(self) -> None:
        # Dropped unread and unclosed: take the request off the books (and free a
        # probe slot) rather than count it in flight for ever.
        if not getattr(self, "_done", True):
            self._inst.breaker.on_abandon()
            self._finish("cancelled")
            self._resp.close()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading; the engine aborts the request when the connection closes."""
        if not self._done:
            self._inst.breaker.on_abandon()
            self._finish("cancelled")
        self._eof = True
        self._ready.clear()
        self._resp.close()

    def _report_first(self) -> None:
        """Tell the router of the first chunk, once (after the caller was handed it)."""
        at = self._first_at
        if at is not None and self.ttft_s is not None:
            self._first_at = None
            self._core.first_token(self._inst, self.decision, self.ttft_s, now=at)

    def _finish(self, outcome: str) -> None:
        self._report_first()
        if not self._done:
            self._done = True
            self._core.completed(self._inst, self.decision, outcome, self.usage, self._prompt_text)

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            event = await self._next_event()
            if event is None:
                raise StopAsyncIteration
            if self._hidden(event[1]):
                continue
            return event[1]

    @property
    def ended(self) -> bool:
        """Whether the stream has nothing more to give: the chunk :meth:`raw_chunks`
        handed over last (the one ending in ``[DONE]``) was its last, or it was closed."""
        return self._eof and not self._ready

    def _hidden(self, doc: dict[str, Any]) -> bool:
        """The usage chunk the router asked for on its own behalf."""
        return not self._caller_usage and not doc.get("choices") and doc.get("usage") is not None

    async def raw(self) -> AsyncIterator[bytes]:
        """The SSE events as the engine sent them (``data: ...\\n\\n``)."""
        while True:
            event = await self._next_event()
            if event is None:
                break
            parts: list[bytes] = []
            self._emit(event, parts)
            if parts:
                yield b"".join(parts)
        yield b"data: [DONE]\n\n"

    async def raw_chunks(self) -> AsyncIterator[bytes]:
        """As :meth:`raw`, with the events that arrived together joined in one chunk.

        A proxy writes each chunk once: one write per read from the engine, not
        one per event (a stream's last read often holds several, and ``[DONE]``).
        """
        while True:
            event = await self._next_event()
            if event is None:
                yield b"data: [DONE]\n\n"
                return
            parts: list[bytes] = []
            self._emit(event, parts)
            while self._ready:
                self._emit(self._ready.popleft(), parts)
            if self._eof:
                parts.append(b"data: [DONE]\n\n")
            if parts:
                yield b"".join(parts)
            if self._eof:
                return

    def _emit(self, event: tuple[bytes, dict[str, Any]], parts: list[bytes]) -> None:
        data, doc = event
        if self._hidden(doc):
            return
        if b"\n" in data:  # a multi-line event: one line for the proxy's clients
            data = orjson.dumps(doc)
        parts += (b"data: ", data, b"\n\n")

    async def _next_event(self) -> tuple[bytes, dict[str, Any]] | None:
        """The next event, or ``None`` at the end of the stream."""
        if self._first_at is not None:
            self._report_first()
        while not self._ready:
            if self._eof:
                return None
            try:
                within = getattr(self._resp.content, "readany_within", None)
                got: bytes | None
                if within is not None:
                    # The hop's own timer: cheaper than a cancel scope per read.
                    got = await within(self._idle_s)
                else:
                    got = None
                    with anyio.move_on_after(self._idle_s):
                        got = await self._resp.content.readany()
                if got is None:
                    self._fail(f"stalled for {self._idle_s:g} s (idle_timeout_s)")
                piece = got or b""
                if not piece:  # the engine closed the stream without [DONE]
                    self._end()
                    return None
                self._parse(piece)
                if self._tokens > self._told and self._first_at is None and not self._done:
                    # Tokens after the first (that one is reported once handed
                    # on): each ended an engine step, which places the views.
                    self._told = self._tokens
                    self._core.tokens(self._inst)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                # A timeout here is the request's total budget; the caller's own
                # budget is not the instance's fault.
                fault = not (
                    self._caller_deadline
                    and isinstance(exc, TimeoutError)
                    and not isinstance(exc, aiohttp.ServerTimeoutError)
                )
                why = "the request's timeout_s ran out" if not fault else ""
                self._fail(why or f"{type(exc).__name__}: {exc_text(exc)}", fault=fault)
            except DispatchError:
                raise
            except BaseException:
                # Cancelled while waiting: the caller gave up on the request.
                self._eof = True
                self._inst.breaker.on_abandon()
                self._finish("cancelled")
                self._resp.close()
                raise
        return self._ready.popleft()

    def _fail(self, why: str, *, fault: bool = True) -> None:
        """End the stream on the instance's failure: close it, complete, raise."""
        self._report_first()
        self._eof = True
        self._ready.clear()
        self._resp.close()
        if fault:
            self._sender.failed(self._inst, self.decision, why, before_head=False)
        else:
            self._inst.breaker.on_abandon()
        self._finish("error")
        raise DispatchError(
            f"request {self.decision.request_id}: stream from {self.instance} broke: {why}",
            [(self.instance, why)],
            self.decision,
        )

    def _parse(self, piece: bytes) -> None:
        buf = self._buf
        buf += piece
        pos = 0
        while True:
            nl = buf.find(b"\n", self._scan)
            if nl < 0:
                break
            end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl  # CRLF
            start, pos = pos, nl + 1
            self._scan = pos
            if end == start:
                if self._data and self._dispatch():
                    return
            elif buf.startswith(b"data:", start):
                start += 6 if buf.startswith(b"data: ", start) else 5
                self._event_size += end - start + 1
                if self._event_size > self._limit:
                    self._fail(f"an event is larger than {self._limit} bytes (max_event_bytes)")
                with memoryview(buf) as view:  # one copy of the payload, not three
                    self._data.append(bytes(view[start:end]))
            # Other fields (event:, id:, retry:) and comments carry nothing here.
        if pos:
            del buf[:pos]
            self._scan -= pos
        self._scan = len(buf)
        if len(buf) > self._limit:
            self._fail(f"a line is longer than {self._limit} bytes (max_event_bytes)")

    def _dispatch(self) -> bool:
        """Hand over the event just ended; True at ``[DONE]``."""
        data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
        self._data = []
        self._event_size = 0
        if data == b"[DONE]":
            self._buf.clear()
            self._scan = 0
            self._end()
            return True
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            self._fail(f"an event is not a JSON object (got {short(data[:80])})")
        self._observe(doc)
        self._ready.append((data, doc))
        return False

    def _end(self) -> None:
        self._eof = True
        if not self._done:
            self._inst.breaker.on_success()
        self._finish("ok")
        self._resp.release()

    def _observe(self, doc: dict[str, Any]) -> None:
        if self.ttft_s is None:
            at = self._core.clock()
            self.ttft_s = at - self._sent_at
            self._first_at = at
        usage = doc.get("usage")
        if usage and isinstance(usage, dict):
            self.usage = usage
        self._tokens += 1

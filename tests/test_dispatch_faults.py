"""Dispatch against engines that misbehave: garbage, resets, hangs, oversized events.

Every exit of a dispatch (success, error, cancellation, garbage) must take the
request off the router's books exactly once, and must say which instance failed
and which decision the request followed. ``FakeEngine`` (also used by
``test_breaker_matrix.py``) is a port-0 OpenAI-style server whose next answers
misbehave on command.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import numpy as np
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.router import AsyncRouter, CircuitBreaker, DispatchError, InstanceConfig, RequestError
from bearsdk.selectors import LatencyAgnostic

MSG = [{"role": "user", "content": "Name three rivers."}]
MODEL = "Qwen/Qwen3-8B"

# What an engine does with a request. Before the head: ``status500``, ``reset``
# (connection dropped), ``hang``. After it: ``garbage`` (not JSON), ``not-object``
# (JSON, not an object), ``reset-after-head``, ``hang-after-head``. Streams only
# differ mid-stream: ``mid-reset``, ``mid-hang`` (after two good events), and
# ``no-blank`` (one endless ``data:`` line). ``slow``: a healthy stream, slowly.
MODES = (
    "ok",
    "slow",
    "status500",
    "reset",
    "hang",
    "garbage",
    "not-object",
    "reset-after-head",
    "hang-after-head",
    "mid-reset",
    "mid-hang",
    "no-blank",
)

_WHOLE = {
    "id": "cmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Nile, Amazon, Po."}}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
}


def _chunk(content: str | None, usage: bool = False) -> bytes:
    doc: dict[str, Any] = {"id": "cmpl-1", "object": "chat.completion.chunk"}
    doc["choices"] = [] if usage else [{"index": 0, "delta": {"content": content}}]
    if usage:
        doc["usage"] = _WHOLE["usage"]
    return b"data: " + orjson.dumps(doc) + b"\n\n"


GOOD_EVENTS = [_chunk(""), _chunk("Nile"), _chunk(", Amazon"), _chunk(", Po."), _chunk(None, True)]


class FakeEngine:
    """An OpenAI-style chat server on port 0 that misbehaves on command.

    ``queue`` holds the modes of the next requests; then ``default`` applies.
    Everything under ``/bear/`` is 404 (the router falls back to its own view).
    """

    def __init__(self) -> None:
        self.queue: deque[str] = deque()
        self.default = "ok"
        self.seen: list[str] = []
        self.on_request: Callable[[], None] | None = None
        self.url = ""
        self.no_blank_bytes = 4 << 20
        self.slow_s = 0.2  # between the events of a ``slow`` (but healthy) stream

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = self.queue.popleft() if self.queue else self.default
        self.seen.append(mode)
        if self.on_request is not None:
            self.on_request()
        stream = bool(body.get("stream"))
        if mode == "status500":
            return web.json_response({"error": "boom"}, status=500)
        if mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if mode == "hang":
            await anyio.sleep(3600)
        if not stream:
            return await self._whole(request, mode)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if mode in ("ok", "slow"):
            for event in GOOD_EVENTS:
                if mode == "slow":
                    await anyio.sleep(self.slow_s)
                await resp.write(event)
            await resp.write(b"data: [DONE]\n\n")
        elif mode == "garbage":
            await resp.write(b"data: <html>not json</html>\n\n")
            await anyio.sleep(3600)  # only the router closing the stream ends it
        elif mode == "not-object":
            await resp.write(b"data: [1, 2]\n\n")
            await anyio.sleep(3600)
        elif mode in ("reset-after-head", "mid-reset"):
            if mode == "mid-reset":
                for event in GOOD_EVENTS[:2]:
                    await resp.write(event)
            assert request.transport is not None
            request.transport.abort()
        elif mode in ("hang-after-head", "mid-hang"):
            if mode == "mid-hang":
                for event in GOOD_EVENTS[:2]:
                    await resp.write(event)
            await anyio.sleep(3600)
        elif mode == "no-blank":
            await resp.write(b"data: ")
            piece = b"x" * (64 << 10)
            for _ in range(self.no_blank_bytes // len(piece)):
                await resp.write(piece)
            await anyio.sleep(3600)
        return resp

    async def _whole(self, request: web.Request, mode: str) -> web.StreamResponse:
        if mode == "ok":
            return web.json_response(_WHOLE)
        if mode == "garbage":
            return web.Response(body=b"<html>not json</html>", content_type="application/json")
        if mode == "not-object":
            return web.Response(body=b"[1, 2]", content_type="application/json")
        if mode == "no-blank":  # a body over the router's cap
            return web.Response(body=b" " * self.no_blank_bytes, content_type="application/json")
        # A head that promises more body than comes.
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 4096
        await resp.prepare(request)
        if mode.startswith("mid"):
            await resp.write(b'{"id": "cmpl-1", ')
        if mode.endswith("reset"):
            assert request.transport is not None
            request.transport.abort()
        else:
            await anyio.sleep(3600)
        return resp

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FakeEngine]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        try:
            yield self
        finally:
            await runner.cleanup()


def config(engine: FakeEngine, name: str = "a", timeout_s: float = 20.0) -> InstanceConfig:
    return InstanceConfig(
        name=name, url=engine.url, model=MODEL, profile="qwen3-8b-h100", timeout_s=timeout_s
    )


def router_for(
    cfgs: list[InstanceConfig],
    *,
    breaker: CircuitBreaker | None = None,
    idle_timeout_s: float = 0.3,
    retries: int = 0,
    **kw: Any,
) -> AsyncRouter:
    return AsyncRouter(
        cfgs,
        LatencyAgnostic(),
        calibrate=False,
        retries=retries,
        breaker=breaker or CircuitBreaker(threshold=3, cooldown_s=60.0),
        idle_timeout_s=idle_timeout_s,
        **kw,
    )


def assert_off_the_books(router: AsyncRouter) -> None:
    """No dispatch left behind: in-flight count, overlay and statistics all empty."""
    for name in router.instances:
        assert router.inflight(name) == 0, name
        assert len(router.state(name).overlay) == 0, name
        assert not router._inst(name).stats._reqs, name


async def read_all(result: Any) -> list[dict[str, Any]]:
    """A stream's chunks, read to the end (a whole answer: itself)."""
    if isinstance(result, dict):
        return [result]
    return [chunk async for chunk in result]


# ---------------------------------------------------------------- defect 7


@pytest.mark.parametrize("mode", ["garbage", "not-object"])
async def test_a_whole_answer_that_is_not_a_json_object_is_a_dispatch_error(mode: str) -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = mode
        with anyio.fail_after(10), pytest.raises(DispatchError, match="not") as ei:
            await router.chat(MSG, max_tokens=5)
        assert ei.value.decision is not None
        assert ei.value.attempts[0][0] == "a"
        assert_off_the_books(router)
        eng.default = "ok"
        doc = await router.chat(MSG, max_tokens=5)  # the router is unharmed
        assert doc["choices"]
        assert_off_the_books(router)


@pytest.mark.parametrize("mode", ["garbage", "not-object"])
async def test_a_streamed_event_that_is_not_a_json_object_ends_the_stream(mode: str) -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = mode
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        with anyio.fail_after(10), pytest.raises(DispatchError, match="not a JSON object") as ei:
            await read_all(stream)
        assert ei.value.decision is stream.decision
        assert_off_the_books(router)
        with pytest.raises(StopAsyncIteration):  # ended for good, not resumable
            await stream.__anext__()


async def test_the_raw_stream_rejects_garbage_too() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = "garbage"
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        with anyio.fail_after(10), pytest.raises(DispatchError, match="not a JSON object"):
            async for _ in stream.raw():
                pass
        assert_off_the_books(router)


@pytest.mark.parametrize("mode", ["ok", "slow"])
async def test_raw_chunks_carry_the_raw_events_joined(mode: str) -> None:
    # A proxy's one write per read: the same bytes as raw(), fewer pieces.
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default, eng.slow_s = mode, 0.01
        one = [e async for e in (await router.chat(MSG, stream=True, max_tokens=5)).raw()]
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        joined, ended = [], []
        async for c in stream.raw_chunks():
            joined.append(c)
            ended.append(stream.ended)
        # Known at the last chunk itself (a proxy sends it with the body's end), not before.
        assert ended == [False] * (len(joined) - 1) + [True]
        assert b"".join(joined) == b"".join(one)
        assert joined[-1].endswith(b"data: [DONE]\n\n")
        if mode == "ok":  # everything in one read: one chunk
            assert len(joined) < len(one)
        assert_off_the_books(router)


async def test_raw_chunks_reject_garbage_too() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = "garbage"
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        with anyio.fail_after(10), pytest.raises(DispatchError, match="not a JSON object"):
            async for _ in stream.raw_chunks():
                pass
        assert_off_the_books(router)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["hang", "hang-after-head", "mid-hang"])
async def test_a_caller_giving_up_takes_the_request_off_the_books(stream: bool, mode: str) -> None:
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng)], idle_timeout_s=30.0) as router,
    ):
        eng.default = mode

        async def ask() -> None:
            result = await router.chat(MSG, stream=stream, max_tokens=5)
            await read_all(result)

        with anyio.move_on_after(0.3) as scope:
            await ask()
        assert scope.cancelled_caught
        assert_off_the_books(router)
        # giving up is no verdict on the instance
        assert router._inst("a").breaker.opens == 0


async def test_a_stream_closed_early_and_one_run_to_the_end_both_complete() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        async with stream:
            await stream.__anext__()
        assert_off_the_books(router)
        chunks = await read_all(await router.chat(MSG, stream=True, max_tokens=5))
        assert [c["choices"][0]["delta"]["content"] for c in chunks][1:] == [
            "Nile",
            ", Amazon",
            ", Po.",
        ]
        assert_off_the_books(router)
        doc = await router.chat(MSG, max_tokens=5)
        assert doc.instance == "a"
        assert_off_the_books(router)


async def test_a_stream_dropped_unread_is_taken_off_the_books() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = "hang-after-head"
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        assert router.inflight("a") == 1
        del stream
        gc.collect()
        assert_off_the_books(router)


# ---------------------------------------------------------------- defect 8


@pytest.mark.parametrize("stream", [False, True])
async def test_an_endless_event_or_body_is_cut_at_the_configured_size(stream: bool) -> None:
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng)], max_event_bytes=256 << 10, max_body_bytes=1 << 20) as router,
    ):
        eng.default = "no-blank"
        with anyio.fail_after(20), pytest.raises(DispatchError) as ei:
            await read_all(await router.chat(MSG, stream=stream, max_tokens=5))
        assert ("max_event_bytes" if stream else "max_body_bytes") in str(ei.value)
        assert_off_the_books(router)


def _parser(limit: int = 1 << 20) -> Any:
    """A ChatStream's parser alone, fed by hand."""
    from bearsdk.router.router import ChatStream

    class _Resp:
        def release(self) -> None: ...
        def close(self) -> None: ...

    class _Core:
        finished: ClassVar[list[str]] = []

        def clock(self) -> float:
            return 0.0

        def first_token(self, *a: object, now: float | None = None) -> None: ...

        def completed(self, inst: object, d: object, outcome: str, *a: object) -> None:
            self.finished.append(outcome)

    class _Dispatcher:
        max_event_bytes = limit
        idle_timeout_s = 1.0
        core = _Core()

        def failed(self, *a: object, **k: object) -> None: ...

    class _Breaker:
        def __getattr__(self, name: str) -> Callable[..., None]:
            return lambda *a: None

    class _Inst:
        name = "a"
        breaker = _Breaker()

    class _Decision:
        request_id = "r"

    return ChatStream(_Dispatcher(), _Inst(), _Decision(), _Resp(), 0.0, True)  # type: ignore[arg-type]


SSE = (
    b": a comment\n"
    b"event: message\nid: 1\n"
    b'data: {"a": 1}\n\n'
    b'data: {"b":\r\ndata: 2}\r\n\r\n'  # one event on two data lines, CRLF
    b'data:{"c": 3}\n\n'
    b"data: [DONE]\n\n"
    b'data: {"after": "done"}\n\n'
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(SSE)), max_size=12))
def test_the_sse_parser_gives_the_same_events_however_the_bytes_are_split(
    cuts: list[int],
) -> None:
    parser = _parser()
    bounds = [0, *sorted(set(cuts)), len(SSE)]
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo and not parser._eof:
            parser._parse(SSE[lo:hi])
    assert [doc for _, doc in parser._ready] == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert parser._eof


def test_the_sse_parser_bounds_lines_and_events() -> None:
    parser = _parser(limit=1000)
    for _ in range(20):  # one unterminated line, 50 bytes at a time
        parser._parse(b"x" * 50)
    assert len(parser._buf) == 1000
    with pytest.raises(DispatchError, match="longer than 1000 bytes"):
        parser._parse(b"x")
    parser = _parser(limit=1000)
    line = b"data: " + b"y" * 40 + b"\n"
    for _ in range(24):  # an endless event of short lines
        parser._parse(line)
    with pytest.raises(DispatchError, match="larger than 1000 bytes"):
        parser._parse(line)


# ---------------------------------------------------------------- API arguments (defect 13)


@pytest.mark.parametrize("bad", [-1, 0, -0.0, math.nan, -math.inf, "0.5", True, None.__class__])
async def test_nonsense_ttft_targets_are_refused_everywhere(bad: object) -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        with pytest.raises(RequestError, match="ttft_target") as ei:
            router.decide(MSG, ttft_target=bad)  # type: ignore[arg-type]
        assert isinstance(ei.value, ValueError)
        assert len(str(ei.value)) < 200
        with pytest.raises(RequestError, match="ttft_target"):
            await router.route(MSG, ttft_target=bad)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="ttft_target"):
            await router.chat(MSG, ttft_target=bad)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="ttft_target"):
            await router.completions("Hi", ttft_target=bad)  # type: ignore[arg-type]
        assert eng.seen == []  # nothing was sent
        assert_off_the_books(router)


async def test_numpy_numbers_are_numbers() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        d = router.decide(MSG, ttft_target=np.float32(0.5), max_tokens=np.int64(7))  # type: ignore[arg-type]
        assert d.ttft_target_s == 0.5
        assert d.output_tokens >= 0
        doc = await router.chat(MSG, max_tokens=np.int32(5), timeout_s=np.float64(10.0))
        assert doc["choices"]


async def test_an_infinite_ttft_target_means_no_target() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        d = router.decide(MSG, ttft_target=math.inf)
        assert d.ttft_target_s == math.inf
        assert "inf" in d.explain()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"stream_options": 5}, "stream_options"),
        ({"stop": {"a", "set"}}, "not JSON"),
    ],
)
async def test_nonsense_request_arguments_are_refused(kwargs: dict[str, Any], field: str) -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        with pytest.raises(RequestError, match=field) as ei:
            await router.chat(MSG, **kwargs)
        value = next(iter(kwargs.values()))
        assert (type(value).__name__ if field == "not JSON" else repr(value)[:20]) in str(ei.value)
        assert eng.seen == []
        assert_off_the_books(router)
    if field == "max_tokens":
        with pytest.raises(RequestError, match=field):
            router.decide(MSG, max_tokens=kwargs[field])


@pytest.mark.parametrize(
    ("messages", "kwargs", "field"),
    [
        (5, {}, "messages must be a list"),
        ("hi", {}, "messages must be a list"),
        ([1], {}, "messages\\[0\\]"),
        ([{"role": "user", "content": 7}], {}, "messages\\[0\\].content"),
        ([{"role": "user", "content": "x" * 10**6}], {"stream": "yes"}, "stream"),
    ],
)
async def test_nonsense_messages_are_refused(messages: Any, kwargs: Any, field: str) -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        with pytest.raises(RequestError, match=field) as ei:
            await router.chat(messages, **kwargs)
        assert len(str(ei.value)) < 300
        with pytest.raises(RequestError, match="request_id"):
            router.decide(MSG, request_id="r" * 10_000)
        with pytest.raises(RequestError, match="prompt must be a string"):
            await router.completions(MSG)  # type: ignore[arg-type]
        assert eng.seen == []
        assert_off_the_books(router)


def test_nonsense_router_settings_are_refused() -> None:
    cfg = InstanceConfig(name="a", url="http://127.0.0.1:9", model=MODEL, profile="qwen3-8b-h100")
    for kw in (
        {"idle_timeout_s": 0},
        {"idle_timeout_s": math.nan},
        {"max_event_bytes": 0},
        {"max_body_bytes": True},
        {"retries": -1},
        {"retries": 1.5},
    ):
        with pytest.raises(ValueError, match=next(iter(kw))):
            AsyncRouter([cfg], **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(cooldown_s=-1)
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(threshold=0)


# ---------------------------------------------------------------- deadlines, fallbacks


async def test_the_callers_deadline_is_not_the_instances_failure() -> None:
    async with FakeEngine().running() as eng, router_for([config(eng)]) as router:
        eng.default = "hang"
        for _ in range(5):  # more than the breaker's threshold
            with anyio.fail_after(10), pytest.raises(DispatchError):
                await router.chat(MSG, max_tokens=5, timeout_s=1e-9)
        for _ in range(5):
            with anyio.fail_after(10), pytest.raises(DispatchError):
                await read_all(await router.chat(MSG, stream=True, max_tokens=5, timeout_s=0.05))
        assert router._inst("a").breaker.opens == 0
        assert_off_the_books(router)
        eng.default = "ok"
        assert (await router.chat(MSG, max_tokens=5))["choices"]  # still routable
        # the instance's own budget running out is its failure
        eng.default = "hang"
    async with eng.running(), router_for([config(eng, timeout_s=0.05)]) as router:
        for _ in range(3):
            with anyio.fail_after(10), pytest.raises(DispatchError):
                await router.chat(MSG, max_tokens=5)
        assert router._inst("a").breaker.opens == 1
        assert_off_the_books(router)


@pytest.mark.parametrize("stream", [False, True])
async def test_the_callers_deadline_after_the_head_is_not_the_instances_failure(
    stream: bool,
) -> None:
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng)], idle_timeout_s=30.0) as router,
    ):
        for mode in ("hang-after-head", "mid-hang", "hang-after-head"):
            eng.default = mode
            with anyio.fail_after(10), pytest.raises(DispatchError, match="timeout_s"):
                await read_all(await router.chat(MSG, stream=stream, timeout_s=0.2))
        assert router._inst("a").breaker.opens == 0
        assert_off_the_books(router)


async def test_an_instance_that_cannot_be_tried_does_not_use_up_a_retry() -> None:
    async with (
        FakeEngine().running() as e0,
        FakeEngine().running() as e1,
        FakeEngine().running() as e2,
    ):
        cfgs = [config(e0, "a"), config(e1, "b"), config(e2, "c")]
        async with router_for(cfgs, retries=1) as router:
            order = router._fallback_order(router.decide(MSG))
            engines = {"a": e0, "b": e1, "c": e2}
            first, second, _ = (engines[n] for n in order)
            first.default = "status500"
            # while the first choice fails, the next one is drained
            first.on_request = lambda: router.drain_instance(order[1])
            doc = await router.chat(MSG, max_tokens=5)
            assert doc.instance == order[2]
            assert second.seen == []
            assert doc.decision.instance == order[0]
            assert_off_the_books(router)

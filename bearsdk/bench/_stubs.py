"""Stub engines the benches load: they answer at once, so what is timed is the caller's side.

:func:`stub_engine` answers every chat completion with 8 streamed chunks and a
usage chunk; :func:`serve_stub` serves any such handler on a free loopback port.
Both also run in the gateway bench's engine process.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import orjson
from aiohttp import web

__all__ = ["serve_stub", "stub_engine"]


async def serve_stub(
    chat: Callable[[web.Request], Awaitable[web.StreamResponse]],
    name: str,
    task_status: Any,
    backlog: int = 128,
) -> None:
    """Serve a stub engine on a free loopback port until cancelled; started with its URL.

    ``chat`` answers ``/v1/chat/completions``; ``/bear/snapshot`` says the engine
    is empty (so the router replays it) and ``/bear/batches`` is 404 (its
    profile's coefficients are kept).
    """

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def snapshot(request: web.Request) -> web.Response:
        doc = {
            "schema": "bear.snapshot/1",
            "instance": name,
            "seq": int(time.time() * 1e3),
            "time": time.time(),
            "requests": [],
        }
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/bear/batches", not_found)
    app.router.add_get("/bear/snapshot", snapshot)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        task_status.started(f"http://127.0.0.1:{port}")
        await anyio.sleep_forever()
    finally:
        await runner.cleanup()


async def stub_engine(task_status: Any) -> None:
    """An engine that answers every chat completion at once with 8 chunks."""
    created = int(time.time())

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": created,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
            }
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [],
            "usage": {"prompt_tokens": 50, "completion_tokens": 8, "total_tokens": 58},
        }
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    await serve_stub(chat, "stub", task_status)

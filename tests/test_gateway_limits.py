"""The gateway's own limits against a misbehaving engine and careless clients.

A caller's tiny deadline fails only that caller (the instance is not blamed); a
socket that never finishes its request head is closed after the header timeout
while a slow but healthy stream is not cut; an oversized body is a 413 that no
engine sees.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
from test_dispatch_faults import MODEL, FakeEngine, assert_off_the_books

from bearsdk.gateway import Gateway
from bearsdk.gateway.config import load_gateway_config
from bearsdk.gateway.server import listen, run_gateway

MSGS = [{"role": "user", "content": "Name three rivers."}]
SLACK_S = 10.0  # scheduling delays on a loaded machine; never a speed claim


@asynccontextmanager
async def gateway(
    tmp_path: Path, eng: FakeEngine, server: str = ""
) -> AsyncIterator[tuple[str, Gateway]]:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f"[server]\nport = 0\naccess_log = false\n{server}\n"
        '[router]\nselector = "latency-agnostic"\nretries = 0\n'
        f'[[instances]]\nname = "a"\nurl = "{eng.url}"\nmodel = "{MODEL}"\n'
        'profile = "qwen3-8b-h100"\ntimeout_s = 20\n',
        encoding="utf-8",
    )
    cfg = load_gateway_config(path)
    sock = listen("127.0.0.1", 0)
    urls: list[str] = []
    async with anyio.create_task_group() as tg:

        async def go(*, task_status: anyio.abc.TaskStatus[Gateway]) -> None:
            await run_gateway(
                cfg, sock, ready=urls.append, handle_signals=False, task_status=task_status
            )

        gw = await tg.start(go)
        try:
            yield urls[0], gw
        finally:
            tg.cancel_scope.cancel()


async def post(url: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=orjson.dumps(body)) as r,
    ):
        text = await r.read()
        try:
            return r.status, orjson.loads(text)
        except orjson.JSONDecodeError:
            return r.status, text.decode()


async def test_a_callers_tiny_deadline_fails_only_that_caller(tmp_path: Path) -> None:
    async with FakeEngine().running() as eng, gateway(tmp_path, eng) as (url, gw):
        eng.default = "hang"
        for _ in range(5):  # more than the breaker's threshold
            status, doc = await post(url, {"messages": MSGS, "bear": {"timeout_s": 0.01}})
            assert status == 502, doc
            assert doc["error"]["code"] == "dispatch_failed"
        assert str(gw.router.breaker_state("a")) == "closed"
        eng.default = "ok"
        status, doc = await post(url, {"messages": MSGS})
        assert status == 200, doc  # not 503: the instance was never at fault
        assert_off_the_books(gw.router)


async def test_a_slow_header_socket_is_closed_a_slow_stream_is_not(tmp_path: Path) -> None:
    timeout_s = 0.5
    server = f"header_timeout_s = {timeout_s}"
    async with FakeEngine().running() as eng, gateway(tmp_path, eng, server) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
            with anyio.fail_after(timeout_s + SLACK_S):
                rest = b""
                try:
                    while piece := await conn.receive():
                        rest += piece
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                    pass
        assert b"200" not in rest
        # A stream that lasts longer than the header timeout is not cut.
        eng.default, eng.slow_s = "slow", timeout_s / 2
        status, doc = await post(url, {"messages": MSGS, "stream": True})
        assert status == 200
        assert "[DONE]" in str(doc)
        assert "Amazon" in str(doc)


async def test_an_oversized_body_is_refused(tmp_path: Path) -> None:
    server = "max_body_bytes = 4096"
    async with FakeEngine().running() as eng, gateway(tmp_path, eng, server) as (url, _):
        huge = "x" * 5000
        status, doc = await post(url, {"messages": [{"role": "user", "content": huge}]})
        assert status == 413
        assert doc["error"]["code"] == "body_too_large"
        assert eng.seen == []

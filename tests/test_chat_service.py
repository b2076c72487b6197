"""examples/chat_service.py as a careless client and a careless operator would use it.

Request bodies are untrusted: an unknown field or a wrong type is a 400 naming
the field (never a 500, never a keyword argument of the router's); a caller's
tiny deadline fails only that caller; slow-header sockets are closed. The
process fails in one line when its port is taken, and Ctrl-C ends it with 130.
"""

from __future__ import annotations

import io
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
from aiohttp import web
from test_dispatch_faults import FakeEngine, assert_off_the_books, config, router_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import chat_service  # noqa: E402  (an example script, not a package)

MSGS = [{"role": "user", "content": "Name three rivers."}]
SLACK_S = 10.0  # scheduling delays on a loaded machine; never a speed claim


@asynccontextmanager
async def service(
    eng: FakeEngine, header_timeout_s: float = 15.0
) -> AsyncIterator[tuple[str, Any]]:
    async with router_for([config(eng)], idle_timeout_s=5.0) as router:
        runner = chat_service.make_runner(chat_service.build_app(router), header_timeout_s)
        await runner.setup()
        sock = chat_service.listen("127.0.0.1", 0)
        site = web.SockSite(runner, sock)
        await site.start()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}", router
        finally:
            await runner.cleanup()


async def post(url: str, body: Any, **kw: Any) -> tuple[int, dict[str, Any] | str]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=io.BytesIO(orjson.dumps(body)), **kw) as r,
    ):
        text = await r.text()
        try:
            return r.status, orjson.loads(text)
        except orjson.JSONDecodeError:
            return r.status, text


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("self", 1),  # was a keyword argument of router.chat: TypeError, HTTP 500
        ("retries", 3),
        ("colour", "blue"),  # was forwarded to the engine as it was
        ("ttft_target", [1]),  # was TypeError, HTTP 500
        ("ttft_target", -1),
        ("ttft_target", "soon"),
        ("stream_options", 5),  # was AttributeError, HTTP 500
        ("stream", "yes"),
        ("max_tokens", "5"),
        ("max_tokens", 0),
        ("temperature", "hot"),
        ("n", 1000),
        ("stop", 5),
        ("timeout_s", 1e-9),  # would fail every instance it touched
        ("timeout_s", 1e9),
        ("timeout_s", "x"),
        ("messages", []),
        ("messages", [1]),
        ("messages", "hi"),
    ],
)
async def test_a_bad_field_is_a_400_naming_it(field: str, value: Any) -> None:
    async with FakeEngine().running() as eng, service(eng) as (url, router):
        body: dict[str, Any] = {"model": "auto", "messages": MSGS, field: value}
        status, doc = await post(url, body)
        assert status == 400, doc
        assert isinstance(doc, dict)
        assert doc["error"]["param"] == field
        assert field in doc["error"]["message"]
        assert len(doc["error"]["message"]) < 300
        assert eng.seen == []  # nothing reached the engine
        assert_off_the_books(router)


async def test_known_fields_reach_the_engine_in_the_body() -> None:
    async with FakeEngine().running() as eng, service(eng) as (url, _):
        body = {"messages": MSGS, "temperature": 0.2, "stop": ["\n"], "top_k": 5, "user": None}
        status, doc = await post(url, body, headers={"X-TTFT-Target": "inf"})
        assert status == 200, doc
        status, doc = await post(url, {**body, "stream": True, "timeout_s": 30})
        assert status == 200
        assert "[DONE]" in str(doc)


async def test_a_callers_tiny_deadline_fails_only_that_caller() -> None:
    async with FakeEngine().running() as eng, service(eng) as (url, router):
        eng.default = "hang"
        lo = chat_service.TIMEOUT_RANGE_S[0]
        for _ in range(5):  # more than the breaker's threshold
            status, doc = await post(url, {"messages": MSGS, "timeout_s": lo})
            assert status == 502, doc
        assert str(router.breaker_state("a")) == "closed"
        eng.default = "ok"
        status, doc = await post(url, {"messages": MSGS})
        assert status == 200, doc  # not 503: the instance was never at fault
        assert_off_the_books(router)


async def test_a_slow_header_socket_is_closed_a_slow_stream_is_not() -> None:
    timeout_s = 0.5
    async with FakeEngine().running() as eng, service(eng, timeout_s) as (url, _):
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
        # a stream that lasts longer than the header timeout is not cut
        eng.default, eng.slow_s = "slow", timeout_s / 2
        status, doc = await post(url, {"messages": MSGS, "stream": True})
        assert status == 200
        assert "[DONE]" in str(doc)
        assert "Amazon" in str(doc)


async def test_an_oversized_body_is_refused() -> None:
    async with FakeEngine().running() as eng, service(eng) as (url, _):
        huge = "x" * (chat_service.MAX_BODY_BYTES + 1)
        status, _doc = await post(url, {"messages": [{"role": "user", "content": huge}]})
        assert status == 413
        assert eng.seen == []


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / "chat_service.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=EXAMPLES,
    )


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = _start("--port", str(port))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert err.count("\n") == 1
    assert err.startswith(f"chat_service.py: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_ctrl_c_exits_130_cleanly(when: str) -> None:
    proc = _start("--port", "0")
    assert proc.stdout is not None
    if when == "serving":
        assert "chat service on" in proc.stdout.readline()
    else:
        # Past the interpreter's own start-up (the script's first lines install
        # its handler), still loading libraries or starting the engines.
        maps = Path(f"/proc/{proc.pid}/maps")
        if not maps.exists():
            proc.kill()
            proc.communicate()
            pytest.skip("needs /proc to see how far the process got")
        deadline = time.monotonic() + 60
        while "aiohttp" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    assert err == "interrupted\n"  # no traceback, no "Unclosed client session"

"""The router's lean HTTP/1.1 client (bearsdk.io.hop), against raw port-0 servers."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest

pytest.importorskip("httptools")

from bearsdk.io import hop
from bearsdk.io.hop import HopSession

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw TCP server on a free port; yields its URL and the peers' ports it saw."""
    peers: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peers.append(w.get_extra_info("peername")[1])
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/chat/completions", peers
    finally:
        srv.close()
        await srv.wait_closed()


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    n = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await r.readexactly(n)


def chunked(*parts: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body


async def body_of(resp: hop.HopResponse) -> bytes:
    parts = []
    while piece := await resp.content.readany():
        parts.append(piece)
    resp.release()
    return b"".join(parts)


async def test_posts_keep_one_connection_and_read_chunked_and_sized_bodies() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(r)
            seen.append((head, body))
            if len(seen) % 2:
                w.write(chunked(b"data: a\n\n", b"data: b\n\n"))
            else:
                w.write(b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello")
            await w.drain()

    s = HopSession()
    async with server(handler) as (url, peers):
        for i in range(4):
            resp = await s.post(url, data=b'{"x":1}', headers={"X-Request-Id": f"r{i}"})
            assert resp.status == (200 if i % 2 == 0 else 201)
            got = await body_of(resp)
            assert got == (b"data: a\n\ndata: b\n\n" if i % 2 == 0 else b"hello")
        await s.close()
    assert len(peers) == 1  # one kept-alive connection for all four
    head, body = seen[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-Request-Id: r0\r\n" in head
    assert body == b'{"x":1}'


async def test_a_body_delimited_by_the_close_ends_cleanly_and_is_not_reused() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await w.drain()

    s = HopSession()
    async with server(handler) as (url, peers):
        for _ in range(2):
            resp = await s.post(url, data=b"{}", headers={})
            assert await body_of(resp) == b"all of it"
    assert len(peers) == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 2x0 OK\r\n\r\n",  # a status that is not a number
        b"NOT HTTP AT ALL\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (hop.MAX_HEAD_BYTES + 10) + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk size
    ],
)
async def test_a_malformed_response_is_a_client_error(reply: bytes) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(reply)
        await w.drain()
        await asyncio.sleep(1)

    s = HopSession()
    async with server(handler) as (url, _):
        with pytest.raises(aiohttp.ClientError):
            await body_of(await s.post(url, data=b"{}", headers={}))


async def test_a_connection_closed_before_the_head_is_a_disconnect() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)

    s = HopSession()
    async with server(handler) as (url, peers):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await s.post(url, data=b"{}", headers={})
    assert len(peers) == 1  # a fresh connection is not tried again


async def test_a_kept_connection_the_engine_closed_is_retried_once_on_a_new_one() -> None:
    n = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal n
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        n += 1
        if n == 1:
            # The next request on this connection is read and dropped unanswered:
            # what a server closing an idle connection as it arrives looks like.
            await read_request(r)

    s = HopSession()
    calls: list[int] = []
    async with server(handler) as (url, peers):
        assert await body_of(await s.post(url, data=b"{}", headers={})) == b"ok"
        resp = await s.post(url, data=b"{}", headers={}, on_dispatch=lambda: calls.append(1))
        assert await body_of(resp) == b"ok"
    assert len(peers) == 2
    assert calls == [1]  # once, though the request went out twice


async def test_on_dispatch_comes_once_after_the_write_on_a_kept_connection() -> None:
    got: list[bytes] = []
    second = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            _, body = await read_request(r)
            got.append(body)
            if len(got) == 2:
                second.set()
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()

    class Booked(Exception):
        pass

    def refuse() -> None:
        raise Booked

    s = HopSession()
    async with server(handler) as (url, peers):
        # A new connection: called before connecting, so nothing reaches the server.
        with pytest.raises(Booked):
            await s.post(url, data=b"new", headers={}, on_dispatch=refuse)
        assert peers == []
        calls: list[int] = []
        resp = await s.post(url, data=b"one", headers={}, on_dispatch=lambda: calls.append(1))
        assert await body_of(resp) == b"ok"
        assert calls == [1]
        # A kept one: the request is already written when it is called.
        with pytest.raises(Booked):
            await s.post(url, data=b"two", headers={}, on_dispatch=refuse)
        await asyncio.wait_for(second.wait(), 5)
        await s.close()
    assert got == [b"one", b"two"]
    assert len(peers) == 1


async def test_the_total_budget_ends_a_stalled_body_with_a_timeout() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        await asyncio.sleep(5)

    s = HopSession()
    async with server(handler) as (url, _):
        resp = await s.post(url, data=b"{}", headers={}, total_s=1.0)
        assert await resp.content.readany() == b"abc"
        with pytest.raises(TimeoutError):
            await resp.content.readany()


async def test_a_get_has_no_body_and_gives_the_content_length() -> None:
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for _ in range(2):
            seen.append(await r.readuntil(b"\r\n\r\n"))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nsnap")
            await w.drain()

    s = HopSession()
    async with server(handler) as (url, peers):
        for _ in range(2):
            resp = await s.get(url.replace("/v1/chat/completions", "/bear/snapshot"), total_s=5.0)
            assert (resp.status, resp.content_length) == (200, 4)
            assert await body_of(resp) == b"snap"
        assert len(peers) == 1  # one kept connection
    assert all(h.startswith(b"GET /bear/snapshot HTTP/1.1\r\n") for h in seen)
    assert not any(b"content-length" in h.lower() for h in seen)
    await s.close()


async def test_a_head_later_than_its_bound_is_a_timeout_and_the_connection_closes() -> None:
    gone = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await r.read()  # no answer; the client's close ends the wait
        gone.set()

    s = HopSession()
    async with server(handler) as (url, _):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError, match="head did not come"):
            await s.post(url, data=b"{}", headers={}, total_s=30.0, head_s=0.2)
        assert 0.15 <= loop.time() - t0 < 2.0
        await asyncio.wait_for(gone.wait(), 5)
        assert not any(s._idle.values())  # nothing kept


async def test_an_idle_read_gives_none_and_the_stream_goes_on() -> None:
    more = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        await more.wait()
        w.write(b"2\r\nde\r\n0\r\n\r\n")
        await w.drain()

    s = HopSession()
    async with server(handler) as (url, _):
        resp = await s.post(url, data=b"{}", headers={}, total_s=10.0, head_s=1.0)
        assert await resp.content.readany_within(5.0) == b"abc"
        assert await resp.content.readany_within(0.1) is None  # stalled: nothing lost
        more.set()
        assert await resp.content.readany_within(5.0) == b"de"
        assert await resp.content.readany_within(0.1) == b""  # the end, at once
        resp.release()


async def test_an_unread_body_stops_the_connection_reading_at_the_buffer_bound() -> None:
    piece = b"x" * 65536
    sent = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(256):  # 16 MiB offered
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            sent += len(piece)
        w.write(b"0\r\n\r\n")
        await w.drain()

    s = HopSession()
    async with server(handler) as (url, _):
        resp = await s.post(url, data=b"{}", headers={})
        await asyncio.sleep(0.5)
        # The client buffered its bound (plus at most what one read of the socket
        # brought) and stopped reading; the server is blocked on the rest.
        assert resp._buffered <= hop.MAX_BUFFER_BYTES + (256 << 10) + len(piece)
        assert sent < 256 * len(piece)
        total = len(await body_of(resp))
    assert total == 256 * len(piece)


async def test_closing_a_response_drops_its_connection() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"0\r\n\r\n")
            await w.drain()

    s = HopSession()
    async with server(handler) as (url, peers):
        resp = await s.post(url, data=b"{}", headers={})
        assert await resp.content.read(10) == b"a"
        resp.close()
        resp.close()  # twice is harmless
        with pytest.raises(aiohttp.ClientConnectionError):
            await resp.content.readany()
        assert await body_of(await s.post(url, data=b"{}", headers={})) == b"a"
    assert len(peers) == 2


async def test_bad_input_is_refused_before_anything_is_sent() -> None:
    s = HopSession()
    with pytest.raises(ValueError, match="line break"):
        await s.post("http://127.0.0.1:9/x", data=b"{}", headers={"X-Id": "a\r\nB: c"})
    with pytest.raises(aiohttp.InvalidURL):
        await s.post("ftp://example/x", data=b"{}", headers={})
    await s.close()
    with pytest.raises(aiohttp.ClientConnectionError, match="closed"):
        await s.post("http://127.0.0.1:9/x", data=b"{}", headers={})


@pytest.mark.parametrize("client", ["hop", "aiohttp"])
async def test_the_router_streams_by_its_own_client_or_by_aiohttp(
    client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bearsdk.emulator import EnginePool
    from bearsdk.router import AsyncRouter, InstanceConfig
    from bearsdk.selectors import BEAR

    if client == "aiohttp":
        monkeypatch.setenv("BEARSDK_HOP", "aiohttp")
    msg = [{"role": "user", "content": "Name three rivers."}]
    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        e = next(iter(pool))
        cfg = InstanceConfig(
            name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile
        )
        async with AsyncRouter([cfg], BEAR()) as router:
            assert (router._dispatch.hop is not None) == (client == "hop")
            for _ in range(3):
                stream = await router.chat(msg, stream=True, max_tokens=5, ttft_target=5.0)
                chunks = [c async for c in stream]
                assert chunks
                assert stream.usage is not None
                assert stream.usage["completion_tokens"] == 5
            whole = await router.chat(msg, max_tokens=4, ttft_target=5.0)
            assert whole["usage"]["completion_tokens"] == 4


async def test_a_dropped_response_closes_its_connection() -> None:
    closed = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await w.drain()
        await r.read()  # until the client closes
        closed.set()

    s = HopSession()
    async with server(handler) as (url, _):
        resp = await s.post(url, data=b"{}", headers={})
        del resp
        await asyncio.wait_for(closed.wait(), 5)


@pytest.fixture
def certificate(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-nodes", "-days", "1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", str(key), "-out", str(cert)),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_https_engine(certificate: tuple[pathlib.Path, pathlib.Path]) -> None:
    cert, key = certificate
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
        await w.drain()
        w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0, ssl=server_ctx)
    port = srv.sockets[0].getsockname()[1]
    try:
        s = HopSession(ssl_context=ssl.create_default_context(cafile=str(cert)))
        resp = await s.post(f"https://127.0.0.1:{port}/x", data=b"{}", headers={})
        assert await body_of(resp) == b"secret"
        # The system's trust store does not know this certificate.
        with pytest.raises(ssl.SSLError):
            await HopSession().post(f"https://127.0.0.1:{port}/x", data=b"{}", headers={})
        await s.close()
    finally:
        srv.close()
        await srv.wait_closed()


async def test_connections_idle_too_long_are_closed_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()

    monkeypatch.setattr(hop, "KEEP_IDLE_S", 0.05)
    s = HopSession()
    async with server(handler) as (url, peers):
        first = await s.post(url, data=b"{}", headers={})
        second = await s.post(url, data=b"{}", headers={})
        assert await body_of(first) == b"ok"  # kept
        await asyncio.sleep(0.1)
        assert await body_of(second) == b"ok"  # kept; the first, stale, closed
        assert len(s._idle[next(iter(s._idle))]) == 1
        await asyncio.sleep(0.1)
        assert await body_of(await s.post(url, data=b"{}", headers={})) == b"ok"
        await s.close()
    assert len(peers) == 3  # the stale second was not reused either


async def test_an_informational_response_is_skipped() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await w.drain()
        await asyncio.sleep(0.1)  # apart: the client must wait past the interim one
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbody")
        await w.drain()

    s = HopSession()
    async with server(handler) as (url, _):
        resp = await s.post(url, data=b"{}", headers={})
        assert resp.status == 200
        assert await body_of(resp) == b"body"

"""Poll and push sources against a small engine stand-in (SnapshotPublisher on aiohttp, port 0)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import attrs
import orjson
import pytest
from aiohttp import web

from bearsdk.io import Backoff, PollSource, PushSource, SnapshotPublisher, SnapshotSource

try:
    from bearsdk.io.hop import HopSession
except ImportError:  # httptools missing: the hop's kind is left out
    HopSession = None  # type: ignore[assignment,misc]
from bearsdk.state import SnapshotCache

FAST = Backoff(initial_s=0.01, max_s=0.05)


def doc(seq: int, epoch: str, n: int = 1) -> dict[str, Any]:
    return {
        "schema": "bear.snapshot/1",
        "instance": "eng-0",
        "seq": seq,
        "time": 1.0e9 + seq,
        "epoch": epoch,
        "requests": [
            {
                "id": f"r{i}",
                "state": "waiting",
                "prompt_tokens": 10 + i,
                "computed_tokens": 0,
                "output_tokens": 0,
            }
            for i in range(n)
        ],
    }


@attrs.define
class Engine:
    """A stand-in engine serving docs/protocol.md's snapshot endpoints."""

    pub: SnapshotPublisher
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        self.pub.add_routes(app)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.runner = runner
        self.port = int(runner.addresses[0][1])

    async def stop(self) -> None:
        self.pub.close()
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    def publish(self, seq: int, n: int = 1) -> None:
        assert self.pub.epoch is not None
        self.pub.publish(doc(seq, self.pub.epoch, n))


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine(SnapshotPublisher("eng-0", heartbeat_s=0.1))
    await e.start()
    yield e
    await e.stop()


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.005)


def seq_is(cache: SnapshotCache, seq: int) -> Callable[[], bool]:
    return lambda: cache.entry is not None and cache.entry.seq == seq


def rejections(cache: SnapshotCache, n: int) -> Callable[[], bool]:
    return lambda: cache.stats().rejected_total >= n


_HOPS: list[HopSession] = []


def _poll_by_hop(url: str) -> PollSource:
    # The router's own client, as AsyncRouter hands it to the poll sources.
    _HOPS.append(HopSession())
    return PollSource(url, interval_s=0.005, timeout_s=1.0, backoff=FAST, hop=_HOPS[-1])


@pytest.fixture(autouse=True)
async def _close_hops() -> AsyncIterator[None]:
    yield
    while _HOPS:
        await _HOPS.pop().close()


SOURCES: dict[str, Callable[[str], SnapshotSource]] = {
    "poll": lambda url: PollSource(url, interval_s=0.005, timeout_s=1.0, backoff=FAST),
    "push": lambda url: PushSource(url, heartbeat_s=0.1, connect_timeout_s=1.0, backoff=FAST),
}
if HopSession is not None:
    SOURCES["poll-hop"] = _poll_by_hop


@pytest.fixture(params=sorted(SOURCES))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_snapshots_arrive_and_the_cache_follows_seq(engine: Engine, kind: str) -> None:
    cache = SnapshotCache("eng-0")
    src = SOURCES[kind](engine.url)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)
        assert cache.entry is not None  # ready means the first attempt delivered seq 0
        assert cache.entry.seq == 0
        for seq in range(1, 6):
            engine.publish(seq, n=seq)
            await until(seq_is(cache, seq))
        assert cache.entry.snapshot.ids == tuple(f"r{i}" for i in range(5))
        assert cache.entry.source == src.name
        tg.cancel_scope.cancel()
    st = src.stats()
    assert st.connects >= 1
    assert st.failures == 0
    assert cache.stats().rejected == {}


async def test_injected_bad_snapshots_leave_the_cache_untouched(engine: Engine, kind: str) -> None:
    cache = SnapshotCache("eng-0")
    src = SOURCES[kind](engine.url)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)
        engine.publish(10)
        await until(seq_is(cache, 10))
        good = cache.entry
        bad = [
            b'{"schema": "bear.snapshot/1", "seq": ',  # malformed JSON
            orjson.dumps({**doc(11, "x"), "schema": "nope"}),  # wrong schema
            orjson.dumps({**doc(12, engine.pub.epoch or ""), "seq": -4}),  # bad field
            orjson.dumps(doc(3, engine.pub.epoch or "")),  # out of order
        ]
        for i, data in enumerate(bad):
            engine.pub.publish(data)
            await until(rejections(cache, i + 1))
            assert cache.entry is good
        engine.publish(13)
        await until(seq_is(cache, 13))
        tg.cancel_scope.cancel()
    assert cache.stats().rejected == {"malformed": 1, "schema": 1, "field": 1, "stale-seq": 1}


async def test_engine_restart_with_seq_starting_over(engine: Engine, kind: str) -> None:
    cache = SnapshotCache("eng-0")
    src = SOURCES[kind](engine.url)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)
        engine.publish(40)
        await until(seq_is(cache, 40))
        old_epoch = engine.pub.epoch
        # the process goes away (connections refused), then comes back on its port
        await engine.stop()
        await anyio.sleep(0.05)
        engine.pub.restart()
        await engine.start()
        assert engine.pub.epoch != old_epoch
        await until(lambda: cache.entry is not None and cache.entry.snapshot.epoch != old_epoch)
        engine.publish(1)
        await until(seq_is(cache, 1))
        tg.cancel_scope.cancel()
    assert cache.stats().restarts == 1
    assert src.stats().failures >= 1  # the refused connections were counted


async def test_push_without_epoch_resumes_after_reconnect(engine: Engine) -> None:
    """An epoch-less engine: a lower seq is accepted as the first line of a new connection."""
    cache = SnapshotCache("eng-0")
    src = PushSource(engine.url, heartbeat_s=0.1, backoff=FAST)

    def plain(seq: int) -> bytes:
        d = doc(seq, "x")
        del d["epoch"]
        return orjson.dumps(d)

    async with anyio.create_task_group() as tg:
        engine.pub.publish(plain(30))
        await tg.start(src.run, cache)
        await until(seq_is(cache, 30))
        engine.pub.publish(plain(2))  # same connection: stale
        await until(lambda: cache.stats().rejected_total == 1)
        engine.pub.close()  # the stream drops; its replacement starts with seq 2
        await until(seq_is(cache, 2))
        tg.cancel_scope.cancel()
    assert cache.stats().restarts == 1


async def test_push_reconnects_after_silence() -> None:
    """A server that accepts the stream but never writes: 3 heartbeats of silence, reconnect."""
    hits = 0

    async def silent(request: web.Request) -> web.StreamResponse:
        nonlocal hits
        hits += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await anyio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_get("/bear/snapshots", silent)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        cache = SnapshotCache("eng-0")
        src = PushSource(url, heartbeat_s=0.02, backoff=FAST)
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, cache)  # ready after the first (silent) attempt failed
            await until(lambda: hits >= 3)
            tg.cancel_scope.cancel()
        assert src.stats().failures >= 2
        assert "TimeoutError" in (src.stats().last_error or "")
        assert cache.entry is None
    finally:
        await runner.cleanup()


async def test_sources_start_while_the_engine_is_down(kind: str) -> None:
    """Readiness comes after the first attempt even when it fails; the source keeps trying."""
    e = Engine(SnapshotPublisher("eng-0", heartbeat_s=0.1))
    await e.start()
    port = e.port
    await e.stop()
    cache = SnapshotCache("eng-0")
    src = SOURCES[kind](f"http://127.0.0.1:{port}")
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(5):
            await tg.start(src.run, cache)
        assert cache.entry is None
        assert src.stats().failures >= 1
        await e.start()
        try:
            await until(seq_is(cache, 0))
        finally:
            tg.cancel_scope.cancel()
            await e.stop()


async def test_http_error_status_is_a_counted_failure(kind: str) -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "down", "type": "x"}}, status=503)

    app = web.Application()
    app.router.add_get("/bear/snapshot", broken)
    app.router.add_get("/bear/snapshots", broken)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        cache = SnapshotCache("eng-0")
        src = SOURCES[kind](f"http://127.0.0.1:{runner.addresses[0][1]}")
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, cache)
            await until(lambda: src.stats().failures >= 2)
            tg.cancel_scope.cancel()
        assert "HTTP 503" in (src.stats().last_error or "")
    finally:
        await runner.cleanup()


async def test_push_coalesces_and_honours_min_interval(engine: Engine) -> None:
    cache = SnapshotCache("eng-0")
    src = PushSource(engine.url, heartbeat_s=0.1, min_interval_ms=30, backoff=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)
        for seq in range(1, 200):
            engine.publish(seq)
        await until(seq_is(cache, 199))
        tg.cancel_scope.cancel()
    # 199 publications in a burst arrive as a few coalesced lines, ending at the latest
    assert src.stats().documents < 50


@pytest.mark.parametrize("by_hop", [False, True])
async def test_poll_rejects_oversized_bodies(engine: Engine, by_hop: bool) -> None:
    if by_hop and HopSession is None:
        pytest.skip("httptools is not installed")
    cache = SnapshotCache("eng-0")
    hop = HopSession() if by_hop else None
    if hop is not None:
        _HOPS.append(hop)
    src = PollSource(engine.url, interval_s=0.005, max_bytes=300, backoff=FAST, hop=hop)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)
        engine.publish(5, n=20)
        await until(lambda: cache.stats().rejected.get("too-large", 0) >= 1)
        tg.cancel_scope.cancel()
    assert cache.entry is not None
    assert cache.entry.seq == 0


def test_source_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="url must start with http"):
        PollSource("localhost:8000")
    with pytest.raises(ValueError, match="interval_s must be a finite number > 0"):
        PollSource("http://x", interval_s=0)
    with pytest.raises(ValueError, match="heartbeat_s"):
        PushSource("http://x", heartbeat_s=-1)
    with pytest.raises(ValueError, match="jitter must be in"):
        Backoff(jitter=2)


def test_backoff_grows_and_caps() -> None:
    b = Backoff(initial_s=0.1, max_s=1.0, factor=2.0, jitter=0.0)
    assert [b.delay(k) for k in (1, 2, 3, 4, 5, 10)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    j = Backoff(initial_s=1.0, max_s=1.0, jitter=0.5)
    assert all(0.5 <= j.delay(3) <= 1.0 for _ in range(100))


def test_sources_satisfy_the_protocol() -> None:
    for make in SOURCES.values():
        assert isinstance(make("http://x"), SnapshotSource)


@pytest.mark.parametrize("raw", ["inf", "nan", "1e308", "-5", "x" * 500])
async def test_push_min_interval_is_bounded(engine: Engine, raw: str) -> None:
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{engine.url}/bear/snapshots", params={"min_interval_ms": raw}) as r,
    ):
        assert r.status == 400
        msg = (await r.json())["error"]["message"]
    assert "min_interval_ms must be a number in [0, 60000]" in msg
    assert len(msg) < 200

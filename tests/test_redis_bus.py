"""The Redis bus against a real redis-server: snapshots, dispatch events, outages, slowness."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.cluster import DispatchEvent, RedisBus, RedisSnapshotBridge, RedisSource
from bearsdk.cluster.local import LocalRedis
from bearsdk.cluster.wire import key_name, redact_url
from bearsdk.io import Backoff, PushSource, SnapshotPublisher
from bearsdk.state import SnapshotCache

FAST = Backoff(initial_s=0.01, max_s=0.05)


def doc(seq: int, epoch: str = "e1") -> bytes:
    return orjson.dumps(
        {
            "schema": "bear.snapshot/1",
            "instance": "eng-0",
            "seq": seq,
            "time": time.time(),
            "epoch": epoch,
            "requests": [
                {
                    "id": "r0",
                    "state": "waiting",
                    "prompt_tokens": 10,
                    "computed_tokens": 0,
                    "output_tokens": 0,
                }
            ],
        }
    )


def bus(server: LocalRedis | str, prefix: str = "t", **kw: Any) -> RedisBus:
    kw.setdefault("backoff", FAST)
    return RedisBus(server if isinstance(server, str) else server.url, prefix=prefix, **kw)


def fresh_prefix() -> str:
    """Keys of this test only (the server may be shared with other tests)."""
    return f"t{uuid.uuid4().hex[:10]}"


async def until(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.005)


def seq_of(cache: SnapshotCache) -> int:
    e = cache.entry
    return -1 if e is None else e.seq


class Engine:
    """A stand-in engine: a SnapshotPublisher on aiohttp (port 0)."""

    def __init__(self) -> None:
        self.pub = SnapshotPublisher("eng-0", heartbeat_s=0.1, epoch="e1")
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        self.pub.add_routes(app)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.pub.close()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = Engine()
    await e.start()
    yield e
    await e.stop()


# ---------------------------------------------------------------------- no server needed


def test_dispatch_event_round_trip() -> None:
    ev = DispatchEvent("r1", "dispatch", "eng-0", "bear-x-1", 12.5, 300, 40)
    assert DispatchEvent.decode(ev.encode()) == ev
    done = DispatchEvent("r1", "complete", "eng-0", "bear-x-1", 13.0)
    assert DispatchEvent.decode(done.encode()) == done


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"{", "not JSON"),
        (b"[1,2]", "7-element array"),
        (b'["r","boom","i","x",1.0,1,null]', "kind"),
        (b'["r","dispatch","","x",1.0,1,null]', "instance"),
        (b'["r","dispatch","i","x","t",1,null]', "time"),
        (b'["r","dispatch","i","x",1.0,0,null]', "prompt_tokens"),
        (b'["r","dispatch","i","x",1.0,5,0]', "output_tokens"),
    ],
)
def test_dispatch_event_errors_name_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DispatchEvent.decode(raw)


def test_bus_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"url must start with redis://.*'http://x'"):
        RedisBus("http://x")
    with pytest.raises(ValueError, match="prefix must be a non-empty string"):
        RedisBus(prefix="a b")
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number > 0 \(got 0\)"):
        RedisBus(timeout_s=0)
    with pytest.raises(ValueError, match="max_queue must be an integer >= 1"):
        RedisBus(max_queue=0)


async def test_publishing_never_blocks_and_the_queue_is_bounded() -> None:
    # Nothing listens on this port: the bus is down from the start.
    down = RedisBus(LocalRedis().url, max_queue=10, backoff=FAST)
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(2.0):
            await tg.start(down.run)
        assert not down.connected
        t0 = time.perf_counter()
        for i in range(100):
            down.publish_dispatch(DispatchEvent("r", "dispatch", "i", f"x{i}", 1.0, 5))
            down.publish_snapshot("i", doc(i))
        assert time.perf_counter() - t0 < 0.05
        s = down.stats()
        assert s.events_dropped == 90
        assert s.failures >= 1
        assert not s.connected
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------------- peers and secrets


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret-pw@127.0.0.1:{port}/0", "redis://:***@127.0.0.1:{port}/0"),
        ("redis://alice:s3cret-pw@127.0.0.1:{port}/0", "redis://alice:***@127.0.0.1:{port}/0"),
        (
            "redis://127.0.0.1:{port}/0?password=s3cret-pw&db=1",
            "redis://127.0.0.1:{port}/0?password=***&db=1",
        ),
    ],
)
async def test_the_password_of_a_redis_url_is_never_logged(
    url: str, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = LocalRedis().port  # nothing listens there: the bus logs its failure
    url, shown = url.format(port=port), shown.format(port=port)
    down = RedisBus(url, backoff=FAST)
    assert "s3cret" not in repr(down)
    assert "s3cret" not in down.name
    assert shown in down.name
    with caplog.at_level(logging.DEBUG, logger="bearsdk"):
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(5.0):
                await tg.start(down.run)
            await until(lambda: down.stats().failures >= 2)
            tg.cancel_scope.cancel()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings, "the failure to connect is logged"
    assert shown in caplog.text
    assert "s3cret" not in caplog.text
    assert "s3cret" not in (down.stats().last_error or "")
    with pytest.raises(ValueError, match=r"http://:\*\*\*@x") as info:
        RedisBus("http://:s3cret-pw@x")
    assert "s3cret" not in str(info.value)


def test_redact_url_leaves_urls_without_a_password_alone() -> None:
    for url in ("redis://127.0.0.1:6379/0", "redis://alice@h/0", "unix:///tmp/r.sock?db=2"):
        assert redact_url(url) == url
    assert redact_url("rediss://u:p@q@h:1/0") == "rediss://u:***@h:1/0"


def test_snapshot_keys_of_different_names_never_collide() -> None:
    # The reported collision: prefix bear:snap:x + instance y == prefix bear + instance x:snap:y.
    assert RedisBus(prefix="bear:snap:x").snapshot_key("y") != RedisBus(prefix="bear").snapshot_key(
        "x:snap:y"
    )
    # Names without ':' or '%' keep their readable key.
    assert RedisBus(prefix="bear").snapshot_key("eng-0") == "bear:snap:eng-0"
    assert RedisBus(prefix="bear").snapshot_key("a:b%c") == "bear:snap:a%3Ab%25c"
    # {prefix}:dispatch of prefix 'x:snap' would be instance 'dispatch''s snapshot under 'x'.
    with pytest.raises(ValueError, match="prefix must not end with ':snap'"):
        RedisBus(prefix="x:snap")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(st.sampled_from("ab:%s"), min_size=1, max_size=8).filter(
                lambda p: not p.endswith(":snap")
            ),
            st.text(st.sampled_from("ab:%s3A"), min_size=1, max_size=8),
        ),
        min_size=2,
        max_size=6,
        unique=True,
    )
)
def test_keys_are_one_to_one(names: list[tuple[str, str]]) -> None:
    keys: dict[str, tuple[str, str | None]] = {}
    for prefix, instance in names:
        b = RedisBus(prefix=prefix)
        for key, owner in ((b.snapshot_key(instance), instance), (b.dispatch_key, None)):
            prev = keys.setdefault(key, (prefix, owner))
            assert prev == (prefix, owner), key
    for _, instance in names:
        assert ":" not in key_name(instance)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'["r","dispatch","i","x",1.0,' + str(2**63 - 1).encode() + b",null]", "prompt_tokens"),
        (b'["r","dispatch","i","x",1.0,5,' + str(2**63 - 1).encode() + b"]", "output_tokens"),
        (b'["r","dispatch","i","' + b"x" * 600 + b'",1.0,5,null]', "rid"),
        (b'["r","dispatch","i","x",1.0,5,null,' + b"1," * 3000 + b"1]", "4096 bytes"),
        (b"[" * 1000 + b"]" * 1000, "not JSON|array"),
        (b"[" * 500 + b"]" * 500, "7-element array"),
    ],
)
def test_forged_dispatch_events_are_bounded(raw: bytes, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        DispatchEvent.decode(raw)
    assert len(str(info.value)) <= 1024


# ---------------------------------------------------------------------- snapshots


async def test_snapshots_reach_subscribers_and_late_joiners(redis_url: str) -> None:
    px = fresh_prefix()
    writer, reader = bus(redis_url, px), bus(redis_url, px)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        await tg.start(reader.run)
        cache = SnapshotCache("eng-0")
        src = RedisSource(reader, "eng-0")
        writer.publish_snapshot("eng-0", doc(1))
        await until(lambda: reader.connected and writer.stats().snapshots_written >= 1)
        # Ready after the first attempt, which found the latest snapshot.
        await tg.start(src.run, cache)
        assert seq_of(cache) == 1
        for s in (2, 3, 4):
            writer.publish_snapshot("eng-0", doc(s))
        await until(lambda: seq_of(cache) == 4)
        assert cache.stats().rejected_total == 0
        assert src.stats().connects == 1
        assert not src.using_fallback
        tg.cancel_scope.cancel()


async def test_keepalive_resends_until_held(redis_url: str) -> None:
    px = fresh_prefix()
    writer, reader = bus(redis_url, px, keepalive_s=0.05), bus(redis_url, px)
    got: list[bytes] = []
    reader.subscribe_snapshots("eng-0", got.append)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        await tg.start(reader.run)
        writer.publish_snapshot("eng-0", doc(7))
        await until(lambda: len(got) >= 4)  # one publication, re-sent while nothing changes
        assert set(got) == {doc(7)} or all(orjson.loads(d)["seq"] == 7 for d in got)
        writer.hold("eng-0")
        await anyio.sleep(0.1)
        n = len(got)
        await anyio.sleep(0.2)
        assert len(got) == n
        tg.cancel_scope.cancel()


async def test_malformed_entries_are_rejected_and_counted(redis_url: str) -> None:
    px = fresh_prefix()
    import redis.asyncio

    reader = bus(redis_url, px)
    cache = SnapshotCache("eng-0")
    raw = redis.asyncio.Redis.from_url(redis_url)
    async with anyio.create_task_group() as tg:
        await tg.start(reader.run)
        await tg.start(RedisSource(reader, "eng-0").run, cache)
        events: list[DispatchEvent] = []
        reader.subscribe_dispatches(events.append)
        await raw.xadd(f"{px}:snap:eng-0", {"d": b"not json"})
        await raw.xadd(f"{px}:dispatch", {"e": b'["r","nope","i","x",1.0,1,null]'})
        good = DispatchEvent("r", "dispatch", "eng-0", "x", 1.0, 5)
        await raw.xadd(f"{px}:dispatch", {"e": good.encode()})
        await until(lambda: cache.stats().rejected.get("malformed") == 1 and events == [good])
        assert reader.stats().events_malformed == 1
        assert cache.entry is None
        tg.cancel_scope.cancel()
    await raw.aclose()


async def test_a_subscriber_failing_on_an_entry_does_not_stop_the_reader(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    px = fresh_prefix()
    import redis.asyncio

    reader = bus(redis_url, px)
    raw = redis.asyncio.Redis.from_url(redis_url)
    seen: list[int] = []

    def fragile(ev: DispatchEvent) -> None:
        if ev.rid == "boom":
            raise RuntimeError("a bug in a subscriber")
        seen.append(ev.prompt_tokens)

    async with anyio.create_task_group() as tg:
        await tg.start(reader.run)
        reader.subscribe_dispatches(fragile)
        for rid, n in (("a", 1), ("boom", 2), ("b", 3)):
            ev = DispatchEvent("r", "dispatch", "eng-0", rid, 1.0, n)
            await raw.xadd(f"{px}:dispatch", {"e": ev.encode()})
        await until(lambda: seen == [1, 3])
        assert reader.stats().callback_errors == 1
        assert "a bug in a subscriber" in caplog.text
        tg.cancel_scope.cancel()
    await raw.aclose()


# ---------------------------------------------------------------------- dispatch events


async def test_dispatch_events_reach_every_bus_in_order(redis_url: str) -> None:
    px = fresh_prefix()
    a, b = bus(redis_url, px), bus(redis_url, px)
    seen_a: list[DispatchEvent] = []
    seen_b: list[DispatchEvent] = []
    a.subscribe_dispatches(seen_a.append)
    b.subscribe_dispatches(seen_b.append)
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        await tg.start(b.run)
        sent = [
            DispatchEvent("ra", "dispatch", "eng-0", f"q{i}", 1.0 + i, 10 + i) for i in range(20)
        ]
        sent.append(DispatchEvent("ra", "complete", "eng-0", "q0", 30.0))
        for ev in sent:
            a.publish_dispatch(ev)
        await until(lambda: len(seen_a) == len(seen_b) == len(sent))
        assert seen_a == sent  # its own too: replicas filter by replica id
        assert seen_b == sent
        assert a.stats().events_written == len(sent)
        tg.cancel_scope.cancel()


async def test_queued_events_are_sent_when_redis_comes_up(redis_server: LocalRedis) -> None:
    redis_server.kill()  # down before the bus ever connects
    a = bus(redis_server)
    async with anyio.create_task_group() as tg:
        await tg.start(a.run)
        assert not a.connected
        a.publish_dispatch(DispatchEvent("ra", "dispatch", "eng-0", "q", 1.0, 10))
        await anyio.sleep(0.05)
        redis_server.start()
        await until(lambda: a.connected and a.stats().events_written == 1)
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------------- failure behaviour


async def test_source_falls_back_while_redis_is_down_and_returns(
    redis_server: LocalRedis, engine: Engine
) -> None:
    bridge = RedisSnapshotBridge(bus(redis_server), {"eng-0": PushSource(engine.url, backoff=FAST)})
    reader = bus(redis_server)
    cache = SnapshotCache("eng-0")
    src = RedisSource(
        reader, "eng-0", PushSource(engine.url, backoff=FAST, name="direct"), recover_after_s=0.1
    )
    async with anyio.create_task_group() as tg:
        await tg.start(bridge.run)
        await tg.start(reader.run)
        engine.pub.publish(doc(1))
        await until(lambda: reader.connected)
        await tg.start(src.run, cache)
        await until(lambda: seq_of(cache) == 1 and not src.using_fallback)

        redis_server.kill()
        await until(lambda: src.using_fallback)
        engine.pub.publish(doc(2))  # only the direct source can deliver it now
        await until(lambda: seq_of(cache) == 2)
        assert cache.entry is not None
        assert cache.entry.source == "direct"

        redis_server.start()
        await until(lambda: not src.using_fallback)
        engine.pub.publish(doc(3))
        await until(lambda: seq_of(cache) == 3)
        assert cache.entry is not None
        assert cache.entry.source == "redis:eng-0"
        assert src.failovers == 1
        # Two paths fed one cache: none of it counts as a rejection.
        assert cache.stats().rejected_total == 0
        tg.cancel_scope.cancel()


async def test_slow_redis_counts_as_down(redis_server: LocalRedis, engine: Engine) -> None:
    import redis.asyncio

    writer = bus(redis_server)
    reader = bus(redis_server, timeout_s=0.1)
    cache = SnapshotCache("eng-0")
    src = RedisSource(
        reader, "eng-0", PushSource(engine.url, backoff=FAST, name="direct"), recover_after_s=0.1
    )
    raw = redis.asyncio.Redis.from_url(redis_server.url)
    async with anyio.create_task_group() as tg:
        await tg.start(writer.run)
        await tg.start(reader.run)
        writer.publish_snapshot("eng-0", doc(1))
        await until(lambda: writer.stats().snapshots_written >= 1)
        await tg.start(src.run, cache)
        assert not src.using_fallback
        # Every client's commands now wait 0.6 s: a slow server, not a dead one.
        await raw.execute_command("CLIENT", "PAUSE", 600, "ALL")
        await until(lambda: src.using_fallback)
        assert "no answer within 0.1 s" in (reader.stats().last_error or "")
        await until(lambda: not src.using_fallback)
        tg.cancel_scope.cancel()
    await raw.aclose()


async def test_a_silent_stream_means_a_lost_writer(redis_url: str, engine: Engine) -> None:
    px = fresh_prefix()
    # Commands may take long on a loaded machine: only the stream's silence is
    # under test, not a slow answer (another path to the fallback).
    writer = bus(redis_url, px, keepalive_s=0.05, timeout_s=2.0)
    reader = bus(redis_url, px, timeout_s=2.0)
    cache = SnapshotCache("eng-0")
    src = RedisSource(
        reader, "eng-0", PushSource(engine.url, backoff=FAST, name="direct"), stale_after_s=0.5
    )
    async with anyio.create_task_group() as tg:
        await tg.start(reader.run)
        async with anyio.create_task_group() as writing:
            await writing.start(writer.run)
            writer.publish_snapshot("eng-0", doc(1))
            await until(lambda: writer.stats().snapshots_written >= 1)
            await tg.start(src.run, cache)
            await anyio.sleep(0.7)  # keep-alives hold the stream alive
            assert not src.using_fallback
            writing.cancel_scope.cancel()  # the writer (a bridge) goes away; Redis stays up
        await until(lambda: src.using_fallback)
        assert src.stats().last_error == "stream silent"
        tg.cancel_scope.cancel()


async def test_bridge_holds_keepalives_of_an_unreachable_engine(
    redis_url: str, engine: Engine
) -> None:
    px = fresh_prefix()
    b = bus(redis_url, px, keepalive_s=0.05)
    bridge = RedisSnapshotBridge(b, {"eng-0": PushSource(engine.url, backoff=FAST)})
    reader = bus(redis_url, px)
    got: list[bytes] = []
    reader.subscribe_snapshots("eng-0", got.append)
    async with anyio.create_task_group() as tg:
        await tg.start(bridge.run)
        await tg.start(reader.run)
        engine.pub.publish(doc(1))
        await until(lambda: len(got) >= 3)
        await engine.stop()  # the engine dies: its push stream fails from now on
        await anyio.sleep(0.3)
        n = len(got)
        await anyio.sleep(0.2)
        assert len(got) == n
        assert bridge.cache("eng-0").entry is not None
        tg.cancel_scope.cancel()

"""Every snapshot source against the emulated engine (bearsdk.emulator): arrive, follow, restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.abc
import pytest

from bearsdk.emulator import EmulatedEngine, EngineConfig
from bearsdk.io import Backoff, PollSource, PushSource, ShmSource, ShmWriter, SnapshotSource
from bearsdk.io.shm import segment_path
from bearsdk.state import SnapshotCache

FAST = Backoff(initial_s=0.01, max_s=0.05)


def emulator() -> EmulatedEngine:
    # Entered inside each test: an engine's task group must be entered and exited
    # in one task, which an async fixture's setup and teardown are not.
    return EmulatedEngine(EngineConfig(heartbeat_s=0.1, seed=3))


async def bridge(
    eng: EmulatedEngine, path: Path, *, task_status: anyio.abc.TaskStatus[None]
) -> None:
    """The engine side of the shm transport: every snapshot the engine publishes, into a segment.

    (The emulator serves HTTP only; a real engine on the router's host would run this.)
    """
    with ShmWriter(path, 1 << 20) as w:
        w.write(eng.latest_snapshot.json())
        task_status.started()
        while True:
            hub = eng.snapshots
            reader = hub.subscribe()
            try:
                while not reader.closed:
                    await reader.wait()
                    snap = reader.take()
                    if snap is not None:
                        w.write(snap.json())
            finally:
                hub.unsubscribe(reader)
            while eng.snapshots is hub:  # noqa: ASYNC110 - restarting: the new run's hub
                await anyio.sleep(0.005)


async def until(cond: Callable[[], bool], limit_s: float = 15.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.005)


def caught_up(cache: SnapshotCache, eng: EmulatedEngine) -> Callable[[], bool]:
    def cond() -> bool:
        e = cache.entry
        latest = eng.latest_snapshot
        return e is not None and e.seq == latest.seq and e.snapshot.epoch == eng.epoch

    return cond


KINDS = ("poll", "push", "shm")


def make(kind: str, eng: EmulatedEngine, seg: Path) -> SnapshotSource:
    if kind == "poll":
        return PollSource(eng.url, interval_s=0.005, backoff=FAST)
    if kind == "push":
        return PushSource(eng.url, heartbeat_s=0.1, backoff=FAST)
    return ShmSource(seg, interval_s=0.001, backoff=FAST)


@pytest.mark.parametrize("kind", KINDS)
async def test_cache_follows_the_engine_and_survives_a_restart(kind: str, tmp_path: Path) -> None:
    seg = segment_path("emu", tmp_path)
    cache = SnapshotCache("emu")
    async with emulator() as engine, anyio.create_task_group() as tg:
        src = make(kind, engine, seg)
        if kind == "shm":
            await tg.start(bridge, engine, seg)
        await tg.start(src.run, cache)
        assert cache.entry is not None
        # load the engine: snapshots after every step; the cache follows seq upwards
        seqs: list[int] = []
        for i in range(6):
            engine.submit_tokens(300 + 50 * i, 30)
        with anyio.fail_after(15):
            while engine.num_running + engine.num_waiting or len(seqs) < 3:
                e = cache.entry
                if e is not None and (not seqs or e.seq != seqs[-1]):
                    seqs.append(e.seq)
                await anyio.sleep(0.002)
        await until(caught_up(cache, engine))
        assert seqs == sorted(seqs)
        assert len(seqs) >= 3
        assert cache.entry.snapshot.instance == engine.instance
        # restart: connections drop, the port refuses for a while, a new epoch, seq from 0
        old = engine.epoch
        await engine.restart(downtime_s=0.1)
        assert engine.epoch != old
        engine.submit_tokens(100, 5)
        await until(caught_up(cache, engine))
        tg.cancel_scope.cancel()
    st = cache.stats()
    assert st.restarts == 1
    assert st.rejected == {}


@pytest.mark.parametrize("kind", ["poll", "push"])
async def test_engine_faults_are_counted_and_survived(kind: str) -> None:
    cache = SnapshotCache("emu")
    async with emulator() as engine, anyio.create_task_group() as tg:
        # both snapshot endpoints (a prefix): two 503s, then one connection reset
        engine.faults.update({"fault_paths": ["/bear/snapshot"]})
        engine.faults.fail_next(2, status=503)
        engine.faults.drop_next(1, after_chunks=1)
        src = make(kind, engine, Path("/nonexistent"))
        await tg.start(src.run, cache)  # ready after the first (failed) attempt
        assert src.stats().failures >= 1
        engine.submit_tokens(200, 3)
        await until(caught_up(cache, engine))
        tg.cancel_scope.cancel()
    st = src.stats()
    assert st.failures >= 2
    assert st.connects >= 1
    assert cache.stats().rejected == {}

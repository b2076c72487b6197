"""The emulated engine's core on its own: no HTTP server, no aiohttp (issue 18)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from bearsdk.emulator import EmulatedEngine, EngineConfig, EngineCore, EnginePool

ROOT = Path(__file__).resolve().parents[1]

# Refuses every import of aiohttp, then runs a request through the bare core.
_NO_AIOHTTP = textwrap.dedent(
    """
    import sys

    class NoAiohttp:
        def find_spec(self, name, path=None, target=None):
            if name == "aiohttp" or name.startswith("aiohttp."):
                raise ImportError("aiohttp is blocked in this test")
            return None

    sys.meta_path.insert(0, NoAiohttp())

    import anyio
    from bearsdk.emulator.core import EngineCore
    from bearsdk.emulator import EngineConfig

    async def main():
        async with EngineCore(EngineConfig(profile="qwen3-0.6b-h100")) as core:
            h = core.submit_tokens(100, 5)
            with anyio.fail_after(10):
                await h.result()
            assert h.produced == 5 and h.finish_reason == "stop", h
            assert core.latest_snapshot.seq > 0
        assert [r.id for r in core.request_log] == [h.id]

    anyio.run(main)
    assert "aiohttp" not in sys.modules
    assert "bearsdk.emulator.server" not in sys.modules
    print("ok")
    """
)


def test_the_core_runs_a_request_without_aiohttp() -> None:
    """The engine (scheduling, timing, snapshots, metrics) needs no HTTP stack."""
    p = subprocess.run(
        [sys.executable, "-c", _NO_AIOHTTP], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "ok"


async def test_the_core_serves_no_port_and_restarts() -> None:
    core = EngineCore(EngineConfig(profile="qwen3-0.6b-h100"))
    assert not hasattr(core, "url")
    async with core:
        epoch = core.epoch
        first = core.submit_tokens(50, 1000)
        await core.restart()
        assert first.dropped
        assert first.done
        assert core.epoch != epoch
        again = core.submit_tokens(50, 3)
        with anyio.fail_after(10):
            await again.result()
        assert again.produced == 3


async def test_the_core_runs_in_a_callers_task_group() -> None:
    core = EngineCore(EngineConfig(profile="qwen3-0.6b-h100"))
    async with anyio.create_task_group() as tg:
        assert await tg.start(core.run) is core
        with anyio.fail_after(10):
            await core.submit_tokens(20, 2).result()
        with pytest.raises(RuntimeError, match="already running"):
            await tg.start(core.run)
        tg.cancel_scope.cancel()


async def test_a_port_in_use_fails_plainly_before_the_block() -> None:
    """A failure before readiness is the error itself, not a group of one."""
    async with EmulatedEngine(EngineConfig(profile="qwen3-0.6b-h100")) as a:
        clash = EmulatedEngine(EngineConfig(profile="qwen3-0.6b-h100", port=a.port))
        with pytest.raises(OSError, match="in use"):
            async with clash:
                pytest.fail("the block must not run")
        pool = EnginePool([EngineConfig(profile="qwen3-0.6b-h100", port=a.port)])
        with pytest.raises(OSError, match="in use"):
            async with pool:
                pytest.fail("the block must not run")


async def test_the_blocks_own_error_leaves_as_it_is() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with EmulatedEngine(EngineConfig(profile="qwen3-0.6b-h100")):
            raise KeyError("mine")


async def test_a_failing_loop_cancels_the_block_and_is_raised() -> None:
    core = EngineCore(EngineConfig(profile="qwen3-0.6b-h100"))

    class Broken:
        def sample(self, shape: object) -> float:
            raise ZeroDivisionError("loop")

    reached: list[str] = []

    async def block() -> None:
        async with core:
            core._timer = Broken()  # type: ignore[assignment]
            core.submit_tokens(10, 1)
            await anyio.sleep(5)
            reached.append("after sleep")

    with pytest.raises(BaseExceptionGroup) as info:
        await block()
    assert info.group_contains(ZeroDivisionError)
    assert reached == []


def test_idle_gpu_time_between_two_instants_counts_only_the_overlap() -> None:
    from bearsdk.emulator.loopstats import LoopMeter

    m = LoopMeter()
    m.idle_spans.extend([(1.0, 1.5), (2.0, 2.2), (3.0, 4.0)])
    assert m.idle_between(0.0, 10.0) == pytest.approx(1.7)
    assert m.idle_between(1.25, 2.1) == pytest.approx(0.35)
    assert m.idle_between(1.5, 2.0) == 0.0
    m.reset()
    assert m.idle_between(0.0, 10.0) == 0.0


async def test_a_late_loop_delivers_the_first_token_late_and_says_by_how_much() -> None:
    # The host stalls the loop while the first-token batch runs: the batch ends
    # on the emulated GPU on time, the token leaves when the loop wakes.
    import time

    async with EmulatedEngine(EngineConfig(serve_http=False, seed=3)) as eng:
        h = eng.submit_tokens(2000, 40, max_tokens=40, request_id="a")
        for _ in range(10_000):
            if h.first_token_batch:  # launched: its batch is in flight
                break
            await anyio.sleep(0.001)
        assert h.first_token_batch
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:  # blocks the loop longer than that batch takes
            pass
        await h.result()
        assert h.ttft is not None
        assert h.ttft > 0.5
        assert h.first_token_late > 0.0
        assert h.ttft - h.first_token_late < 0.5

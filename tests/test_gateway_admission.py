"""Queue admission's ticker: held requests cost a decision only when a snapshot arrived.

A held request is decided again only once the evidence moved (a prediction
cannot improve without it), oldest first, within a quarter of the tick's
interval; each expires at its deadline with a 429; nothing holds without the
ticker running.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from bearsdk.gateway.admission import Admission, Refused
from bearsdk.gateway.config import AdmissionConfig
from bearsdk.router import Candidate, Decision


def decision(target: float, ttft: float) -> Decision:
    c = Candidate("a", "m", 0.5, 1.0, 0.4, ttft, ttft <= target, 0.4, "bea")
    return Decision("r", "bear", "a", (c,), 0, target, "best", 10, 10, 0.0, 1e-5)


class Pool:
    """A decide() whose predicted TTFT the test sets, counting its calls."""

    def __init__(self, ttft: float, cost_s: float = 0.0) -> None:
        self.ttft = ttft
        self.cost_s = cost_s
        self.calls = 0
        self.evidence = 0

    def decide(self, prompt: Any, *, ttft_target: float | None, **kw: Any) -> Decision:
        self.calls += 1
        if self.cost_s:
            end = time.perf_counter() + self.cost_s
            while time.perf_counter() < end:
                pass
        return decision(1.0 if ttft_target is None else ttft_target, self.ttft)


def queue(pool: Pool, **kw: Any) -> Admission:
    cfg = AdmissionConfig(mode="queue", recheck_ms=kw.pop("recheck_ms", 5.0), **kw)
    return Admission(cfg, evidence=lambda: pool.evidence)


async def admit(adm: Admission, pool: Pool, target: float = 1.0) -> Decision:
    return await adm.admit(pool.decide, "hi", ttft_target=target, max_tokens=None, instances=())


async def test_a_held_request_is_decided_again_only_on_new_evidence() -> None:
    pool = Pool(ttft=500.0)  # late at first
    adm = queue(pool)
    got: list[Decision] = []
    async with anyio.create_task_group() as tg:
        await tg.start(adm.run)

        async def client() -> None:
            got.append(await admit(adm, pool, target=10.0))

        tg.start_soon(client)
        await anyio.sleep(0.1)  # 20 ticks, no new snapshot
        assert pool.calls == 1  # the arrival's decision only
        assert adm.held == 1
        pool.ttft = 0.01  # the engine drained; a snapshot says so
        pool.evidence += 1
        with anyio.fail_after(5):
            while not got:  # noqa: ASYNC110
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
    assert pool.calls == 2
    assert got[0].ttft_target_s < 10.0  # decided against what was left of its target
    assert adm.held == 0


async def test_a_held_request_expires_at_its_deadline() -> None:
    pool = Pool(ttft=500.0)
    adm = queue(pool, max_wait_ms=30.0)
    async with anyio.create_task_group() as tg:
        await tg.start(adm.run)
        t0 = time.monotonic()
        with pytest.raises(Refused) as ei:
            await admit(adm, pool, target=10.0)
        waited = time.monotonic() - t0
        tg.cancel_scope.cancel()
    assert ei.value.code == "slo_unattainable"
    assert "after waiting" in str(ei.value)
    assert waited >= 0.03
    assert adm.held == 0


async def test_rechecks_stay_within_a_quarter_of_each_tick() -> None:
    # Each decision costs 4 ms, a tick is 20 ms: at most 5 ms of deciding a tick,
    # so 2 decisions (the budget is checked before each), never all 20 held.
    pool = Pool(ttft=500.0, cost_s=0.004)
    adm = queue(pool, recheck_ms=20.0)
    async with anyio.create_task_group() as tg:
        await tg.start(adm.run)
        for _ in range(20):
            tg.start_soon(admit, adm, pool, 60.0)
        with anyio.fail_after(10):
            while adm.held < 20:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        before = pool.calls
        pool.evidence += 1
        with anyio.fail_after(10):
            while pool.calls == before:  # noqa: ASYNC110  (the tick with new evidence)
                await anyio.sleep(0.001)
        await anyio.sleep(0.06)  # later ticks see no new evidence: no decisions
        decided = pool.calls - before
        tg.cancel_scope.cancel()
    assert 1 <= decided <= 3


async def test_the_queue_refuses_when_full_and_without_its_ticker() -> None:
    pool = Pool(ttft=500.0)
    adm = queue(pool, queue_size=1)
    with pytest.raises(Refused) as ei:  # no ticker: nothing would move the queue
        await admit(adm, pool)
    assert ei.value.code == "slo_unattainable"
    async with anyio.create_task_group() as tg:
        await tg.start(adm.run)
        tg.start_soon(admit, adm, pool, 60.0)
        with anyio.fail_after(5):
            while adm.held < 1:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        with pytest.raises(Refused) as ei:
            await admit(adm, pool, 60.0)
        assert ei.value.code == "queue_full"
        tg.cancel_scope.cancel()


async def test_a_client_that_gives_up_leaves_the_queue() -> None:
    pool = Pool(ttft=500.0)
    adm = queue(pool)
    async with anyio.create_task_group() as tg:
        await tg.start(adm.run)
        with anyio.move_on_after(0.05):
            await admit(adm, pool, 60.0)
        assert adm.held == 0
        tg.cancel_scope.cancel()

"""The circuit breaker under every way an engine can fail (issue 19's test matrix).

Failure before the response head, after it, mid-stream, a hang, garbage; for
streamed and whole requests; starting from a closed and from a half-open breaker:
the breaker always opens (or re-opens) once the failing request has ended, and
turns half-open, then closed on a good probe, within its configured times. The
waits are bounded by the configured times plus a slack that is generous under
load; nothing asserts a speed.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from test_dispatch_faults import MSG, FakeEngine, assert_off_the_books, config, read_all, router_for

from bearsdk.router import (
    AsyncRouter,
    BreakerState,
    CircuitBreaker,
    DispatchError,
    NoInstanceError,
)

THRESHOLD = 2
COOLDOWN_S = 0.3
IDLE_S = 0.3  # silence after the head that counts as a hang
HEAD_S = 1.0  # the instance's timeout: a whole answer's head may take that long
SLACK_S = 10.0  # scheduling delays on a loaded machine; never a speed claim

FAILURES = {
    "before head": ["status500", "reset", "hang"],
    "after head": ["reset-after-head", "hang-after-head", "garbage", "not-object"],
    "mid-stream": ["mid-reset", "mid-hang"],
}
CASES = [(where, mode) for where, modes in FAILURES.items() for mode in modes]


def breaker() -> CircuitBreaker:
    return CircuitBreaker(
        threshold=THRESHOLD, cooldown_s=COOLDOWN_S, max_cooldown_s=COOLDOWN_S, probe_timeout_s=30.0
    )


async def attempt(router: AsyncRouter, stream: bool) -> None:
    """One request, read to its end; fails with DispatchError, within the configured times."""
    with anyio.fail_after(HEAD_S + IDLE_S + SLACK_S):
        result: Any = await router.chat(MSG, stream=stream, max_tokens=5)
        await read_all(result)


def opens(router: AsyncRouter) -> int:
    """How often the breaker opened so far (robust to a cool-down ending meanwhile)."""
    return router._inst("a").breaker.opens


def assert_opened(router: AsyncRouter, times: int) -> None:
    assert opens(router) == times
    # Open, or already half-open if the machine stalled past the cool-down.
    assert router.breaker_state("a") is not BreakerState.CLOSED


async def wait_for(router: AsyncRouter, want: BreakerState | int, within_s: float) -> None:
    """Until the breaker is in state ``want`` (or has opened ``want`` times)."""
    step = 0.01
    for _ in range(int((within_s + SLACK_S) / step)):
        state = router.breaker_state("a")  # (a probe's claim expires when looked at)
        if (state if isinstance(want, BreakerState) else opens(router)) == want:
            return
        await anyio.sleep(step)
    pytest.fail(f"the breaker did not reach {want} within {within_s} s (+ {SLACK_S} s slack)")


async def open_it(router: AsyncRouter, eng: FakeEngine) -> None:
    eng.queue.extend(["status500"] * THRESHOLD)
    for _ in range(THRESHOLD):
        with pytest.raises(DispatchError):
            await attempt(router, stream=False)
    assert_opened(router, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("where", "mode"), CASES)
async def test_a_closed_breaker_opens_then_probes_back(where: str, mode: str, stream: bool) -> None:
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng, timeout_s=HEAD_S)], breaker=breaker(), idle_timeout_s=IDLE_S) as r,
    ):
        eng.default = mode
        for k in range(THRESHOLD):
            assert r.breaker_state("a") is BreakerState.CLOSED, k
            with pytest.raises(DispatchError) as ei:
                await attempt(r, stream)
            assert ei.value.decision is not None
            assert ei.value.attempts[0][0] == "a"
            assert_off_the_books(r)
        assert_opened(r, 1)
        eng.default = "ok"
        await wait_for(r, BreakerState.HALF_OPEN, COOLDOWN_S)
        await attempt(r, stream)  # the probe succeeds
        assert r.breaker_state("a") is BreakerState.CLOSED
        assert_off_the_books(r)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("where", "mode"), CASES)
async def test_a_failed_probe_reopens_the_breaker(where: str, mode: str, stream: bool) -> None:
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng, timeout_s=HEAD_S)], breaker=breaker(), idle_timeout_s=IDLE_S) as r,
    ):
        await open_it(r, eng)
        await wait_for(r, BreakerState.HALF_OPEN, COOLDOWN_S)
        eng.queue.append(mode)
        with pytest.raises(DispatchError):
            await attempt(r, stream)
        # Re-opened at once (a mid-stream failure closes it on the first event, then
        # re-opens it: the failures before the probe still count).
        assert_opened(r, 2)
        assert_off_the_books(r)
        await wait_for(r, BreakerState.HALF_OPEN, COOLDOWN_S)
        await attempt(r, stream)
        assert r.breaker_state("a") is BreakerState.CLOSED


async def test_a_probe_nobody_reads_is_given_up_after_probe_timeout() -> None:
    probe_s = 0.5
    brk = CircuitBreaker(
        threshold=THRESHOLD,
        cooldown_s=COOLDOWN_S,
        max_cooldown_s=COOLDOWN_S,
        probe_timeout_s=probe_s,
    )
    async with (
        FakeEngine().running() as eng,
        router_for([config(eng, timeout_s=HEAD_S)], breaker=brk, idle_timeout_s=60.0) as r,
    ):
        await open_it(r, eng)
        await wait_for(r, BreakerState.HALF_OPEN, COOLDOWN_S)
        eng.queue.append("hang-after-head")
        held = await r.chat(MSG, stream=True, max_tokens=5)  # the probe, never read
        assert not r._inst("a").breaker.routable(r.clock())
        await wait_for(r, 2, probe_s)  # the probe's claim expired: re-opened
        await wait_for(r, BreakerState.HALF_OPEN, COOLDOWN_S)
        await attempt(r, stream=True)
        assert r.breaker_state("a") is BreakerState.CLOSED
        await held.aclose()
        assert_off_the_books(r)


@pytest.mark.parametrize("mode", ["hang-after-head", "mid-hang", "status500"])
async def test_concurrent_failures_open_the_breaker_once(mode: str) -> None:
    async with (
        FakeEngine().running() as eng,
        # A cool-down no straggler outlives, however loaded the machine.
        router_for(
            [config(eng, timeout_s=HEAD_S)],
            breaker=CircuitBreaker(threshold=THRESHOLD, cooldown_s=60.0),
            idle_timeout_s=IDLE_S,
        ) as r,
    ):
        eng.default = mode
        errors: list[BaseException] = []

        async def one() -> None:
            try:
                await attempt(r, stream=True)
            except (DispatchError, NoInstanceError) as exc:  # sent, or refused once open
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(4 * THRESHOLD):
                tg.start_soon(one)
        assert len(errors) == 4 * THRESHOLD
        # The stragglers failing after it opened do not stretch its cool-down.
        assert_opened(r, 1)
        assert_off_the_books(r)

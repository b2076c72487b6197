"""AsyncRouter against emulated vLLM engines: decisions, dispatch, faults, pool changes."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.router import (
    AsyncRouter,
    ConfigError,
    DispatchError,
    EngineRequestError,
    InstanceConfig,
    NoInstanceError,
    load_pool_config,
)
from bearsdk.selectors import BEAR, LatencyAgnostic, RoundRobin

MSG = [{"role": "user", "content": "Explain in 2 sentences why the sky is blue."}]


def engines() -> EnginePool:
    # Entered inside each test: anyio task groups must be left in the task that
    # entered them, which async-generator fixtures do not guarantee.
    return EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100")


def configs(pool: EnginePool, snapshots: str = "push") -> list[InstanceConfig]:
    return [
        InstanceConfig(
            name=e.instance,
            url=e.url,
            model=e.model_name,
            profile=e.config.profile,
            snapshots=snapshots,
            timeout_s=20.0,
        )
        for e in pool
    ]


async def drain(stream: object) -> int:
    n = 0
    async for _ in stream:  # type: ignore[attr-defined]
        n += 1
    return n


async def settle(router: AsyncRouter) -> None:
    with anyio.fail_after(5):
        for n in router.instances:
            await router.cache(n).wait_version(0)


async def test_decision_records_every_candidate() -> None:
    # (Priced every one: by default those a better utility rules out are left
    # unpriced, tests/test_best_first.py.)
    async with engines() as pool, AsyncRouter(configs(pool), BEAR(price_all=True)) as router:
        await settle(router)
        d = await router.route(MSG, ttft_target=0.5)
        assert [c.instance for c in d.candidates] == router.instances
        assert d.instance == d.candidates[d.index].instance
        assert d.selector == "bear"
        for c in d.candidates:
            assert 0.0 <= c.accuracy <= 1.0
            assert c.cost > 0
            assert c.utility == pytest.approx(c.accuracy - 5e-4 * c.cost)
            assert math.isfinite(c.ttft_s)
            assert c.feasible == (c.ttft_s <= 0.5)
            assert c.estimator in ("bea", "overlay", "fast-forward")
            assert c.prompt_tokens > 0
        # idle instances: all feasible, so BEAR takes the best utility
        best = max(range(3), key=lambda i: d.candidates[i].utility)
        assert d.index == best
        assert "*" in d.explain()


async def test_streaming_chat_passes_chunks_and_feeds_back() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), BEAR()) as router:
        await settle(router)
        stream = await router.chat(MSG, stream=True, max_tokens=12)
        chunks = [c async for c in stream]
        assert stream.ttft_s is not None
        assert stream.ttft_s > 0
        assert stream.usage is not None
        assert stream.usage["completion_tokens"] == 12
        # the usage chunk the router asked for itself is not passed on
        assert all(c["choices"] for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text
        _, _mape, n = router.ttft_error(stream.instance)
        assert n == 1
        # engine's own record of the request agrees with what the router observed
        eng = next(e for e in pool if e.instance == stream.instance)
        assert eng.metrics is not None


async def test_usage_chunk_kept_when_asked() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), LatencyAgnostic()) as router:
        stream = await router.chat(
            MSG, stream=True, max_tokens=3, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        body = await router.chat(MSG, max_tokens=4)
        assert isinstance(body, dict)
        assert body["usage"]["completion_tokens"] == 4


async def test_failure_before_first_byte_retries_next_best() -> None:
    async with (
        engines() as pool,
        AsyncRouter(configs(pool), LatencyAgnostic(), retries=2) as router,
    ):
        await settle(router)
        first = (await router.route(MSG)).instance
        eng = next(e for e in pool if e.instance == first)
        eng.faults.fail_next(1, status=503)
        stream = await router.chat(MSG, stream=True, max_tokens=5)
        assert stream.instance != first
        assert stream.decision.instance == first
        assert await drain(stream) >= 5


async def test_every_instance_failing_is_one_clear_error() -> None:
    async with (
        engines() as pool,
        AsyncRouter(configs(pool), LatencyAgnostic(), retries=2) as router,
    ):
        for e in pool:
            e.faults.fail_next(1, status=500)
        with pytest.raises(DispatchError) as ei:
            await router.chat(MSG, max_tokens=5)
        assert len(ei.value.attempts) == 3
        assert all("HTTP 500" in why for _, why in ei.value.attempts)


async def test_dropped_stream_is_an_error_not_a_silent_retry() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), LatencyAgnostic()) as router:
        await settle(router)
        first = (await router.route(MSG)).instance
        next(e for e in pool if e.instance == first).faults.drop_next(1, after_chunks=3)
        stream = await router.chat(MSG, stream=True, max_tokens=50)
        got: list[object] = []

        async def read() -> None:
            async for chunk in stream:
                got.append(chunk)

        with pytest.raises(DispatchError, match="broke"):
            await read()
        assert len(got) < 10  # cut short (the count of chunks before the drop is the engine's)
        assert stream.instance == first


async def test_bad_request_is_not_retried() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), LatencyAgnostic()) as router:
        with pytest.raises(EngineRequestError) as ei:
            await router.chat(MSG, max_tokens=10**7)  # above max_model_len
        assert ei.value.status == 400


async def test_drain_remove_and_circuit_breaking() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), RoundRobin(), retries=0) as router:
        names = router.instances
        router.drain_instance(names[0])
        seen = {(await router.route(MSG)).instance for _ in range(6)}
        assert names[0] not in seen
        router.undrain_instance(names[0])
        # a stream in flight to a removed instance still completes
        while (await router.route(MSG)).instance != names[0]:
            pass  # round robin: the next request goes to names[1]
        stream = await router.chat(MSG, stream=True, max_tokens=20)
        assert stream.instance == names[1]
        router.remove_instance(names[1])
        assert await drain(stream) >= 20  # a role chunk, then one chunk per token
        assert names[1] not in router.instances
        with pytest.raises(Exception, match="not in the pool"):
            router.drain_instance(names[1])
        # three consecutive failures open the breaker on names[2]
        eng = next(e for e in pool if e.instance == names[2])
        eng.faults.fail_next(3, status=500)
        fails = 0
        for _ in range(8):
            try:
                await router.chat(MSG, max_tokens=2)
            except DispatchError:
                fails += 1
        assert fails == 3
        seen = {(await router.route(MSG)).instance for _ in range(4)}
        assert seen == {names[0]}
        router.drain_instance(names[0])
        with pytest.raises(NoInstanceError):
            await router.route(MSG)


async def test_add_instance_at_run_time() -> None:
    async with engines() as pool:
        cfgs = configs(pool)
        async with AsyncRouter(cfgs[:1], RoundRobin()) as router:
            await router.add_instance(cfgs[2])
            assert {(await router.route(MSG)).instance for _ in range(2)} == {
                cfgs[0].name,
                cfgs[2].name,
            }


def test_pool_file_is_strict(tmp_path: Path) -> None:
    f = tmp_path / "pool.toml"
    f.write_text(
        '[[instances]]\nname = "a"\nurl = "http://127.0.0.1:1"\nmodel = "Qwen/Qwen3-8B"\n'
        'profile = "qwen3-8b-h100"\n[instances.scheduler_params]\nmax_num_seqs = 64\n'
    )
    (inst,) = load_pool_config(f)
    assert inst.params == {"max_num_seqs": 64}
    assert inst.batch_time_model().b0 > 0
    f.write_text('[[instances]]\nname = "a"\nurl = "http://x"\nmodel = "m"\ncolour = 1\n')
    with pytest.raises(ConfigError, match="instance 'a': colour is not a known field"):
        load_pool_config(f)
    f.write_text('[[instances]]\nname = "a"\nurl = "ftp://x"\nmodel = "m"\n')
    with pytest.raises(ConfigError, match="url must start with http"):
        load_pool_config(f)
    # A model the predictor does not know routes with a prior (tests/test_unknown_models.py).
    router = AsyncRouter(
        [InstanceConfig(name="a", url="http://x:1", model="nope", profile="qwen3-8b-h100")]
    )
    assert router.predictor.models[-1] == "nope"


def _generated(pool: EnginePool, request_id: str) -> list[str]:
    """Engines that generated a request to the end (aborted copies do not count)."""
    rid = f"chatcmpl-{request_id}"  # vLLM's chat request id from X-Request-Id
    return [
        e.instance
        for e in pool
        for r in e.request_log
        if r.id == rid and r.finish_reason != "abort"
    ]


async def test_timeout_before_first_byte_moves_on_without_a_duplicate() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), LatencyAgnostic()) as router:
        await settle(router)
        first = (await router.route(MSG)).instance
        slow = next(e for e in pool if e.instance == first)
        slow.faults.latency_s = 0.8  # the request reaches this engine 0.8 s late
        stream = await router.chat(MSG, stream=True, max_tokens=5, timeout_s=0.3)
        assert stream.instance != first
        assert await drain(stream) >= 5
        slow.faults.latency_s = 0.0
        await anyio.sleep(1.0)  # the abandoned copy has reached the slow engine by now
        assert _generated(pool, stream.decision.request_id) == [stream.instance]
        with pytest.raises(Exception, match="timeout_s must be"):
            await router.chat(MSG, timeout_s=0.0)


async def test_every_request_gets_exactly_one_outcome_under_faults() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), RoundRobin(), retries=1) as router:
        await settle(router)
        for e in pool:  # each engine's fault draws are seeded by its config
            e.faults.update({"error_rate": 0.25, "drop_rate": 0.15, "drop_after_chunks": 2})
        outcomes: dict[int, tuple[str, str, str | None]] = {}

        async def one(k: int) -> None:
            try:
                s = await router.chat(MSG, stream=True, max_tokens=6)
                await drain(s)
                outcomes[k] = ("ok", s.decision.request_id, s.instance)
            except DispatchError as exc:
                outcomes[k] = ("error", exc.decision.request_id if exc.decision else "", None)

        async with anyio.create_task_group() as tg:
            for k in range(60):
                tg.start_soon(one, k)
        assert len(outcomes) == 60
        kinds = [o[0] for o in outcomes.values()]
        assert 0 < kinds.count("error") < 60  # the faults fired, and retries saved some
        assert len({o[1] for o in outcomes.values()}) == 60  # one decision per request
        for kind, rid, inst in outcomes.values():
            # a served request was generated once, where the router said; a failed one nowhere
            assert _generated(pool, rid) == ([inst] if kind == "ok" else [])
        for name in router.instances:
            assert router.inflight(name) == 0  # nothing left on the books


async def test_whole_response_says_who_answered_and_teaches_no_ttft() -> None:
    async with engines() as pool, AsyncRouter(configs(pool), LatencyAgnostic()) as router:
        doc = await router.chat(MSG, max_tokens=6)
        assert doc["choices"][0]["message"]["content"]
        assert doc.instance == doc.decision.instance
        assert doc.latency_s > 0
        # a whole answer's latency is not a time to first token
        assert router.ttft_error(doc.instance)[2] == 0
        assert router.overhead(doc.instance) == 0.0
        assert router.inflight(doc.instance) == 0


async def test_snapshots_come_from_snapshot_url_when_given() -> None:
    # As with the vLLM plugin: requests to the API port, /bear/* on a side port.
    async with engines() as pool:
        e = pool[1]
        cfg = InstanceConfig(
            name=e.instance,
            url="http://127.0.0.1:9",  # nothing listens here: only requests would go
            snapshot_url=e.url,
            model=e.model_name,
            profile=e.config.profile,
        )
        async with AsyncRouter([cfg], BEAR()) as router:
            await settle(router)
            assert router.cache(e.instance).entry is not None
        with pytest.raises(ConfigError, match="snapshot_url must start with http"):
            InstanceConfig(name="x", url=e.url, snapshot_url="localhost:8100", model="m")


def test_request_ids_are_fixed_width() -> None:
    # No id may be contained in another: engines embed it in theirs, and the
    # overlay matches dispatches to a snapshot's ids by containment.
    router = AsyncRouter(
        [
            InstanceConfig(
                name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
            )
        ],
        BEAR(),
    )
    ids = [router.decide(MSG).request_id for _ in range(12)]
    assert len({len(i) for i in ids}) == 1
    assert not any(a in b for a in ids for b in ids if a != b)


async def test_a_streams_first_token_is_reported_after_the_caller_has_it() -> None:
    # The router's bookkeeping must not delay the first chunk (a gateway passes it
    # on at once); it is reported once the caller asks for more, with the time
    # the chunk arrived, and before the request completes.
    seen: list[tuple[str, float]] = []
    async with engines() as pool, AsyncRouter(configs(pool), BEAR(), retries=0) as router:
        hooks = router.hooks
        hooks.on_first_token.append(lambda d, name, observed: seen.append(("first", observed)))
        hooks.on_complete.append(lambda d, name, outcome: seen.append((outcome, 0.0)))
        stream = await router.chat(MSG, stream=True, max_tokens=4, ttft_target=5.0)
        it = stream.__aiter__()
        await it.__anext__()
        assert stream.ttft_s is not None
        assert seen == []
        rest = await drain(it)
        assert rest >= 1
        assert seen == [("first", stream.ttft_s), ("ok", 0.0)]
        # Closed right after its first chunk: reported first, then cancelled.
        seen.clear()
        stream = await router.chat(MSG, stream=True, max_tokens=40, ttft_target=5.0)
        await stream.__aiter__().__anext__()
        await stream.aclose()
        assert seen == [("first", stream.ttft_s), ("cancelled", 0.0)]


async def test_a_streams_later_tokens_place_the_instances_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every read that brings tokens after the first tells the router an engine
    # step ended there (StalenessRules.anchor_steps); so does the completion.
    from bearsdk.state import InstanceState

    ends: list[tuple[str, float]] = []
    told = InstanceState.on_step_end

    def spy(self: InstanceState, at: float) -> None:
        ends.append((self.name, at))
        told(self, at)

    monkeypatch.setattr(InstanceState, "on_step_end", spy)
    async with engines() as pool, AsyncRouter(configs(pool), BEAR(), retries=0) as router:
        await settle(router)
        start = router.core.clock()
        stream = await router.chat(MSG, stream=True, max_tokens=24, ttft_target=5.0)
        await drain(stream)
        mine = [at for name, at in ends if name == stream.instance]
        # The first token, at least one read after it, and the end.
        assert len(mine) >= 3
        assert mine == sorted(mine)
        assert all(start <= at <= router.core.clock() for at in mine)
        assert {name for name, _ in ends} == {stream.instance}


def test_record_tokens_tells_the_instance_a_step_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    from bearsdk.errors import BearError
    from bearsdk.router.core import RouterCore
    from bearsdk.state import InstanceState

    t = [10.0]
    core = RouterCore(
        [
            InstanceConfig(
                name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
            )
        ],
        BEAR(),
        clock=lambda: t[0],
    )
    got: list[float] = []
    monkeypatch.setattr(InstanceState, "on_step_end", lambda self, at: got.append(at))
    core.record_tokens("a", at=9.5)
    core.record_tokens("a")
    # No first token observed yet: no overhead learned, the times are as told.
    assert got == [9.5, 10.0]
    with pytest.raises(BearError, match="nowhere"):
        core.record_tokens("nowhere", at=1.0)


def test_an_instance_without_snapshots_places_no_steps() -> None:
    # Its snapshots are the router's shadow view (counts from /metrics), not the
    # engine's steps: there is no batch in flight to place on its tokens.
    from bearsdk.router.core import RouterCore

    def cfg(name: str, snapshots: str) -> InstanceConfig:
        return InstanceConfig(
            name=name,
            url="http://127.0.0.1:9",
            model="Qwen/Qwen3-8B",
            profile="qwen3-8b-h100",
            snapshots=snapshots,
        )

    core = RouterCore([cfg("a", "push"), cfg("b", "metrics")], BEAR())
    assert core.slot("a").state.rules.anchor_steps
    assert core.slot("a").shadow is None
    assert core.slot("b").shadow is not None
    assert not core.slot("b").state.rules.anchor_steps

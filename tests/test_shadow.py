"""Unmodified vLLM: /metrics parsing, the shadow view's reconciliation, and MetricsSource."""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio
import pytest
from aiohttp import web

from bearsdk import BEAEstimator
from bearsdk.estimators import BatchTimeModel
from bearsdk.io import Backoff, EngineMetrics, MetricsSource, parse_vllm_metrics
from bearsdk.io.metrics import MetricsError
from bearsdk.snapshot import STATE_RUNNING, STATE_WAITING, snapshot_from_dict
from bearsdk.state import InstanceState, ShadowView, SnapshotCache

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="Qwen/Qwen3-8B",engine="0"} 3.0
vllm:num_requests_running{model_name="Qwen/Qwen3-8B",engine="1"} 2.0
vllm:num_requests_waiting{model_name="Qwen/Qwen3-8B",engine="0"} 4.0
vllm:num_requests_waiting{model_name="Qwen/Qwen3-8B",engine="1"} 0.0
vllm:kv_cache_usage_perc{model_name="Qwen/Qwen3-8B",engine="0"} 0.25
vllm:kv_cache_usage_perc{model_name="Qwen/Qwen3-8B",engine="1"} 0.15
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1000",\
swap_space="4",engine="0",note="a \\"quoted\\" value"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
python_gc_objects_collected_total{generation="0"} 123.0
"""


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(PAGE)
    assert (m.running, m.waiting, m.block_size, m.num_gpu_blocks) == (5, 4, 16, 1000)
    assert m.kv_usage == pytest.approx(0.2)
    assert m.used_blocks == 200


def test_parse_old_names_and_missing_series() -> None:
    old = (
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n"
    )
    m = parse_vllm_metrics(old)
    assert (m.running, m.waiting, m.kv_usage, m.num_gpu_blocks) == (1, 0, 0.5, None)
    assert m.used_blocks is None
    with pytest.raises(MetricsError, match="vllm:num_requests_waiting: must be present"):
        parse_vllm_metrics("vllm:num_requests_running 1\n")
    with pytest.raises(MetricsError, match="value must be a number"):
        parse_vllm_metrics("vllm:num_requests_running one\nvllm:num_requests_waiting 0\n")


def test_router_requests_become_a_snapshot() -> None:
    clock = Clock()
    v = ShadowView("eng-0", clock=clock)
    v.on_dispatch("a", 500, max_tokens=100)
    v.on_dispatch("b", 300, output_len=20)
    v.on_dispatch("c", 200)
    v.on_tokens("a", 7)  # a streams: running, prompt + 6 computed
    v.on_tokens("b", 1)
    v.on_complete("c")
    s = v.snapshot()
    assert s.ids == ("a", "b")
    assert s.table.tolist() == [
        [STATE_RUNNING, 500, 506, 7, 100, -1, 0],
        [STATE_RUNNING, 300, 300, 1, -1, 20, 0],
    ]
    assert s.kv is None  # no metrics yet
    v.on_dispatch("d", 50)
    s2 = v.snapshot()
    assert s2.seq == s.seq + 1
    assert s2.epoch == s.epoch
    assert s2.ids[-1] == "d"
    assert s2.table[-1, 0] == STATE_WAITING
    # what the view synthesizes is a valid snapshot (round-trips through the decoder)
    assert snapshot_from_dict(s2.to_dict()).ids == s2.ids
    with pytest.raises(ValueError, match="already in flight"):
        v.on_dispatch("a", 1)
    with pytest.raises(ValueError, match="prompt_tokens must be an integer >= 1"):
        v.on_dispatch("z", 0)


def test_metrics_add_phantoms_and_kv() -> None:
    clock = Clock()
    v = ShadowView("eng-0", clock=clock)
    v.on_dispatch("a", 1000)
    v.on_tokens("a", 3)
    v.on_dispatch("b", 600)
    # the engine counts 3 running and 3 waiting: 1 + 2 foreign running, 2 foreign waiting
    v.on_metrics(EngineMetrics(3, 3, 0.5, 16, 1000))
    s = v.snapshot()
    assert s.ids[:1] == ("a",)
    assert s.num_running == 3
    assert s.num_waiting == 3
    assert s.ids[-1] == "b"  # foreign waiting ahead of the router's (their order is unknown)
    assert s.kv is not None
    assert (s.kv.block_size, s.kv.num_blocks, s.kv.free_blocks) == (16, 1000, 500)
    # running phantoms share the blocks the engine uses beyond the router's request
    phantom_blocks = sum(-(-int(r[2]) // 16) for r in s.table[1:3])
    assert 500 - 63 - 2 <= phantom_blocks <= 500 - 63
    wait_prompts = s.table[3:5, 1].tolist()
    assert wait_prompts == [800, 800]  # the mean of the router's prompts
    snapshot_from_dict(s.to_dict())  # valid


def test_router_requests_being_prefilled_are_not_double_counted() -> None:
    v = ShadowView("eng-0", clock=Clock())
    v.on_dispatch("a", 100)
    v.on_dispatch("b", 100)
    # both admitted (running), neither has a first token yet
    v.on_metrics(EngineMetrics(2, 0, None, None, None))
    s = v.snapshot()
    assert s.ids == ("a", "b")


def test_old_metrics_are_ignored() -> None:
    clock = Clock()
    v = ShadowView("eng-0", clock=clock, metrics_max_age_s=1.0)
    v.on_metrics(EngineMetrics(5, 5, 0.1, 16, 100))
    assert len(v.snapshot()) == 10
    clock.t += 2.0
    assert len(v.snapshot()) == 0


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.005)


async def test_metrics_source_against_a_metrics_endpoint() -> None:
    page = [PAGE]
    status = [200]

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=page[0], status=status[0])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        cache = SnapshotCache("eng-0")
        view = ShadowView("eng-0", clock=cache.clock)
        src = MetricsSource(
            url, view, interval_s=0.01, refresh_s=0.005, backoff=Backoff(0.01, 0.02)
        )
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, cache)
            assert cache.entry is not None
            assert len(cache.entry.snapshot) == 9  # all foreign: 5 running + 4 waiting
            view.on_dispatch("mine", 100)
            await until(lambda: cache.entry is not None and "mine" in cache.entry.snapshot.ids)
            status[0] = 503
            await until(lambda: src.stats().failures >= 1)
            status[0] = 200
            page[0] = "garbage"
            await until(lambda: "MetricsError" in (src.stats().last_error or ""))
            tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()


async def test_shadow_against_the_emulated_engine() -> None:
    """Unmodified-vLLM mode end to end: the emulator's /metrics, router events, BEA on top."""
    from bearsdk.emulator import EmulatedEngine, EngineConfig

    async with EmulatedEngine(EngineConfig(heartbeat_s=0.2)) as eng:
        pol = eng.policy
        est = BEAEstimator(pol, BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10))
        cache = SnapshotCache("eng-0")
        state = InstanceState(cache, est)
        view = ShadowView("eng-0", clock=cache.clock)
        src = MetricsSource(eng.url, view, interval_s=0.02, refresh_s=0.005)
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, cache)
            mine = [eng.submit_tokens(800, 400, request_id=f"mine-{i}") for i in range(3)]
            for h in mine:
                view.on_dispatch(h.id, 800)
            for _ in range(4):  # another client's requests, unknown to the router
                eng.submit_tokens(800, 400)

            def seen() -> bool:
                e = cache.entry
                return e is not None and len(e.snapshot) == 7 and e.snapshot.kv is not None

            await until(seen)
            entry = cache.entry
            assert entry is not None
            assert sum(1 for rid in entry.snapshot.ids if rid.startswith("~phantom")) == 4
            # Pinned to the capture time: a loaded machine can age the snapshot past
            # ``fast_forward_after_s`` (10 ms) between ``seen()`` and this call, and an
            # aged snapshot is (rightly) fast-forwarded; both modes are checked.
            est_ttft = state.ttft(500, now=entry.captured)
            assert est_ttft.mode == "bea"
            assert est_ttft.ttft_s > 0
            aged = state.ttft(500, now=entry.captured + 0.5)
            assert aged.mode == "fast-forward"
            assert 0 < aged.ttft_s < math.inf
            for h in mine:
                eng.abort(h.id)
                view.on_complete(h.id)
            tg.cancel_scope.cancel()


def test_prefill_progress_is_estimated_from_the_prefill_rate() -> None:
    clock = Clock(1000.0)
    v = ShadowView("eng-0", clock=clock, prefill_tokens_per_s=1000.0)
    v.on_dispatch("c", 50, now=998.0)  # long done: prompt - 1 computed, first token due
    v.on_dispatch("a", 800, now=999.5)  # 500 tokens computed by now
    v.on_dispatch("b", 600, now=999.9)  # behind a (FCFS): starts at 1000.3
    s = v.snapshot()
    rows = dict(zip(s.ids, s.table.tolist(), strict=True))
    assert rows["c"] == [STATE_RUNNING, 50, 49, 0, -1, -1, 0]
    assert rows["a"][:3] == [STATE_RUNNING, 800, 500]
    assert rows["b"][:3] == [STATE_WAITING, 600, 0]
    snapshot_from_dict(s.to_dict())  # valid

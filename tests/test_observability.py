"""Router observability: Prometheus metrics and structured decision logs."""

from __future__ import annotations

import logging

import anyio.lowlevel
import orjson
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.router import AsyncRouter, DecisionLog, InstanceConfig, PrometheusMetrics
from bearsdk.selectors import BEAR

prom = pytest.importorskip("prometheus_client")

MSG = [{"role": "user", "content": "Name three rivers."}]


async def test_metrics_and_logs_follow_requests(caplog: pytest.LogCaptureFixture) -> None:
    registry = prom.CollectorRegistry()
    async with EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100") as pool:
        cfgs = [
            InstanceConfig(name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile)
            for e in pool
        ]
        async with AsyncRouter(cfgs, BEAR(), retries=1) as router:
            metrics = PrometheusMetrics(registry).attach(router)
            assert isinstance(metrics, PrometheusMetrics)
            DecisionLog().attach(router)
            first = (await router.route(MSG, ttft_target=5.0)).instance
            next(e for e in pool if e.instance == first).faults.fail_next(1, status=503)
            with caplog.at_level(logging.INFO, logger="bearsdk.decisions"):
                for _ in range(3):
                    stream = await router.chat(MSG, stream=True, max_tokens=4, ttft_target=5.0)
                    async for _chunk in stream:
                        pass

    def value(name: str, **labels: str) -> float:
        v = registry.get_sample_value(f"bearsdk_{name}", labels)
        return 0.0 if v is None else v

    other = next(e.instance for e in pool if e.instance != first)
    # 1 route() + 3 chat() decisions, all for `first` (BEAR with a 5 s target: best utility)
    assert sum(
        value("decisions_total", instance=first, selector="bear", estimator=e)
        for e in ("bea", "overlay", "fast-forward", "lps", "none")
    ) == pytest.approx(4)
    assert value("dispatch_failures_total", instance=first) == 1
    # the failed attempt went on to the other instance; the two others were served by `first`
    assert value("requests_total", instance=other, outcome="ok") == 1
    assert value("requests_total", instance=first, outcome="ok") == 2
    assert value("slo_total", instance=first, outcome="met") == 2
    assert value("ttft_seconds_count", instance=first) == 2
    assert value("decision_seconds_count") == 4
    assert value("ttft_abs_relative_error_count", instance=first) == 2
    # Each instance's learned speed and overhead as of the last decision (a
    # fresh router: near its profile).
    for name in (first, other):
        assert 0.05 <= value("speed_factor", instance=name) <= 20.0
        assert value("ttft_overhead_seconds", instance=name) >= 0.0
    assert registry.get_sample_value("bearsdk_speed_factor", {"instance": first}) is not None

    docs = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bearsdk.decisions"]
    events = [d["event"] for d in docs]
    assert events.count("decision") == 3
    assert events.count("failure") == 1
    assert events.count("first_token") == 3
    assert events.count("complete") == 3
    decision = next(d for d in docs if d["event"] == "decision")
    assert {c["instance"] for c in decision["candidates"]} == {first, other}
    assert all(c["speed_factor"] > 0 and c["overhead_s"] >= 0 for c in decision["candidates"])
    assert all(getattr(r, "bearsdk", None) for r in caplog.records if r.name == "bearsdk.decisions")


def test_metrics_without_prometheus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(Exception, match=r"pip install 'bearsdk\[metrics\]'"):
        PrometheusMetrics()


async def test_deferred_metrics_record_at_the_next_loop_turn_not_in_the_request_path() -> None:
    registry = prom.CollectorRegistry()
    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        cfgs = [
            InstanceConfig(name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile)
            for e in pool
        ]
        async with AsyncRouter(cfgs, BEAR(), retries=0) as router:
            PrometheusMetrics(registry, defer=True).attach(router)
            name = cfgs[0].name
            router.decide(MSG, ttft_target=5.0)
            count = registry.get_sample_value("bearsdk_decision_seconds_count")
            # Decided, not yet recorded: that waits for the loop's next turn.
            assert count in (None, 0.0)
            await anyio.lowlevel.checkpoint()
            assert registry.get_sample_value("bearsdk_decision_seconds_count") == 1
            stream = await router.chat(MSG, stream=True, max_tokens=3, ttft_target=5.0)
            async for _chunk in stream:
                pass
            await anyio.lowlevel.checkpoint()
            assert registry.get_sample_value("bearsdk_decision_seconds_count") == 2
            assert registry.get_sample_value("bearsdk_ttft_seconds_count", {"instance": name}) == 1
            labels = {"instance": name, "outcome": "ok"}
            assert registry.get_sample_value("bearsdk_requests_total", labels) == 1


def test_deferred_metrics_without_a_running_loop_record_at_once() -> None:
    registry = prom.CollectorRegistry()
    cfg = InstanceConfig(
        name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
    )
    router = AsyncRouter([cfg], BEAR())
    PrometheusMetrics(registry, defer=True).attach(router)
    router.decide(MSG, ttft_target=5.0)
    assert registry.get_sample_value("bearsdk_decision_seconds_count") == 1

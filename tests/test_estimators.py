"""The common estimator interface: InstanceStats, baselines, eq. 8, the BEA adapter."""

from __future__ import annotations

import math
from typing import Any

import pytest

from bearsdk.estimators import (
    BatchTimeModel,
    BEAEstimator,
    BEALatencyEstimator,
    InstanceStats,
    InstanceView,
    LatencyEstimator,
    LMDeployProxyEstimator,
    LPSEstimator,
    PrefillThroughputEstimator,
    RequestInfo,
    RouteBalanceEstimator,
    ScoreEstimator,
    SemanticRouterEstimator,
    normalized_scores,
)
from bearsdk.estimators.baselines import percentile
from bearsdk.estimators.prefill import nominal_theta_pre, remaining_prefill_tokens
from bearsdk.snapshot import snapshot_from_dict

MODEL = BatchTimeModel(0.004, 2e-5, 4e-8, 1e-10)


def snapshot_doc(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": "i0",
        "seq": 7,
        "time": 100.0,
        "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 900},
        "requests": [
            {
                "id": "a",
                "state": "running",
                "prompt_tokens": 100,
                "computed_tokens": 120,
                "output_tokens": 21,
                "output_len": 50,
            },
            {
                "id": "b",
                "state": "running",
                "prompt_tokens": 300,
                "computed_tokens": 256,
                "output_tokens": 0,
                "output_len": 20,
            },
            {
                "id": "c",
                "state": "waiting",
                "prompt_tokens": 80,
                "computed_tokens": 0,
                "output_tokens": 5,
                "output_len": 30,
            },
            {
                "id": "d",
                "state": "waiting",
                "prompt_tokens": 40,
                "computed_tokens": 0,
                "output_tokens": 0,
                "output_len": 10,
            },
        ],
    }
    d.update(over)
    return d


# ---------------------------------------------------------------- interface


def test_every_estimator_implements_the_protocol() -> None:
    bea = BEAEstimator.for_scheduler(
        "vllm-v1", MODEL, {"max_num_batched_tokens": 512, "max_num_seqs": 8}
    )
    for est in (
        LPSEstimator(),
        PrefillThroughputEstimator(1000.0),
        ScoreEstimator(),
        RouteBalanceEstimator(),
        LMDeployProxyEstimator(),
        SemanticRouterEstimator(),
        BEALatencyEstimator(bea),
    ):
        assert isinstance(est, LatencyEstimator)
        assert est.estimate_ttft(RequestInfo(100, 20), InstanceView()) >= 0.0


def test_request_and_view_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        RequestInfo(0)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestInfo(10, output_tokens=0)
    with pytest.raises(ValueError, match="unfinished"):
        InstanceView(unfinished=-1)
    with pytest.raises(ValueError, match="arrival_rate"):
        InstanceView(arrival_rate=math.nan)
    with pytest.raises(ValueError, match="snapshot_age_s"):
        InstanceView(snapshot_age_s=-1.0)
    assert RequestInfo(10, 500, max_tokens=64).expected_output(256) == 64
    assert RequestInfo(10).expected_output(256) == 256


# ---------------------------------------------------------------- InstanceStats


def test_stats_counts_and_pending_work() -> None:
    s = InstanceStats(window_s=100.0)
    s.on_dispatch("a", 0.0, 100, 50)
    s.on_dispatch("b", 1.0, 200, None)
    s.on_dispatch("c", 2.0, 300, 10)
    assert s.on_first_token("a", 0.5) == 0.5
    s.on_tokens("a", 1.5, 20)
    v = s.view(3.0)
    assert (v.dispatched, v.unfinished, v.running, v.waiting) == (3, 3, 1, 2)
    assert v.pending_prefill_tokens == 500
    assert v.pending_decode_tokens == 30 + 256 + 10  # a: 50 - 20; b: default; c: 10
    assert v.recent_ttfts_s == (0.5,)
    s.on_complete("a", 4.0, 50)
    s.on_abort("b", 4.5)
    v = s.view(5.0)
    assert (v.unfinished, v.running, v.waiting, v.pending_prefill_tokens) == (1, 0, 1, 300)
    assert v.mean_tpot_s == pytest.approx((4.0 - 0.5) / 49)
    assert v.mean_output_tokens == 50


def test_stats_rates_busy_time_and_variability() -> None:
    s = InstanceStats(window_s=1000.0)
    t = 0.0
    for i in range(200):  # deterministic arrivals every 2 s, each served in 1 s
        s.on_dispatch(f"r{i}", t, 100, 10)
        s.on_first_token(f"r{i}", t + 0.1)
        s.on_complete(f"r{i}", t + 1.0, 10)
        t += 2.0
    v = s.view(t)
    assert v.arrival_rate == pytest.approx(199 / 400, rel=1e-3)
    assert v.completion_rate == pytest.approx(200 / 400, rel=1e-3)
    assert v.service_rate == pytest.approx(1.0)  # completions per busy second
    assert v.output_token_rate == pytest.approx(2000 / 400, rel=1e-3)
    assert v.arrival_scv == pytest.approx(0.0, abs=1e-9)
    assert v.service_scv == pytest.approx(0.0, abs=1e-9)
    assert v.prefill_throughput == pytest.approx(100 / 0.1)  # every request found no queue
    assert v.ttft_ewma_s == pytest.approx(0.1)


def test_stats_window_forgets_old_events() -> None:
    s = InstanceStats(window_s=10.0)
    for i in range(10):
        s.on_dispatch(f"r{i}", float(i), 10, 1)
        s.on_complete(f"r{i}", float(i) + 0.5, 1)
    assert s.view(100.0).completion_rate == 0.0
    assert s.view(100.0).mean_output_tokens is None


def test_stats_saturated_concurrency_from_engine_counts() -> None:
    s = InstanceStats(window_s=60.0)
    s.on_load(0.0, 10, 0)  # not saturated: does not tell k
    s.on_load(10.0, 24, 5)
    s.on_load(20.0, 26, 9)
    s.on_load(30.0, 12, 0)
    v = s.view(40.0)
    assert v.concurrency is not None
    assert 24 < v.concurrency < 26
    assert (v.running, v.waiting) == (12, 0)


def test_stats_reject_bad_events() -> None:
    s = InstanceStats()
    s.on_dispatch("a", 0.0, 10)
    with pytest.raises(ValueError, match="already in flight"):
        s.on_dispatch("a", 1.0, 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        s.on_dispatch("b", 1.0, 0)
    with pytest.raises(ValueError, match="not in flight"):
        s.on_complete("zzz", 1.0)
    with pytest.raises(ValueError, match="now"):
        s.on_first_token("a", math.nan)
    with pytest.raises(ValueError, match="window_s"):
        InstanceStats(window_s=0.0)


# ---------------------------------------------------------------- baselines


def test_score_is_queueing_plus_own_generation() -> None:
    view = InstanceView(pending_decode_tokens=1000, mean_tpot_s=0.02)
    assert ScoreEstimator().estimate_ttft(RequestInfo(50, 100), view) == pytest.approx(0.02 * 1100)
    assert ScoreEstimator(tpot_s=0.01).estimate_ttft(RequestInfo(50, 100), view) == pytest.approx(
        11.0
    )
    assert ScoreEstimator(default_output_tokens=10).estimate_ttft(
        RequestInfo(50), InstanceView(pending_decode_tokens=90)
    ) == pytest.approx(0.02 * 100)


def test_routebalance_divides_pending_decode_by_batch_size() -> None:
    view = InstanceView(pending_decode_tokens=3200, running=32, mean_tpot_s=0.025)
    assert RouteBalanceEstimator().estimate_ttft(RequestInfo(10), view) == pytest.approx(
        100 * 0.025
    )
    idle = InstanceView(pending_decode_tokens=0, running=0)
    assert RouteBalanceEstimator().estimate_ttft(RequestInfo(10), idle) == 0.0


def test_lmdeploy_is_unfinished_over_throughput() -> None:
    view = InstanceView(unfinished=12, completion_rate=4.0)
    assert LMDeployProxyEstimator().estimate_ttft(RequestInfo(10), view) == pytest.approx(3.0)
    assert LMDeployProxyEstimator(requests_per_s=6.0).estimate_ttft(RequestInfo(10), view) == 2.0
    assert (
        LMDeployProxyEstimator().estimate_ttft(RequestInfo(10), InstanceView(unfinished=3)) == 3.0
    )


def test_semantic_router_percentile_of_recent_ttfts() -> None:
    ttfts = tuple(float(x) for x in range(1, 102))  # 1..101
    view = InstanceView(recent_ttfts_s=ttfts, ttft_ewma_s=7.0)
    assert SemanticRouterEstimator(percentile=50).estimate_ttft(RequestInfo(1), view) == 51.0
    assert SemanticRouterEstimator(percentile=90).estimate_ttft(RequestInfo(1), view) == 91.0
    assert (
        SemanticRouterEstimator(percentile=50, window=11).estimate_ttft(RequestInfo(1), view)
        == 96.0
    )
    few = InstanceView(recent_ttfts_s=(1.0, 3.0), ttft_ewma_s=2.5)
    assert SemanticRouterEstimator().estimate_ttft(RequestInfo(1), few) == 2.5
    assert (
        SemanticRouterEstimator(no_data_s=0.0).estimate_ttft(RequestInfo(1), InstanceView()) == 0.0
    )
    assert percentile([1.0, 2.0], 0.25) == 1.25
    assert normalized_scores({"a": 0.2, "b": 0.5, "c": math.inf}) == {
        "a": 1.0,
        "b": 2.5,
        "c": math.inf,
    }
    with pytest.raises(ValueError, match="percentile"):
        SemanticRouterEstimator(percentile=0)


# ---------------------------------------------------------------- eq. 8


def test_remaining_prefill_of_a_snapshot() -> None:
    snap = snapshot_from_dict(snapshot_doc())
    # a decodes (0), b has 44 prompt tokens left, c recomputes 85, d prefills 40.
    assert remaining_prefill_tokens(snap) == 44 + 85 + 40


def test_prefill_throughput_estimator_eq8() -> None:
    snap = snapshot_from_dict(snapshot_doc())
    est = PrefillThroughputEstimator(theta_pre=1000.0)
    with_snap = InstanceView(snapshot=snap, snapshot_age_s=0.0, pending_prefill_tokens=99999)
    assert est.estimate_ttft(RequestInfo(231), with_snap) == pytest.approx((169 + 231) / 1000)
    no_snap = InstanceView(pending_prefill_tokens=769)
    assert est.estimate_ttft(RequestInfo(231), no_snap) == pytest.approx(1.0)
    online = InstanceView(prefill_throughput=500.0)
    assert PrefillThroughputEstimator().estimate_ttft(RequestInfo(100), online) == pytest.approx(
        0.2
    )
    assert PrefillThroughputEstimator().estimate_ttft(RequestInfo(100), InstanceView()) == math.inf
    assert nominal_theta_pre(BatchTimeModel(0.0, 1e-4, 0, 0), 1000) == pytest.approx(1e4)


# ---------------------------------------------------------------- BEA adapter


def test_bea_adapter_replays_fresh_snapshots_and_falls_back_otherwise() -> None:
    bea = BEAEstimator.for_scheduler(
        "vllm-v1",
        MODEL,
        {
            "max_num_batched_tokens": 512,
            "max_num_seqs": 8,
            "block_size": 16,
            "num_gpu_blocks": 1000,
        },
    )
    fallback = LPSEstimator(theta_pre=1e4)
    adapter = BEALatencyEstimator(bea, fallback=fallback, max_snapshot_age_s=0.5)
    snap = snapshot_from_dict(snapshot_doc())
    req = RequestInfo(300, 5)
    fresh = InstanceView(snapshot=snap, snapshot_age_s=0.1)
    expected = bea.estimate(snap, 300, 5).ttft_s
    assert adapter.estimate_ttft(req, fresh) == pytest.approx(expected)
    assert adapter.estimate_ttft(req, fresh) == pytest.approx(expected)  # cached preparation
    stale = InstanceView(snapshot=snap, snapshot_age_s=2.0)
    assert adapter.estimate_ttft(req, stale) == pytest.approx(0.03)
    assert adapter.estimate_ttft(req, InstanceView()) == pytest.approx(0.03)
    # A longer prompt at the same instance state cannot be served sooner.
    assert adapter.estimate_ttft(RequestInfo(2000, 5), fresh) > expected


def test_bea_adapter_accepts_the_richer_dense_term() -> None:
    bea = BEAEstimator.for_scheduler("vllm-v1", MODEL.with_dense_floor(64))
    assert BEALatencyEstimator(bea).bea.batch_time.dense_floor_tokens == 64


def test_stats_view_feeds_every_estimator() -> None:
    s = InstanceStats(window_s=30.0)
    t = 0.0
    for i in range(60):
        s.on_dispatch(f"r{i}", t, 200 + i, 40)
        if i >= 3:
            s.on_first_token(f"r{i - 3}", t)
        if i >= 6:
            s.on_complete(f"r{i - 6}", t, 40)
        t += 0.25
    view = s.view(t, name="i0")
    ests: list[LatencyEstimator] = [
        LPSEstimator(concurrency=4, variability=True),
        PrefillThroughputEstimator(1e4),  # every TTFT here was queued: no online theta
        ScoreEstimator(),
        RouteBalanceEstimator(),
        LMDeployProxyEstimator(),
        SemanticRouterEstimator(),
    ]
    for est in ests:
        value = est.estimate_ttft(RequestInfo(500, 40), view)
        assert math.isfinite(value), est
        assert value >= 0.0, est

"""Runs: the real router on a virtual clock, the oracles, metrics, sweeps and their summary."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from bearsdk.predictors import Predictor
from bearsdk.sim import (
    ORACLE,
    ORACLE_LATENCY,
    PAPER_POOL,
    InstanceSpec,
    PolicySpec,
    RequestSet,
    RunResult,
    Scenario,
    arrival_times,
    build_requests,
    calibrate_pool,
    run_scenario,
    summarize,
)
from bearsdk.sim.inputs import SimInputError, engine_output_lengths
from bearsdk.state import StalenessRules
from bearsdk.workload import requests_at, task_prompts

N = 300


@pytest.fixture(scope="module")
def requests() -> RequestSet:
    bank = task_prompts(60, seed=2)
    items = requests_at(bank, np.zeros(N), seed=2)
    return build_requests(items, PAPER_POOL, Predictor.load_default())


def _run(rs: RequestSet, policy: str, rate: float = 14.0, **kw: object) -> RunResult:
    sc = Scenario(PolicySpec(policy), rate, seed=2, **kw)  # type: ignore[arg-type]
    return run_scenario(rs, PAPER_POOL, sc, arrival_times(sc.arrivals, N, rate, 2))


def test_truth_comes_from_the_emulator_and_predictions_from_the_predictor(
    requests: RequestSet,
) -> None:
    rs = requests
    assert rs.true_output.shape == rs.true_accuracy.shape == (N, 3)
    # Same prompt, same profile: the emulator's length; distinct prompts repeat.
    texts = list(rs.texts[:5])
    again = engine_output_lengths(texts, [s.engine for s in PAPER_POOL])
    assert again.tolist() == rs.true_output[:5].tolist()
    assert np.all(rs.true_output >= 1)
    assert rs.models == Predictor.load_default().models
    p = Predictor.load_default().predict(rs.texts[0], prompt_tokens=int(rs.prompt_tokens[0]))
    assert rs.prediction(0).accuracy.tolist() == p.accuracy.tolist()
    # Micro-dollars: tokens times USD per million tokens.
    cost = rs.true_cost()
    assert cost[0, 2] == pytest.approx(rs.prompt_tokens[0] * 0.287 + rs.true_output[0, 2] * 0.640)


def test_a_router_run_is_deterministic_and_consistent(requests: RequestSet) -> None:
    a = _run(requests, "bear")
    b = _run(requests, "bear")
    assert attrs.evolve(a, wall_s=0.0, decide_us=0.0) == attrs.evolve(b, wall_s=0.0, decide_us=0.0)
    assert a.n == N
    assert sum(c["routed"] for c in a.composition.values()) == N
    assert all(c["met"] + c["missed"] == c["routed"] for c in a.composition.values())
    met = sum(c["met"] for c in a.composition.values())
    assert a.slo_attainment == pytest.approx(met / N)
    assert 0.0 < a.on_time_utility <= a.mean_utility + 1e-12
    # BEA's estimates, scored against what happened.
    assert "bea" in a.ttft_mape
    assert 0.0 < a.ttft_mape["bea"] < 1.0
    # Each figure's count: the estimators' share the requests scored, and
    # weighing their figures by them gives the overall one (how runs pool).
    n = a.ttft_mape_n
    assert set(n) == set(a.ttft_mape)
    assert 0 < n["all"] <= N
    assert sum(v for k, v in n.items() if k != "all") == n["all"]
    pooled = sum(a.ttft_mape[k] * v for k, v in n.items() if k != "all") / n["all"]
    assert pooled == pytest.approx(a.ttft_mape["all"], rel=1e-12)
    assert a.as_dict()["ttft_mape_n"] == n
    assert a.batches > 0
    assert a.mean_ttft_s > 0


def test_policies_route_differently_and_baselines_use_their_estimators(
    requests: RequestSet,
) -> None:
    rr = _run(requests, "round-robin")
    assert [c["routed"] for c in rr.composition.values()] == [100, 100, 100]
    assert math.isnan(rr.ttft_mape["all"])
    la = _run(requests, "latency-agnostic")
    assert la.composition["qwen3-0.6b"]["routed"] == 0  # never the best utility here
    tps = _run(requests, "prefill-tps")
    assert set(tps.ttft_mape) == {"all", "prefill-tps"}
    sr = _run(requests, "semantic-router")
    assert "semantic-router" in sr.ttft_mape


def test_the_oracle_is_the_ceiling_and_bear_approaches_it(requests: RequestSet) -> None:
    oracle = _run(requests, ORACLE, rate=16.0)
    latency = _run(requests, ORACLE_LATENCY, rate=16.0)
    bear = _run(requests, "bear", rate=16.0)
    base = [
        _run(requests, p, rate=16.0) for p in ("latency-agnostic", "round-robin", "shortest-queue")
    ]
    assert oracle.on_time_utility > bear.on_time_utility
    assert oracle.on_time_utility > latency.on_time_utility
    assert bear.on_time_utility > 0.8 * oracle.on_time_utility
    assert all(bear.on_time_utility > b.on_time_utility for b in base)


def test_stale_snapshots_go_through_the_routers_staleness_handling(requests: RequestSet) -> None:
    fresh = _run(requests, "bear", staleness_s=0.0)
    stale = _run(requests, "bear", staleness_s=0.4)
    assert "fast-forward" in stale.ttft_mape
    assert stale.ttft_mape.keys() != fresh.ttft_mape.keys() or stale != fresh
    paper = _run(requests, "bear", staleness_s=0.4, router_staleness=StalenessRules.paper())
    # Replays whatever it has; only before the first snapshot arrives, the fallback.
    assert set(paper.ttft_mape) == {"all", "bea", "lps"}


def test_streamed_tokens_place_stale_views_where_the_engines_are(requests: RequestSet) -> None:
    # 400 ms old snapshots under bursts: the router's streams say when each
    # engine's latest step ended, and the fast-forwarded views' batch in flight
    # is placed there (StalenessRules.anchor_steps) rather than where the
    # batch-time model drifted to.
    kw: dict[str, object] = {"rate": 10.0, "staleness_s": 0.4, "arrivals": "mmpp2:3"}
    on = _run(requests, "bear", **kw)
    off = _run(requests, "bear", router_staleness=StalenessRules(anchor_steps=False), **kw)
    assert on.ttft_mape["fast-forward"] < 0.8 * off.ttft_mape["fast-forward"]


def test_online_batch_time_refits_the_routers_coefficients_as_batches_come(
    requests: RequestSet,
) -> None:
    # The profiles are not the simulated hardware (test_calibration_fits_...):
    # following the engines' batch records, as AsyncRouter follows
    # /bear/batches, the router's estimates of fresh snapshots close in on it.
    profile = _run(requests, "bear", rate=8.0)
    online = _run(requests, "bear", rate=8.0, online_batch_time=True)
    assert online.ttft_mape["bea"] < 0.7 * profile.ttft_mape["bea"]
    assert online.speed is not None
    assert profile.speed is not None


def test_an_engine_streams_while_something_decodes() -> None:
    from bearsdk.sim.engine import BatchNoise, SimEngine, bind_engine

    em = bind_engine("qwen3-8b-h100")
    tm = em.time_model
    e = SimEngine("x", em.policy, em.max_model_len, tm, BatchNoise(tm.params, 1), lambda ev: None)
    assert e.streamed_at(0.0) is None  # idle
    e.add_request("a", 2000, 500, 0.0)
    e.advance(1e-4)
    assert e.streamed_at(1e-4) is None  # its prompt is still being computed
    e.advance(0.2)
    at = e.streamed_at(0.2)
    assert at is not None
    assert 0.0 < at <= 0.2
    assert e.streamed_at(at - 1e-9) is None  # not before that step ended


def test_diagnosis_scores_every_candidate(requests: RequestSet) -> None:
    sc = Scenario(PolicySpec("bear"), 12.0, seed=2)
    r = run_scenario(requests, PAPER_POOL, sc, arrival_times("poisson", N, 12.0, 2), diagnose=True)
    for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-32b"):
        d = r.diagnosis[name]
        assert d["n"] == N
        assert 0.0 <= d["false_miss"] <= 1.0
        assert 0.0 <= d["false_hit"] <= 1.0
    assert r.diagnosis["qwen3-8b/bea"]["mape"] < 0.5


def test_the_floor_is_exact_alone_and_later_arrivals_only_delay(requests: RequestSet) -> None:
    """The chosen engine's true forecast is the TTFT it gives when nothing arrives
    after the request; under load later arrivals share its batches and only add."""
    sc = Scenario(PolicySpec("bear"), 0.05, seed=2)  # one request every 20 s: alone
    alone = run_scenario(
        requests, PAPER_POOL, sc, arrival_times("poisson", N, 0.05, 2), diagnose=True
    )
    assert alone.ttft_floor["n"] == N
    assert alone.ttft_floor["mape"] < 1e-9
    sc = Scenario(PolicySpec("bear"), 40.0, seed=2)
    busy = run_scenario(
        requests, PAPER_POOL, sc, arrival_times("poisson", N, 40.0, 2), diagnose=True
    )
    floor = busy.ttft_floor
    assert floor["n"] == N
    assert floor["mape"] > 0.001
    assert floor["bias"] < 0.0  # the forecast is short of what later arrivals made it
    assert busy.as_dict()["ttft_floor"] == floor
    assert "ttft_floor" not in _run(requests, "bear").as_dict()


def test_a_floor_with_nothing_to_measure_holds_no_nan() -> None:
    from bearsdk.sim.run import _Diagnosis

    none = np.zeros(0)
    assert _Diagnosis(["a"]).floor(np.zeros(0, dtype=np.int64), none, none, none) == {"n": 0.0}


def test_missing_truth_is_an_error_naming_the_model() -> None:
    bank = task_prompts(3, seed=1)
    pool = (InstanceSpec("x", "FuseChat-Llama-3.2-1B-Instruct", "qwen3-0.6b-h100"),)
    with pytest.raises(SimInputError, match="not in the predictor's pool"):
        build_requests(bank, pool, Predictor.load_default())
    with pytest.raises(SimInputError, match="no output length"):
        build_requests(bank, PAPER_POOL, Predictor.load_default(), lengths="data")


def test_calibration_fits_the_simulated_hardware(requests: RequestSet) -> None:
    pool, cals = calibrate_pool(PAPER_POOL[:2], requests, per_phase=60, seed=9)
    assert [c.instance for c in cals] == ["qwen3-0.6b", "qwen3-8b"]
    for spec, cal in zip(pool, cals, strict=True):
        assert spec.batch_time == cal.model.extended_coeffs
        assert cal.batches > 100
        assert cal.fit_mape < 0.06
        assert cal.fit_mape <= cal.profile_mape + 1e-9


def test_summary_measures_gain_oracle_fraction_and_staleness_loss() -> None:
    def res(policy: str, rate: float, otu: float, st: float = 0.0) -> RunResult:
        sc = Scenario(PolicySpec(policy), rate, staleness_s=st, sweep="s")
        return RunResult(sc, 10, otu, 1.0, otu, 0.1, 0.2, {}, {}, 0.0, 0.0, 0)

    rows = [
        res("bear", 4, 0.6),
        res("round-robin", 4, 0.5),
        res("score", 4, 0.4),
        res(ORACLE, 4, 0.75),
        res("bear", 8, 0.5),
        res("round-robin", 8, 0.55),
        res("bear", 8, 0.45, st=1.0),
    ]
    s = summarize(rows)
    by_rate = {g["rate"]: g for g in s["gain"]}
    assert by_rate[4]["gain_pct"] == pytest.approx(20.0)
    assert by_rate[4]["best_baseline"] == "round-robin"
    assert by_rate[4][f"bear_fraction_of_{ORACLE}"] == pytest.approx(0.8)
    assert by_rate[8]["bear_ahead_of_all"] is False
    (m,) = s["mean_gain"]
    assert m["mean_gain_pct"] == pytest.approx((20.0 + 100 * (0.5 / 0.55 - 1)) / 2)
    assert m["bear_ahead_everywhere"] is False
    (st,) = s["staleness"]
    assert st["loss_pct"]["1000"] == pytest.approx(10.0)

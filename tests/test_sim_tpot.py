"""TPOT targets in the simulator, the prefills still to come, and the llm-d-style baseline."""

from __future__ import annotations

import math
import tomllib
from typing import Any

import attrs
import numpy as np
import pytest

from bearsdk.estimators.stats import InstanceStats
from bearsdk.predictors import Predictor
from bearsdk.selectors import SLOHeadroom, make_selector
from bearsdk.selectors.base import Option
from bearsdk.sim import (
    PAPER_POOL,
    PolicySpec,
    RequestSet,
    RunResult,
    Scenario,
    SimConfigError,
    arrival_times,
    build_requests,
    parse_config,
    run_scenario,
)
from bearsdk.sim.run import _tpot
from bearsdk.workload import TPOT_TARGETS_S, requests_at, task_prompts

N = 500
SEED = 4
RATE = 20.0
TPOT_S = 0.025


@pytest.fixture(scope="module")
def requests() -> RequestSet:
    bank = task_prompts(80, seed=SEED)
    items = requests_at(bank, np.zeros(N), seed=SEED)
    rs = build_requests(items, PAPER_POOL, Predictor.load_default())
    return attrs.evolve(rs, tpot_targets_s=np.full(N, TPOT_S))


def _run(rs: RequestSet, name: str, **params: Any) -> RunResult:
    sc = Scenario(PolicySpec(name, tuple(sorted(params.items()))), RATE, seed=SEED)
    return run_scenario(rs, PAPER_POOL, sc, arrival_times("poisson", N, RATE, SEED))


def test_tpot_is_vllms_last_token_less_first_over_outputs_less_one() -> None:
    first = np.array([1.0, 2.0, 3.0, np.nan])
    done = np.array([2.0, 2.0, 4.5, np.nan])
    out = np.array([11, 1, 4, 5])
    got = _tpot(first, done, out)
    assert got[0] == pytest.approx(0.1)
    assert math.isnan(got[1])  # one token: no pace to miss
    assert got[2] == pytest.approx(0.5)
    assert math.isnan(got[3])  # never served


def test_routing_on_tpot_meets_both_targets_more_often(requests: RequestSet) -> None:
    ttft_only = _run(requests, "bear", tpot_tokens=0)
    both = _run(requests, "bear", tpot_tokens=32)
    for r in (ttft_only, both):
        t = r.tpot
        assert set(t) >= {"ttft_attainment", "tpot_attainment", "tpot_missed", "p90_tpot_s"}
        assert t["ttft_attainment"] is not None
        assert t["tpot_attainment"] is not None
        # On time means both: never more often than either alone.
        assert r.slo_attainment <= min(t["ttft_attainment"], t["tpot_attainment"]) + 1e-12
        assert "tpot" in r.as_dict()
    assert both.tpot["tpot_missed"] < ttft_only.tpot["tpot_missed"]
    assert both.on_time_utility > ttft_only.on_time_utility


def test_the_llm_d_style_baseline_learns_and_routes(requests: RequestSet) -> None:
    r = _run(requests, "slo-headroom")
    assert r.tpot["tpot_attainment"] is not None
    # It learned enough to spread the load beyond the first instance.
    assert sum(c["routed"] > 0 for c in r.composition.values()) >= 2
    assert r.on_time_utility > 0.0


def test_without_tpot_targets_nothing_changes(requests: RequestSet) -> None:
    plain = attrs.evolve(requests, tpot_targets_s=None)
    a = _run(plain, "bear", tpot_tokens=0)
    b = _run(plain, "bear", tpot_tokens=32)
    assert a.tpot == {} == b.tpot
    assert a.composition == b.composition
    assert a.on_time_utility == b.on_time_utility


def _doc(**workload: Any) -> dict[str, Any]:
    doc = tomllib.loads(
        """
        [simulation]
        name = "t"
        requests = 10
        [[pool]]
        name = "a"
        model = "Qwen/Qwen3-8B"
        engine = "qwen3-8b-h100"
        [policies]
        bear = {}
        [[sweep]]
        name = "r"
        rates = [1]
        """
    )
    doc["workload"] = workload
    return doc


def test_tpot_targets_are_none_tasks_or_seconds() -> None:
    assert parse_config(_doc()).workload.tpot_targets == "none"
    assert parse_config(_doc(tpot_targets="tasks")).workload.tpot_targets == "tasks"
    assert parse_config(_doc(tpot_targets=0.03)).workload.tpot_targets == 0.03
    for bad in ("fast", -1, 0, True):
        with pytest.raises(SimConfigError, match="tpot_targets"):
            parse_config(_doc(tpot_targets=bad))
    assert set(TPOT_TARGETS_S) == {"alpaca", "govreport", "hotpotqa", "writingprompts"}


def test_prefill_load_is_the_recent_dispatches_eq12_prefill_per_second() -> None:
    s = InstanceStats()
    assert s.prefill_load(0.0, 1e-4, 1e-8) == 0.0
    for i in range(10):
        s.on_dispatch(f"r{i}", float(i), 100)
    # Ten 100-token prompts over 9 s: tokens and attention (100 * 101 / 2 each).
    want = (1e-4 * 1000 + 1e-8 * 10 * 5050) / 9.0
    assert s.prefill_load(9.0, 1e-4, 1e-8) == pytest.approx(want)
    # Past the horizon they no longer count.
    assert s.prefill_load(100.0, 1e-4, 1e-8) == 0.0


def _opt(name: str, utility: float, ttft: float, tpot: float) -> Option:
    return Option(name, "m", utility, 0.0, utility, ttft, tpot_s=tpot)


def test_slo_headroom_takes_the_best_utility_with_headroom_else_the_least_short() -> None:
    sel = make_selector("slo-headroom")
    assert isinstance(sel, SLOHeadroom)
    assert sel.latency == "learned"
    assert sel.next_tokens(0.05) == 1
    assert sel.next_tokens(math.inf) == 0
    opts = [_opt("a", 0.9, 0.1, 0.08), _opt("b", 0.7, 0.3, 0.02), _opt("c", 0.8, 0.3, 0.03)]
    assert sel.select(opts, 0.5, tpot_target_s=0.05).index == 2
    late = [_opt("a", 0.9, 1.0, 0.05), _opt("b", 0.7, 0.6, 0.5)]
    # TTFT shortfall weighs 0.8, TPOT's 0.2: a 100% late TTFT beats a 900% late TPOT.
    got = sel.select(late, 0.5, tpot_target_s=0.05)
    assert got.index == 0
    assert "least short" in got.reason


def test_a_cached_prefix_brings_no_prefill_load() -> None:
    s = InstanceStats()
    s.on_dispatch("a", 0.0, 1000, cached_tokens=800)
    s.on_dispatch("b", 9.0, 1000, cached_tokens=5000)  # more than the prompt: all but one
    # a computes tokens 801..1000, b only its last.
    want = (1e-4 * (200 + 1) + 1e-8 * ((1000 * 1001 - 800 * 801) / 2 + 1000)) / 9.0
    assert s.prefill_load(9.0, 1e-4, 1e-8) == pytest.approx(want)

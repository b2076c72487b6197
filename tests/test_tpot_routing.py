"""Routing on TPOT (issue 21): BEAR's feasibility with both targets, the Lagrangian's
TPOT term, and the router asking BEA to follow the first tokens."""

from __future__ import annotations

import math
import random
from pathlib import Path

import anyio
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.replay.blocks import chain_keys
from bearsdk.router import AsyncRouter, InstanceConfig, RequestError
from bearsdk.selectors import BEAR, Lagrangian, LatencyAgnostic, Option

MSG = [{"role": "user", "content": "Explain in 2 sentences why the sky is blue."}]


def _opt(name: str, utility: float, ttft: float, tpot: float) -> Option:
    return Option(name, "m", utility, 0.0, utility, ttft, tpot_s=tpot)


def test_bear_needs_both_targets_when_a_tpot_target_is_given() -> None:
    opts = [_opt("fast-first", 0.9, 0.1, 0.08), _opt("steady", 0.7, 0.3, 0.02)]
    sel = BEAR()
    # TTFT alone: the better utility meets it.
    assert sel.select(opts, 0.5).index == 0
    got = sel.select(opts, 0.5, tpot_target_s=0.05)
    assert got.index == 1
    assert got.feasible == (False, True)
    assert "both targets" in got.reason
    # An unknown TPOT (a fallback estimate) is judged on its TTFT alone.
    opts[0].tpot_s = math.nan
    assert sel.select(opts, 0.5, tpot_target_s=0.05).index == 0


def test_bear_with_no_instance_meeting_both_takes_the_least_late() -> None:
    opts = [_opt("a", 0.9, 0.2, 0.2), _opt("b", 0.5, 0.9, 0.06), _opt("c", 0.1, 0.3, 0.09)]
    got = BEAR().select(opts, 0.25, tpot_target_s=0.05)
    # Lateness relative to the targets: a 4x (TPOT), b 3.6x (TTFT), c 1.8x.
    assert got.index == 2
    assert not any(got.feasible or ())
    assert "least late" in got.reason


def test_only_selectors_that_route_on_tpot_ask_for_it() -> None:
    assert BEAR().next_tokens(0.05) == 32
    assert BEAR().next_tokens(math.inf) == 0
    assert BEAR(tpot_tokens=0).next_tokens(0.05) == 0
    assert Lagrangian().next_tokens(0.05) == 0
    assert Lagrangian(tpot_delta=2.0, tpot_tokens=8).next_tokens(math.inf) == 8
    assert not hasattr(LatencyAgnostic(), "next_tokens")
    for bad in (-1, 5000, 1.5, True):
        with pytest.raises(ValueError, match="tpot_tokens"):
            BEAR(tpot_tokens=bad)  # type: ignore[arg-type]


def test_the_lagrangian_prices_tpot_when_told_to() -> None:
    opts = [_opt("a", 0.9, 0.1, 0.10), _opt("b", 0.85, 0.1, 0.02)]
    assert Lagrangian(delta=1.0).select(opts, math.inf).index == 0
    got = Lagrangian(delta=1.0, tpot_delta=1.0).select(opts, math.inf)
    assert got.index == 1
    assert got.scores[1] == pytest.approx(0.85 - 0.1 - 0.02)
    assert "TPOT" in got.reason


def _configs(pool: EnginePool) -> list[InstanceConfig]:
    return [
        InstanceConfig(
            name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile, timeout_s=20.0
        )
        for e in pool
    ]


async def test_a_tpot_target_has_bea_follow_the_first_tokens_at_every_instance() -> None:
    async with (
        EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100") as pool,
        # (price_all: by default the 8B on time would leave the 0.6B unpriced.)
        AsyncRouter(_configs(pool), BEAR(price_all=True)) as router,
    ):
        with anyio.fail_after(5):
            for n in router.instances:
                await router.cache(n).wait_version(0)
        plain = router.decide(MSG, ttft_target=1.0)
        assert all(math.isnan(c.tpot_s) for c in plain.candidates)
        assert plain.tpot_target_s == math.inf
        d = router.decide(MSG, ttft_target=1.0, tpot_target=0.5)
        assert d.tpot_target_s == 0.5
        # An idle engine: TPOT is the decode-only batch time of each model.
        tpot = {c.instance: c.tpot_s for c in d.candidates}
        assert all(0.0 < t < 0.5 for t in tpot.values()), tpot
        small, large = (e.instance for e in pool)
        assert tpot[small] < tpot[large]
        assert "TPOT 500.0 ms" in d.explain()
        assert "tpot" in d.explain()
        # Nothing meets a 1 us TPOT: the least late instance, said so.
        late = router.decide(MSG, ttft_target=1.0, tpot_target=1e-6)
        assert late.instance == small
        assert "least late" in late.reason
        for bad in (0, -1.0, math.nan, "fast", True):
            with pytest.raises(RequestError, match="tpot_target"):
                router.decide(MSG, tpot_target=bad)  # type: ignore[arg-type]
        # chat() takes the target for itself: it never reaches the engine's body.
        resp = await router.chat(MSG, ttft_target=1.0, tpot_target=0.5, max_tokens=4)
        assert resp.instance in {small, large}


def test_recent_prefill_load_stretches_the_predicted_tpot() -> None:
    from bearsdk.bench.router import _configs
    from bearsdk.predictors import Predictor
    from bearsdk.router.core import RouterCore
    from bearsdk.router.pricing import tpot_with_arrivals as _with_arrivals

    core = RouterCore(_configs(2), BEAR(), predictor=Predictor.load_default(), clock=lambda: 10.0)
    s = core.slot(core.instances[0])
    assert _with_arrivals(0.02, s, 10.0) == 0.02  # nothing sent yet: the replay's own
    for i in range(50):
        s.stats.on_dispatch(f"r{i}", 5.0 + i * 0.1, 2000)
    c = s.state.estimator.replay_coeffs
    rho = s.stats.prefill_load(10.0, c[1], c[3])
    assert 0.0 < rho < 0.9
    assert _with_arrivals(0.02, s, 10.0) == pytest.approx(0.02 / (1.0 - rho))
    # An instance drowning in prefill is much slower, not infinitely so.
    for i in range(50, 2000):
        s.stats.on_dispatch(f"r{i}", 9.0 + i * 1e-4, 8000)
    assert _with_arrivals(0.02, s, 10.0) == pytest.approx(0.2)


def test_the_decision_cost_bench_pairs_tpot_with_ttft_only() -> None:
    from bearsdk.bench.decisions import tpot_cost

    r = tpot_cost(10, 20)
    assert r["decisions"] == 20
    assert r["ttft_only"]["median_us"] > 0.0
    assert r["with_tpot"]["median_us"] > 0.0
    assert r["ratio_median"] > 0.0


def test_the_harm_rule_keeps_residents_within_their_targets() -> None:
    from bearsdk.selectors.bear import harms

    def opt(base: float, with_: float, target: float) -> Option:
        o = _opt("x", 0.9, 0.1, 0.02)
        o.resident_itl_base_s, o.resident_itl_s, o.resident_tpot_target_s = base, with_, target
        return o

    assert harms(opt(0.020, 0.030, 0.025), "targets", math.inf)  # pushed past it
    assert not harms(opt(0.020, 0.024, 0.025), "targets", math.inf)  # still within
    assert not harms(opt(0.030, 0.040, 0.025), "targets", math.inf)  # already past
    assert not harms(opt(0.020, 0.030, 0.025), "none", math.inf)
    assert harms(opt(0.020, 0.024, math.inf), "none", 0.1)  # 20% slower than allowed
    assert not harms(opt(math.nan, math.nan, 0.025), "targets", 0.0)  # not weighed
    sel = BEAR()
    opts = [opt(0.020, 0.030, 0.025), opt(0.020, 0.021, 0.025)]
    opts[1].utility = 0.5
    got = sel.select(opts, 0.5, tpot_target_s=0.05)
    assert got.index == 1
    assert got.feasible == (False, True)
    assert BEAR(harm="none").select(opts, 0.5, tpot_target_s=0.05).index == 0
    assert BEAR().weighs_residents(0.025)
    assert not BEAR().weighs_residents(math.inf)
    assert BEAR(harm="none", max_slowdown=0.2).weighs_residents(math.inf)
    for bad in ("some", 1):
        with pytest.raises(ValueError, match="harm"):
            BEAR(harm=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_slowdown"):
        BEAR(max_slowdown=-0.1)


async def test_residents_with_targets_are_weighed_in_the_decision() -> None:
    async with (
        EnginePool.of("qwen3-8b-h100", "qwen3-8b-h100") as pool,
        AsyncRouter(_configs(pool), BEAR()) as router,
    ):
        with anyio.fail_after(5):
            for n in router.instances:
                await router.cache(n).wait_version(0)
        first = router.decide(MSG, ttft_target=1.0, tpot_target=0.5)
        # No resident the router sent: nothing to weigh, nothing replayed twice.
        assert all(math.isnan(c.harm_s) for c in first.candidates)
        router.record_dispatch(first)
        slot = router.core.slot(first.instance)
        assert slot.tpot_targets == {first.request_id: 0.5}
        d = router.decide(MSG, ttft_target=1.0, tpot_target=0.5)
        c = next(c for c in d.candidates if c.instance == first.instance)
        assert c.resident_tpot_target_s == 0.5
        assert c.resident_itl_base_s > 0.0
        assert c.resident_itl_s >= c.resident_itl_base_s
        assert "residents" in d.explain()
        other = next(c for c in d.candidates if c.instance != first.instance)
        assert math.isnan(other.harm_s)
        router.record_complete(first, first.instance, usage={"completion_tokens": 3})
        assert slot.tpot_targets == {}


def test_bearsdk_replay_follows_tokens_past_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from bearsdk.cli import main

    snap = {
        "schema": "bear.snapshot/1",
        "instance": "x",
        "seq": 1,
        "time": 0.0,
        "requests": [
            {
                "id": "a",
                "state": "running",
                "prompt_tokens": 300,
                "computed_tokens": 310,
                "output_tokens": 10,
                "output_len": 200,
            }
        ],
    }
    f = tmp_path / "snap.json"
    f.write_text(json.dumps(snap))
    base = ["replay", "--snapshot", str(f), "--prompt-tokens", "400", "--output-len", "40"]
    timed = [*base, "--batch-time", "3e-3,2e-5,4e-8,1e-9"]
    assert main([*timed, "--next-tokens", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["token_batches"] == [1, 2, 3, 4, 5, 6]
    assert doc["tpot_s"] > 0.0
    assert main([*timed, "--next-tokens", "5"]) == 0
    assert "tokens 1-6 in batches 1, 2, 3, 4, 5, 6; TPOT" in capsys.readouterr().out
    for bad in ("-1", "5000", "x"):
        with pytest.raises(SystemExit) as exc:
            main([*base, "--next-tokens", bad])
        assert exc.value.code == 2
        assert "--next-tokens" in capsys.readouterr().err


async def test_the_prompts_token_ids_price_the_prefix_each_instance_holds() -> None:
    import random

    from bearsdk.emulator import EngineConfig

    params = {"enable_prefix_caching": True, "max_model_len": 8192}
    cfgs = [
        EngineConfig(profile="qwen3-8b-h100", params=params, instance=f"e{i}", seed=i)
        for i in range(2)
    ]
    rng = random.Random(3)
    ids = [rng.randrange(1, 100_000) for _ in range(4000)]
    async with EnginePool(cfgs) as pool, AsyncRouter(_configs(pool), BEAR()) as router:
        warm, cold = (e.instance for e in pool)
        # The warm instance computes this prompt (and decodes on): its blocks are cached.
        first = next(iter(pool)).submit_tokens(len(ids), 300, max_tokens=300, prompt_ids=ids)
        with anyio.fail_after(5):
            await router.cache(cold).wait_version(0)
            while not first.produced:  # its prompt computed (one batch)
                await first.changed()
            # A snapshot from after that batch: the blocks cached, nothing in flight
            # for the new request to wait on but a decode step.
            seen_version = router.cache(warm).version
            await router.cache(warm).wait_version(seen_version + 1)
        blind = router.decide(MSG, ttft_target=5.0, prompt_token_ids=None)
        seen = router.decide(MSG, ttft_target=5.0, prompt_token_ids=ids)
        # (Its snapshot may still show the request running: a fast-forwarded view
        # keeps the advanced block pool.)
        t = {c.instance: c.ttft_s for c in seen.candidates}
        # A 4,000-token prefill where nothing is cached; the last block alone where it is.
        assert t[warm] < 0.5 * t[cold]
        assert seen.instance == warm
        assert all(c.prompt_tokens == len(ids) for c in seen.candidates)
        cached = {c.instance: c.cached_tokens for c in seen.candidates}
        assert cached[cold] == 0
        assert cached[warm] >= len(ids) - 16
        assert "cached" in seen.explain()
        assert all(c.cached_tokens == -1 for c in blind.candidates)
        next(iter(pool)).abort(first.id)
        assert all(c.prompt_tokens != len(ids) for c in blind.candidates)
        with pytest.raises(RequestError, match="prompt_token_ids"):
            router.decide(MSG, prompt_token_ids=[1, -2])
        with pytest.raises(RequestError, match="prompt_token_ids"):
            router.decide(MSG, prompt_token_ids="abc")  # type: ignore[arg-type]


def test_a_fast_forwarded_view_keeps_the_block_pool_and_its_hits() -> None:
    import random

    from bearsdk.estimators import BatchTimeModel
    from bearsdk.estimators.bea import BEAEstimator
    from bearsdk.replay.scheduler import SchedulerCore
    from bearsdk.schedulers import bind_scheduler
    from bearsdk.snapshot import snapshot_from_dict
    from bearsdk.state.fastforward import FastForward

    pol = bind_scheduler(
        "vllm-v1", {"enable_prefix_caching": True, "num_gpu_blocks": 2000, "max_model_len": 8192}
    )
    rng = random.Random(3)
    ids = [rng.randrange(1, 100_000) for _ in range(4000)]
    core = SchedulerCore(pol)
    core.add_request("a", len(ids), 300, 300, ids + [rng.randrange(1, 100_000) for _ in range(300)])
    for _ in range(3):
        core.process(core.schedule())
    snap = snapshot_from_dict(core.snapshot(instance="x", seq=1, time=0.0, output_len=True))
    est = BEAEstimator(pol, BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10))
    ff = FastForward(snap, est, captured=0.0)
    ff.advance(0.2, [])
    view = ff.at(0.2)
    assert view.prefix_cache is not None
    keys = chain_keys(ids, 16)
    hit = est.estimate(view, len(ids), 10, prefix_keys=keys)
    miss = est.estimate(view, len(ids), 10)
    assert hit.ttft_s < 0.5 * miss.ttft_s


def test_expected_arrivals_ride_in_the_last_batch_and_fill_one_budget_at_most() -> None:
    from bearsdk.bench.decisions import _snapshot as _queued
    from bearsdk.bench.router import _configs
    from bearsdk.predictors import Predictor
    from bearsdk.router.core import RouterCore
    from bearsdk.router.pricing import ttft_arrivals as _ttft_arrivals

    def core(arrivals: bool) -> RouterCore:
        return RouterCore(
            _configs(2),
            BEAR(price_all=True),  # every candidate's arrivals
            predictor=Predictor.load_default(),
            clock=lambda: 10.0,
            expect_arrivals=arrivals,
        )

    plain, expecting = core(False), core(True)
    s = expecting.slot(expecting.instances[0])
    assert _ttft_arrivals(0.1, s, 10.0) == 0.0  # nothing sent yet
    for c in (plain, expecting):
        for slot in (c.slot(n) for n in c.instances):
            for i in range(50):
                slot.stats.on_dispatch(f"r{i}", 5.0 + i * 0.1, 2000)
    co = s.state.estimator.replay_coeffs
    rho = s.stats.prefill_load(10.0, co[1], co[3])
    assert 0.0 < rho < 0.9
    # Only what arrives before the batch that computes the prompt's last chunk
    # is scheduled rides in it: the window is the TTFT less that chunk's terms.
    final = co[0] + co[1] * 1 + co[3] * 1
    assert _ttft_arrivals(0.1, s, 10.0) == pytest.approx((0.1 - final) * rho)
    budget = s.scheduler.token_budget
    p = budget + 100  # two chunks: the last is 100 tokens after ``budget``
    final = co[0] + co[1] * 100 + co[3] * (100 * budget + 100 * 101 / 2)
    assert _ttft_arrivals(0.2, s, 10.0, p) == pytest.approx((0.2 - final) * rho)
    # A cached prefix leaves a short last chunk, attending to the cached tokens.
    final = co[0] + co[1] * 20 + co[3] * (20 * (p - 20) + 20 * 21 / 2)
    assert _ttft_arrivals(0.2, s, 10.0, p, p - 20) == pytest.approx((0.2 - final) * rho)
    # A TTFT that is that batch alone leaves no window.
    assert _ttft_arrivals(final, s, 10.0, p, p - 20) == 0.0
    # However long the wait, the prompts that come fill one batch at most.
    assert _ttft_arrivals(100.0, s, 10.0) == pytest.approx(co[1] * budget)
    # Queues ahead: the last chunk's batch comes after a wait for others to ride in.
    for c in (plain, expecting):
        rng = random.Random(3)
        for name in c.instances:
            c.cache(name).offer(_queued(name, rng, 10.0, 10), received=10.0)
    d0, d1 = plain.decide(MSG, ttft_target=5.0), expecting.decide(MSG, ttft_target=5.0)
    for a, b in zip(d0.candidates, d1.candidates, strict=True):
        assert a.arrivals_s == 0.0
        assert b.arrivals_s > 0.0
        assert b.ttft_s == pytest.approx(a.ttft_s + b.arrivals_s)
    assert "ms arrivals" in d1.explain()
    assert "arrivals" not in d0.explain()

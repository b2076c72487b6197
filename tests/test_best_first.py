"""Best-first pricing: BEAR's decision is the same whether or not the router
prices the instances that cannot be chosen (docs/decision-cost.md, section 5)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bearsdk.predictors.predictor import PoolPrediction
from bearsdk.predictors.protocol import StagedPredictor
from bearsdk.router.config import InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.router.decision import Decision
from bearsdk.router.explore import Exploration
from bearsdk.selectors import BEAR, Lagrangian, PrefillTPS
from bearsdk.snapshot import KVState, RequestState, Snapshot

MODELS = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B")
PROFILES = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100")
T0 = 1_000.0


def _configs(models: list[int]) -> list[InstanceConfig]:
    return [
        InstanceConfig(
            name=f"i{k}",
            url="http://127.0.0.1:9",
            model=MODELS[m],
            profile=PROFILES[m],
            snapshots="poll",
        )
        for k, m in enumerate(models)
    ]


def _snapshot(name: str, seed: int, waiting: int) -> Snapshot:
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(0, 24)):
        p, o = rng.randint(100, 2000), rng.randint(1, 200)
        reqs.append(RequestState(f"d{i}", "running", p, p + o, o, None, None, 1))
    for i in range(waiting):
        reqs.append(RequestState(f"w{i}", "waiting", rng.randint(200, 3000), 0, 0))
    held = sum(-(-r.computed_tokens // 16) for r in reqs)
    return Snapshot.build(
        reqs, instance=name, seq=1, time=T0, kv=KVState(16, 60_000, 60_000 - held - 1)
    )


def _prediction(acc: list[float], cost: list[float]) -> PoolPrediction:
    n = len(MODELS)
    return PoolPrediction(
        MODELS,
        np.array(acc, dtype=np.float64),
        np.full(n, 150.0),
        np.full(n, 400.0),
        np.array(cost, dtype=np.float64),
    )


def _router(
    models: list[int], waiting: list[int], selector: object, **kw: object
) -> tuple[RouterCore, StagedPredictor]:
    feed = StagedPredictor(MODELS)
    core = RouterCore(
        _configs(models),
        selector,  # type: ignore[arg-type]
        predictor=feed,
        clock=lambda: T0,
        **kw,  # type: ignore[arg-type]
    )
    for k, name in enumerate(core.instances):
        core.cache(name).offer(_snapshot(name, k, waiting[k]))
    return core, feed


def _decide(
    core: RouterCore, feed: StagedPredictor, pred: PoolPrediction, **kw: object
) -> Decision:
    feed.stage(pred)
    return core.decide("a prompt", **kw)  # type: ignore[arg-type]


def _check(pruned: Decision, full: Decision) -> None:
    """The same choice; priced candidates as priced in full; the rest could not win."""
    assert (pruned.index, pruned.reason) == (full.index, full.reason)
    assert [c.score for c in pruned.candidates] == [c.score for c in full.candidates]
    assert all(c.estimator != "unpriced" for c in full.candidates)
    chosen = pruned.chosen
    skipped = [c for c in pruned.candidates if c.estimator == "unpriced"]
    if skipped:
        # Only when something is on time, and only what utility rules out.
        assert chosen.feasible is True
        assert all(c.utility < chosen.utility for c in skipped)
    for c, f in zip(pruned.candidates, full.candidates, strict=True):
        if c.estimator == "unpriced":
            assert math.isnan(c.ttft_s)
            assert c.feasible is None
            assert (c.instance, c.utility, c.prompt_tokens, c.output_tokens) == (
                f.instance,
                f.utility,
                f.prompt_tokens,
                f.output_tokens,
            )
            assert (c.cached_tokens, c.cache_source) == (f.cached_tokens, f.cache_source)
            if f.feasible:
                assert f.utility < chosen.utility
        elif repr(c) != repr(f):
            # Left a lower bound of what pricing it gives, one that can win
            # nothing: past the target and the lowest TTFT found before it, or
            # left by the second look (nothing on time) past the lowest TTFT.
            assert c.ttft_lower_bound
            assert not f.feasible
            assert chosen.ttft_s < c.ttft_s <= f.ttft_s


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    models=st.lists(st.integers(0, 2), min_size=2, max_size=7),
    waiting=st.lists(st.sampled_from([0, 0, 1, 4, 12, 40]), min_size=7, max_size=7),
    acc=st.lists(st.sampled_from([0.2, 0.5, 0.5, 0.9]), min_size=3, max_size=3),
    cost=st.lists(st.sampled_from([0.0, 0.0, 1e-4, 3e-4]), min_size=3, max_size=3),
    target=st.sampled_from([0.02, 0.08, 0.3, 1.0, 5.0]),
    tpot=st.sampled_from([None, None, 0.02, 0.2]),
)
def test_pruned_decisions_equal_full_ones(
    models: list[int],
    waiting: list[int],
    acc: list[float],
    cost: list[float],
    target: float,
    tpot: float | None,
) -> None:
    pred = _prediction(acc, cost)
    kw: dict[str, object] = {"ttft_target": target}
    if tpot is not None:
        kw["tpot_target"] = tpot
    a, fa = _router(models, waiting, BEAR())
    b, fb = _router(models, waiting, BEAR(price_all=True))
    # Twice: the second decision on the same views has their one-token bounds.
    for _ in range(2):
        _check(_decide(a, fa, pred, **kw), _decide(b, fb, pred, **kw))


def test_past_the_target_and_the_lowest_ttft_found_an_estimate_stays_a_bound() -> None:
    # Three 8B instances: i0 idle (~16 ms), i1 and i2 behind 4 waiting prompts
    # each (~216 and ~188 ms). At a 1 s target all three are on time and exact
    # (the tie breaks on TTFT); at 0.15 s only i0 is, and i1 and i2, past the
    # target and i0's TTFT, are left lower bounds (here their queue-ahead
    # bounds) where pricing them in full replays them within the 0.3 s horizon.
    pred = _prediction([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])
    models, waiting = [1, 1, 1], [0, 4, 4]
    for target, bounds in ((1.0, []), (0.15, [1, 2])):
        a, fa = _router(models, waiting, BEAR())
        b, fb = _router(models, waiting, BEAR(price_all=True))
        d, full = _decide(a, fa, pred, ttft_target=target), _decide(b, fb, pred, ttft_target=target)
        _check(d, full)
        assert d.instance == "i0"
        assert [i for i, c in enumerate(d.candidates) if c.ttft_lower_bound] == bounds
        for i in bounds:
            c, f = d.candidates[i], full.candidates[i]
            assert not f.ttft_lower_bound
            assert f.ttft_s <= 2 * target
            assert target < c.ttft_s <= f.ttft_s
            assert c.feasible is False


def test_only_the_best_level_is_priced_when_it_is_on_time() -> None:
    # 32B (best utility) on time at i2 and i5: the six others are left unpriced.
    models = [0, 1, 2, 0, 1, 2, 0, 1]
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router(models, [0] * 8, BEAR())
    d = _decide(core, feed, pred, ttft_target=5.0)
    assert [c.estimator == "unpriced" for c in d.candidates] == [m != 2 for m in models]
    assert d.instance in ("i2", "i5")
    assert d.chosen.feasible
    text = d.explain()
    assert "[unpriced] (a better utility is on time)" in text
    assert "nan" not in text


def test_a_level_on_time_for_ttft_but_not_tpot_does_not_stop_the_pricing() -> None:
    # Every model meets 5 s TTFT; only the 0.6B (~2.6 ms/token) and the 8B
    # (~7 ms) meet 10 ms per token: the 32B's level is not on time, the 8B's is.
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 1, 2], [0, 0, 0], BEAR())
    d = _decide(core, feed, pred, ttft_target=5.0, tpot_target=0.01)
    assert [c.estimator for c in d.candidates] == ["unpriced", "bea", "bea"]
    assert d.instance == "i1"
    assert [c.feasible for c in d.candidates] == [None, True, False]


def test_nothing_is_left_unpriced_when_nothing_is_on_time() -> None:
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 1, 2], [40, 40, 40], BEAR())
    d = _decide(core, feed, pred, ttft_target=0.001)
    assert not any(c.feasible for c in d.candidates)
    assert all(c.estimator != "unpriced" and not math.isnan(c.ttft_s) for c in d.candidates)


def test_the_second_look_prices_only_bounds_that_could_be_the_lowest() -> None:
    # Nothing meets 20 ms and every first estimate stops at the 40 ms horizon:
    # the bounds are priced again 8x further out from the lowest up. i1 comes
    # out at ~216 ms; i0's queue-ahead bound (~220 ms) cannot beat it and is
    # left as it was, where pricing every instance again replays it to ~224 ms.
    pred = _prediction([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])
    models, waiting = [2, 1, 1, 2, 2], [4, 4, 120, 40, 400]
    a, fa = _router(models, waiting, BEAR())
    b, fb = _router(models, waiting, BEAR(price_all=True))
    pruned = _decide(a, fa, pred, ttft_target=0.02)
    full = _decide(b, fb, pred, ttft_target=0.02)
    _check(pruned, full)
    assert pruned.instance == "i1"
    assert pruned.reason.startswith("no instance predicted to meet the target")
    i0, f0 = pruned.candidates[0], full.candidates[0]
    assert (i0.estimator, i0.ttft_lower_bound) == ("bound", True)
    assert not f0.ttft_lower_bound
    assert pruned.chosen.ttft_s < i0.ttft_s < f0.ttft_s


def test_a_regime_where_best_first_saves_nothing_is_priced_at_once() -> None:
    # Best first saves nothing where nothing is on time, or where only the least
    # useful model is; after such a decision the next is priced at once, and
    # best first resumes after one where it would have saved.
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    models, waiting = [0, 1, 2], [0, 40, 40]  # the 8B and 32B queues are deep
    core, feed = _router(models, waiting, BEAR())
    full, ffeed = _router(models, waiting, BEAR(price_all=True))
    seen, chosen = [], []
    for target in (5.0, 1e-4, 5.0, 0.05, 0.05, 5.0, 5.0):
        d = _decide(core, feed, pred, ttft_target=target)
        _check(d, _decide(full, ffeed, pred, ttft_target=target))
        seen.append(sum(c.estimator == "unpriced" for c in d.candidates))
        chosen.append((d.instance, d.chosen.feasible))
    assert chosen[1][1] is False
    assert chosen[3] == chosen[4] == ("i0", True)
    # 5 s: the 32B on time, two unpriced; 0.1 ms: none on time; 5 s after it:
    # priced at once (it would have saved, so the next goes best first); 50 ms:
    # only the 0.6B on time, nothing to save (best first, then at once); 5 s:
    # at once after that, then best first again.
    assert seen == [2, 0, 0, 0, 0, 0, 2]


def test_equal_utilities_across_models_share_a_level() -> None:
    # 8B and 32B tie on utility: both are priced, and the tie breaks on TTFT
    # (the idle 8B), not on which model came first.
    pred = _prediction([0.5, 0.9, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 2, 1], [0, 40, 0], BEAR())
    d = _decide(core, feed, pred, ttft_target=5.0)
    est = {c.instance: c.estimator for c in d.candidates}
    assert est == {"i0": "unpriced", "i1": "bea", "i2": "bea"}
    assert d.instance == "i2"


def test_a_decision_that_may_explore_prices_every_instance() -> None:
    # Exploring needs every estimate: the decisions whose draw said yes (about
    # half of them here) price every instance, the others prune.
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 1, 2], [0, 0, 0], BEAR(), explore=Exploration(share=0.5, seed=3))
    draws = random.Random(3)
    for _ in range(40):
        explores = draws.random() < 0.5
        d = _decide(core, feed, pred, ttft_target=5.0)
        assert any(c.estimator == "unpriced" for c in d.candidates) is not explores


@pytest.mark.parametrize("selector", [Lagrangian(), BEAR(price_all=True)])
def test_selectors_that_need_every_estimate_get_them(selector: object) -> None:
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 1, 2], [0, 0, 0], selector)
    d = _decide(core, feed, pred, ttft_target=5.0)
    assert all(c.estimator != "unpriced" for c in d.candidates)


def test_prefill_tps_prunes_too() -> None:
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 0.0, 0.0])
    core, feed = _router([0, 1, 2], [0, 0, 0], PrefillTPS())
    d = _decide(core, feed, pred, ttft_target=5.0)
    assert [c.estimator for c in d.candidates][:2] == ["unpriced", "unpriced"]


@pytest.mark.parametrize("cls", [BEAR, PrefillTPS])
def test_price_all_must_be_a_flag(cls: type) -> None:
    with pytest.raises(ValueError, match=r"price_all must be true or false \(got 'yes'\)"):
        cls(price_all="yes")


def test_an_overload_is_priced_out_to_the_second_look_at_once() -> None:
    # The decision after one that needed the second look (nothing meets 20 ms,
    # the lowest TTFT past the horizon) is priced 8x the horizon out at once,
    # least late first: the instances of the model the last overload chose
    # (i1's) exactly, the others past the lowest TTFT found among them only.
    # The same choice as a router seeing that state first; once something is
    # on time again, the horizon is back.
    pred = _prediction([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])
    models, waiting = [2, 1, 1, 2, 2], [4, 4, 120, 40, 400]
    core, feed = _router(models, waiting, BEAR())
    first = _decide(core, feed, pred, ttft_target=0.02)
    second = _decide(core, feed, pred, ttft_target=0.02)
    fresh, ffeed = _router(models, waiting, BEAR())
    assert (
        first.instance == second.instance == _decide(fresh, ffeed, pred, ttft_target=0.02).instance
    )
    assert first.instance == "i1"
    assert second.chosen.ttft_s == first.chosen.ttft_s
    assert not second.chosen.ttft_lower_bound
    # i2, of i1's model, priced 8x the horizon out (120 waiting: past it too);
    # the others are lower bounds past i1's TTFT.
    assert second.candidates[2].ttft_lower_bound
    assert second.candidates[2].ttft_s > 8 * 2 * 0.02
    for i in (0, 3, 4):
        assert second.candidates[i].ttft_lower_bound
        assert second.candidates[i].ttft_s > second.chosen.ttft_s
    on_time = _decide(core, feed, pred, ttft_target=5.0)
    assert on_time.chosen.feasible
    again = _decide(core, feed, pred, ttft_target=0.02)
    assert [repr(c) for c in again.candidates] == [repr(c) for c in first.candidates]


def test_overload_pricing_replays_to_the_second_look_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Counted in replays: the first decision replays three instances to the
    # 10 ms horizon (their queues are empty: no bound), then one of them 8x
    # further; the next replays none to the horizon first, the first of the
    # chosen model's instances 8x out, the next only past that one's TTFT, the
    # others only past the lowest TTFT among those.
    from bearsdk.estimators.bea import BEAEstimator

    horizons: list[float] = []
    real = BEAEstimator.ttft_from

    def spy(self: BEAEstimator, *a: Any) -> float:
        horizons.append(float(a[5]))  # (the router's path: positional)
        return real(self, *a)

    monkeypatch.setattr(BEAEstimator, "ttft_from", spy)
    pred = _prediction([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])
    core, feed = _router([2, 1, 1, 2, 2], [0, 0, 0, 4, 40], BEAR())
    first = _decide(core, feed, pred, ttft_target=0.005)
    assert sorted(horizons) == [0.01, 0.01, 0.01, 0.08]
    n_first = len(horizons)
    horizons.clear()
    second = _decide(core, feed, pred, ttft_target=0.005)
    best = second.chosen.ttft_s
    assert 0.01 < best < 0.08
    i1 = second.candidates[1].ttft_s
    assert best < i1 < 0.08
    assert not second.candidates[1].ttft_lower_bound
    assert sorted(horizons) == [pytest.approx(best)] * (len(horizons) - 2) + [
        pytest.approx(i1),
        0.08,
    ]
    assert 0 < len(horizons) <= n_first
    assert second.instance == first.instance == "i2"
    assert second.chosen.ttft_s == first.chosen.ttft_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waiting=st.lists(st.sampled_from([0, 4, 40, 120, 400]), min_size=5, max_size=5),
    targets=st.lists(st.sampled_from([1e-4, 0.02, 0.3, 5.0]), min_size=2, max_size=6),
)
def test_a_sequence_of_decisions_chooses_as_fresh_routers_do(
    waiting: list[int], targets: list[float]
) -> None:
    pred = _prediction([0.5, 0.8, 0.9], [0.0, 1e-4, 3e-4])
    models = [2, 1, 1, 0, 2]
    core, feed = _router(models, waiting, BEAR())
    for target in targets:
        d = _decide(core, feed, pred, ttft_target=target)
        fresh, ffeed = _router(models, waiting, BEAR())
        want = _decide(fresh, ffeed, pred, ttft_target=target)
        assert d.reason == want.reason
        far = 2.0 * 8.0 * target  # the second look's horizon
        if d.chosen.ttft_lower_bound and d.chosen.ttft_s >= far:
            # Every instance is later than the second look reaches: the choice
            # is the lowest of lower bounds, and a view asked before keeps a
            # tighter one (the one-token bound), so the two may differ; neither
            # knows an instance earlier than that horizon.
            assert want.chosen.ttft_lower_bound
            assert want.chosen.ttft_s >= far
            for c in (*d.candidates, *want.candidates):
                assert c.ttft_lower_bound
                assert c.ttft_s >= far
            continue
        assert d.index == want.index
        assert d.chosen.ttft_s == want.chosen.ttft_s

"""The O(1) lower bound BEA answers "later than the horizon" with (docs/decision-cost.md).

For random snapshots under every built-in scheduler and random custom specs,
on both replay twins: the bound never exceeds the replayed TTFT, and the hot
path with a horizon returns the replayed value up to the horizon and a lower
bound past it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_replay_property import (
    PROBE_POOL,
    builtin_policy,
    custom_policy,
    tiny_workload,
    workload,
)

from bearsdk.estimators import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator, first_tokens_in_order
from bearsdk.replay import implementations
from bearsdk.replay.types import StopReason
from bearsdk.schedulers import BoundScheduler, compile_scheduler, scheduler_names
from bearsdk.snapshot import Snapshot

# A dominant prefill term, so that the bound is often close (and a slip shows).
MODELS = (BatchTimeModel(0.003, 2e-5, 5e-8, 1e-10), BatchTimeModel(0.0, 1e-4, 0.0, 0.0))
IMPLS = sorted(implementations())


def _estimator(pol: BoundScheduler, w: dict[str, Any], model: BatchTimeModel, impl: str):
    probe = compile_scheduler(pol.with_kv(pol.block_size, PROBE_POOL), "python")
    held = PROBE_POOL - pol.reserved_blocks - probe.prepare(w["table"]).free_blocks
    blocks = 0 if w["unlimited"] else held + pol.reserved_blocks + w["extra"] + 1
    est = BEAEstimator(pol.with_kv(pol.block_size, blocks), model, implementation=impl)
    ids = tuple(f"r{i}" for i in range(len(w["table"])))
    return est, Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=ids, table=w["table"])


def _check(pol: BoundScheduler, w: dict[str, Any], model: BatchTimeModel) -> None:
    for impl in sorted(IMPLS):  # "cython" first: it sizes the case for the twin
        est, snap = _estimator(pol, w, model, impl)
        prep = est.prepare(snap)
        res = est.estimate(prep, w["prompt"], w["out"])
        # The Python twin takes seconds to reach the work bound: keep to cases it ends.
        assume(res.stop_reason is not StopReason.BATCH_LIMIT and res.first_token_batch < 2000)
        full = res.ttft_s
        lb = est.bound(prep, w["prompt"])
        assert 0.0 < lb <= full, (impl, lb, full)
        if not math.isfinite(full):
            continue
        for h in (lb * 0.5, (lb + full) / 2, full * 0.999, full * 1.001):
            got = est.ttft(prep, w["prompt"], w["out"], horizon_s=h)
            if full <= h:
                assert got == pytest.approx(full, rel=1e-12)
            else:
                assert h < got <= full * (1 + 1e-12)


@pytest.mark.parametrize("name", scheduler_names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.sampled_from(MODELS))
def test_the_bound_never_exceeds_the_replay_builtin(
    name: str, data: Any, m: BatchTimeModel
) -> None:
    pol = data.draw(builtin_policy(name))
    _check(pol, data.draw(workload(pol)), m)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.sampled_from(MODELS))
def test_the_bound_never_exceeds_the_replay_custom(data: Any, m: BatchTimeModel) -> None:
    pol = data.draw(custom_policy())
    _check(pol, data.draw(workload(pol)), m)


def _check_one_token(pol: BoundScheduler, w: dict[str, Any], model: BatchTimeModel, gap: float):
    # The one-token request's first token (one output token), arriving first,
    # against the new request's arriving `gap` later, in absolute time.
    for impl in sorted(IMPLS):
        est, snap = _estimator(pol, w, model, impl)
        prep = est.prepare(snap)
        assume(prep.in_order)
        res = est.estimate(prep, w["prompt"], w["out"], arrival_s=gap)
        assume(res.stop_reason is not StopReason.BATCH_LIMIT and res.first_token_batch < 2000)
        one = est.estimate(prep, 1, 1, max_tokens=1)
        assert one.stop_reason is not StopReason.BATCH_LIMIT
        if one.stop_reason is StopReason.NEVER_ADMITTED:
            # A stuck state orders no arrivals (test_bea.py): no bound, ever.
            assert est.admission_bound(prep, 0.0) == 0.0
            assert est.admission_bound(prep, 0.0) == 0.0
            assert est.admission_bound(prep, gap) == 0.0
            continue
        assert one.ttft_s <= res.ttft_s + gap + 1e-12 * max(1.0, res.ttft_s), (impl, one, res)
        # What the estimator keeps: nothing the first time it is asked, then the bound.
        assert est.admission_bound(prep, 0.0) == 0.0
        lb = est.admission_bound(prep, 0.0)
        assert lb == one.ttft_s
        assert est.admission_bound(prep, gap) == pytest.approx(lb - gap, abs=1e-12)


@pytest.mark.parametrize("name", scheduler_names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.sampled_from(MODELS), gap=st.sampled_from([0.0, 1e-4, 0.003, 0.2]))
def test_a_one_token_request_is_first_to_its_first_token_builtin(
    name: str, data: Any, m: BatchTimeModel, gap: float
) -> None:
    pol = data.draw(builtin_policy(name))
    if not first_tokens_in_order(pol):
        return
    _check_one_token(pol, data.draw(workload(pol)), m, gap)


# tiny: states engines never report but a network may send (tiny counts, placeholders).
@pytest.mark.parametrize("states", [workload, tiny_workload], ids=["workload", "tiny"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), m=st.sampled_from(MODELS), gap=st.sampled_from([0.0, 1e-4, 0.003, 0.2]))
def test_a_one_token_request_is_first_to_its_first_token_custom(
    states: Any, data: Any, m: BatchTimeModel, gap: float
) -> None:
    # Built in order rather than filtered: few random specs are, and filtering
    # them out made the search fail its health check now and then.
    pol = attrs.evolve(
        data.draw(custom_policy()),
        stages=data.draw(
            st.sampled_from([("running", "waiting"), ("decodes", "prefills", "waiting")])
        ),
        on_blocked="stop",
        budget_count="tokens",
        chunk_cap=0,
        requeue="front",
    )
    assert first_tokens_in_order(pol)
    _check_one_token(pol, data.draw(states(pol)), m, gap)


def test_the_one_token_bound_is_replayed_when_asked_again_and_kept() -> None:
    from bearsdk.schedulers import bind_scheduler

    rows = [[0, 3000, 3100, 100, -1, 400, 0]] * 120 + [[1, 2000, 0, 0, -1, 200, 0]] * 12
    ids = tuple(f"r{i}" for i in range(len(rows)))
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=ids, table=np.array(rows))
    for impl in IMPLS:
        est = BEAEstimator(bind_scheduler("vllm-v1"), MODELS[0], implementation=impl)
        prep = est.prepare(snap)
        assert prep.in_order
        one = est.estimate(prep, 1, 1, max_tokens=1).ttft_s
        later = est.estimate(prep, 1, 1, max_tokens=1, arrival_s=0.01).ttft_s
        assert est.admission_bound(prep, 0.0, 0.1) == 0.0  # asked once: nothing replayed
        cut = est.admission_bound(prep, 0.0, 0.1)  # again: replayed, stopped past 0.1 s
        assert 0.1 < cut < one
        assert prep.admission[3] is False
        # Past a shorter horizon it answers from what it kept; further out it replays.
        assert est.admission_bound(prep, 0.01, 0.05) == pytest.approx(cut - 0.01, abs=1e-12)
        assert est.admission_bound(prep, 0.01, math.inf) == pytest.approx(later, rel=1e-12)
        assert prep.admission[3] is True
        assert est.admission_bound(prep, 0.02, 0.05) == pytest.approx(later - 0.01, rel=1e-9)
        # An earlier arrival starts over; a state prepared anew keeps nothing.
        assert est.admission_bound(prep, 0.0, math.inf) == 0.0
        assert est.prepare(snap).admission == []


def test_the_one_token_bound_needs_admissions_last_and_no_overtaking() -> None:
    from bearsdk.schedulers import bind_scheduler

    ordered = {n for n in scheduler_names() if first_tokens_in_order(bind_scheduler(n))}
    assert {"vllm-v1", "sarathi"} <= ordered
    # Admissions first: a long prompt takes budget the one-token request leaves to decodes.
    assert "prefill-first" not in ordered
    assert not first_tokens_in_order(
        bind_scheduler("vllm-v1", {"long_prefill_token_threshold": 64})
    )


def test_the_bound_counts_the_queue_only_where_nothing_overtakes() -> None:
    import numpy as np

    from bearsdk.schedulers import bind_scheduler

    table = np.array([[1, 3000, 0, 0, -1, 100, 0]] * 4, dtype=np.int64)
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=("a", "b", "c", "d"), table=table)
    m = MODELS[1]
    fcfs = BEAEstimator(bind_scheduler("vllm-v1"), m)
    capped = BEAEstimator(bind_scheduler("vllm-v1", {"long_prefill_token_threshold": 64}), m)
    assert fcfs.bound(fcfs.prepare(snap), 100) == pytest.approx(12100 * 1e-4, rel=1e-6)
    # A chunk cap lets the new request finish first: only its own prefill counts.
    assert capped.bound(capped.prepare(snap), 100) == pytest.approx(100 * 1e-4, rel=1e-6)


def test_a_padded_budget_lets_a_short_prompt_overtake_and_the_bound_knows() -> None:
    # Found by the property test above: counted padded (sequences x longest
    # chunk), a running request's 9-token rest does not fit beside a decode,
    # and the new 1-token prompt does; it is served first.
    import attrs

    from bearsdk.schedulers import bind_scheduler

    pol = attrs.evolve(
        bind_scheduler("prefill-first"),
        token_budget=16,
        max_seqs=5,
        budget_count="padded",
        stages=("running", "waiting"),
        chunked_prefill=False,
        chunk_cap=0,
        on_blocked="stop",
        async_scheduling=False,
    )
    table = np.array(
        [
            [0, 1, 1, 0, 1, 1, 0],
            [0, 1, 1, 1, 2, 2, 0],
            [0, 1, 1, 0, 1, 1, 0],
            [0, 10, 1, 0, 1, 1, 0],
        ]
    )
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=("a", "b", "c", "d"), table=table)
    for impl in IMPLS:
        est = BEAEstimator(pol, MODELS[0], implementation=impl)
        prep = est.prepare(snap)
        full = est.estimate(prep, 1, 1).ttft_s
        assert prep.ahead == (0.0, 0.0)
        assert 0.0 < est.bound(prep, 1) <= full
        tokens = attrs.evolve(pol, budget_count="tokens")
        assert BEAEstimator(tokens, MODELS[0], implementation=impl).prepare(snap).ahead[0] == 9.0


def _deep_router(horizon_factor: float, clock: list[float], overload: str = "lowest-ttft"):
    import numpy as np

    from bearsdk.router import InstanceConfig
    from bearsdk.router.core import RouterCore
    from bearsdk.selectors import BEAR
    from bearsdk.snapshot import NCOLS

    cfgs = [
        InstanceConfig(name=n, url=f"http://{n}", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100")
        for n in ("deep", "short", "deeper")
    ]
    core = RouterCore(
        cfgs,
        BEAR(horizon_factor=horizon_factor, overload=overload),
        clock=lambda: clock[0],
        explore=None,
    )
    for name, depth in (("deep", 100), ("short", 2), ("deeper", 250)):
        rows = [(0, 500, 520, 20, -1, 200, 0)] * 8 + [(1, 2000, 0, 0, -1, 200, 0)] * depth
        table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
        ids = tuple(f"{name}{i}" for i in range(len(rows)))
        core.cache(name).offer(Snapshot(name, 1, clock[0], None, ids, table), received=clock[0])
    return core


@pytest.mark.parametrize("stale_s", [0.0, 0.4])
def test_the_router_cuts_estimates_past_the_horizon_and_chooses_the_same(stale_s: float) -> None:
    clock = [100.0]
    cut = _deep_router(4.0, clock)
    exact = _deep_router(math.inf, clock)
    clock[0] += stale_s
    for target in (0.5, 2.0):
        d, e = cut.decide("hi", ttft_target=target), exact.decide("hi", ttft_target=target)
        assert d.instance == e.instance == "short"
        by = {c.instance: c for c in d.candidates}
        ex = {c.instance: c for c in e.candidates}
        assert not by["short"].ttft_lower_bound
        assert by["short"].ttft_s == pytest.approx(ex["short"].ttft_s)
        for name in ("deep", "deeper"):
            c, x = by[name], ex[name]
            assert not x.ttft_lower_bound
            if x.ttft_s <= 4 * target:  # within the horizon: exact
                assert not c.ttft_lower_bound
                assert c.ttft_s == pytest.approx(x.ttft_s)
            else:
                # A lower bound past it: from the queue ahead alone ("bound",
                # nothing replayed), or where a replay stopped.
                assert c.ttft_lower_bound
                assert 4 * target < c.ttft_s <= x.ttft_s
        assert by["deeper"].estimator == "bound"
        if target == 0.5:
            assert by["deep"].estimator == "bound"
        assert ">=" in d.explain()
        assert ">=" not in e.explain()


def test_a_lower_bound_teaches_the_overhead_nothing() -> None:
    clock = [100.0]
    core = _deep_router(4.0, clock)
    d = core.decide("hi", ttft_target=0.01, exclude=frozenset({"short"}))
    assert d.chosen.ttft_lower_bound
    s = core.slot(d.instance)
    core.sent(s, d, clock[0])
    core.first_token(s, d, 0.5)
    assert core.ttft_error(d.instance)[2] == 0
    assert core.overhead(d.instance) == 0.0


def test_a_target_below_the_overhead_still_decides() -> None:
    # The overhead (learned from first tokens) exceeds what is left of the target:
    # the horizon handed to the replay would be negative. The decision stands, with a
    # lower bound past the target, instead of raising.
    from bearsdk.router.config import InstanceConfig
    from bearsdk.router.core import RouterCore
    from bearsdk.snapshot import snapshot_from_dict

    now = [100.0]
    cfg = InstanceConfig(
        name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
    )
    core = RouterCore([cfg], clock=lambda: now[0])
    running = [
        {"id": f"r{i}", "state": "running", "prompt_tokens": 100, "computed_tokens": 101,
         "output_tokens": 2}
        for i in range(2)
    ]  # fmt: skip
    core.cache("a").offer(
        snapshot_from_dict(
            {
                "schema": "bear.snapshot/1",
                "instance": "a",
                "seq": 1,
                "time": 100.0,
                "kv": {"block_size": 16, "num_blocks": 4000, "free_blocks": 3000},
                "requests": running,
            }
        )
    )
    slot = core.slot("a")
    slot.overhead_s = 0.05
    slot.overhead_at = now[0]
    d = core.decide("hello", ttft_target=0.001)
    assert d.instance == "a"
    assert d.chosen.estimator == "bea"
    assert d.chosen.ttft_lower_bound
    assert d.chosen.ttft_s > 0.05


def test_a_new_request_admitted_whole_overtakes_a_chunked_prompt_admitted_before_it() -> None:
    # Admissions before the running stage, chunked prefill: the fourth waiting
    # request's last token would come in the running stage of the next batch,
    # after the new request, admitted whole in that batch's admissions. The
    # queue ahead is then no bound (hypothesis found it with these numbers).
    import attrs

    from bearsdk.schedulers import bind_scheduler

    pol = attrs.evolve(
        bind_scheduler("vllm-v1", {}),
        token_budget=16,
        max_seqs=4,
        max_model_len=0,
        stages=("waiting", "running"),
        admit_after_preemption=False,
        async_scheduling=False,
        chunked_prefill=True,
        chunk_cap=0,
        cap_exempt_when_alone=False,
        reserve_full_sequence=False,
        block_size=1,
        num_blocks=0,
        reserved_blocks=0,
        watermark=0.0,
        decode_needs_free_block=False,
        prefix_caching=False,
    )
    table = np.array([[1, 1, 0, 0, 1, 1, 0]] * 3 + [[1, 14, 0, 0, 1, 1, 0]], dtype=np.int64)
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=("a", "b", "c", "d"), table=table)
    for impl in IMPLS:
        est = BEAEstimator(pol, MODELS[0], implementation=impl)
        prep = est.prepare(snap)
        res = est.estimate(prep, 16, 1)
        assert res.first_token_batch == 2
        assert 0.0 <= est.bound(prep, 16) <= res.ttft_s


def test_with_nothing_on_time_the_fallback_looks_past_the_horizon() -> None:
    # Every estimate stops at the horizon (4 x 0.2 s): lower bounds say nothing
    # about which instance is least late, so the router prices again further out
    # (8 x the horizon) and compares what it finds there exactly.
    clock = [100.0]
    cut = _deep_router(4.0, clock)
    exact = _deep_router(math.inf, clock)
    d = cut.decide("hi", ttft_target=0.2, exclude=frozenset({"short"}))
    e = exact.decide("hi", ttft_target=0.2, exclude=frozenset({"short"}))
    assert d.instance == e.instance == "deep"
    by = {c.instance: c for c in d.candidates}
    ex = {c.instance: c for c in e.candidates}
    assert 0.8 < ex["deep"].ttft_s <= 6.4 < ex["deeper"].ttft_s
    assert not by["deep"].ttft_lower_bound
    assert by["deep"].ttft_s == pytest.approx(ex["deep"].ttft_s)
    assert by["deeper"].ttft_lower_bound
    assert 6.4 < by["deeper"].ttft_s <= ex["deeper"].ttft_s
    # An instance on time needs no second look: its estimate is exact already.
    assert not cut.decide("hi", ttft_target=0.2).chosen.ttft_lower_bound


def test_with_nothing_on_time_least_requests_needs_no_second_look() -> None:
    # The fewest requests in flight: the estimates past the horizon stay bounds
    # (they only break ties; the lowest-TTFT rule would make "deep" exact, as
    # above), and the router's own dispatches move the choice.
    clock = [100.0]
    core = _deep_router(4.0, clock, overload="least-requests")
    picked = []
    for _ in range(4):
        d = core.decide("hi", ttft_target=0.2, exclude=frozenset({"short"}))
        by = {c.instance: c for c in d.candidates}
        assert by["deep"].ttft_lower_bound
        assert by["deeper"].ttft_lower_bound
        assert d.reason == "no instance predicted on time: fewest requests in flight"
        core.record_dispatch(d)
        picked.append(d.instance)
    # A tie at first (the lower bound wins it), then each takes its turn.
    assert picked == ["deep", "deeper", "deep", "deeper"]
    # Something on time: BEAR's own rule.
    assert core.decide("hi", ttft_target=0.2).instance == "short"

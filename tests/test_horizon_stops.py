"""Horizon stops that hold for any new request (docs/decision-cost.md, "Horizon stops").

A replay that stops at its horizon while a request ahead of the new one is
still waiting never let admission look at the new request: its batches, and
the time it reached, are those of any other new request. ``BEAEstimator.ttft``
remembers such stops per prepared state and answers later calls from them.
These tests check the premise on every replay implementation (the pure twin,
the compiled loop, its forced exact path) for every built-in scheduler and
random custom specs, and that the estimator's remembered answers are the
replay's own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_prefix_replay import POLICIES, tokens
from test_prefix_replay_twins import ARRIVAL, NEW, _run_engine
from test_replay_property import COEFFS, PROBE_POOL, builtin_policy, custom_policy, workload

from bearsdk.estimators import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.replay import implementations
from bearsdk.replay._replay_py import Replayer as PyReplayer
from bearsdk.replay.blocks import chain_keys
from bearsdk.schedulers import BoundScheduler, bind_scheduler, compile_scheduler, scheduler_names
from bearsdk.snapshot import NCOLS, Snapshot

IMPLS = sorted(implementations())
if "cython" in IMPLS:
    from bearsdk.replay._replay_apc_c import Replayer as ApcReplayer
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _sized(pol: BoundScheduler, w: dict[str, Any]) -> BoundScheduler:
    """The policy with a pool the snapshot fits in, ``extra`` blocks to spare."""
    probe = compile_scheduler(pol.with_kv(pol.block_size, PROBE_POOL), "python")
    held = PROBE_POOL - pol.reserved_blocks - probe.prepare(w["table"]).free_blocks
    blocks = 0 if w["unlimited"] else held + pol.reserved_blocks + w["extra"] + 1
    return pol.with_kv(pol.block_size, blocks)


def _horizons(pol: BoundScheduler, w: dict[str, Any]) -> list[float]:
    """Horizons inside each of the first batches of the twin's replay, and on their ends."""
    tw = compile_scheduler(pol, "python")
    # Forty batches give every horizon used: a replay to the first token can
    # run a million batches on a livelocked draw.
    full = tw.replay(
        tw.prepare(w["table"]), w["prompt"], w["out"], COEFFS, record=True, max_batches=40
    )
    assert full.batches is not None
    ends = np.cumsum([b.duration_s for b in full.batches[:40]]).tolist()
    return [h for e in ends for h in (e * 0.5, e) if h > 0.0][:12]


def _others(draw: st.DrawFn, n: int) -> list[tuple[int, int, int]]:
    """Other new requests: prompt, output, output cap (-1: none)."""
    return [
        (
            draw(st.integers(1, 4000)),
            draw(st.integers(1, 500)),
            draw(st.sampled_from([-1, -1, 1, 7, 300])),
        )
        for _ in range(n)
    ]


def _check(pol: BoundScheduler, w: dict[str, Any], others: list[tuple[int, int, int]]) -> int:
    """Every unexamined horizon stop holds for other requests and later horizons."""
    pol = _sized(pol, w)
    stops = 0
    c = compile_scheduler(pol, "cython") if "cython" in IMPLS else None
    runs = [(compile_scheduler(pol, "python"), False)]
    if c is not None:
        runs += [(c, False), (c, True)]
    for h in _horizons(pol, w):
        for rp, slow in runs:
            if rp is c:
                c.force_slow = slow
            try:
                prep = rp.prepare(w["table"])
                t = rp.ttft(prep, w["prompt"], w["out"], COEFFS, horizon_s=h)
                if rp.last_new_examined or not h < t < math.inf:
                    continue
                stops += 1
                event("an unexamined stop")
                where = f"{rp.implementation} slow={slow} horizon {h} policy {pol}"
                for prompt, out, cap in others:
                    got = rp.replay(prep, prompt, out, COEFFS, max_tokens=cap, horizon_s=h)
                    assert str(got.stop_reason) == "horizon", where
                    assert got.ttft_s == t, where
                    assert not rp.last_new_examined, where
                    later = h + (t - h) * 0.5
                    if h < later < t:  # not when t is h's next float
                        assert rp.ttft(prep, prompt, out, COEFFS, cap, horizon_s=later) == (
                            pytest.approx(t, rel=1e-12)
                        ), where
            finally:
                if c is not None:
                    c.force_slow = False
    return stops


@pytest.mark.parametrize("name", scheduler_names())
@SETTINGS
@given(data=st.data())
def test_an_unexamined_horizon_stop_holds_for_any_new_request_builtin(name: str, data: Any) -> None:
    pol = data.draw(builtin_policy(name))
    _check(pol, data.draw(workload(pol)), _others(data.draw, 3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_unexamined_horizon_stop_holds_for_any_new_request_custom(data: Any) -> None:
    pol = data.draw(custom_policy())
    _check(pol, data.draw(workload(pol)), _others(data.draw, 3))


def _queue(n_wait: int) -> Snapshot:
    rows = [(0, 800, 820, 20, -1, 300, 0)] * 6 + [(1, 1500, 0, 0, -1, 200, 0)] * n_wait
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    ids = tuple(f"r{i}" for i in range(len(rows)))
    return Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=ids, table=table)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_stop_is_found_where_it_should_be(impl: str) -> None:
    """Not vacuous: deep queues stop unexamined, a short one does not."""
    rp = compile_scheduler(bind_scheduler("vllm-v1", {"max_num_batched_tokens": 512}), impl)
    deep = rp.prepare(_queue(40).table)
    t = rp.ttft(deep, 100, 10, COEFFS, horizon_s=0.05)
    assert 0.05 < t < math.inf
    assert not rp.last_new_examined
    short = rp.prepare(_queue(1).table)
    t = rp.ttft(short, 100, 10, COEFFS, horizon_s=0.05)
    assert rp.last_new_examined
    rp.ttft(deep, 100, 10, COEFFS)  # to the first token
    assert rp.last_new_examined


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(data=st.data())
def test_the_estimator_answers_from_its_stops_as_a_fresh_replay_would(impl: str, data: Any) -> None:
    n_wait = data.draw(st.integers(0, 60))
    budget = data.draw(st.sampled_from([256, 512, 2048]))
    model = BatchTimeModel(0.003, 2e-5, 5e-8, 1e-10)
    pol = bind_scheduler("vllm-v1", {"max_num_batched_tokens": budget})
    est = BEAEstimator(pol, model, implementation=impl)
    snap = _queue(n_wait)
    kept = est.prepare(snap)
    for _ in range(8):
        prompt, out, cap = _others(data.draw, 1)[0]
        h = data.draw(st.floats(0.01, 3.0))
        fresh = est.ttft(est.prepare(snap), prompt, out, None if cap < 0 else cap, horizon_s=h)
        got = est.ttft(kept, prompt, out, None if cap < 0 else cap, horizon_s=h)
        assert got == pytest.approx(fresh, rel=1e-12), (prompt, out, cap, h)
        assert (got > h) == (fresh > h)
    assert len(kept.horizon_stops) <= 8
    # New coefficients (a recalibration) are never answered from the old ones' stops.
    if kept.horizon_stops:
        lo = kept.horizon_stops[-1][0]
        est.batch_time = BatchTimeModel(0.006, 4e-5, 1e-7, 2e-10)
        fresh = est.ttft(est.prepare(snap), 100, 10, horizon_s=lo)
        assert est.ttft(kept, 100, 10, horizon_s=lo) == pytest.approx(fresh, rel=1e-12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(ARRIVAL, min_size=4, max_size=16),
    at=st.integers(0, 30),
    news=st.lists(NEW, min_size=2, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_an_unexamined_horizon_stop_holds_with_prefix_caching(
    name: str,
    arrivals: list[tuple[int, int, int, int, int]],
    at: int,
    news: list[tuple[int, int, int, int]],
    seed: int,
) -> None:
    """The same with the snapshot's blocks: the new request's keys are looked up
    only when admission reaches it."""
    pol, rng, snap = _run_engine(name, arrivals, at, seed)
    assert snap.kv is not None
    reqs = [
        (plen, out, chain_keys(tokens(rng, pfx, shared, plen), pol.block_size))
        for pfx, shared, plen, out in news
    ]
    replayers = [PyReplayer(pol)]
    if "cython" in IMPLS:
        replayers.append(ApcReplayer(pol))
    for rp in replayers:
        prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        plen, out, keys = reqs[0]
        full = rp.replay(prep, plen, out, COEFFS, record=True, prefix_keys=keys)
        assert full.batches is not None
        for e in np.cumsum([b.duration_s for b in full.batches[:12]]).tolist():
            t = rp.ttft(prep, plen, out, COEFFS, prefix_keys=keys, horizon_s=e * 0.5)
            if rp.last_new_examined or not e * 0.5 < t < math.inf:
                continue
            event("an unexamined stop")
            for plen2, out2, keys2 in reqs[1:]:
                got = rp.ttft(prep, plen2, out2, COEFFS, prefix_keys=keys2, horizon_s=e * 0.5)
                assert got == t, (rp.implementation, e)
                assert not rp.last_new_examined

"""Staleness handling: dispatch overlay, fast-forward, fallback switching, and the benchmark."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest

from bearsdk import BEAEstimator, bind_scheduler
from bearsdk.estimators import BatchTimeModel
from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.lps import LPSEstimator
from bearsdk.replay import SchedulerCore
from bearsdk.snapshot import STATE_RUNNING, STATE_WAITING, snapshot_from_dict
from bearsdk.state import (
    Dispatch,
    DispatchOverlay,
    FastForward,
    InstanceState,
    SnapshotCache,
    StalenessRules,
)

BT = BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10)
PARAMS = {"max_num_batched_tokens": 2048, "max_num_seqs": 32, "num_gpu_blocks": 4000}


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def estimator(**over: Any) -> BEAEstimator:
    return BEAEstimator.for_scheduler("vllm-v1", BT, {**PARAMS, **over})


def running_engine(seed: int = 0, n: int = 40, steps: int = 30) -> tuple[SchedulerCore, float]:
    """A vllm-v1 core with ``n`` requests, run ``steps`` batches in virtual time."""
    core = SchedulerCore(bind_scheduler("vllm-v1", PARAMS))
    core.set_coeffs(BT.replay_coeffs)
    rng = random.Random(seed)
    for i in range(n):
        core.add_request(f"r{i}", rng.randint(100, 2000), rng.randint(10, 300))
    t = 0.0
    for _ in range(steps):
        t += step(core)
    return core, t


def step(core: SchedulerCore) -> float:
    b = core.schedule()
    dt = core.account(b) if b else 0.0
    core.queue.append(b)
    if len(core.queue) >= 2:  # vllm-v1 schedules asynchronously
        core.process(core.queue.popleft())
    return dt


def state_of(rows: Any) -> dict[str, tuple[int, int, int]]:
    return {rid: (row[0], row[2], row[3]) for rid, row in rows}


# -- fast-forward -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_forward_reproduces_the_engine_when_lengths_are_known(seed: int) -> None:
    core, t0 = running_engine(seed)
    snap = snapshot_from_dict(core.snapshot(instance="x", seq=1, time=t0, output_len=True))
    arrivals = []
    t = t0
    rng = random.Random(seed + 10)
    for k in range(40):
        if k % 7 == 3:  # the router dispatches a request mid-run
            rid = f"new{k}"
            p, o = rng.randint(50, 900), rng.randint(5, 80)
            arrivals.append(Dispatch(rid, t, p, o))
            core.add_request(rid, p, o)
        t += step(core)
    truth = core.snapshot(instance="x", seq=2, time=t, output_len=True)
    ff = FastForward(snap, estimator(), captured=t0)
    now = t - 1e-9  # just before the boundary the truth was taken at
    ff.advance(now, arrivals)
    got = ff.at(now)
    want = {
        r["id"]: (
            STATE_RUNNING if r["state"] == "running" else STATE_WAITING,
            r["computed_tokens"],
            r["output_tokens"],
        )
        for r in truth["requests"]
    }
    assert state_of(zip(got.ids, got.table.tolist(), strict=True)) == want
    assert got.inflight_remaining_s is not None
    assert ff.simulated_batches == 40


def test_fast_forward_is_incremental() -> None:
    core, t0 = running_engine(3)
    snap = snapshot_from_dict(core.snapshot(instance="x", seq=1, time=t0, output_len=True))
    whole = FastForward(snap, estimator(), captured=t0)
    whole.advance(t0 + 0.5, [])
    steps = FastForward(snap, estimator(), captured=t0)
    for k in range(1, 11):
        steps.advance(t0 + 0.05 * k, [])
    a, b = whole.at(t0 + 0.5), steps.at(t0 + 0.5)
    assert a.ids == b.ids
    assert np.array_equal(a.table, b.table)
    assert a.inflight_remaining_s == pytest.approx(b.inflight_remaining_s)
    assert whole.simulated_batches == steps.simulated_batches


def test_fast_forward_idles_and_wakes_for_arrivals() -> None:
    snap = snapshot_from_dict(
        {"schema": "bear.snapshot/1", "instance": "x", "seq": 1, "time": 0.0, "requests": []}
    )
    ff = FastForward(snap, estimator(), captured=0.0)
    ff.advance(1.0, [])
    assert len(ff.at(1.0)) == 0
    d = Dispatch("late", 2.0, 300, 3)
    ff.advance(2.0 + 1e-6, [d])
    got = ff.at(2.0 + 1e-6)
    assert got.ids == ("late",)
    assert got.table[0, 0] == STATE_RUNNING  # admitted into the batch at its arrival
    ff.advance(10.0, [d])
    assert len(ff.at(10.0)) == 0  # served and finished
    assert ff.simulated_batches >= 3


# -- overlay ----------------------------------------------------------------------


def snap_with(ids: list[str], seq: int = 1, time: float = 100.0) -> Any:
    return snapshot_from_dict(
        {
            "schema": "bear.snapshot/1",
            "instance": "x",
            "seq": seq,
            "time": time,
            "kv": {"block_size": 16, "num_blocks": 4000, "free_blocks": 3000},
            "requests": [
                {
                    "id": rid,
                    "state": "running",
                    "prompt_tokens": 100,
                    "computed_tokens": 101,
                    "output_tokens": 2,
                }
                for rid in ids
            ]
            + [
                {
                    "id": "w0",
                    "state": "waiting",
                    "prompt_tokens": 50,
                    "computed_tokens": 0,
                    "output_tokens": 0,
                }
            ],
        }
    )


def test_overlay_adds_unseen_dispatches_in_order() -> None:
    ov = DispatchOverlay(grace_s=0.05)
    ov.add(Dispatch("a", 100.00, 300))
    ov.add(Dispatch("b", 100.01, 200, output_len=9, max_tokens=5))
    ov.add(Dispatch("old", 99.0, 10))  # long before the capture: assumed served
    snap = snap_with(["r0"])
    pending = ov.unseen(100.0)
    assert [d.rid for d in pending] == ["a", "b"]
    view = DispatchOverlay.apply(snap, pending)
    assert view.ids == ("r0", "w0", "a", "b")
    assert view.table[2].tolist() == [STATE_WAITING, 300, 0, 0, -1, -1, 0]
    assert view.table[3].tolist() == [STATE_WAITING, 200, 0, 0, 5, 5, 0]  # capped
    # a first token moves a dispatch to the running requests, holding its blocks
    ov.progress("a", 1)
    view = DispatchOverlay.apply(snap, ov.unseen(100.0))
    assert view.ids == ("r0", "a", "w0", "b")
    assert view.table[1].tolist() == [STATE_RUNNING, 300, 300, 1, -1, -1, 0]
    assert view.kv is not None
    assert view.kv.free_blocks == 3000 - 19


def test_a_dispatch_seen_running_takes_no_seat_the_engine_lacks() -> None:
    # Every seat taken in the snapshot: a dispatch whose first token the router
    # saw has replaced one the snapshot still shows. The view stays one an
    # engine could be in (the replay refuses more running than max_num_seqs),
    # and the estimate is made (bench staleness once stopped on this).
    clock = Clock(100.0)
    st = make_state(clock, fast_forward_after_s=None)
    rows = [
        {
            "id": f"r{i}",
            "state": "running",
            "prompt_tokens": 50,
            "computed_tokens": 50,
            "output_tokens": 1,
        }
        for i in range(PARAMS["max_num_seqs"])
    ]
    st.cache.offer(
        snapshot_from_dict(
            {
                "schema": "bear.snapshot/1",
                "instance": "x",
                "seq": 1,
                "time": 100.0,
                "requests": rows,
            }
        ),
        received=100.0,
    )
    st.on_dispatch("late", 300, now=100.1)
    st.on_tokens("late", 1)
    st.on_dispatch("queued", 200, now=100.1)
    clock.t = 100.2
    e = st.ttft(700, 10)
    assert e.mode == "overlay"
    view = st._view
    assert view is not None
    assert view.snapshot.num_running == PARAMS["max_num_seqs"]
    assert "late" not in view.snapshot.ids
    assert "queued" in view.snapshot.ids
    assert st.fast_forward_errors == 0


def test_overlay_keeps_a_bounded_number_of_unseen_dispatches() -> None:
    # A flood of (forged) dispatches from the bus forgets the oldest, never grows.
    ov = DispatchOverlay(max_pending=3)
    for i in range(10):
        ov.add(Dispatch(f"d{i}", 100.0 + i, 10))
    assert len(ov) == 3
    assert [d.rid for d in ov] == ["d7", "d8", "d9"]
    assert ov.expired == 7
    with pytest.raises(ValueError, match="max_pending"):
        DispatchOverlay(max_pending=0)


def test_overlay_reconciles_with_snapshots() -> None:
    ov = DispatchOverlay(expire_s=5.0)
    for rid, t in (("q1", 100.0), ("q2", 100.1), ("q3", 100.2), ("q4", 90.0)):
        ov.add(Dispatch(rid, t, 100))
    v = ov.version
    # vLLM ids embed the router's: "cmpl-q1-0" shows q1
    ov.reconcile(snap_with(["cmpl-q1-0", "q2"]), captured=100.3)
    assert [d.rid for d in ov] == ["q3"]
    assert ov.shown == 2
    assert ov.expired == 1
    assert ov.version > v
    assert ov.discard("q3")
    assert not ov.discard("q3")
    ov.add(Dispatch("x", 0, 1))
    with pytest.raises(ValueError, match="already pending"):
        ov.add(Dispatch("x", 0, 1))
    with pytest.raises(ValueError, match="prompt_tokens must be an integer >= 1"):
        ov.add(Dispatch("y", 0, 0))


# -- the instance estimator -------------------------------------------------------


def make_state(
    clock: Clock, *, fallback: LatencyEstimator | None = None, **pol: Any
) -> InstanceState:
    cache = SnapshotCache("x", clock=clock, max_transit_s=math.inf)
    kw: dict[str, Any] = {"rules": StalenessRules(**pol)}
    if fallback is not None:
        kw["fallback"] = fallback
    return InstanceState(cache, estimator(), **kw)


def test_fresh_snapshot_replays_the_prepared_state() -> None:
    clock = Clock(100.0)
    st = make_state(clock)
    st.cache.offer(snap_with(["r0", "r1"]))
    e = st.ttft(500, 20)
    assert e.mode == "bea"
    assert e.pending == 0
    entry = st.cache.entry
    assert entry is not None
    assert entry.prepared is not None
    assert e.ttft_s == pytest.approx(st.estimator.ttft(entry.prepared, 500, 20))


def test_back_to_back_decisions_see_each_other() -> None:
    clock = Clock(100.0)
    st = make_state(clock, fast_forward_after_s=None)
    st.cache.offer(snap_with(["r0"]))
    first = st.ttft(1500, 20)
    st.on_dispatch("q1", 1500, 20)
    clock.t += 0.001
    second = st.ttft(1500, 20)
    assert second.mode == "overlay"
    assert second.pending == 1
    assert second.ttft_s > first.ttft_s
    # the next snapshot shows q1: the overlay drops it (no double counting)
    st.cache.offer(snap_with(["r0", "q1"], seq=2, time=100.002))
    clock.t = 100.003
    third = st.ttft(1500, 20)
    assert third.mode == "bea"
    assert len(st.overlay) == 0


def test_paper_rules_ignore_dispatches() -> None:
    clock = Clock(100.0)
    st = make_state(clock)
    st = InstanceState(st.cache, st.estimator, rules=StalenessRules.paper())
    st.cache.offer(snap_with(["r0"]))
    a = st.ttft(800, 10)
    st.on_dispatch("q1", 5000)
    clock.t = 200.0  # a very old snapshot
    b = st.ttft(800, 10)
    assert a.ttft_s == b.ttft_s
    assert b.mode == "bea"


def test_age_is_deducted_from_the_batch_in_flight() -> None:
    clock = Clock(100.0)
    st = make_state(clock, fast_forward_after_s=0.01)
    snap = snapshot_from_dict({**snap_with(["r0"]).to_dict(), "inflight": {"remaining_s": 0.05}})
    st.cache.offer(snap)
    a = st.ttft(400, 10)
    clock.t += 0.03
    b = st.ttft(400, 10)
    assert b.mode == "bea"
    assert a.ttft_s - b.ttft_s == pytest.approx(0.03)


def test_stale_snapshot_is_fast_forwarded() -> None:
    core, t0 = running_engine(5)
    clock = Clock(t0)
    st = make_state(clock, fast_forward_after_s=0.01, refresh_s=0.0)
    snap = snapshot_from_dict(core.snapshot(instance="x", seq=1, time=t0, output_len=True))
    st.cache.offer(snap, received=t0)
    for _ in range(25):
        clock.t += step(core)
    clock.t -= 1e-9
    e = st.ttft(700, 10)
    assert e.mode == "fast-forward"
    # the same estimate as from a fresh snapshot of the engine now
    fresh = snapshot_from_dict(
        {
            **core.snapshot(instance="x", seq=2, time=clock.t, output_len=True),
            "inflight": {"remaining_s": 1e-9},
        }
    )
    want = st.estimator.estimate(fresh, 700, 10).ttft_s
    assert e.ttft_s == pytest.approx(want, rel=1e-6, abs=1e-8)


def _forwarded_view(refresh_s: float) -> tuple[InstanceState, Clock, Any, float, Any, float]:
    """A state whose snapshot is 10 engine steps old, its first fast-forwarded
    view built: (state, clock, snapshot, capture time, view, view's batch left)."""
    core, t0 = running_engine(5)
    clock = Clock(t0)
    st = make_state(clock, fast_forward_after_s=0.01, refresh_s=refresh_s)
    snap = snapshot_from_dict(core.snapshot(instance="x", seq=1, time=t0, output_len=True))
    st.cache.offer(snap, received=t0)
    for _ in range(10):
        clock.t += step(core)
    clock.t += 1e-4
    st.ttft(700, 10)
    view = st._view
    assert view is not None
    inflight = view.snapshot.inflight_remaining_s
    assert inflight is not None
    assert inflight > 2e-4
    return st, clock, snap, t0, view, inflight


def test_a_fast_forwarded_view_is_reused_exactly_while_its_batch_runs() -> None:
    # With refresh_s = 0 the view is rebuilt once the batch in flight in it
    # ends; in between, its estimates are those of a view built then.
    st, clock, snap, t0, view, inflight = _forwarded_view(0.0)
    first = st.ttft(700, 10)
    t1 = clock.t
    for frac in (0.3, 0.9):
        clock.t = t1 + inflight * frac
        got = st.ttft(700, 10)
        assert st._view is view  # not rebuilt
        again = make_state(clock, fast_forward_after_s=0.01, refresh_s=0.0)
        again.cache.offer(snap, received=t0)
        assert got.ttft_s == pytest.approx(again.ttft(700, 10).ttft_s, rel=1e-9, abs=1e-12)
        assert got.ttft_s == pytest.approx(first.ttft_s - inflight * frac, rel=1e-9)
    clock.t = t1 + inflight * 1.5
    st.ttft(700, 10)
    assert st._view is not view  # the batch ended: rebuilt


def test_a_fast_forwarded_view_is_kept_past_its_batch_exactly() -> None:
    # Within refresh_s the view outlives its batch in flight: an estimate replays
    # it on to the decision (the new request arriving that much later), which is
    # what a view rebuilt at the decision gives.
    st, clock, snap, t0, view, inflight = _forwarded_view(0.2)
    t1 = clock.t
    for later in (inflight * 1.5, inflight * 4.3, 0.05, 0.19):
        clock.t = t1 + later
        got = st.ttft(700, 10)
        assert st._view is view  # not rebuilt
        again = make_state(clock, fast_forward_after_s=0.01, refresh_s=0.0)
        again.cache.offer(snap, received=t0)
        assert got.ttft_s == pytest.approx(again.ttft(700, 10).ttft_s, rel=1e-9, abs=1e-12)
    clock.t = t1 + 0.21
    st.ttft(700, 10)
    assert st._view is not view  # past refresh_s: rebuilt


def test_a_view_is_rebuilt_before_a_request_the_router_holds_could_finish() -> None:
    # Fast-forward keeps the router's own requests running until it sees them
    # finish; a replay of the view would end them at their predicted length.
    from bearsdk.estimators import RememberedLengths

    rid = "bear-0a1b2c3d-0000000007"
    lengths = RememberedLengths()
    lengths.remember(rid, 30)
    est = BEAEstimator.for_scheduler("vllm-v1", BT, PARAMS, length_predictor=lengths)
    clock = Clock(0.0)
    cache = SnapshotCache("x", clock=clock, max_transit_s=math.inf)
    st = InstanceState(cache, est, rules=StalenessRules(fast_forward_after_s=0.01, refresh_s=10.0))
    cache.offer(_one_decoding(f"chatcmpl-{rid}"), received=0.0)
    clock.t = 0.02
    st.ttft(700, 10)
    view = st._view
    assert view is not None
    # 30 tokens predicted, 1 produced: it cannot finish within 27 batches of b0.
    limit = (view.snapshot.inflight_remaining_s or 0.0) + (
        int(view.snapshot.table[0, 5] - view.snapshot.table[0, 3] - view.snapshot.table[0, 6]) - 1
    ) * BT.b0
    assert limit > 0.05
    clock.t = 0.02 + limit * 0.99
    st.ttft(700, 10)
    assert st._view is view
    clock.t = 0.02 + limit * 1.01
    st.ttft(700, 10)
    assert st._view is not view


class StubFallback:
    def __init__(self) -> None:
        self.calls = 0

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        self.calls += 1
        return 42.0


def test_fallback_without_or_with_stale_snapshots_and_back() -> None:
    clock = Clock(100.0)
    stub = StubFallback()
    assert isinstance(stub, LatencyEstimator)
    st = make_state(clock, fallback=stub, fallback_after_s=1.0)
    e = st.ttft(100)
    assert (e.mode, e.ttft_s) == ("fallback", 42.0)
    st.cache.offer(snap_with(["r0"], time=100.0))
    assert st.ttft(100).mode == "bea"
    clock.t = 101.5
    assert st.ttft(100).mode == "fallback"
    st.cache.offer(snap_with(["r0"], seq=2, time=101.5))
    assert st.ttft(100).mode == "bea"
    assert st.switches == 3  # fallback -> bea -> fallback -> bea
    assert stub.calls == 2
    # through the LatencyEstimator interface, the router's view feeds the fallback
    clock.t = 200.0
    assert st.estimate_ttft(RequestInfo(100), InstanceView(name="x", now=200.0)) == 42.0


def test_an_idle_engines_snapshot_never_goes_stale() -> None:
    # An idle engine publishes nothing: its last (empty) snapshot stays exact.
    clock = Clock(100.0)
    stub = StubFallback()
    st = make_state(clock, fallback=stub, fallback_after_s=1.0)
    idle = {"schema": "bear.snapshot/1", "instance": "x", "seq": 1, "time": 100.0}
    st.cache.offer(snapshot_from_dict({**idle, "requests": []}))
    clock.t = 160.0
    e = st.ttft(100, 10)
    assert e.mode == "bea"
    assert e.ttft_s < 1.0
    # once something was sent there and no snapshot followed, the fallback answers
    st.on_dispatch("q1", 100, 10)
    assert st.ttft(100, 10).mode == "fallback"
    assert stub.calls == 1


def test_default_fallback_is_lps() -> None:
    st = InstanceState(SnapshotCache("x", clock=Clock()), estimator())
    assert isinstance(st.fallback, LPSEstimator)
    view = InstanceView(name="x", now=0.0, prefill_throughput=10_000.0)
    assert st.estimate_ttft(RequestInfo(1000), view) == pytest.approx(0.1)
    assert st.mode == "fallback"


def test_no_fallback_means_no_estimate_without_snapshot() -> None:
    st = InstanceState(SnapshotCache("x", clock=Clock()), estimator(), fallback=None)
    e = st.ttft(100)
    assert e.mode == "none"
    assert math.isinf(e.ttft_s)


def test_staleness_rules_validation() -> None:
    with pytest.raises(ValueError, match="fallback_after_s must be a number >= 0"):
        StalenessRules(fallback_after_s=-1)
    with pytest.raises(ValueError, match="fast_forward_after_s"):
        StalenessRules(fast_forward_after_s=math.nan)
    other = estimator()
    with pytest.raises(ValueError, match=r"cache\.estimator must be"):
        InstanceState(SnapshotCache("x", estimator=other), estimator())


# -- the benchmark ----------------------------------------------------------------


def test_staleness_benchmark_runs_and_the_fixes_help() -> None:
    """A small run of ``bearsdk bench staleness`` (the full figures are a benchmark)."""
    from bearsdk.bench.staleness import METHODS, Workload, run

    report = run(Workload(requests=150, rate=12.0, seed=3), (0, 400))
    table = report["mape_pct"]
    assert set(table) == {"0", "400"}
    assert set(table["400"]) == set(METHODS)
    assert report["scored_requests"] > 50
    # deterministic for a seed, and at 400 ms both fixes beat the paper's estimator
    assert table["400"]["overlay+ff"] < table["400"]["paper"]


# -- the router's own requests in fast-forward ------------------------------------


def _one_decoding(rid: str) -> Any:
    return snapshot_from_dict(
        {
            "schema": "bear.snapshot/1",
            "instance": "x",
            "seq": 1,
            "time": 0.0,
            "requests": [
                {
                    "id": rid,
                    "state": "running",
                    "prompt_tokens": 100,
                    "computed_tokens": 100,
                    "output_tokens": 1,
                }
            ],
        }
    )


@pytest.mark.parametrize("calibrate", [False, True])
def test_own_requests_run_in_fast_forward_until_seen_complete(calibrate: bool) -> None:
    from bearsdk.estimators import RememberedLengths

    rid = "bear-0a1b2c3d-0000000007"
    lengths = RememberedLengths(calibrate=calibrate)
    lengths.remember(rid, 5)  # predicted: done after a few steps
    est = BEAEstimator.for_scheduler("vllm-v1", BT, PARAMS, length_predictor=lengths)
    ff = FastForward(_one_decoding(f"chatcmpl-{rid}"), est, captured=0.0)
    ff.advance(1.0, [])  # ~200 steps: far past its prediction
    got = ff.at(1.0)
    # The router has not seen it finish, so it is still running, and its length
    # is predicted again from what it has produced by now.
    assert got.ids == (f"chatcmpl-{rid}",)
    out, total = int(got.table[0, 3]), int(got.table[0, 5])
    assert out > 100
    assert total > out
    ff.complete(rid)  # the router's id; the engine's decorates it
    ff.advance(1.1, [])
    assert len(ff.at(1.1)) == 0


def test_other_residents_finish_at_their_predicted_length() -> None:
    from bearsdk.estimators import RememberedLengths

    est = BEAEstimator.for_scheduler(
        "vllm-v1", BT, PARAMS, length_predictor=RememberedLengths(mean=5.0)
    )
    ff = FastForward(_one_decoding("chatcmpl-someone-else"), est, captured=0.0)
    ff.advance(1.0, [])
    assert len(ff.at(1.0)) == 0


def test_state_tracks_dispatches_until_they_complete() -> None:
    from bearsdk.estimators import RememberedLengths

    lengths = RememberedLengths()
    est = BEAEstimator.for_scheduler("vllm-v1", BT, PARAMS, length_predictor=lengths)
    clock = Clock()
    st = InstanceState(SnapshotCache("x", est, clock=clock), est)
    st.on_dispatch("bear-ab-0000000001", 100, 50, now=clock.t)
    st.on_dispatch("bear-ab-0000000002", 100, None, now=clock.t)  # no prediction
    assert st.tracks("bear-ab-0000000001")
    assert "bear-ab-0000000001" in lengths
    assert st.tracks("bear-ab-0000000002")  # pending in the overlay
    assert not st.tracks("bear-ab-0000000003")
    st.on_complete("bear-ab-0000000001", now=clock.t + 1, output_tokens=70)
    assert not st.tracks("bear-ab-0000000001")
    assert len(lengths) == 0


def test_fast_forward_times_batches_with_the_replays_dense_floor() -> None:
    """A model with the dense floor prices a one-token batch at b1 * tau, in the
    fast-forward as in the replay it feeds (not at eq. 12's b1 * 1)."""
    floor = BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10, dense_floor_tokens=64.0)
    est = BEAEstimator.for_scheduler("vllm-v1", floor, PARAMS)
    snap = _one_decoding("chatcmpl-x")
    ff = FastForward(snap, est, captured=0.0)
    ff.advance(1e-9, [])  # schedules the first batch: the one decode token
    want = floor.b0 + floor.b1 * 64.0 + floor.b2 * 101  # context 100, and itself
    assert ff.elapsed(1.0) == pytest.approx(want, rel=1e-12)
    # The replay of the same snapshot charges its first batch alike.
    rec = est.estimate(snap, 1, 1, explain=True).batches
    assert rec is not None
    assert rec[0].duration_s == pytest.approx(floor.time_of(rec[0]), rel=1e-12)
    assert floor.time_of(rec[0]) == pytest.approx(
        floor.b0
        + floor.b1 * 64.0
        + floor.b2 * (rec[0].decode_context + rec[0].decode_tokens)
        + floor.b3 * 1,
        rel=1e-12,
    )


def test_the_kept_view_shortcut_answers_as_the_full_path_does() -> None:
    # estimate_fields finds a kept fast-forwarded view without _prepared while
    # its entry, view key and rules hold; a dispatch (the overlay's version), a
    # completion or new rules each send it the full way again. A twin state
    # with the shortcut cleared before every estimate agrees.
    st, clock, snap, t0, _, inflight = _forwarded_view(0.2)
    twin = make_state(clock, fast_forward_after_s=0.01, refresh_s=0.2)
    twin.cache.offer(snap, received=t0)

    def both(prompt: int) -> tuple[Any, Any]:
        twin._hot = None
        return st.ttft(prompt, 10), twin.ttft(prompt, 10)

    t1 = clock.t
    events = [
        lambda: None,
        lambda: (st.on_dispatch("q1", 900, 10), twin.on_dispatch("q1", 900, 10)),
        lambda: None,
        lambda: (st.on_complete("q1"), twin.on_complete("q1")),
        lambda: None,
    ]
    for k, event in enumerate(events):
        clock.t = t1 + inflight * (0.2 + k * 0.3)
        event()
        a, b = both(700 + k)
        assert (a.mode, a.pending) == (b.mode, b.pending), k
        assert a.ttft_s == pytest.approx(b.ttft_s, rel=1e-9, abs=1e-12), k
    assert st._hot is not None
    # New rules: the shortcut no longer holds for them.
    st.rules = StalenessRules(fast_forward_after_s=None)
    got = st.ttft(700, 10)
    assert got.mode != "fast-forward"

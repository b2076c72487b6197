"""The simulated engine: decode runs change nothing, snapshots and forecasts are exact."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bearsdk.emulator import GroundTruthParams
from bearsdk.estimators.batch_time import fit_batch_time
from bearsdk.replay import SchedulerCore
from bearsdk.sim.engine import (
    COMPLETE,
    FIRST_TOKEN,
    BatchNoise,
    EngineEvent,
    SimEngine,
    bind_engine,
)
from bearsdk.snapshot import snapshot_from_dict

CASES = [
    # (profile, engine flags, rate, snapshot delay)
    ("qwen3-8b-h100", {}, 4.0, 0.0),
    ("qwen3-0.6b-h100", {}, 8.0, 0.05),
    ("qwen3-32b-2xh100", {"num_gpu_blocks": 3000}, 6.0, 0.4),
    (
        "qwen3-8b-h100",
        {
            "num_gpu_blocks": 1500,
            "max_model_len": 16384,
            "max_num_batched_tokens": 2048,
            "max_num_seqs": 48,
        },
        10.0,
        0.0,
    ),
]


def _arrivals(seed: int, n: int, rate: float) -> list[tuple[float, str, int, int]]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append((t, f"r{i:05d}", rng.randint(1, 6000), rng.randint(1, 1200)))
    return out


def _engine(
    profile: str, params: dict[str, object], seed: int, runs: bool, events: list[EngineEvent]
) -> SimEngine:
    em = bind_engine(profile, "vllm-v1", params)
    noise = BatchNoise(em.time_model.params, seed)
    return SimEngine(
        "e", em.policy, em.max_model_len, em.time_model, noise, events.append, decode_runs=runs
    )


def _trace(
    case: tuple[str, dict[str, object], float, float], seed: int, runs: bool
) -> tuple[list[EngineEvent], list[object], SimEngine]:
    profile, params, rate, delay = case
    events: list[EngineEvent] = []
    eng = _engine(profile, params, seed, runs, events)
    arr = _arrivals(seed, 60, rate)
    eng.plan_captures([a[0] - delay for a in arr])
    seen: list[object] = []
    for i, (t, rid, p, o) in enumerate(arr):
        eng.advance(t)
        s = eng.captured(i)
        seen.append((s.seq, round(s.time, 9), s.table.tobytes(), s.kv, s.inflight_remaining_s))
        if i % 4 == 0:  # forecasts replay: a sample suffices (and keeps pure-Python CI fast)
            seen.append(round(eng.forecast_ttft(p, o, t), 9))
        eng.add_request(rid, p, o, t)
    eng.drain()
    return events, seen, eng


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]:g}qps" for c in CASES])
def test_decode_runs_change_nothing(case: tuple[str, dict[str, object], float, float]) -> None:
    slow_events, slow_seen, slow = _trace(case, 3, runs=False)
    fast_events, fast_seen, fast = _trace(case, 3, runs=True)
    assert fast.run_steps > 0
    assert slow.run_steps == 0
    assert fast.batches == slow.batches
    assert len(fast_events) == len(slow_events) == 120
    for a, b in zip(slow_events, fast_events, strict=True):
        assert (a.kind, a.rid) == (b.kind, b.rid)
        assert b.time == pytest.approx(a.time, rel=1e-9)
    for a, b in zip(slow_seen, fast_seen, strict=True):
        if isinstance(a, float):
            assert b == pytest.approx(a, rel=1e-7)
        else:
            assert isinstance(a, tuple)
            assert isinstance(b, tuple)
            assert (a[0], a[2], a[3]) == (b[0], b[2], b[3])
            assert b[1] == pytest.approx(a[1], rel=1e-9)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_forecast_is_the_true_ttft_when_nothing_arrives_after(async_scheduling: bool) -> None:
    events: list[EngineEvent] = []
    em = bind_engine("qwen3-8b-h100", "vllm-v1", {"async_scheduling": async_scheduling})
    eng = SimEngine(
        "e",
        em.policy,
        em.max_model_len,
        em.time_model,
        BatchNoise(em.time_model.params, 5),
        events.append,
    )
    arr = _arrivals(11, 80, 5.0)
    forecast: dict[str, tuple[float, float, float]] = {}
    for i, (t, rid, p, o) in enumerate(arr):
        eng.advance(t)
        nxt = arr[i + 1][0] if i + 1 < len(arr) else float("inf")
        forecast[rid] = (eng.forecast_ttft(p, o, t), t, nxt)
        eng.add_request(rid, p, o, t)
    eng.drain()
    checked = 0
    for e in events:
        if e.kind != FIRST_TOKEN:
            continue
        f, t, nxt = forecast[e.rid]
        if e.time <= nxt:
            assert f == pytest.approx(e.time - t, rel=1e-9)
            checked += 1
    assert checked > 40


def test_events_and_published_snapshots_follow_the_scheduler() -> None:
    events: list[EngineEvent] = []
    eng = _engine("qwen3-0.6b-h100", {}, 1, True, events)
    eng.add_request("a", 300, 5, 0.0)
    eng.advance(1e-9)  # the first step starts at 0: the prefill of a
    snap = eng.snapshot()
    assert snap.ids == ("a",)
    assert snap.num_running == 1
    assert snap.inflight_remaining_s is not None
    assert snap.inflight_remaining_s > 0
    eng.add_request("b", 50, 3, 1e-9)
    # b arrived after the last step: the published snapshot cannot show it yet.
    assert eng.snapshot().ids == ("a",)
    eng.drain()
    assert eng.idle
    kinds = [(e.kind, e.rid) for e in events]
    assert kinds.index((FIRST_TOKEN, "a")) < kinds.index((COMPLETE, "a"))
    assert sorted(kinds) == sorted(
        [(FIRST_TOKEN, "a"), (COMPLETE, "a"), (FIRST_TOKEN, "b"), (COMPLETE, "b")]
    )
    assert eng.snapshot().ids == ()


def test_published_rows_are_the_cores_snapshot() -> None:
    eng = _engine("qwen3-8b-h100", {}, 2, True, [])
    for i, (t, rid, p, o) in enumerate(_arrivals(4, 60, 30.0)):
        eng.advance(t)
        if i % 10 == 9:
            # After a step and before the next arrival: what the core itself exports.
            ours = eng.snapshot()
            doc = eng.core.snapshot(instance="e", seq=ours.seq, time=ours.time)
            theirs = snapshot_from_dict(doc)
            # The core also holds the arrivals since its last step, at the queue's end.
            n = len(ours.ids)
            assert ours.ids == theirs.ids[:n]
            assert ours.table.tolist() == theirs.table[:n].tolist()
            assert all(r[0] == 1 for r in theirs.table[n:].tolist())
            assert ours.kv == theirs.kv
        eng.add_request(rid, p, o, t)


def test_noise_is_the_same_however_it_is_read() -> None:
    params = GroundTruthParams(noise_sigma=0.1, outlier_prob=0.2)
    a, b = BatchNoise(params, 9), BatchNoise(params, 9)
    whole = b.span(0, 40_000).copy()
    assert [a.at(k) for k in (39_999, 0, 17_000)] == [whole[39_999], whole[0], whole[17_000]]
    assert not np.array_equal(BatchNoise(params, 10).span(0, 100), whole[:100])
    plain = BatchNoise(GroundTruthParams(noise_sigma=0.0, outlier_prob=0.0), 1).span(0, 50)
    assert np.all(plain == 1.0)
    outliers = np.mean(whole > 1.45)
    assert 0.1 < outliers < 0.3  # the 20% outliers (x1.5 to x4) dominate the tail


def test_batch_log_fits_eq12_to_the_ground_truth() -> None:
    eng = _engine("qwen3-0.6b-h100", {}, 7, True, [])
    eng.log_batches = True  # set before any batch runs
    for t, rid, p, o in _arrivals(8, 80, 6.0):
        eng.advance(t)
        eng.add_request(rid, p, o, t)
    eng.drain()
    feats, y = eng.batch_log()
    assert len(y) == eng.batches
    assert np.all(y > 0)
    assert eng.run_steps > 0  # decode runs are logged too
    fit = fit_batch_time((feats, y))
    assert fit.mape < 0.06


def test_batches_are_taken_once_each_as_they_come() -> None:
    eng = _engine("qwen3-0.6b-h100", {}, 7, True, [])
    eng.log_batches = True
    feats, y = eng.take_batches()
    assert len(y) == 0
    got_f, got_y = [feats], [y]
    for t, rid, p, o in _arrivals(8, 80, 6.0):
        eng.advance(t)
        eng.add_request(rid, p, o, t)
        f, d = eng.take_batches()
        got_f.append(f)
        got_y.append(d)
    eng.drain()
    f, d = eng.take_batches()
    got_f.append(f)
    got_y.append(d)

    # Every batch once, decode runs included: the whole log (batch_log lists
    # the decode runs last; taken as they come, they are interleaved).
    def rows(f: np.ndarray, y: np.ndarray) -> np.ndarray:
        a = np.column_stack([f, y])
        return a[np.lexsort(a.T[::-1])]

    all_f, all_y = eng.batch_log()
    assert np.array_equal(rows(np.concatenate(got_f), np.concatenate(got_y)), rows(all_f, all_y))
    assert len(eng.take_batches()[1]) == 0


def test_scheduler_core_is_the_engines_own() -> None:
    eng = _engine("qwen3-8b-h100", {}, 1, True, [])
    assert isinstance(eng.core, SchedulerCore)
    assert eng.core.p is eng.policy

"""BEA estimator semantics (eq. 9-12) on top of the replay."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bearsdk
import bearsdk.estimators.bea as bea_module
from bearsdk.estimators import (
    BatchTimeModel,
    BEAEstimator,
    MeanLengthPredictor,
    resolve_output_lengths,
)
from bearsdk.replay import StopReason
from bearsdk.snapshot import COL_OUTPUT_LEN, KVState, RequestState, Snapshot

BT = BatchTimeModel(0.005, 2e-5, 5e-8, 1e-10)


def dec(rid: str, prompt: int, out: int, total: int | None = None, ph: int = 0) -> RequestState:
    return RequestState(rid, "running", prompt, prompt + out - 1 + ph, out, None, total, ph)


def test_single_batch_time_is_eq12(impl: str) -> None:
    snap = Snapshot.build([dec("a", 500, 201, 400)], kv=KVState(16, 1000, 900))
    est = BEAEstimator(
        bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False}), BT, implementation=impl
    )
    r = est.estimate(snap, 512, 10, explain=True)
    assert r.first_token_batch == 1
    assert r.stop_reason is StopReason.FIRST_TOKEN
    # one decode at context 700 (attending 701 keys) + a 512-token prefill from scratch
    want = 0.005 + 2e-5 * 513 + 5e-8 * 701 + 1e-10 * (512 * 513 // 2)
    assert r.ttft_s == pytest.approx(want)
    assert r.batches is not None
    assert r.batches[0].duration_s == pytest.approx(want)
    assert BT.time_of(r.batches[0]) == pytest.approx(want)


def test_inflight_remaining_is_added(impl: str) -> None:
    reqs = [dec("a", 500, 201, 400)]
    est = BEAEstimator(
        bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False}), BT, implementation=impl
    )
    base = est.estimate(Snapshot.build(reqs), 64, 10).ttft_s
    r = est.estimate(Snapshot.build(reqs, inflight_remaining_s=0.0123), 64, 10)
    assert r.ttft_s == pytest.approx(base + 0.0123)
    assert r.inflight_s == 0.0123


def test_chunked_prefill_spans_batches(impl: str) -> None:
    est = BEAEstimator(
        bearsdk.bind_scheduler(
            "vllm-v1", {"max_num_batched_tokens": 256, "max_num_seqs": 8, "async_scheduling": False}
        ),
        BT,
        implementation=impl,
    )
    r = est.estimate(Snapshot.build([dec("a", 100, 5, 500)]), 1000, 10, explain=True)
    # 255 prompt tokens per batch next to the decode: 1000 tokens need 4 batches
    assert r.first_token_batch == 4
    assert r.batches is not None
    assert [b.prefill_tokens for b in r.batches] == [255, 255, 255, 235]


def test_unknown_lengths_are_predicted_with_one_token_to_go() -> None:
    snap = Snapshot.build(
        [dec("a", 100, 900), dec("b", 100, 3), RequestState("w", "waiting", 50, 0, 0, 20)]
    )
    table = resolve_output_lengths(snap.table, MeanLengthPredictor(mean=256, residual=64))
    assert table[:, COL_OUTPUT_LEN].tolist() == [
        964,
        256,
        20,
    ]  # past the mean; fresh; capped by max_tokens
    assert (snap.table[:, COL_OUTPUT_LEN] == -1).all()  # the snapshot itself is untouched


def test_prediction_changes_the_estimate(impl: str) -> None:
    # Memory only frees when the resident finishes: its predicted length decides.
    snap = Snapshot.build([dec("a", 1000, 10)], kv=KVState(16, 80, 80 - 63 - 1))
    pol = bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False})
    short = BEAEstimator(pol, BT, MeanLengthPredictor(mean=50), implementation=impl).estimate(
        snap, 400, 5
    )
    long = BEAEstimator(pol, BT, MeanLengthPredictor(mean=150), implementation=impl).estimate(
        snap, 400, 5
    )
    # predicted totals: max(50, 10 + 64) = 74 and 150 outputs; "a" frees its blocks
    # after its last decode, and the new prompt is admitted in the next batch
    assert short.first_token_batch == 74 - 10 + 1
    assert long.first_token_batch == 150 - 10 + 1
    assert long.ttft_s > short.ttft_s


def test_a_stuck_state_orders_no_arrivals_and_keeps_no_bound(impl: str) -> None:
    # Two one-token KV blocks; the resident, preempted once (an output token),
    # recomputes both, then its decode finds no block and preempts it: that
    # step schedules nothing, and the replay ends there (never admitted) for a
    # request already waiting. One arriving after that step waits idle for it
    # and is admitted, so in such a state arriving later can mean a first token
    # earlier, and the one-token bound (docs/decision-cost.md) keeps nothing.
    import attrs
    from test_replay_regressions import custom

    pol = attrs.evolve(
        custom(seqs=2, async_scheduling=False, chunked=False, keep_outputs=False).with_kv(1, 2),
        exclusive=True,
    )
    table = np.array([[1, 1, 0, 1, -1, 3, 0]], dtype=np.int64)
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=("r0",), table=table)
    est = BEAEstimator(pol, BatchTimeModel(0.003, 2e-5, 5e-8, 1e-10), implementation=impl)
    prep = est.prepare(snap)
    assert prep.in_order
    assert est.estimate(prep, 1, 1).stop_reason is StopReason.NEVER_ADMITTED
    late = est.estimate(prep, 1, 1, arrival_s=0.2)
    assert late.stop_reason is StopReason.FIRST_TOKEN
    assert late.ttft_s < 0.01
    for arrival in (0.0, 0.0, 0.2, 0.1):
        assert est.admission_bound(prep, arrival) == 0.0
    assert prep.admission[1:] == [-math.inf, -math.inf, True]  # kept for every arrival


def test_never_admitted_is_infinite(impl: str) -> None:
    snap = Snapshot.build([], kv=KVState(16, 10, 9))
    est = BEAEstimator(bearsdk.bind_scheduler("vllm-v1"), BT, implementation=impl)
    r = est.estimate(snap, 5000, 10)
    assert r.stop_reason is StopReason.NEVER_ADMITTED
    assert math.isinf(r.ttft_s)
    assert r.first_token_batch == 0


def test_hot_path_equals_full_estimate(impl: str) -> None:
    rng = np.random.default_rng(0)
    reqs = [
        dec(f"d{i}", int(rng.integers(100, 2000)), int(rng.integers(1, 100)), 300, 1)
        for i in range(40)
    ]
    reqs += [
        RequestState(f"w{i}", "waiting", int(rng.integers(100, 3000)), 0, 0, 200, 100)
        for i in range(5)
    ]
    snap = Snapshot.build(reqs, kv=KVState(16, 20000, 20000 - 3000), inflight_remaining_s=0.002)
    est = BEAEstimator(
        bearsdk.bind_scheduler("vllm-v1", {"max_num_batched_tokens": 2048}), BT, implementation=impl
    )
    prep = est.prepare(snap)
    for p in (16, 700, 5000):
        assert est.ttft(prep, p, 50) == pytest.approx(est.estimate(prep, p, 50).ttft_s)
        for cap in (1, 8, 50, 4000):
            full = est.estimate(prep, p, 50, max_tokens=cap).ttft_s
            assert est.ttft(prep, p, 50, cap) == pytest.approx(full)


def test_a_horizon_bounds_the_estimate_with_the_batch_in_flight(impl: str) -> None:
    # A long waiting queue ahead: the full replay forms many batches.
    reqs = [dec(f"d{i}", 800, 20, 400, 1) for i in range(8)]
    reqs += [RequestState(f"w{i}", "waiting", 3000, 0, 0, 200, 100) for i in range(12)]
    snap = Snapshot.build(reqs, kv=KVState(16, 20000, 15000), inflight_remaining_s=0.004)
    est = BEAEstimator(
        bearsdk.bind_scheduler("vllm-v1", {"max_num_batched_tokens": 2048}), BT, implementation=impl
    )
    prep = est.prepare(snap)
    full = est.estimate(prep, 500, 50, explain=True)
    assert full.stop_reason is StopReason.FIRST_TOKEN
    assert full.batches is not None
    assert len(full.batches) > 10
    # Past the answer, the horizon changes nothing.
    assert est.estimate(prep, 500, 50, horizon_s=full.ttft_s * 1.01).ttft_s == full.ttft_s
    # Short of it: a lower bound past the horizon, after the batches that reach it.
    h = 0.004 + sum(b.duration_s for b in full.batches[:3]) - 1e-6
    cut = est.estimate(prep, 500, 50, explain=True, horizon_s=h)
    assert cut.stop_reason is StopReason.HORIZON
    assert cut.lower_bound
    assert cut.batches == full.batches[:3]
    assert h < cut.ttft_s < full.ttft_s
    # The hot path knows it sooner: the prefill queued ahead alone is past h.
    lb = est.bound(prep, 500)
    assert h < lb <= full.ttft_s
    assert est.ttft(prep, 500, 50, horizon_s=h) == lb
    # Where that bound is short of the horizon, the replay cuts as estimate() does.
    h2 = (lb + full.ttft_s) / 2
    cut2 = est.estimate(prep, 500, 50, horizon_s=h2)
    assert h2 < cut2.ttft_s <= full.ttft_s
    assert est.ttft(prep, 500, 50, horizon_s=h2) == pytest.approx(cut2.ttft_s)
    # The batch in flight alone reaches the horizon: one batch replayed.
    tiny = est.estimate(prep, 500, 50, explain=True, horizon_s=0.003)
    assert tiny.stop_reason is StopReason.HORIZON
    assert tiny.batches == full.batches[:1]
    with pytest.raises(ValueError, match="horizon_s"):
        est.ttft(prep, 500, 50, horizon_s=-1.0)


def test_snapshot_kv_overrides_policy_geometry(impl: str) -> None:
    snap = Snapshot.build([dec("a", 64, 1, 100)], kv=KVState(32, 500, 497))
    est = BEAEstimator(
        bearsdk.bind_scheduler("vllm-v1", {"block_size": 16}), BT, implementation=impl
    )
    assert est.prepare(snap).replayer.policy.block_size == 32


def test_richer_dense_term_is_priced_per_batch(impl: str) -> None:
    """b1 * max(tokens, tau): small batches cost the floor, in every batch the replay forms."""
    bt = BT.with_dense_floor(1024)  # above the 512-token budget: every batch costs the floor
    rng = np.random.default_rng(3)
    reqs = [
        dec(f"d{i}", int(rng.integers(100, 900)), int(rng.integers(1, 50)), 400) for i in range(12)
    ]
    snap = Snapshot.build(reqs, kv=KVState(16, 2000, 2000 - 800))
    pol = bearsdk.bind_scheduler(
        "vllm-v1", {"max_num_batched_tokens": 512, "async_scheduling": False}
    )
    r = BEAEstimator(pol, bt, implementation=impl).estimate(snap, 3000, 10, explain=True)
    assert r.batches is not None
    assert len(r.batches) == 6  # 3000 prompt tokens, 500 per batch next to 12 decodes
    assert r.ttft_s == pytest.approx(sum(bt.time_of(b) for b in r.batches))
    assert all(b.duration_s == pytest.approx(bt.time_of(b)) for b in r.batches)
    plain = BEAEstimator(pol, BT, implementation=impl).estimate(snap, 3000, 10)
    assert r.ttft_s == pytest.approx(plain.ttft_s + 6 * BT.b1 * (1024 - 512))


def test_dense_floor_in_closed_form_decode_runs(impl: str) -> None:
    # Few decodes, memory-bound wait: the closed-form runs must price the floor too.
    snap = Snapshot.build([dec("a", 1000, 10, 200), dec("b", 300, 5, 60)], kv=KVState(16, 100, 15))
    pol = bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False})
    bt = BT.with_dense_floor(128)
    r = BEAEstimator(pol, bt, implementation=impl).estimate(snap, 600, 5, explain=True)
    assert r.batches is not None
    assert r.first_token_batch > 50
    assert r.ttft_s == pytest.approx(sum(bt.time_of(b) for b in r.batches), rel=1e-9)


@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0, 1]),
            st.integers(1, 300_000),
            st.integers(0, 300_050),
        ),
        min_size=1,
        max_size=32,
    ),
    counted=st.sampled_from([1, 2]),
)
def test_the_prefill_ahead_of_a_few_rows_is_numpys_sum(
    rows: list[tuple[int, int, int]], counted: int
) -> None:
    # A few rows are counted in exact integers, row by row; more with numpy.
    table = np.array(
        [(s, p, c if s == 0 else 0, 0, -1, 5, 0) for s, p, c in rows], dtype=np.int64
    ).reshape(len(rows), 7)
    snap = Snapshot(instance="x", seq=1, time=0.0, kv=None, ids=tuple(map(str, rows)), table=table)
    small = bea_module._prefill_of(snap, counted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bea_module, "_SMALL_TABLE", 0)
        assert bea_module._prefill_of(snap, counted) == small

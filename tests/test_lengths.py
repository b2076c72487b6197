"""Residents' output lengths: the router's own predictions, remembered by request id."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import bearsdk
from bearsdk.estimators import (
    BatchTimeModel,
    BEAEstimator,
    KnownLengths,
    MeanLengthPredictor,
    RememberedLengths,
    resolve_output_lengths,
)
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig
from bearsdk.selectors import BEAR
from bearsdk.snapshot import COL_OUTPUT_LEN, RequestState, Snapshot

BT = BatchTimeModel(0.005, 2e-5, 5e-8, 1e-10)
RID = "bear-0a1b2c3d-0000000001"


def running(rid: str, prompt: int, out: int, max_tokens: int | None = None) -> RequestState:
    return RequestState(rid, "running", prompt, prompt + out - 1, out, max_tokens)


def test_engine_decorated_ids_find_the_router_id() -> None:
    lengths = RememberedLengths()
    assert isinstance(lengths, KnownLengths)
    lengths.remember(RID, 700)
    ids = [f"chatcmpl-{RID}", f"cmpl-{RID}-0", RID, "chatcmpl-abc", "bear-0a1b2c3d-0000000002"]
    zeros = np.zeros(len(ids), dtype=np.int64)
    assert lengths.known_lengths(ids, zeros).tolist() == [700, 700, 700, -1, -1]
    lengths.forget(RID)
    assert lengths.known_lengths(ids, zeros).tolist() == [-1] * 5
    # An id chosen by the application is found when the engine keeps it as it is.
    lengths.remember("my-request", 40)
    assert lengths.known_lengths(["my-request"], zeros[:1]).tolist() == [40]


def test_mean_follows_the_remembered_predictions_and_memory_is_bounded() -> None:
    lengths = RememberedLengths(mean=256.0, capacity=3)
    for i, n in enumerate([100, 200, 300, 400]):
        lengths.remember(f"bear-ab-{i:010d}", n)
    assert lengths.mean == pytest.approx(250.0)
    assert len(lengths) == 3  # the oldest went
    ids = [f"bear-ab-{i:010d}" for i in range(4)]
    assert lengths.known_lengths(ids, np.zeros(4, np.int64)).tolist() == [-1, 200, 300, 400]
    with pytest.raises(ValueError, match=r"output_len must be >= 1 \(got 0\)"):
        lengths.remember("x", 0)


def test_known_length_used_while_ahead_of_the_output() -> None:
    lengths = RememberedLengths(mean=256.0, residual=64)
    lengths.remember("bear-ab-0000000001", 700)
    lengths.remember("bear-ab-0000000002", 700)
    lengths.remember("bear-ab-0000000003", 400)
    assert lengths.mean == pytest.approx(600.0)
    snap = Snapshot.build(
        [
            running("chatcmpl-bear-ab-0000000001", 100, 10),  # its own prediction
            running("chatcmpl-bear-ab-0000000002", 100, 800),  # outran it: output + residual
            running("chatcmpl-bear-ab-0000000003", 100, 10, max_tokens=300),  # capped
            running("chatcmpl-other", 100, 10),  # not the router's: the mean of its predictions
        ]
    )
    table = resolve_output_lengths(snap.table, lengths, snap.ids)
    assert table[:, COL_OUTPUT_LEN].tolist() == [700, 864, 300, 600]
    # Without ids the predictor's rule applies to every row.
    plain = resolve_output_lengths(snap.table, lengths)
    assert plain[:, COL_OUTPUT_LEN].tolist() == [600, 864, 300, 600]
    with pytest.raises(ValueError, match="ids: 1 ids for 4 rows"):
        resolve_output_lengths(snap.table, lengths, snap.ids[:1])


def test_a_frozen_table_knowing_every_length_is_returned_as_it_is() -> None:
    # A fast-forwarded view's table (rebuilt after every dispatch) knows them all:
    # read-only, it needs no copy; a writable one is still copied.
    known = RequestState("a", "running", 100, 109, 10, output_len=50)
    snap = Snapshot.build([known, RequestState("b", "waiting", 80, 0, 0, output_len=7)])
    lengths = MeanLengthPredictor(mean=256)
    assert resolve_output_lengths(snap.table, lengths) is snap.table
    writable = np.array(snap.table)
    got = resolve_output_lengths(writable, lengths)
    assert got is not writable
    assert got.tolist() == writable.tolist()
    empty = Snapshot.build([]).table
    assert resolve_output_lengths(empty, lengths) is empty
    # One unknown: a new array, the frozen one untouched.
    one = Snapshot.build([known, RequestState("c", "waiting", 80, 0, 0)])
    got = resolve_output_lengths(one.table, lengths)
    assert got is not one.table
    assert got[:, COL_OUTPUT_LEN].tolist() == [50, 256]
    assert one.table[1, COL_OUTPUT_LEN] == -1


@given(
    rows=st.lists(
        st.tuples(
            st.integers(1, 4000),
            st.integers(1, 3000),
            st.one_of(st.none(), st.integers(1, 3000)),
            st.one_of(st.none(), st.integers(1, 3000)),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_resolved_lengths_leave_a_token_and_respect_max_tokens(
    rows: list[tuple[int, int, int | None, int | None]],
) -> None:
    lengths = RememberedLengths(mean=256.0, residual=64)
    reqs = []
    for i, (prompt, out, cap, known) in enumerate(rows):
        rid = f"bear-ab-{i:010d}"
        if cap is not None:
            out = min(out, cap - 1) if cap > 1 else 0
        if out < 1:
            continue
        if known is not None:
            lengths.remember(rid, known)
        reqs.append(running(f"cmpl-{rid}-0", prompt, out, cap))
    if not reqs:
        return
    snap = Snapshot.build(reqs)
    got = resolve_output_lengths(snap.table, lengths, snap.ids)[:, COL_OUTPUT_LEN]
    for r, n in zip(reqs, got.tolist(), strict=True):
        assert n >= r.output_tokens + 1
        if r.max_tokens is not None:
            assert n <= r.max_tokens


def test_estimate_uses_the_remembered_length(impl: str) -> None:
    pol = bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False, "num_gpu_blocks": 120})
    lengths = RememberedLengths(mean=20.0)
    lengths.remember(RID, 900)
    est = BEAEstimator(pol, BT, lengths, implementation=impl)
    shown = Snapshot.build([running(f"chatcmpl-{RID}", 1000, 5)])
    explicit = Snapshot.build(
        [RequestState(f"chatcmpl-{RID}", "running", 1000, 1004, 5, None, 900)]
    )
    ref = BEAEstimator(pol, BT, MeanLengthPredictor(mean=20), implementation=impl)
    # KV memory frees only when the resident finishes: its length decides the wait.
    assert est.estimate(shown, 900, 5).ttft_s == pytest.approx(
        ref.estimate(explicit, 900, 5).ttft_s
    )
    # Not remembered: the prior mean (20 tokens) frees the memory much sooner.
    fresh = BEAEstimator(pol, BT, RememberedLengths(mean=20.0), implementation=impl)
    assert fresh.estimate(shown, 900, 5).ttft_s < 0.5 * est.estimate(shown, 900, 5).ttft_s


@pytest.mark.parametrize("mode", ["predicted", "calibrated"])
def test_router_remembers_what_it_sent_until_it_completes(mode: str) -> None:
    cfg = InstanceConfig(
        name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
    )
    router = AsyncRouter([cfg], BEAR(), resident_lengths=mode)  # type: ignore[arg-type]
    d = router.decide([{"role": "user", "content": "Write a long story about a bear."}])
    router.record_dispatch(d)
    lengths = router.state("a").estimator.length_predictor
    assert isinstance(lengths, RememberedLengths)
    assert lengths.calibrate is (mode == "calibrated")
    want = d.candidates[0].output_tokens
    sid, zero = [f"chatcmpl-{d.request_id}"], np.zeros(1, np.int64)
    assert lengths.known_lengths(sid, zero).tolist() == [want]
    router.record_complete(d, "a", usage={"completion_tokens": 321})
    assert lengths.known_lengths(sid, zero).tolist() == [-1]
    assert lengths.observed == (1 if mode == "calibrated" else 0)
    assert lengths.mean == pytest.approx(want)  # the first prediction replaces the prior


def test_router_rejects_an_unknown_length_mode() -> None:
    cfg = InstanceConfig(name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B")
    with pytest.raises(ConfigError, match="resident_lengths must be 'predicted' or 'calibrated'"):
        AsyncRouter([cfg], BEAR(), resident_lengths="mean")  # type: ignore[arg-type]


def _taught(pairs: list[tuple[int, int]], **kw: int) -> RememberedLengths:
    lengths = RememberedLengths(calibrate=True, **kw)  # type: ignore[arg-type]
    for i, (pred, true) in enumerate(pairs):
        rid = f"bear-ab-{i:010d}"
        lengths.remember(rid, pred)
        lengths.observe(rid, true)
    return lengths


def test_before_enough_completions_nothing_is_calibrated() -> None:
    lengths = _taught([(100, 400)] * 4, min_observed=5, window=8)
    lengths.remember(RID, 100)
    assert lengths.calibrated(100) == 100
    assert lengths.known_lengths([RID], np.zeros(1, np.int64)).tolist() == [100]
    assert lengths.predict_lengths(np.zeros(2, np.int64), np.array([0, 500])).tolist() == [
        100,
        564,
    ]


def test_quantile_mapping_corrects_scale_and_keeps_order() -> None:
    # The predictor is right about the order but off by a factor of 3.
    rng = np.random.default_rng(1)
    true = rng.integers(50, 2000, 400)
    lengths = _taught([(max(1, int(t) // 3), int(t)) for t in true], window=400)
    assert lengths.observed == 400
    assert abs(lengths.calibrated(200) - 600) <= 20
    ids = ["bear-cd-0000000001", "bear-cd-0000000002", "bear-cd-0000000003"]
    for rid, p in zip(ids, [30, 300, 600], strict=True):
        lengths.remember(rid, p)
    got = lengths.known_lengths(ids, np.zeros(3, np.int64))
    assert got[0] < got[1] < got[2]
    assert abs(got[1] - 900) <= 25
    # A resident past what its prediction maps to: a length beyond its output.
    past = lengths.known_lengths(ids[:1], np.array([1500]))
    assert 1500 < past[0] <= 2000


def test_unknown_residents_span_the_distribution_instead_of_its_mean() -> None:
    # Heavy-tailed lengths: most are short, a few very long. Giving every resident
    # the mean would have none of them finish early.
    true = [20] * 80 + [5000] * 20
    lengths = _taught([(100, t) for t in true], window=100)
    got = lengths.predict_lengths(np.zeros(50, np.int64), np.zeros(50, np.int64))
    assert 0.6 <= float(np.mean(got == 20)) <= 0.95
    assert (got == 5000).any()
    # Conditioned on the output: a resident past 20 tokens is one of the long ones.
    assert lengths.predict_lengths(np.zeros(3, np.int64), np.full(3, 21)).tolist() == [5000] * 3
    # Past everything seen: its output plus the residual.
    assert lengths.predict_lengths(np.zeros(1, np.int64), np.array([6000])).tolist() == [6064]
    with pytest.raises(ValueError, match=r"output_tokens must be >= 1 \(got 0\)"):
        lengths.observe("x", 0)
    with pytest.raises(ValueError, match="min_observed"):
        RememberedLengths(window=4, min_observed=8)


def test_without_calibration_completions_teach_nothing() -> None:
    lengths = RememberedLengths(min_observed=1, window=4)
    lengths.remember(RID, 50)
    lengths.observe(RID, 900)
    assert lengths.observed == 0
    assert len(lengths) == 0  # but the request is forgotten
    assert lengths.calibrated(50) == 50

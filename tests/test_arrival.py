"""A new request that arrives after the snapshot (``arrival_s``).

The replay runs the snapshot's requests on until the new request arrives; it
joins the waiting queue before the first batch scheduled at or after its
arrival, as fast-forward adds a dispatch. Checked here: the replay twins agree
batch for batch (the compiled loop's closed-form decode runs must stop short
of the arrival), a replay with an arrival equals fast-forwarding the snapshot
to then and replaying that, and the router's estimates from a kept view equal
those from one rebuilt at the decision.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_horizon_stops import _sized
from test_replay_property import COEFFS, MAX_BATCHES, builtin_policy, custom_policy, workload

from bearsdk.estimators import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.replay import implementations
from bearsdk.schedulers import BoundScheduler, bind_scheduler, compile_scheduler, scheduler_names
from bearsdk.snapshot import NCOLS, Snapshot
from bearsdk.state import FastForward

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IMPLS = sorted(implementations())


def _check_twins(pol: BoundScheduler, w: dict[str, Any], where: float) -> None:
    pol = _sized(pol, w)
    tw = compile_scheduler(pol, "python")
    prep = tw.prepare(w["table"])
    full = tw.replay(prep, w["prompt"], w["out"], COEFFS, record=True, max_batches=MAX_BATCHES)
    assert full.batches is not None
    span = sum(b.duration_s for b in full.batches) or 1.0
    arrival = where * span * 1.5
    ref = tw.replay(
        prep, w["prompt"], w["out"], COEFFS, record=True, max_batches=MAX_BATCHES, arrival_s=arrival
    )
    if "cython" not in IMPLS:
        return
    c = compile_scheduler(pol, "cython")
    for slow in (False, True):
        c.force_slow = slow
        try:
            cp = c.prepare(w["table"])
            got = c.replay(
                cp,
                w["prompt"],
                w["out"],
                COEFFS,
                record=True,
                max_batches=MAX_BATCHES,
                arrival_s=arrival,
            )
        finally:
            c.force_slow = False
        msg = f"slow={slow} arrival {arrival} policy {pol}"
        assert got.stop_reason == ref.stop_reason, msg
        assert got.first_token_batch == ref.first_token_batch, msg
        assert got.batches == ref.batches, msg
        if math.isfinite(ref.ttft_s):
            assert got.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9), msg
        if ref.stop_reason == "first-token":
            assert ref.ttft_s >= arrival, msg
            t = c.ttft(c.prepare(w["table"]), w["prompt"], w["out"], COEFFS, arrival_s=arrival)
            assert t == pytest.approx(ref.ttft_s, rel=1e-9), msg


@pytest.mark.parametrize("name", scheduler_names())
@SETTINGS
@given(data=st.data(), where=st.floats(0.0, 1.0))
def test_the_twins_agree_on_a_later_arrival_builtin(name: str, data: Any, where: float) -> None:
    pol = data.draw(builtin_policy(name))
    _check_twins(pol, data.draw(workload(pol)), where)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), where=st.floats(0.0, 1.0))
def test_the_twins_agree_on_a_later_arrival_custom(data: Any, where: float) -> None:
    pol = data.draw(custom_policy())
    _check_twins(pol, data.draw(workload(pol)), where)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "1", True, None])
def test_a_bad_arrival_is_refused_by_name(impl: str, bad: object) -> None:
    rp = compile_scheduler(bind_scheduler("vllm-v1"), impl)
    prep = rp.prepare(np.zeros((0, NCOLS), dtype=np.int64))
    with pytest.raises(ValueError, match="arrival_s"):
        rp.replay(prep, 10, 5, COEFFS, arrival_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arrival_s"):
        rp.ttft(prep, 10, 5, COEFFS, arrival_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", IMPLS)
def test_an_idle_engine_waits_for_the_arrival(impl: str) -> None:
    rp = compile_scheduler(bind_scheduler("vllm-v1"), impl)
    prep = rp.prepare(np.zeros((0, NCOLS), dtype=np.int64))
    now = rp.replay(prep, 100, 5, COEFFS)
    later = rp.replay(prep, 100, 5, COEFFS, arrival_s=0.25)
    assert later.batches == now.batches
    assert later.ttft_s == pytest.approx(0.25 + now.ttft_s, rel=1e-12)


MODEL = BatchTimeModel(0.003, 2e-5, 5e-8, 1e-10)


def _snapshot(rows: list[tuple[int, ...]], inflight: float | None) -> Snapshot:
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    ids = tuple(f"r{i}" for i in range(len(rows)))
    return Snapshot("x", 1, 0.0, None, ids, table, inflight_remaining_s=inflight)


@st.composite
def engine_state(draw: st.DrawFn) -> tuple[BEAEstimator, Snapshot]:
    params = {
        "max_num_batched_tokens": draw(st.sampled_from([256, 512, 2048])),
        "max_num_seqs": draw(st.sampled_from([8, 64])),
        "num_gpu_blocks": draw(st.sampled_from([0, 300, 4000])),
        "async_scheduling": draw(st.booleans()),
    }
    est = BEAEstimator.for_scheduler("vllm-v1", MODEL, params)
    rows: list[tuple[int, ...]] = []
    for _ in range(draw(st.integers(0, min(8, params["max_num_seqs"])))):
        p, o = draw(st.integers(16, 600)), draw(st.integers(1, 40))
        total = o + draw(st.integers(1, 60))
        ph = 1 if params["async_scheduling"] else 0
        rows.append((0, p, p + o - 1 + ph, o, -1, total, ph))
    for _ in range(draw(st.integers(0, 10))):
        rows.append((1, draw(st.integers(16, 1500)), 0, 0, -1, draw(st.integers(1, 60)), 0))
    inflight = draw(st.sampled_from([None, 0.004]))
    if not rows:
        inflight = None
    return est, _snapshot(rows, inflight)


@SETTINGS
@given(
    state=engine_state(),
    # Not 0: fast-forward to a batch's start (0 without a batch in flight) has it
    # scheduled without the new request, the replay with it; either is a
    # convention for an arrival exactly then, and no clock hits one.
    later=st.floats(1e-6, 0.4),
    prompt=st.integers(1, 1200),
    out=st.integers(1, 50),
)
def test_a_later_arrival_is_fast_forward_then_replay(
    state: tuple[BEAEstimator, Snapshot], later: float, prompt: int, out: int
) -> None:
    """Replaying the snapshot with the arrival = fast-forwarding it to the arrival
    and replaying the view there (fast-forward with the replay's own times)."""
    est, snap = state
    ff = FastForward(snap, est, captured=0.0)
    ff.advance(later, [])
    view = ff.at(later)
    rebuilt = est.ttft(est.prepare(view), prompt, out)
    kept = est.ttft(est.prepare(snap), prompt, out, arrival_s=later)
    if math.isinf(rebuilt):
        assert math.isinf(kept)
    else:
        assert kept == pytest.approx(rebuilt, rel=1e-9, abs=1e-12)

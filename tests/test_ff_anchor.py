"""Fast-forward anchored on the first tokens the router sees (``FastForward.first_token``).

A first token marks the end of an engine batch. Where the batch-time model runs
the virtual engine faster or slower than the engine, the anchor moves its clock
so that the view is where the engine is, not where the model put it.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.snapshot import Snapshot, snapshot_from_dict
from bearsdk.state.cache import SnapshotCache
from bearsdk.state.fastforward import STEP_TOLERANCE_S, FastForward
from bearsdk.state.instance import InstanceState, StalenessRules
from bearsdk.state.overlay import Dispatch

BT = BatchTimeModel(4e-3, 2.2e-5, 5e-8, 1.2e-10)
PARAMS = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "num_gpu_blocks": 4000}
T0 = 100.0


def _snapshot() -> Snapshot:
    rows = [
        {
            "id": f"r{i}",
            "state": "running",
            "prompt_tokens": 400,
            "computed_tokens": 400 + 10 * i,
            "output_tokens": 10 * i + 1,
            "output_len": 200,
        }
        for i in range(6)
    ]
    rows += [
        {
            "id": "w0",
            "state": "waiting",
            "prompt_tokens": 900,
            "computed_tokens": 0,
            "output_tokens": 0,
            "output_len": 50,
        }
    ]
    return snapshot_from_dict(
        {"schema": "bear.snapshot/1", "instance": "x", "seq": 1, "time": T0, "requests": rows}
    )


def _ff() -> FastForward:
    est = BEAEstimator.for_scheduler("vllm-v1", BT, PARAMS)
    return FastForward(_snapshot(), est, captured=T0)


def _sent() -> list[Dispatch]:
    # Sent at capture: it joins before the first batch, on any clock.
    return [Dispatch("bear-1", T0, 700, 30, None)]


def _first_token_time() -> float:
    """When the virtual engine, unanchored, gives bear-1 its first token (after capture)."""
    probe = _ff()
    probe.advance(T0, _sent())
    assert probe.first_token("bear-1", 0.0)
    return -probe.lag


def _rows(ff: FastForward, now: float) -> tuple[tuple[str, ...], list[list[int]]]:
    snap = ff.at(now)
    return snap.ids, np.asarray(snap.table).tolist()


def test_a_slower_engine_holds_the_view_back_by_its_lag() -> None:
    t_hat = _first_token_time()
    assert t_hat > 0.01
    late = 0.02
    ff = _ff()
    ff.advance(T0 + t_hat + late, _sent())  # the view ran past the token already
    assert ff.first_token("bear-1", t_hat + late)
    assert math.isclose(ff.lag, late, abs_tol=1e-12)
    # Batches that the engine has not run were simulated: the view is rebuilt
    # on the anchored clock, and then is where the engine is.
    assert ff.overran
    rebuilt = FastForward(ff.snapshot, ff.estimator, T0, lag=ff.lag)
    free = _ff()
    for x in (0.0005, 0.013, 0.04):
        rebuilt.advance(T0 + t_hat + late + x, _sent())
        free.advance(T0 + t_hat + x, _sent())
        assert _rows(rebuilt, T0 + t_hat + late + x) == _rows(free, T0 + t_hat + x)


def test_a_view_anchored_as_the_token_comes_has_nothing_to_take_back() -> None:
    t_hat = _first_token_time()
    ff = _ff()
    ff.advance(T0 + t_hat, _sent())
    assert ff.first_token("bear-1", t_hat + 0.01)
    assert not ff.overran
    free = _ff()
    ff.advance(T0 + t_hat + 0.01 + 0.02, _sent())
    free.advance(T0 + t_hat + 0.02, _sent())
    assert _rows(ff, T0 + t_hat + 0.03) == _rows(free, T0 + t_hat + 0.02)


def test_a_faster_engine_runs_the_view_on_to_its_token() -> None:
    t_hat = _first_token_time()
    early = 0.008
    ff = _ff()
    ff.advance(T0 + t_hat - early - 0.001, _sent())  # not there yet
    assert ff.first_token("bear-1", t_hat - early)
    assert math.isclose(ff.lag, -early, abs_tol=1e-12)
    assert not ff.overran
    free = _ff()
    for x in (0.0007, 0.011, 0.05):
        ff.advance(T0 + t_hat - early + x, _sent())
        free.advance(T0 + t_hat + x, _sent())
        assert _rows(ff, T0 + t_hat - early + x) == _rows(free, T0 + t_hat + x)


def test_a_snapshot_request_anchors_by_the_id_it_is_embedded_in() -> None:
    # The waiting resident w0 gets its first token in the virtual engine too;
    # the router knows it by the id the engine embeds ("w0" in "w0").
    ff = _ff()
    ff.advance(T0 + 5.0, [])
    assert ff.first_token("w0", 5.0)
    assert ff.lag > 0


def test_a_token_the_view_cannot_reach_anchors_nothing_and_is_taken_back() -> None:
    import bearsdk.state.fastforward as ffmod

    ff = _ff()
    ff.advance(T0 + 0.001, _sent())
    was = ffmod.MAX_ANCHOR_BATCHES
    ffmod.MAX_ANCHOR_BATCHES = 1  # bear-1's prompt needs two batches of 512 tokens
    try:
        assert not ff.first_token("bear-1", 0.002)
    finally:
        ffmod.MAX_ANCHOR_BATCHES = was
    assert ff.lag == 0.0
    assert ff.overran  # it ran on for nothing: the instance rebuilds it


def test_what_the_view_cannot_place_anchors_nothing() -> None:
    ff = _ff()
    ff.advance(T0 + 0.05, _sent())
    # Not a request of the view; a resident decoding since before the capture.
    assert not ff.first_token("bear-unknown", 0.04)
    assert not ff.first_token("r3", 0.04)
    assert ff.lag == 0.0


def _state(clock: list[float], anchor: bool = True, steps: bool = True) -> InstanceState:
    cache = SnapshotCache("x", clock=lambda: clock[0], max_transit_s=math.inf)
    est = BEAEstimator.for_scheduler("vllm-v1", BT, PARAMS)
    rules = StalenessRules(
        fast_forward_after_s=0.001, refresh_s=0.0, anchor=anchor, anchor_steps=steps
    )
    st = InstanceState(cache, est, rules=rules)
    cache.offer(_snapshot(), received=T0)
    st.on_dispatch("bear-1", 700, 30, now=T0)
    return st


def test_the_instance_anchors_its_view_on_the_routers_first_tokens() -> None:
    t_hat = _first_token_time()
    late = 0.03
    now = T0 + t_hat + late + 0.0023
    clock = [now]
    anchored = _state(clock)
    anchored.ttft(200, 10)  # a view on the model's clock, further on than the engine
    anchored.on_tokens("bear-1", 1, at=T0 + t_hat + late)
    got = anchored.ttft(200, 10)
    assert got.mode == "fast-forward"
    # The engine runs 30 ms behind the model: the view is where an unanchored
    # one is 30 ms earlier, the new request arriving as late.
    behind = [now - late]
    free = _state(behind)
    want = free.ttft(200, 10)
    assert got.ttft_s == pytest.approx(want.ttft_s, rel=1e-9)
    # A snapshot captured after the token starts a view with no anchor.
    snap = attrs.evolve(_snapshot(), seq=2, time=T0 + t_hat + late + 0.001)
    anchored.cache.offer(snap, received=now)
    clock[0] = now + 0.01
    assert anchored.ttft(200, 10).ttft_s > 0


def test_anchoring_on_first_tokens_is_off_by_default() -> None:
    assert not StalenessRules().anchor
    t_hat = _first_token_time()
    now = T0 + t_hat + 0.0323
    plain = _state([now], anchor=False, steps=False)
    plain.ttft(200, 10)
    plain.on_tokens("bear-1", 1, at=T0 + t_hat + 0.03)
    plain.on_step_end(T0 + t_hat + 0.031)
    want = _state([now], anchor=False, steps=False).ttft(200, 10).ttft_s
    assert plain.ttft(200, 10).ttft_s == want


# ---------------------------------------------------------------- step ends


def _virtual_end(ff: FastForward, now: float) -> float:
    """When the batch in flight in ``ff``'s view at ``now`` ends, seconds after capture."""
    remaining = ff.at(now).inflight_remaining_s
    assert remaining is not None
    assert remaining > 0.0
    return now - ff.captured - ff.lag + remaining


def _step_ends() -> tuple[float, float]:
    """Two successive step ends of the unanchored virtual engine, after capture."""
    probe = _ff()
    probe.advance(T0 + 0.0405, _sent())
    first = _virtual_end(probe, T0 + 0.0405)
    probe.advance(T0 + first + 1e-6, _sent())
    return first, _virtual_end(probe, T0 + first + 1e-6)


@pytest.mark.parametrize("shift", [0.0021, -0.0017])
def test_a_step_end_places_the_batch_in_flight_where_the_engines_ends(shift: float) -> None:
    _, end = _step_ends()
    now = T0 + end + 0.003  # the engine's last step end is past, the view's too
    ff = _ff()
    ff.advance(now, _sent())
    # The engine's step ended ``shift`` later (or earlier) than the model's:
    # the nearest virtual end moves there.
    assert ff.step_offset(end + shift) == pytest.approx(shift, abs=1e-12)
    assert ff.step_end(end + shift, now)
    assert math.isclose(ff.lag, shift, abs_tol=1e-12)
    assert not ff.overran  # the view's batch in flight began before the new clock's now
    free = _ff()
    for x in (0.0, 0.004, 0.02):
        ff.advance(now + x, _sent())
        free.advance(now - shift + x, _sent())
        assert _rows(ff, now + x) == _rows(free, now - shift + x)
        got = ff.at(now + x).inflight_remaining_s
        assert got == pytest.approx(free.at(now - shift + x).inflight_remaining_s, abs=1e-12)


def test_a_step_end_nearer_an_earlier_step_takes_back_what_the_view_ran_past() -> None:
    first, second = _step_ends()
    now = T0 + second + 0.001
    ff = _ff()
    ff.advance(now, _sent())
    # Nearer the first end than the second: the engine is still in the step the
    # view finished, and the view had begun the next.
    at = first + 0.4 * (second - first)
    assert ff.step_end(at, now)
    assert math.isclose(ff.lag, at - first, abs_tol=1e-12)
    assert ff.overran
    # An exact one moves nothing.
    again = _ff()
    again.advance(now, _sent())
    assert not again.step_end(second, now)
    assert again.lag == 0.0
    assert not again.overran


@pytest.mark.parametrize("at", [math.nan, math.inf, -math.inf, -0.001])
def test_a_step_end_that_is_no_time_after_capture_moves_nothing(at: float) -> None:
    ff = _ff()
    ff.advance(T0 + 0.03, _sent())
    before = _rows(ff, T0 + 0.03)
    assert not ff.step_end(at, T0 + 0.03)
    assert ff.lag == 0.0
    assert not ff.overran
    assert _rows(ff, T0 + 0.03) == before


def test_the_instance_places_its_view_on_the_step_ends_it_is_told() -> None:
    _, second = _step_ends()
    now = T0 + second + 0.003
    end = T0 + second
    shift = -0.0013  # the engine is 1.3 ms ahead of the model
    clock = [now]
    placed = _state(clock, anchor=False)
    placed.ttft(200, 10)
    placed.on_step_end(end + shift)
    got = placed.ttft(200, 10)
    assert got.mode == "fast-forward"
    ahead = _state([now - shift], anchor=False, steps=False)
    assert got.ttft_s == pytest.approx(ahead.ttft(200, 10).ttft_s, rel=1e-9)
    # A step end that agrees with the kept view to within the tolerance keeps it.
    kept = _state([now], anchor=False)
    want = kept.ttft(200, 10).ttft_s
    kept.on_step_end(end + STEP_TOLERANCE_S / 2)
    assert kept.ttft(200, 10).ttft_s == want
    # Not with the rule off, nor from a time that is none.
    off = _state([now], anchor=False, steps=False)
    off.on_step_end(end + shift)
    assert off.ttft(200, 10).ttft_s == _state([now], anchor=False, steps=False).ttft(200, 10).ttft_s
    assert StalenessRules().anchor_steps
    bad = _state([now], anchor=False)
    for at in (math.nan, math.inf):
        bad.on_step_end(at)
    assert bad.ttft(200, 10).ttft_s == _state([now], anchor=False).ttft(200, 10).ttft_s


def test_a_dispatch_to_an_idle_engine_is_served_after_its_clock_moved_back() -> None:
    # An idle virtual engine whose clock a step end moved back (the engine runs
    # behind the model): a dispatch added then was left waiting for an arrival
    # that had already come, and anchoring on its first token ran the clock to
    # infinity and the next advance forever (found by tests/test_ff_patch.py).
    doc = {
        "schema": "bear.snapshot/1",
        "instance": "x",
        "seq": 1,
        "time": T0,
        "requests": [],
        "inflight": {"remaining_s": 0.003},
        "kv": {"block_size": 16, "num_blocks": 3000, "free_blocks": 3000},
    }
    est = BEAEstimator.for_scheduler("vllm-v1", BT, {"max_num_batched_tokens": 2048})
    ff = FastForward(snapshot_from_dict(doc), est, captured=T0)
    now = T0 + 0.0376
    ff.advance(now, [])  # idle
    assert ff.step_end(now - T0 + 0.0004, now)
    assert ff.lag > 0.03  # the engine is behind: "now" is earlier on the virtual clock
    sent = [Dispatch("bear-1", now, 669, 2, None)]
    ff.advance(now, sent)
    later = now + 0.05
    ff.advance(later, sent)
    view = ff.at(later)
    assert view.ids == ("bear-1",)
    assert view.table[0].tolist()[:3] == [0, 669, 669]  # running, prefilled: not stranded
    assert ff.first_token("bear-1", later - T0, later)
    assert math.isfinite(ff.lag)
    ff.advance(later + 0.01, sent)  # (it never returned)

"""Self-calibration: an instance's speed learned from its successive snapshots."""

from __future__ import annotations

import logging
import math
import random

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.emulator.timing import GroundTruthTimeModel
from bearsdk.estimators.batch_model import BatchTimeModel
from bearsdk.estimators.profiles import load_profile
from bearsdk.router import Decision, InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.router.slot import OVERHEAD_MAX_S, OVERHEAD_MEMORY_S
from bearsdk.sim.engine import BatchNoise, SimEngine, bind_engine
from bearsdk.snapshot import NCOLS, Snapshot
from bearsdk.state.speed import SpeedInterval, SpeedTracker, interval_evidence

PROFILE = "qwen3-8b-h100"


def _engine(
    profile: str, scale: float, changes: tuple[tuple[float, float], ...] = ()
) -> tuple[SimEngine, int]:
    em = bind_engine(profile, "vllm-v1", {})
    params = attrs.evolve(em.time_model.params, time_scale=scale)
    tm = GroundTruthTimeModel(em.profile, params, 0)
    eng = SimEngine(
        "e",
        em.policy,
        em.max_model_len,
        tm,
        BatchNoise(tm.params, 3),
        log_batches=True,
        decode_runs=False,
        speed_changes=changes,
    )
    return eng, em.policy.token_budget


def _stream(eng: SimEngine, n: int, rate: float, seed: int = 1):
    """Poisson arrivals; yields (snapshot, batches started) at each arrival."""
    rng = random.Random(seed)
    t = 0.0
    for k in range(n):
        t += rng.expovariate(rate)
        eng.advance(t)
        yield eng.snapshot(), eng.batches
        eng.add_request(
            f"r{k}",
            min(8000, int(rng.lognormvariate(6.5, 1.0))),
            1 + int(rng.lognormvariate(5, 0.8)),
            t,
        )


@pytest.mark.parametrize("rate", [1.0, 6.0])
def test_the_evidence_prices_exactly_the_batches_that_ran(rate: float) -> None:
    eng, budget = _engine(PROFILE, 1.0)
    prof = load_profile(PROFILE)
    obs = true = pred = exact = 0.0
    steps_ok = intervals = 0
    prev = None
    for snap, nb in _stream(eng, 600, rate):
        if prev is not None:
            iv = interval_evidence(prev[0], snap, prof, budget)
            if iv is not None:
                feats, y = eng.batch_log()
                f, yy = feats[prev[1] : nb], y[prev[1] : nb]
                obs += iv.observed_s
                true += float(yy.sum())
                pred += iv.predicted_s
                exact += float(prof.predict(f).sum())
                steps_ok += iv.steps == nb - prev[1]
                intervals += 1
                assert math.isclose(sum(iv.terms), iv.predicted_s, rel_tol=1e-12)
        prev = (snap, nb)
    assert intervals > 100
    # The step count is exact, the time spans exactly those batches, and eq. 12
    # prices the reconstructed work within 2% of the batches' own compositions.
    assert steps_ok == intervals
    assert obs == pytest.approx(true, rel=1e-9)
    assert pred == pytest.approx(exact, rel=0.02)


def test_the_factor_is_the_ratio_of_true_speeds() -> None:
    prof = load_profile(PROFILE)
    factors = {}
    for scale in (1.0, 2.0):
        eng, budget = _engine(PROFILE, scale)
        tr = SpeedTracker(prof, memory_s=1e6)
        prev = None
        # Arrivals slowed with the hardware: the same batches, each `scale` x longer.
        for snap, _ in _stream(eng, 500, 4.0 / scale):
            if prev is not None and (iv := interval_evidence(prev, snap, prof, budget)):
                tr.observe(iv, snap.time)
            prev = snap
        est = tr.estimate(prev.time if prev else None)
        assert est.intervals > 100
        assert est.stderr < 0.05
        factors[scale] = tr.factor
    # (Not to the last digit: the prior's pseudo-evidence at factor 1 remains.)
    assert factors[2.0] / factors[1.0] == pytest.approx(2.0, rel=1e-3)


def test_a_step_change_is_tracked_within_ten_seconds() -> None:
    prof = load_profile(PROFILE)
    eng, budget = _engine(PROFILE, 1.0, changes=((60.0, 2.0),))
    tr = SpeedTracker(prof)
    prev = None
    before = after = None
    for snap, _ in _stream(eng, 700, 6.0):
        if prev is not None and (iv := interval_evidence(prev, snap, prof, budget)):
            tr.observe(iv, snap.time)
        if before is None and snap.time >= 59.0:
            before = tr.factor
        if after is None and snap.time >= 70.0:
            after = tr.factor
        prev = snap
    assert before is not None
    assert after is not None
    assert after / before == pytest.approx(2.0, rel=0.10)


def _snap(
    rows: list[tuple[int, ...]],
    *,
    seq: int,
    time: float,
    ids: list[str] | None = None,
    epoch: str | None = "e1",
) -> Snapshot:
    ids = ids or [f"r{i}" for i in range(len(rows))]
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    return Snapshot("x", seq, time, None, tuple(ids), table, None, epoch)


def _decoding(prompt: int, computed: int, out: int) -> tuple[int, ...]:
    return (0, prompt, computed, out, -1, -1, 0)


MODEL = BatchTimeModel(5e-3, 5e-5, 1e-8, 1e-10)


def test_a_pair_without_evidence_says_nothing() -> None:
    a = _snap([_decoding(100, 110, 10)], seq=5, time=1.0)
    b = _snap([_decoding(100, 120, 20)], seq=15, time=1.2)
    assert interval_evidence(a, b, MODEL, 2048) is not None
    # Another engine run, a clock that did not advance, an older seq.
    assert interval_evidence(a, attrs.evolve(b, epoch="e2"), MODEL, 2048) is None
    assert interval_evidence(a, attrs.evolve(b, time=1.0), MODEL, 2048) is None
    assert interval_evidence(a, attrs.evolve(b, seq=5), MODEL, 2048) is None
    # Nobody decoded throughout (the engine may have idled in between).
    c = _snap([_decoding(100, 130, 30)], seq=25, time=9.0, ids=["other"])
    assert interval_evidence(b, c, MODEL, 2048) is None
    # One step is not a stretch; 10,000 steps in 0.1 s are not physical.
    d = _snap([_decoding(100, 121, 21)], seq=16, time=1.3)
    assert interval_evidence(b, d, MODEL, 2048) is None
    e = _snap([_decoding(100, 10_120, 10_020)], seq=9_999, time=1.3)
    assert interval_evidence(b, e, MODEL, 2048) is None


def test_the_work_of_a_pair_is_what_eq12_prices() -> None:
    # Two decoding requests for 10 steps; a third arrives and prefills 512 tokens.
    a = _snap([_decoding(100, 110, 10), _decoding(200, 250, 50)], seq=1, time=0.0)
    b = _snap(
        [_decoding(100, 120, 20), _decoding(200, 260, 60), (0, 512, 512, 1, -1, -1, 0)],
        seq=11,
        time=0.5,
        ids=["r0", "r1", "new"],
    )
    iv = interval_evidence(a, b, MODEL, 2048)
    assert iv is not None
    assert (iv.steps, iv.prefill_tokens, iv.decode_tokens) == (10, 512, 20)
    # Each decode attends its context and itself (decode_keys="attended").
    ctx = (10 * 110 + 45) + (10 * 250 + 45) + 20
    att = 512 * 513 // 2
    # One step carries the prefill (512 + 2 tokens), nine carry 2 decodes each.
    dense = (512 + 2) + 9 * 2
    expect = 10 * MODEL.b0 + MODEL.b1 * dense + MODEL.b2 * ctx + MODEL.b3 * att
    assert iv.predicted_s == pytest.approx(expect, rel=1e-12)
    assert iv.observed_s == 0.5


def test_the_tracker_refuses_what_cannot_be() -> None:
    tr = SpeedTracker(MODEL, warmup_s=0.5)
    for k in range(20):
        assert tr.observe(SpeedInterval(10, 0.2, 0.1, 0, 10, (0.1, 0.0, 0.0, 0.0)), k * 0.2)
    assert tr.factor == pytest.approx(2.0, rel=0.01)
    assert not tr.observe(SpeedInterval(10, math.nan, 0.1, 0, 10), 5.0)
    assert not tr.observe(SpeedInterval(10, 20.0, 0.1, 0, 10), 5.0)  # 100x: absurd
    assert tr.rejected == {"non-finite": 1, "absurd": 1}
    assert tr.factor == pytest.approx(2.0, rel=0.01)
    # Unobserved, the factor holds and its uncertainty grows.
    e1, e2 = tr.estimate(4.0), tr.estimate(40.0)
    assert e1.factor == e2.factor
    assert e2.stderr > e1.stderr
    assert e1.describe("a").startswith("a runs 1.99x slower than its profile")
    with pytest.raises(ValueError, match="memory_s"):
        SpeedTracker(MODEL, memory_s=0)
    with pytest.raises(ValueError, match="min_factor"):
        SpeedTracker(MODEL, min_factor=2.0, max_factor=1.0)


def test_a_new_base_prices_the_evidence_again_rather_than_dropping_it() -> None:
    # The snapshots showed the engine 2x slower; an online fit that lags says
    # 1.5x so far: the model stays 2x (factor 2 / 1.5), not back to 1.5x.
    tr = SpeedTracker(MODEL, per_term=False)
    for k in range(30):
        assert tr.observe(SpeedInterval(10, 0.2, 0.1, 0, 10, (0.02, 0.08, 0.0, 0.0)), k * 0.2)
    assert tr.factor == pytest.approx(2.0, rel=0.01)
    f, err, model = tr.factor, tr.stderr, tr.model
    lagging = attrs.evolve(MODEL, b0=1.5 * MODEL.b0, b1=1.5 * MODEL.b1)
    tr.rebase(lagging)
    assert tr.base is lagging
    assert tr.factor == pytest.approx(f / 1.5, rel=1e-9)
    assert tr.stderr == pytest.approx(err / 1.5, rel=1e-6)
    # The terms the evidence priced are what they were (one factor for all:
    # those it never saw follow it).
    assert tr.model.b0 == pytest.approx(model.b0, rel=1e-9)
    assert tr.model.b1 == pytest.approx(model.b1, rel=1e-9)
    # One term only moved: the evidence's own mix decides (here 20 % per batch).
    tr.rebase(attrs.evolve(lagging, b0=3 * lagging.b0))
    assert tr.factor == pytest.approx(f / 1.5 / (0.2 * 3 + 0.8), rel=1e-9)
    # Without evidence, or priced at nothing, it starts over.
    fresh = SpeedTracker(MODEL)
    fresh.rebase(lagging)
    assert fresh.factor == 1.0
    tr.rebase(attrs.evolve(MODEL, b0=0.0, b1=0.0))
    assert tr.factor == 1.0


def test_per_term_factors_separate_what_the_evidence_separates() -> None:
    # Decode-only stretches run 2x slow on the per-batch term, prefill stretches
    # are exact on the dense term: one overall factor would misprice both.
    tr = SpeedTracker(MODEL, memory_s=1e6)
    rng = random.Random(0)
    for k in range(400):
        t0, t1 = rng.uniform(0.01, 0.1), rng.uniform(0.0, 0.1)
        obs = 2.0 * t0 + 1.0 * t1
        tr.observe(SpeedInterval(10, obs, t0 + t1, 0, 10, (t0, t1, 0.0, 0.0)), float(k))
    f0, f1, f2, f3 = tr.term_factors
    assert f0 == pytest.approx(2.0, rel=0.03)
    assert f1 == pytest.approx(1.0, rel=0.05)
    # Terms with no evidence keep the overall factor.
    assert f2 == f3 == pytest.approx(tr.factor)
    m = tr.model
    assert m.b0 == pytest.approx(MODEL.b0 * f0)
    assert m.dense_floor_tokens == MODEL.dense_floor_tokens


_count = st.integers(min_value=0, max_value=1 << 40)
_row = st.tuples(
    st.integers(0, 1),
    _count,
    _count,
    _count,
    st.integers(-1, 1 << 40),
    st.integers(-1, 1 << 40),
    st.integers(0, 1 << 20),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_row, max_size=6),
    st.lists(_row, max_size=6),
    st.floats(-1e9, 1e9),
    st.floats(-1e9, 1e9),
    st.integers(0, 3),
)
def test_any_pair_of_valid_snapshots_gives_finite_evidence_or_none(
    ra: list[tuple[int, ...]], rb: list[tuple[int, ...]], ta: float, tb: float, shift: int
) -> None:
    a = _snap(ra, seq=1, time=ta, ids=[f"q{i}" for i in range(len(ra))])
    b = _snap(rb, seq=2, time=tb, ids=[f"q{i + shift}" for i in range(len(rb))])
    iv = interval_evidence(a, b, MODEL, 2048)
    if iv is not None:
        assert iv.steps >= 2
        assert math.isfinite(iv.observed_s)
        assert iv.observed_s > 0
        assert math.isfinite(iv.predicted_s)
        assert iv.predicted_s > 0
        tr = SpeedTracker(MODEL)
        tr.observe(iv, 1.0)
        assert math.isfinite(tr.factor)
        assert tr.min_factor <= tr.factor <= tr.max_factor


def _core(speed: bool = True) -> RouterCore:
    cfg = InstanceConfig(name="a", url="http://a", model="Qwen/Qwen3-8B", profile=PROFILE)
    if speed:
        return RouterCore([cfg], clock=lambda: 0.0)
    return RouterCore([cfg], clock=lambda: 0.0, speed=None)


@pytest.mark.parametrize("learn", [True, False])
def test_the_router_replays_with_the_learned_speed(learn: bool) -> None:
    core = _core(learn)
    eng, _ = _engine(PROFILE, 2.0)
    base = core.slot("a").batch_time
    for snap, _ in _stream(eng, 300, 4.0):
        core.cache("a").offer(attrs.evolve(snap, instance="a"))
    est = core.state("a").estimator
    sp = core.speed("a")
    if not learn:
        assert sp is None
        assert est.batch_time is base
        assert core.decide("hello there", ttft_target=1.0).chosen.speed_factor == 1.0
        return
    assert sp is not None
    assert sp.intervals > 50
    assert 1.6 < sp.factor < 2.6
    # The replay uses the tracker's model (refreshed every few stretches).
    f0 = core.slot("a").speed.term_factors[0]
    assert est.batch_time.b0 == pytest.approx(base.b0 * f0, rel=0.02)
    # Decisions show what priced them.
    d = core.decide("hello there", ttft_target=1.0)
    assert d.chosen.speed_factor == pytest.approx(sp.factor, rel=0.05)
    assert f"speed x{d.chosen.speed_factor:.2f}" in d.explain()
    # New base coefficients (an online fit): the evidence is priced again with
    # them, so the model it learned stays what it was.
    core.rebase("a", base)
    assert core.speed("a").factor == pytest.approx(sp.factor, rel=1e-9)
    before = est.batch_time
    # (Half the times: every factor doubles, none meets the floor of 1.)
    half = attrs.evolve(base, b0=base.b0 / 2, b1=base.b1 / 2, b2=base.b2 / 2, b3=base.b3 / 2)
    core.rebase("a", half)
    assert core.speed("a").factor == pytest.approx(sp.factor * 2, rel=1e-9)
    for a, b in zip(est.batch_time.coeffs, before.coeffs, strict=True):
        assert a == pytest.approx(b, rel=1e-9)


def test_a_failing_listener_costs_no_snapshot(caplog: pytest.LogCaptureFixture) -> None:
    core = _core()
    cache = core.cache("a")

    def boom(prev: object, new: object) -> None:
        raise RuntimeError("listener bug")

    cache.on_accept = boom
    a = _snap([_decoding(100, 110, 10)], seq=1, time=1.0)
    with caplog.at_level(logging.WARNING, logger="bearsdk.state.cache"):
        assert cache.offer(attrs.evolve(a, instance="a"))
    assert cache.entry is not None
    assert cache.entry.snapshot.seq == 1
    assert "on_accept raised" in caplog.text


def test_the_overhead_is_bounded_by_the_fastest_first_token_and_fades() -> None:
    cfg = InstanceConfig(name="a", url="http://a", model="Qwen/Qwen3-8B", profile=PROFILE)
    clock = [10.0]
    core = RouterCore([cfg], clock=lambda: clock[0])
    seq = iter(range(1, 1000))

    def decide() -> Decision:
        # A fresh snapshot each time: the estimate is a replay, which the overhead joins.
        snap = _snap([_decoding(100, 110, 10)], seq=next(seq), time=clock[0])
        assert core.cache("a").offer(attrs.evolve(snap, instance="a"), received=clock[0])
        d = core.decide("hello there", ttft_target=5.0)
        assert d.chosen.estimator in ("bea", "overlay")
        core.record_dispatch(d)
        return d

    # A slow first token alone would make the overhead its whole residual: held
    # to the cap.
    d = decide()
    core.record_first_token(d, "a", 2.0)
    assert core.overhead("a") == OVERHEAD_MAX_S
    assert decide().chosen.overhead_s == OVERHEAD_MAX_S
    for _ in range(3):
        core.record_first_token(decide(), "a", 2.0)
    # No fixed cost of every first token exceeds the fastest first token seen,
    # though the median residual is still the slow ones'.
    core.record_first_token(decide(), "a", 0.03)
    assert core.overhead("a") == 0.03
    learned = core.overhead("a")
    # Unconfirmed, it fades: an instance the router stopped choosing is not
    # locked out by what it learned once.
    clock[0] += OVERHEAD_MEMORY_S
    assert core.overhead("a") == pytest.approx(learned / math.e, rel=1e-9)
    clock[0] += 10 * OVERHEAD_MEMORY_S
    late = decide()
    assert late.chosen.overhead_s < learned * 1e-4
    # After that long, a new first token starts the residuals over (the old,
    # larger ones do not come back through the median).
    core.record_first_token(late, "a", late.chosen.ttft_s + 0.004)
    assert core.overhead("a") == pytest.approx(0.004, abs=1e-6)

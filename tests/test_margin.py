"""The TTFT margin: conformal widening of BEA's estimates by each instance's first tokens."""

from __future__ import annotations

import logging
import math

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.router import Decision, InstanceConfig, TtftMargin
from bearsdk.router.core import RouterCore
from bearsdk.router.margin import MarginTracker
from bearsdk.snapshot import NCOLS, Snapshot

PROFILE = "qwen3-8b-h100"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("quantile", 0.3),
        ("quantile", 1.0),
        ("quantile", math.nan),
        ("window", 0),
        ("window", True),
        ("min_samples", 1.5),
        ("max_margin", 0.9),
        ("max_margin", True),
        ("quantile", False),
        ("memory_s", True),
        ("max_margin", 11.0),
        ("memory_s", 0.0),
        ("memory_s", math.inf),
    ],
)
def test_bad_settings_name_the_field_and_the_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"ttft margin: {field} must .*\(got {value!r}\)"):
        TtftMargin(**{field: value})  # type: ignore[arg-type]


def test_min_samples_cannot_exceed_the_window() -> None:
    with pytest.raises(ValueError, match=r"min_samples must be <= window \(got 20 > 10\)"):
        TtftMargin(window=10, min_samples=20)


def _fed(ratios: list[float], cfg: TtftMargin, now: float = 1.0) -> MarginTracker:
    tr = cfg.tracker()
    for r in ratios:
        tr.observe(0.1 * r, 0.1, now)
    return tr


@settings(max_examples=200, deadline=None)
@given(
    ratios=st.lists(st.floats(0.2, 4.0), min_size=0, max_size=80),
    q=st.sampled_from([0.5, 0.8, 0.9, 0.99]),
)
def test_the_margin_is_the_conformal_bound_of_the_latest_ratios(
    ratios: list[float], q: float
) -> None:
    cfg = TtftMargin(quantile=q, window=32, min_samples=4, max_margin=3.0)
    tr = _fed(ratios, cfg)
    kept = [min(max(r, 1 / 3.0), 3.0) for r in ratios[-32:]]
    if len(kept) < 4:
        assert tr.value(1.0) == 1.0
        return
    # The ceil((n + 1) q)-th smallest: a fresh exchangeable ratio exceeds it
    # with probability at most 1 - q.
    k = min(math.ceil((len(kept) + 1) * q), len(kept))
    want = min(max(sorted(kept)[k - 1], 1.0), 3.0)
    assert tr.value(1.0) == pytest.approx(want, rel=1e-12)
    assert 1.0 <= tr.value(1.0) <= 3.0
    assert tr.samples == len(kept)


def test_it_covers_the_share_it_was_asked_for() -> None:
    rng = np.random.default_rng(7)
    cfg = TtftMargin(quantile=0.9, window=64)
    tr = cfg.tracker()
    covered = seen = 0
    for i in range(20_000):
        ratio = float(rng.lognormal(0.05, 0.08))
        if tr.samples >= cfg.min_samples:
            seen += 1
            covered += ratio <= tr.value(i * 1e-3)
        tr.observe(ratio, 1.0, float(i) * 1e-3)
    assert 0.88 <= covered / seen <= 0.93


def test_what_is_not_a_time_is_ignored() -> None:
    tr = _fed([1.5] * 20, TtftMargin())
    before = tr.value(1.0)
    for obs, pred, now in [
        (math.nan, 0.1, 1.0),
        (0.1, math.inf, 1.0),
        (0.0, 0.1, 1.0),
        (0.1, -1.0, 1.0),
        (0.1, 0.1, math.nan),
    ]:
        tr.observe(obs, pred, now)
    assert tr.value(1.0) == before
    assert tr.samples == 20


def test_it_fades_unconfirmed_and_starts_over_after_its_memory() -> None:
    cfg = TtftMargin(memory_s=60.0)
    tr = _fed([1.5] * 20, cfg, now=10.0)
    assert tr.value(10.0) == pytest.approx(1.5)
    assert tr.value(70.0) == pytest.approx(1.0 + 0.5 / math.e)
    # After its memory, a new first token starts the ratios over.
    tr.observe(0.1, 0.1, 80.0)
    assert tr.samples == 1
    assert tr.value(80.0) == 1.0


def _snap(seq: int, time: float) -> Snapshot:
    table = np.array([(0, 100, 110, 10, -1, -1, 0)], dtype=np.int64).reshape(1, NCOLS)
    return Snapshot("a", seq, time, None, ("r0",), table, None, "e1")


@pytest.mark.parametrize("on", [True, False])
def test_the_router_widens_what_its_first_tokens_say_it_should(on: bool) -> None:
    cfg = InstanceConfig(name="a", url="http://a", model="Qwen/Qwen3-8B", profile=PROFILE)
    clock = [10.0]
    core = RouterCore([cfg], clock=lambda: clock[0], margin=TtftMargin() if on else None)
    seq = iter(range(1, 1000))

    def decide(target: float = 5.0) -> Decision:
        assert core.cache("a").offer(_snap(next(seq), clock[0]), received=clock[0])
        d = core.decide("hello there", ttft_target=target)
        core.record_dispatch(d)
        return d

    # First tokens 30% later than predicted, every time.
    for _ in range(40):
        d = decide()
        core.record_first_token(d, "a", 1.3 * d.chosen.ttft_estimate_s)
        clock[0] += 0.01
    d = decide()
    c = d.chosen
    if not on:
        assert c.margin == 1.0
        assert core.margin("a") == 1.0
        assert "margin" not in d.explain()
        return
    # Learned on the point estimate (no feedback of the margin into itself;
    # 10 ms of fading since the last first token).
    assert c.margin == pytest.approx(1.3, rel=1e-3)
    assert core.margin("a") == pytest.approx(1.3, rel=1e-3)
    assert c.ttft_s == pytest.approx(c.margin * c.ttft_estimate_s, rel=1e-12)
    assert "margin x1.30" in d.explain()
    # Feasibility is on the widened estimate.
    tight = decide(target=1.15 * c.ttft_estimate_s)
    assert tight.chosen.feasible is False
    loose = decide(target=1.4 * c.ttft_estimate_s)
    assert loose.chosen.feasible is True
    # The router's error statistics are on the point estimate: 30% late is
    # a 23% error of the observed time, not 0.
    _mae, mape, n = core.ttft_error("a")
    assert n == 40
    assert mape == pytest.approx(0.3 / 1.3, rel=1e-3)


def test_early_first_tokens_never_narrow_it() -> None:
    tr = _fed([0.5] * 64, TtftMargin())
    assert tr.value(1.0) == 1.0


def test_the_decision_log_and_the_metrics_carry_it(caplog: pytest.LogCaptureFixture) -> None:
    prom = pytest.importorskip("prometheus_client")
    from bearsdk.router import DecisionLog, PrometheusMetrics

    cfg = InstanceConfig(name="a", url="http://a", model="Qwen/Qwen3-8B", profile=PROFILE)
    clock = [10.0]
    core = RouterCore([cfg], clock=lambda: clock[0], margin=TtftMargin())
    reg = prom.CollectorRegistry()
    PrometheusMetrics(reg).attach(core)  # type: ignore[arg-type]
    DecisionLog().attach(core)  # type: ignore[arg-type]
    for i in range(20):
        assert core.cache("a").offer(_snap(i + 1, clock[0]), received=clock[0])
        d = core.decide("hello there", ttft_target=5.0)
        core.record_dispatch(d)
        core.record_first_token(d, "a", 2.0 * d.chosen.ttft_estimate_s)
    assert core.cache("a").offer(_snap(99, clock[0]), received=clock[0])
    with caplog.at_level(logging.INFO, logger="bearsdk.decisions"):
        d = core.decide("hello there", ttft_target=5.0)
    core.record_dispatch(d)
    assert d.chosen.margin == pytest.approx(2.0)
    assert reg.get_sample_value("bearsdk_ttft_margin", {"instance": "a"}) == pytest.approx(2.0)
    doc = [r.bearsdk for r in caplog.records if r.bearsdk["event"] == "decision"][-1]  # type: ignore[attr-defined]
    assert doc["candidates"][0]["margin"] == pytest.approx(2.0)
    # The first token's logged prediction is the point estimate.
    with caplog.at_level(logging.INFO, logger="bearsdk.decisions"):
        core.record_first_token(d, "a", 0.5)
    tok = [r.bearsdk for r in caplog.records if r.bearsdk["event"] == "first_token"][-1]  # type: ignore[attr-defined]
    assert tok["predicted_ttft_s"] == pytest.approx(d.chosen.ttft_estimate_s, abs=1e-5)


def test_a_candidate_without_a_margin_is_its_own_estimate() -> None:
    from bearsdk.router import Candidate

    c = Candidate("a", "m", 0.5, 1.0, 0.5, 0.2, True, 0.5, "bea")
    assert c.margin == 1.0
    assert c.ttft_estimate_s == 0.2
    assert attrs.evolve(c, ttft_s=0.3, margin=1.5).ttft_estimate_s == pytest.approx(0.2)


def test_the_router_has_no_margin_unless_asked() -> None:
    cfg = InstanceConfig(name="a", url="http://a", model="Qwen/Qwen3-8B", profile=PROFILE)
    assert RouterCore([cfg]).slot("a").margin is None
    assert RouterCore([cfg], margin=TtftMargin()).slot("a").margin is not None

"""The lite metrics expose what prometheus_client's own would, update for update."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

prom = pytest.importorskip("prometheus_client")

from bearsdk.router.lite_metrics import LiteMetrics  # noqa: E402

BUCKETS = (0.01, 0.1, 0.5, 1.0, 10.0)
_CREATED = re.compile(r"^(\S+_created(?:\{[^}]*\})?) \S+$", re.M)


def _text(registry: object) -> str:
    """The exposition with creation times (wall clock) blanked."""
    return _CREATED.sub(r"\1 T", prom.generate_latest(registry).decode())


def _pair() -> tuple[object, LiteMetrics, object, dict[str, object]]:
    ref_reg, lite_reg = prom.CollectorRegistry(), prom.CollectorRegistry()
    kw = {"namespace": "ns", "registry": ref_reg}
    ref = {
        "c": prom.Counter("reqs", "Requests", ["instance", "code"], **kw),
        "g": prom.Gauge("depth", "Depth", **kw),
        "gl": prom.Gauge("age", "Age", ["instance"], **kw),
        "h": prom.Histogram("ttft_seconds", "TTFT", ["instance"], buckets=BUCKETS, **kw),
        "hu": prom.Histogram("decide_seconds", "Decide", buckets=BUCKETS, **kw),
    }
    m = LiteMetrics(lite_reg, "ns")
    lite = {
        "c": m.counter("reqs", "Requests", ["instance", "code"]),
        "g": m.gauge("depth", "Depth"),
        "gl": m.gauge("age", "Age", ["instance"]),
        "h": m.histogram("ttft_seconds", "TTFT", ["instance"], buckets=BUCKETS),
        "hu": m.histogram("decide_seconds", "Decide", buckets=BUCKETS),
    }
    m.register()
    return ref_reg, m, lite_reg, {"ref": ref, "lite": lite}


def test_declared_metrics_expose_as_prometheus_client_before_any_update() -> None:
    ref_reg, _, lite_reg, _ = _pair()
    assert _text(lite_reg) == _text(ref_reg)


values = st.one_of(
    st.sampled_from([*BUCKETS, 0.0, -1.0, math.inf, math.nan]),
    st.floats(min_value=-5, max_value=50, allow_nan=False),
)
ops = st.lists(
    st.tuples(st.sampled_from(["c", "g", "gl", "h", "hu"]), st.sampled_from(["a", "b"]), values),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_any_updates_expose_as_prometheus_client(updates: list[tuple[str, str, float]]) -> None:
    ref_reg, _, lite_reg, both = _pair()
    for kind, label, v in updates:
        for side in ("ref", "lite"):
            metric = both[side][kind]
            if kind == "c":
                metric.labels(label, "200").inc(abs(v) if math.isfinite(v) else 1.0)
            elif kind == "g":
                metric.set(v)
            elif kind == "gl":
                metric.labels(label).set(v)
            elif kind == "h":
                metric.labels(label).observe(v)
            else:
                metric.observe(v)
    assert _text(lite_reg) == _text(ref_reg)
    assert ref_reg.get_sample_value("ns_decide_seconds_count") == lite_reg.get_sample_value(
        "ns_decide_seconds_count"
    )


def test_a_name_registered_twice_is_refused() -> None:
    reg = prom.CollectorRegistry()
    m = LiteMetrics(reg, "ns")
    m.counter("reqs", "Requests")
    m.register()
    again = LiteMetrics(reg, "ns")
    again.counter("reqs", "Requests")
    with pytest.raises(ValueError, match="ns_reqs"):
        again.register()


def test_wrong_label_count_names_the_metric_and_the_labels() -> None:
    m = LiteMetrics(prom.CollectorRegistry(), "ns")
    c = m.counter("reqs", "Requests", ["instance", "code"])
    with pytest.raises(
        ValueError, match=r"'ns_reqs': 2 label value\(s\) expected \(instance, code\), got 1"
    ):
        c.labels("a")


def test_label_values_are_rendered_once_and_keep_their_series() -> None:
    reg = prom.CollectorRegistry()
    m = LiteMetrics(reg, "ns")
    c = m.counter("reqs", "Requests", ["code"])
    m.register()
    c.labels(200).inc()
    c.labels(200).inc()
    c.labels("200").inc()
    assert reg.get_sample_value("ns_reqs_total", {"code": "200"}) == 3.0

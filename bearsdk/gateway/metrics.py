"""The gateway's Prometheus metrics, named as llm-d's endpoint picker names its equivalents.

Served on ``GET /metrics`` with the router's own (:class:`~bearsdk.router.PrometheusMetrics`,
namespace ``bearsdk``: decisions, speed factors, overheads per instance). The
gateway's are in namespace ``bearsdk_gateway``; where llm-d has an equivalent
(``inference_objective_request_ttft_seconds`` and friends) the name after the
namespace and the ``model_name`` / ``target_model_name`` labels are the same,
so a dashboard written for one reads the other with a changed prefix.

==============================================  =========  ===================================
name (after ``bearsdk_gateway_``)               type       what
==============================================  =========  ===================================
``request_total``                               counter    requests answered, by ``model_name``
                                                           (asked), ``target_model_name``
                                                           (chosen) and HTTP ``code``
``request_error_total``                         counter    refused or failed requests by
                                                           ``model_name`` and ``error_code``
``request_duration_seconds``                    histogram  first byte in to last byte out
``request_ttft_seconds``                        histogram  observed time to first token
``request_predicted_ttft_seconds``              histogram  BEA's prediction for the chosen
                                                           instance
``request_ttft_prediction_duration_seconds``    histogram  time the routing decision took
``request_ttft_slo_violation_total``            counter    first tokens later than the
                                                           request's TTFT target
``admission_total``                             counter    admission outcomes: ``admitted``,
                                                           ``rejected``, ``queued``, ``expired``
``queue_depth``                                 gauge      requests held by ``queue`` admission
``in_flight``                                   gauge      requests being served
``key_in_flight``                               gauge      per API key name (never the key)
==============================================  =========  ===================================
"""

from __future__ import annotations

from typing import Any, NamedTuple

from bearsdk.router.lite_metrics import CounterSeries, HistogramSeries, LiteMetrics

__all__ = ["GatewayMetrics", "ModelMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0)
_DECIDE_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3, 20e-3)


class ModelMetrics(NamedTuple):
    """One (asked model, chosen model) pair's series, resolved once."""

    duration: HistogramSeries
    ttft: HistogramSeries
    predicted_ttft: HistogramSeries
    prediction_duration: HistogramSeries
    slo_violations: CounterSeries


class GatewayMetrics:
    """The table above, exposed through a ``prometheus_client`` registry
    (:mod:`bearsdk.router.lite_metrics`: an update is an addition).

    Args:
        registry: A ``prometheus_client.CollectorRegistry``.
    """

    def __init__(self, registry: Any) -> None:
        m = LiteMetrics(registry, "bearsdk_gateway")
        models = ["model_name", "target_model_name"]
        self.requests = m.counter("request", "Requests answered", [*models, "code"])
        self.errors = m.counter(
            "request_error", "Requests refused or failed", ["model_name", "error_code"]
        )
        self.duration = m.histogram(
            "request_duration_seconds",
            "First byte in to last byte out",
            models,
            buckets=_DURATION_BUCKETS,
        )
        self.ttft = m.histogram(
            "request_ttft_seconds", "Observed time to first token", models, buckets=_TTFT_BUCKETS
        )
        self.predicted_ttft = m.histogram(
            "request_predicted_ttft_seconds",
            "Predicted time to first token at the chosen instance",
            models,
            buckets=_TTFT_BUCKETS,
        )
        self.prediction_duration = m.histogram(
            "request_ttft_prediction_duration_seconds",
            "Time the routing decision (all predictions) took",
            models,
            buckets=_DECIDE_BUCKETS,
        )
        self.slo_violations = m.counter(
            "request_ttft_slo_violation", "First tokens later than the TTFT target", models
        )
        self.admission = m.counter("admission", "Admission outcomes", ["outcome"])
        self.queue_depth = m.gauge("queue_depth", "Requests held by queue admission")
        self.in_flight = m.gauge("in_flight", "Requests being served")
        self.key_in_flight = m.gauge(
            "key_in_flight", "Requests in flight per API key name", ["key"]
        )
        m.register()

        # Each pair's series resolved once (the pairs are few: a model or group,
        # and a served model).
        self._pairs: dict[tuple[str, str], ModelMetrics] = {}

    def pair(self, model: str, target: str) -> ModelMetrics:
        """The series of requests asking for ``model`` and served by ``target``."""
        got = self._pairs.get((model, target))
        if got is None:
            got = ModelMetrics(
                self.duration.labels(model, target),
                self.ttft.labels(model, target),
                self.predicted_ttft.labels(model, target),
                self.prediction_duration.labels(model, target),
                self.slo_violations.labels(model, target),
            )
            self._pairs[(model, target)] = got
        return got

    def answered(self, model: str, target: str, code: str) -> CounterSeries:
        """The request counter of a (model, target, HTTP status) triple."""
        return self.requests.labels(model, target, code)

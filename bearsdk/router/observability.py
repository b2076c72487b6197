"""Observability for :class:`~bearsdk.router.AsyncRouter`: Prometheus metrics and decision logs.

Both attach to a router's :class:`~bearsdk.router.RouterHooks` and cost nothing
when not attached::

    router = AsyncRouter(pool)
    PrometheusMetrics().attach(router)  # needs the ``metrics`` extra
    DecisionLog().attach(router)  # one JSON line per decision and per outcome

Metrics (namespace ``bearsdk`` by default), labelled by ``instance`` and, where
it applies, ``selector`` and ``estimator``:

==========================================  =========  =====================================
name                                        type       what
==========================================  =========  =====================================
``decisions_total``                         counter    routing decisions, by chosen instance,
                                                       selector and the estimator behind it
``decision_seconds``                        histogram  time one decision took
``fallbacks_total``                         counter    decisions made without a fresh snapshot
                                                       (the LPS fallback)
``explorations_total``                      counter    decisions that explored an instance with
                                                       no recent speed evidence
``snapshot_age_seconds``                    gauge      age of the snapshot behind the latest
                                                       decision, per instance
``speed_factor``                            gauge      the instance's learned speed: real batch
                                                       time over its profile's (1: as profiled)
``ttft_overhead_seconds``                   gauge      first-token overhead added to its
                                                       replayed TTFT (as of the latest
                                                       decision that priced it)
``ttft_margin``                             gauge      the factor its TTFT estimates were
                                                       widened by (its first tokens' spread;
                                                       1: none), as of the latest decision
                                                       that priced it
``ttft_seconds``                            histogram  observed time to first token
``ttft_error_seconds``                      histogram  observed minus predicted TTFT (the
                                                       point estimate, without the margin)
``ttft_abs_relative_error``                 histogram  ``|observed - predicted| / observed``
``slo_total``                               counter    first tokens by ``outcome``: ``met`` or
                                                       ``missed`` (the request's TTFT target)
``requests_total``                          counter    finished requests by ``outcome``
``dispatch_failures_total``                 counter    attempts that failed before the
                                                       response started (then retried)
==========================================  =========  =====================================
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from bearsdk.errors import BearError

if TYPE_CHECKING:
    from bearsdk.router.decision import Candidate, Decision
    from bearsdk.router.router import AsyncRouter

__all__ = ["DecisionLog", "PrometheusMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_ERR_BUCKETS = (-1.0, -0.3, -0.1, -0.05, -0.02, -0.01, 0.0, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0)
_REL_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
_DECIDE_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 5e-3)


def _now(fn: Callable[..., None]) -> Callable[..., None]:
    return fn


def _later(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` called at the running event loop's next turn (at once without one)."""

    def hook(*args: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            fn(*args)
        else:
            loop.call_soon(fn, *args)

    return hook


class PrometheusMetrics:
    """Router metrics in a ``prometheus_client`` registry (the table above).

    Args:
        registry: Where to register them (default: ``prometheus_client``'s
            global registry, which its HTTP exporter serves).
        namespace: Metric name prefix.
        defer: Record each hook's event at the event loop's next turn rather
            than inside the request's path: a decision's metrics then cost
            nothing before its request is sent, nor a first token's before it
            is passed on (what a gateway wants). Outside a running event loop
            they are recorded at once.

    Raises:
        BearError: ``prometheus_client`` is not installed (``pip install
            'bearsdk[metrics]'``).
    """

    def __init__(
        self, registry: Any = None, namespace: str = "bearsdk", *, defer: bool = False
    ) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise BearError(
                "PrometheusMetrics needs prometheus_client: pip install 'bearsdk[metrics]'"
            ) from None
        from bearsdk.router.lite_metrics import LiteMetrics

        reg = registry if registry is not None else prom.REGISTRY
        m = LiteMetrics(reg, namespace)
        self.decisions = m.counter(
            "decisions", "Routing decisions", ["instance", "selector", "estimator"]
        )
        self.decision_seconds = m.histogram(
            "decision_seconds", "Time one routing decision took", buckets=_DECIDE_BUCKETS
        )
        self.fallbacks = m.counter(
            "fallbacks", "Decisions made without a fresh snapshot", ["instance"]
        )
        self.explorations = m.counter(
            "explorations",
            "Decisions that explored an instance with no recent speed evidence",
            ["instance"],
        )
        self.snapshot_age = m.gauge(
            "snapshot_age_seconds", "Age of the snapshot behind the latest decision", ["instance"]
        )
        self.speed_factor = m.gauge(
            "speed_factor",
            "Learned batch time over the profile's, as of the latest decision",
            ["instance"],
        )
        self.ttft_overhead = m.gauge(
            "ttft_overhead_seconds",
            "First-token overhead added to the replayed TTFT, as of the latest decision",
            ["instance"],
        )
        self.ttft_margin = m.gauge(
            "ttft_margin",
            "Factor the TTFT estimates were widened by, as of the latest decision",
            ["instance"],
        )
        self.ttft = m.histogram(
            "ttft_seconds", "Observed time to first token", ["instance"], buckets=_TTFT_BUCKETS
        )
        self.ttft_error = m.histogram(
            "ttft_error_seconds",
            "Observed minus predicted time to first token",
            ["instance"],
            buckets=_ERR_BUCKETS,
        )
        self.ttft_rel_error = m.histogram(
            "ttft_abs_relative_error",
            "|observed - predicted| / observed TTFT",
            ["instance"],
            buckets=_REL_BUCKETS,
        )
        self.slo = m.counter(
            "slo", "First tokens against the request's TTFT target", ["instance", "outcome"]
        )
        self.requests = m.counter("requests", "Finished requests", ["instance", "outcome"])
        self.failures = m.counter(
            "dispatch_failures", "Attempts failed before the response started", ["instance"]
        )
        m.register()
        self._defer = defer

    def attach(self, router: AsyncRouter) -> PrometheusMetrics:
        """Record ``router``'s decisions and outcomes from now on; returns ``self``."""
        h = router.hooks
        later = _later if self._defer else _now
        h.on_decision.append(later(self._on_decision))
        h.on_first_token.append(later(self._on_first_token))
        h.on_complete.append(later(self._on_complete))
        h.on_failure.append(later(self._on_failure))
        return self

    def _on_decision(self, d: Decision) -> None:
        c = d.chosen
        self.decisions.labels(d.instance, d.selector, c.estimator).inc()
        self.decision_seconds.observe(d.decide_s)
        # (The rows, not the candidates: building every candidate costs more than this.)
        for inst, est, age, speed, overhead, margin in _gauges(d.candidates):
            if math.isfinite(age):
                self.snapshot_age.labels(inst).set(age)
            self.speed_factor.labels(inst).set(speed)
            if est != "unpriced":  # (no estimate, so no overhead added)
                self.ttft_overhead.labels(inst).set(overhead)
                self.ttft_margin.labels(inst).set(margin)
        if c.estimator == "lps":
            self.fallbacks.labels(d.instance).inc()
        if d.explored:
            self.explorations.labels(d.instance).inc()

    def _on_first_token(self, d: Decision, instance: str, observed: float) -> None:
        self.ttft.labels(instance).observe(observed)
        self.slo.labels(instance, "met" if observed <= d.ttft_target_s else "missed").inc()
        if instance == d.instance:
            pred = d.chosen.ttft_estimate_s
        else:  # a failover's: rare
            found = (c.ttft_estimate_s for c in d.candidates if c.instance == instance)
            pred = next(found, math.nan)
        if math.isfinite(pred) and observed > 0:
            self.ttft_error.labels(instance).observe(observed - pred)
            self.ttft_rel_error.labels(instance).observe(abs(observed - pred) / observed)

    def _on_complete(self, d: Decision, instance: str, outcome: str) -> None:
        self.requests.labels(instance, outcome).inc()

    def _on_failure(self, d: Decision, instance: str, why: str) -> None:
        self.failures.labels(instance).inc()


def _gauges(
    candidates: Sequence[Candidate],
) -> Iterable[tuple[str, str, float, float, float, float]]:
    """Each candidate's instance, estimator, snapshot age, speed factor, overhead, margin."""
    fast = getattr(candidates, "gauges", None)
    if fast is not None:
        return fast()  # type: ignore[no-any-return]
    return [
        (c.instance, c.estimator, c.snapshot_age_s, c.speed_factor, c.overhead_s, c.margin)
        for c in candidates
    ]


class DecisionLog:
    """Structured logs: one JSON object per decision, first token, outcome and failure.

    Each record's message is the JSON text, and the parsed object is also on the
    record as ``record.bearsdk`` for structured handlers. Decisions carry every
    candidate's predictions (the "why"); outcomes carry the observed TTFT and
    whether the target was met.

    Args:
        logger: Where to log (default ``bearsdk.decisions``).
        level: Level of every record.
        candidates: Include every candidate in decision records.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        level: int = logging.INFO,
        *,
        candidates: bool = True,
    ) -> None:
        self.logger = logger if logger is not None else logging.getLogger("bearsdk.decisions")
        self.level = level
        self.candidates = candidates

    def attach(self, router: AsyncRouter) -> DecisionLog:
        """Log ``router``'s decisions and outcomes from now on; returns ``self``."""
        h = router.hooks
        h.on_decision.append(self._on_decision)
        h.on_first_token.append(self._on_first_token)
        h.on_complete.append(self._on_complete)
        h.on_failure.append(self._on_failure)
        return self

    def _emit(self, doc: dict[str, Any]) -> None:
        if self.logger.isEnabledFor(self.level):
            self.logger.log(
                self.level,
                orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY).decode(),
                extra={"bearsdk": doc},
            )

    def _on_decision(self, d: Decision) -> None:
        doc: dict[str, Any] = {
            "event": "decision",
            "request_id": d.request_id,
            "selector": d.selector,
            "instance": d.instance,
            "reason": d.reason,
            "explored": d.explored,
            "ttft_target_s": d.ttft_target_s,
            "decide_us": round(d.decide_s * 1e6, 1),
        }
        if self.candidates:
            doc["candidates"] = [
                {
                    "instance": c.instance,
                    "accuracy": round(c.accuracy, 4),
                    "cost": round(c.cost, 3),
                    "utility": round(c.utility, 4),
                    "ttft_s": None if not math.isfinite(c.ttft_s) else round(c.ttft_s, 5),
                    "feasible": c.feasible,
                    "estimator": c.estimator,
                    "snapshot_age_s": (
                        None if not math.isfinite(c.snapshot_age_s) else round(c.snapshot_age_s, 4)
                    ),
                    "speed_factor": round(c.speed_factor, 4),
                    "overhead_s": round(c.overhead_s, 5),
                    "margin": round(c.margin, 4),
                }
                for c in d.candidates
            ]
        self._emit(doc)

    def _on_first_token(self, d: Decision, instance: str, observed: float) -> None:
        pred = next((c.ttft_estimate_s for c in d.candidates if c.instance == instance), math.nan)
        self._emit(
            {
                "event": "first_token",
                "request_id": d.request_id,
                "instance": instance,
                "ttft_s": round(observed, 5),
                "predicted_ttft_s": round(pred, 5) if math.isfinite(pred) else None,
                "slo_met": observed <= d.ttft_target_s,
            }
        )

    def _on_complete(self, d: Decision, instance: str, outcome: str) -> None:
        self._emit(
            {
                "event": "complete",
                "request_id": d.request_id,
                "instance": instance,
                "outcome": outcome,
            }
        )

    def _on_failure(self, d: Decision, instance: str, why: str) -> None:
        self._emit(
            {"event": "failure", "request_id": d.request_id, "instance": instance, "why": why}
        )

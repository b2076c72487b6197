"""The routers BEAR is compared against (paper, section 5.1), as selectors.

Each uses the latency estimate its authors use (``latency``); the router
computes it with the matching estimator in :mod:`bearsdk.estimators.baselines`.
Ties break as BEAR's do (:mod:`bearsdk.selectors.bear`): lower predicted TTFT,
lighter load, then a seeded draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from bearsdk.selectors.base import Option, Selection
from bearsdk.selectors.bear import TieBreaking, _nonneg

__all__ = [
    "LMDeployProxy",
    "RoundRobin",
    "RouteBalance",
    "Score",
    "SemanticRouter",
    "ShortestQueue",
]


def _finite(v: float, worst: float) -> float:
    return v if math.isfinite(v) else worst


@attrs.define
class RoundRobin:
    """Cycles through the instances in pool order, whatever the request."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "round-robin"
    latency: str = "none"
    _next: int = attrs.field(default=0, init=False)

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        i = self._next % len(options)
        self._next = i + 1
        return Selection(
            i, tuple(1.0 if j == i else 0.0 for j in range(len(options))), None, "next in turn"
        )


@attrs.frozen
class ShortestQueue(TieBreaking):
    """Join the shortest queue: fewest resident (queued + active) requests."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "shortest-queue"
    latency: str = "none"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        scores = tuple(-float(o.queue) for o in options)
        return Selection(self._best(scores, options), scores, None, "fewest resident requests")


@attrs.frozen
class LMDeployProxy(TieBreaking):
    """LMDeploy's proxy: smallest unfinished requests / measured request throughput."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "lmdeploy-proxy"
    latency: str = "lmdeploy"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        scores = tuple(-_finite(o.ttft_s, math.inf) for o in options)
        return Selection(
            self._best(scores, options), scores, None, "smallest unfinished / throughput"
        )


@attrs.frozen
class SemanticRouter(TieBreaking):
    """vLLM Semantic Router's latency-aware selection: lowest normalised TTFT percentile."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "semantic-router"
    latency: str = "semantic-router"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        best = min(
            (o.ttft_s for o in options if math.isfinite(o.ttft_s) and o.ttft_s > 0), default=1.0
        )
        # Normalised by the best candidate, as the Semantic Router does.
        scores = tuple(-_finite(o.ttft_s, math.inf) / best for o in options)
        return Selection(
            self._best(scores, options), scores, None, "lowest normalised observed TTFT"
        )


@attrs.frozen
class Score(TieBreaking):
    """SCORE: predicted quality minus weighted cost and latency penalties.

    ``score = accuracy - lam * cost - latency_weight * latency``, where the latency
    is SCORE's own estimate (queueing delay plus predicted output length times
    the model's time per output token).

    Args:
        lam: Cost weight (the utility's).
        latency_weight: Quality given up per second of estimated latency (tuned
            per workload in the paper's comparison).
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    latency_weight: float = attrs.field(default=0.1, validator=_nonneg)
    name: str = "score"
    latency: str = "score"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        scores = tuple(
            o.utility - (self.latency_weight * o.ttft_s if math.isfinite(o.ttft_s) else math.inf)
            for o in options
        )
        return Selection(
            self._best(scores, options), scores, None, "best quality - cost and latency penalties"
        )


@attrs.frozen
class RouteBalance(TieBreaking):
    """RouteBalance: quality combined with cost and latency scores normalised across instances.

    ``score = accuracy - cost_weight * norm(cost) - latency_weight * norm(latency)``
    with min-max normalisation over the candidates, and RouteBalance's latency
    estimate (pending decode tokens over the active batch size, times TPOT).

    Args:
        lam: Cost weight of the utility reported in decisions.
        cost_weight: Weight of the normalised cost.
        latency_weight: Weight of the normalised latency.
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    cost_weight: float = attrs.field(default=0.1, validator=_nonneg)
    latency_weight: float = attrs.field(default=0.5, validator=_nonneg)
    name: str = "routebalance"
    latency: str = "routebalance"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        cost = _minmax([o.cost for o in options])
        lat = _minmax([o.ttft_s for o in options])
        scores = tuple(
            o.accuracy - self.cost_weight * c - self.latency_weight * t
            for o, c, t in zip(options, cost, lat, strict=True)
        )
        return Selection(
            self._best(scores, options), scores, None, "best quality - normalised cost and latency"
        )


def _minmax(values: Sequence[float]) -> list[float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return [0.0] * len(values)
    lo, hi = min(finite), max(finite)
    span = hi - lo
    # An instance that can never serve the request ranks below every finite one.
    return [((v - lo) / span if span > 0 else 0.0) if math.isfinite(v) else 2.0 for v in values]

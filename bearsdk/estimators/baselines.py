"""Latency estimators of the routers BEAR is compared against (paper, section 5.1 and appendix F).

Each is implemented as its authors describe it, from the same router-side
observations BEA's fallback uses (:class:`~bearsdk.estimators.base.InstanceView`),
so a comparison measures the estimators, not their plumbing:

* :class:`ScoreEstimator` (SCORE, Lakha et al. 2025): queueing delay plus the
  predicted output length times the model's per-token time; the queueing delay
  is the estimated remaining token workload at the instance times that per-token time.
* :class:`RouteBalanceEstimator` (RouteBalance, Da and Kalyvianaki 2026): the
  pending decode tokens across the instance's requests over its active decode
  batch size, times the time per output token.
* :class:`LMDeployProxyEstimator` (LMDeploy proxy, ``min_expected_latency``):
  unfinished requests over the instance's measured request throughput.
* :class:`SemanticRouterEstimator` (vLLM Semantic Router, ``latency_aware``): a
  percentile of the TTFTs observed over a rolling window (the last 1000), with
  the exponentially weighted mean standing in below 3 observations; the router
  normalises by the best candidate (:func:`normalized_scores`), which does not
  change the ranking.

SCORE, RouteBalance and LMDeploy estimate completion latency; like the paper's
comparison (figure 19), they are used as the instance's latency estimate as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs

from bearsdk.estimators.base import InstanceView, RequestInfo

__all__ = [
    "LMDeployProxyEstimator",
    "RouteBalanceEstimator",
    "ScoreEstimator",
    "SemanticRouterEstimator",
    "normalized_scores",
    "percentile",
]


def _optional_positive(
    inst: object, att: attrs.Attribute[float | None], value: float | None
) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{att.name} must be a finite number > 0 or None (got {value!r})")


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{att.name} must be a finite number > 0 (got {value!r})")


@attrs.frozen
class ScoreEstimator:
    """SCORE: ``tpot * (pending decode tokens + predicted output length)``.

    Args:
        tpot_s: The model's per-token processing time; when ``None``, the view's
            measured mean time per output token.
        default_tpot_s: Per-token time before anything is measured.
        default_output_tokens: Output length when the request carries no prediction.
    """

    tpot_s: float | None = attrs.field(default=None, validator=_optional_positive)
    default_tpot_s: float = attrs.field(default=0.02, validator=_positive)
    default_output_tokens: int = 256

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """Queueing delay plus own generation time, seconds."""
        tpot = self.tpot_s or view.mean_tpot_s or self.default_tpot_s
        queueing = view.pending_decode_tokens * tpot
        return queueing + request.expected_output(self.default_output_tokens) * tpot


@attrs.frozen
class RouteBalanceEstimator:
    """RouteBalance: ``pending decode tokens / active batch size * tpot``.

    Args:
        tpot_s: Calibrated time per output token; when ``None``, the view's
            measured mean.
        default_tpot_s: Time per output token before anything is measured.
    """

    tpot_s: float | None = attrs.field(default=None, validator=_optional_positive)
    default_tpot_s: float = attrs.field(default=0.02, validator=_positive)

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """Time to drain the pending decode work at the current batch size, seconds."""
        tpot = self.tpot_s or view.mean_tpot_s or self.default_tpot_s
        batch = max(1, view.running)
        return view.pending_decode_tokens / batch * tpot


@attrs.frozen
class LMDeployProxyEstimator:
    """LMDeploy proxy: ``unfinished requests / request throughput``.

    Args:
        requests_per_s: Configured node speed; when ``None``, the view's measured
            completion rate.
        default_requests_per_s: Speed before any completion is measured (the
            proxy uses the mean of the known nodes' speeds, or 1).
    """

    requests_per_s: float | None = attrs.field(default=None, validator=_optional_positive)
    default_requests_per_s: float = attrs.field(default=1.0, validator=_positive)

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """Expected latency in the proxy's sense, seconds."""
        speed = self.requests_per_s or view.completion_rate or self.default_requests_per_s
        return view.unfinished / speed


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in ``[0, 1]``) of ascending values."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    pos = q * (n - 1)
    lo = int(pos)
    if lo + 1 >= n:
        return float(sorted_values[-1])
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[lo + 1] * frac)


@attrs.frozen
class SemanticRouterEstimator:
    """vLLM Semantic Router: a percentile of the recently observed TTFTs.

    Args:
        percentile: Percentile in ``[1, 100]`` (the router's ``ttft_percentile``).
        window: Observations the percentile covers (most recent).
        no_data_s: Estimate for an instance with no observation yet (the router
            skips such candidates; ``0`` lets a cold instance be tried).
    """

    percentile: float = 50.0
    window: int = 1000
    no_data_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not (1.0 <= self.percentile <= 100.0):
            raise ValueError(f"percentile must be in [1, 100] (got {self.percentile!r})")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (got {self.window!r})")

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """The configured percentile of the window's TTFTs, seconds."""
        recent = view.recent_ttfts_s[-self.window :]
        if not recent:
            return self.no_data_s
        if len(recent) < 3:
            if view.ttft_ewma_s is not None:
                return view.ttft_ewma_s
            return sum(recent) / len(recent)
        return percentile(sorted(recent), self.percentile / 100.0)


def normalized_scores(estimates: Mapping[str, float]) -> dict[str, float]:
    """Each candidate's estimate over the best one (the Semantic Router's score; lower wins)."""
    finite = [v for v in estimates.values() if math.isfinite(v)]
    best = min(finite) if finite else 0.0
    denom = best if best > 0 else 1.0
    return {k: v / denom for k, v in estimates.items()}

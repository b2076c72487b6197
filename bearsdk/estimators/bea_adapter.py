"""BEA behind the common :class:`~bearsdk.estimators.base.LatencyEstimator` interface.

A thin adapter over :class:`~bearsdk.estimators.bea.BEAEstimator`: it replays from
the view's snapshot when one is fresh enough, and otherwise defers to a fallback
(the LPS estimator, as the paper prescribes when no snapshot is available).
"""

from __future__ import annotations

import math

import attrs

from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot
from bearsdk.estimators.lps import LPSEstimator
from bearsdk.snapshot import Snapshot

__all__ = ["BEALatencyEstimator"]


@attrs.define
class BEALatencyEstimator:
    """BEA replay when a usable snapshot exists, else a fallback estimator.

    The prepared replay state of the latest snapshot is cached, so the many
    estimates made between two snapshots of an instance replay without
    re-preparing.

    Args:
        bea: The instance's BEA estimator (policy, batch-time model, length predictor).
        fallback: Used when the view has no snapshot or one older than
            ``max_snapshot_age_s`` (default: an :class:`LPSEstimator`).
        max_snapshot_age_s: Oldest snapshot still replayed (the paper finds
            routing quality nearly unchanged up to 0.4 s of staleness).
    """

    bea: BEAEstimator
    fallback: LatencyEstimator = attrs.field(factory=LPSEstimator)
    max_snapshot_age_s: float = 1.0
    _cached: tuple[Snapshot, PreparedSnapshot] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if math.isnan(self.max_snapshot_age_s) or self.max_snapshot_age_s < 0:
            raise ValueError(f"max_snapshot_age_s must be >= 0 (got {self.max_snapshot_age_s!r})")

    def _prepared(self, snapshot: Snapshot) -> PreparedSnapshot:
        if self._cached is None or self._cached[0] is not snapshot:
            self._cached = (snapshot, self.bea.prepare(snapshot))
        return self._cached[1]

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """BEA's replayed TTFT, or the fallback's estimate without a usable snapshot.

        When the replay reaches its work bound this is the lower bound it
        reached (:attr:`~bearsdk.estimators.bea.TTFTEstimate.lower_bound`): the
        instance is ranked as at least that slow.
        """
        snap = view.snapshot
        if snap is None or view.snapshot_age_s > self.max_snapshot_age_s:
            return self.fallback.estimate_ttft(request, view)
        prep = self._prepared(snap)
        est = self.bea.estimate(
            prep, request.prompt_tokens, request.output_tokens, max_tokens=request.max_tokens
        )
        return est.ttft_s

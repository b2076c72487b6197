"""Latency estimators: BEA (replay), and the analytical and baseline ones.

Every estimator implements :class:`LatencyEstimator` (``estimate_ttft(request,
view)``) over what the router knows about an instance (:class:`InstanceView`,
built by :class:`InstanceStats`), so the router and the simulator swap them freely.
"""

from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.baselines import (
    LMDeployProxyEstimator,
    RouteBalanceEstimator,
    ScoreEstimator,
    SemanticRouterEstimator,
    normalized_scores,
)
from bearsdk.estimators.batch_time import (
    BatchDataError,
    BatchObservation,
    BatchTimeFit,
    BatchTimeModel,
    OnlineBatchTime,
    fit_batch_time,
    read_batches,
    write_batches,
)
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot, TTFTEstimate
from bearsdk.estimators.bea_adapter import BEALatencyEstimator
from bearsdk.estimators.length import (
    KnownLengths,
    LengthPredictor,
    MeanLengthPredictor,
    RememberedLengths,
    resolve_output_lengths,
)
from bearsdk.estimators.lps import LPSEstimator, lps_wait, lps_wait_variability
from bearsdk.estimators.prefill import PrefillThroughputEstimator, calibrate_theta_pre
from bearsdk.estimators.profiles import get_profile, load_profile, profile_names
from bearsdk.estimators.stats import InstanceStats

__all__ = [
    "BEAEstimator",
    "BEALatencyEstimator",
    "BatchDataError",
    "BatchObservation",
    "BatchTimeFit",
    "BatchTimeModel",
    "InstanceStats",
    "InstanceView",
    "KnownLengths",
    "LMDeployProxyEstimator",
    "LPSEstimator",
    "LatencyEstimator",
    "LengthPredictor",
    "MeanLengthPredictor",
    "OnlineBatchTime",
    "PrefillThroughputEstimator",
    "PreparedSnapshot",
    "RememberedLengths",
    "RequestInfo",
    "RouteBalanceEstimator",
    "ScoreEstimator",
    "SemanticRouterEstimator",
    "TTFTEstimate",
    "calibrate_theta_pre",
    "fit_batch_time",
    "get_profile",
    "load_profile",
    "lps_wait",
    "lps_wait_variability",
    "normalized_scores",
    "profile_names",
    "read_batches",
    "resolve_output_lengths",
    "write_batches",
]

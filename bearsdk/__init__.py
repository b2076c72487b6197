"""bearsdk: latency-aware routing for heterogeneous vLLM pools (BEA + BEAR)."""

from bearsdk.errors import BearError, SnapshotError, SpecError
from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
from bearsdk.estimators.baselines import (
    LMDeployProxyEstimator,
    RouteBalanceEstimator,
    ScoreEstimator,
    SemanticRouterEstimator,
)
from bearsdk.estimators.batch_time import (
    BatchObservation,
    BatchTimeFit,
    BatchTimeModel,
    OnlineBatchTime,
    fit_batch_time,
    read_batches,
)
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot, TTFTEstimate
from bearsdk.estimators.bea_adapter import BEALatencyEstimator
from bearsdk.estimators.length import LengthPredictor, MeanLengthPredictor
from bearsdk.estimators.lps import LPSEstimator
from bearsdk.estimators.prefill import PrefillThroughputEstimator
from bearsdk.estimators.profiles import load_profile, profile_names
from bearsdk.estimators.stats import InstanceStats
from bearsdk.replay import (
    IMPLEMENTATION,
    BatchRecord,
    Replayer,
    ReplayerProtocol,
    ReplayResult,
    ScheduledBatch,
    SchedulerCore,
    StepOutput,
    StopReason,
)
from bearsdk.schedulers import (
    Policy,
    SchedulerSpec,
    compile_policy,
    get_scheduler,
    load_spec,
    policy,
    register_scheduler,
    scheduler_names,
    unregister_scheduler,
)
from bearsdk.snapshot import KVState, RequestState, Snapshot, decode_snapshot, snapshot_from_dict

__version__ = "0.1.0.dev0"

__all__ = [
    "IMPLEMENTATION",
    "BEAEstimator",
    "BEALatencyEstimator",
    "BatchObservation",
    "BatchRecord",
    "BatchTimeFit",
    "BatchTimeModel",
    "BearError",
    "InstanceStats",
    "InstanceView",
    "KVState",
    "LMDeployProxyEstimator",
    "LPSEstimator",
    "LatencyEstimator",
    "LengthPredictor",
    "MeanLengthPredictor",
    "OnlineBatchTime",
    "Policy",
    "PrefillThroughputEstimator",
    "PreparedSnapshot",
    "ReplayResult",
    "Replayer",
    "ReplayerProtocol",
    "RequestInfo",
    "RequestState",
    "RouteBalanceEstimator",
    "ScheduledBatch",
    "SchedulerCore",
    "SchedulerSpec",
    "ScoreEstimator",
    "SemanticRouterEstimator",
    "Snapshot",
    "SnapshotError",
    "SpecError",
    "StepOutput",
    "StopReason",
    "TTFTEstimate",
    "__version__",
    "compile_policy",
    "decode_snapshot",
    "fit_batch_time",
    "get_scheduler",
    "load_profile",
    "load_spec",
    "policy",
    "profile_names",
    "read_batches",
    "register_scheduler",
    "scheduler_names",
    "snapshot_from_dict",
    "unregister_scheduler",
]

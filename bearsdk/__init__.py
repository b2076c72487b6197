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
from bearsdk.predictors import (
    QWEN3_POOL,
    ModelSpec,
    PoolPrediction,
    Predictor,
    PredictorError,
    PredictorFormatError,
    PromptTokenCounter,
    TrainConfig,
    load_pool,
    train_predictor,
)
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
    "QWEN3_POOL",
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
    "ModelSpec",
    "OnlineBatchTime",
    "Policy",
    "PoolPrediction",
    "Predictor",
    "PredictorError",
    "PredictorFormatError",
    "PrefillThroughputEstimator",
    "PreparedSnapshot",
    "PromptTokenCounter",
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
    "TrainConfig",
    "__version__",
    "compile_policy",
    "decode_snapshot",
    "fit_batch_time",
    "get_scheduler",
    "load_pool",
    "load_profile",
    "load_spec",
    "policy",
    "profile_names",
    "read_batches",
    "register_scheduler",
    "scheduler_names",
    "snapshot_from_dict",
    "train_predictor",
    "unregister_scheduler",
]

"""bearsdk: latency-aware routing for heterogeneous vLLM pools (BEA + BEAR)."""

from bearsdk.errors import BearError, SnapshotError, SpecError
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator, PreparedSnapshot, TTFTEstimate
from bearsdk.estimators.length import LengthPredictor, MeanLengthPredictor
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
    "BatchRecord",
    "BatchTimeModel",
    "BearError",
    "KVState",
    "LengthPredictor",
    "MeanLengthPredictor",
    "Policy",
    "PreparedSnapshot",
    "ReplayResult",
    "Replayer",
    "ReplayerProtocol",
    "RequestState",
    "ScheduledBatch",
    "SchedulerCore",
    "SchedulerSpec",
    "Snapshot",
    "SnapshotError",
    "SpecError",
    "StepOutput",
    "StopReason",
    "TTFTEstimate",
    "__version__",
    "compile_policy",
    "decode_snapshot",
    "get_scheduler",
    "load_spec",
    "policy",
    "register_scheduler",
    "scheduler_names",
    "snapshot_from_dict",
    "unregister_scheduler",
]

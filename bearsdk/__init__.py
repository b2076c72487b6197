"""bearsdk: latency-aware routing for heterogeneous vLLM pools (BEA + BEAR)."""

from bearsdk.errors import BearError, SnapshotError, SpecError
from bearsdk.replay import IMPLEMENTATION, BatchRecord, Replayer, ReplayResult, StopReason
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
    "BatchRecord",
    "BearError",
    "KVState",
    "Policy",
    "ReplayResult",
    "Replayer",
    "RequestState",
    "SchedulerSpec",
    "Snapshot",
    "SnapshotError",
    "SpecError",
    "StopReason",
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

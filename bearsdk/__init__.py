"""bearsdk: latency-aware routing for heterogeneous vLLM pools (BEA + BEAR).

The top level holds what an application embedding the router needs (about
forty names, :data:`__all__`): :class:`AsyncRouter` and its synchronous
:class:`RouterCore`, pool configuration, decisions and TTFT targets, the
selectors (BEAR, Lagrangian, :class:`Selector`, :func:`make_selector`), the
scheduler specs and their registry, the staleness rules, the errors, the
estimator entry points and :func:`twins`. Everything else is imported from its
subpackage: :mod:`bearsdk.emulator`, :mod:`bearsdk.sim`, :mod:`bearsdk.cluster`,
:mod:`bearsdk.io`, :mod:`bearsdk.estimators`, :mod:`bearsdk.selectors`,
:mod:`bearsdk.replay`, :mod:`bearsdk.state`, :mod:`bearsdk.snapshot`,
:mod:`bearsdk.predictors`, :mod:`bearsdk.workload`, :mod:`bearsdk.evaluation`.

Words: a *scheduler spec* is an engine's scheduling policy as data
(:class:`SchedulerSpec`; bound to parameter values it is a
:class:`BoundScheduler`); a *selector* picks an instance per request; the
*staleness rules* say how estimates treat old snapshots.

Every name is loaded on first use (PEP 562), so ``import bearsdk`` costs
almost nothing and pulls in none of the emulator, the simulator, Redis or aiohttp
until a name that needs them is touched. Names that used to live here still
resolve, for one release, with a :class:`DeprecationWarning` naming their home.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bearsdk.errors import BearError, SnapshotError, SpecError
    from bearsdk.estimators.base import InstanceView, LatencyEstimator, RequestInfo
    from bearsdk.estimators.bea import BEAEstimator
    from bearsdk.predictors import Predictor
    from bearsdk.router import (
        AsyncRouter,
        Candidate,
        ChatResponse,
        ChatStream,
        CircuitBreaker,
        ConfigError,
        Decision,
        DispatchError,
        EngineRequestError,
        FixedTarget,
        InstanceConfig,
        NoInstanceError,
        PaperTargets,
        RequestError,
        RouterHooks,
        TargetRule,
        load_pool_config,
    )
    from bearsdk.router.core import RouterCore
    from bearsdk.schedulers import (
        BoundScheduler,
        SchedulerSpec,
        bind_scheduler,
        get_scheduler,
        load_spec,
        register_scheduler,
        scheduler_names,
    )
    from bearsdk.selectors import BEAR, Lagrangian, Selector, make_selector
    from bearsdk.state import StalenessRules

__version__ = "0.1.0.dev0"

# Public name -> the module it lives in. The one table both the lazy loader and
# ``__all__`` are built from, so they cannot drift apart.
_HOMES: dict[str, str] = {
    # The router: the class to embed, its synchronous core, pools, decisions, targets
    "AsyncRouter": "bearsdk.router",
    "RouterCore": "bearsdk.router.core",
    "InstanceConfig": "bearsdk.router",
    "load_pool_config": "bearsdk.router",
    "CircuitBreaker": "bearsdk.router",
    "RouterHooks": "bearsdk.router",
    "Decision": "bearsdk.router",
    "Candidate": "bearsdk.router",
    "ChatResponse": "bearsdk.router",
    "ChatStream": "bearsdk.router",
    "FixedTarget": "bearsdk.router",
    "PaperTargets": "bearsdk.router",
    "TargetRule": "bearsdk.router",
    # Errors
    "BearError": "bearsdk.errors",
    "SnapshotError": "bearsdk.errors",
    "SpecError": "bearsdk.errors",
    "ConfigError": "bearsdk.router",
    "DispatchError": "bearsdk.router",
    "EngineRequestError": "bearsdk.router",
    "NoInstanceError": "bearsdk.router",
    "RequestError": "bearsdk.router",
    # Selectors (BEAR and friends; the baselines are in bearsdk.selectors)
    "BEAR": "bearsdk.selectors",
    "Lagrangian": "bearsdk.selectors",
    "Selector": "bearsdk.selectors",
    "make_selector": "bearsdk.selectors",
    # Scheduler specs (engine scheduling policies as data) and their registry
    "SchedulerSpec": "bearsdk.schedulers",
    "BoundScheduler": "bearsdk.schedulers",
    "bind_scheduler": "bearsdk.schedulers",
    "load_spec": "bearsdk.schedulers",
    "register_scheduler": "bearsdk.schedulers",
    "get_scheduler": "bearsdk.schedulers",
    "scheduler_names": "bearsdk.schedulers",
    # Staleness rules
    "StalenessRules": "bearsdk.state",
    # Estimator entry points
    "BEAEstimator": "bearsdk.estimators.bea",
    "LatencyEstimator": "bearsdk.estimators.base",
    "RequestInfo": "bearsdk.estimators.base",
    "InstanceView": "bearsdk.estimators.base",
    "Predictor": "bearsdk.predictors",
}

# Names that were public here before the API was cut to the above (issue 18):
# old name -> (its home, its name there). They resolve with a warning for one
# release; then they go.
_MOVED: dict[str, tuple[str, str]] = {
    "BEALatencyEstimator": ("bearsdk.estimators", "BEALatencyEstimator"),
    "BatchObservation": ("bearsdk.estimators", "BatchObservation"),
    "BatchRecord": ("bearsdk.replay", "BatchRecord"),
    "BatchTimeFit": ("bearsdk.estimators", "BatchTimeFit"),
    "BatchTimeModel": ("bearsdk.estimators", "BatchTimeModel"),
    "CachedSnapshot": ("bearsdk.state", "CachedSnapshot"),
    "Cluster": ("bearsdk.cluster", "Cluster"),
    "DecisionLog": ("bearsdk.router", "DecisionLog"),
    "DispatchOverlay": ("bearsdk.state", "DispatchOverlay"),
    "EmulatedEngine": ("bearsdk.emulator", "EmulatedEngine"),
    "EngineConfig": ("bearsdk.emulator", "EngineConfig"),
    "EnginePool": ("bearsdk.emulator", "EnginePool"),
    "FastForward": ("bearsdk.state", "FastForward"),
    "GroundTruthParams": ("bearsdk.emulator", "GroundTruthParams"),
    "IMPLEMENTATION": ("bearsdk.replay", "IMPLEMENTATION"),
    "InstanceState": ("bearsdk.state", "InstanceState"),
    "InstanceStats": ("bearsdk.estimators", "InstanceStats"),
    "KVState": ("bearsdk.snapshot", "KVState"),
    "KnownLengths": ("bearsdk.estimators", "KnownLengths"),
    "LMDeployProxy": ("bearsdk.selectors", "LMDeployProxy"),
    "LMDeployProxyEstimator": ("bearsdk.estimators", "LMDeployProxyEstimator"),
    "LPSEstimator": ("bearsdk.estimators", "LPSEstimator"),
    "LatencyAgnostic": ("bearsdk.selectors", "LatencyAgnostic"),
    "LengthPredictor": ("bearsdk.estimators", "LengthPredictor"),
    "MeanLengthPredictor": ("bearsdk.estimators", "MeanLengthPredictor"),
    "MetricsSource": ("bearsdk.io", "MetricsSource"),
    "ModelSpec": ("bearsdk.predictors", "ModelSpec"),
    "OnlineBatchTime": ("bearsdk.estimators", "OnlineBatchTime"),
    "Option": ("bearsdk.selectors", "Option"),
    "Policy": ("bearsdk.schedulers", "BoundScheduler"),
    "PollSource": ("bearsdk.io", "PollSource"),
    "PoolPrediction": ("bearsdk.predictors", "PoolPrediction"),
    "PowerOfD": ("bearsdk.cluster", "PowerOfD"),
    "PredictorError": ("bearsdk.predictors", "PredictorError"),
    "PredictorFormatError": ("bearsdk.predictors", "PredictorFormatError"),
    "PrefillTPS": ("bearsdk.selectors", "PrefillTPS"),
    "PrefillThroughputEstimator": ("bearsdk.estimators", "PrefillThroughputEstimator"),
    "PreparedSnapshot": ("bearsdk.estimators", "PreparedSnapshot"),
    "PrometheusMetrics": ("bearsdk.router", "PrometheusMetrics"),
    "PromptTokenCounter": ("bearsdk.predictors", "PromptTokenCounter"),
    "PushSource": ("bearsdk.io", "PushSource"),
    "QWEN3_POOL": ("bearsdk.predictors", "QWEN3_POOL"),
    "RedisBus": ("bearsdk.cluster", "RedisBus"),
    "RedisSnapshotBridge": ("bearsdk.cluster", "RedisSnapshotBridge"),
    "RedisSource": ("bearsdk.cluster", "RedisSource"),
    "RememberedLengths": ("bearsdk.estimators", "RememberedLengths"),
    "ReplayResult": ("bearsdk.replay", "ReplayResult"),
    "Replayer": ("bearsdk.replay", "Replayer"),
    "ReplayerProtocol": ("bearsdk.replay", "ReplayerProtocol"),
    "RequestResult": ("bearsdk.evaluation", "RequestResult"),
    "RequestState": ("bearsdk.snapshot", "RequestState"),
    "RoundRobin": ("bearsdk.selectors", "RoundRobin"),
    "RouteBalance": ("bearsdk.selectors", "RouteBalance"),
    "RouteBalanceEstimator": ("bearsdk.estimators", "RouteBalanceEstimator"),
    "RunSummary": ("bearsdk.evaluation", "RunSummary"),
    "ScheduledBatch": ("bearsdk.replay", "ScheduledBatch"),
    "SchedulerCore": ("bearsdk.replay", "SchedulerCore"),
    "Score": ("bearsdk.selectors", "Score"),
    "ScoreEstimator": ("bearsdk.estimators", "ScoreEstimator"),
    "Selection": ("bearsdk.selectors", "Selection"),
    "SelectorError": ("bearsdk.selectors", "SelectorError"),
    "SemanticRouter": ("bearsdk.selectors", "SemanticRouter"),
    "SemanticRouterEstimator": ("bearsdk.estimators", "SemanticRouterEstimator"),
    "ShadowView": ("bearsdk.state", "ShadowView"),
    "SharedOverlay": ("bearsdk.cluster", "SharedOverlay"),
    "ShmReader": ("bearsdk.io", "ShmReader"),
    "ShmSource": ("bearsdk.io", "ShmSource"),
    "ShmWriter": ("bearsdk.io", "ShmWriter"),
    "ShortestQueue": ("bearsdk.selectors", "ShortestQueue"),
    "Snapshot": ("bearsdk.snapshot", "Snapshot"),
    "SnapshotCache": ("bearsdk.state", "SnapshotCache"),
    "SnapshotPublisher": ("bearsdk.io", "SnapshotPublisher"),
    "SnapshotSource": ("bearsdk.io", "SnapshotSource"),
    "StalenessPolicy": ("bearsdk", "StalenessRules"),
    "StepOutput": ("bearsdk.replay", "StepOutput"),
    "StopReason": ("bearsdk.replay", "StopReason"),
    "TTFTEstimate": ("bearsdk.estimators", "TTFTEstimate"),
    "TrainConfig": ("bearsdk.predictors", "TrainConfig"),
    "WorkItem": ("bearsdk.workload", "WorkItem"),
    "arrivals": ("bearsdk.workload", "arrivals"),
    "compile_policy": ("bearsdk.schedulers", "compile_scheduler"),
    "decode_snapshot": ("bearsdk.snapshot", "decode_snapshot"),
    "drive_workload": ("bearsdk.evaluation", "drive_workload"),
    "fit_batch_time": ("bearsdk.estimators", "fit_batch_time"),
    "load_pool": ("bearsdk.predictors", "load_pool"),
    "load_profile": ("bearsdk.estimators", "load_profile"),
    "policy": ("bearsdk", "bind_scheduler"),
    "profile_names": ("bearsdk.estimators", "profile_names"),
    "read_batches": ("bearsdk.estimators", "read_batches"),
    "snapshot_from_dict": ("bearsdk.snapshot", "snapshot_from_dict"),
    "summarize": ("bearsdk.evaluation", "summarize"),
    "synthetic_workload": ("bearsdk.workload", "synthetic_workload"),
    "train_predictor": ("bearsdk.predictors", "train_predictor"),
    "unregister_scheduler": ("bearsdk.schedulers", "unregister_scheduler"),
}

__all__ = [
    "BEAR",
    "AsyncRouter",
    "BEAEstimator",
    "BearError",
    "BoundScheduler",
    "Candidate",
    "ChatResponse",
    "ChatStream",
    "CircuitBreaker",
    "ConfigError",
    "Decision",
    "DispatchError",
    "EngineRequestError",
    "FixedTarget",
    "InstanceConfig",
    "InstanceView",
    "Lagrangian",
    "LatencyEstimator",
    "NoInstanceError",
    "PaperTargets",
    "Predictor",
    "RequestError",
    "RequestInfo",
    "RouterCore",
    "RouterHooks",
    "SchedulerSpec",
    "Selector",
    "SnapshotError",
    "SpecError",
    "StalenessRules",
    "TargetRule",
    "__version__",
    "bind_scheduler",
    "get_scheduler",
    "load_pool_config",
    "load_spec",
    "make_selector",
    "register_scheduler",
    "scheduler_names",
    "twins",
]


def twins() -> dict[str, str]:
    """Which implementation of each twin pair is in use.

    Returns:
        ``"cython"`` or ``"python"`` for every pair (replay, snapshot decoder,
        prompt features, shared-memory seqlock, vLLM publisher capture), as
        ``bearsdk --version`` prints them; ``BEARSDK_NO_EXTENSIONS=1`` gives
        ``"python"`` everywhere.
    """
    from bearsdk import _twins

    return _twins.loaded()


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home), name)
        # Cache it: the next access is a plain module attribute, no hook.
        globals()[name] = value
        return value
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module 'bearsdk' has no attribute {name!r}")
    module, new = moved
    hint = f"import it from {module}" if new == name else f"use {module}.{new}"
    # Not cached, so that every use warns (the warnings filter decides how often).
    warnings.warn(f"bearsdk.{name} is deprecated: {hint}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), new)


def __dir__() -> list[str]:
    return sorted(__all__)

"""The embedded router: AsyncRouter, pool configuration, decisions."""

from bearsdk.router.breaker import BreakerState, CircuitBreaker
from bearsdk.router.config import SNAPSHOT_MODES, ConfigError, InstanceConfig, load_pool_config
from bearsdk.router.decision import Candidate, Decision
from bearsdk.router.explore import Exploration
from bearsdk.router.margin import TtftMargin
from bearsdk.router.observability import DecisionLog, PrometheusMetrics
from bearsdk.router.router import (
    AsyncRouter,
    ChatResponse,
    ChatStream,
    DispatchError,
    EngineRequestError,
    NoInstanceError,
    RequestError,
    RouterHooks,
)
from bearsdk.router.targets import FixedTarget, PaperTargets, TargetRule

__all__ = [
    "SNAPSHOT_MODES",
    "AsyncRouter",
    "BreakerState",
    "Candidate",
    "ChatResponse",
    "ChatStream",
    "CircuitBreaker",
    "ConfigError",
    "Decision",
    "DecisionLog",
    "DispatchError",
    "EngineRequestError",
    "Exploration",
    "FixedTarget",
    "InstanceConfig",
    "NoInstanceError",
    "PaperTargets",
    "PrometheusMetrics",
    "RequestError",
    "RouterHooks",
    "TargetRule",
    "TtftMargin",
    "load_pool_config",
]

"""Latency estimators by name: what a selector's ``latency`` asks the router for.

A selector names the TTFT estimate it needs (``BEAR.latency == "bea"``); the
router looks that name up here and builds one estimator per instance from an
:class:`EstimatorContext` (the instance's configuration, its batch-time model,
its scheduler, its snapshot state and the router's statistics of it). The
built-ins are registered below exactly as a user registers their own::

    class QueueTimes:  # any LatencyEstimator
        def estimate_ttft(self, request, view):
            return 0.05 * (view.waiting + 1)

    register_estimator("queue-times", lambda ctx: QueueTimes())

A factory returns either a plain :class:`~bearsdk.estimators.base.LatencyEstimator`
(it is handed the instance's :class:`~bearsdk.estimators.base.InstanceView` per
request) or an :class:`InstanceEstimator`, which reads what it needs itself
(BEA replays the snapshot state without building a view).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from bearsdk.errors import BearError
from bearsdk.estimators.base import (
    InstanceView,
    Latency,
    LatencyEstimator,
    LatencyFields,
    RequestInfo,
)

if TYPE_CHECKING:
    from bearsdk.estimators.batch_time import BatchTimeModel
    from bearsdk.schedulers.spec import BoundScheduler
    from bearsdk.state import InstanceState

NAN = math.nan

__all__ = [
    "EstimatorContext",
    "EstimatorError",
    "EstimatorFactory",
    "InstanceEstimator",
    "Latency",
    "build_estimator",
    "estimator_names",
    "register_estimator",
    "unregister_estimator",
]


class EstimatorError(BearError, ValueError):
    """An estimator name that is not registered, or a registration that clashes."""


@attrs.frozen(eq=False)
class EstimatorContext:
    """One instance, as an estimator factory sees it.

    Attributes:
        name: The instance's name.
        model: The model it serves.
        batch_time: Its eq. 12 batch-time model (profile or explicit).
        scheduler: Its engine's scheduler spec, bound to the instance's parameters.
        state: Its snapshot state (the cached snapshot and the router's own
            dispatches since): what BEA replays.
        view: The router's statistics of the instance at a time (router clock).
    """

    name: str
    model: str
    batch_time: BatchTimeModel
    scheduler: BoundScheduler
    state: InstanceState
    view: Callable[[float], InstanceView]


@runtime_checkable
class InstanceEstimator(Protocol):
    """A per-instance estimator that reads the instance's state itself.

    One whose ``estimate`` also takes a keyword ``horizon_s`` (and says so with
    a class attribute ``horizon_aware = True``) is told, per request, the TTFT
    past which the selector's choice no longer depends on the exact value: it
    may stop there and return a lower bound past it, with
    :attr:`Latency.lower_bound` set. One that also takes a keyword
    ``next_tokens`` (class attribute ``tpot_aware = True``) is asked, for
    requests with a TPOT target, to predict :attr:`Latency.tpot_s` over that
    many tokens after the first, and with ``residents=True`` the harm to the
    instance's residents (:attr:`Latency.resident_itl_s`). One that also takes
    ``prefix_keys`` (``prefix_aware = True``) gets the content keys of the
    prompt's full blocks (:func:`~bearsdk.replay.blocks.chain_keys`) when the
    caller gave its token ids, to price the instance's cached prefix.
    """

    def estimate(
        self, prompt_tokens: int, output_tokens: int, max_tokens: int | None, now: float
    ) -> Latency:
        """The TTFT a request (tokens predicted for this instance's model) would see now."""
        ...


EstimatorFactory = Callable[[EstimatorContext], "InstanceEstimator | LatencyEstimator"]
"""Builds one instance's estimator."""

_REGISTRY: dict[str, EstimatorFactory] = {}


def register_estimator(name: str, factory: EstimatorFactory, *, replace: bool = False) -> None:
    """Register a latency estimator under ``name`` (what selectors' ``latency`` names).

    Args:
        name: The name.
        factory: Builds the estimator of one instance from its context.
        replace: Replace an estimator of that name (default: refuse).

    Raises:
        EstimatorError: ``name`` is empty, or taken and ``replace`` is false.
    """
    if not isinstance(name, str) or not name:
        raise EstimatorError(f"estimator name must be a non-empty string (got {name!r})")
    if not callable(factory):
        raise EstimatorError(f"estimator {name!r}: factory must be callable (got {factory!r})")
    if name in _REGISTRY and not replace:
        raise EstimatorError(f"estimator {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


def unregister_estimator(name: str) -> None:
    """Remove a registered estimator.

    Raises:
        EstimatorError: ``name`` is not registered.
    """
    if _REGISTRY.pop(name, None) is None:
        raise EstimatorError(_unknown(name))


def estimator_names() -> list[str]:
    """The registered estimator names, in registration order."""
    return list(_REGISTRY)


def _unknown(name: str) -> str:
    return f"estimator {name!r} is not registered (known: {', '.join(_REGISTRY)})"


def build_estimator(name: str, ctx: EstimatorContext) -> InstanceEstimator:
    """Build estimator ``name`` for one instance.

    Raises:
        EstimatorError: ``name`` is not registered, or its factory returned
            neither estimator kind.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise EstimatorError(_unknown(name))
    est = factory(ctx)
    if isinstance(est, InstanceEstimator):
        return est
    if isinstance(est, LatencyEstimator):
        return _ViewEstimator(est, name, ctx)
    raise EstimatorError(
        f"estimator {name!r}: the factory returned {type(est).__name__}, which has "
        "neither estimate_ttft(request, view) nor estimate(...)"
    )


class _ViewEstimator:
    """A :class:`LatencyEstimator` handed the router's view of the instance per request."""

    __slots__ = ("_cache", "_est", "_name", "_view")

    def __init__(self, est: LatencyEstimator, name: str, ctx: EstimatorContext) -> None:
        self._est = est
        self._name = name
        self._view = ctx.view
        self._cache = ctx.state.cache

    def estimate(
        self, prompt_tokens: int, output_tokens: int, max_tokens: int | None, now: float
    ) -> Latency:
        req = RequestInfo(prompt_tokens, output_tokens, max_tokens)
        ttft = self._est.estimate_ttft(req, self._view(now))
        return Latency(float(ttft), self._name, self._cache.age(now))


class _BEA:
    """BEA (eq. 9-12) on the instance's snapshot state; LPS once it is too old."""

    __slots__ = ("_state", "_view")
    horizon_aware = True
    tpot_aware = True
    prefix_aware = True

    def __init__(self, ctx: EstimatorContext) -> None:
        self._state = ctx.state
        self._view = ctx.view

    def estimate(
        self,
        prompt_tokens: int,
        output_tokens: int,
        max_tokens: int | None,
        now: float,
        horizon_s: float = math.inf,
        next_tokens: int = 0,
        residents: bool = False,
        prefix_keys: Sequence[int] | None = None,
    ) -> Latency:
        return Latency(
            *self.fields(
                prompt_tokens,
                output_tokens,
                max_tokens,
                now,
                horizon_s,
                next_tokens,
                residents,
                prefix_keys,
            )
        )

    def fields(
        self,
        prompt_tokens: int,
        output_tokens: int,
        max_tokens: int | None,
        now: float,
        horizon_s: float = math.inf,
        next_tokens: int = 0,
        residents: bool = False,
        prefix_keys: Sequence[int] | None = None,
    ) -> LatencyFields:
        """:meth:`estimate` as :class:`Latency`'s fields in order: the router's
        hot path, which has no use for the object."""
        # (The router's statistics only matter to the fallback estimator: the
        # state summarises them only when the snapshot cannot be replayed.)
        t, mode, age, _, bound, tpot, itl, itl_base = self._state.estimate_fields(
            prompt_tokens,
            output_tokens,
            max_tokens,
            now,
            self._view,
            horizon_s,
            next_tokens,
            residents,
            prefix_keys,
        )
        if mode == "fallback":
            return (t, "lps", age, False, False, NAN, NAN, NAN)
        return (t, mode, age, True, bound, tpot, itl, itl_base)


class _NoLatency:
    """For selectors that use no TTFT estimate."""

    __slots__ = ("_cache",)

    def __init__(self, ctx: EstimatorContext) -> None:
        self._cache = ctx.state.cache

    def estimate(
        self, prompt_tokens: int, output_tokens: int, max_tokens: int | None, now: float
    ) -> Latency:
        return Latency(math.nan, "none", self._cache.age(now))


def _prefill_tps(ctx: EstimatorContext) -> LatencyEstimator:
    from bearsdk.estimators.prefill import PrefillThroughputEstimator, nominal_theta_pre

    return PrefillThroughputEstimator(theta_pre=nominal_theta_pre(ctx.batch_time))


def _shared(cls_name: str) -> EstimatorFactory:
    """A stateless baseline estimator: one object serves every instance."""
    shared: list[LatencyEstimator] = []

    def factory(ctx: EstimatorContext) -> LatencyEstimator:
        if not shared:
            from bearsdk.estimators import baselines

            shared.append(getattr(baselines, cls_name)())
        return shared[0]

    return factory


register_estimator("bea", _BEA)
register_estimator("prefill-tps", _prefill_tps)
register_estimator("score", _shared("ScoreEstimator"))
register_estimator("routebalance", _shared("RouteBalanceEstimator"))
register_estimator("lmdeploy", _shared("LMDeployProxyEstimator"))
register_estimator("semantic-router", _shared("SemanticRouterEstimator"))
register_estimator("none", _NoLatency)


def _learned(ctx: EstimatorContext) -> InstanceEstimator:
    from bearsdk.estimators.learned import LearnedLatency

    return LearnedLatency(ctx)


register_estimator("learned", _learned)

"""Selectors: BEAR, its Lagrangian relaxation, and the paper's baselines.

A selector is any object implementing :class:`Selector`; :func:`make_selector`
builds the built-in ones by name (for configuration files and benchmarks).
"""

from __future__ import annotations

from typing import Any

from bearsdk.errors import BearError
from bearsdk.selectors.base import LATENCY_KINDS, Option, Selection, Selector
from bearsdk.selectors.baselines import (
    LMDeployProxy,
    RoundRobin,
    RouteBalance,
    Score,
    SemanticRouter,
    ShortestQueue,
)
from bearsdk.selectors.bear import BEAR, Lagrangian, LatencyAgnostic, PrefillTPS
from bearsdk.selectors.slo import SLOHeadroom

__all__ = [
    "BEAR",
    "LATENCY_KINDS",
    "SELECTORS",
    "LMDeployProxy",
    "Lagrangian",
    "LatencyAgnostic",
    "Option",
    "PrefillTPS",
    "RoundRobin",
    "RouteBalance",
    "SLOHeadroom",
    "Score",
    "Selection",
    "Selector",
    "SelectorError",
    "SemanticRouter",
    "ShortestQueue",
    "make_selector",
]

SELECTORS: dict[str, type] = {
    "bear": BEAR,
    "lagrangian": Lagrangian,
    "latency-agnostic": LatencyAgnostic,
    "prefill-tps": PrefillTPS,
    "round-robin": RoundRobin,
    "shortest-queue": ShortestQueue,
    "lmdeploy-proxy": LMDeployProxy,
    "semantic-router": SemanticRouter,
    "score": Score,
    "routebalance": RouteBalance,
    "slo-headroom": SLOHeadroom,
}
"""Built-in selectors by name."""


class SelectorError(BearError, ValueError):
    """An unknown selector name or a bad selector parameter."""


def make_selector(name: str, **params: Any) -> Selector:
    """Build a built-in selector by name.

    Args:
        name: One of :data:`SELECTORS`.
        **params: Its parameters (``lam``, ``delta``, ...).

    Raises:
        SelectorError: Unknown name, unknown parameter or bad value.
    """
    cls = SELECTORS.get(name)
    if cls is None:
        raise SelectorError(f"selector {name!r} is not known (known: {', '.join(SELECTORS)})")
    try:
        sel: Selector = cls(**params)
    except TypeError as exc:
        raise SelectorError(f"selector {name!r}: {exc}") from None
    except ValueError as exc:
        raise SelectorError(f"selector {name!r}: {exc}") from None
    return sel

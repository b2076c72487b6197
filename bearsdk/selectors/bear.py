"""BEAR (eq. 5), its Lagrangian relaxation (eq. 7), and the latency-agnostic router.

Ties break toward the earlier option (the pool's order), so decisions are
deterministic for a given state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from bearsdk.selectors.base import Option, Selection

__all__ = ["BEAR", "Lagrangian", "LatencyAgnostic", "PrefillTPS"]


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be a finite number >= 0 (got {value!r})"
        )


def _argmax(values: Sequence[float], allowed: Sequence[bool] | None = None) -> int:
    best = -1
    best_v = -math.inf
    for i, v in enumerate(values):
        if (allowed is None or allowed[i]) and (best < 0 or v > best_v):
            best, best_v = i, v
    return best


def _bear(options: Sequence[Option], target: float) -> Selection:
    utility = [o.utility for o in options]
    feasible = [o.ttft_s <= target for o in options]
    if any(feasible):
        return Selection(
            _argmax(utility, feasible),
            tuple(utility),
            tuple(feasible),
            "best utility among instances predicted to meet the target",
        )
    neg_ttft = [-o.ttft_s for o in options]
    return Selection(
        _argmax(neg_ttft),
        tuple(utility),
        tuple(feasible),
        "no instance predicted to meet the target: lowest predicted TTFT",
    )


@attrs.frozen
class BEAR:
    """Best accuracy - lam * cost among instances predicted (by BEA) to meet the target (eq. 5).

    When none is, the instance with the lowest predicted TTFT.

    Args:
        lam: Cost weight of the utility (eq. 4); the paper uses 5e-4.
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "bear"
    latency: str = "bea"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        return _bear(options, ttft_target_s)


@attrs.frozen
class PrefillTPS:
    """BEAR's rule with the prefill-throughput estimator (eq. 8): the paper's ablation."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "prefill-tps"
    latency: str = "prefill-tps"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        return _bear(options, ttft_target_s)


@attrs.frozen
class Lagrangian:
    """Maximise ``utility - delta * predicted TTFT`` (eq. 7); ignores targets.

    Args:
        lam: Cost weight of the utility.
        delta: Utility given up per second of predicted TTFT (``0``: the
            latency-agnostic router; large: pure TTFT minimisation).
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    delta: float = attrs.field(default=1.0, validator=_nonneg)
    name: str = "lagrangian"
    latency: str = "bea"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        # An instance that can never serve the request (inf TTFT) scores -inf,
        # even with delta = 0 (inf * 0 is nan).
        scores = tuple(
            o.utility - (self.delta * o.ttft_s if math.isfinite(o.ttft_s) else math.inf)
            for o in options
        )
        return Selection(_argmax(scores), scores, None, "best utility - delta * predicted TTFT")


@attrs.frozen
class LatencyAgnostic:
    """Best predicted accuracy - lam * cost, whatever the load (the paper's quality-cost router)."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "latency-agnostic"
    latency: str = "none"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        scores = tuple(o.utility for o in options)
        return Selection(_argmax(scores), scores, None, "best utility")

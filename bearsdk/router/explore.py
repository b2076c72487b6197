"""Bounded exploration: the one way back for an instance nothing tells the router about.

The router learns an instance's speed from its snapshots whenever it runs
anything (:mod:`bearsdk.state.speed`), chosen by this router or not. An
instance that runs nothing gives no evidence: if the router believes it slow,
it sends it nothing, and the belief stands for ever. So a small, seeded share of
decisions go instead to such an instance — one whose speed evidence is older
than ``after_s`` (or absent) — when its predicted TTFT is within ``max_ratio``
of the request's target, i.e. it would still be on time were the belief that
much too pessimistic. The decision says so (``Decision.explored``, reason
``explore: ...``). Busy instances always have fresh evidence, so on a loaded
pool exploration never fires.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs

__all__ = ["Exploration", "Explorer"]


def _share(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and 0.0 <= value <= 0.5):
        raise ValueError(f"exploration: {att.name} must be in [0, 0.5] (got {value!r})")


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"exploration: {att.name} must be a finite number > 0 (got {value!r})")


@attrs.frozen
class Exploration:
    """How often, and where, the router explores.

    Args:
        share: Share of decisions that may explore (0 turns it off).
        after_s: An instance is explored once its speed evidence is older than
            this (seconds, engine clock), or when it has none.
        max_ratio: The explored instance's predicted TTFT must be at most this
            times the request's target.
        seed: Seed of the draws (decisions explore reproducibly).
    """

    share: float = attrs.field(default=0.01, validator=_share)
    after_s: float = attrs.field(default=30.0, validator=_positive)
    max_ratio: float = attrs.field(default=1.5, validator=_positive)
    seed: int = 0


@attrs.define
class Explorer:
    """Draws the exploring decisions of one router (see :class:`Exploration`)."""

    config: Exploration
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.config.seed)

    def draw(self) -> bool:
        """Whether this decision may explore (one seeded draw per decision)."""
        share = self.config.share
        return share > 0.0 and self._rng.random() < share

    def pick(
        self,
        chosen: int,
        ttfts: Sequence[float],
        evidence_at: Sequence[float],
        target: float,
        now: float,
    ) -> tuple[int, str] | None:
        """The instance to explore instead of ``chosen``, with the reason; or ``None``.

        Call it only when :meth:`draw` said yes: building its arguments is
        what the common path saves.

        Args:
            chosen: Index the selector chose.
            ttfts: Each candidate's predicted TTFT (``nan``: no replayed
                estimate, never explored).
            evidence_at: Each candidate's latest speed evidence (``-inf``: none;
                ``nan``: not learned, never explored).
            target: The request's TTFT target.
            now: Clock of the decision (the engines' clock).
        """
        cfg = self.config
        best, oldest = -1, cfg.after_s
        limit = cfg.max_ratio * target
        for i, (ttft, at) in enumerate(zip(ttfts, evidence_at, strict=True)):
            if i == chosen or math.isnan(at) or not ttft <= limit:
                continue
            age = now - at
            if age > oldest:
                best, oldest = i, age
        if best < 0:
            return None
        since = "none yet" if oldest == math.inf else f"{oldest:.0f} s old"
        return best, f"explore: speed evidence {since}"

"""Randomised tie-breaking among near-equal instances (power of d choices).

Policies break ties toward the pool's first instance, so that a decision is a
function of the state. Replicas that share a state then make the same decision
too: every replica sends its next request to the same instance until a
snapshot (or the shared overlay) shows the pile-up. :class:`PowerOfD` wraps any
policy: when the instance it chose has near-equal rivals (same feasibility,
score within ``tolerance``), it samples ``d`` of them at random and takes the
one with the lowest predicted TTFT, drawing at random among those within
``ttft_tolerance_s`` of it. Between replicas the draws differ, so ties spread.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs

from bearsdk.selectors.base import Option, Selection, Selector

__all__ = ["PowerOfD"]


def _d(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"PowerOfD.{att.name} must be an integer >= 1 (got {value!r})")


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"PowerOfD.{att.name} must be a finite number >= 0 (got {value!r})")


@attrs.define(on_setattr=attrs.setters.NO_OP)  # validators at init only: select is hot
class PowerOfD:
    """A policy with its ties among near-equal instances broken at random (power of d).

    Args:
        inner: The policy (BEAR, Lagrangian...).
        d: Tied instances sampled per decision; the sample's lowest predicted
            TTFT wins.
        tolerance: Scores within this of the chosen one's are ties.
        ttft_tolerance_s: Sampled instances whose TTFT is within this of the
            lowest are equally good: one of them is drawn.
        seed: Seeds the draws (default: fresh entropy, different per replica).
    """

    inner: Selector
    d: int = attrs.field(default=2, validator=_d)
    tolerance: float = attrs.field(default=1e-3, validator=_nonneg)
    ttft_tolerance_s: float = attrs.field(default=0.005, validator=_nonneg)
    seed: int | None = None
    _rng: random.Random = attrs.field(init=False)
    _broken: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def name(self) -> str:
        """The inner policy's name (decisions and metrics keep it)."""
        return self.inner.name

    @property
    def latency(self) -> str:
        """The inner policy's TTFT estimate."""
        return self.inner.latency

    @property
    def lam(self) -> float:
        """The inner policy's cost weight."""
        return self.inner.lam

    @property
    def ties_broken(self) -> int:
        """Decisions whose choice had near-equal rivals so far."""
        return self._broken

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """The inner policy's selection, its ties broken at random."""
        sel = self.inner.select(options, ttft_target_s)
        k = sel.index
        if k < 0 or len(options) < 2:
            return sel
        feasible = sel.feasible
        if feasible is not None and not feasible[k]:
            return sel  # nothing meets the target: the policy's own fallback rule
        best = sel.scores[k]
        if not math.isfinite(best):
            return sel
        ties = [
            i
            for i, s in enumerate(sel.scores)
            if (feasible is None or feasible[i]) and abs(s - best) <= self.tolerance
        ]
        if len(ties) < 2:
            return sel
        self._broken += 1
        sample = ties if len(ties) <= self.d else self._rng.sample(ties, self.d)
        ttfts = [options[i].ttft_s for i in sample]
        finite = [t for t in ttfts if math.isfinite(t)]
        if finite:
            low = min(finite)
            near = [
                i
                for i, t in zip(sample, ttfts, strict=True)
                if math.isfinite(t) and t <= low + self.ttft_tolerance_s
            ]
        else:
            near = sample
        pick = self._rng.choice(near)
        if pick == k:
            return sel
        return attrs.evolve(
            sel, index=pick, reason=f"{sel.reason}; tie among {len(ties)} drawn (power of {self.d})"
        )

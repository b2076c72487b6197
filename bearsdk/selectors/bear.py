"""BEAR (eq. 5), its Lagrangian relaxation (eq. 7), and the latency-agnostic router.

Ties break on the next criterion, not by position: among options with the same
score, the lower predicted TTFT, then the lighter load (resident, then
unfinished requests), then a draw from the selector's seeded generator. Two
identical instances therefore share the load instead of the first one taking
every request (decisions stay reproducible for a given seed).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import attrs

from bearsdk.selectors.base import Option, Selection

__all__ = ["BEAR", "Lagrangian", "LatencyAgnostic", "PrefillTPS", "TieBreaking"]


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be a finite number >= 0 (got {value!r})"
        )


def _argmax(
    values: Sequence[float],
    allowed: Sequence[bool] | None = None,
    options: Sequence[Option] | None = None,
    rng: random.Random | None = None,
) -> int:
    """The best allowed index; ties broken as the module says (``-1``: none allowed).

    Without ``options`` ties go to the earliest index (the criteria need them).
    """
    ties: list[int] = []
    best_v = -math.inf
    for i, v in enumerate(values):
        if allowed is not None and not allowed[i]:
            continue
        if not ties or v > best_v:
            best_v = v
            ties = [i]
        elif v == best_v:
            ties.append(i)
    if len(ties) < 2 or options is None:
        return ties[0] if ties else -1
    return _break_tie(ties, options, rng)


def _break_tie(ties: list[int], options: Sequence[Option], rng: random.Random | None) -> int:
    # The lower predicted TTFT (unknown, nan, says nothing; inf is the worst).
    ttft = [options[i].ttft_s for i in ties]
    known = [t for t in ttft if not math.isnan(t)]
    if known:
        low = min(known)
        ties = [i for i, t in zip(ties, ttft, strict=True) if t == low]
    if len(ties) > 1:
        load = [(options[i].queue, options[i].unfinished) for i in ties]
        light = min(load)
        ties = [i for i, x in zip(ties, load, strict=True) if x == light]
    if len(ties) > 1 and rng is not None:
        return ties[rng.randrange(len(ties))]
    return ties[0]


@attrs.frozen
class TieBreaking:
    """What every built-in selector shares: the seeded generator that draws among ties.

    Args:
        seed: Seeds the draws (``None``: fresh entropy).
    """

    seed: int | None = attrs.field(default=0, kw_only=True)
    _rng: random.Random = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_rng", random.Random(self.seed))

    def _best(
        self,
        values: Sequence[float],
        options: Sequence[Option],
        allowed: Sequence[bool] | None = None,
    ) -> int:
        return _argmax(values, allowed, options, self._rng)


def _bear(options: Sequence[Option], target: float, rng: random.Random) -> Selection:
    utility = [o.utility for o in options]
    feasible = [o.ttft_s <= target for o in options]
    if any(feasible):
        return Selection(
            _argmax(utility, feasible, options, rng),
            tuple(utility),
            tuple(feasible),
            "best utility among instances predicted to meet the target",
        )
    neg_ttft = [-o.ttft_s for o in options]
    return Selection(
        _argmax(neg_ttft, None, options, rng),
        tuple(utility),
        tuple(feasible),
        "no instance predicted to meet the target: lowest predicted TTFT",
    )


@attrs.frozen
class BEAR(TieBreaking):
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
        return _bear(options, ttft_target_s, self._rng)


@attrs.frozen
class PrefillTPS(TieBreaking):
    """BEAR's rule with the prefill-throughput estimator (eq. 8): the paper's ablation."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "prefill-tps"
    latency: str = "prefill-tps"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        return _bear(options, ttft_target_s, self._rng)


@attrs.frozen
class Lagrangian(TieBreaking):
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
        return Selection(
            self._best(scores, options), scores, None, "best utility - delta * predicted TTFT"
        )


@attrs.frozen
class LatencyAgnostic(TieBreaking):
    """Best predicted accuracy - lam * cost, whatever the load (the paper's quality-cost router)."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    name: str = "latency-agnostic"
    latency: str = "none"

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        scores = tuple(o.utility for o in options)
        return Selection(self._best(scores, options), scores, None, "best utility")

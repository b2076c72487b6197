"""An SLO-headroom picker in the style of llm-d's predicted-latency scheduling (a baseline).

llm-d's SLO-aware router predicts each pod's p90 TTFT and TPOT with online
regressors (:mod:`bearsdk.estimators.learned` here) and keeps pods with
positive headroom against the request's targets; when none has any, it leans
to the pods least past them, TTFT weighing 0.8 and TPOT 0.2 (its defaults).
In a pool of different models the choice among pods with headroom also has a
quality and a price: like BEAR, this picker takes the best utility among them,
so that the comparison is of the predictions, not of the objective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from bearsdk.selectors.base import Option, Selection
from bearsdk.selectors.bear import TieBreaking, _nonneg

__all__ = ["SLOHeadroom"]


@attrs.frozen
class SLOHeadroom(TieBreaking):
    """Best utility among instances whose learned p90 TTFT and TPOT leave headroom.

    Args:
        lam: Cost weight of the utility.
        ttft_weight: Weight of the TTFT shortfall when no instance has headroom.
        tpot_weight: Weight of the TPOT shortfall then.
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    ttft_weight: float = attrs.field(default=0.8, validator=_nonneg, kw_only=True)
    tpot_weight: float = attrs.field(default=0.2, validator=_nonneg, kw_only=True)
    name: str = "slo-headroom"
    latency: str = "learned"

    def next_tokens(self, tpot_target_s: float) -> int:
        """Ask for a TPOT prediction whenever the request has a TPOT target."""
        return 1 if tpot_target_s != math.inf else 0

    def select(
        self, options: Sequence[Option], ttft_target_s: float, tpot_target_s: float = math.inf
    ) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        utility = [o.utility for o in options]
        feasible = [o.ttft_s <= ttft_target_s and not o.tpot_s > tpot_target_s for o in options]
        if any(feasible):
            return Selection(
                self._best(utility, options, feasible),
                tuple(utility),
                tuple(feasible),
                "best utility among instances with predicted headroom",
            )
        short = [
            -(
                self.ttft_weight * max(o.ttft_s - ttft_target_s, 0.0) / ttft_target_s
                + (
                    0.0
                    if tpot_target_s == math.inf or math.isnan(o.tpot_s)
                    else self.tpot_weight * max(o.tpot_s - tpot_target_s, 0.0) / tpot_target_s
                )
            )
            for o in options
        ]
        return Selection(
            self._best(short, options),
            tuple(utility),
            tuple(feasible),
            "no instance with predicted headroom: the least short of the targets",
        )

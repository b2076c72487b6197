"""What a selector sees and returns.

For one request the router builds an :class:`Option` per routable instance —
predicted accuracy and cost (eq. 4's utility), the TTFT estimate of the latency
estimator the selector asks for, and the load figures baselines use — and asks
the selector to pick one. Selectors are plain objects implementing
:class:`Selector`; users plug their own in without touching the router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

__all__ = ["LATENCY_KINDS", "Option", "Selection", "Selector"]

LATENCY_KINDS = (
    "bea",  # replay (eq. 9-12), LPS fallback when the snapshot is missing or stale
    "prefill-tps",  # eq. 8
    "score",
    "routebalance",
    "lmdeploy",
    "semantic-router",
    "learned",  # llm-d-style online regressors (bearsdk.estimators.learned)
    "none",
)
"""The TTFT estimates a selector can ask the router for (``Selector.latency``)."""


class Option:
    """One instance, as a selector sees it for one request (built per request; slots).

    Attributes:
        instance: Instance name.
        model: Model the instance serves.
        accuracy: Predicted accuracy in [0, 1].
        cost: Predicted cost of the request at this instance, in micro-dollars
            (prompt tokens x input price + output tokens x output price, prices
            in USD per million tokens: the unit the paper's ``lam = 5e-4`` is for).
        utility: ``accuracy - lam * cost`` (eq. 4).
        ttft_s: The estimate of the selector's latency estimator (``nan`` when it
            asked for none; ``inf`` when the request could never be served).
        queue: Requests the router counts as resident there (running + waiting).
        unfinished: Requests the router dispatched there and not seen finish.
        throughput_rps: Measured completions per second (``nan`` when unknown).
        tpot_s: Predicted mean time per output token after the first (``nan``:
            not asked for, see :class:`Selector`, or not known).
        resident_itl_s: The instance's decoding residents' predicted
            inter-token time over the request's window if it is sent there
            (``nan``: not asked for, see :class:`Selector`).
        resident_itl_base_s: The same if it is not.
        resident_tpot_target_s: The tightest TPOT target among the requests
            the router sent there and that are still there (``inf``: none, or
            the selector weighs no residents).
        cached_tokens: The request's prompt tokens the instance is known to
            hold in its prefix cache (``-1``: unknown).
    """

    __slots__ = (
        "accuracy",
        "cached_tokens",
        "cost",
        "instance",
        "model",
        "queue",
        "resident_itl_base_s",
        "resident_itl_s",
        "resident_tpot_target_s",
        "throughput_rps",
        "tpot_s",
        "ttft_s",
        "unfinished",
        "utility",
    )

    def __init__(
        self,
        instance: str,
        model: str,
        accuracy: float,
        cost: float,
        utility: float,
        ttft_s: float = float("nan"),
        queue: int = 0,
        unfinished: int = 0,
        throughput_rps: float = float("nan"),
        tpot_s: float = float("nan"),
        resident_itl_s: float = float("nan"),
        resident_itl_base_s: float = float("nan"),
        resident_tpot_target_s: float = float("inf"),
        cached_tokens: int = -1,
    ) -> None:
        self.instance = instance
        self.model = model
        self.accuracy = accuracy
        self.cost = cost
        self.utility = utility
        self.ttft_s = ttft_s
        self.queue = queue
        self.unfinished = unfinished
        self.throughput_rps = throughput_rps
        self.tpot_s = tpot_s
        self.resident_itl_s = resident_itl_s
        self.resident_itl_base_s = resident_itl_base_s
        self.resident_tpot_target_s = resident_tpot_target_s
        self.cached_tokens = cached_tokens

    def __repr__(self) -> str:
        return (
            f"Option({self.instance!r}, acc={self.accuracy:.3f}, cost={self.cost:.1f}, "
            f"u={self.utility:.3f}, ttft={self.ttft_s:.4f}, queue={self.queue})"
        )


@attrs.frozen
class Selection:
    """A selector's answer.

    Attributes:
        index: Index of the chosen option.
        scores: What the selector maximised, per option (same order).
        feasible: Per option, whether it was predicted to meet the TTFT target
            (``None`` for selectors that do not use targets).
        reason: Why, in a few words (``"best utility among feasible"``...).
    """

    index: int
    scores: tuple[float, ...]
    feasible: tuple[bool, ...] | None
    reason: str


@runtime_checkable
class Selector(Protocol):
    """A selector: picks one instance per request from its options.

    Attributes:
        name: Name shown in decisions and metrics.
        latency: Which TTFT estimate it needs (one of :data:`LATENCY_KINDS`).
        lam: The cost weight of eq. 4's utility (``accuracy - lam * cost``).

    A selector may also define ``horizon(ttft_target_s) -> float``: the TTFT
    past which its choice no longer depends on the exact estimate (BEAR: a
    multiple of the target). The router then lets estimators stop there: an
    option's ``ttft_s`` beyond the horizon is a lower bound past it. Without
    the method every estimate is exact.

    A selector that routes on TPOT too defines ``next_tokens(tpot_target_s)
    -> int``: how many tokens after the first the estimates should follow for
    a request with that TPOT target (``inf``: none), ``0`` for none. The
    router then fills :attr:`Option.tpot_s` (estimators that can) and calls
    ``select(options, ttft_target_s, tpot_target_s=...)``. One that also
    weighs the harm to residents defines
    ``weighs_residents(resident_tpot_target_s) -> bool``, asked per instance
    with the tightest TPOT target of the requests the router sent there and
    that are still there: where it answers yes, the router fills the
    ``resident_*`` fields (a second replay, of the residents alone).

    A selector whose choice is always the best utility among the options it
    deems on time (BEAR) may define ``prunes_by_utility`` true: the router then
    estimates the instances a utility level at a time, best first, and leaves
    those below the first level with an option on time unpriced (their
    ``ttft_s`` is ``inf`` to the selector; ``docs/decision-cost.md``). Such a
    selector must judge each option on its own, never deem one on time whose
    ``ttft_s`` exceeds the TTFT target, and, with no TPOT target, take the
    lowest ``ttft_s`` when none is on time (the router then prices again, past
    the horizon, only the lower bounds that could be the lowest), unless it
    defines ``seeks_least_late`` false: then its choice when none is on time
    does not rank the estimates, and the router does not price again.
    """

    @property
    def name(self) -> str:
        """Name shown in decisions and metrics."""
        ...

    @property
    def latency(self) -> str:
        """Which TTFT estimate it needs (one of :data:`LATENCY_KINDS`)."""
        ...

    @property
    def lam(self) -> float:
        """The cost weight of the utility."""
        ...

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """Pick one option for a request with the given TTFT target (seconds)."""
        ...

"""BEAR (eq. 5), its Lagrangian relaxation (eq. 7), and the latency-agnostic router.

Ties break on the next criterion, not by position: among options with the same
score, the lower predicted TTFT, then, with a ``seed``, a seeded pseudo-random
draw, else the earlier option. Two identical instances therefore share the load
instead of the first one taking every request: the one a request went to looks
slower to the next. Not the in-flight counts: a replica knows only its own, so
with them replicas that share their view (a shared overlay) would decide unlike
one router. The draw is a hash of the seed and the state (the predicted TTFTs,
else the counts), so a decision stays a function of the state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from bearsdk.replay.types import MAX_NEXT_TOKENS
from bearsdk.selectors.base import Option, Selection

__all__ = [
    "AFFINITY_RULES",
    "BEAR",
    "HOME_MARGIN_TOKENS",
    "OVERLOAD_RULES",
    "Lagrangian",
    "LatencyAgnostic",
    "PrefillTPS",
    "TieBreaking",
]


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be a finite number >= 0 (got {value!r})"
        )


def _argmax(
    values: Sequence[float],
    allowed: Sequence[bool] | None = None,
    options: Sequence[Option] | None = None,
    salt: int | None = None,
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
    return _break_tie(ties, options, salt)


_M1: Final = 0x9E3779B97F4A7C15
_M2: Final = 0xBF58476D1CE4E5B9
_MASK64: Final = (1 << 64) - 1


def _draw(salt: int, state: int, n: int) -> int:
    """A pseudo-random index in ``[0, n)`` from a salt and a state (splitmix-style)."""
    z = ((salt * _M1) ^ (state * _M2)) & _MASK64
    z = ((z ^ (z >> 30)) * _M2) & _MASK64
    z ^= z >> 31
    return z % n


def _break_tie(ties: list[int], options: Sequence[Option], salt: int | None) -> int:
    # The lower predicted TTFT (unknown, nan, says nothing; inf is the worst).
    ttft = [options[i].ttft_s for i in ties]
    known = [t for t in ttft if not math.isnan(t)]
    if known:
        low = min(known)
        ties = [i for i, t in zip(ties, ttft, strict=True) if t == low]
    if len(ties) > 1 and salt is not None:
        return ties[_draw(salt, _state(options), len(ties))]
    return ties[0]


def _state(options: Sequence[Option]) -> int:
    """What the draw hashes: the predicted TTFTs (nanoseconds), else the load.

    Both move with every dispatch, so successive ties land on different
    instances; the TTFTs come from the instances' views, which replicas
    sharing an overlay have in common, where the in-flight counts are each
    replica's own.
    """
    ttft = [o.ttft_s for o in options if math.isfinite(o.ttft_s)]
    if ttft:
        return round(sum(ttft) * 1e6)  # microseconds: coarser than any rounding
    return sum(o.queue + o.unfinished for o in options)


@attrs.frozen
class TieBreaking:
    """What every built-in selector shares: how it draws among exact ties.

    Args:
        seed: Salts a pseudo-random draw among options still tied after the
            TTFT and the load (``None``: the earlier option).
    """

    seed: int | None = attrs.field(default=None, kw_only=True)

    def _best(
        self,
        values: Sequence[float],
        options: Sequence[Option],
        allowed: Sequence[bool] | None = None,
    ) -> int:
        return _argmax(values, allowed, options, self.seed)


def _horizon_factor(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (value >= 1.0):  # nan fails too; inf turns the cut-off off
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be a number >= 1 (inf: no cut-off) "
            f"(got {value!r})"
        )


def _horizon(factor: float, target: float) -> float:
    return factor * target if math.isfinite(target) else math.inf


OVERLOAD_RULES: Final = ("lowest-ttft", "least-requests")
"""Where BEAR sends a request no instance is predicted to serve on time."""
AFFINITY_RULES: Final = ("none", "home")
"""What BEAR's ``affinity`` may be: eq. 5 as it is, or the request's home when on time."""
HOME_MARGIN_TOKENS: Final = 256
"""How many more prompt tokens than any other candidate an instance must hold
cached to be the request's home (``BEAR(affinity="home")``): more than a
shared system prompt's blocks, a session's own turns."""


def _home(options: Sequence[Option]) -> int:
    """The option holding clearly the most of the prompt cached (``-1``: none does)."""
    best, first, second = -1, 0, 0
    for i, o in enumerate(options):
        c = o.cached_tokens
        if c > first:
            best, first, second = i, c, first
        elif c > second:
            second = c
    return best if first - second >= HOME_MARGIN_TOKENS else -1


HARM_RULES: Final = ("none", "targets")
"""What BEAR's ``harm`` may be: ignore the residents, or push none past its target."""


def harms(o: Option, rule: str, max_slowdown: float) -> bool:
    """Whether sending the request to ``o`` would break the harm rule (``docs/tpot.md``).

    ``targets``: a resident with a TPOT target the instance meets now would be
    pushed past it; with ``max_slowdown``, the residents' inter-token time
    would also grow by more than that fraction. Unknown (``nan``): no harm.
    """
    with_, base = o.resident_itl_s, o.resident_itl_base_s
    if not (with_ > base):  # nan, or no slower
        return False
    if rule == "targets" and base <= o.resident_tpot_target_s < with_:
        return True
    return with_ > base * (1.0 + max_slowdown)


def _bear(
    options: Sequence[Option],
    target: float,
    salt: int | None,
    tpot_target: float = math.inf,
    harm: str = "none",
    max_slowdown: float = math.inf,
    overload: str = "lowest-ttft",
    affinity: str = "none",
) -> Selection:
    utility = [o.utility for o in options]
    if tpot_target == math.inf:
        feasible = [o.ttft_s <= target for o in options]
    else:
        # An option with no TPOT prediction (a fallback estimate) is judged on TTFT.
        feasible = [
            o.ttft_s <= target and not o.tpot_s > tpot_target and not harms(o, harm, max_slowdown)
            for o in options
        ]
    if any(feasible):
        if affinity == "home":
            home = _home(options)
            if home >= 0 and feasible[home]:
                return Selection(
                    home,
                    tuple(utility),
                    tuple(feasible),
                    "the instance holding the request's prefix, predicted on time",
                )
        return Selection(
            _argmax(utility, feasible, options, salt),
            tuple(utility),
            tuple(feasible),
            "best utility among instances predicted to meet the target"
            if tpot_target == math.inf
            else "best utility among instances predicted to meet both targets",
        )
    if overload == "least-requests":
        # Late anywhere, it earns no on-time utility (eq. 6): keep it off the
        # instances that are still meeting targets for the requests that can.
        # (Never one that cannot serve it at all: an infinite estimate.)
        fewest = [-float(o.queue) for o in options]
        servable = [o.ttft_s != math.inf for o in options]
        return Selection(
            _argmax(fewest, servable if any(servable) else None, options, salt),
            tuple(utility),
            tuple(feasible),
            "no instance predicted on time: fewest requests in flight",
        )
    if tpot_target == math.inf:
        neg_ttft = [-o.ttft_s for o in options]
        return Selection(
            _argmax(neg_ttft, None, options, salt),
            tuple(utility),
            tuple(feasible),
            "no instance predicted to meet the target: lowest predicted TTFT",
        )
    # The least late relative to its targets: the worse of TTFT / target and
    # TPOT / target (an unknown TPOT counts as on target).
    neg_late = [
        -max(o.ttft_s / target, 0.0 if math.isnan(o.tpot_s) else o.tpot_s / tpot_target)
        for o in options
    ]
    return Selection(
        _argmax(neg_late, None, options, salt),
        tuple(utility),
        tuple(feasible),
        "no instance predicted to meet both targets: least late relative to them",
    )


def _flag(inst: object, att: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(inst).__name__}.{att.name} must be true or false (got {value!r})")


def _one_of(rules: tuple[str, ...]) -> Callable[[object, attrs.Attribute[str], str], None]:
    """A validator: the field's value is one of ``rules``."""

    def check(inst: object, att: attrs.Attribute[str], value: str) -> None:
        if value not in rules:
            raise ValueError(
                f"{type(inst).__name__}.{att.name} must be one of {', '.join(rules)} "
                f"(got {value!r})"
            )

    return check


def _slowdown(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be a number >= 0 (inf: no bound) "
            f"(got {value!r})"
        )


def _tpot_tokens(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not 0 <= value <= MAX_NEXT_TOKENS:
        raise ValueError(
            f"{type(inst).__name__}.{att.name} must be an integer in [0, {MAX_NEXT_TOKENS}] "
            f"(got {value!r})"
        )


@attrs.frozen
class BEAR(TieBreaking):
    """Best accuracy - lam * cost among instances predicted (by BEA) to meet the target (eq. 5).

    When none is, the instance with the lowest predicted TTFT (the paper's
    rule), or with ``overload="least-requests"`` the one with the fewest
    requests in flight.

    Only feasibility and, when nothing is feasible, the lowest TTFT matter, so
    an estimate need not be exact past ``horizon_factor`` times the target: the
    router lets the replay stop there (:meth:`horizon`), which bounds the cost
    of a decision by the target rather than by the queue ahead
    (``docs/decision-cost.md``). When every estimate stopped there, the router
    prices the request again further out before the lowest TTFT is taken.

    A request with a TPOT target too is feasible where both are predicted to
    be met and the harm rule holds for the instance's residents: BEA follows
    ``tpot_tokens`` tokens past the first (issue 21); when none is, the
    instance least late relative to its targets.

    Args:
        lam: Cost weight of the utility (eq. 4); the paper uses 5e-4.
        horizon_factor: Estimates are exact up to this multiple of the target
            and lower bounds past it (``inf``: always exact).
        tpot_tokens: Tokens after the first over which TPOT is predicted for
            requests with a TPOT target (``0``: ignore TPOT targets).
        harm: ``"targets"``: no instance where the request would push a
            resident with a TPOT target (one the router sent) past it;
            ``"none"``: the residents are not weighed.
        max_slowdown: Also no instance where it would slow the residents'
            tokens by more than this fraction (``inf``: no bound).
        price_all: Estimate every instance, also those that cannot be chosen
            because one of higher utility is predicted on time (by default the
            router leaves them unpriced: :attr:`prunes_by_utility`).
        overload: Where a request goes that no instance is predicted to serve
            on time: ``"lowest-ttft"``, the least late (for a TPOT target too:
            relative to both targets); ``"least-requests"``, the fewest
            requests in flight (ties: the lower predicted TTFT). Late
            anywhere, such a request earns no on-time utility (eq. 6); sent
            where the least is in flight, it stays off the instances that keep
            meeting targets, the fast ones that ``"lowest-ttft"`` fills in an
            overload. Its estimates need not be exact past the horizon, so an
            overloaded decision costs no second look (``docs/decision-cost.md``).
            The counts are the router's own (:attr:`Option.queue`): replicas
            count each their own, as load balancers' least-request does.
        affinity: ``"home"``: among the instances predicted on time, the one
            holding clearly the most of the request's prompt cached
            (:data:`HOME_MARGIN_TOKENS` more than any other: a session's own
            earlier turns) is chosen even where another has a better utility.
            Eq. 4 prices this request alone; kept home, a session's later turns
            find their prefix there, and no second instance evicts others'
            blocks to hold a copy. The router then prices every instance (no
            pruning by utility). ``"none"``: eq. 5 as it is. Needs the
            prompt's cached tokens per instance (``Option.cached_tokens``:
            token ids with the instances' blocks or KV events, or the router's
            own dispatch index).
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    horizon_factor: float = attrs.field(default=2.0, validator=_horizon_factor, kw_only=True)
    overload: str = attrs.field(
        default="lowest-ttft", validator=_one_of(OVERLOAD_RULES), kw_only=True
    )
    tpot_tokens: int = attrs.field(default=32, validator=_tpot_tokens, kw_only=True)
    harm: str = attrs.field(default="targets", validator=_one_of(HARM_RULES), kw_only=True)
    max_slowdown: float = attrs.field(default=math.inf, validator=_slowdown, kw_only=True)
    price_all: bool = attrs.field(default=False, validator=_flag, kw_only=True)
    affinity: str = attrs.field(default="none", validator=_one_of(AFFINITY_RULES), kw_only=True)
    name: str = "bear"
    latency: str = "bea"

    @property
    def prunes_by_utility(self) -> bool:
        """The choice is the best utility among the options on time (see :class:`Selector`)."""
        return not self.price_all and self.affinity == "none"

    @property
    def seeks_least_late(self) -> bool:
        """Whether a request no instance serves on time goes to the least late
        (see :class:`Selector`)."""
        return self.overload == "lowest-ttft"

    def horizon(self, ttft_target_s: float) -> float:
        """How far past a request's target (seconds) its TTFT estimates must be exact."""
        return _horizon(self.horizon_factor, ttft_target_s)

    def next_tokens(self, tpot_target_s: float) -> int:
        """Tokens to follow past the first for a request with this TPOT target."""
        return self.tpot_tokens if tpot_target_s != math.inf else 0

    def weighs_residents(self, resident_tpot_target_s: float) -> bool:
        """Whether an instance's residents (tightest TPOT target given) need weighing."""
        if self.harm == "none":
            return self.max_slowdown != math.inf
        return resident_tpot_target_s != math.inf or self.max_slowdown != math.inf

    def select(
        self, options: Sequence[Option], ttft_target_s: float, tpot_target_s: float = math.inf
    ) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        return _bear(
            options,
            ttft_target_s,
            self.seed,
            tpot_target_s,
            self.harm,
            self.max_slowdown,
            self.overload,
            self.affinity,
        )


@attrs.frozen
class PrefillTPS(TieBreaking):
    """BEAR's rule with the prefill-throughput estimator (eq. 8): the paper's ablation."""

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    horizon_factor: float = attrs.field(default=2.0, validator=_horizon_factor, kw_only=True)
    price_all: bool = attrs.field(default=False, validator=_flag, kw_only=True)
    name: str = "prefill-tps"
    latency: str = "prefill-tps"

    @property
    def prunes_by_utility(self) -> bool:
        """See :attr:`BEAR.prunes_by_utility`."""
        return not self.price_all

    def horizon(self, ttft_target_s: float) -> float:
        """See :meth:`BEAR.horizon`."""
        return _horizon(self.horizon_factor, ttft_target_s)

    def select(self, options: Sequence[Option], ttft_target_s: float) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        return _bear(options, ttft_target_s, self.seed)


@attrs.frozen
class Lagrangian(TieBreaking):
    """Maximise ``utility - delta * predicted TTFT`` (eq. 7); ignores targets.

    With ``tpot_delta`` it also gives up utility per second of predicted TPOT
    (over ``tpot_tokens`` tokens after the first): the same trade for the
    token rate users feel once the answer streams.

    Args:
        lam: Cost weight of the utility.
        delta: Utility given up per second of predicted TTFT (``0``: the
            latency-agnostic router; large: pure TTFT minimisation).
        tpot_delta: Utility given up per second of predicted TPOT (``0``:
            TPOT is not predicted).
        tpot_tokens: Tokens after the first over which TPOT is predicted.
    """

    lam: float = attrs.field(default=5e-4, validator=_nonneg)
    delta: float = attrs.field(default=1.0, validator=_nonneg)
    tpot_delta: float = attrs.field(default=0.0, validator=_nonneg, kw_only=True)
    tpot_tokens: int = attrs.field(default=32, validator=_tpot_tokens, kw_only=True)
    name: str = "lagrangian"
    latency: str = "bea"

    def next_tokens(self, tpot_target_s: float) -> int:
        """Tokens to follow past the first: ``tpot_tokens`` once TPOT is priced."""
        return self.tpot_tokens if self.tpot_delta > 0.0 else 0

    def select(
        self, options: Sequence[Option], ttft_target_s: float, tpot_target_s: float = math.inf
    ) -> Selection:
        """See :class:`~bearsdk.selectors.Selector`."""
        # An instance that can never serve the request (inf TTFT) scores -inf,
        # even with delta = 0 (inf * 0 is nan).
        scores = tuple(
            o.utility
            - (self.delta * o.ttft_s if math.isfinite(o.ttft_s) else math.inf)
            - (self.tpot_delta * o.tpot_s if self.tpot_delta and math.isfinite(o.tpot_s) else 0.0)
            for o in options
        )
        reason = "best utility - delta * predicted TTFT"
        if self.tpot_delta:
            reason += " - tpot_delta * predicted TPOT"
        return Selection(self._best(scores, options), scores, None, reason)


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

"""Pricing a request at every candidate instance: accuracy, cost and predicted latency.

For each instance, the request's utility (eq. 4) and its BEA estimate (or
the selector's estimator): with the prompt's block chain where its ids are
known (the instance's cached prefix), the learned first-token overhead, the
prompts still to come (``expect_arrivals``) and, for TPOT, their prefill in
the request's decode batches. :meth:`~bearsdk.router.core.RouterCore.decide`
hands the rows to the selector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

from bearsdk.estimators.base import LatencyFields
from bearsdk.estimators.batch_model import prefill_attention_of
from bearsdk.prompts.approx import BLOCK_CHARS
from bearsdk.prompts.ids import PromptIds
from bearsdk.router.slot import InstanceSlot, block_size, cached_tokens, first_token_overhead
from bearsdk.selectors import Option, Selection

if TYPE_CHECKING:
    from bearsdk.router.core import RouterCore

__all__ = [
    "MICRO",
    "UNPRICED",
    "Ask",
    "PruningMemo",
    "Row",
    "price",
    "price_best_first",
    "price_least_late",
    "reprice_lowest",
    "tpot_with_arrivals",
    "ttft_arrivals",
]

MICRO: Final = 1e6
"""Cost unit: micro-dollars (price per million tokens x tokens)."""
MIN_HORIZON_S: Final = 1e-9
"""The shortest horizon a replay is asked for: past it, the first batch is a lower bound."""
MAX_PREFILL_SHARE: Final = 0.9
"""The most of an instance's time the prompts still to come are taken to fill."""
UNPRICED: Final = "unpriced"
"""The estimator of a candidate left unpriced: one of higher utility was on time."""
Row = tuple[Option, str, float, int, int, float, float, bool, int, str, float, float]
"""A candidate as priced: option, estimator, snapshot age, prompt and output
tokens, speed factor, overhead, lower bound, cached tokens and their source,
arrivals, margin."""


def tpot_with_arrivals(tpot_s: float, s: InstanceSlot, now: float) -> float:
    """The replay's TPOT, with the prefills still to come folded in.

    The replay knows the requests in the snapshot; while a request streams its
    answer others arrive, and with chunked prefill their prompts ride in the
    very batches it decodes in. If recent dispatches brought ``rho`` seconds
    of prefill per second, each second of its decoding stretches to
    ``1 / (1 - rho)``. The share is capped: an instance already saturated
    with prefill is not made infinitely slow, only much slower.
    """
    c = s.state.estimator.replay_coeffs
    rho = min(s.stats.prefill_load(now, c[1], c[3]), MAX_PREFILL_SHARE)
    return tpot_s / (1.0 - rho)


def ttft_arrivals(
    ttft_s: float, s: InstanceSlot, now: float, prompt_tokens: int = 1, cached_tokens: int = 0
) -> float:
    """What the prompts still to come add to a replayed TTFT.

    Requests that arrive while the new one waits queue behind it, so they do
    not delay its admission; but vLLM fills every batch's leftover token budget
    with them, and the batch that computes the new request's last prompt
    tokens is usually not full: their prefill rides in it and lengthens it.
    Only what has arrived by the time that batch is scheduled can ride in it,
    and a request whose prefix is cached has little left to compute: that one
    batch is most of its TTFT, and the window for arrivals is what comes
    before it. Eq. 12's terms of the prompt's last chunk alone (its tokens
    past the cache, cut at the token budget, attending to the rest of the
    prompt) are a lower bound on that batch, so ``ttft`` less them bounds the
    window from above. If recent dispatches brought ``rho`` seconds of
    prefill per second, about ``rho`` times the window of it arrives in time,
    and at most one batch's budget of it fits in that batch.

    Args:
        ttft_s: The replayed TTFT.
        s: The instance.
        now: Decision time.
        prompt_tokens: The new request's prompt tokens.
        cached_tokens: Of them, the tokens the instance holds cached (``<= 0``:
            none known).
    """
    c = s.state.estimator.replay_coeffs
    rho = min(s.stats.prefill_load(now, c[1], c[3]), MAX_PREFILL_SHARE)
    budget = s.scheduler.token_budget
    p = max(1, prompt_tokens)
    left = p - min(max(0, cached_tokens), p - 1)
    last = left - budget * ((left - 1) // budget)
    final = c[0] + c[1] * last + c[3] * prefill_attention_of(last, p - last)
    return min(rho * max(0.0, ttft_s - final), c[1] * budget)


_Columns = tuple[list[float], list[float], list[float], list[float]]


@attrs.frozen(eq=False)
class Ask:
    """One request as every instance is priced for it (built once per decision).

    Attributes:
        cols: Accuracy, output tokens, prompt tokens and cost per model, as
            plain lists (indexing numpy arrays element by element costs more).
        max_tokens: Its output cap.
        now: Decision time.
        next_tokens: Tokens past the first to follow (TPOT).
        ids: The prompt's ids, shared or per model.
        approx: The prompt's text and character-block chain (``dispatch_prefixes``).
        priced: Filled with the keys each instance was priced with.
    """

    cols: _Columns
    max_tokens: int | None
    now: float
    next_tokens: int = 0
    ids: PromptIds | dict[str, PromptIds] | None = None
    approx: tuple[str, list[int] | None] = ("", None)
    priced: dict[str, Sequence[int]] | None = None


class _PerModel(dict[int, tuple[float, int, int, float, float, PromptIds | None]]):
    """What depends on the model alone, once per model and decision (a pool has
    few models and may have hundreds of instances): accuracy, output and
    prompt tokens, cost, utility and the prompt's ids, by model index
    (``per_model[s.model_index]``, computed on first use)."""

    __slots__ = ("_ask", "_by_model", "_lam", "_models", "_shared")

    def __init__(self, core: RouterCore, ask: Ask) -> None:
        super().__init__()
        self._ask = ask
        self._lam = core.selector.lam
        self._models = core.predictor.models
        self._shared, self._by_model = _split_ids(ask.ids)

    def __missing__(self, j: int) -> tuple[float, int, int, float, float, PromptIds | None]:
        ask = self._ask
        accs, outs, ptoks, costs = ask.cols
        out = int(outs[j])
        if ask.max_tokens is not None:
            out = min(out, ask.max_tokens)
        p = self._shared if self._by_model is None else self._by_model.get(self._models[j])
        # The engines' own count when the prompt's ids are known.
        ptok = len(p) if p else max(1, int(ptoks[j]))
        acc, cost = accs[j], costs[j] * MICRO
        m = self[j] = (acc, out, ptok, cost, acc - self._lam * cost, p)
        return m


def price(
    core: RouterCore,
    slots: list[InstanceSlot],
    ask: Ask,
    horizon: float = math.inf,
    floor: float | None = None,
) -> list[Row]:
    """Price ``slots`` for one request: each instance's option and how it was estimated.

    Args:
        core: The router (its selector, estimators and settings).
        slots: The candidate instances.
        ask: The request.
        horizon: How far past the target estimates must be exact.
        floor: For a selector that takes the best utility on time, else the
            lowest TTFT (BEAR without a TPOT target): its TTFT target. Each
            instance is then priced exactly only up to ``max(floor, lowest TTFT
            found before it)`` (within ``horizon``): one past both is neither on
            time nor the lowest, and is left a lower bound.
    """
    return _price(core, slots, ask, horizon, None, floor)


def _price(
    core: RouterCore,
    slots: list[InstanceSlot],
    ask: Ask,
    horizon: float,
    per_model: _PerModel | None = None,
    floor: float | None = None,
) -> list[Row]:
    # floor: after each row the horizon becomes max(floor, the lowest TTFT so
    # far) (see price).
    max_tokens, now, next_tokens = ask.max_tokens, ask.now, ask.next_tokens
    approx, priced = ask.approx, ask.priced
    kind = core.selector.latency
    weigh = getattr(core.selector, "weighs_residents", None) if next_tokens else None
    out_rows: list[Row] = []
    if per_model is None:
        per_model = _PerModel(core, ask)
    # (Locals: read once per call, not once per instance.)
    expect_arrivals = core.expect_arrivals
    isfinite, inf, nan = math.isfinite, math.inf, math.nan
    for s in slots:
        acc, out, ptok, cost, utility, p = per_model[s.model_index]
        keys: Sequence[int] | None
        if p is None and s.dispatches is None:
            keys, cached, source, eptok = None, -1, "", ptok
        else:
            keys, cached, source, eptok = _cached(s, p, ptok, approx)
        est = s.estimators.get(kind)
        if est is None:
            est = core.estimator_for(s, kind)
        # (Only a selector that weighs residents needs them: min() is O(requests there).)
        tight = min(s.tpot_targets.values(), default=inf) if weigh else inf
        prefix_keys: Sequence[int] | None = None
        if keys is not None and p is not None and getattr(est, "prefix_aware", False):
            # With the instance's KV events: its snapshot names blocks by vLLM's
            # hashes, which the index maps the prompt's content keys to.
            prefix_keys = keys if s.kv_index is None else s.kv_index.engine_keys(keys)
            if priced is not None:
                priced[s.name] = prefix_keys
        residents = weigh is not None and bool(weigh(tight))
        fields = getattr(est, "fields", None)
        if fields is not None:
            # BEA's own form: every option positional, the fields as a tuple.
            ov = 0.0 if s.overhead_s <= 0.0 else first_token_overhead(s, now)
            left = max(horizon - ov, MIN_HORIZON_S) if horizon != inf else inf
            f: LatencyFields = fields(
                eptok,
                out,
                max_tokens,
                now,
                left,
                next_tokens,
                residents,
                prefix_keys,
            )
        else:
            ov, f = _estimate(
                s, est, (eptok, out, max_tokens, now), horizon, next_tokens, residents, prefix_keys
            )
        ttft, estimator, age, replayed, bound, tpot, itl, itl_base = f
        overhead = ov if replayed else 0.0
        if next_tokens and (isfinite(tpot) or isfinite(itl)):
            stretch = tpot_with_arrivals(1.0, s, now)
            tpot, itl, itl_base = tpot * stretch, itl * stretch, itl_base * stretch
        arrivals = 0.0
        if expect_arrivals and isfinite(ttft):
            arrivals = ttft_arrivals(ttft, s, now, ptok, cached)
        # (The spread is learned on replayed estimates; the others have their own errors.)
        margin = s.margin.value(now) if s.margin is not None and replayed else 1.0
        config = s.config
        n = s.inflight
        option = Option(
            config.name,
            config.model,
            acc,
            cost,
            utility,
            (ttft + arrivals + overhead) * margin,
            n,
            n,
            nan,  # throughput_rps
            tpot,
            itl,
            itl_base,
            tight,
            cached,
        )
        if floor is not None and option.ttft_s < horizon:
            horizon = max(floor, option.ttft_s)
        speed = 1.0 if s.speed is None else s.speed.factor
        out_rows.append(
            (
                option,
                estimator,
                age,
                ptok,
                out,
                speed,
                overhead,
                bound,
                cached,
                source,
                arrivals,
                margin,
            )
        )
    return out_rows


def _estimate(
    s: InstanceSlot,
    est: Any,
    request: tuple[int, int, int | None, float],
    horizon: float,
    next_tokens: int,
    residents: bool,
    prefix_keys: Sequence[int] | None,
) -> tuple[float, LatencyFields]:
    """Any registered estimator's estimate of ``request`` (prompt and output
    tokens, output cap, time), as ``(overhead, fields)``: each estimator is
    asked only for what it says it understands."""
    extra: dict[str, Any] = {} if prefix_keys is None else {"prefix_keys": prefix_keys}
    now = request[3]
    ov = first_token_overhead(s, now)
    if next_tokens and getattr(est, "tpot_aware", False):
        left = max(horizon - ov, MIN_HORIZON_S) if horizon != math.inf else math.inf
        lat = est.estimate(*request, left, next_tokens=next_tokens, residents=residents, **extra)
    elif horizon != math.inf and getattr(est, "horizon_aware", False):
        # A target already eaten by the overhead (a tiny one, or a held request's
        # near its deadline) still gets an estimate: the first batch, a lower bound.
        lat = est.estimate(*request, max(horizon - ov, MIN_HORIZON_S), **extra)
    else:
        lat = est.estimate(*request, **extra)
    return ov, (
        lat.ttft_s,
        lat.estimator,
        lat.age_s,
        lat.replayed,
        lat.lower_bound,
        lat.tpot_s,
        lat.resident_itl_s,
        lat.resident_itl_base_s,
    )


def _split_ids(
    ids: PromptIds | dict[str, PromptIds] | None,
) -> tuple[PromptIds | None, dict[str, PromptIds] | None]:
    """The prompt's ids: the caller's for every instance, or each model's own
    (chains of block keys computed once per model and block size)."""
    return (ids if isinstance(ids, PromptIds) else None), (ids if isinstance(ids, dict) else None)


def _cached(
    s: InstanceSlot, p: PromptIds | None, ptok: int, approx: tuple[str, list[int] | None]
) -> tuple[Sequence[int], int, str, int]:
    """The prompt's block keys at ``s``, the tokens ``s`` holds of it and where
    that is known from, and the prompt tokens left to price."""
    cached, source = -1, ""
    keys: Sequence[int] = ()
    if p is not None:
        bs = block_size(s)
        keys = p.chain(bs)
        cached, source = cached_tokens(s, keys, bs)
    eptok = ptok
    if cached < 0 and s.dispatches is not None and approx[1] is not None:
        # Characters to tokens at this prompt's own ratio; the engine always
        # computes the last token. The replay prices the rest of the prompt.
        hit = s.dispatches.hit_blocks(approx[1]) * BLOCK_CHARS
        cached = min(ptok - 1, hit * ptok // max(1, len(approx[0])))
        source = "dispatches"
        eptok = ptok - cached
    return keys, cached, source, eptok


def unpriced(
    core: RouterCore, slots: list[InstanceSlot], ask: Ask, per_model: _PerModel | None = None
) -> list[Row]:
    """Rows for ``slots`` without a latency estimate (``ttft_s = inf``: never on time).

    What costs little is filled in as :func:`price` fills it: the utility, the
    token counts, the snapshot's age, the speed factor and the prompt's tokens
    each instance holds (an index lookup, no replay).
    """
    now, approx = ask.now, ask.approx
    rows: list[Row] = []
    if per_model is None:
        per_model = _PerModel(core, ask)
    for s in slots:
        acc, out, ptok, cost, utility, p = per_model[s.model_index]
        if p is None and s.dispatches is None:
            cached, source = -1, ""
        else:
            _, cached, source, _ = _cached(s, p, ptok, approx)
        entry = s.cache.entry
        n = s.inflight
        rows.append(
            (
                Option(
                    s.name, s.config.model, acc, cost, utility, math.inf, n, n, cached_tokens=cached
                ),
                UNPRICED,
                math.inf if entry is None else entry.age(now),
                ptok,
                out,
                1.0 if s.speed is None else s.speed.factor,
                0.0,
                False,
                cached,
                source,
                0.0,
                1.0,
            )
        )
    return rows


def price_best_first(
    core: RouterCore,
    slots: list[InstanceSlot],
    ask: Ask,
    horizon: float,
    select: Callable[[list[Option]], Selection],
    target: float,
    floor: float | None = None,
) -> tuple[list[Row], Selection]:
    """Price ``slots`` a utility level at a time, best first, until one is on time.

    For a selector that takes the best utility among the instances it deems on
    time (``Selector.prunes_by_utility``: BEAR), an instance whose utility is
    below that of one on time can never be chosen, so pricing it (a replay)
    changes nothing. Instances of equal utility (the same model) are priced
    together, so that ties still break on their TTFTs; whether a level has an
    instance on time is asked of the selector with that level's options alone
    (such a selector judges each option on its own, and none is on time past
    the TTFT target ``target``). The rest are left
    :func:`unpriced`; the selector's final answer sees them as never on time.
    When no level has an instance on time, every instance is priced, as
    :func:`price` would.

    Args:
        core: The router.
        slots: The candidate instances.
        ask: The request.
        horizon: How far past the target estimates must be exact.
        select: The selector's answer for a list of options.
        target: The request's TTFT target.
        floor: As :func:`price`'s, the lowest TTFT carried from level to level.

    Returns:
        The rows in ``slots``' order, and the selector's answer over all of them.
    """
    # Models of equal utility share a level, so that their ties break on TTFT
    # as without pruning.
    per_model = _PerModel(core, ask)
    by_level: dict[float, list[int]] = {}
    for i, s in enumerate(slots):
        u = per_model[s.model_index][4]
        idx = by_level.get(u)
        if idx is None:
            by_level[u] = [i]
        else:
            idx.append(i)
    if any(u != u for u in by_level):  # (nan)
        rows = _price(core, slots, ask, horizon, per_model)
        return rows, select([r[0] for r in rows])
    levels = sorted(by_level, reverse=True)
    got: list[Row | None] = [None] * len(slots)
    h = horizon
    for k, level in enumerate(levels):
        idx = by_level[level]
        level_rows = _price(core, [slots[i] for i in idx], ask, h, per_model, floor)
        for i, row in zip(idx, level_rows, strict=True):
            got[i] = row
        if floor is not None:
            low = min(r[0].ttft_s for r in level_rows)
            if low < h:
                h = max(floor, low)
        # (On time needs the TTFT target met: a level without one needs no select.)
        if k < len(levels) - 1 and any(r[0].ttft_s <= target for r in level_rows):
            sel = select([r[0] for r in level_rows])
            if sel.feasible is not None and any(sel.feasible):
                rest = [i for i, r in enumerate(got) if r is None]
                left = unpriced(core, [slots[i] for i in rest], ask, per_model)
                for i, row in zip(rest, left, strict=True):
                    got[i] = row
                break
    rows = [r for r in got if r is not None]
    return rows, select([r[0] for r in rows])


def price_least_late(
    core: RouterCore,
    slots: list[InstanceSlot],
    ask: Ask,
    horizon: float,
    far: float,
    first_model: int,
) -> list[Row]:
    """Price an overload, where BEAR takes the lowest TTFT: the likely least late first.

    In an overload (the router's previous decision had no instance on time,
    and the lowest TTFT past the horizon) the request is priced out to ``far``
    at once (see :meth:`~bearsdk.router.core.RouterCore.decide`). Only the
    lowest TTFT needs to be exact then: the instances of ``first_model`` (the
    model the previous overload chose) are priced one after the other, the
    first to ``far`` and each next to ``max(horizon, min(far, lowest so
    far))``, and every other instance to ``max(horizon, min(far, best))``,
    ``best`` the lowest TTFT found among the first. An instance whose TTFT
    exceeds its horizon is left a lower bound past it (often without a replay:
    its queue-ahead or one-token bound says so), and cannot have the lowest
    TTFT; an instance within the target's horizon is
    exact as always, so whether any is on time is still known exactly. The
    choice is the one pricing every instance to ``far`` makes: a row's TTFT
    is at least its estimate plus its overhead (margin >= 1, arrivals >= 0),
    so a lower bound past ``best`` is past it as a row too.

    Args:
        core: The router.
        slots: The candidate instances.
        ask: The request (no tokens to follow: the fallback is on TTFT alone).
        horizon: The target's horizon.
        far: The overload's horizon.
        first_model: The model index whose instances are priced first.

    Returns:
        The rows in ``slots``' order.
    """
    per_model = _PerModel(core, ask)
    first = [i for i, s in enumerate(slots) if s.model_index == first_model]
    if not first or len(first) == len(slots):
        return _price(core, slots, ask, far, per_model, horizon)
    rest = [i for i, s in enumerate(slots) if s.model_index != first_model]
    got: list[Row | None] = [None] * len(slots)
    best = math.inf
    # Each of the first past the lowest TTFT found before it is left a lower bound
    # too (often from its state's one-token bound, without a replay).
    first_rows = _price(core, [slots[i] for i in first], ask, far, per_model, horizon)
    for i, row in zip(first, first_rows, strict=True):
        got[i] = row
        best = min(best, row[0].ttft_s)
    h = max(horizon, min(far, best))
    for i, row in zip(rest, _price(core, [slots[i] for i in rest], ask, h, per_model), strict=True):
        got[i] = row
    return [r for r in got if r is not None]


def reprice_lowest(
    core: RouterCore, slots: list[InstanceSlot], rows: list[Row], ask: Ask, horizon: float
) -> list[Row]:
    """Price again, further out, only the lower bounds that could be the lowest TTFT.

    For BEAR's fallback (no instance on time: the lowest TTFT). An exact
    estimate stays what it was with a longer horizon, and an instance whose
    lower bound exceeds an estimate already in hand cannot have the lowest
    TTFT; so the bounds are priced again from the lowest up, until the next
    one exceeds the lowest value so far. The instance with the lowest TTFT is
    the one pricing every instance again would find (a tie included: only
    bounds strictly above the lowest are left).

    Args:
        core: The router.
        slots: The candidate instances.
        rows: Their rows, every one priced (nothing was on time).
        ask: The request (no tokens to follow: the fallback is on TTFT alone).
        horizon: The longer horizon.

    Returns:
        The rows, those priced again replaced.
    """
    rows = list(rows)
    if ask.next_tokens:
        ask = attrs.evolve(ask, next_tokens=0)
    best = min((r[0].ttft_s for r in rows if not r[7]), default=math.inf)
    for lb, i in sorted((r[0].ttft_s, i) for i, r in enumerate(rows) if r[7]):
        if lb > best:
            break
        (rows[i],) = _price(core, [slots[i]], ask, horizon)
        best = min(best, rows[i][0].ttft_s)
    return rows


@attrs.define
class PruningMemo:
    """Whether pricing best first saved a replay in the router's last decision.

    Best first saves only where an instance on time has a utility above the
    lowest (the instances below its level are left unpriced). Where none is,
    nothing is on time or only the least useful model is, every level is
    priced anyway and the grouping is overhead; such a regime (an overload, a
    pool whose better models are saturated) lasts, so after a decision that
    saved nothing the next is priced at once, and after one priced at once, the
    next goes best first again if it would have saved. The choice is the same
    either way (:func:`price_best_first`); only the cost and which candidates
    are left unpriced follow the memo.
    """

    _helps: bool = True

    def worth_it(self) -> bool:
        """Price the next decision best first."""
        return self._helps

    def observe(self, rows: list[Row], sel: Selection, best_first: bool) -> None:
        """Learn from a decision's rows, priced best first or at once."""
        if best_first:
            self._helps = UNPRICED in [r[1] for r in rows]
            return
        feasible = sel.feasible
        if feasible is None:
            self._helps = False
            return
        on_time = [r[0].utility for r, f in zip(rows, feasible, strict=True) if f]
        self._helps = bool(on_time) and max(on_time) > min(r[0].utility for r in rows)

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
from typing import TYPE_CHECKING, Any, Final

from bearsdk.predictors.predictor import PoolPrediction
from bearsdk.prompts.approx import BLOCK_CHARS
from bearsdk.prompts.ids import PromptIds
from bearsdk.router.slot import InstanceSlot, block_size, cached_tokens, first_token_overhead
from bearsdk.selectors import Option

if TYPE_CHECKING:
    from bearsdk.router.core import RouterCore

__all__ = ["MICRO", "Row", "price", "tpot_with_arrivals", "ttft_arrivals"]

MICRO: Final = 1e6
"""Cost unit: micro-dollars (price per million tokens x tokens)."""
MIN_HORIZON_S: Final = 1e-9
"""The shortest horizon a replay is asked for: past it, the first batch is a lower bound."""
MAX_PREFILL_SHARE: Final = 0.9
"""The most of an instance's time the prompts still to come are taken to fill."""
Row = tuple[Option, str, float, int, int, float, float, bool, int, str, float]
"""A candidate as priced: option, estimator, snapshot age, prompt and output
tokens, speed factor, overhead, lower bound, cached tokens and their source,
arrivals."""


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


def ttft_arrivals(ttft_s: float, s: InstanceSlot, now: float) -> float:
    """What the prompts still to come add to a replayed TTFT.

    Requests that arrive while the new one waits queue behind it, so they do
    not delay its admission; but vLLM fills every batch's leftover token budget
    with them, and the batch that computes the new request's last prompt
    tokens is usually not full: their prefill rides in it and lengthens it. A
    request whose prefix is cached has little left to compute, and that one
    batch is most of its TTFT. If recent dispatches brought ``rho`` seconds
    of prefill per second, about ``rho * ttft`` seconds of it arrive while it
    waits, and at most one batch's budget of it fits in that batch.
    """
    c = s.state.estimator.replay_coeffs
    rho = min(s.stats.prefill_load(now, c[1], c[3]), MAX_PREFILL_SHARE)
    return min(rho * ttft_s, c[1] * s.scheduler.token_budget)


def price(
    core: RouterCore,
    slots: list[InstanceSlot],
    pred: PoolPrediction,
    max_tokens: int | None,
    now: float,
    horizon: float = math.inf,
    next_tokens: int = 0,
    ids: PromptIds | dict[str, PromptIds] | None = None,
    approx: tuple[str, list[int] | None] = ("", None),
    priced: dict[str, list[int]] | None = None,
) -> list[Row]:
    """Price ``slots`` for one request: each instance's option and how it was estimated.

    Args:
        core: The router (its selector, estimators and settings).
        slots: The candidate instances.
        pred: The request's predictions for every model.
        max_tokens: Its output cap.
        now: Decision time.
        horizon: How far past the target estimates must be exact.
        next_tokens: Tokens past the first to follow (TPOT).
        ids: The prompt's ids, shared or per model.
        approx: The prompt's text and character-block chain (``dispatch_prefixes``).
        priced: Filled with the keys each instance was priced with.
    """
    lam = core.selector.lam
    kind = core.selector.latency
    weigh = getattr(core.selector, "weighs_residents", None) if next_tokens else None
    # The prompt's ids: the caller's for every instance, or each model's own
    # (chains of block keys computed once per model and block size).
    shared = ids if isinstance(ids, PromptIds) else None
    by_model = ids if isinstance(ids, dict) else None
    out_rows: list[Row] = []
    # Plain lists: indexing numpy arrays element by element costs more.
    accs, outs = pred.accuracy.tolist(), pred.output_tokens.tolist()
    ptoks, costs = pred.prompt_tokens.tolist(), pred.cost_usd.tolist()
    for s in slots:
        j = s.model_index
        acc = accs[j]
        out = int(outs[j])
        if max_tokens is not None:
            out = min(out, max_tokens)
        p = shared if by_model is None else by_model.get(s.config.model)
        # The engines' own count when the prompt's ids are known.
        ptok = len(p) if p else max(1, int(ptoks[j]))
        cost = costs[j] * MICRO
        est = s.estimators.get(kind)
        if est is None:
            est = core.estimator_for(s, kind)
        # (Only a selector that weighs residents needs them: min() is O(requests there).)
        tight = min(s.tpot_targets.values(), default=math.inf) if weigh else math.inf
        extra: dict[str, Any] = {}
        cached, source = -1, ""
        keys: list[int] = []
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
        if p is not None and getattr(est, "prefix_aware", False):
            # With the instance's KV events: its snapshot names blocks by vLLM's
            # hashes, which the index maps the prompt's content keys to.
            extra["prefix_keys"] = keys if s.kv_index is None else s.kv_index.engine_keys(keys)
            if priced is not None:
                priced[s.name] = extra["prefix_keys"]
        if next_tokens and getattr(est, "tpot_aware", False):
            ov = first_token_overhead(s, now)
            left = max(horizon - ov, MIN_HORIZON_S) if horizon != math.inf else math.inf
            lat = est.estimate(  # type: ignore[call-arg]
                eptok,
                out,
                max_tokens,
                now,
                left,
                next_tokens=next_tokens,
                residents=weigh is not None and bool(weigh(tight)),
                **extra,
            )
            overhead = ov if lat.replayed else 0.0
        elif horizon != math.inf and getattr(est, "horizon_aware", False):
            ov = first_token_overhead(s, now)
            # A target already eaten by the overhead (a tiny one, or a held request's
            # near its deadline) still gets an estimate: the first batch, a lower bound.
            left = max(horizon - ov, MIN_HORIZON_S)
            lat = est.estimate(eptok, out, max_tokens, now, left, **extra)  # type: ignore[call-arg]
            overhead = ov if lat.replayed else 0.0
        else:
            lat = est.estimate(eptok, out, max_tokens, now, **extra)
            overhead = first_token_overhead(s, now) if lat.replayed else 0.0
        tpot = lat.tpot_s
        itl, itl_base = lat.resident_itl_s, lat.resident_itl_base_s
        if next_tokens and (math.isfinite(tpot) or math.isfinite(itl)):
            stretch = tpot_with_arrivals(1.0, s, now)
            tpot, itl, itl_base = tpot * stretch, itl * stretch, itl_base * stretch
        arrivals = 0.0
        if core.expect_arrivals and math.isfinite(lat.ttft_s):
            arrivals = ttft_arrivals(lat.ttft_s, s, now)
        option = Option(
            s.name,
            s.config.model,
            acc,
            cost,
            acc - lam * cost,
            lat.ttft_s + arrivals + overhead,
            s.inflight,
            s.inflight,
            tpot_s=tpot,
            resident_itl_s=itl,
            resident_itl_base_s=itl_base,
            resident_tpot_target_s=tight,
        )
        speed = 1.0 if s.speed is None else s.speed.factor
        out_rows.append(
            (
                option,
                lat.estimator,
                lat.age_s,
                ptok,
                out,
                speed,
                overhead,
                lat.lower_bound,
                cached,
                source,
                arrivals,
            )
        )
    return out_rows

"""Drive a workload through an :class:`~bearsdk.router.AsyncRouter` in real time and score it.

The paper's metric is **OnTimeUtility** (eq. 6): the mean over all requests of
the realized utility ``accuracy - lam * cost`` at the instance that served the
request, counting zero for a request whose first token missed its TTFT target
(or that failed). ``bearsdk demo`` and ``examples/batch_eval.py`` are built on
:func:`drive_workload` and :func:`summarize`.

Costs are in micro-dollars, as the router's: a model's price in USD per million
tokens times tokens, so the paper's ``lam = 5e-4`` weighs a 1,000-token answer
from Qwen3-32B (0.64 $/Mtok) at 0.32 accuracy points.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
import numpy as np

from bearsdk.router.router import AsyncRouter, ChatStream, DispatchError, NoInstanceError
from bearsdk.workload import WorkItem

__all__ = ["RequestResult", "RunSummary", "drive_workload", "summarize"]

TokenLookup = Callable[[str, str], "tuple[int, int] | None"]
"""``(instance, request_id) -> (prompt_tokens, output_tokens)`` for requests cut off
before their last token (an in-process engine knows what it would have generated)."""


@attrs.frozen
class RequestResult:
    """What happened to one request.

    Attributes:
        index: The work item's index.
        task: Its task.
        instance: The instance that served it (``None``: it failed).
        model: That instance's model.
        ttft_s: Observed time to first token (``None``: none arrived).
        ttft_target_s: Its target.
        predicted_ttft_s: The router's prediction at the chosen instance.
        accuracy: True accuracy at the model that served it.
        cost: Realized cost, micro-dollars.
        prompt_tokens: Prompt tokens as the engine counted them.
        output_tokens: Output tokens (generated, or planned when cut off).
        error: Why it failed, if it did.
    """

    index: int
    task: str
    instance: str | None
    model: str | None
    ttft_s: float | None
    ttft_target_s: float
    predicted_ttft_s: float | None
    accuracy: float
    cost: float
    prompt_tokens: int
    output_tokens: int
    error: str | None = None

    @property
    def on_time(self) -> bool:
        """The first token arrived within the target."""
        return self.ttft_s is not None and self.ttft_s <= self.ttft_target_s

    def utility(self, lam: float) -> float:
        """Realized ``accuracy - lam * cost`` (0 for a failed request)."""
        return 0.0 if self.instance is None else self.accuracy - lam * self.cost


@attrs.frozen
class RunSummary:
    """One policy on one workload.

    Attributes:
        policy: Policy name.
        rate: Mean arrival rate, requests/s.
        n: Requests sent.
        on_time_utility: Eq. 6.
        attainment: Share of requests whose first token met the target.
        mean_utility: Mean realized utility, on time or not.
        mean_accuracy: Mean true accuracy of the served requests.
        mean_cost: Mean realized cost, micro-dollars.
        composition: Share of requests per instance (failed ones under ``""``).
        ttft_p50_s: Median observed TTFT.
        ttft_p99_s: Its 99th percentile.
        ttft_mape: Mean absolute percentage error of the chosen instance's predicted TTFT.
        failed: Requests that got no instance or no answer.
        arrival_lag_p99_s: 99th percentile of how late requests were sent (the
            driver's event loop falling behind; large values mean an overloaded machine).
        wall_s: Wall time of the run.
    """

    policy: str
    rate: float
    n: int
    on_time_utility: float
    attainment: float
    mean_utility: float
    mean_accuracy: float
    mean_cost: float
    composition: Mapping[str, float]
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mape: float
    failed: int
    arrival_lag_p99_s: float
    wall_s: float


@attrs.define
class _Pending:
    item: WorkItem
    stream: ChatStream | None = None
    error: str | None = None


def _model_prices(router: AsyncRouter) -> dict[str, tuple[float, float]]:
    from bearsdk.predictors import Predictor

    pred = router.predictor
    # A table-driven predictor has no price list: its costs were given with it.
    pool = pred.pool if isinstance(pred, Predictor) else ()
    return {m.name: (m.input_price, m.output_price) for m in pool}


async def drive_workload(
    router: AsyncRouter,
    items: Sequence[WorkItem],
    *,
    tail_s: float | None = None,
    lookup: TokenLookup | None = None,
    on_result: Callable[[RequestResult], None] | None = None,
    **params: Any,
) -> tuple[list[RequestResult], float]:
    """Send every item at its arrival time as a streamed chat request; wait for the outcomes.

    Each request is routed with its own TTFT target. Every request gets exactly
    one :class:`RequestResult`. With ``tail_s``, streams still open that long
    after the last arrival are closed (their first-token outcome is known by
    then when ``tail_s`` exceeds the largest target) and their output length
    comes from ``lookup``, else from the router's prediction.

    Args:
        router: A started router.
        items: The workload, in arrival order.
        tail_s: How long to wait after the last arrival (``None``: until every
            response is complete).
        lookup: Tokens of requests cut off by ``tail_s``.
        on_result: Called with each result as it is known (progress).
        **params: Further OpenAI parameters for every request.

    Returns:
        The results in item order, and the 99th percentile of the send lag, seconds.
    """
    prices = _model_prices(router)
    pending = [_Pending(it) for it in items]
    results: list[RequestResult | None] = [None] * len(items)
    lags: list[float] = []

    def result_of(p: _Pending, cut: bool) -> RequestResult:
        it, s = p.item, p.stream
        if s is None:
            return RequestResult(
                it.index, it.task, None, None, None, it.ttft_target_s, None, 0.0, 0.0, 0, 0,
                p.error or "not sent",
            )  # fmt: skip
        model = router.instance_config(s.instance).model
        usage = s.usage or {}
        prompt = int(usage.get("prompt_tokens") or s.decision.prompt_tokens)
        output = int(usage.get("completion_tokens") or 0)
        if not usage:
            known = lookup(s.instance, s.decision.request_id) if lookup is not None else None
            if known is not None:
                prompt, output = known
            else:
                output = max(output, s.decision.output_tokens)
        pin, pout = prices.get(model, (0.0, 0.0))
        return RequestResult(
            it.index,
            it.task,
            s.instance,
            model,
            s.ttft_s,
            it.ttft_target_s,
            s.decision.chosen.ttft_estimate_s,
            float(it.accuracy.get(model, 0.0)),
            prompt * pin + output * pout,
            prompt,
            output,
            None if cut else p.error,
        )

    def settle(k: int, cut: bool = False) -> None:
        if results[k] is None:
            r = results[k] = result_of(pending[k], cut)
            if on_result is not None:
                on_result(r)

    async def one(k: int) -> None:
        p = pending[k]
        try:
            s = await router.chat(
                p.item.messages, ttft_target=p.item.ttft_target_s, stream=True, **params
            )
            assert isinstance(s, ChatStream)
            p.stream = s
            async with s:
                async for _ in s:
                    pass
        except (NoInstanceError, DispatchError) as exc:
            # A stream that broke after its first token still served the request.
            p.error = f"{type(exc).__name__}: {exc}"
        settle(k)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k, it in enumerate(items):
            delay = start + it.arrival_s - time.perf_counter()
            if delay > 0:
                await anyio.sleep(delay)
            lags.append(max(0.0, -delay))
            tg.start_soon(one, k)
        if tail_s is not None:
            await anyio.sleep(max(0.0, start + items[-1].arrival_s + tail_s - time.perf_counter()))
            tg.cancel_scope.cancel()
    for k in range(len(items)):
        settle(k, cut=True)
    lag_p99 = float(np.percentile(lags, 99)) if lags else 0.0
    return [r for r in results if r is not None], lag_p99


def summarize(
    policy: str,
    rate: float,
    results: Sequence[RequestResult],
    *,
    lam: float,
    arrival_lag_p99_s: float = 0.0,
    wall_s: float = 0.0,
) -> RunSummary:
    """Score a run: OnTimeUtility (eq. 6), attainment, composition, TTFT error.

    Args:
        policy: Policy name (for the record).
        rate: Arrival rate (for the record).
        results: One per request.
        lam: Cost weight of the utility.
        arrival_lag_p99_s: From :func:`drive_workload`.
        wall_s: Wall time of the run.
    """
    n = len(results)
    if n == 0:
        raise ValueError("results: no requests to summarize")
    served = [r for r in results if r.instance is not None]
    comp: dict[str, float] = {}
    for r in results:
        comp[r.instance or ""] = comp.get(r.instance or "", 0.0) + 1.0 / n
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    errs = [
        abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s
        for r in results
        if r.ttft_s and r.predicted_ttft_s is not None and math.isfinite(r.predicted_ttft_s)
    ]
    return RunSummary(
        policy=policy,
        rate=rate,
        n=n,
        on_time_utility=sum(r.utility(lam) for r in results if r.on_time) / n,
        attainment=sum(r.on_time for r in results) / n,
        mean_utility=sum(r.utility(lam) for r in results) / n,
        mean_accuracy=float(np.mean([r.accuracy for r in served])) if served else 0.0,
        mean_cost=float(np.mean([r.cost for r in served])) if served else 0.0,
        composition=dict(sorted(comp.items())),
        ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts else math.nan,
        ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else math.nan,
        ttft_mape=float(np.mean(errs)) if errs else math.nan,
        failed=n - len(served),
        arrival_lag_p99_s=arrival_lag_p99_s,
        wall_s=wall_s,
    )

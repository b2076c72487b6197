"""What the router learns from the requests it routed: RouterCore's feedback half.

Dispatches, first tokens and completions update each instance's state and
statistics, its learned first-token overhead and TTFT margin, the estimators
that learn (LPS), and the predictor's token counts; the readers below report
what was learned. :class:`~bearsdk.router.core.RouterCore` inherits these
methods; they rely on its clock, hooks, predictor and pool.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bearsdk.errors import BearError
from bearsdk.predictors.protocol import PoolPredictor
from bearsdk.router.breaker import BreakerState
from bearsdk.router.decision import Decision
from bearsdk.router.hooks import RouterHooks
from bearsdk.router.slot import (
    OVERHEAD_MAX_S,
    OVERHEAD_MEMORY_S,
    InstanceSlot,
    first_token_overhead,
)

__all__ = ["RouterFeedback"]


class RouterFeedback:
    """The feedback and reading methods of :class:`~bearsdk.router.core.RouterCore`."""

    clock: Callable[[], float]
    hooks: RouterHooks
    predictor: PoolPredictor
    _dispatch_keys: OrderedDict[tuple[str, str], Sequence[int]]

    def slot(self, name: str) -> InstanceSlot:
        """The slot of instance ``name`` (RouterCore's)."""
        raise NotImplementedError

    def sent(self, s: InstanceSlot, d: Decision, now: float) -> None:
        """A request following ``d`` was sent to ``s`` at ``now``."""
        # (The chosen one by index: the others are built only if read.)
        c = (
            d.chosen
            if s.name == d.instance
            else next(c for c in d.candidates if c.instance == s.name)
        )
        s.inflight += 1
        if d.tpot_target_s != math.inf:
            s.tpot_targets[d.request_id] = d.tpot_target_s
        keys = self._dispatch_keys.get((d.request_id, s.name), ())
        s.state.on_dispatch(
            d.request_id, c.prompt_tokens, c.output_tokens, now=now, prefix_keys=keys
        )
        if s.shadow is not None:
            s.shadow.on_dispatch(d.request_id, c.prompt_tokens, output_len=c.output_tokens)
        s.stats.on_dispatch(
            d.request_id, now, c.prompt_tokens, c.output_tokens, max(0, c.cached_tokens)
        )
        for est in s.estimators.values():
            learn = getattr(est, "learn_dispatch", None)
            if learn is not None:
                learn(d.request_id, c.prompt_tokens, now)
        for hook in self.hooks.on_dispatch:
            hook(d, s.name, now)

    def unsent(self, s: InstanceSlot, d: Decision) -> None:
        """A sent request never reached the engine (or was refused): off the books."""
        s.inflight -= 1
        s.tpot_targets.pop(d.request_id, None)
        now = self.clock()
        s.state.on_complete(d.request_id, now=now)
        s.stats.on_abort(d.request_id, now)
        if s.shadow is not None:
            s.shadow.on_complete(d.request_id)

    def first_token(
        self, s: InstanceSlot, d: Decision, observed: float, now: float | None = None
    ) -> None:
        """The first token of a request at ``s`` arrived ``observed`` seconds after sending.

        ``now`` is when it arrived on the router's clock (default: now), for a
        report made after the chunk was passed on.
        """
        if now is None:
            now = self.clock()
        s.breaker.on_answer()
        # The engine produced it the network and HTTP time before it came.
        s.state.on_tokens(d.request_id, 1, at=now - first_token_overhead(s, now))
        s.stats.on_first_token(d.request_id, now)
        for est in s.estimators.values():
            learn = getattr(est, "learn_first_token", None)
            if learn is not None:
                learn(d.request_id, observed, now)
        if s.shadow is not None:
            s.shadow.on_tokens(d.request_id, 1)
        if s.name == d.instance:
            c = d.chosen
            pred = c.ttft_estimate_s
            # A lower bound past the horizon says nothing about the model's error.
            if math.isfinite(pred) and observed > 0 and not c.ttft_lower_bound:
                s.ttft_abs_err_sum += abs(pred - observed)
                s.ttft_rel_err_sum += abs(pred - observed) / observed
                s.ttft_err_n += 1
                if c.estimator != "lps":
                    if now - s.overhead_at > OVERHEAD_MEMORY_S:
                        s.residuals.clear()
                        s.observed_ttfts.clear()
                    # The median of recent residuals: a mean would be dragged up by
                    # requests that reach the engine just after it formed the next
                    # batch (a whole batch late) and overpredict everything else.
                    s.residuals.append(observed - (pred - c.overhead_s))
                    s.observed_ttfts.append(observed)
                    bound = min(OVERHEAD_MAX_S, min(s.observed_ttfts))
                    s.overhead_s = min(max(statistics.median(s.residuals), 0.0), bound)
                    s.overhead_at = now
                    if s.margin is not None:
                        s.margin.observe(observed, pred, now)
        for hook in self.hooks.on_first_token:
            hook(d, s.name, observed)

    def tokens(self, s: InstanceSlot, now: float | None = None) -> None:
        """More tokens of a request at ``s`` have come after its first, the latest
        at ``now`` (default: now): an engine step there ended just before.

        (The first token alone changes what the dispatch overlay shows: later
        ones move no view, whose rebuild they would cost.)
        """
        if now is None:
            now = self.clock()
        s.state.on_step_end(now - first_token_overhead(s, now))

    def completed(
        self,
        s: InstanceSlot,
        d: Decision,
        outcome: str,
        usage: Mapping[str, Any] | None,
        prompt: str,
    ) -> None:
        """A request at ``s`` ended (``"ok"``, ``"error"`` or ``"cancelled"``)."""
        now = self.clock()
        if outcome == "ok":
            self.tokens(s, now)  # its last token ended a step, as every streamed one does
        s.inflight -= 1
        s.tpot_targets.pop(d.request_id, None)
        out = None if not usage else usage.get("completion_tokens")
        known = out if outcome == "ok" and isinstance(out, int) and out > 0 else None
        s.state.on_complete(d.request_id, now=now, output_tokens=known)
        if s.shadow is not None:
            s.shadow.on_complete(d.request_id)
        if usage:
            ptok = usage.get("prompt_tokens")
            if isinstance(ptok, int) and ptok > 0 and prompt:
                # The engine's count teaches the predictor this model's tokens per char.
                self.predictor.observe_usage(s.config.model, prompt, ptok)
        if outcome == "ok":
            s.stats.on_complete(
                d.request_id, now, out if isinstance(out, int) and out > 0 else None
            )
        else:
            s.stats.on_abort(d.request_id, now)
        for est in s.estimators.values():
            learn = getattr(est, "learn_complete", None)
            if learn is not None:
                learn(d.request_id, known, now)
        for hook in self.hooks.on_complete:
            hook(d, s.name, outcome)

    def record_dispatch(self, decision: Decision, instance: str | None = None) -> None:
        """Tell the router a request was sent (when something else than the router
        sends it: a simulator, or an application with its own HTTP client).

        Args:
            decision: The decision the request followed.
            instance: Where it went (default: the decision's instance).
        """
        self.sent(self.slot(instance or decision.instance), decision, self.clock())

    def record_first_token(self, decision: Decision, instance: str, ttft_s: float) -> None:
        """Tell the router the request's first token arrived after ``ttft_s`` seconds."""
        self.first_token(self.slot(instance), decision, ttft_s)

    def record_tokens(self, instance: str, *, at: float | None = None) -> None:
        """Tell the router a token of a request it sent to ``instance`` (after the
        first) arrived at ``at`` on its clock (default: now), when something
        else than the router reads the stream. Each ends an engine step:
        fast-forwarded views place their batch in flight by the latest
        (``StalenessRules.anchor_steps``, ``docs/snapshots.md``).
        """
        self.tokens(self.slot(instance), at)

    def record_complete(
        self,
        decision: Decision,
        instance: str,
        *,
        outcome: str = "ok",
        usage: Mapping[str, Any] | None = None,
        prompt: str = "",
    ) -> None:
        """Tell the router the request ended (``"ok"``, ``"error"`` or ``"cancelled"``).

        Args:
            decision: Its decision.
            instance: Where it ran.
            outcome: How it ended.
            usage: The engine's usage report, if any (teaches token counts).
            prompt: Its prompt text (with ``usage``, teaches token counts).
        """
        if outcome not in ("ok", "error", "cancelled"):
            raise BearError(f"outcome must be 'ok', 'error' or 'cancelled' (got {outcome!r})")
        self.completed(self.slot(instance), decision, outcome, usage, prompt)

    # ------------------------------------------------------------------ reading

    def inflight(self, name: str) -> int:
        """Requests sent to ``name`` whose response has not ended (all finished: 0)."""
        return self.slot(name).inflight

    def breaker_state(self, name: str) -> BreakerState:
        """The state of ``name``'s circuit breaker now (closed, open or half-open)."""
        return self.slot(name).breaker.state(self.clock())

    def overhead(self, name: str) -> float:
        """The learned dispatch overhead added to ``name``'s replayed TTFTs now (seconds).

        The median of recent first-token residuals, never above the fastest of
        those first tokens nor :data:`OVERHEAD_MAX_S`, fading over
        :data:`OVERHEAD_MEMORY_S` while no first token confirms it.
        """
        return first_token_overhead(self.slot(name), self.clock())

    def margin(self, name: str) -> float:
        """The factor ``name``'s replayed TTFTs are widened by now (1: none; see
        :mod:`bearsdk.router.margin`)."""
        m = self.slot(name).margin
        return 1.0 if m is None else m.value(self.clock())

    def ttft_error(self, name: str) -> tuple[float, float, int]:
        """``(MAE seconds, MAPE, n)`` of the router's TTFT predictions at ``name`` so far."""
        s = self.slot(name)
        n = s.ttft_err_n
        if n == 0:
            return (math.nan, math.nan, 0)
        return (s.ttft_abs_err_sum / n, s.ttft_rel_err_sum / n, n)

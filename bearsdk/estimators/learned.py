"""A learned TTFT/TPOT predictor in the style of llm-d's SLO-aware routing (a baseline).

llm-d's predicted-latency scheduling (the Gateway API Inference Extension's
SLO-aware router with its latency-predictor sidecars) trains gradient-boosted
trees online on the traffic it routes: features of the pod at dispatch (KV
cache usage, the request's input length, waiting and running requests) to
the p90 TTFT and p90 TPOT it then observed; the picker keeps pods whose
predicted latencies leave headroom against the request's targets. This module
is that predictor, one per instance (llm-d assumes identical pods; a pool of
different models needs one model each): LightGBM quantile regression
(``alpha = 0.9``) retrained every :attr:`LearnedLatency.retrain_every` new
samples over a bounded window. Until it has :attr:`LearnedLatency.min_samples`
samples it predicts zero latency, so every instance is tried (llm-d explores
the same way). It needs no snapshot replay: only the engine's counts, from
the cached snapshot, and the router's own dispatches.

The router teaches it through the ``learn_*`` methods (dispatch, first token,
completion); :class:`~bearsdk.selectors.SLOHeadroom` is the picker.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from bearsdk.estimators.base import Latency
from bearsdk.snapshot import COL_STATE, STATE_RUNNING

if TYPE_CHECKING:
    from bearsdk.estimators.registry import EstimatorContext

__all__ = ["LearnedLatency"]

_FEATURES = ("input_tokens", "running", "waiting", "kv_usage", "pending_prefill_tokens")


class LearnedLatency:
    """Per-instance p90 TTFT and TPOT regressors, trained online (see the module).

    Args:
        ctx: The instance, as the estimator registry hands it over.
        window: Samples kept per target (the oldest go first).
        min_samples: Samples before a model predicts (before: zero, so it explores).
        retrain_every: New samples between two fits.
    """

    horizon_aware = False
    tpot_aware = True

    def __init__(
        self,
        ctx: EstimatorContext,
        window: int = 4000,
        min_samples: int = 50,
        retrain_every: int = 200,
    ) -> None:
        self._state = ctx.state
        self._cache = ctx.state.cache
        self.window = window
        self.min_samples = min_samples
        self.retrain_every = retrain_every
        self._pending: dict[str, tuple[list[float], float]] = {}
        self._first: dict[str, float] = {}
        self._x: dict[str, deque[list[float]]] = {k: deque(maxlen=window) for k in ("ttft", "tpot")}
        self._y: dict[str, deque[float]] = {k: deque(maxlen=window) for k in ("ttft", "tpot")}
        self._new = {"ttft": 0, "tpot": 0}
        self._model: dict[str, Any] = {"ttft": None, "tpot": None}
        self._dispatched_prefill = 0  # the router's prompts sent and not yet at a first token

    def features(self, prompt_tokens: int) -> list[float]:
        """What llm-d's predictor reads, as this instance stands now."""
        entry = self._cache.entry
        running = waiting = 0
        usage = 0.0
        if entry is not None:
            snap = entry.snapshot
            running = int(np.count_nonzero(snap.table[:, COL_STATE] == STATE_RUNNING))
            waiting = len(snap) - running
            kv = snap.kv
            if kv is not None and kv.num_blocks > 0:
                usage = 1.0 - kv.free_blocks / kv.num_blocks
        return [
            float(prompt_tokens),
            float(running),
            float(waiting),
            usage,
            float(self._dispatched_prefill),
        ]

    # -- predicting ----------------------------------------------------------------

    def _predict(self, kind: str, x: list[float]) -> float:
        model = self._model[kind]
        if model is None:
            return 0.0
        return max(0.0, float(model.predict(np.asarray([x], dtype=np.float64))[0]))

    def estimate(
        self,
        prompt_tokens: int,
        output_tokens: int,
        max_tokens: int | None,
        now: float,
        horizon_s: float = math.inf,
        next_tokens: int = 0,
        residents: bool = False,
    ) -> Latency:
        """Predicted p90 TTFT (and p90 TPOT when ``next_tokens``) of a request sent now.

        (llm-d's predictor says nothing of the residents: ``residents`` is ignored.)
        """
        x = self.features(prompt_tokens)
        tpot = self._predict("tpot", x) if next_tokens else math.nan
        return Latency(self._predict("ttft", x), "learned", self._cache.age(now), tpot_s=tpot)

    # -- learning ------------------------------------------------------------------

    def learn_dispatch(self, request_id: str, prompt_tokens: int, now: float) -> None:
        """A request was sent here: keep the features it was sent on."""
        if len(self._pending) >= 4 * self.window:
            self._pending.pop(next(iter(self._pending)))  # a lost outcome must not pile up
        self._pending[request_id] = (self.features(prompt_tokens), float(prompt_tokens))
        self._dispatched_prefill += prompt_tokens

    def learn_first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        """Its first token came ``ttft_s`` after dispatch."""
        got = self._pending.get(request_id)
        if got is None:
            return
        self._dispatched_prefill = max(0, self._dispatched_prefill - int(got[1]))
        self._first[request_id] = now
        if math.isfinite(ttft_s) and ttft_s >= 0.0:
            self._add("ttft", got[0], ttft_s)

    def learn_complete(self, request_id: str, output_tokens: int | None, now: float) -> None:
        """It finished with ``output_tokens`` (``None``: failed or unknown)."""
        got = self._pending.pop(request_id, None)
        first = self._first.pop(request_id, None)
        if got is None:
            return
        if first is None:
            self._dispatched_prefill = max(0, self._dispatched_prefill - int(got[1]))
            return
        if output_tokens is not None and output_tokens >= 2:
            self._add("tpot", got[0], (now - first) / (output_tokens - 1))

    def _add(self, kind: str, x: list[float], y: float) -> None:
        self._x[kind].append(x)
        self._y[kind].append(y)
        self._new[kind] += 1
        n = len(self._y[kind])
        if n >= self.min_samples and (
            self._model[kind] is None or self._new[kind] >= self.retrain_every
        ):
            self._fit(kind)

    def _fit(self, kind: str) -> None:
        import lightgbm as lgb

        x = np.asarray(self._x[kind], dtype=np.float64)
        y = np.asarray(self._y[kind], dtype=np.float64)
        params = {
            "objective": "quantile",
            "alpha": 0.9,
            "learning_rate": 0.1,
            "num_leaves": 15,
            "min_data_in_leaf": 10,
            "num_threads": 1,
            "verbose": -1,
        }
        self._model[kind] = lgb.train(params, lgb.Dataset(x, y), num_boost_round=60)
        self._new[kind] = 0

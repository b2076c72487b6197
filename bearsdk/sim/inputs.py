"""A workload turned into what a run needs: per request, the truth and the predictions.

The truth is independent of the router's estimators:

* **output lengths** come from the emulated engine's own model
  (:class:`~bearsdk.emulator.OutputLengthModel`, drawn as the emulator draws a
  chat request's: the prompt's task category, its length and a seed from the
  prompt and the served model), or from the data (AlpacaEval's per-model
  lengths, a trace's generated tokens);
* **accuracy** comes from the workload (Table 2 generator, or AlpacaEval's judge);
* **cost** is the true prompt and output tokens at the model's prices.

Predictions are the predictor's, computed once per distinct (prompt, length):
the router reads them as it would compute them, with the prompt's true token
count (a router with the model's tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from bearsdk.emulator import get_profile
from bearsdk.emulator.text import Tokenizer, classify_prompt, prompt_seed
from bearsdk.errors import BearError
from bearsdk.predictors import Predictor
from bearsdk.sim.scenario import InstanceSpec, RequestSet
from bearsdk.workload import WorkItem

__all__ = ["LENGTH_SOURCES", "SimInputError", "build_requests", "engine_output_lengths"]

LENGTH_SOURCES: Final = ("engine", "data", "trace")
"""Where true output lengths come from: the emulator's model, the prompts' data
(AlpacaEval), or the trace."""


class SimInputError(BearError, ValueError):
    """A workload and a pool do not fit together (the message names what is missing)."""


def engine_output_lengths(texts: Sequence[str], profiles: Sequence[str]) -> npt.NDArray[np.int64]:
    """Natural output length of each prompt (sent as one chat user message) on each
    emulator profile, as the emulated engine draws it.

    Returns:
        ``int64[len(texts), len(profiles)]``.
    """
    out = np.zeros((len(texts), len(profiles)), dtype=np.int64)
    tok = Tokenizer()
    cache: dict[str, tuple[str, int, str]] = {}
    models = [get_profile(p) for p in profiles]
    memo: dict[tuple[str, str], int] = {}
    for i, text in enumerate(texts):
        got = cache.get(text)
        if got is None:
            rendered = tok.render_chat([{"role": "user", "content": text}])
            got = (classify_prompt(text, chat=True), max(1, tok.count(text)), rendered)
            cache[text] = got
        cat, class_tokens, rendered = got
        for j, prof in enumerate(models):
            key = (text, prof.name)
            n = memo.get(key)
            if n is None:
                n = prof.lengths.sample(cat, class_tokens, prompt_seed(prof.model, rendered))
                memo[key] = n
            out[i, j] = n
    return out


def build_requests(
    items: Sequence[WorkItem],
    instances: Sequence[InstanceSpec],
    predictor: Predictor,
    *,
    lengths: str = "engine",
    trace_outputs: npt.NDArray[np.int64] | None = None,
) -> RequestSet:
    """Truth and predictions for every request of a workload.

    Args:
        items: The requests (arrival times are not used: a run brings its own).
        instances: The pool.
        predictor: The router's predictor (its pool names the instances' models).
        lengths: One of :data:`LENGTH_SOURCES`.
        trace_outputs: Generated tokens per request (``lengths="trace"``).

    Raises:
        SimInputError: A model without a true accuracy or a price, a missing
            length source.
    """
    if lengths not in LENGTH_SOURCES:
        raise SimInputError(f"lengths must be one of {', '.join(LENGTH_SOURCES)} (got {lengths!r})")
    n, k = len(items), len(instances)
    specs = {m.name: m for m in predictor.pool}
    for s in instances:
        if s.model not in specs:
            raise SimInputError(
                f"instance {s.name!r}: model {s.model!r} is not in the predictor's pool "
                f"({', '.join(specs)})"
            )
    texts = tuple(it.prompt for it in items)
    acc = np.zeros((n, k))
    for i, it in enumerate(items):
        for j, s in enumerate(instances):
            a = it.accuracy.get(s.model)
            if a is None:
                raise SimInputError(
                    f"request {it.index}: no true accuracy for model {s.model!r} "
                    f"(the workload knows {', '.join(it.accuracy)})"
                )
            acc[i, j] = a
    if lengths == "engine":
        out = engine_output_lengths(texts, [s.engine for s in instances])
    elif lengths == "data":
        out = np.zeros((n, k), dtype=np.int64)
        for i, it in enumerate(items):
            for j, s in enumerate(instances):
                v = it.outputs.get(s.model)
                if v is None:
                    raise SimInputError(
                        f"request {it.index}: the workload has no output length for model "
                        f"{s.model!r} (use lengths = 'engine')"
                    )
                out[i, j] = v
    else:
        if trace_outputs is None or len(trace_outputs) < n:
            raise SimInputError("lengths = 'trace' needs a trace with one row per request")
        out = np.repeat(np.maximum(trace_outputs[:n], 1)[:, None], k, axis=1).astype(np.int64)
    ptok = np.array([it.prompt_tokens for it in items], dtype=np.int64)
    models = predictor.models
    m = len(models)
    p_acc = np.zeros((n, m))
    p_out = np.zeros((n, m))
    p_tok = np.zeros((n, m))
    p_cost = np.zeros((n, m))
    memo: dict[tuple[str, int], int] = {}
    for i, it in enumerate(items):
        key = (it.prompt, it.prompt_tokens)
        src = memo.get(key)
        if src is not None:
            p_acc[i], p_out[i], p_tok[i], p_cost[i] = (
                p_acc[src],
                p_out[src],
                p_tok[src],
                p_cost[src],
            )
            continue
        memo[key] = i
        pred = predictor.predict(it.prompt, prompt_tokens=it.prompt_tokens)
        p_acc[i], p_out[i], p_tok[i], p_cost[i] = (
            pred.accuracy,
            pred.output_tokens,
            pred.prompt_tokens,
            pred.cost_usd,
        )
    return RequestSet(
        texts=texts,
        prompt_tokens=ptok,
        targets_s=np.array([it.ttft_target_s for it in items]),
        true_output=out,
        true_accuracy=acc,
        price_in=np.array([specs[s.model].input_price for s in instances]),
        price_out=np.array([specs[s.model].output_price for s in instances]),
        models=models,
        pred_accuracy=p_acc,
        pred_output=p_out,
        pred_prompt=p_tok,
        pred_cost=p_cost,
        tasks=tuple(it.task for it in items),
    )

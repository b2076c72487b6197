"""Model descriptions: what the predictors know about each model of a pool.

A :class:`ModelSpec` carries the per-model features of appendix A.4 (parameter
count, maximum context) and the per-token prices that turn a predicted output
length into a predicted cost. Two pools ship:

* :data:`QWEN3_POOL`: the paper's pool, Qwen3-0.6B/8B/32B, priced as in its
  Table 1 (Alibaba Cloud Model Studio, non-thinking mode, USD per million tokens).
  The shipped default predictor covers it.
* :data:`FUSECHAT3_POOL`: the default real-data pool, three sizes of the
  FuseChat-3.0 family (one fusion recipe applied to different targets):
  Llama-3.2-1B, Qwen-2.5-7B and Gemma-2-9B, with AlpacaEval judgements and
  output lengths. Its two larger models are close on average but not on every
  kind of prompt, so the best model changes from prompt to prompt.
* :data:`FUSECHAT_LLAMA_POOL`: FuseChat Llama-3.2-1B / 3.2-3B / 3.1-8B, one
  architecture in three sizes; the larger model is better on almost every kind
  of prompt (docs/predictors.md compares the two).

No provider prices the FuseChat models; their prices are interpolated from
Table 1 in log parameter count (illustrative only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import orjson

from bearsdk.predictors.errors import PredictorError

__all__ = [
    "FUSECHAT3_POOL",
    "FUSECHAT_LLAMA_POOL",
    "POOLS",
    "QWEN3_POOL",
    "ModelSpec",
    "load_pool",
    "pool_from_dicts",
]


def _finite_nonneg(field: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PredictorError(field, "must be a number", value)
    if not math.isfinite(value) or value < 0:
        raise PredictorError(field, "must be finite and >= 0", value)


@attrs.frozen
class ModelSpec:
    """One model of a pool.

    Attributes:
        name: The model name requests are routed with (as the server reports it).
        params_b: Parameter count in billions, or ``None`` when unknown (the
            feature is then missing).
        max_context: Maximum context length in tokens, or ``None`` when unknown.
        input_price: USD per million prompt tokens.
        output_price: USD per million output tokens.
        chars_per_token: Prior characters per prompt token for the built-in
            token estimate, before usage reports refine it.
    """

    name: str
    params_b: float | None = None
    max_context: int | None = None
    input_price: float = 0.0
    output_price: float = 0.0
    chars_per_token: float = 4.0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PredictorError("model.name", "must be a non-empty str", self.name)
        where = f"model {self.name!r}"
        if self.params_b is not None:
            _finite_nonneg(f"{where}: params_b", self.params_b)
            if self.params_b <= 0:
                raise PredictorError(f"{where}: params_b", "must be > 0", self.params_b)
        if self.max_context is not None and (
            isinstance(self.max_context, bool)
            or not isinstance(self.max_context, int)
            or self.max_context < 1
        ):
            raise PredictorError(
                f"{where}: max_context", "must be a positive int", self.max_context
            )
        _finite_nonneg(f"{where}: input_price", self.input_price)
        _finite_nonneg(f"{where}: output_price", self.output_price)
        _finite_nonneg(f"{where}: chars_per_token", self.chars_per_token)
        if self.chars_per_token <= 0:
            raise PredictorError(f"{where}: chars_per_token", "must be > 0", self.chars_per_token)

    def features(self) -> tuple[float, float]:
        """Return ``(log parameter count in billions, max context)``, NaN where unknown."""
        return (
            math.log(self.params_b) if self.params_b is not None else math.nan,
            float(self.max_context) if self.max_context is not None else math.nan,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (see :func:`pool_from_dicts`)."""
        return attrs.asdict(self)


QWEN3_POOL: Final = (
    ModelSpec("Qwen/Qwen3-0.6B", 0.6, 32768, 0.044, 0.173),
    ModelSpec("Qwen/Qwen3-8B", 8.2, 32768, 0.072, 0.287),
    ModelSpec("Qwen/Qwen3-32B", 32.8, 32768, 0.287, 0.640),
)
"""The paper's pool with its Table 1 prices (USD per million tokens)."""

FUSECHAT_LLAMA_POOL: Final = (
    ModelSpec("FuseChat-Llama-3.2-1B-Instruct", 1.24, 131072, 0.0518, 0.205),
    ModelSpec("FuseChat-Llama-3.2-3B-Instruct", 3.21, 131072, 0.0621, 0.247),
    ModelSpec("FuseChat-Llama-3.1-8B-Instruct", 8.03, 131072, 0.0720, 0.287),
)
"""One architecture in three sizes; prices interpolated from Table 1 (illustrative)."""

FUSECHAT3_POOL: Final = (
    ModelSpec("FuseChat-Llama-3.2-1B-Instruct", 1.24, 131072, 0.0518, 0.205),
    ModelSpec("FuseChat-Qwen-2.5-7B-Instruct", 7.62, 32768, 0.0712, 0.284),
    ModelSpec("FuseChat-Gemma-2-9B-Instruct", 9.24, 8192, 0.0905, 0.317),
)
"""The default real-data pool; prices interpolated from Table 1 (illustrative)."""

POOLS: Final = {
    "qwen3": QWEN3_POOL,
    "fusechat3": FUSECHAT3_POOL,
    "fusechat-llama": FUSECHAT_LLAMA_POOL,
}
"""Built-in pools by name."""


def pool_from_dicts(items: Sequence[object], *, field: str = "pool") -> tuple[ModelSpec, ...]:
    """Build a pool from JSON-like dicts (keys as :class:`ModelSpec` attributes).

    Raises:
        PredictorError: A model is malformed or a name repeats.
    """
    if not isinstance(items, list | tuple) or not items:
        raise PredictorError(field, "must be a non-empty list of models", type(items).__name__)
    known = {a.name for a in attrs.fields(ModelSpec)}
    pool = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PredictorError(f"{field}[{i}]", "must be an object", type(item).__name__)
        extra = set(item) - known
        if extra:
            raise PredictorError(
                f"{field}[{i}]", f"has unknown keys (known: {sorted(known)})", sorted(extra)
            )
        if "name" not in item:
            raise PredictorError(f"{field}[{i}].name", "is missing")
        pool.append(ModelSpec(**item))
    names = [m.name for m in pool]
    for name in names:
        if names.count(name) > 1:
            raise PredictorError(f"{field}", "names a model twice", name)
    return tuple(pool)


def load_pool(spec: str) -> tuple[ModelSpec, ...]:
    """Return a built-in pool by name (:data:`POOLS`) or read one from a JSON file.

    The file holds a list of objects with :class:`ModelSpec`'s attributes, e.g.
    ``[{"name": "m", "params_b": 8, "max_context": 32768, "input_price": 0.1,
    "output_price": 0.4}]``.

    Raises:
        PredictorError: Unknown name, unreadable file or malformed models.
    """
    if spec in POOLS:
        return POOLS[spec]
    path = Path(spec)
    if not path.is_file():
        raise PredictorError("pool", f"is neither a built-in pool {sorted(POOLS)} nor a file", spec)
    try:
        items = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise PredictorError("pool", f"file is not valid JSON: {exc}", spec) from exc
    return pool_from_dicts(items, field=f"pool file {spec}")

"""Per-prompt predictions of accuracy, output length and cost for every model of a pool.

:class:`Predictor` bundles what appendix A.4 describes: the prompt feature
pipeline, the pool's model features and prices, and LightGBM heads (accuracy:
Huber regression; output length: mean regression; optional length quantiles),
plus, where training found one, the relative-accuracy head that reorders the
pool per prompt (:mod:`bearsdk.predictors.relative`).
One call predicts for the whole pool: the prompt's features are computed once,
the rows of all models are stacked, and each head's trees are walked for all rows
in one compiled call. The cost of model ``j`` is::

    prompt_tokens[j] * input_price[j] + predicted_output_tokens[j] * output_price[j]

with prices in USD per million tokens and ``prompt_tokens`` from each model's
tokenizer or learned estimate (:class:`~bearsdk.predictors.tokens.PromptTokenCounter`).
These feed the utility of eq. 4, ``accuracy - lambda * cost``.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors import _impl
from bearsdk.predictors._forest import TreeEnsemble
from bearsdk.predictors.errors import PredictorError, PredictorFormatError
from bearsdk.predictors.features import FeaturePipeline
from bearsdk.predictors.pool import ModelSpec
from bearsdk.predictors.relative import RelativeAccuracy
from bearsdk.predictors.tokens import PromptTokenCounter, TokenizerLike

__all__ = [
    "ACCURACY",
    "DEFAULT_PREDICTOR",
    "MODEL_FEATURES",
    "OUTPUT_TOKENS",
    "PoolPrediction",
    "Predictor",
    "feature_matrix",
    "model_rows",
    "quantile_head",
]

ACCURACY: Final = "accuracy"
OUTPUT_TOKENS: Final = "output_tokens"
MODEL_FEATURES: Final = ("model_id", "log_params_b", "max_context")
"""Per-model columns after the prompt features; ``model_id`` is categorical."""

DEFAULT_PREDICTOR: Final = "default.bearpred"
"""File name of the shipped predictor in ``bearsdk/predictors/data/``."""

_PER_MILLION: Final = 1e-6


def quantile_head(alpha: float) -> str:
    """Return the head name of output-length quantile ``alpha`` (0.9 -> ``output_tokens_p90``)."""
    return f"{OUTPUT_TOKENS}_p{round(alpha * 100):02d}"


@attrs.frozen(eq=False)
class PoolPrediction:
    """Predictions for one prompt, one entry per model in pool order.

    Attributes:
        models: Model names.
        accuracy: Predicted judge score in [0, 1].
        output_tokens: Predicted mean output length (tokens, >= 1).
        prompt_tokens: Prompt token count per model (counted or estimated).
        cost_usd: Predicted cost of the request in USD.
        output_quantiles: Predicted output-length quantiles by level (e.g.
            ``{0.5: ..., 0.9: ...}``), when the predictor has quantile heads;
            non-decreasing in the level.
    """

    models: tuple[str, ...]
    accuracy: npt.NDArray[np.float64]
    output_tokens: npt.NDArray[np.float64]
    prompt_tokens: npt.NDArray[np.float64]
    cost_usd: npt.NDArray[np.float64]
    output_quantiles: Mapping[float, npt.NDArray[np.float64]] = attrs.field(factory=dict)

    def utility(self, lam: float) -> npt.NDArray[np.float64]:
        """Return eq. 4's ``accuracy - lam * cost_usd`` per model."""
        out: npt.NDArray[np.float64] = self.accuracy - lam * self.cost_usd
        return out

    def best(
        self, lam: float, feasible: npt.NDArray[np.bool_] | Sequence[bool] | None = None
    ) -> int:
        """Return the index of the model with the highest utility among ``feasible`` ones.

        Raises:
            PredictorError: ``feasible`` has the wrong length or selects nothing.
        """
        u = self.utility(lam)
        if feasible is not None:
            mask = np.asarray(feasible, dtype=bool)
            if mask.shape != u.shape:
                raise PredictorError("feasible", f"must have {u.shape[0]} entries", mask.shape)
            if not mask.any():
                raise PredictorError("feasible", "selects no model")
            u = np.where(mask, u, -np.inf)
        return int(np.argmax(u))


def _default_path() -> importlib.resources.abc.Traversable:
    return importlib.resources.files("bearsdk.predictors").joinpath("data", DEFAULT_PREDICTOR)


def model_rows(pipeline: FeaturePipeline, pool: Sequence[ModelSpec]) -> npt.NDArray[np.float64]:
    """Return ``float64[len(pool), n_features]``: model columns filled, prompt columns 0."""
    p = pipeline.n_features
    rows = np.zeros((len(pool), p + len(MODEL_FEATURES)), dtype=np.float64)
    for j, spec in enumerate(pool):
        rows[j, p] = j
        rows[j, p + 1 : p + 3] = spec.features()
    return rows


def feature_matrix(
    pipeline: FeaturePipeline,
    pool: Sequence[ModelSpec],
    prompts: Sequence[str],
    prompt_index: npt.NDArray[np.int64] | None = None,
    model_index: npt.NDArray[np.int64] | None = None,
) -> npt.NDArray[np.float64]:
    """Return feature rows for (prompt, model) pairs: every pair when the indices are omitted.

    Args:
        pipeline: The prompt feature pipeline.
        pool: The models (their position is the categorical model id).
        prompts: The prompts.
        prompt_index: ``int64[R]`` prompt of each row.
        model_index: ``int64[R]`` model of each row.
    """
    feats = pipeline.transform_many(prompts)
    if prompt_index is None or model_index is None:
        prompt_index = np.repeat(np.arange(len(prompts)), len(pool))
        model_index = np.tile(np.arange(len(pool)), len(prompts))
    x = model_rows(pipeline, pool)[model_index]
    x[:, : pipeline.n_features] = feats[prompt_index]
    return x


def _default_counter(self: Predictor) -> PromptTokenCounter:
    return PromptTokenCounter(
        tuple(m.name for m in self.pool), tuple(m.chars_per_token for m in self.pool)
    )


@attrs.define(repr=False)
class Predictor:
    """Accuracy, output-length and cost predictors for a pool (see the module docstring).

    Build one with :func:`~bearsdk.predictors.training.train_predictor`, or load one
    with :meth:`load` / :meth:`load_default`.

    Args:
        pipeline: The prompt feature pipeline the heads were trained on.
        pool: The models, in the order of their categorical ids.
        heads: Tree ensembles by name: ``"accuracy"``, ``"output_tokens"`` and
            optionally quantile heads named by :func:`quantile_head`.
        quantiles: Quantile level of each quantile head, by head name.
        info: Provenance (data source, configuration, training metrics); JSON-able.
        relative: The relative-accuracy head (reorders the pool per prompt), if trained.
        tokens: Prompt token counter (built from the pool when omitted).
    """

    pipeline: FeaturePipeline
    pool: tuple[ModelSpec, ...]
    heads: dict[str, TreeEnsemble]
    quantiles: dict[str, float] = attrs.field(factory=dict)
    info: dict[str, Any] = attrs.field(factory=dict)
    relative: RelativeAccuracy | None = None
    tokens: PromptTokenCounter = attrs.field(
        default=attrs.Factory(_default_counter, takes_self=True)
    )
    _forests: dict[str, _impl.Forest] = attrs.field(init=False, repr=False)
    _template: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _index: dict[str, int] = attrs.field(init=False, repr=False)
    _names: tuple[str, ...] = attrs.field(init=False, repr=False)
    _in_price: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _out_price: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _qheads: tuple[tuple[float, str], ...] = attrs.field(init=False, repr=False)
    _qlevels: tuple[float, ...] = attrs.field(init=False, repr=False)
    _heads: tuple[_impl.Forest, ...] = attrs.field(init=False, repr=False)
    _lo: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _hi: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.pool:
            raise PredictorError("pool", "must name at least one model")
        for name in (ACCURACY, OUTPUT_TOKENS):
            if name not in self.heads:
                raise PredictorFormatError("heads", f"lack the {name!r} head", sorted(self.heads))
        for name, q in self.quantiles.items():
            if name not in self.heads or not 0.0 < q < 1.0:
                raise PredictorFormatError(
                    f"quantiles.{name}", "must name a head and a level in (0, 1)", q
                )
        n_features = self.n_features
        for name, ens in self.heads.items():
            if ens.n_features > n_features:
                raise PredictorFormatError(
                    f"heads.{name}",
                    f"reads {ens.n_features} features, the pipeline makes {n_features}",
                )
        rel = self.relative
        if rel is not None and (
            rel.n_models != len(self.pool) or rel.n_features != self.pipeline.n_features
        ):
            raise PredictorFormatError(
                "relative",
                f"must map {self.pipeline.n_features} prompt features to {len(self.pool)} models",
                rel.weights.shape,
            )
        self._forests = {
            name: _impl.Forest(**ens.evaluator_args()) for name, ens in self.heads.items()
        }
        self._template = model_rows(self.pipeline, self.pool)
        self._index = {m.name: i for i, m in enumerate(self.pool)}
        self._names = tuple(self._index)
        if len(self._index) != len(self.pool):
            raise PredictorError("pool", "names a model twice", [m.name for m in self.pool])
        self._in_price = np.array([m.input_price for m in self.pool]) * _PER_MILLION
        self._out_price = np.array([m.output_price for m in self.pool]) * _PER_MILLION
        self._qheads = tuple(sorted((q, name) for name, q in self.quantiles.items()))
        self._qlevels = tuple(q for q, _ in self._qheads)
        order = self.head_order
        self._heads = tuple(self._forests[name] for name in order)
        # With a relative head the accuracy is clipped after its correction is added.
        acc_lo, acc_hi = (0.0, 1.0) if rel is None else (-np.inf, np.inf)
        self._lo = np.array([acc_lo] + [1.0] * (len(order) - 1))
        self._hi = np.array([acc_hi] + [np.inf] * (len(order) - 1))
        if self.tokens.models != tuple(m.name for m in self.pool):
            raise PredictorError("tokens", "must count for the pool's models", self.tokens.models)

    def __repr__(self) -> str:
        source = str(self.info.get("source", ""))
        if len(source) > 60:
            source = source[:57] + "..."
        models, heads = list(self.models), list(self.head_order)
        return f"Predictor(models={models}, heads={heads}, source={source!r})"

    # -- structure ---------------------------------------------------------

    @property
    def models(self) -> tuple[str, ...]:
        """Model names in pool order."""
        return tuple(m.name for m in self.pool)

    @property
    def head_order(self) -> tuple[str, ...]:
        """Head names in evaluation order: accuracy, mean length, quantiles by level."""
        qs = sorted((q, name) for name, q in self.quantiles.items())
        return (ACCURACY, OUTPUT_TOKENS, *(name for _, name in qs))

    @property
    def n_features(self) -> int:
        """Columns of a feature row: prompt features, then :data:`MODEL_FEATURES`."""
        return self.pipeline.n_features + len(MODEL_FEATURES)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Names of the feature columns."""
        return (*self.pipeline.names, *MODEL_FEATURES)

    # -- prediction --------------------------------------------------------

    def predict(
        self,
        prompt: str,
        *,
        prompt_tokens: Sequence[int] | int | None = None,
        quantiles: bool = True,
    ) -> PoolPrediction:
        """Predict accuracy, output length and cost of ``prompt`` on every model of the pool.

        Args:
            prompt: The prompt text (for chat requests, the messages' text joined).
            prompt_tokens: The prompt's token count, when the caller knows it: one
                count for all models or one per model. Counted or estimated otherwise.
            quantiles: Also evaluate the output-length quantile heads (the router
                does not need them; skipping them halves the trees walked).

        Raises:
            PredictorError: ``prompt`` is not a str or ``prompt_tokens`` is malformed.
        """
        if not isinstance(prompt, str):
            raise PredictorError("prompt", "must be a str", type(prompt).__name__)
        x = self._template.copy()
        heads = self._heads if quantiles else self._heads[:2]
        out = np.empty((len(heads), x.shape[0]))
        _impl.predict_pool(self.pipeline.extractor, prompt, x, heads, self._lo, self._hi, out)
        if self.relative is not None:
            self.relative.add_to(x, self.pipeline.n_features, out[0])
        qs: dict[float, npt.NDArray[np.float64]] = {}
        if self._qlevels and quantiles:
            # Independently trained quantile heads can cross; keep them ordered.
            q = np.maximum.accumulate(out[2:], axis=0)
            qs = dict(zip(self._qlevels, q, strict=True))
        ptok = self._prompt_tokens(prompt, prompt_tokens)
        cost = ptok * self._in_price + out[1] * self._out_price
        return PoolPrediction(self._names, out[0], out[1], ptok, cost, qs)

    def _prompt_tokens(
        self, prompt: str, given: Sequence[int] | int | None
    ) -> npt.NDArray[np.float64]:
        if given is None:
            return self.tokens.counts(prompt)
        if isinstance(given, int) and not isinstance(given, bool):
            if given < 0:
                raise PredictorError("prompt_tokens", "must be >= 0", given)
            return np.full(len(self.pool), float(given))
        arr = np.asarray(given, dtype=np.float64)
        if arr.shape != (len(self.pool),) or not (arr >= 0).all():
            raise PredictorError(
                "prompt_tokens", f"must be an int or {len(self.pool)} counts >= 0", given
            )
        return arr

    def predict_rows(self, x: npt.NDArray[np.float64]) -> dict[str, npt.NDArray[np.float64]]:
        """Evaluate every head on feature rows (``float64[R, n_features]``), clipped as in predict.

        For evaluation and batch use: rows may mix prompts and models.
        """
        x = np.ascontiguousarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features:
            raise PredictorError("x", f"must be float64[R, {self.n_features}]", x.shape)
        res: dict[str, npt.NDArray[np.float64]] = {}
        for name, forest in self._forests.items():
            v = np.empty(x.shape[0])
            forest.predict_into(x, v)
            if name == ACCURACY:
                if self.relative is not None:
                    try:
                        self.relative.add_to(x, self.pipeline.n_features, v)
                    except ValueError as exc:
                        raise PredictorError("x", f"model_id column: {exc}") from None
                np.clip(v, 0.0, 1.0, out=v)
            else:
                np.maximum(v, 1.0, out=v)
            res[name] = v
        prev: npt.NDArray[np.float64] | None = None
        for _, name in self._qheads:
            if prev is not None:
                np.maximum(res[name], prev, out=res[name])
            prev = res[name]
        return res

    def feature_rows(
        self,
        prompts: Sequence[str],
        prompt_index: npt.NDArray[np.int64] | None = None,
        model_index: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.float64]:
        """Return feature rows for (prompt, model) pairs (see :func:`feature_matrix`)."""
        return feature_matrix(self.pipeline, self.pool, prompts, prompt_index, model_index)

    # -- usage feedback ----------------------------------------------------

    def observe_usage(self, model: str, prompt: str, prompt_tokens: int) -> None:
        """Learn ``model``'s token count from a response's ``usage.prompt_tokens``."""
        self.tokens.observe(model, prompt, prompt_tokens)

    def set_tokenizer(self, model: str, tokenizer: TokenizerLike | str | Path | None) -> None:
        """Count ``model``'s prompt tokens with a tokenizer (object or ``tokenizer.json`` path)."""
        if isinstance(tokenizer, str | Path):
            from bearsdk.predictors.tokens import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokens.set_tokenizer(model, tokenizer)

    # -- persistence -------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the predictor to ``path`` (a file, or a folder to hold ``predictor.bearpred``).

        Returns:
            The file written.
        """
        from bearsdk.predictors.serialize import save_predictor

        return save_predictor(self, path)

    @classmethod
    def load(cls, path: str | Path) -> Predictor:
        """Read a predictor written by :meth:`save`.

        Raises:
            PredictorFormatError: Missing, corrupt or truncated file, or a file
                of another format or feature version.
        """
        from bearsdk.predictors.serialize import load_predictor

        return load_predictor(path)

    @classmethod
    def load_default(cls) -> Predictor:
        """Load the predictor shipped with bearsdk (Qwen3 pool, trained on synthetic data).

        It is a placeholder so that demos run without a training step: retrain on
        your own evaluations with ``bearsdk train``.
        """
        from bearsdk.predictors.serialize import decode_predictor

        ref = _default_path()
        return decode_predictor(ref.read_bytes(), f"<bearsdk>/predictors/data/{DEFAULT_PREDICTOR}")

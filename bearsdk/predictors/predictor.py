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

**Models the heads were not trained on** get a prior (:meth:`Predictor.with_priors`),
so that a pool of any models routes on latency before a predictor is trained for
it: their output length is the mean of the trained models' predictions for the
prompt (the pool-average model), their accuracy a configured score, else the
trained models' mean for the prompt (neutral: neither better nor worse than an
average known model), their prices the trained models' mean prices, and their
prompt tokens the generic 4 characters per token until usage reports refine it.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors import _archive, _impl
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

    def lists(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Accuracy, output tokens, prompt tokens and cost as plain lists, in pool
        order (what the router reads, one value at a time)."""
        return (
            self.accuracy.tolist(),
            self.output_tokens.tolist(),
            self.prompt_tokens.tolist(),
            self.cost_usd.tolist(),
        )

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
        tuple(m.name for m in self.pool) + tuple(name for name, _ in self.priors),
        tuple(m.chars_per_token for m in self.pool) + (_PRIOR_CHARS_PER_TOKEN,) * len(self.priors),
    )


def _priors(
    value: Sequence[tuple[str, float | None]] | Mapping[str, float | None],
) -> tuple[tuple[str, float | None], ...]:
    return tuple(value.items()) if isinstance(value, Mapping) else tuple(value)


_PRIOR_CHARS_PER_TOKEN: Final = 4.0
"""Characters per prompt token assumed for a model without a trained prior (refined by usage)."""


def _check_priors(pool: Sequence[ModelSpec], priors: Sequence[tuple[str, float | None]]) -> None:
    known = {m.name for m in pool}
    for name, acc in priors:
        if not isinstance(name, str) or not name:
            raise PredictorError("priors", "must name models by non-empty str", name)
        if name in known:
            raise PredictorError(f"priors.{name}", "is a model the predictor was trained on", name)
        known.add(name)
        if acc is not None and (
            isinstance(acc, bool)
            or not isinstance(acc, int | float)
            or not 0.0 <= float(acc) <= 1.0
        ):
            raise PredictorError(f"priors.{name}", "accuracy must be a number in [0, 1]", acc)


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
        priors: Models the heads were not trained on, each with its accuracy
            prior (``None``: neutral); they follow ``pool`` in :attr:`models`
            (see the module docstring and :meth:`with_priors`).
        tokens: Prompt token counter (built from the pool when omitted).
    """

    pipeline: FeaturePipeline
    pool: tuple[ModelSpec, ...]
    heads: dict[str, TreeEnsemble]
    quantiles: dict[str, float] = attrs.field(factory=dict)
    info: dict[str, Any] = attrs.field(factory=dict)
    relative: RelativeAccuracy | None = None
    priors: tuple[tuple[str, float | None], ...] = attrs.field(default=(), converter=_priors)
    tokens: PromptTokenCounter = attrs.field(
        default=attrs.Factory(_default_counter, takes_self=True)
    )
    _forests: dict[str, _impl.Forest] = attrs.field(init=False, repr=False)
    _template: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _index: dict[str, int] = attrs.field(init=False, repr=False)
    _names: tuple[str, ...] = attrs.field(init=False, repr=False)
    _in_price: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _out_price: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _in_prices: list[float] = attrs.field(init=False, repr=False)
    _out_prices: list[float] = attrs.field(init=False, repr=False)
    _qheads: tuple[tuple[float, str], ...] = attrs.field(init=False, repr=False)
    _qlevels: tuple[float, ...] = attrs.field(init=False, repr=False)
    _heads: tuple[_impl.Forest, ...] = attrs.field(init=False, repr=False)
    _lo: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _hi: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)
    _prior_acc: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)

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
        if len(self._index) != len(self.pool):
            raise PredictorError("pool", "names a model twice", [m.name for m in self.pool])
        _check_priors(self.pool, self.priors)
        for name, _ in self.priors:
            self._index[name] = len(self._index)
        self._names = tuple(self._index)
        n_prior = len(self.priors)
        in_price = np.array([m.input_price for m in self.pool])
        out_price = np.array([m.output_price for m in self.pool])
        # An unknown model is priced as the pool's average model: neither cheap nor dear.
        in_price = np.concatenate([in_price, np.full(n_prior, in_price.mean())])
        out_price = np.concatenate([out_price, np.full(n_prior, out_price.mean())])
        self._in_price = in_price * _PER_MILLION
        self._out_price = out_price * _PER_MILLION
        self._in_prices = self._in_price.tolist()
        self._out_prices = self._out_price.tolist()
        self._prior_acc = np.array(
            [np.nan if a is None else float(a) for _, a in self.priors], dtype=np.float64
        )
        self._qheads = tuple(sorted((q, name) for name, q in self.quantiles.items()))
        self._qlevels = tuple(q for q, _ in self._qheads)
        order = self.head_order
        self._heads = tuple(self._forests[name] for name in order)
        # With a relative head the accuracy is clipped after its correction is added.
        acc_lo, acc_hi = (0.0, 1.0) if rel is None else (-np.inf, np.inf)
        self._lo = np.array([acc_lo] + [1.0] * (len(order) - 1))
        self._hi = np.array([acc_hi] + [np.inf] * (len(order) - 1))
        if self.tokens.models != self._names:
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
        """Model names in pool order, then the models with a prior (:meth:`with_priors`)."""
        return self._names

    @property
    def trained_models(self) -> tuple[str, ...]:
        """The models the heads were trained on (``pool``'s names)."""
        return tuple(m.name for m in self.pool)

    def with_priors(self, priors: Mapping[str, float | None]) -> Predictor:
        """Return a predictor that also covers ``priors``' models, which it was not trained on.

        Each new model gets the prior of the module docstring; ``priors`` maps it
        to its accuracy prior in [0, 1], or ``None`` for the neutral one (the
        trained models' mean accuracy for each prompt). What the prompt token
        counter learned so far is kept; models already covered are left as they are.

        Args:
            priors: Accuracy prior by model name.

        Raises:
            PredictorError: A prior is not a number in [0, 1].
        """
        new = [(name, acc) for name, acc in priors.items() if name not in self._index]
        if not new:
            return self
        added: tuple[tuple[str, float | None], ...] = tuple(new)
        return attrs.evolve(
            self,
            priors=self.priors + added,
            tokens=self.tokens.extended([name for name, _ in new], _PRIOR_CHARS_PER_TOKEN),
        )

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
        if self.priors:
            out = self._with_prior_columns(out)
        qs: dict[float, npt.NDArray[np.float64]] = {}
        if self._qlevels and quantiles:
            # Independently trained quantile heads can cross; keep them ordered.
            q = np.maximum.accumulate(out[2:], axis=0)
            qs = dict(zip(self._qlevels, q, strict=True))
        ptok = self._prompt_tokens(prompt, prompt_tokens)
        cost = ptok * self._in_price + out[1] * self._out_price
        return PoolPrediction(self._names, out[0], out[1], ptok, cost, qs)

    def predict_lists(
        self, prompt: str
    ) -> tuple[list[float], list[float], list[float], list[float]]:
        """:meth:`predict` without quantiles, as plain lists in pool order: accuracy,
        output tokens, prompt tokens and cost in USD.

        The router's hot path: it reads each model's values one at a time, which
        plain floats serve faster than arrays, and needs no prediction object.
        The values are :meth:`predict`'s to the bit (:meth:`PoolPrediction.lists`).

        Raises:
            PredictorError: ``prompt`` is not a str.
        """
        if self.relative is not None or self.priors:
            return self.predict(prompt, quantiles=False).lists()
        if not isinstance(prompt, str):
            raise PredictorError("prompt", "must be a str", type(prompt).__name__)
        x = self._template.copy()
        out = np.empty((2, x.shape[0]))
        _impl.predict_pool(
            self.pipeline.extractor, prompt, x, self._heads[:2], self._lo, self._hi, out
        )
        acc, outs = out.tolist()
        ptok = self.tokens.counts(prompt).tolist()
        # (Element by element as numpy computes it in predict: the same floats.)
        cost = [
            p * ip + o * op
            for p, ip, o, op in zip(ptok, self._in_prices, outs, self._out_prices, strict=True)
        ]
        return acc, outs, ptok, cost

    def _with_prior_columns(self, out: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        full = np.empty((out.shape[0], len(self._names)))
        k = out.shape[1]
        full[:, :k] = out
        # Every head but accuracy (lengths, their quantiles): the pool-average model.
        full[1:, k:] = out[1:].mean(axis=1, keepdims=True)
        acc = self._prior_acc
        full[0, k:] = np.where(np.isnan(acc), float(np.clip(out[0], 0.0, 1.0).mean()), acc)
        return full

    def _prompt_tokens(
        self, prompt: str, given: Sequence[int] | int | None
    ) -> npt.NDArray[np.float64]:
        if given is None:
            return self.tokens.counts(prompt)
        if isinstance(given, int) and not isinstance(given, bool):
            if given < 0:
                raise PredictorError("prompt_tokens", "must be >= 0", given)
            return np.full(len(self._names), float(given))
        arr = np.asarray(given, dtype=np.float64)
        if arr.shape != (len(self._names),) or not (arr >= 0).all():
            raise PredictorError(
                "prompt_tokens", f"must be an int or {len(self._names)} counts >= 0", given
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
        return _archive.save_predictor(self, path)

    @classmethod
    def load(cls, path: str | Path) -> Predictor:
        """Read a predictor written by :meth:`save`.

        Raises:
            PredictorFormatError: Missing, corrupt or truncated file, or a file
                of another format or feature version.
        """
        return _archive.decode(*_archive.read_file(path), Predictor)

    @classmethod
    def load_default(cls) -> Predictor:
        """Load the predictor shipped with bearsdk (Qwen3 pool, trained on synthetic data).

        It is a placeholder so that demos run without a training step: retrain on
        your own evaluations with ``bearsdk train``.
        """
        ref = _default_path()
        where = f"<bearsdk>/predictors/data/{DEFAULT_PREDICTOR}"
        return _archive.decode(ref.read_bytes(), where, Predictor)

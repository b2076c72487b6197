"""Training the predictors with LightGBM (appendix A.4).

:func:`train_predictor` fits the prompt feature pipeline (the PCA of the hashed
tokens) on the training prompts, stacks one feature row per (prompt, model)
evaluation, and trains

* ``accuracy``: a LightGBM Huber regressor on the judge scores;
* ``output_tokens``: a LightGBM mean (L2) regressor on completion-token counts;
* optionally quantile regressors of the output length (``output_tokens_p50``,
  ``output_tokens_p90``) for uncertainty;
* the relative-accuracy head (:mod:`bearsdk.predictors.relative`): a ridge model
  of each model's score relative to the pool on the same prompt, which reorders
  the pool per prompt where the data supports it and is left out where not.

Every head reads the same rows, with the model id as a categorical feature. Runs
are deterministic (one thread, fixed seeds). The result is flattened into
:class:`~bearsdk.predictors._forest.TreeEnsemble` heads, checked to reproduce
LightGBM's own predictions exactly on the training rows.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors._forest import TreeEnsemble
from bearsdk.predictors.dataset import TrainingSet
from bearsdk.predictors.errors import PredictorError
from bearsdk.predictors.features import DEFAULT_HASH_DIM, DEFAULT_N_COMPONENTS, FeaturePipeline
from bearsdk.predictors.predictor import (
    ACCURACY,
    OUTPUT_TOKENS,
    Predictor,
    feature_matrix,
    quantile_head,
)
from bearsdk.predictors.relative import fit_relative_accuracy

__all__ = ["TrainConfig", "train_predictor"]

_MIN_ROWS: Final = 10


def _positive_int(inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PredictorError(f"config.{attr.name}", "must be an int >= 1", value)


def _fraction(inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise PredictorError(f"config.{attr.name}", "must be in (0, 1]", value)


def _levels(
    inst: object, attr: attrs.Attribute[tuple[float, ...]], value: tuple[float, ...]
) -> None:
    if any(not isinstance(q, float) or not 0.0 < q < 1.0 for q in value) or len(set(value)) != len(
        value
    ):
        raise PredictorError(f"config.{attr.name}", "must be distinct levels in (0, 1)", value)


@attrs.frozen
class TrainConfig:
    """LightGBM and feature settings.

    The defaults keep the ensembles small (200 trees of at most 15 leaves per
    head) so that a pool of 8 models is evaluated in well under 100 us, and were
    checked by cross-validation on the AlpacaEval data (docs/predictors.md).

    Attributes:
        n_estimators: Boosting rounds per head.
        learning_rate: Shrinkage.
        num_leaves: Maximum leaves per tree.
        min_data_in_leaf: Minimum rows per leaf.
        feature_fraction: Fraction of features sampled per tree.
        bagging_fraction: Fraction of rows sampled per tree.
        lambda_l2: L2 regularisation of leaf values.
        huber_delta: Huber transition point of the accuracy head (scores are in [0, 1]).
        quantiles: Output-length quantile heads to train (empty: none).
        relative_head: Also fit the relative-accuracy head (kept only where it
            predicts held-out prompts better than none).
        hash_dim: Feature-hashing buckets.
        n_components: PCA components kept.
        seed: Seed of every random choice.
    """

    n_estimators: int = attrs.field(default=200, validator=_positive_int)
    learning_rate: float = attrs.field(default=0.03, validator=_fraction)
    num_leaves: int = attrs.field(default=15, validator=_positive_int)
    min_data_in_leaf: int = attrs.field(default=20, validator=_positive_int)
    feature_fraction: float = attrs.field(default=0.8, validator=_fraction)
    bagging_fraction: float = attrs.field(default=0.8, validator=_fraction)
    lambda_l2: float = 1.0
    huber_delta: float = 0.3
    quantiles: tuple[float, ...] = attrs.field(default=(0.5, 0.9), validator=_levels)
    relative_head: bool = True
    hash_dim: int = attrs.field(default=DEFAULT_HASH_DIM, validator=_positive_int)
    n_components: int = attrs.field(default=DEFAULT_N_COMPONENTS, validator=_positive_int)
    seed: int = 0

    def lgb_params(self, objective: str, **extra: Any) -> dict[str, Any]:
        """Return LightGBM parameters for one head."""
        return {
            "objective": objective,
            "learning_rate": self.learning_rate,
            "num_leaves": self.num_leaves,
            "min_data_in_leaf": self.min_data_in_leaf,
            "feature_fraction": self.feature_fraction,
            "bagging_fraction": self.bagging_fraction,
            "bagging_freq": 1 if self.bagging_fraction < 1.0 else 0,
            "lambda_l2": self.lambda_l2,
            "seed": self.seed,
            "deterministic": True,
            "force_row_wise": True,
            "num_threads": 1,
            "verbose": -1,
            **extra,
        }


def _fit_head(
    x: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
    model_index: npt.NDArray[np.int64],
    n_models: int,
    model_col: int,
    params: dict[str, Any],
    rounds: int,
    quantile: float | None = None,
) -> TreeEnsemble:
    import lightgbm as lgb

    from bearsdk.predictors import _impl

    # Boost from each model's own mean (or quantile): the trees then only learn
    # how prompts move a model away from it, and the model ordering of the
    # per-model-mean baseline is the starting point rather than something each
    # head has to rediscover through categorical splits.
    def stat(v: npt.NDArray[np.float64]) -> float:
        return float(np.quantile(v, quantile) if quantile is not None else v.mean())

    base = np.array(
        [
            stat(y[model_index == j]) if (model_index == j).any() else stat(y)
            for j in range(n_models)
        ]
    )
    init = base[model_index]
    ds = lgb.Dataset(x, y, init_score=init, categorical_feature=[model_col], params={"verbose": -1})
    booster = lgb.train(params, ds, num_boost_round=rounds)
    ens = TreeEnsemble.from_lightgbm(booster.model_to_string(), base=base, base_feature=model_col)
    # The flat walker must agree with LightGBM exactly; check on the training rows.
    mine = np.empty(x.shape[0])
    _impl.Forest(**ens.evaluator_args()).predict_into(x, mine)
    if not np.array_equal(mine, booster.predict(x) + init):
        raise RuntimeError("flattened trees disagree with LightGBM: please report this as a bug")
    return ens


def _chars_per_token(data: TrainingSet, pipeline_prompts: tuple[str, ...]) -> list[float]:
    # A model's prior ratio: total characters over total reported prompt tokens.
    ratios = []
    lengths = np.array([len(p) for p in pipeline_prompts], dtype=np.float64)
    for j, spec in enumerate(data.pool):
        rows = (data.model_index == j) & ~np.isnan(data.prompt_tokens) & (data.prompt_tokens > 0)
        if rows.sum() >= 5:
            ratios.append(
                float(lengths[data.prompt_index[rows]].sum() / data.prompt_tokens[rows].sum())
            )
        else:
            ratios.append(spec.chars_per_token)
    return ratios


def train_predictor(
    data: TrainingSet, config: TrainConfig | None = None, *, info: dict[str, Any] | None = None
) -> Predictor:
    """Train the accuracy, output-length (and quantile) heads on ``data``.

    Args:
        data: The evaluations to learn from.
        config: LightGBM and feature settings (defaults when omitted).
        info: Extra provenance to record in the predictor.

    Raises:
        PredictorError: Too little data for a head.
    """
    config = config or TrainConfig()
    pipeline = FeaturePipeline.fit(
        data.prompts, hash_dim=config.hash_dim, n_components=config.n_components
    )
    ratios = _chars_per_token(data, data.prompts)
    pool = tuple(attrs.evolve(m, chars_per_token=r) for m, r in zip(data.pool, ratios, strict=True))
    x = feature_matrix(pipeline, pool, data.prompts, data.prompt_index, data.model_index)
    model_col = pipeline.n_features
    heads: dict[str, TreeEnsemble] = {}
    quantiles: dict[str, float] = {}
    has_acc = ~np.isnan(data.accuracy)
    has_len = ~np.isnan(data.output_tokens)
    for name, rows in ((ACCURACY, has_acc), (OUTPUT_TOKENS, has_len)):
        if rows.sum() < _MIN_ROWS:
            raise PredictorError(
                "data", f"has too few rows with {name} to train on", int(rows.sum())
            )
    m = len(pool)
    heads[ACCURACY] = _fit_head(
        x[has_acc],
        data.accuracy[has_acc],
        data.model_index[has_acc],
        m,
        model_col,
        config.lgb_params("huber", alpha=config.huber_delta),
        config.n_estimators,
    )
    lx, ly, lm = x[has_len], data.output_tokens[has_len], data.model_index[has_len]
    heads[OUTPUT_TOKENS] = _fit_head(
        lx, ly, lm, m, model_col, config.lgb_params("regression"), config.n_estimators
    )
    for q in config.quantiles:
        name = quantile_head(q)
        heads[name] = _fit_head(
            lx, ly, lm, m, model_col, config.lgb_params("quantile", alpha=q), config.n_estimators, q
        )
        quantiles[name] = q
    relative = None
    rel_record: dict[str, Any] = {}
    if config.relative_head:
        scores = np.full((len(data.prompts), m), np.nan)
        scores[data.prompt_index[has_acc], data.model_index[has_acc]] = data.accuracy[has_acc]
        prompt_x = np.zeros((len(data.prompts), pipeline.n_features))
        prompt_x[data.prompt_index] = x[:, : pipeline.n_features]
        relative, rel_record = fit_relative_accuracy(prompt_x, scores)
    record: dict[str, Any] = {
        "source": data.source,
        "n_prompts": len(data.prompts),
        "n_rows_accuracy": int(has_acc.sum()),
        "n_rows_output_tokens": int(has_len.sum()),
        "config": _config_dict(config),
    }
    if config.relative_head:
        record["relative_head"] = rel_record
    record.update(info or {})
    return Predictor(pipeline, pool, heads, quantiles, record, relative)


def _config_dict(config: TrainConfig) -> dict[str, Any]:
    d = attrs.asdict(config)
    d["quantiles"] = list(config.quantiles)
    return d

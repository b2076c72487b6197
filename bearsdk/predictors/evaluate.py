"""Held-out evaluation of the predictors against the per-model-mean baseline.

Prompts are split into ``k`` folds (all models of a prompt fall in the same
fold); each fold is predicted by a predictor trained on the others, so every
prompt is scored exactly once, by a predictor that never saw it. The baseline
predicts, for each model, its mean over the training folds: what a router
without prompt features would use.

Metrics, computed over all held-out rows:

* accuracy: MAE; per prompt, Spearman correlation between predicted and true
  scores across the pool's models (prompts whose true scores are all equal are
  skipped), and top-1 agreement (the predicted best model is a truly best one);
  the mean true accuracy of the model each predictor would pick;
* output length: MAE, MAPE and median APE (rows with a true length of at least
  one token), and the coverage of the p90 head (fraction of true lengths at or below it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors.dataset import TrainingSet
from bearsdk.predictors.errors import PredictorError
from bearsdk.predictors.predictor import ACCURACY, OUTPUT_TOKENS, quantile_head
from bearsdk.predictors.training import TrainConfig, train_predictor

__all__ = ["EvalReport", "MethodScores", "cross_validate", "rankdata", "spearman"]


def rankdata(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Return average ranks (ties share their mean rank), 1-based."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.shape[0], dtype=np.float64)
    sorted_vals = values[order]
    i = 0
    n = values.shape[0]
    while i < n:
        j = i
        while j + 1 < n and sorted_vals[j + 1] == sorted_vals[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> float:
    """Return Spearman's rank correlation of ``a`` and ``b`` (NaN when either is constant)."""
    ra, rb = rankdata(a), rankdata(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


@attrs.frozen
class MethodScores:
    """Held-out scores of one method (the predictor or the baseline).

    Attributes:
        accuracy_mae: Mean absolute error of the accuracy.
        spearman: Mean per-prompt Spearman correlation across models.
        top1: Fraction of prompts whose predicted best model is a truly best one.
        picked_accuracy: Mean true accuracy of the model predicted best.
        length_mae: Mean absolute error of the output length (tokens).
        length_mape: Mean absolute percentage error of the output length.
        length_median_ape: Median absolute percentage error of the output length
            (robust to the few near-empty outputs that dominate the MAPE).
        length_p90_coverage: Fraction of true lengths <= the p90 prediction (NaN without it).
    """

    accuracy_mae: float
    spearman: float
    top1: float
    picked_accuracy: float
    length_mae: float
    length_mape: float
    length_median_ape: float
    length_p90_coverage: float = float("nan")


@attrs.frozen
class EvalReport:
    """Result of :func:`cross_validate`.

    Attributes:
        models: The pool.
        n_prompts: Prompts evaluated (each held out once).
        folds: Number of folds.
        predictor: Scores of the trained predictors.
        baseline: Scores of the per-model-mean baseline.
        differences: Predictor minus baseline for each per-prompt metric
            (``accuracy_mae``, ``spearman``, ``top1``, ``picked_accuracy``,
            ``length_mae``): ``(mean, standard error over prompts)``. A difference
            within about two standard errors of zero is not significant.
        oracle_accuracy: Mean accuracy of the truly best model per prompt.
        per_model: Held-out accuracy MAE and length MAE per model, for both methods.
        source: Data source.
        relative_folds: Folds whose predictor kept the relative-accuracy head.
    """

    models: tuple[str, ...]
    n_prompts: int
    folds: int
    predictor: MethodScores
    baseline: MethodScores
    differences: dict[str, tuple[float, float]]
    oracle_accuracy: float
    per_model: dict[str, dict[str, float]]
    source: str
    relative_folds: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return attrs.asdict(self)


_PerPrompt = dict[str, npt.NDArray[np.float64]]


def _per_prompt_mean(
    data: TrainingSet, rows: npt.NDArray[np.bool_], values: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    n = len(data.prompts)
    total = np.bincount(data.prompt_index[rows], weights=values, minlength=n)
    count = np.bincount(data.prompt_index[rows], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        out: npt.NDArray[np.float64] = np.where(count > 0, total / count, np.nan)
    return out


def _scores(
    data: TrainingSet,
    acc_pred: npt.NDArray[np.float64],
    len_pred: npt.NDArray[np.float64],
    p90: npt.NDArray[np.float64] | None,
) -> tuple[MethodScores, _PerPrompt]:
    has_acc = ~np.isnan(data.accuracy)
    has_len = ~np.isnan(data.output_tokens) & (data.output_tokens >= 1.0)
    n_models = len(data.pool)
    truth = np.full((len(data.prompts), n_models), np.nan)
    pred = np.full_like(truth, np.nan)
    truth[data.prompt_index, data.model_index] = data.accuracy
    pred[data.prompt_index, data.model_index] = acc_pred
    n = truth.shape[0]
    rhos, top1, picked = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    for i in range(n):
        ok = ~np.isnan(truth[i]) & ~np.isnan(pred[i])
        if ok.sum() < 2:
            continue
        t, p = truth[i, ok], pred[i, ok]
        best = np.argmax(p)
        top1[i] = float(t[best] >= t.max())
        picked[i] = float(t[best])
        if np.ptp(t) > 0:
            rho = spearman(t, p)
            rhos[i] = 0.0 if np.isnan(rho) else rho  # a constant prediction ranks nothing
    acc_err = np.abs(acc_pred - data.accuracy)
    len_err = np.abs(len_pred - data.output_tokens)
    ape = len_err[has_len] / data.output_tokens[has_len]
    scores = MethodScores(
        accuracy_mae=float(acc_err[has_acc].mean()),
        spearman=float(np.nanmean(rhos)),
        top1=float(np.nanmean(top1)),
        picked_accuracy=float(np.nanmean(picked)),
        length_mae=float(len_err[has_len].mean()),
        length_mape=float(ape.mean()),
        length_median_ape=float(np.median(ape)),
        length_p90_coverage=(
            float((data.output_tokens[has_len] <= p90[has_len]).mean())
            if p90 is not None
            else float("nan")
        ),
    )
    per_prompt = {
        "accuracy_mae": _per_prompt_mean(data, has_acc, acc_err[has_acc]),
        "spearman": rhos,
        "top1": top1,
        "picked_accuracy": picked,
        "length_mae": _per_prompt_mean(data, has_len, len_err[has_len]),
    }
    return scores, per_prompt


def _differences(a: _PerPrompt, b: _PerPrompt) -> dict[str, tuple[float, float]]:
    out = {}
    for key in a:
        d = a[key] - b[key]
        d = d[~np.isnan(d)]
        se = float(d.std(ddof=1) / np.sqrt(d.shape[0])) if d.shape[0] > 1 else float("nan")
        out[key] = (float(d.mean()), se)
    return out


def cross_validate(
    data: TrainingSet,
    config: TrainConfig | None = None,
    *,
    folds: int = 5,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Score predictors on held-out prompts against the per-model-mean baseline.

    Args:
        data: The evaluations (all models of a prompt stay in one fold).
        config: Training settings.
        folds: Number of prompt folds (>= 2).
        seed: Seed of the fold assignment.
        progress: Called with ``(fold, folds)`` after each fold.

    Raises:
        PredictorError: Fewer than two folds or too few prompts.
    """
    config = config or TrainConfig()
    if isinstance(folds, bool) or not isinstance(folds, int) or folds < 2:
        raise PredictorError("folds", "must be an int >= 2", folds)
    n = len(data.prompts)
    if n < 2 * folds:
        raise PredictorError("data", f"has too few prompts for {folds} folds", n)
    fold_of = np.random.default_rng(seed).permutation(n) % folds
    acc_pred = np.full(data.n_rows, np.nan)
    len_pred = np.full(data.n_rows, np.nan)
    p90 = np.full(data.n_rows, np.nan)
    acc_base = np.full(data.n_rows, np.nan)
    len_base = np.full(data.n_rows, np.nan)
    p90_name = quantile_head(0.9)
    has_p90 = 0.9 in config.quantiles
    relative_folds = 0
    for k in range(folds):
        train_ids = np.flatnonzero(fold_of != k)
        train = data.select_prompts(train_ids)
        pred = train_predictor(train, config)
        relative_folds += pred.relative is not None
        rows = np.flatnonzero(fold_of[data.prompt_index] == k)
        x = pred.feature_rows(data.prompts, data.prompt_index[rows], data.model_index[rows])
        out = pred.predict_rows(x)
        acc_pred[rows] = out[ACCURACY]
        len_pred[rows] = out[OUTPUT_TOKENS]
        if has_p90:
            p90[rows] = out[p90_name]
        for j in range(len(data.pool)):
            mine = rows[data.model_index[rows] == j]
            tr = train.model_index == j
            acc_base[mine] = np.nanmean(train.accuracy[tr])
            len_base[mine] = np.nanmean(train.output_tokens[tr])
        if progress is not None:
            progress(k + 1, folds)
    truth = np.full((n, len(data.pool)), np.nan)
    truth[data.prompt_index, data.model_index] = data.accuracy
    best = np.nanmax(np.where(np.isnan(truth), -np.inf, truth), axis=1)
    per_model: dict[str, dict[str, float]] = {}
    for j, spec in enumerate(data.pool):
        r = data.model_index == j
        a = r & ~np.isnan(data.accuracy)
        ln = r & ~np.isnan(data.output_tokens)
        per_model[spec.name] = {
            "accuracy_mean": float(data.accuracy[a].mean()),
            "accuracy_mae": float(np.abs(acc_pred[a] - data.accuracy[a]).mean()),
            "accuracy_mae_baseline": float(np.abs(acc_base[a] - data.accuracy[a]).mean()),
            "length_mean": float(data.output_tokens[ln].mean()),
            "length_mae": float(np.abs(len_pred[ln] - data.output_tokens[ln]).mean()),
            "length_mae_baseline": float(np.abs(len_base[ln] - data.output_tokens[ln]).mean()),
        }
    pred_scores, pred_pp = _scores(data, acc_pred, len_pred, p90 if has_p90 else None)
    base_scores, base_pp = _scores(data, acc_base, len_base, None)
    return EvalReport(
        models=tuple(m.name for m in data.pool),
        n_prompts=n,
        folds=folds,
        predictor=pred_scores,
        baseline=base_scores,
        differences=_differences(pred_pp, base_pp),
        oracle_accuracy=float(best[np.isfinite(best)].mean()),
        per_model=per_model,
        source=data.source,
        relative_folds=relative_folds,
    )

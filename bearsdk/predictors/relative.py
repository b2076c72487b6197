"""The relative-accuracy head: which model of the pool suits a prompt better than its average.

The LightGBM accuracy head learns how hard a prompt is, which moves every model
of the pool together; routing also needs the *order* of the models on a prompt.
On judged data the order-changing signal is weak and spread thinly over many
prompt features (on AlpacaEval, the gap between two 7-9B models depends on the
kind of instruction by a few hundredths). Trees boosted at the accuracy head's
learning rate never move one model past another on that; a strongly
regularised linear model of the *pool-relative* scores does.

Target: for each training prompt with a score for every model of the pool, the
score minus the prompt's mean over the pool, minus the model's mean of that
(so it is zero-mean per prompt and per model). Model: ridge regression on the
standardised prompt features, one output per model, with one penalty chosen
over a grid by the ranking quality it gives held-out prompts: the mean
per-prompt Spearman correlation of the exact leave-one-prompt-out predictions
(a linear smoother's are closed-form), among penalties of at least the prompt
count (see :data:`PENALTY_GRID`). Ranking, not squared error, is the
criterion because the head exists to order the pool: on AlpacaEval's 55-model
pool the squared-error choice lowered the held-out Spearman by 0.066, the
ranking choice leaves it unchanged. The gain must clear two standard errors
(over prompts) at the chosen penalty: the best of 19 noisy held-out scores
beats the means by chance more often than not. When no penalty does (a pool
whose order the prompt does not change), the head is left out and the
accuracy head's order stands.

Because the targets sum to zero across the pool on every prompt, so does the
correction: it reorders the models without shifting a prompt's mean accuracy.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.predictors import _impl
from bearsdk.predictors.errors import PredictorFormatError

__all__ = [
    "MIN_PROMPTS",
    "PENALTY_GRID",
    "SIGNIFICANCE",
    "RelativeAccuracy",
    "fit_relative_accuracy",
]

PENALTY_GRID: Final = tuple(float(v) for v in np.geomspace(1.0, 1e3, 19))
"""Ridge penalties tried, as multiples of the prompt count.

With standardised features the penalty compares with the prompt count: at one
times it, a feature's coefficient is shrunk to about half its least-squares
value. Weaker penalties are not tried: at ~400 prompts they won the
leave-one-out comparison (+0.05 Spearman) and lost on new prompts (-0.05)."""

MIN_PROMPTS: Final = 50
"""Fewest prompts with a score for every model that the head is fitted on."""

SIGNIFICANCE: Final = 2.0
"""Standard errors by which the held-out ranking gain must exceed zero to keep the head."""


def _finite(value: object, field: str) -> npt.NDArray[np.float64]:
    arr = np.ascontiguousarray(value, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise PredictorFormatError(f"relative.{field}", "must be finite")
    return arr


def _weights(value: object) -> npt.NDArray[np.float64]:
    return _finite(value, "weights")


def _intercept(value: object) -> npt.NDArray[np.float64]:
    return _finite(value, "intercept")


@attrs.frozen(eq=False)
class RelativeAccuracy:
    """A linear correction of each model's accuracy from the prompt features.

    ``correction[j] = prompt_features @ weights[:, j] + intercept[j]`` (the
    standardisation is folded into the weights).

    Attributes:
        weights: ``float64[n_prompt_features, n_models]``.
        intercept: ``float64[n_models]``.
        penalty: The ridge penalty chosen (standardised features).
        loo_spearman_gain: Leave-one-prompt-out gain in mean per-prompt Spearman
            over the models' means, at that penalty.
        n_prompts: Prompts the head was fitted on.
    """

    weights: npt.NDArray[np.float64] = attrs.field(converter=_weights)
    intercept: npt.NDArray[np.float64] = attrs.field(converter=_intercept)
    penalty: float = 0.0
    loo_spearman_gain: float = 0.0
    n_prompts: int = 0

    _per_model: npt.NDArray[np.float64] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.weights.ndim != 2 or self.intercept.shape != (self.weights.shape[1],):
            raise PredictorFormatError(
                "relative",
                "needs weights[n_features, n_models] and intercept[n_models]",
                (self.weights.shape, self.intercept.shape),
            )
        object.__setattr__(self, "_per_model", np.ascontiguousarray(self.weights.T))

    @property
    def n_features(self) -> int:
        """Prompt features read."""
        return int(self.weights.shape[0])

    @property
    def n_models(self) -> int:
        """Models corrected."""
        return int(self.weights.shape[1])

    def add_to(
        self,
        x: npt.NDArray[np.float64],
        model_col: int,
        out: npt.NDArray[np.float64],
        lo: float = 0.0,
        hi: float = 1.0,
    ) -> None:
        """Add each feature row's correction to ``out`` (in place), then clip to ``[lo, hi]``.

        Row ``r`` is corrected for the model whose pool index is ``x[r, model_col]``.

        Raises:
            ValueError: A row's model id is not a pool index.
        """
        _impl.add_linear(
            x, self.n_features, model_col, self._per_model, self.intercept, out, lo, hi
        )

    def info(self) -> dict[str, Any]:
        """JSON-able description (recorded in the predictor file's metadata)."""
        return {
            "penalty": self.penalty,
            "loo_spearman_gain": self.loo_spearman_gain,
            "n_prompts": self.n_prompts,
        }


def _ranks(v: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    # Row-wise ranks; exact ties are rare with continuous scores and are broken by position.
    return np.argsort(np.argsort(v, axis=1), axis=1).astype(np.float64)


def _spearman(
    truth: npt.NDArray[np.float64], pred: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """Per-row Spearman correlation."""
    k = truth.shape[1]
    d = _ranks(truth) - _ranks(pred)
    rho: npt.NDArray[np.float64] = 1.0 - 6.0 * (d**2).sum(axis=1) / (k * (k * k - 1))
    return rho


def fit_relative_accuracy(
    features: npt.NDArray[np.float64], scores: npt.NDArray[np.float64]
) -> tuple[RelativeAccuracy | None, dict[str, Any]]:
    """Fit the head on per-prompt features and a prompts x models score table.

    Args:
        features: ``float64[n_prompts, n_prompt_features]``.
        scores: ``float64[n_prompts, n_models]``; NaN where a model has no score
            (such prompts are left out).

    Returns:
        The head, or ``None`` when it would not help (too few complete prompts,
        one model, or no penalty ranks held-out prompts better than the models'
        means), and a JSON-able record of the choice.
    """
    n_models = scores.shape[1]
    complete = ~np.isnan(scores).any(axis=1)
    n = int(complete.sum())
    record: dict[str, Any] = {"n_prompts": n}
    if n_models < 2 or n < MIN_PROMPTS:
        record["fitted"] = False
        record["reason"] = "one model" if n_models < 2 else f"fewer than {MIN_PROMPTS} prompts"
        return None, record
    a = scores[complete]
    y = a - a.mean(axis=1, keepdims=True)
    y -= y.mean(axis=0)
    x = features[complete]
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    used = scale > 1e-12
    z = np.zeros_like(x)
    z[:, used] = (x[:, used] - mean[used]) / scale[used]
    u, s, vt = np.linalg.svd(z, full_matrices=False)
    uty = u.T @ y
    level = a.mean(axis=0)
    base_rho = _spearman(a, np.broadcast_to(level, a.shape))
    best_bound, best_lam, best_gain = 0.0, None, 0.0
    for lam in (n * m for m in PENALTY_GRID):
        shrink = s**2 / (s**2 + lam)
        fitted = u @ (shrink[:, None] * uty)
        leverage = (u**2) @ shrink
        # Exact leave-one-prompt-out predictions of a linear smoother.
        loo = y - (y - fitted) / (1.0 - leverage)[:, None]
        diff = _spearman(a, level + loo) - base_rho
        # Picking the best of many penalties on noisy held-out ranks finds a
        # "gain" even where there is none; require it to clear two standard errors.
        bound = float(diff.mean() - SIGNIFICANCE * diff.std() / np.sqrt(n))
        if bound > best_bound:
            best_bound, best_lam, best_gain = bound, lam, float(diff.mean())
    record.update(
        fitted=best_lam is not None,
        penalty=best_lam,
        loo_spearman_gain=best_gain,
        loo_spearman_without=float(base_rho.mean()),
    )
    if best_lam is None:
        record["reason"] = "no penalty ranks held-out prompts significantly better than the means"
        return None, record
    coef = vt.T @ ((s / (s**2 + best_lam))[:, None] * uty)
    weights = np.zeros((x.shape[1], n_models))
    weights[used] = coef[used] / scale[used, None]
    intercept = -(mean @ weights)
    head = RelativeAccuracy(weights, intercept, float(best_lam), best_gain, n)
    return head, record

"""The four-term token-batch time model of eq. 12: evaluation, fitting, online recalibration.

``T = b0 + b1 * tokens + b2 * sum(decode context) + b3 * sum(prefill attention)``,
where a prefill chunk of ``t`` tokens after ``c`` computed ones contributes
``t*c + t*(t+1)/2`` to the attention sum. The compiled replay evaluates the same
expression inside its loop from the four coefficients (:attr:`BatchTimeModel.coeffs`).

Optional richer dense term (off by default): with ``dense_floor_tokens = tau > 0`` the
dense part is priced as ``b1 * max(tokens, tau)``: below ``tau`` tokens a batch costs
what reading the weights costs (memory-bound, flat); above it, one more token costs
``b1`` (compute-bound). ``tau = 0`` is exactly eq. 12. See ``docs/batch-time.md``.

Observed batches (composition + measured duration) are :class:`BatchObservation`;
:func:`fit_batch_time` fits non-negative coefficients robustly (NNLS inside
iteratively reweighted Huber on relative residuals), :class:`OnlineBatchTime` keeps
an instance's model tracking drift from the batch durations its engine reports
(recursive least squares with exponential forgetting, solved under non-negativity),
and :func:`read_batches` reads the ``bear.batch/1`` JSONL format.

This module fits; the model, its evaluation, observations and the batch records
are in :mod:`bearsdk.estimators.batch_model`, and every name there is
re-exported here.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import attrs
import numpy as np

from bearsdk.estimators.batch_model import (
    BATCH_SCHEMA,
    COEFF_NAMES,
    DECODE_KEYS,
    BatchDataError,
    BatchObservation,
    BatchTimeModel,
    FloatArray,
    batch_arrays,
    iter_terms,
    mape,
    prefill_attention_of,
    read_batches,
    self_keys_of,
    write_batches,
)
from bearsdk.replay.types import BatchRecord

__all__ = [
    "BATCH_SCHEMA",
    "DECODE_KEYS",
    "BatchDataError",
    "BatchObservation",
    "BatchTimeFit",
    "BatchTimeModel",
    "FloatArray",
    "OnlineBatchTime",
    "batch_arrays",
    "fit_batch_time",
    "iter_terms",
    "mape",
    "prefill_attention_of",
    "read_batches",
    "write_batches",
]

# --------------------------------------------------------------------------- NNLS


def _solve(g: FloatArray, r: FloatArray) -> FloatArray:
    try:
        sol = np.linalg.solve(g, r)
    except np.linalg.LinAlgError:
        sol = np.linalg.lstsq(g, r, rcond=None)[0]
    return np.asarray(sol, dtype=np.float64)


def _nnls_normal(gram: FloatArray, rhs: FloatArray) -> FloatArray:
    """Exact non-negative least squares from the normal equations, for a few columns.

    The NNLS optimum is the unconstrained optimum on its own support, and that
    restricted solution is feasible; every other feasible restricted solution
    scores no better. So trying every support (2**p, p <= 6) is exact, needs no
    iteration tolerance, and costs nothing at this size. The full support is
    tried first: when its solution is already non-negative it is the answer.
    """
    p = gram.shape[0]
    full = _solve(gram, rhs)
    if np.all(full >= 0) and np.all(np.isfinite(full)):
        return np.asarray(full, dtype=np.float64)
    best = np.zeros(p)
    best_obj = 0.0
    for mask in itertools.product((False, True), repeat=p):
        idx = [i for i in range(p) if mask[i]]
        if not idx or len(idx) == p:
            continue
        sol = _solve(gram[np.ix_(idx, idx)], rhs[idx])
        if not np.all(np.isfinite(sol)) or np.any(
            sol < -1e-12 * max(1.0, float(np.max(np.abs(sol))))
        ):
            continue
        c = np.zeros(p)
        c[idx] = np.maximum(sol, 0.0)
        obj = float(c @ gram @ c - 2.0 * rhs @ c)
        if obj < best_obj - 1e-15 * max(1.0, abs(best_obj)):
            best, best_obj = c, obj
    return best


def _design(features: FloatArray, tau: float, self_keys: int) -> FloatArray:
    x = np.empty((features.shape[0], 4), dtype=np.float64)
    x[:, 0] = 1.0
    x[:, 1] = np.maximum(features[:, 0] + features[:, 1], tau)
    x[:, 2] = features[:, 2] + self_keys * features[:, 1]
    x[:, 3] = features[:, 3]
    return x


def _weighted_nnls(x: FloatArray, y: FloatArray, w: FloatArray) -> FloatArray:
    # Scale columns so the normal matrix is well conditioned: raw columns span
    # ~1 (overhead) to ~1e9 (prefill attention units).
    scale = np.sqrt(np.mean(x * x * w[:, None], axis=0))
    scale[scale == 0] = 1.0
    xs = x / scale
    gram = (xs * w[:, None]).T @ xs
    rhs = (xs * w[:, None]).T @ y
    return np.asarray(_nnls_normal(gram, rhs) / scale, dtype=np.float64)


@attrs.frozen
class BatchTimeFit:
    """The result of :func:`fit_batch_time`.

    Attributes:
        model: The fitted coefficients.
        mape: Mean absolute percentage error on the fitted data (fraction).
        median_ape: Median absolute percentage error (fraction).
        max_ape: Largest absolute percentage error (fraction).
        n: Observations used.
        n_downweighted: Observations the robust loss gave less than full weight
            (relative residual beyond ``huber_delta``): the outliers.
        iterations: Reweighting iterations run.
        unidentified: Terms the data cannot determine (the term is 0 in every
            batch); their coefficients are 0.
    """

    model: BatchTimeModel
    mape: float
    median_ape: float
    max_ape: float
    n: int
    n_downweighted: int
    iterations: int
    unidentified: tuple[str, ...] = ()


def _irls(
    x: FloatArray, y: FloatArray, loss: str, delta: float, max_iter: int
) -> tuple[FloatArray, FloatArray, int]:
    base = 1.0 / (y * y)  # relative least squares: every batch counts by its % error
    w = base.copy()
    coef = _weighted_nnls(x, y, w)
    it = 1
    if loss == "huber":
        while it < max_iter:
            it += 1
            r = np.abs(y - x @ coef) / y
            h = np.where(r <= delta, 1.0, delta / np.maximum(r, 1e-300))
            w = base * h
            new = _weighted_nnls(x, y, w)
            done = np.allclose(new, coef, rtol=1e-9, atol=0.0)
            coef = new
            if done:
                break
    return coef, w / base, it


def fit_batch_time(
    observations: Sequence[BatchObservation] | tuple[FloatArray, FloatArray],
    *,
    dense_floor: bool | float = False,
    loss: Literal["huber", "squared"] = "huber",
    huber_delta: float = 0.05,
    max_iter: int = 50,
    decode_keys: str = DECODE_KEYS[0],
) -> BatchTimeFit:
    """Fit eq. 12's coefficients to observed batches: non-negative and robust to outliers.

    Minimises the Huber loss of the *relative* residuals ``(observed - predicted) /
    observed`` (so a 10 ms batch counts as much as a 1 s one, matching the MAPE it
    reports) under ``b >= 0``, by iteratively reweighted least squares with an exact
    NNLS solve at each step. Batches slowed by CPU or kernel hiccups (the paper's
    outliers) get weight ``huber_delta / |residual|`` instead of dominating the fit.

    Args:
        observations: Observed batches, or ``(features, durations)`` as from
            :func:`batch_arrays`.
        dense_floor: ``False``: eq. 12. ``True``: also fit the richer dense term's
            floor ``tau`` (grid search over observed batch sizes). A number: use
            that ``tau``.
        loss: ``"huber"`` (robust, default) or ``"squared"`` (plain relative LS).
        huber_delta: Relative residual beyond which a batch is down-weighted.
        max_iter: Cap on reweighting iterations.
        decode_keys: The model's decode convention (:data:`DECODE_KEYS`).

    Returns:
        The fit and its error statistics.

    Raises:
        BatchDataError: Fewer than one observation, or bad options.
    """
    if isinstance(observations, tuple):
        features = np.asarray(observations[0], dtype=np.float64)
        y = np.asarray(observations[1], dtype=np.float64)
    else:
        features, y = batch_arrays(observations)
    n = len(y)
    if n == 0:
        raise BatchDataError("observations", "must hold at least one batch", 0)
    if features.shape != (n, 4):
        raise BatchDataError("features", "must be an (n, 4) array", features.shape)
    if not np.all(np.isfinite(y) & (y > 0)):
        bad = int(np.flatnonzero(~(np.isfinite(y) & (y > 0)))[0])
        raise BatchDataError(f"durations[{bad}]", "must be a finite number > 0", float(y[bad]))
    if loss not in ("huber", "squared"):
        raise BatchDataError("loss", "must be 'huber' or 'squared'", loss)
    if not (huber_delta > 0 and math.isfinite(huber_delta)):
        raise BatchDataError("huber_delta", "must be a finite number > 0", huber_delta)
    if decode_keys not in DECODE_KEYS:
        raise BatchDataError("decode_keys", f"must be one of {DECODE_KEYS}", decode_keys)
    self_keys = self_keys_of(decode_keys)

    tau = 0.0
    if dense_floor is True:
        tau = _search_floor(features, y, loss, huber_delta, max_iter, self_keys)
    elif dense_floor is not False:
        tau = float(dense_floor)
        if not (math.isfinite(tau) and tau >= 0):
            raise BatchDataError("dense_floor", "must be a finite number >= 0", dense_floor)
    x = _design(features, tau, self_keys)
    coef, weights, it = _irls(x, y, loss, huber_delta, max_iter)
    model = BatchTimeModel(
        float(coef[0]),
        float(coef[1]),
        float(coef[2]),
        float(coef[3]),
        dense_floor_tokens=tau,
        decode_keys=decode_keys,
    )
    ape = np.abs(model.predict(features) - y) / y
    unidentified = tuple(COEFF_NAMES[j] for j in (2, 3) if not np.any(features[:, j] != 0))
    return BatchTimeFit(
        model=model,
        mape=float(np.mean(ape)),
        median_ape=float(np.median(ape)),
        max_ape=float(np.max(ape)),
        n=n,
        n_downweighted=int(np.sum(weights < 1.0)),
        iterations=it,
        unidentified=unidentified,
    )


def _search_floor(
    features: FloatArray, y: FloatArray, loss: str, delta: float, max_iter: int, self_keys: int
) -> float:
    tokens = features[:, 0] + features[:, 1]
    # Candidates: observed batch sizes up to the 95th percentile (a knee above
    # nearly every batch would price them all flat).
    cap = float(np.quantile(tokens, 0.95))
    every = np.concatenate([[0.0], np.unique(tokens[tokens <= cap])])
    # Robust weights from the eq. 12 fit keep one hiccup from choosing the knee.
    _, h, _ = _irls(_design(features, 0.0, self_keys), y, loss, delta, max_iter)
    w = h / (y * y)

    def objective(tau: float) -> float:
        x = _design(features, tau, self_keys)
        coef = _weighted_nnls(x, y, w)
        return float(np.sum(w * (y - x @ coef) ** 2))

    # Coarse pass over at most 64 candidates, then every size around the best one.
    step = max(1, len(every) // 64)
    coarse = every[::step]
    scores = [objective(float(t)) for t in coarse]
    i = int(np.argmin(scores))
    lo = coarse[max(0, i - 1)]
    hi = coarse[min(len(coarse) - 1, i + 1)]
    best_tau, best_obj = float(coarse[i]), scores[i]
    for tau in every[(every > lo) & (every < hi)]:
        obj = objective(float(tau))
        if obj < best_obj * (1 - 1e-12):
            best_tau, best_obj = float(tau), obj
    # The knee need not be an observed size: golden-section search between the
    # best size's neighbours, where the objective is smooth.
    k = int(np.searchsorted(every, best_tau))
    a, b = float(every[max(0, k - 1)]), float(every[min(len(every) - 1, k + 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = objective(c), objective(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = objective(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = objective(d)
    for tau, obj in ((c, fc), (d, fd)):
        if obj < best_obj * (1 - 1e-12):
            best_tau, best_obj = tau, obj
    return best_tau


# --------------------------------------------------------------------------- online


_REASONS: Final = (
    "non-finite",
    "non-positive-duration",
    "too-long",
    "negative-composition",
    "empty-batch",
    "absurd",
)


@attrs.define
class OnlineBatchTime:
    """Tracks one instance's eq. 12 coefficients from the batch durations its engine reports.

    Recursive least squares in information form with exponential forgetting: each
    accepted batch updates exponentially weighted normal equations of the relative
    residual (``O(16)`` work); the model is the exact non-negative solution of those
    equations, recomputed lazily when read. ``forgetting = 0.995`` remembers about
    the last 200 batches, so a drifted instance (thermal throttling, a co-located
    job, a driver update) is tracked within a few hundred batches without a restart.

    Each solve is pulled towards the previous solution (starting at ``initial``)
    by a proximal ridge of ``prior_weight`` batch-equivalents (forgotten like
    data: it damps the first noisy batches) plus ``regularization`` (never
    forgotten). Along directions the recent batches do not inform (e.g. no
    prefill for a while) the coefficients hold their last value instead of
    winding up; where data inform them the ridge vanishes at the fixed point, so
    it adds no bias.

    A bad observation is never folded in; it is counted by reason
    (:attr:`rejected`): ``non-finite``, ``non-positive-duration``, ``too-long``
    (over ``max_duration_s``), ``negative-composition``, ``empty-batch``, and once
    warmed up ``absurd`` (off from the current prediction by more than a factor
    ``absurd_ratio``). Plausible but surprising batches are down-weighted by a
    Huber weight on the relative residual instead (:attr:`downweighted`).

    Args:
        initial: The starting model (a profile, or an offline fit). Its
            ``dense_floor_tokens`` and ``decode_keys`` are kept fixed.
        forgetting: Per-batch forgetting factor in ``(0, 1]``.
        prior_weight: Batch-equivalents of damping towards ``initial`` at start
            (forgotten like data).
        regularization: Batch-equivalents of the permanent proximal damping.
        huber_delta: Relative residual beyond which a batch is down-weighted.
        absurd_ratio: Reject a batch whose duration is off the prediction by more
            than this factor (after ``warmup`` batch-equivalents of data).
        max_duration_s: Reject any batch longer than this.
        warmup: Effective batches before the ``absurd`` test applies.
        resolve_every: Observations between re-solves of the model used to screen
            new observations (reading :attr:`model` always re-solves).
    """

    initial: BatchTimeModel
    forgetting: float = attrs.field(default=0.995)
    prior_weight: float = 5.0
    regularization: float = 0.05
    huber_delta: float = 0.1
    absurd_ratio: float = 20.0
    max_duration_s: float = 600.0
    warmup: float = 20.0
    resolve_every: int = 16
    _since_solve: int = attrs.field(init=False, default=0)
    _scale: FloatArray = attrs.field(init=False)
    _gram: FloatArray = attrs.field(init=False)
    _rhs: FloatArray = attrs.field(init=False)
    _anchor: FloatArray = attrs.field(init=False)
    _n_eff: float = attrs.field(init=False, default=0.0)
    _prior_mass: float = attrs.field(init=False, default=0.0)
    _model: BatchTimeModel = attrs.field(init=False)
    _dirty: bool = attrs.field(init=False, default=False)
    _accepted: int = attrs.field(init=False, default=0)
    _downweighted: int = attrs.field(init=False, default=0)
    _rejected: Counter[str] = attrs.field(init=False, factory=Counter)

    @forgetting.validator
    def _check_forgetting(self, att: attrs.Attribute[float], value: float) -> None:
        if not (0.0 < value <= 1.0):
            raise ValueError(f"forgetting must be in (0, 1] (got {value!r})")

    def __attrs_post_init__(self) -> None:
        for name in ("prior_weight", "regularization", "huber_delta", "absurd_ratio", "warmup"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (got {v!r})")
        if self.absurd_ratio <= 1.0:
            raise ValueError(f"absurd_ratio must be > 1 (got {self.absurd_ratio!r})")
        # Parametrise by multiples of typical term sizes so every unknown is O(1)
        # and the ridge is isotropic; a zero initial coefficient gets a typical
        # magnitude of a mid-size GPU instead.
        typical = np.array([5e-3, 5e-5, 5e-9, 5e-11])
        init = np.array(self.initial.coeffs)
        self._scale = np.where(init > 0, init, typical)
        self._anchor = init / self._scale
        self._gram = np.zeros((4, 4))
        self._rhs = np.zeros(4)
        self._prior_mass = self.prior_weight
        self._model = self.initial

    def _resolve(self) -> None:
        ridge = self.regularization + self._prior_mass
        g = self._gram + ridge * np.eye(4)
        r = self._rhs + ridge * self._anchor
        theta = _nnls_normal(g, r)
        # Proximal anchor: the next solve is pulled towards this one, not towards
        # the initial model, so the anchor blocks wind-up without biasing the fit.
        self._anchor = theta
        coef = theta * self._scale
        self._model = attrs.evolve(
            self.initial,
            b0=float(coef[0]),
            b1=float(coef[1]),
            b2=float(coef[2]),
            b3=float(coef[3]),
        )
        self._dirty = False

    @property
    def model(self) -> BatchTimeModel:
        """The current coefficients (exact NNLS of the forgetting-weighted data)."""
        if self._dirty:
            self._since_solve = 0
            self._resolve()
        return self._model

    @property
    def accepted(self) -> int:
        """Observations folded in."""
        return self._accepted

    @property
    def downweighted(self) -> int:
        """Accepted observations that got less than full weight (robust loss)."""
        return self._downweighted

    @property
    def rejected(self) -> Mapping[str, int]:
        """Rejected observations, counted by reason."""
        return dict(self._rejected)

    @property
    def effective_batches(self) -> float:
        """Forgetting-weighted number of batches the model rests on."""
        return self._n_eff

    def _reject(self, reason: str) -> bool:
        self._rejected[reason] += 1
        return False

    def observe(
        self,
        prefill_tokens: float,
        decode_tokens: float,
        decode_context: float,
        prefill_attention: float,
        duration_s: float,
    ) -> bool:
        """Fold in one executed batch, or reject it.

        Args:
            prefill_tokens: Prompt tokens in the batch.
            decode_tokens: Decode tokens in the batch.
            decode_context: Sum of decode contexts.
            prefill_attention: Sum of prefill attention units.
            duration_s: Measured duration, seconds.

        Returns:
            Whether the observation was accepted.
        """
        vals = (prefill_tokens, decode_tokens, decode_context, prefill_attention, duration_s)
        try:
            if not all(math.isfinite(float(v)) for v in vals):
                return self._reject("non-finite")
        except (TypeError, ValueError):
            return self._reject("non-finite")
        if duration_s <= 0:
            return self._reject("non-positive-duration")
        if duration_s > self.max_duration_s:
            return self._reject("too-long")
        if min(prefill_tokens, decode_tokens, decode_context, prefill_attention) < 0:
            return self._reject("negative-composition")
        if prefill_tokens + decode_tokens < 1:
            return self._reject("empty-batch")
        # The screening model may lag a few batches: re-solving the NNLS on every
        # observation would cost more than everything else here together.
        if self._dirty and self._since_solve >= self.resolve_every:
            self._since_solve = 0
            self._resolve()
        model = self._model
        pred = model.batch_time(
            int(prefill_tokens), int(decode_tokens), int(decode_context), int(prefill_attention)
        )
        ratio = duration_s / pred if pred > 0 else math.inf
        if self._n_eff >= self.warmup and not (
            1.0 / self.absurd_ratio <= ratio <= self.absurd_ratio
        ):
            return self._reject("absurd")
        x = np.array(
            [
                1.0,
                max(prefill_tokens + decode_tokens, model.dense_floor_tokens),
                model.decode_units(decode_tokens, decode_context),
                prefill_attention,
            ]
        )
        xs = x * self._scale / duration_s  # relative residual: target 1
        weight = 1.0
        if self._n_eff >= self.warmup:
            r = abs(1.0 - 1.0 / ratio) if math.isfinite(ratio) else math.inf
            if r > self.huber_delta:
                weight = self.huber_delta / r
                self._downweighted += 1
        lam = self.forgetting
        self._gram *= lam
        self._rhs *= lam
        self._gram += weight * np.outer(xs, xs)
        self._rhs += weight * xs
        self._n_eff = lam * self._n_eff + 1.0
        self._prior_mass *= lam
        self._accepted += 1
        self._since_solve += 1
        self._dirty = True
        return True

    def observe_batch(
        self, batch: BatchObservation | BatchRecord, duration_s: float | None = None
    ) -> bool:
        """Fold in an observation, or a replay :class:`BatchRecord` with its measured duration."""
        d = batch.duration_s if duration_s is None else duration_s
        return self.observe(
            batch.prefill_tokens,
            batch.decode_tokens,
            batch.decode_context,
            batch.prefill_attention,
            d,
        )

"""Each instance's real speed, learned from its snapshots: the self-calibrating time model.

A profile's eq. 12 coefficients were measured on some GPU, some day. The GPU
the router talks to may be throttled, shared, or another model of card; an
engine upgrade may have changed its kernels. The router must notice without
sending the instance traffic to find out: an instance that is wrongly believed
slow gets no requests, so no first token would ever correct the belief.

Two successive snapshots of a busy engine say how much work it did between
them, and the engine clock says how long it took. :func:`interval_evidence`
turns a pair into one observation: the number of engine steps (read from the
requests that decoded throughout: a running request gains exactly one computed
token per step, so this needs no step counter), and the tokens processed,
split into prefill and decode, with their attention contexts; eq. 12 with the
base coefficients prices that work (``predicted_s``) against the measured
``observed_s``. :class:`SpeedTracker` folds the observations into a speed
factor: the ratio of sums with exponential forgetting on the engine clock,
which is the weighted least-squares estimate of ``observed = factor x
predicted`` when a stretch's variance grows with its length, with a standard
error from the same sums (``docs/calibration.md``).

The evidence is approximate at the edges of each interval (the step in flight
at each capture; requests that finished in between, whose last tokens are not
seen): errors that average out over successive intervals, since the intervals
telescope. Stretches with no request running throughout (possibly idle) give
no evidence: the factor then holds its value while its uncertainty grows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Final

import attrs
import numpy as np

from bearsdk.estimators.batch_model import BatchTimeModel
from bearsdk.snapshot import (
    COL_COMPUTED,
    COL_OUTPUT,
    COL_OUTPUT_LEN,
    COL_PLACEHOLDERS,
    COL_PROMPT,
    COL_STATE,
    STATE_RUNNING,
    Snapshot,
)

__all__ = ["SpeedEstimate", "SpeedInterval", "SpeedTracker", "interval_evidence"]

MAX_INTERVAL_S: Final = 30.0
"""Longest stretch between two snapshots that counts as evidence (seconds)."""

_RESOLVE_EVERY: Final = 8

MIN_STEP_S: Final = 20e-6
"""No engine step is shorter: a pair claiming more steps per second is refused."""


@attrs.frozen
class SpeedInterval:
    """What an engine did between two snapshots.

    Attributes:
        steps: Engine steps in the stretch.
        observed_s: Engine-clock time from the end of the batch in flight at the
            first capture to the end of the one in flight at the second.
        predicted_s: What the base eq. 12 model predicts for the same work.
        prefill_tokens: Prompt tokens processed.
        decode_tokens: Decode tokens processed.
        terms: ``predicted_s`` split into eq. 12's four terms (per batch, dense,
            decode attention, prefill attention), seconds.
    """

    steps: int
    observed_s: float
    predicted_s: float
    prefill_tokens: int
    decode_tokens: int
    terms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @property
    def ratio(self) -> float:
        """Observed over predicted time: this stretch's speed factor."""
        return self.observed_s / self.predicted_s


def interval_evidence(
    a: Snapshot, b: Snapshot, model: BatchTimeModel, token_budget: int
) -> SpeedInterval | None:
    """Price the work an engine did between snapshots ``a`` and ``b`` (``None``: no evidence).

    Args:
        a: The earlier snapshot.
        b: The later snapshot, of the same engine run.
        model: The base eq. 12 coefficients the work is priced with.
        token_budget: The engine's per-step token budget (how many steps a
            stretch's prefill needed at least).

    Returns:
        The stretch, or ``None`` when the pair says nothing about speed: another
        engine run, a clock that did not advance or jumped, no request decoding
        throughout, fewer than two steps, or an implausible step rate.
    """
    # Each snapshot counts the batch in flight at its capture as computed: the
    # stretch runs from that batch's end to the other's. From capture to capture
    # instead would count one batch's time without its tokens, and a capture at a
    # random moment most likely falls in a long batch (length-biased sampling:
    # +7-10% at load in the simulator).
    dt = (b.time + (b.inflight_remaining_s or 0.0)) - (a.time + (a.inflight_remaining_s or 0.0))
    if not (0.0 < dt <= MAX_INTERVAL_S) or a.epoch != b.epoch or b.seq <= a.seq:
        return None
    before = {rid: i for i, rid in enumerate(a.ids)}
    nb = len(b.ids)
    ia = np.fromiter((before.get(r, -1) for r in b.ids), dtype=np.int64, count=nb)
    # float64 throughout: sums of products of untrusted (bounded) counts never overflow.
    ta = a.table.astype(np.float64)
    tb = b.table.astype(np.float64)
    present = ia >= 0
    ra = ta[np.where(present, ia, 0)] if len(ta) else np.zeros_like(tb)
    p = tb[:, COL_PROMPT]
    cb = tb[:, COL_COMPUTED]
    ca = np.where(present, ra[:, COL_COMPUTED], 0.0)
    # The steps, from requests that decoded from a to b: one token each step.
    gained = cb - ca
    made = tb[:, COL_OUTPUT] + tb[:, COL_PLACEHOLDERS] - ra[:, COL_OUTPUT] - ra[:, COL_PLACEHOLDERS]
    decoding = (
        present
        & (ra[:, COL_STATE] == STATE_RUNNING)
        & (tb[:, COL_STATE] == STATE_RUNNING)
        & (ra[:, COL_COMPUTED] >= ra[:, COL_PROMPT])
        & (gained == made)
    )
    steps = int(gained[decoding].max()) if decoding.any() else 0
    if steps < 2 or dt < steps * MIN_STEP_S:
        return None
    ca = np.where(cb < ca, 0.0, ca)  # preempted since: recomputed from scratch
    work = _work(p, ca, cb)
    # Requests gone by b finished in between; when is not known: half the stretch.
    seen = np.zeros(len(ta), dtype=bool)
    seen[ia[present]] = True
    gone = ta[~seen & (ta[:, COL_STATE] == STATE_RUNNING)] if len(ta) else ta
    if len(gone):
        half = float(steps // 2)
        olen = gone[:, COL_OUTPUT_LEN]
        left = np.where(olen >= 0, np.clip(olen - gone[:, COL_OUTPUT], 0.0, half), half)
        gp, gc = gone[:, COL_PROMPT], gone[:, COL_COMPUTED]
        work += _work(gp, gc, np.maximum(gc, gp) + left)
    pre, dec, ctx, att = (float(x) for x in work)
    terms = _price(model, steps, pre, dec, ctx, att, token_budget)
    predicted = sum(terms)
    if not predicted > 0.0:
        return None
    return SpeedInterval(steps, dt, predicted, int(pre), int(dec), terms)


def _work(prompt: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Prefill and decode tokens from ``start`` to ``end`` computed, with their
    contexts, summed over requests: ``[prefill, decode, decode context, prefill attention]``."""
    end = np.maximum(end, start)
    lo = np.minimum(start, prompt)
    pre = np.maximum(np.minimum(end, prompt) - lo, 0.0)
    # Eq. 12's units (prefill_attention_of), one chunk or many: they add up the same.
    att = pre * lo + pre * (pre + 1.0) / 2.0
    dec = end - start - pre
    s = np.maximum(start, prompt)
    # The contexts before each decode token (the model adds its own key where its
    # convention says so: BatchTimeModel.decode_units).
    ctx = dec * s + dec * (dec - 1.0) / 2.0
    return np.array([pre.sum(), dec.sum(), ctx.sum(), att.sum()])


def _price(
    model: BatchTimeModel, steps: int, pre: float, dec: float, ctx: float, att: float, budget: int
) -> tuple[float, float, float, float]:
    """Eq. 12 over ``steps`` batches that together did this work.

    The dense term is per batch (``b1 * max(tokens, floor)``): decode tokens are
    spread over every step, prefill over the fewest steps the budget allows.
    """
    per_step = dec / steps
    floor = model.dense_floor_tokens
    m = min(steps, math.ceil(pre / max(1, budget))) if pre else 0
    dense = (steps - m) * max(per_step, floor)
    if m:
        dense += m * max(per_step + pre / m, floor)
    return (
        model.b0 * steps,
        model.b1 * dense,
        model.b2 * model.decode_units(dec, ctx),
        model.b3 * att,
    )


@attrs.frozen
class SpeedEstimate:
    """An instance's learned speed.

    Attributes:
        factor: Real time over the base model's time (``2.0``: twice slower).
        stderr: Its standard error (``inf`` before any evidence).
        steps: Engine steps observed in all.
        intervals: Snapshot pairs folded in.
        evidence_s: Forgetting-weighted predicted seconds the factor rests on.
        age_s: Engine-clock seconds since the last evidence (``inf``: none yet).
    """

    factor: float
    stderr: float
    steps: int
    intervals: int
    evidence_s: float
    age_s: float

    def describe(self, name: str) -> str:
        """One line for humans, e.g. ``qwen3-32b runs 1.9x slower than its profile``."""
        if self.intervals == 0:
            return f"{name}: speed not observed yet (profile as is)"
        f = self.factor
        how = f"{f:.2f}x slower" if f >= 1.0 else f"{1.0 / f:.2f}x faster"
        return (
            f"{name} runs {how} than its profile (+-{self.stderr:.2f}), "
            f"learned from {self.steps} steps"
        )


def _term_ratios(old: BatchTimeModel, new: BatchTimeModel) -> np.ndarray | None:
    """Each eq. 12 coefficient of ``new`` over ``old`` (``None``: one that is not a
    finite ratio >= 0; a term ``old`` prices at nothing keeps its evidence as is)."""
    out = []
    for a, b in zip(old.coeffs, new.coeffs, strict=True):
        r = b / a if a > 0.0 else 1.0
        if not (math.isfinite(r) and r >= 0.0):
            return None
        out.append(r)
    return np.array(out)


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{att.name} must be a finite number > 0 (got {value!r})")


@attrs.define
class SpeedTracker:
    """Learns one instance's speed factor from :class:`SpeedInterval` evidence.

    Args:
        base: The coefficients the evidence is priced with (a profile, or an
            online fit of the engine's batches): :attr:`model` is this, scaled.
        memory_s: Time constant of the forgetting, on the engine clock: a step
            change of speed is tracked within about two of these.
        prior_s: Predicted seconds of pseudo-evidence for factor 1 at the start
            (forgotten like data).
        min_factor: Smallest factor the estimate may take.
        max_factor: Largest factor the estimate may take.
        absurd_ratio: Once warm, a stretch whose own factor is off the current
            one by more than this is refused (counted, not folded in).
        warmup_s: Predicted seconds of evidence before that test applies.
        per_term: Also fit one factor per eq. 12 term (per batch, dense, decode
            attention, prefill attention), each pulled towards the overall
            factor by a ridge of ``term_ridge`` (relative to the evidence):
            a profile is rarely off by one factor everywhere (the simulator's
            32B profile is 19% fast on small decode batches and 5% slow under
            load), and one factor learned on decode-heavy stretches would
            misprice the new request's prefill. A term the evidence does not
            separate keeps the overall factor.
        term_ridge: See ``per_term``.
    """

    base: BatchTimeModel
    memory_s: float = attrs.field(default=3.0, validator=_positive)
    prior_s: float = attrs.field(default=0.05, validator=_positive)
    min_factor: float = attrs.field(default=0.05, validator=_positive)
    max_factor: float = attrs.field(default=20.0, validator=_positive)
    absurd_ratio: float = attrs.field(default=8.0, validator=_positive)
    warmup_s: float = attrs.field(default=1.0, validator=_positive)
    per_term: bool = True
    term_ridge: float = attrs.field(default=0.01, validator=_positive)
    # Per-term normal equations, weighted by 1 / predicted (variance grows with length).
    _gram: np.ndarray = attrs.field(init=False, factory=lambda: np.zeros((4, 4)))
    _rhs: np.ndarray = attrs.field(init=False, factory=lambda: np.zeros(4))
    # Forgetting-weighted sums of the predicted time per term (what rebase re-prices).
    _terms: np.ndarray = attrs.field(init=False, factory=lambda: np.zeros(4))
    # Forgetting-weighted sums: observed, predicted, observed^2 / predicted, count.
    _obs: float = attrs.field(init=False, default=0.0)
    _pred: float = attrs.field(init=False, default=0.0)
    _sq: float = attrs.field(init=False, default=0.0)
    _n: float = attrs.field(init=False, default=0.0)
    _last: float = attrs.field(init=False, default=-math.inf)
    _steps: int = attrs.field(init=False, default=0)
    _intervals: int = attrs.field(init=False, default=0)
    _rejected: Counter[str] = attrs.field(init=False, factory=Counter)
    _model: BatchTimeModel | None = attrs.field(init=False, default=None)
    _solved: int = attrs.field(init=False, default=0)
    # The factor, kept current by every change of the sums (read once per
    # instance per decision, changed once per stretch).
    _factor: float = attrs.field(init=False, default=1.0)

    def __attrs_post_init__(self) -> None:
        if self.min_factor >= self.max_factor:
            raise ValueError(
                f"min_factor must be < max_factor (got {self.min_factor} >= {self.max_factor})"
            )
        if self.absurd_ratio <= 1.0:
            raise ValueError(f"absurd_ratio must be > 1 (got {self.absurd_ratio!r})")
        self._reset()

    def _reset(self) -> None:
        self._obs = self._pred = self._sq = self.prior_s
        self._n = 1.0
        self._gram = np.zeros((4, 4))
        self._rhs = np.zeros(4)
        self._terms = np.zeros(4)
        self._model = None
        self._solved = self._intervals
        self._factor = self._clamped()

    def _clamped(self) -> float:
        return min(max(self._obs / self._pred, self.min_factor), self.max_factor)

    def rebase(self, model: BatchTimeModel) -> None:
        """New base coefficients (an online fit of the engine's own batch times).

        The evidence priced with the old ones is priced again with the new, term
        by term (each term's predicted time scales with its coefficient), so that
        :attr:`model` stays what it was on that evidence and the factors then
        follow the evidence to come. An online fit forgets slowly (hundreds of
        batches): rebased every few dozen batches, a tracker that started over
        would throw away, again and again, the change of speed the snapshots
        had already shown it, and underprice the engine until the fit caught
        up. Evidence without its terms, or a new base that prices it at
        nothing, starts over.
        """
        old, self.base = self.base, model
        scale = _term_ratios(old, model)
        total = float(self._terms.sum())
        pred = self._pred
        if scale is None or not total > 0.0:
            self._reset()
            return
        new_pred = pred * float(scale @ self._terms) / total
        if not (math.isfinite(new_pred) and new_pred > 0.0):
            self._reset()
            return
        self._pred = new_pred
        # (obs^2 / pred: the residual sum behind stderr keeps its proportion.)
        self._sq *= pred / new_pred
        self._terms = self._terms * scale
        self._gram = self._gram * np.outer(scale, scale)
        self._rhs = self._rhs * scale
        self._model = None
        self._solved = self._intervals
        self._factor = self._clamped()

    @property
    def factor(self) -> float:
        """The current speed factor (real over base time)."""
        return self._factor

    @property
    def last_evidence_at(self) -> float:
        """Engine-clock time of the latest stretch folded in (``-inf``: none yet)."""
        return self._last if self._intervals else -math.inf

    @property
    def stderr(self) -> float:
        """Standard error of :attr:`factor` (``inf`` before two stretches)."""
        if self._intervals < 2:
            return math.inf
        f = self._obs / self._pred
        # Weighted residuals sum (obs - f pred)^2 / pred, from the sums alone.
        resid = max(self._sq - f * self._obs, 0.0)
        dof = max(self._n - 1.0, 1.0)
        return math.sqrt(resid / dof / self._pred)

    @property
    def rejected(self) -> Mapping[str, int]:
        """Refused stretches, by reason."""
        return dict(self._rejected)

    @property
    def model(self) -> BatchTimeModel:
        """The base coefficients scaled by the speed factor (what BEA replays with)."""
        m = self._model
        if m is None:
            b = self.base
            f0, f1, f2, f3 = self.term_factors
            m = attrs.evolve(b, b0=b.b0 * f0, b1=b.b1 * f1, b2=b.b2 * f2, b3=b.b3 * f3)
            self._model = m
            self._solved = self._intervals
        return m

    @property
    def term_factors(self) -> tuple[float, float, float, float]:
        """One factor per eq. 12 term (all :attr:`factor` without ``per_term``)."""
        f = self.factor
        if not self.per_term or self._intervals < 2:
            return (f, f, f, f)
        g = self._gram
        # Ridge towards the overall factor, scaled by the evidence on the
        # strongest term: terms the data inform follow them, the others stay at f.
        rho = self.term_ridge * max(float(np.max(np.diag(g))), 1e-300)
        theta = np.linalg.solve(g + rho * np.eye(4), self._rhs + rho * f)
        lo, hi = self.min_factor, self.max_factor
        t = [min(max(float(x), lo), hi) if math.isfinite(float(x)) else f for x in theta]
        return (t[0], t[1], t[2], t[3])

    def observe(self, interval: SpeedInterval, at: float) -> bool:
        """Fold in a stretch that ended at engine time ``at``; whether it was accepted."""
        obs, pred = interval.observed_s, interval.predicted_s
        if not (math.isfinite(obs) and math.isfinite(pred) and obs > 0.0 and pred > 0.0):
            self._rejected["non-finite"] += 1
            return False
        if not math.isfinite(at):
            self._rejected["non-finite"] += 1
            return False
        warm = self._pred >= self.warmup_s
        off = (obs / pred) / self.factor
        if warm and not (1.0 / self.absurd_ratio <= off <= self.absurd_ratio):
            self._rejected["absurd"] += 1
            return False
        if at > self._last > -math.inf:
            keep = math.exp(-(at - self._last) / self.memory_s)
            self._obs *= keep
            self._pred *= keep
            self._sq *= keep
            self._n *= keep
            self._gram *= keep
            self._rhs *= keep
            self._terms *= keep
        self._last = max(self._last, at)
        self._obs += obs
        self._pred += pred
        self._sq += obs * obs / pred
        self._n += 1.0
        x = np.array(interval.terms)
        self._terms += x
        if self.per_term:
            self._gram += np.outer(x, x) / pred
            self._rhs += x * (obs / pred)
        self._factor = self._clamped()
        self._steps += interval.steps
        self._intervals += 1
        # The model (a 4x4 solve) is refreshed every few stretches once settled:
        # one stretch moves a factor resting on dozens by well under a percent.
        if self._intervals <= _RESOLVE_EVERY or self._intervals - self._solved >= _RESOLVE_EVERY:
            self._model = None
        return True

    def estimate(self, now: float | None = None) -> SpeedEstimate:
        """The factor, its uncertainty and its evidence (``now``: engine clock)."""
        age = math.inf
        if self._intervals and now is not None:
            age = max(0.0, now - self._last)
        keep = 1.0 if not math.isfinite(age) else math.exp(-age / self.memory_s)
        return SpeedEstimate(
            factor=self.factor,
            stderr=self.stderr / math.sqrt(keep) if keep > 0 else math.inf,
            steps=self._steps,
            intervals=self._intervals,
            evidence_s=self._pred * keep,
            age_s=age,
        )

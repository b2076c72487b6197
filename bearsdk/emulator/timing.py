"""The emulator's ground-truth batch time: a roofline model, deliberately not eq. 12.

Estimators price a batch with eq. 12 (four linear terms). The emulated engine
executes batches under a different functional form, so that an estimator tested
against it is tested against a model it does not share:

``T = cpu + dense(n) + max(attn_mem, attn_flops) + max(lm_mem, lm_flops) + comm(n)``,
then multiplied by log-normal noise, and now and then by an outlier factor.

* ``cpu``: engine step overhead (scheduling, input preparation, sampling) plus a
  per-sequence cost: eq. 12 has no per-sequence term.
* ``dense(n)``: Vidur's *measured* dense-operator cost of a forward of ``n``
  tokens, interpolated piecewise-linearly between 13 power-of-two knots (flat while
  weight reads dominate, then compute-bound, with the measured wiggles), floored
  by a per-layer kernel-launch cost. Not a line.
* attention, one kernel per layer over the whole batch: the larger of reading the
  KV cache (decode contexts, plus each prefill chunk's context re-read once per
  128-query tile) at the attained HBM bandwidth, and its FLOPs (``4 * head_dim *
  heads / tp * layers`` per query-key pair) at the attained bf16 rate.
* LM head, for the sequences sampled: weight read versus FLOPs.
* ``comm(n)``: two all-reduces per layer of ``n * hidden * 2`` bytes (TP > 1),
  Vidur's measured all-reduce line.

Efficiencies and overheads are assumptions (documented on
:class:`GroundTruthParams`), chosen to be plausible, not fitted.
"""

from __future__ import annotations

import bisect
import math
import random
from typing import TYPE_CHECKING

import attrs

from bearsdk.emulator.profiles import EmulatorProfile

if TYPE_CHECKING:
    from bearsdk.estimators.batch_time import BatchTimeModel

__all__ = ["BatchShape", "GroundTruthParams", "GroundTruthTimeModel"]


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{att.name} must be a finite number > 0 (got {value!r})")


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{att.name} must be a finite number >= 0 (got {value!r})")


def _prob(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"{att.name} must be in [0, 1] (got {value!r})")


@attrs.frozen
class GroundTruthParams:
    """Assumed constants of the ground-truth model (all overridable).

    Attributes:
        step_overhead_s: Engine CPU time per step (scheduling, input prep, sampling).
        per_seq_s: Extra CPU/GPU time per sequence in the batch.
        kernel_floor_per_layer_s: Smallest dense time per layer (kernel launches).
        attn_bw_efficiency: Fraction of HBM bandwidth attention attains.
        attn_flops_efficiency: Fraction of bf16 peak attention attains.
        q_tile: Queries per attention tile (each tile re-reads the chunk's context).
        noise_sigma: Log-normal per-step noise (standard deviation of ``log T``).
        outlier_prob: Probability that a step is an outlier (CPU or kernel hiccup).
        outlier_min: Smallest outlier slow-down factor.
        outlier_max: Largest outlier slow-down factor.
        time_scale: Multiplies every duration (``< 1`` runs the emulation faster
            than the hardware it models).
    """

    step_overhead_s: float = attrs.field(default=0.8e-3, validator=_nonneg)
    per_seq_s: float = attrs.field(default=6e-6, validator=_nonneg)
    kernel_floor_per_layer_s: float = attrs.field(default=25e-6, validator=_nonneg)
    attn_bw_efficiency: float = attrs.field(default=0.7, validator=_positive)
    attn_flops_efficiency: float = attrs.field(default=0.5, validator=_positive)
    q_tile: int = attrs.field(default=128)
    noise_sigma: float = attrs.field(default=0.03, validator=_nonneg)
    outlier_prob: float = attrs.field(default=0.004, validator=_prob)
    outlier_min: float = attrs.field(default=1.5, validator=_positive)
    outlier_max: float = attrs.field(default=4.0, validator=_positive)
    time_scale: float = attrs.field(default=1.0, validator=_positive)

    @q_tile.validator
    def _check_tile(self, att: attrs.Attribute[int], value: int) -> None:
        if value < 1:
            raise ValueError(f"q_tile must be >= 1 (got {value!r})")

    def without_noise(self) -> GroundTruthParams:
        """The same model, deterministic (no noise, no outliers)."""
        return attrs.evolve(self, noise_sigma=0.0, outlier_prob=0.0)


@attrs.frozen
class BatchShape:
    """What the ground-truth model needs to know of a batch.

    Attributes:
        prefill_tokens: Prompt (or recompute) tokens.
        decode_tokens: Decode tokens.
        decode_context: Sum over decodes of the context before the batch.
        prefill_attention: Sum over prefill chunks of ``t*c + t*(t+1)/2``.
        num_seqs: Sequences in the batch.
        num_sampled: Sequences sampled (their LM head runs).
    """

    prefill_tokens: int
    decode_tokens: int
    decode_context: int
    prefill_attention: int
    num_seqs: int
    num_sampled: int


@attrs.define
class GroundTruthTimeModel:
    """Batch durations of one emulated instance (seeded noise).

    Args:
        profile: The model/GPU profile.
        params: The assumed constants.
        seed: Seeds the noise and outliers.
    """

    _profile: EmulatorProfile
    _params: GroundTruthParams = GroundTruthParams()
    _seed: int = 0
    _rng: random.Random = attrs.field(init=False)
    _knots_n: list[int] = attrs.field(init=False)
    _knots_s: list[float] = attrs.field(init=False)
    _floor: float = attrs.field(init=False)
    _kv_bytes: float = attrs.field(init=False)
    _pair_flops: float = attrs.field(init=False)
    _bw: float = attrs.field(init=False)
    _flops: float = attrs.field(init=False)
    _lm_read_s: float = attrs.field(init=False)
    _lm_flops: float = attrs.field(init=False)
    _comm0: float = attrs.field(init=False)
    _comm1: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        p, a, g = self._params, self._profile.arch, self._profile
        self._rng = random.Random(self._seed)
        self._knots_n = list(g.knot_tokens)
        self._knots_s = list(g.dense_knots_s)
        self._floor = a.layers * p.kernel_floor_per_layer_s
        self._kv_bytes = float(g.kv_bytes_per_token)
        self._pair_flops = 4.0 * a.head_dim * a.heads / g.tp * a.layers
        self._bw = g.hbm_bytes_per_s * p.attn_bw_efficiency
        self._flops = g.bf16_flops * p.attn_flops_efficiency
        self._lm_read_s = a.vocab * a.hidden * 2 / g.tp / g.hbm_bytes_per_s
        self._lm_flops = 2.0 * a.vocab * a.hidden / g.tp / (g.bf16_flops * 0.6)
        ar_a, ar_b = g.allreduce
        self._comm0 = 2 * a.layers * ar_a if g.tp > 1 else 0.0
        self._comm1 = 2 * a.layers * ar_b * a.hidden * 2 if g.tp > 1 else 0.0

    @property
    def params(self) -> GroundTruthParams:
        """The constants in use."""
        return self._params

    def dense(self, tokens: int) -> float:
        """Measured dense cost of a forward of ``tokens`` tokens (seconds)."""
        kn, ks = self._knots_n, self._knots_s
        if tokens <= kn[0]:
            d = ks[0]
        elif tokens >= kn[-1]:
            slope = (ks[-1] - ks[-2]) / (kn[-1] - kn[-2])
            d = ks[-1] + slope * (tokens - kn[-1])
        else:
            i = bisect.bisect_right(kn, tokens)
            n0, n1, s0, s1 = kn[i - 1], kn[i], ks[i - 1], ks[i]
            d = s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        return max(d, self._floor)

    def expected(self, shape: BatchShape) -> float:
        """Noise-free duration of a batch (seconds)."""
        n = shape.prefill_tokens + shape.decode_tokens
        if n <= 0:
            return 0.0
        p = self._params
        kv_tokens = (
            shape.decode_context
            + shape.decode_tokens
            + shape.prefill_tokens
            + shape.prefill_attention / p.q_tile
        )
        pairs = shape.prefill_attention + shape.decode_context + shape.decode_tokens
        attn = max(kv_tokens * self._kv_bytes / self._bw, pairs * self._pair_flops / self._flops)
        lm = max(self._lm_read_s, shape.num_sampled * self._lm_flops) if shape.num_sampled else 0.0
        comm = self._comm0 + self._comm1 * n
        cpu = p.step_overhead_s + p.per_seq_s * shape.num_seqs
        return (cpu + self.dense(n) + attn + lm + comm) * p.time_scale

    def sample(self, shape: BatchShape) -> float:
        """A measured duration: the expected one with per-step noise and rare outliers."""
        t = self.expected(shape)
        p = self._params
        if p.noise_sigma > 0:
            t *= math.exp(self._rng.gauss(0.0, p.noise_sigma))
        if p.outlier_prob > 0 and self._rng.random() < p.outlier_prob:
            t *= self._rng.uniform(p.outlier_min, max(p.outlier_min, p.outlier_max))
        return t

    def profiling_sweep(
        self, *, max_batched_tokens: int = 8192, max_seqs: int = 256, seed: int = 0
    ) -> list[tuple[BatchShape, float]]:
        """Batch shapes a profiling run would execute, with their noise-free durations.

        Decode-only batches (1 to ``max_seqs`` sequences, contexts 64 to 16k
        tokens) and mixed batches (a prefill chunk of 16 tokens up to the budget,
        fresh or continuing a prompt, alongside decodes), log-uniformly spread.

        Args:
            max_batched_tokens: The engine's token budget.
            max_seqs: The engine's sequence cap.
            seed: Seeds the sweep.
        """
        rng = random.Random(seed)

        def loguni(lo: int, hi: int) -> int:
            return round(math.exp(rng.uniform(math.log(lo), math.log(max(lo, hi)))))

        out = []
        for k in range(600):
            decodes = loguni(1, max_seqs) if k % 3 else 0
            ctx = loguni(64, 16384)
            t = 0 if k % 3 == 1 else loguni(16, max(16, max_batched_tokens - decodes))
            c = 0 if rng.random() < 0.6 else loguni(16, 8192)
            sampled = decodes + (1 if t else 0)
            shape = BatchShape(
                prefill_tokens=t,
                decode_tokens=decodes,
                decode_context=decodes * ctx,
                prefill_attention=t * c + t * (t + 1) // 2,
                num_seqs=sampled,
                num_sampled=sampled,
            )
            out.append((shape, self.expected(shape)))
        return out

    def fit_eq12(self, *, dense_floor: bool = True, **sweep: int) -> BatchTimeModel:
        """Eq. 12 coefficients fitted to a :meth:`profiling_sweep` of this model.

        What ``bearsdk calibrate`` would fit from a profiling run on the emulated
        hardware (the estimators' shipped profiles are fitted to other data, so
        they are off by some percent; this is the instance's own calibration).

        Args:
            dense_floor: Also fit the dense term's floor (see
                :func:`~bearsdk.estimators.batch_time.fit_batch_time`).
            **sweep: Arguments of :meth:`profiling_sweep`.
        """
        from bearsdk.estimators.batch_time import BatchObservation, fit_batch_time

        obs = [
            BatchObservation(
                s.prefill_tokens, s.decode_tokens, s.decode_context, s.prefill_attention, d
            )
            for s, d in self.profiling_sweep(**sweep)
        ]
        return fit_batch_time(obs, dense_floor=dense_floor).model

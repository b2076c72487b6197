"""The four-term token-batch time model of eq. 12, its evaluation, and observed batches.

``T = b0 + b1 * tokens + b2 * sum(decode context) + b3 * sum(prefill attention)``,
where a prefill chunk of ``t`` tokens after ``c`` computed ones contributes
``t*c + t*(t+1)/2`` to the attention sum. The compiled replay evaluates the same
expression inside its loop from the four coefficients (:attr:`BatchTimeModel.coeffs`).

Optional richer dense term (off by default): with ``dense_floor_tokens = tau > 0`` the
dense part is priced as ``b1 * max(tokens, tau)``: below ``tau`` tokens a batch costs
what reading the weights costs (memory-bound, flat); above it, one more token costs
``b1`` (compute-bound). ``tau = 0`` is exactly eq. 12. See ``docs/batch-time.md``.

Observed batches (composition + measured duration) are :class:`BatchObservation`;
:func:`read_batches` and :func:`write_batches` read and write the ``bear.batch/1``
JSONL format. Fitting the coefficients to observations, offline and online, is
:mod:`bearsdk.estimators.batch_time`, which re-exports every name here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from bearsdk.errors import BearError
from bearsdk.replay.types import BatchRecord

__all__ = [
    "BATCH_SCHEMA",
    "COEFF_NAMES",
    "DECODE_KEYS",
    "BatchDataError",
    "BatchObservation",
    "BatchTimeModel",
    "FloatArray",
    "batch_arrays",
    "iter_terms",
    "mape",
    "prefill_attention_of",
    "read_batches",
    "self_keys_of",
    "write_batches",
]

BATCH_SCHEMA: Final = "bear.batch/1"
COEFF_NAMES: Final = ("b0", "b1", "b2", "b3")
"""The names of eq. 12's coefficients, in order."""
_TERM_NAMES: Final = ("overhead", "tokens", "decode_context", "prefill_attention")

DECODE_KEYS: Final = ("attended", "before")
"""What a decode token's context counts in the ``b2`` term, the default first:
``"attended"``, the keys it attends (the tokens computed before it plus its own,
as vLLM's attention kernels read them and Vidur prices them); ``"before"``, only
the tokens computed before it. See ``docs/batch-time.md``."""

FloatArray = npt.NDArray[np.float64]


class BatchDataError(BearError, ValueError):
    """A batch observation (or a ``bear.batch/1`` line) failed validation.

    The message reads ``[line N: ]FIELD must be ... (got VALUE)``.

    Attributes:
        field: The offending field (``"duration_s"``, ``"requests[2].context"``).
        value: The rejected value.
        line: 1-based line number in the JSONL input, when read from a file.
    """

    def __init__(self, field: str, message: str, value: object = None, line: int | None = None):
        self.field = field
        self.value = value
        self.line = line
        where = f"line {line}: " if line is not None else ""
        super().__init__(f"{where}{field} {message} (got {value!r})")


def _nonneg(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(
            f"batch-time coefficient {att.name} must be a finite number >= 0 (got {value!r})"
        )


def _decode_keys(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if value not in DECODE_KEYS:
        raise ValueError(
            f"batch-time {att.name} must be one of {', '.join(map(repr, DECODE_KEYS))}"
            f" (got {value!r})"
        )


def self_keys_of(decode_keys: str) -> int:
    """Keys a decode adds to its own context in the ``b2`` term under ``decode_keys``."""
    return 1 if decode_keys == "attended" else 0


def prefill_attention_of(tokens: int, context: int) -> int:
    """Eq. 12's prefill-attention units of a chunk of ``tokens`` after ``context`` computed ones."""
    return tokens * context + tokens * (tokens + 1) // 2


@attrs.frozen
class BatchTimeModel:
    """Eq. 12 coefficients of one model instance, in seconds.

    Attributes:
        b0: Fixed per-batch overhead.
        b1: Per token (dense layers).
        b2: Per unit of decode context (attention over the KV cache).
        b3: Per unit of prefill attention (``t*c + t*(t+1)/2``).
        dense_floor_tokens: Optional richer dense term ``tau`` (tokens): the dense
            part costs ``b1 * max(tokens, tau)``. ``0`` (default) is eq. 12 as is.
        decode_keys: What ``b2`` prices per decode token (:data:`DECODE_KEYS`):
            ``"attended"`` (default), its context plus itself, the keys the
            attention kernel reads; ``"before"``, its context alone. Batch
            records and observations always carry the context before the batch;
            the convention is applied here, when they are priced.
    """

    b0: float = attrs.field(converter=float, validator=_nonneg)
    b1: float = attrs.field(converter=float, validator=_nonneg)
    b2: float = attrs.field(converter=float, validator=_nonneg)
    b3: float = attrs.field(converter=float, validator=_nonneg)
    dense_floor_tokens: float = attrs.field(default=0.0, converter=float, validator=_nonneg)
    decode_keys: str = attrs.field(default=DECODE_KEYS[0], validator=_decode_keys, kw_only=True)

    @property
    def coeffs(self) -> tuple[float, float, float, float]:
        """``(b0, b1, b2, b3)``: the four coefficients alone (see :attr:`replay_coeffs`)."""
        return (self.b0, self.b1, self.b2, self.b3)

    @property
    def self_keys(self) -> int:
        """Keys a decode token adds to its own context in the ``b2`` term (1 or 0)."""
        return self_keys_of(self.decode_keys)

    @property
    def replay_coeffs(self) -> tuple[float, ...]:
        """The tuple the replay loops take: ``(b0, b1, b2, b3)``, with
        ``dense_floor_tokens`` appended when the floor is on, and then
        :attr:`self_keys` when a decode token's own key is priced."""
        if self.self_keys:
            return (self.b0, self.b1, self.b2, self.b3, self.dense_floor_tokens, 1.0)
        if self.has_dense_floor:
            return self.extended_coeffs
        return self.coeffs

    def decode_units(self, decode_tokens: float, decode_context: float) -> float:
        """What ``b2`` multiplies: the decodes' contexts before the batch, plus
        one key each under the ``"attended"`` convention."""
        return decode_context + self.self_keys * decode_tokens

    @property
    def extended_coeffs(self) -> tuple[float, float, float, float, float]:
        """``(b0, b1, b2, b3, dense_floor_tokens)``: eq. 12 plus the optional dense floor."""
        return (self.b0, self.b1, self.b2, self.b3, self.dense_floor_tokens)

    @property
    def has_dense_floor(self) -> bool:
        """Whether the richer dense term is on (``dense_floor_tokens > 0``)."""
        return self.dense_floor_tokens > 0.0

    def batch_time(
        self, prefill_tokens: int, decode_tokens: int, decode_context: int, prefill_attention: int
    ) -> float:
        """Return the predicted duration of a batch with this composition (seconds)."""
        tokens = prefill_tokens + decode_tokens
        if tokens < self.dense_floor_tokens:
            dense = self.b1 * self.dense_floor_tokens
        else:
            dense = self.b1 * tokens
        decode = decode_context + self.self_keys * decode_tokens
        return self.b0 + dense + self.b2 * decode + self.b3 * prefill_attention

    def time_of(self, batch: BatchRecord | BatchObservation) -> float:
        """Return the predicted duration of a simulated or observed batch (seconds)."""
        return self.batch_time(
            batch.prefill_tokens, batch.decode_tokens, batch.decode_context, batch.prefill_attention
        )

    def predict(self, features: FloatArray) -> FloatArray:
        """Vectorised :meth:`batch_time`.

        Args:
            features: ``(n, 4)`` array of ``prefill_tokens, decode_tokens,
                decode_context, prefill_attention`` per batch (see :func:`batch_arrays`).

        Returns:
            The predicted durations, seconds.
        """
        f = np.asarray(features, dtype=np.float64)
        tokens = np.maximum(f[:, 0] + f[:, 1], self.dense_floor_tokens)
        decode = f[:, 2] + self.self_keys * f[:, 1]
        return np.asarray(
            self.b0 + self.b1 * tokens + self.b2 * decode + self.b3 * f[:, 3], dtype=np.float64
        )

    def with_dense_floor(self, tokens: float) -> BatchTimeModel:
        """Return a copy with the richer dense term's floor set to ``tokens``."""
        return attrs.evolve(self, dense_floor_tokens=tokens)

    def to_dict(self) -> dict[str, float | str]:
        """Return the coefficients as a plain mapping (``dense_floor_tokens`` only
        when on, ``decode_keys`` only when not the default)."""
        d: dict[str, float | str] = {"b0": self.b0, "b1": self.b1, "b2": self.b2, "b3": self.b3}
        if self.has_dense_floor:
            d["dense_floor_tokens"] = self.dense_floor_tokens
        if self.decode_keys != DECODE_KEYS[0]:
            d["decode_keys"] = self.decode_keys
        return d


# --------------------------------------------------------------------------- observations


def _int_field(name: str, value: object, line: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise BatchDataError(name, "must be an integer >= 0", value, line)
    if value < 0:
        raise BatchDataError(name, "must be an integer >= 0", value, line)
    return value


def _duration_field(value: object, line: int | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BatchDataError("duration_s", "must be a finite number > 0", value, line)
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise BatchDataError("duration_s", "must be a finite number > 0", value, line)
    return v


@attrs.frozen
class BatchObservation:
    """One executed batch: its composition (the quantities eq. 12 prices) and its duration.

    Build from aggregates (validated) or with :meth:`from_requests` from a
    per-request composition.

    Attributes:
        prefill_tokens: Prompt (or recompute) tokens in the batch.
        decode_tokens: Decode tokens (one per decoding request).
        decode_context: Sum over decodes of the context length before the batch.
        prefill_attention: Sum over prefill chunks of ``t*c + t*(t+1)/2``.
        duration_s: Measured duration of the batch, seconds.
    """

    prefill_tokens: int
    decode_tokens: int
    decode_context: int
    prefill_attention: int
    duration_s: float

    def __attrs_post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_tokens", "decode_context", "prefill_attention"):
            _int_field(name, getattr(self, name), None)
        _duration_field(self.duration_s, None)
        if self.prefill_tokens + self.decode_tokens < 1:
            raise BatchDataError(
                "prefill_tokens + decode_tokens", "must be >= 1 (an empty batch takes no time)", 0
            )
        if self.prefill_tokens == 0 and self.prefill_attention != 0:
            raise BatchDataError(
                "prefill_attention", "must be 0 when prefill_tokens is 0", self.prefill_attention
            )

    @property
    def total_tokens(self) -> int:
        """Tokens in the batch."""
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def from_requests(
        cls, requests: Iterable[Mapping[str, Any]], duration_s: float, *, line: int | None = None
    ) -> BatchObservation:
        """Build an observation from a per-request composition.

        Args:
            requests: One entry per request in the batch: ``{"prefill": t, "context": c}``
                for a prefill chunk of ``t`` tokens after ``c`` computed ones, or
                ``{"decode": 1, "context": c}`` for a decode token at context ``c``.
            duration_s: Measured duration, seconds.
            line: Line number for error messages.

        Returns:
            The aggregated observation.

        Raises:
            BatchDataError: An entry is malformed (named by its index).
        """
        pre = dec = dctx = patt = 0
        for i, req in enumerate(requests):
            where = f"requests[{i}]"
            if not isinstance(req, Mapping):
                raise BatchDataError(where, "must be an object", req, line)
            unknown = set(req) - {"prefill", "decode", "context"}
            if unknown:
                raise BatchDataError(
                    f"{where}.{sorted(unknown)[0]}", "is not a known field", req, line
                )
            ctx = _int_field(f"{where}.context", req.get("context", 0), line)
            if ("prefill" in req) == ("decode" in req):
                raise BatchDataError(
                    where, "must have exactly one of 'prefill' or 'decode'", req, line
                )
            if "prefill" in req:
                t = _int_field(f"{where}.prefill", req["prefill"], line)
                if t < 1:
                    raise BatchDataError(f"{where}.prefill", "must be >= 1", t, line)
                pre += t
                patt += prefill_attention_of(t, ctx)
            else:
                d = _int_field(f"{where}.decode", req["decode"], line)
                if d != 1:
                    raise BatchDataError(
                        f"{where}.decode", "must be 1 (one token per decode)", d, line
                    )
                dec += 1
                dctx += ctx
        try:
            return cls(pre, dec, dctx, patt, duration_s)
        except BatchDataError as exc:
            raise BatchDataError(exc.field, _bare_message(exc), exc.value, line) from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, line: int | None = None) -> BatchObservation:
        """Decode one ``bear.batch/1`` object (see :func:`read_batches`)."""
        if not isinstance(d, Mapping):
            raise BatchDataError("line", "must be a JSON object", d, line)
        schema = d.get("schema", BATCH_SCHEMA)
        if schema != BATCH_SCHEMA:
            raise BatchDataError("schema", f"must be {BATCH_SCHEMA!r}", schema, line)
        if "duration_s" not in d:
            raise BatchDataError("duration_s", "is required", None, line)
        duration = _duration_field(d["duration_s"], line)
        if "requests" in d:
            reqs = d["requests"]
            if not isinstance(reqs, list):
                raise BatchDataError("requests", "must be a list", reqs, line)
            for name in ("prefill_tokens", "decode_tokens", "decode_context", "prefill_attention"):
                if name in d:
                    raise BatchDataError(
                        name, "must not be given together with requests", d[name], line
                    )
            return cls.from_requests(reqs, duration, line=line)
        vals = []
        for name in ("prefill_tokens", "decode_tokens", "decode_context", "prefill_attention"):
            vals.append(_int_field(name, d.get(name, 0), line))
        try:
            return cls(vals[0], vals[1], vals[2], vals[3], duration)
        except BatchDataError as exc:
            raise BatchDataError(exc.field, _bare_message(exc), exc.value, line) from None

    def to_dict(self) -> dict[str, Any]:
        """Return the aggregate ``bear.batch/1`` form of this observation."""
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "decode_context": self.decode_context,
            "prefill_attention": self.prefill_attention,
            "duration_s": self.duration_s,
        }


def _bare_message(exc: BatchDataError) -> str:
    text = str(exc)
    if text.startswith("line "):
        text = text.split(": ", 1)[1]
    text = text[len(exc.field) + 1 :]
    return text.rsplit(" (got", 1)[0]


def read_batches(source: str | Path | Iterable[str]) -> list[BatchObservation]:
    """Read ``bear.batch/1`` JSONL: one executed batch per line.

    Each line is an object with ``duration_s`` and either the aggregates
    (``prefill_tokens``, ``decode_tokens``, ``decode_context``, ``prefill_attention``;
    absent ones are 0) or ``requests``, a per-request composition (see
    :meth:`BatchObservation.from_requests`). ``schema`` is optional; other keys
    (``time``, ``instance``, ...) are ignored. Blank lines are skipped.

    Args:
        source: A path, or an iterable of lines.

    Returns:
        The observations, in file order.

    Raises:
        BatchDataError: A malformed line; the message names the line and the field.
    """
    if isinstance(source, (str, Path)):
        with open(source, encoding="utf-8") as fh:
            return read_batches(list(fh))
    out: list[BatchObservation] = []
    for lineno, raw in enumerate(source, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise BatchDataError("line", f"is not valid JSON ({exc})", text[:80], lineno) from None
        out.append(BatchObservation.from_dict(obj, line=lineno))
    return out


def write_batches(path: str | Path, observations: Iterable[BatchObservation]) -> None:
    """Write observations as ``bear.batch/1`` JSONL (aggregate form)."""
    with open(path, "wb") as fh:
        for obs in observations:
            fh.write(orjson.dumps(obs.to_dict()))
            fh.write(b"\n")


def batch_arrays(observations: Sequence[BatchObservation]) -> tuple[FloatArray, FloatArray]:
    """Return ``(features, durations)``: an ``(n, 4)`` composition array and the durations."""
    n = len(observations)
    f = np.empty((n, 4), dtype=np.float64)
    y = np.empty(n, dtype=np.float64)
    for i, o in enumerate(observations):
        f[i] = (o.prefill_tokens, o.decode_tokens, o.decode_context, o.prefill_attention)
        y[i] = o.duration_s
    return f, y


def mape(model: BatchTimeModel, observations: Sequence[BatchObservation]) -> float:
    """Mean absolute percentage error of ``model`` on ``observations`` (a fraction: 0.04 = 4%)."""
    f, y = batch_arrays(observations)
    if len(y) == 0:
        return math.nan
    return float(np.mean(np.abs(model.predict(f) - y) / y))


def iter_terms(model: BatchTimeModel, batch: BatchObservation) -> Iterator[tuple[str, float]]:
    """Yield ``(term, seconds)`` for each of eq. 12's terms of ``batch`` (explains a prediction)."""
    tokens = max(batch.total_tokens, model.dense_floor_tokens)
    yield _TERM_NAMES[0], model.b0
    yield _TERM_NAMES[1], model.b1 * tokens
    yield _TERM_NAMES[2], model.b2 * model.decode_units(batch.decode_tokens, batch.decode_context)
    yield _TERM_NAMES[3], model.b3 * batch.prefill_attention

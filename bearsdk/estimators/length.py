"""Output-length predictors for resident requests whose length the snapshot omits.

BEA needs each resident request's remaining decode work (eq. 9). A snapshot
carries ``output_len`` only when it is known (tests, what-if analysis); the rest
are predicted. The predictor is pluggable; :class:`MeanLengthPredictor` is the
simple default until trained predictors are configured. A predictor that also
implements :class:`KnownLengths` supplies per-request lengths by request id:
the router remembers the length it predicted for each request it sent, from the
request's own prompt, which beats any guess from the counts a snapshot shows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "ROUTER_ID",
    "KnownLengths",
    "LengthPredictor",
    "MeanLengthPredictor",
    "RememberedLengths",
    "resolve_output_lengths",
]


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts total output lengths of resident requests from what a snapshot shows."""

    def predict_lengths(
        self, prompt_tokens: npt.NDArray[np.int64], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Return the predicted total output length of each request (any integers;
        the caller enforces at least one more token and the ``max_tokens`` cap)."""
        ...


@runtime_checkable
class KnownLengths(Protocol):
    """Per-request output lengths known (or predicted from the prompt) by request id."""

    def known_lengths(
        self, ids: Sequence[str], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Return each request's total output length, or ``-1`` where it is not known.

        Args:
            ids: Snapshot ids, which an engine may have decorated (vLLM names a
                chat request ``chatcmpl-<X-Request-Id>``); matching them is the
                implementation's business.
            output_tokens: The tokens each has produced so far.
        """
        ...


@attrs.frozen
class MeanLengthPredictor:
    """Predicts a fixed expected length, or the expected residual once a request is past it.

    A request that has already produced ``o`` tokens is predicted to produce
    ``max(mean, o + residual)`` in total: long generations tend to keep going,
    which a fixed mean ignores.

    Attributes:
        mean: Expected total output length of a fresh request (tokens).
        residual: Expected further tokens of a request already past ``mean``.
    """

    mean: int = 256
    residual: int = 64

    def predict_lengths(
        self, prompt_tokens: npt.NDArray[np.int64], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """See :class:`LengthPredictor`."""
        return np.maximum(self.mean, output_tokens + self.residual).astype(np.int64)


def resolve_output_lengths(
    table: npt.NDArray[np.int64],
    predictor: LengthPredictor,
    ids: Sequence[str] | None = None,
) -> npt.NDArray[np.int64]:
    """Return a snapshot table with every unknown ``output_len`` predicted.

    A new array, or ``table`` itself where it is read-only (as every
    :class:`~bearsdk.snapshot.Snapshot`'s is) and knows every length already.

    Where ``ids`` are given and ``predictor`` is also :class:`KnownLengths`, a
    request's known length is used while it is still ahead of the request's
    output; past it (the request outran its prediction) the predictor's rule for
    long generations takes over. Lengths are clamped so a request still has at
    least one token to go and never exceeds its ``max_tokens``.

    Args:
        table: A snapshot table (see :class:`~bearsdk.snapshot.Snapshot`).
        predictor: Predicts lengths from prompt and output counts.
        ids: The snapshot's request ids, one per row.
    """
    from bearsdk.snapshot import COL_MAX_TOKENS, COL_OUTPUT, COL_OUTPUT_LEN, COL_PROMPT

    # (A fast-forwarded view's, rebuilt after every dispatch, knows them all.)
    frozen = table.dtype == np.int64 and not table.flags.writeable and table.ndim == 2
    if frozen and (not len(table) or table[:, COL_OUTPUT_LEN].min() >= 1):
        return table
    out = np.array(table, dtype=np.int64, copy=True)
    missing = out[:, COL_OUTPUT_LEN] < 1
    if not missing.any():
        return out
    # Engines publish no lengths: every row is missing, and the whole table is
    # used as it is (fancy indexing costs microseconds per snapshot).
    every = bool(missing.all())
    rows = out if every else out[missing]
    produced = rows[:, COL_OUTPUT]
    pred = np.asarray(predictor.predict_lengths(rows[:, COL_PROMPT], produced), dtype=np.int64)
    # Not isinstance(predictor, KnownLengths): a protocol check costs microseconds.
    known_lengths = getattr(predictor, "known_lengths", None) if ids is not None else None
    if known_lengths is not None and ids is not None:
        if len(ids) != len(out):
            raise ValueError(f"ids: {len(ids)} ids for {len(out)} rows")
        sel = ids if every else [ids[i] for i in np.flatnonzero(missing).tolist()]
        known = np.asarray(known_lengths(sel, produced), dtype=np.int64)
        pred = np.where(known > produced, known, pred)
    pred = np.maximum(pred, produced + 1)
    cap = rows[:, COL_MAX_TOKENS]
    pred = np.where((cap > 0) & (pred > cap), cap, pred)
    if every:
        out[:, COL_OUTPUT_LEN] = pred
    else:
        out[missing, COL_OUTPUT_LEN] = pred
    return out


#: The ids :class:`~bearsdk.router.AsyncRouter` gives requests, as they appear
#: inside an engine's own ids (``chatcmpl-bear-…``, ``cmpl-bear-…-0``).
ROUTER_ID = re.compile(r"bear-[0-9a-f]+-[0-9]{10}")


@attrs.define
class RememberedLengths:
    """Residents' output lengths from what a router predicted and what it saw complete.

    A router predicts each request's output length from its prompt when it
    routes it; this remembers that prediction, by request id, until the request
    completes, so BEA replays the router's own requests with their own lengths.

    With ``calibrate``, completions calibrate it. What decides a new request's wait under memory
    pressure is when the *first* residents finish, so each resident is given
    not a mean (heavy-tailed lengths make every mean finish far too late) but
    a quantile of the length distribution of the last ``window`` completions,
    conditioned on what it has produced (``L > output``). A resident the router
    sent takes the quantile of its prediction's rank among the predictions of
    the completed requests (quantile mapping: a biased or mis-scaled predictor
    is corrected, its ordering kept; an uninformative one spreads like the
    rest); any other resident takes the next level of a low-discrepancy
    sequence, so the residents together span the distribution. Without it, or
    before ``min_observed`` completions, a remembered prediction is used as it
    is and other residents get the mean of the predictions, or their output
    plus ``residual`` once past it. Calibration is off by default: it makes
    BEA's TTFT more accurate on an instance under memory pressure, but in the
    routing simulations it cost BEAR a little OnTimeUtility at high load
    (``docs/snapshots.md``). Memory is bounded: past ``capacity`` requests
    the oldest are forgotten (requests whose completion the router never saw).

    Attributes:
        mean: Running mean of the remembered predictions (the initial value is
            the prior before any).
        residual: Expected further tokens of a request already past every
            length seen.
        capacity: Most requests remembered at once.
        calibrate: Learn from completions (above).
        window: Completions the distributions are drawn from.
        min_observed: Completions needed before they are used.
        id_pattern: Finds a remembered id inside an engine's decorated id.
    """

    mean: float = 256.0
    residual: int = 64
    capacity: int = 65536
    calibrate: bool = False
    window: int = 1024
    min_observed: int = 32
    id_pattern: re.Pattern[str] = ROUTER_ID
    _n: int = attrs.field(default=0, init=False)
    _known: dict[str, int] = attrs.field(factory=dict, init=False)
    # Snapshot id -> the router id inside it (itself when none): each is searched once.
    _alias: dict[str, str] = attrs.field(factory=dict, init=False)
    _done: _Ring = attrs.field(init=False)  # true lengths of completed requests
    _pred: _Ring = attrs.field(init=False)  # predictions of the router's completed ones
    _sorted: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = attrs.field(
        default=None, init=False
    )

    def __attrs_post_init__(self) -> None:
        if self.window < 1 or self.min_observed < 1 or self.min_observed > self.window:
            raise ValueError(
                f"need 1 <= min_observed <= window (got min_observed={self.min_observed}, "
                f"window={self.window})"
            )
        self._done = _Ring(self.window)
        self._pred = _Ring(self.window)

    def __len__(self) -> int:
        return len(self._known)

    def __contains__(self, rid: object) -> bool:
        return rid in self._known

    @property
    def observed(self) -> int:
        """Completed lengths held (at most ``window``)."""
        return len(self._done)

    def remember(self, rid: str, output_len: int) -> None:
        """Remember the predicted total output length of request ``rid``."""
        if output_len < 1:
            raise ValueError(f"output_len must be >= 1 (got {output_len})")
        self._n = min(self._n + 1, 1000)
        self.mean += (output_len - self.mean) / self._n
        self._known[rid] = int(output_len)
        if len(self._known) > self.capacity:
            del self._known[next(iter(self._known))]
        if len(self._alias) > 2 * self.capacity:
            self._alias.clear()

    def forget(self, rid: str) -> None:
        """Forget request ``rid`` (it ended without a length to learn from)."""
        self._known.pop(rid, None)

    def observe(self, rid: str, output_tokens: int) -> None:
        """Request ``rid`` completed with ``output_tokens`` tokens: learn, then forget it."""
        if output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1 (got {output_tokens})")
        pred = self._known.pop(rid, None)
        if not self.calibrate:
            return
        self._done.push(output_tokens)
        if pred is not None:
            self._pred.push(pred)
        self._sorted = None

    def _distributions(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
        # Completed lengths and the router's predictions for them, both sorted;
        # None until enough lengths completed.
        if len(self._done) < self.min_observed:
            return None
        if self._sorted is None:
            self._sorted = (np.sort(self._done.values()), np.sort(self._pred.values()))
        return self._sorted

    def _mapping(
        self,
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None:
        # The same, None also until enough of the router's own requests completed.
        dist = self._distributions()
        return None if dist is None or len(self._pred) < self.min_observed else dist

    def _quantile(
        self,
        lengths: npt.NDArray[np.float64],
        output: npt.NDArray[np.int64],
        level: npt.NDArray[np.float64],
    ) -> npt.NDArray[np.int64]:
        # The ``level`` quantile of the completed lengths beyond ``output``.
        k = np.searchsorted(lengths, output, side="right")
        beyond = len(lengths) - k
        at = np.minimum(k + (beyond * level).astype(np.int64), len(lengths) - 1)
        return np.where(beyond > 0, lengths[at], output + self.residual).astype(np.int64)

    def _rank(self, preds: npt.NDArray[np.float64], values: npt.NDArray[np.int64]) -> Any:
        lo = np.searchsorted(preds, values, side="left")
        hi = np.searchsorted(preds, values, side="right")
        return (lo + hi) / (2.0 * len(preds))

    def _router_id(self, sid: str) -> str:
        m = self.id_pattern.search(sid)
        rid = self._alias[sid] = sid if m is None else m.group(0)
        return rid

    def calibrated(self, output_len: int) -> int:
        """A fresh request's predicted length mapped onto the completed lengths
        (as it is before ``min_observed`` of the router's own completed)."""
        mapping = self._mapping()
        if mapping is None:
            return output_len
        lengths, preds = mapping
        v = np.array([output_len], dtype=np.int64)
        return int(self._quantile(lengths, np.zeros(1, np.int64), self._rank(preds, v))[0])

    def predict_lengths(
        self, prompt_tokens: npt.NDArray[np.int64], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """See :class:`LengthPredictor`."""
        out = np.asarray(output_tokens, dtype=np.int64)
        dist = self._distributions()
        if dist is None:
            return np.maximum(int(self.mean), out + self.residual).astype(np.int64)
        # Golden-ratio levels: any prefix of the rows spreads evenly over (0, 1).
        level = np.modf(np.arange(1, len(out) + 1) * _GOLDEN)[0]
        return self._quantile(dist[0], out, level)

    def known_lengths(
        self, ids: Sequence[str], output_tokens: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """See :class:`KnownLengths`."""
        known = self._known
        if not known:
            return np.full(len(ids), -1, dtype=np.int64)
        alias = self._alias.get
        find = self._router_id
        get = known.get
        res = np.array([get(alias(sid) or find(sid), -1) for sid in ids], dtype=np.int64)
        found = res > 0
        mapping = self._mapping()
        if mapping is None or not found.any():
            return res
        lengths, preds = mapping
        out = np.asarray(output_tokens, dtype=np.int64)
        res[found] = self._quantile(lengths, out[found], self._rank(preds, res[found]))
        return res


_GOLDEN = 0.6180339887498949


class _Ring:
    """The last ``size`` values pushed."""

    __slots__ = ("_buf", "_i", "_n")

    def __init__(self, size: int) -> None:
        self._buf = np.zeros(size, dtype=np.float64)
        self._i = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, v: float) -> None:
        buf = self._buf
        self._n = min(self._n + 1, len(buf))
        buf[self._i] = v
        self._i = (self._i + 1) % len(buf)

    def values(self) -> npt.NDArray[np.float64]:
        return self._buf[: self._n] if self._n < len(self._buf) else self._buf

"""The one interface every latency estimator implements, and the values it reads.

A router (or the simulator) holds, per instance, what it knows about it: the latest
workload snapshot if the instance publishes one, and statistics of what it has
observed itself (dispatches, first tokens, completions, engine load counts). It
packs that into an :class:`InstanceView` (usually with
:meth:`~bearsdk.estimators.stats.InstanceStats.view`) and asks each estimator for
the TTFT a new request (:class:`RequestInfo`) would see there. Estimators never
mutate anything, so the router and the simulator can swap them freely.

Unknown statistics are ``None``; each estimator documents what it falls back to.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs

from bearsdk.snapshot import Snapshot

__all__ = ["InstanceView", "Latency", "LatencyEstimator", "LatencyFields", "RequestInfo"]


def _positive_int(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{att.name} must be an integer >= 1 (got {value!r})")


def _optional_positive_int(
    inst: object, att: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None:
        _positive_int(inst, att, value)  # type: ignore[arg-type]


def _count(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{att.name} must be an integer >= 0 (got {value!r})")


def _optional_rate(inst: object, att: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{att.name} must be a finite number >= 0 or None (got {value!r})")


def _age(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"{att.name} must be a number >= 0 (inf: unknown) (got {value!r})")


@attrs.frozen
class RequestInfo:
    """The new request, as the router sees it before dispatch.

    Attributes:
        prompt_tokens: Prompt length in tokens.
        output_tokens: Predicted (or known) total output length, when available.
        max_tokens: The request's cap on output tokens, if any.
    """

    prompt_tokens: int = attrs.field(validator=_positive_int)
    output_tokens: int | None = attrs.field(default=None, validator=_optional_positive_int)
    max_tokens: int | None = attrs.field(default=None, validator=_optional_positive_int)

    def expected_output(self, default: int) -> int:
        """The predicted output length, ``default`` when unknown, capped by ``max_tokens``."""
        out = self.output_tokens if self.output_tokens is not None else default
        if self.max_tokens is not None:
            out = min(out, self.max_tokens)
        return max(1, out)


@attrs.frozen(eq=False)
class InstanceView:
    """What the router knows about one instance at one moment.

    Counts are the router's own bookkeeping (requests it dispatched there);
    ``running``/``waiting`` come from the engine when it reports them (metrics or
    snapshot), else from the router's view (first token seen or not). Rates and
    averages cover the statistics' rolling window; ``None`` means not enough data.

    Attributes:
        name: Instance name.
        now: Time of the view (router clock, seconds).
        snapshot: Latest valid workload snapshot, if the instance publishes one.
        snapshot_age_s: Age of ``snapshot`` (``inf`` when none).
        dispatched: Requests dispatched to the instance so far.
        unfinished: Dispatched requests not yet completed.
        running: Requests being decoded (admitted).
        waiting: Requests queued (not yet admitted / no first token).
        pending_prefill_tokens: Prompt tokens of unfinished requests without a first token.
        pending_decode_tokens: Predicted output tokens still to generate, summed
            over unfinished requests.
        arrival_rate: Dispatches per second.
        completion_rate: Completions per second (request throughput).
        service_rate: Completions per second of busy time (LPS ``mu``).
        output_token_rate: Output tokens per second.
        mean_tpot_s: Mean time per output token of completed requests.
        mean_output_tokens: Mean output length of completed requests.
        ttft_ewma_s: Exponentially weighted mean of observed TTFTs.
        arrival_scv: Squared coefficient of variation of inter-arrival times.
        service_scv: Squared coefficient of variation of service requirements.
        concurrency: Concurrently decoding requests at saturation (LPS ``k``).
        prefill_throughput: Prefill tokens per second (eq. 8's ``theta_pre``).
        recent_ttfts_s: Most recent observed TTFTs, oldest first.
    """

    name: str = ""
    now: float = 0.0
    snapshot: Snapshot | None = None
    snapshot_age_s: float = attrs.field(default=math.inf, validator=_age)
    dispatched: int = attrs.field(default=0, validator=_count)
    unfinished: int = attrs.field(default=0, validator=_count)
    running: int = attrs.field(default=0, validator=_count)
    waiting: int = attrs.field(default=0, validator=_count)
    pending_prefill_tokens: int = attrs.field(default=0, validator=_count)
    pending_decode_tokens: int = attrs.field(default=0, validator=_count)
    arrival_rate: float | None = attrs.field(default=None, validator=_optional_rate)
    completion_rate: float | None = attrs.field(default=None, validator=_optional_rate)
    service_rate: float | None = attrs.field(default=None, validator=_optional_rate)
    output_token_rate: float | None = attrs.field(default=None, validator=_optional_rate)
    mean_tpot_s: float | None = attrs.field(default=None, validator=_optional_rate)
    mean_output_tokens: float | None = attrs.field(default=None, validator=_optional_rate)
    ttft_ewma_s: float | None = attrs.field(default=None, validator=_optional_rate)
    arrival_scv: float | None = attrs.field(default=None, validator=_optional_rate)
    service_scv: float | None = attrs.field(default=None, validator=_optional_rate)
    concurrency: float | None = attrs.field(default=None, validator=_optional_rate)
    prefill_throughput: float | None = attrs.field(default=None, validator=_optional_rate)
    recent_ttfts_s: tuple[float, ...] = ()


@runtime_checkable
class LatencyEstimator(Protocol):
    """Estimates the TTFT a new request would see at one instance."""

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """Return the estimated time to first token, seconds (``inf``: would not be served)."""
        ...


LatencyFields = tuple[float, str, float, bool, bool, float, float, float]
"""A :class:`Latency`'s fields in order, as a tuple (the router's hot path)."""


@attrs.frozen
class Latency:
    """One instance's TTFT estimate for one request.

    Attributes:
        ttft_s: Predicted time to first token, seconds (``inf``: never served;
            ``nan``: no estimate).
        estimator: What made it, as decisions show it (``"bea"``, ``"lps"``...).
        age_s: Age of the snapshot behind it (``inf``: none).
        replayed: It replays the engine alone: the router adds the dispatch
            overhead it learns from observed first tokens.
        lower_bound: ``ttft_s`` is past the horizon the router asked for and
            only a lower bound (see :class:`InstanceEstimator`).
        tpot_s: Predicted mean time per output token after the first (``nan``:
            not asked for, or the estimator cannot tell).
        resident_itl_s: The instance's residents' predicted inter-token time
            over the new request's window with it admitted (``nan``: not asked).
        resident_itl_base_s: The same without it.
    """

    ttft_s: float
    estimator: str
    age_s: float = math.inf
    replayed: bool = False
    lower_bound: bool = False
    tpot_s: float = math.nan
    resident_itl_s: float = math.nan
    resident_itl_base_s: float = math.nan

"""The TTFT margin: BEA's point estimate widened by an instance's first tokens' spread.

BEA predicts one number per candidate, and BEAR admits a candidate when that
number meets the target. A well calibrated point estimate is late about as
often as it is early, so the candidates that just meet their target miss it
about half the time; what is left unseen (arrivals while the request waits,
output lengths, the batch the request just misses) spreads the error further.
The router sees the first token of every request it sent, so per instance it
keeps the ratios of observed over predicted first-token times of its latest
dispatches and widens the instance's estimates by their upper quantile: the
split-conformal bound, ``ceil((n + 1) q)``-th smallest of ``n`` ratios, which
a new ratio exceeds with probability at most ``1 - q`` when the ratios are
exchangeable.

A margin only ever widens (never below 1: an instance whose estimates run late
is no reason to believe another's early), is capped (``max_margin``), and
fades while no first token confirms it, as the first-token overhead does: an
instance the router stopped choosing because of its margin is not held out by
it (issue 17's lock-out). Measured in docs/calibration.md: in the simulator it
brings the step-change scenario's on-time rate after the slow-down back within
2% of its level before at no measurable cost in on-time utility, but it cost
the emulated demo on-time utility, so it is opt-in.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Final

import attrs

__all__ = ["DEFAULT_MARGIN", "MarginTracker", "TtftMargin"]


def _quantile(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0.5 <= value < 1.0):
        raise ValueError(f"ttft margin: {att.name} must be in [0.5, 1) (got {value!r})")


def _count(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096):
        raise ValueError(f"ttft margin: {att.name} must be an int in [1, 4096] (got {value!r})")


def _ratio_cap(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not (isinstance(value, int | float) and 1.0 <= value <= 10.0):
        raise ValueError(f"ttft margin: {att.name} must be in [1, 10] (got {value!r})")


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and math.isfinite(value) and value > 0
    ):
        raise ValueError(f"ttft margin: {att.name} must be a finite number > 0 (got {value!r})")


@attrs.frozen
class TtftMargin:
    """How the router widens each instance's TTFT estimates (copied per instance).

    Args:
        quantile: The share of first tokens the widened estimate should cover.
        window: First tokens kept per instance (the latest).
        min_samples: First tokens needed before any margin applies.
        max_margin: The widest margin (a ratio).
        memory_s: Time constant over which an unconfirmed margin fades to 1
            (seconds); after this long without a first token the ratios start over.
    """

    quantile: float = attrs.field(default=0.8, validator=_quantile)
    window: int = attrs.field(default=64, validator=_count)
    min_samples: int = attrs.field(default=16, validator=_count)
    max_margin: float = attrs.field(default=2.0, validator=_ratio_cap)
    memory_s: float = attrs.field(default=60.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.min_samples > self.window:
            raise ValueError(
                f"ttft margin: min_samples must be <= window "
                f"(got {self.min_samples} > {self.window})"
            )

    def tracker(self) -> MarginTracker:
        """A fresh tracker with these settings (one per instance)."""
        return MarginTracker(self)


DEFAULT_MARGIN: Final = TtftMargin()
"""The recommended settings (``RouterCore(margin=DEFAULT_MARGIN)``; the router's
default is no margin): the 80% conformal bound of the latest 64 first tokens.

Chosen by measurement (docs/calibration.md): over the paper, staleness,
mis-calibrated, random-speed and step-change runs, 0.8 moved BEAR's on-time
utility by -0.0012 to +0.0047 per cell (the loss within seed noise, in one
cell); 0.9 cost up to 0.004 under stale snapshots and 0.95 up to 0.019, both
by sending less to the most accurate model. The emulated demo (`bearsdk demo`)
lost 0.03-0.04 on-time utility at 10-16 req/s with it (q = 0.6 or 0.8), which is
why it is off by default."""


@attrs.define
class MarginTracker:
    """One instance's margin, learned from its first tokens (see :class:`TtftMargin`)."""

    settings: TtftMargin
    _ratios: deque[float] = attrs.field(init=False)
    _value: float = attrs.field(init=False, default=1.0)
    _at: float = attrs.field(init=False, default=-math.inf)

    def __attrs_post_init__(self) -> None:
        self._ratios = deque(maxlen=self.settings.window)

    def observe(self, observed_s: float, predicted_s: float, now: float) -> None:
        """A first token came ``observed_s`` after sending, predicted ``predicted_s``
        (the point estimate, without the margin)."""
        cfg = self.settings
        if not (
            math.isfinite(observed_s)
            and math.isfinite(predicted_s)
            and observed_s > 0.0
            and predicted_s > 0.0
            and math.isfinite(now)
        ):
            return
        if now - self._at > cfg.memory_s:
            self._ratios.clear()
            self._value = 1.0
        # (Clipped: one absurd first token moves the quantile by one rank only.)
        ratio = min(max(observed_s / predicted_s, 1.0 / cfg.max_margin), cfg.max_margin)
        self._ratios.append(ratio)
        self._at = now
        n = len(self._ratios)
        if n < cfg.min_samples:
            return
        k = min(math.ceil((n + 1) * cfg.quantile), n)
        bound = sorted(self._ratios)[k - 1]
        self._value = min(max(bound, 1.0), cfg.max_margin)

    def value(self, now: float) -> float:
        """The margin now: the learned one, faded by the time since a first token."""
        v = self._value
        if v <= 1.0:
            return 1.0
        idle = now - self._at
        return v if idle <= 0.0 else 1.0 + (v - 1.0) * math.exp(-idle / self.settings.memory_s)

    @property
    def samples(self) -> int:
        """First tokens it rests on."""
        return len(self._ratios)

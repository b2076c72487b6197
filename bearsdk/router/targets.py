"""Default TTFT targets for requests that carry none."""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

import attrs

from bearsdk import _validators as _v

__all__ = ["FixedTarget", "PaperTargets", "TargetRule"]


@runtime_checkable
class TargetRule(Protocol):
    """Assigns a TTFT target (seconds) to a request from its prompt length."""

    def target_for(self, prompt_tokens: int) -> float:
        """The target, seconds."""
        ...


@attrs.frozen
class FixedTarget:
    """The same target for every request."""

    seconds: float = attrs.field(validator=_v.positive)

    def target_for(self, prompt_tokens: int) -> float:
        """See :class:`TargetRule`."""
        return self.seconds


@attrs.define
class PaperTargets:
    """The paper's rule (appendix A.2): linear in the prompt length, jittered, clipped.

    ``tau = min(1120 ms, max(150 ms, u + (155 ms + 3.5e-3 ms * prompt) * v))`` with
    ``u ~ U(1 ms, 5 ms)`` and ``v ~ U(0.98, 1.02)``, from a seeded generator.

    Args:
        seed: Seed of the jitter (reproducible targets).
    """

    seed: int = 0
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def target_for(self, prompt_tokens: int) -> float:
        """See :class:`TargetRule`."""
        u = self._rng.uniform(1.0, 5.0)
        v = self._rng.uniform(0.98, 1.02)
        ms = min(1120.0, max(150.0, u + (155.0 + 3.5e-3 * prompt_tokens) * v))
        return ms / 1000.0

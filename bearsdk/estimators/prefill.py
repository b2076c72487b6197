"""The prefill-throughput TTFT estimator (eq. 8) and its calibration.

``theta_pre`` is the effective prefill throughput of an instance: the prefill
tokens processed in all profiled batches that contain prefill, divided by those
batches' total time. A new request's TTFT is then the remaining prefill tokens of
every resident request plus its own prompt, over ``theta_pre``. It ignores decode
interference, which is why BEA beats it (85% vs 5% MAPE in the paper); it is kept
as a baseline and as the prefill-time term of the LPS estimator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from bearsdk.estimators.base import InstanceView, RequestInfo
from bearsdk.estimators.batch_time import BatchDataError, BatchObservation, BatchTimeModel
from bearsdk.snapshot import (
    COL_COMPUTED,
    COL_OUTPUT,
    COL_PLACEHOLDERS,
    COL_PROMPT,
    COL_STATE,
    STATE_RUNNING,
    Snapshot,
)

__all__ = [
    "PrefillThroughputEstimator",
    "calibrate_theta_pre",
    "nominal_theta_pre",
    "remaining_prefill_tokens",
]


def calibrate_theta_pre(observations: Sequence[BatchObservation]) -> float:
    """Effective prefill throughput (tokens/s) of profiled batches, as eq. 8 defines it.

    Raises:
        BatchDataError: No observed batch contains prefill tokens.
    """
    tokens = 0
    seconds = 0.0
    for o in observations:
        if o.prefill_tokens > 0:
            tokens += o.prefill_tokens
            seconds += o.duration_s
    if tokens == 0:
        raise BatchDataError(
            "observations", "must contain at least one batch with prefill tokens", 0
        )
    return tokens / seconds


def nominal_theta_pre(model: BatchTimeModel, chunk_tokens: int = 2048) -> float:
    """``theta_pre`` a batch-time model implies for back-to-back fresh prefill chunks.

    Used for profiles that have a model but no profiling batches: a chunk of
    ``chunk_tokens`` prompt tokens from an empty context, no decodes.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1 (got {chunk_tokens!r})")
    t = model.batch_time(chunk_tokens, 0, 0, chunk_tokens * (chunk_tokens + 1) // 2)
    return chunk_tokens / t if t > 0 else math.inf


def remaining_prefill_tokens(snapshot: Snapshot) -> int:
    """Prompt (or recompute) tokens the snapshot's residents still have to process.

    A running request past its prompt (one token left to compute: its next decode
    input) counts 0; a waiting one counts its whole prompt plus outputs (recompute
    after preemption).
    """
    tab = snapshot.table
    if len(tab) == 0:
        return 0
    need = tab[:, COL_PROMPT] + tab[:, COL_OUTPUT] + tab[:, COL_PLACEHOLDERS] - tab[:, COL_COMPUTED]
    decoding = (
        (tab[:, COL_STATE] == STATE_RUNNING)
        & (tab[:, COL_OUTPUT] + tab[:, COL_PLACEHOLDERS] >= 1)
        & (need <= 1)
    )
    return int(np.sum(np.where(decoding, 0, np.maximum(need, 0))))


@attrs.frozen
class PrefillThroughputEstimator:
    """Eq. 8: (residents' remaining prefill + own prompt) / ``theta_pre``.

    Residents' remaining prefill comes from the snapshot when the view has one,
    else from the router's count of prompt tokens dispatched without a first token
    yet (:attr:`InstanceView.pending_prefill_tokens`).

    Args:
        theta_pre: Calibrated prefill throughput, tokens/s (see
            :func:`calibrate_theta_pre`); when ``None``, the view's online estimate.
    """

    theta_pre: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.theta_pre is not None and not (
            math.isfinite(self.theta_pre) and self.theta_pre > 0
        ):
            raise ValueError(f"theta_pre must be a finite number > 0 (got {self.theta_pre!r})")

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """See the class docstring; ``inf`` when no throughput is known."""
        theta = self.theta_pre if self.theta_pre is not None else view.prefill_throughput
        if theta is None or theta <= 0:
            return math.inf
        if view.snapshot is not None:
            resident = remaining_prefill_tokens(view.snapshot)
        else:
            resident = view.pending_prefill_tokens
        return (resident + request.prompt_tokens) / theta

"""Decisions: the frozen record of every routing choice, with its reasons."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import attrs

__all__ = ["Candidate", "Decision"]


@attrs.frozen
class Candidate:
    """One instance as it stood when a request was routed.

    Attributes:
        instance: Instance name.
        model: Model it serves.
        accuracy: Predicted accuracy in [0, 1].
        cost: Predicted cost in micro-dollars (see :class:`~bearsdk.selectors.Option`).
        utility: ``accuracy - lam * cost``.
        ttft_s: The selector's TTFT estimate (``nan`` when it uses none).
        feasible: Predicted to meet the target (``None``: the selector ignores targets).
        score: What the selector maximised.
        estimator: Which estimator produced ``ttft_s``: ``bea`` (the snapshot
            replayed as it is), ``overlay`` (BEA with the requests sent since the
            snapshot added), ``fast-forward`` (BEA from the snapshot advanced to
            now), ``bound`` (known to be past the selector's horizon from the
            prefill queued ahead alone, nothing replayed), ``lps`` (the
            queueing fallback: no fresh snapshot), ``unpriced`` (not
            estimated: an instance of higher utility was on time, so this one
            could not be chosen; ``ttft_s`` is ``nan``, ``feasible`` ``None``;
            ``BEAR(price_all=True)`` estimates every instance), a baseline's
            estimator name, or ``none``.
        snapshot_age_s: Age of the snapshot behind the estimate (``inf``: none).
        queue: Requests the router counted as resident there.
        prompt_tokens: The prompt's tokens for this instance's model.
        output_tokens: Predicted output tokens there.
        speed_factor: The instance's learned speed, which the replaying
            estimators price its batches with: real batch time over the
            profile's (``1.0``: the profile as is, or not learned; see
            ``docs/calibration.md``).
        overhead_s: The first-token overhead added to the replayed TTFT.
        ttft_lower_bound: ``ttft_s`` is past the selector's horizon and only a
            lower bound: the replay stopped there, or never started
            (``docs/decision-cost.md``).
        tpot_s: Predicted mean time per output token after the first, for a
            request with a TPOT target (``nan``: not predicted).
        resident_itl_s: The instance's decoding residents' predicted
            inter-token time over the request's window with it sent there
            (``nan``: not weighed; see :class:`~bearsdk.selectors.BEAR`'s ``harm``).
        resident_itl_base_s: The same without it: the harm is the difference.
        resident_tpot_target_s: The tightest TPOT target among the requests the
            router had there (``inf``: none, or the selector weighs no residents).
        cached_tokens: The prompt tokens the instance held in its prefix cache:
            with the prompt's token ids, when the router last heard from it (its
            KV events, else its snapshot's block pool); else, with
            ``dispatch_prefixes``, an estimate from what the router sent there;
            ``-1``: not known.
        cache_source: Where ``cached_tokens`` comes from: ``"events"``,
            ``"snapshot"``, ``"dispatches"`` (approximate: the prompt's length
            is discounted by it in the TTFT estimate), or ``""``.
        arrivals_s: What the prompts still to come were expected to add to the
            TTFT (``RouterCore(expect_arrivals=True)``; included in ``ttft_s``).
        margin: The factor the instance's estimate was widened by (its recent
            first tokens' spread, :mod:`bearsdk.router.margin`; included in
            ``ttft_s``, so that ``feasible`` is ``ttft_s`` against the target).
    """

    instance: str
    model: str
    accuracy: float
    cost: float
    utility: float
    ttft_s: float
    feasible: bool | None
    score: float
    estimator: str
    snapshot_age_s: float = math.inf
    queue: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    speed_factor: float = 1.0
    overhead_s: float = 0.0
    ttft_lower_bound: bool = False
    tpot_s: float = math.nan
    resident_itl_s: float = math.nan
    resident_itl_base_s: float = math.nan
    resident_tpot_target_s: float = math.inf
    cached_tokens: int = -1
    cache_source: str = ""
    arrivals_s: float = 0.0
    margin: float = 1.0

    @property
    def ttft_estimate_s(self) -> float:
        """The point estimate: ``ttft_s`` without the margin (what errors are measured on)."""
        return self.ttft_s / self.margin if self.margin > 0.0 else self.ttft_s

    @property
    def harm_s(self) -> float:
        """How much slower the residents' tokens come if it goes here (``nan``: not weighed)."""
        return self.resident_itl_s - self.resident_itl_base_s


@attrs.frozen
class Decision:
    """Why a request went where it went.

    Attributes:
        request_id: The router's id for the request.
        selector: The selector's name (``bear``, ``lagrangian``, ...).
        instance: The chosen instance.
        candidates: Every instance considered, in pool order (a tuple, or
            the router's :class:`~bearsdk.router.candidates.Candidates`, which
            builds each record when it is first read and compares as the tuple).
        index: Index of the chosen one in ``candidates``.
        ttft_target_s: The request's TTFT target.
        reason: The selector's reason.
        prompt_tokens: Prompt tokens at the chosen instance's model.
        output_tokens: Predicted output tokens there.
        decided_at: Router clock (``time.monotonic``) at the decision.
        decide_s: Time the decision took.
        explored: The router overrode the selector's choice to explore an
            instance with no recent speed evidence (see
            :mod:`bearsdk.router.explore`); ``reason`` says why.
        tpot_target_s: The request's TPOT target (``inf``: none).
    """

    request_id: str
    selector: str
    instance: str
    candidates: Sequence[Candidate]
    index: int
    ttft_target_s: float
    reason: str
    prompt_tokens: int
    output_tokens: int
    decided_at: float
    decide_s: float
    explored: bool = False
    tpot_target_s: float = math.inf

    @property
    def policy(self) -> str:
        """The old name of :attr:`selector` (deprecated)."""
        warnings.warn(
            "Decision.policy is deprecated: read Decision.selector",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.selector

    @property
    def chosen(self) -> Candidate:
        """The chosen candidate."""
        return self.candidates[self.index]

    def explain(self) -> str:
        """A few lines for humans: the candidates and the choice."""
        target_ms = self.ttft_target_s * 1e3
        target = f"target {target_ms:.0f} ms"
        if self.tpot_target_s != math.inf:
            target += f", TPOT {self.tpot_target_s * 1e3:.1f} ms"
        lines = [f"{self.selector}: {self.instance} ({self.reason}; {target})"]
        for i, c in enumerate(self.candidates):
            mark = "*" if i == self.index else " "
            feas = "" if c.feasible is None else (" ok " if c.feasible else " miss")
            # Only what moved the estimate off the plain replay of the profile.
            extra = f" speed x{c.speed_factor:.2f}" if c.speed_factor != 1.0 else ""
            if c.overhead_s > 0.0:
                extra += f" +{c.overhead_s * 1e3:.1f} ms overhead"
            if c.arrivals_s > 0.0:
                extra += f" +{c.arrivals_s * 1e3:.1f} ms arrivals"
            if c.margin > 1.0:
                extra += f" margin x{c.margin:.2f}"
            ge = ">=" if c.ttft_lower_bound else "  "
            tpot = "" if math.isnan(c.tpot_s) else f" tpot {c.tpot_s * 1e3:6.2f} ms"
            if c.cached_tokens >= 0:
                about = "~" if c.cache_source == "dispatches" else ""
                tpot += f" cached {about}{c.cached_tokens} tok"
            if not math.isnan(c.harm_s):
                tpot += (
                    f" residents {c.resident_itl_base_s * 1e3:.2f}->"
                    f"{c.resident_itl_s * 1e3:.2f} ms/token"
                )
            ttft = f"{ge}{c.ttft_s * 1e3:8.1f} ms"
            if c.estimator == "unpriced":
                ttft, extra = f"{'-':>10} ms", " (a better utility is on time)"
            lines.append(
                f" {mark} {c.instance:<16} acc {c.accuracy:.3f} cost {c.cost:9.1f} "
                f"u {c.utility:+.3f} ttft {ttft}{tpot}{feas} [{c.estimator}]{extra}"
            )
        return "\n".join(lines)

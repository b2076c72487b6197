"""The analytical TTFT estimator: a limited-processor-sharing queue (eq. 13-15).

When an instance publishes no usable snapshot, the router can still estimate TTFT
from time averages. The LPS abstraction (section 4.2) serves up to ``k`` requests
at once, sharing the instance's aggregate service rate ``mu`` (requests/s)
equally; further requests wait in FCFS order. With Poisson arrivals of rate
``alpha`` and exponential work, the resident count is an M/M/1 chain, and an
arrival waits on average

    E[W] = rho**k / (mu - alpha),   rho = alpha / mu            (eq. 13)

before being admitted; its TTFT adds the prefill time ``p / theta_pre`` (eq. 14).
For general arrivals and service requirements, appendix D's variability-corrected
heuristic (Kingman/Whitt) scales the wait by ``(c_a^2 + c_s^2) / 2``:

    E[W] ~ (c_a^2 + c_s^2) / 2 * rho**k * E[Q] / (1 - rho),  E[Q] = 1/mu   (eq. 15)

which is eq. 13 when ``c_a^2 = c_s^2 = 1`` and exact (Pollaczek-Khinchine) for ``k = 1``
with Poisson arrivals.
"""

from __future__ import annotations

import math

import attrs

from bearsdk.estimators.base import InstanceView, RequestInfo

__all__ = ["LPSEstimator", "lps_wait", "lps_wait_given_state", "lps_wait_variability"]


def _check(name: str, value: float, *, positive: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound} (got {value!r})")
    return v


def lps_wait(arrival_rate: float, service_rate: float, k: float) -> float:
    """Mean LPS queueing delay of eq. 13, seconds (``inf`` when ``alpha >= mu``).

    Args:
        arrival_rate: ``alpha``, requests per second.
        service_rate: ``mu``, aggregate completions per second when busy.
        k: Concurrency cap (real values interpolate).
    """
    a = _check("arrival_rate", arrival_rate)
    mu = _check("service_rate", service_rate, positive=True)
    k = _check("k", k, positive=True)
    if a >= mu:
        return math.inf
    return math.pow(a / mu, k) / (mu - a)


def lps_wait_variability(
    arrival_rate: float, service_rate: float, k: float, arrival_scv: float, service_scv: float
) -> float:
    """Variability-corrected mean LPS queueing delay of eq. 15, seconds.

    Args:
        arrival_rate: ``alpha``, requests per second.
        service_rate: ``mu = 1 / E[Q]``.
        k: Concurrency cap.
        arrival_scv: ``c_a^2``, squared coefficient of variation of inter-arrival times.
        service_scv: ``c_s^2``, that of the per-request service requirement.
    """
    a = _check("arrival_rate", arrival_rate)
    mu = _check("service_rate", service_rate, positive=True)
    k = _check("k", k, positive=True)
    ca2 = _check("arrival_scv", arrival_scv)
    cs2 = _check("service_scv", service_scv)
    if a >= mu:
        return math.inf
    rho = a / mu
    return (ca2 + cs2) / 2.0 * math.pow(rho, k) * (1.0 / mu) / (1.0 - rho)


def lps_wait_given_state(resident: int, service_rate: float, k: float) -> float:
    """Expected LPS wait of an arrival that finds ``resident`` requests: ``(n - k + 1)+ / mu``.

    The step of eq. 13's derivation before averaging over the stationary state;
    finite whatever the load, so it serves when ``alpha >= mu`` makes eq. 13 infinite.
    """
    mu = _check("service_rate", service_rate, positive=True)
    k = _check("k", k, positive=True)
    if resident < 0:
        raise ValueError(f"resident must be >= 0 (got {resident!r})")
    return max(0.0, resident - math.ceil(k) + 1) / mu


@attrs.frozen
class LPSEstimator:
    """TTFT from the LPS queue (eq. 14, optionally eq. 15): the no-snapshot fallback.

    Every parameter comes from the view's online statistics
    (:class:`~bearsdk.estimators.stats.InstanceStats`) when present, else from the
    configured value: ``alpha`` (:attr:`InstanceView.arrival_rate`), ``mu``
    (:attr:`~InstanceView.service_rate`), ``k`` (:attr:`~InstanceView.concurrency`),
    ``c_a^2``/``c_s^2`` (``arrival_scv``/``service_scv``). ``theta_pre`` is the
    other way round: a calibrated value (from profiling batches, as the paper
    does) wins over the view's online estimate.

    Fallbacks: no ``alpha`` or ``mu`` yet means no queueing delay is predicted;
    no ``k`` means ``k = 1``; no ``theta_pre`` means no prefill time. When the
    measured load is unstable (``alpha >= mu``), the stationary mean does not
    exist and the state-conditional wait ``(n - k + 1)+ / mu`` for the current
    resident count ``n`` (:attr:`InstanceView.unfinished`) is used instead.

    Args:
        theta_pre: Calibrated prefill throughput, tokens/s.
        concurrency: ``k`` when the view has none (e.g. the engine's ``max_num_seqs``).
        service_rate: ``mu`` when the view has none, requests/s.
        arrival_rate: ``alpha`` when the view has none, requests/s.
        variability: Use eq. 15 with the view's SCVs (1 where unknown).
        conditional: Always use the state-conditional wait for the current count.
    """

    theta_pre: float | None = None
    concurrency: float | None = None
    service_rate: float | None = None
    arrival_rate: float | None = None
    variability: bool = False
    conditional: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("theta_pre", "concurrency", "service_rate"):
            v = getattr(self, name)
            if v is not None:
                _check(name, v, positive=True)
        if self.arrival_rate is not None:
            _check("arrival_rate", self.arrival_rate)

    def wait(self, view: InstanceView) -> float:
        """Expected queueing delay at the instance, seconds."""
        alpha = view.arrival_rate if view.arrival_rate is not None else self.arrival_rate
        mu = view.service_rate if view.service_rate is not None else self.service_rate
        k = view.concurrency if view.concurrency is not None else self.concurrency
        k = max(1.0, k) if k is not None else 1.0
        if mu is None or mu <= 0:
            return 0.0
        if self.conditional:
            return lps_wait_given_state(view.unfinished, mu, k)
        if alpha is None:
            return 0.0
        if alpha >= mu:
            return lps_wait_given_state(view.unfinished, mu, k)
        if self.variability:
            ca2 = view.arrival_scv if view.arrival_scv is not None else 1.0
            cs2 = view.service_scv if view.service_scv is not None else 1.0
            return lps_wait_variability(alpha, mu, k, ca2, cs2)
        return lps_wait(alpha, mu, k)

    def prefill_time(self, request: RequestInfo, view: InstanceView) -> float:
        """The request's prefill time ``p / theta_pre``, seconds (0 when unknown)."""
        theta = self.theta_pre if self.theta_pre is not None else view.prefill_throughput
        if theta is None or theta <= 0:
            return 0.0
        return request.prompt_tokens / theta

    def estimate_ttft(self, request: RequestInfo, view: InstanceView) -> float:
        """Eq. 14: expected queueing delay plus the request's prefill time, seconds."""
        return self.wait(view) + self.prefill_time(request, view)

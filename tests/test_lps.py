"""The LPS analytical estimator (eq. 13-15) against discrete-event simulation of an LPS queue.

Two simulators, both seeded:

* ``lps_des``: an explicit-work event simulation with a heap. Each job carries its
  own service requirement; the ``min(n, k)`` active jobs share the capacity
  equally (a virtual clock advances at ``1/m`` per second, a job finishes when the
  clock passes its start plus its work); the rest wait FCFS. It makes no
  assumption about the work distribution. Pure Python: ~1 us per job.
* ``lps_chain``: for exponential work, memorylessness makes the completion rate
  ``mu`` in every busy state, whichever job completes; the state is then the
  uniformised birth-death chain, simulated vectorised (~50 ns per event), and an
  arrival that finds ``n >= k`` residents is admitted at the ``(n-k+1)``-th later
  completion (FCFS: later arrivals cannot overtake it). The explicit simulator
  checks this equivalence where both are cheap.

Mean waits at high load and large ``k`` are rare-event averages with long
correlations, so the comparison with ``k > 1`` uses the k=1 wait of the same
sample path as a control variate; its mean is the classical M/M/1 FCFS wait
(Pollaczek-Khinchine), not eq. 13. The tolerance is 5% of the larger of the
predicted wait and one mean service time ``1/mu`` (below that the wait is a small
fraction of a request's time in the system; e.g. k=25 at rho=0.5 waits 3e-8/mu).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from functools import cache

import numpy as np
import numpy.typing as npt
import pytest

from bearsdk.estimators.base import InstanceView, RequestInfo
from bearsdk.estimators.lps import (
    LPSEstimator,
    lps_wait,
    lps_wait_given_state,
    lps_wait_variability,
)

F = npt.NDArray[np.float64]
MU = 1.0
RHOS = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
KS = (1, 4, 25)
# Uniformised events per utilisation: enough that 5% holds with margin.
STEPS = {0.1: 1e6, 0.3: 1e6, 0.5: 1e6, 0.7: 1e6, 0.8: 2e6, 0.9: 1.5e7, 0.95: 1e7}


def lps_des(inter: F, work: F, k: int) -> F:
    """Waiting time (arrival to admission) of each job in an LPS queue, capacity 1."""
    n = len(inter)
    waits = np.empty(n)
    arrivals = np.cumsum(inter).tolist()
    works = work.tolist()
    active: list[float] = []  # finish times on the virtual (attained-service) clock
    queue: deque[int] = deque()
    t = v = 0.0
    i = 0
    while i < n or active:
        m = len(active)
        t_done = t + (active[0] - v) * m if m else math.inf
        if i < n and arrivals[i] <= t_done:
            if m:
                v += (arrivals[i] - t) / m
            t = arrivals[i]
            if m < k:
                heapq.heappush(active, v + works[i])
                waits[i] = 0.0
            else:
                queue.append(i)
            i += 1
        else:
            v = heapq.heappop(active)
            t = t_done
            if queue:
                j = queue.popleft()
                waits[j] = t - arrivals[j]
                heapq.heappush(active, v + works[j])
    return waits


def fcfs_waits(inter: F, work: F) -> F:
    """Single-server FCFS waits (Lindley's recursion, vectorised)."""
    x = np.concatenate([[0.0], np.cumsum(work[:-1] - inter[1:])])
    return np.asarray(x - np.minimum.accumulate(np.minimum(x, 0.0)), dtype=np.float64)


@cache
def lps_chain(rho: float, seed: int = 20260) -> dict[int, F]:
    """Waits of the arrivals of one uniformised LPS sample path, for every k in KS."""
    rng = np.random.default_rng(seed)
    n_steps = int(STEPS[rho])
    alpha = rho * MU
    lam = alpha + MU
    up = rng.random(n_steps) < alpha / lam
    walk = np.cumsum(np.where(up, 1, -1).astype(np.int64))
    after = walk - np.minimum(np.minimum.accumulate(walk), 0)  # reflected at 0: residents
    before = np.concatenate([[0], after[:-1]])
    clock = np.cumsum(rng.exponential(1.0 / lam, n_steps))
    downs = np.cumsum(~up)
    arr = np.flatnonzero(up)
    arr = arr[arr >= n_steps // 20]  # start from (near) stationarity
    seen = before[arr]
    out: dict[int, F] = {}
    valid = np.ones(len(arr), dtype=bool)
    for k in KS:
        need = np.maximum(seen - k + 1, 0)
        w = np.zeros(len(arr))
        q = need > 0
        j = np.searchsorted(downs, downs[arr[q]] + need[q])  # the (n-k+1)-th later completion
        ok = j < n_steps
        wq = np.full(int(q.sum()), np.nan)
        wq[ok] = clock[j[ok]] - clock[arr[q]][ok]
        w[q] = wq
        valid &= ~np.isnan(w)  # admitted after the path ends: dropped (a handful at most)
        out[k] = w
    return {k: w[valid] for k, w in out.items()}


def control_variate_mean(w: F, control: F, control_mean: float) -> float:
    var = float(np.var(control))
    if var == 0.0:
        return float(np.mean(w))
    beta = float(np.cov(w, control)[0, 1]) / var
    return float(np.mean(w) - beta * (np.mean(control) - control_mean))


def mm1_wait(rho: float) -> float:
    return rho / (MU * (1 - rho))


# ---------------------------------------------------------------- formulas


def test_eq13_closed_form() -> None:
    assert lps_wait(0.5, 1.0, 1) == pytest.approx(1.0)  # M/M/1: rho / (mu - alpha)
    assert lps_wait(0.8, 1.0, 4) == pytest.approx(0.8**4 / 0.2)
    assert lps_wait(8.0, 10.0, 25) == pytest.approx(0.8**25 / 2.0)
    assert lps_wait(0.0, 1.0, 3) == 0.0
    assert lps_wait(1.0, 1.0, 3) == math.inf
    assert lps_wait(0.9, 1.0, 1) > lps_wait(0.9, 1.0, 4) > lps_wait(0.9, 1.0, 25)


@pytest.mark.parametrize(
    ("alpha", "mu", "k"), [(0.5, 1.0, 1), (3.0, 4.0, 4), (20.0, 21.0, 25), (0.1, 2.0, 7.5)]
)
def test_eq15_reduces_to_eq13_for_poisson_exponential(alpha: float, mu: float, k: float) -> None:
    assert lps_wait_variability(alpha, mu, k, 1.0, 1.0) == pytest.approx(
        lps_wait(alpha, mu, k), rel=1e-12
    )


def test_eq15_scales_with_variability() -> None:
    base = lps_wait(0.7, 1.0, 4)
    assert lps_wait_variability(0.7, 1.0, 4, 1.0, 0.0) == pytest.approx(base / 2)
    assert lps_wait_variability(0.7, 1.0, 4, 3.0, 2.0) == pytest.approx(base * 2.5)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: lps_wait(-1, 1, 1), "arrival_rate"),
        (lambda: lps_wait(1, 0, 1), "service_rate"),
        (lambda: lps_wait(1, 2, 0), "k"),
        (lambda: lps_wait(math.nan, 2, 1), "arrival_rate"),
        (lambda: lps_wait_variability(1, 2, 1, -1, 1), "arrival_scv"),
        (lambda: lps_wait_variability(1, 2, 1, 1, math.inf), "service_scv"),
        (lambda: lps_wait_given_state(-1, 2, 1), "resident"),
    ],
)
def test_bad_parameters_are_named(call: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()  # type: ignore[operator]


def test_state_conditional_wait() -> None:
    assert lps_wait_given_state(3, 2.0, 4) == 0.0
    assert lps_wait_given_state(4, 2.0, 4) == 0.5  # one completion needed
    assert lps_wait_given_state(10, 2.0, 4) == 3.5


# ---------------------------------------------------------------- simulation


def test_explicit_simulation_is_fcfs_for_k1() -> None:
    rng = np.random.default_rng(1)
    inter = rng.exponential(1 / 0.9, 20000)
    work = rng.exponential(1.0, 20000)
    np.testing.assert_allclose(lps_des(inter, work, 1), fcfs_waits(inter, work), atol=1e-8)


@pytest.mark.parametrize("rho", [0.5, 0.8, 0.95])
def test_eq13_matches_explicit_work_simulation(rho: float) -> None:
    rng = np.random.default_rng(2)
    n = 200_000
    inter = rng.exponential(1 / (rho * MU), n)
    work = rng.exponential(1 / MU, n)
    k = 4
    est = control_variate_mean(lps_des(inter, work, k), fcfs_waits(inter, work), mm1_wait(rho))
    predicted = lps_wait(rho * MU, MU, k)
    assert abs(est - predicted) <= 0.05 * max(predicted, 1 / MU), (est, predicted)


@pytest.mark.parametrize("rho", RHOS)
@pytest.mark.parametrize("k", KS)
def test_eq13_matches_lps_simulation(k: int, rho: float) -> None:
    waits = lps_chain(rho)
    if k == 1:
        est = float(np.mean(waits[1]))
    else:
        est = control_variate_mean(waits[k], waits[1], mm1_wait(rho))
    predicted = lps_wait(rho * MU, MU, k)
    assert abs(est - predicted) <= 0.05 * max(predicted, 1 / MU), (est, predicted)


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_eq15_exact_for_deterministic_work_k1(rho: float) -> None:
    # Appendix D's correction with c_a^2 = 1, c_s^2 = 0 is M/D/1 (Pollaczek-Khinchine).
    rng = np.random.default_rng(3)
    n = 2_000_000
    inter = rng.exponential(1 / (rho * MU), n)
    work = np.full(n, 1 / MU)
    est = float(np.mean(fcfs_waits(inter, work)[n // 20 :]))
    predicted = lps_wait_variability(rho * MU, MU, 1, 1.0, 0.0)
    assert est == pytest.approx(predicted, rel=0.05)
    des = lps_des(inter[:20000], work[:20000], 1)
    np.testing.assert_allclose(des, fcfs_waits(inter[:20000], work[:20000]), atol=1e-8)


# ---------------------------------------------------------------- estimator


def test_estimator_is_eq14() -> None:
    view = InstanceView(arrival_rate=8.0, service_rate=10.0, concurrency=25.0)
    est = LPSEstimator(theta_pre=20000.0)
    assert est.estimate_ttft(RequestInfo(4000), view) == pytest.approx(0.8**25 / 2.0 + 0.2)


def test_estimator_uses_eq15_when_asked() -> None:
    view = InstanceView(
        arrival_rate=0.7, service_rate=1.0, concurrency=4.0, arrival_scv=3.0, service_scv=2.0
    )
    plain = LPSEstimator().estimate_ttft(RequestInfo(10), view)
    corrected = LPSEstimator(variability=True).estimate_ttft(RequestInfo(10), view)
    assert corrected == pytest.approx(2.5 * plain)


def test_estimator_fallbacks() -> None:
    req = RequestInfo(1000)
    # No data at all: no queueing, prefill at the configured throughput.
    assert LPSEstimator(theta_pre=10000.0).estimate_ttft(req, InstanceView()) == pytest.approx(0.1)
    # Configured rates stand in for missing ones; k defaults to 1.
    cfg = LPSEstimator(service_rate=2.0, arrival_rate=1.0)
    assert cfg.wait(InstanceView()) == pytest.approx(lps_wait(1.0, 2.0, 1))
    # The view's measurements win over configured values.
    view = InstanceView(arrival_rate=1.0, service_rate=4.0, concurrency=2.0)
    assert cfg.wait(view) == pytest.approx(lps_wait(1.0, 4.0, 2))
    # Overload: the stationary mean does not exist; the current backlog decides.
    hot = InstanceView(arrival_rate=5.0, service_rate=4.0, concurrency=2.0, unfinished=9)
    assert LPSEstimator().wait(hot) == pytest.approx((9 - 2 + 1) / 4.0)
    assert LPSEstimator(conditional=True).wait(view) == 0.0
    with pytest.raises(ValueError, match="theta_pre"):
        LPSEstimator(theta_pre=0.0)

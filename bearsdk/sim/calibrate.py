"""Calibrating the router's eq. 12 on the simulated instances, as the paper does on real ones.

The paper fits each instance's batch-time coefficients to its observed batches
(section 4.1, figure 5). :func:`calibrate_pool` does that here: each simulated
engine serves a calibration stream alone (the workload's requests in a
different order, at a low, a medium and a high rate, so that the batches span
light and heavy load), every batch is logged, and
:func:`~bearsdk.estimators.batch_time.fit_batch_time` fits eq. 12 (with the
dense floor) to them. The ground truth is untouched: only what the router
believes changes. The report compares the fitted coefficients' error on those
batches with the shipped profile's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np

from bearsdk.estimators.batch_time import BatchTimeModel, fit_batch_time
from bearsdk.sim.engine import BatchNoise, SimEngine, bind_engine
from bearsdk.sim.scenario import InstanceSpec, RequestSet

__all__ = ["Calibration", "calibrate_pool"]

CALIBRATION_RATES: Final = (1.0, 4.0, 8.0)
"""Arrival rates of the calibration stream's three phases, requests/s."""


@attrs.frozen
class Calibration:
    """One instance's calibration.

    Attributes:
        instance: Instance name.
        batches: Batches observed.
        model: The fitted coefficients.
        fit_mape: Their MAPE on the observed batches.
        profile_mape: The shipped profile's MAPE on the same batches (``nan``
            when the instance has explicit coefficients only).
        profile_bias: Mean log ratio (profile over truth) on the same batches.
    """

    instance: str
    batches: int
    model: BatchTimeModel
    fit_mape: float
    profile_mape: float
    profile_bias: float


def calibrate_pool(
    pool: Sequence[InstanceSpec],
    requests: RequestSet,
    *,
    per_phase: int = 400,
    seed: int = 0,
) -> tuple[tuple[InstanceSpec, ...], tuple[Calibration, ...]]:
    """Fit eq. 12 to each instance's batches; return the pool with the fits set.

    Args:
        pool: The instances.
        requests: Requests to draw the calibration stream from.
        per_phase: Requests per rate phase.
        seed: Seeds the draws, arrivals and batch noise (keep it apart from the runs').

    Returns:
        The pool with each instance's ``batch_time`` set, and the calibrations.
    """
    from bearsdk.estimators.profiles import load_profile

    rng = np.random.default_rng(seed)
    out: list[InstanceSpec] = []
    cals: list[Calibration] = []
    n = len(requests)
    for j, spec in enumerate(pool):
        em = bind_engine(spec.engine, spec.scheduler, dict(spec.params))
        tm = em.time_model
        if spec.time_params() != tm.params:
            from bearsdk.emulator.timing import GroundTruthTimeModel

            tm = GroundTruthTimeModel(em.profile, spec.time_params(), 0)
        eng = SimEngine(
            f"cal-{spec.name}",
            em.policy,
            em.max_model_len,
            tm,
            BatchNoise(tm.params, seed + 104729 * (j + 1)),
            log_batches=True,
        )
        picks = rng.integers(0, n, size=per_phase * len(CALIBRATION_RATES))
        gaps = np.concatenate([rng.exponential(1.0 / r, size=per_phase) for r in CALIBRATION_RATES])
        t = 0.0
        for k, (i, gap) in enumerate(zip(picks, gaps, strict=True)):
            t += float(gap)
            eng.advance(t)
            eng.add_request(
                f"c{k:07d}", int(requests.prompt_tokens[i]), int(requests.true_output[i, j]), t
            )
        eng.drain()
        feats, y = eng.batch_log()
        fit = fit_batch_time((feats, y), dense_floor=True)
        prof_mape = prof_bias = float("nan")
        try:
            base = (
                BatchTimeModel(*spec.batch_time)
                if spec.batch_time is not None
                else load_profile(spec.profile or spec.engine)
            )
            pred = base.predict(feats)
            prof_mape = float(np.mean(np.abs(pred - y) / y))
            prof_bias = float(np.mean(np.log(pred / y)))
        except (KeyError, ValueError):
            pass
        cals.append(Calibration(spec.name, len(y), fit.model, fit.mape, prof_mape, prof_bias))
        out.append(attrs.evolve(spec, batch_time=fit.model.extended_coeffs))
    return tuple(out), tuple(cals)

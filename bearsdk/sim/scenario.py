"""What a simulation run is made of, and what it gives.

The pool's instances (:class:`InstanceSpec`), the policies
(:class:`PolicySpec`), the requests with everything true and predicted about
them (:class:`RequestSet`), one run's settings (:class:`Scenario`) and its
outcome (:class:`RunResult`); the arrival processes (:func:`arrival_times`).
:func:`~bearsdk.sim.run.run_scenario` routes a run.
"""

from __future__ import annotations

import random
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.emulator import GroundTruthParams
from bearsdk.predictors import PoolPrediction
from bearsdk.schedulers import Policy
from bearsdk.state import StalenessRules

__all__ = [
    "BATCH_TIME_MODES",
    "MARGIN_MODES",
    "ORACLE",
    "ORACLE_LATENCY",
    "SPEED_MODES",
    "TIMELINE_WINDOW_S",
    "InstanceSpec",
    "PolicySpec",
    "RequestSet",
    "RunResult",
    "Scenario",
    "arrival_times",
    "router_params",
    "staleness_label",
]

TIMELINE_WINDOW_S: Final = 5.0
"""Width of a :attr:`RunResult.timeline` window, seconds of arrivals."""

BATCH_TIME_MODES: Final = ("profile", "calibrated", "online")
"""The router's eq. 12 coefficients: each instance's profile, a fit to its
batches before the runs, or refitted online from the batches it reports."""

SPEED_MODES: Final = ("learned", "profile")
"""How the router prices an instance's batches: its speed learned, or the profile as is."""

MARGIN_MODES: Final = ("learned", "off")
"""Whether the router widens each instance's TTFT estimates by its first tokens' spread."""

ORACLE: Final = "oracle"
"""Name of the oracle router (true TTFT and true utility)."""
ORACLE_LATENCY: Final = "oracle-ttft"
"""Name of the latency oracle: true TTFT, predicted utility (BEAR with a perfect
TTFT estimator: the gap to BEAR is what latency estimation costs)."""


@attrs.frozen
class InstanceSpec:
    """One instance of the simulated pool.

    Attributes:
        name: Instance name.
        model: The model it serves, as the predictor names it (accuracy, prices).
        engine: Emulator profile: the ground truth (hardware, batch times, lengths).
        profile: The router's eq. 12 batch-time profile (default: ``engine``).
        batch_time: Explicit eq. 12 coefficients for the router, overriding ``profile``.
        scheduler: Registered scheduler policy of the engine (and the router's).
        params: Engine flags (default: what ``vllm serve`` picks on the hardware).
        ground_truth: Overrides of :class:`~bearsdk.emulator.GroundTruthParams`.
        snapshots: The registered snapshot source kind whose simulated form
            delivers the engine's snapshots to the router
            (:class:`~bearsdk.router.sources.SimulatedSource`).
        speed_changes: ``(time_s, multiplier)`` steps of the engine's speed: from
            ``time_s`` on, every batch takes ``multiplier`` times its ground-truth
            time (a GPU throttled mid-run, then recovered).
        time_scale_range: ``(low, high)``: each seed draws the engine's
            ``time_scale`` log-uniformly in this range (times the ground
            truth's own), the same draw for every policy of that seed.
    """

    name: str
    model: str
    engine: str
    profile: str | None = None
    batch_time: tuple[float, ...] | None = None
    scheduler: str = "vllm-v1"
    params: tuple[tuple[str, Any], ...] = ()
    ground_truth: tuple[tuple[str, float], ...] = ()
    snapshots: str = "push"
    speed_changes: tuple[tuple[float, float], ...] = ()
    time_scale_range: tuple[float, float] | None = None

    def time_params(self, seed: int | None = None) -> GroundTruthParams:
        """The ground-truth model's constants (with ``seed``: its drawn time scale)."""
        overrides: dict[str, Any] = dict(self.ground_truth)
        params = attrs.evolve(GroundTruthParams(), **overrides)
        if seed is not None and self.time_scale_range is not None:
            params = attrs.evolve(params, time_scale=params.time_scale * self.drawn_scale(seed))
        return params

    def drawn_scale(self, seed: int) -> float:
        """The time scale ``seed`` draws from :attr:`time_scale_range` (1 without one)."""
        if self.time_scale_range is None:
            return 1.0
        lo, hi = self.time_scale_range
        # Keyed by seed and name alone: the same instance gets the same draw in
        # every policy's run, whatever the pool's order or the worker.
        u = random.Random(f"time-scale:{seed}:{self.name}").random()
        return float(lo * (hi / lo) ** u)


@attrs.frozen
class PolicySpec:
    """A routing policy: a built-in selector (:func:`~bearsdk.selectors.make_selector`)
    with parameters, or :data:`ORACLE`.

    Attributes:
        name: Selector name or ``"oracle"``.
        params: Its parameters (``lam`` and ``delta`` come from the scenario).
        label: How results name it (default: the name, with parameters).
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    @property
    def display(self) -> str:
        """The label, or the name with its parameters."""
        if self.label:
            return self.label
        if not self.params:
            return self.name
        inner = ",".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params
        )
        return f"{self.name}({inner})"


@attrs.frozen(eq=False)
class RequestSet:
    """The requests of a workload, with everything true and predicted about them.

    Arrays have one row per request; ``[:, j]`` columns follow the pool's
    instances (truth) or the predictor's models (predictions).

    Attributes:
        texts: Prompt text of each request (what the router's predictor reads).
        prompt_tokens: True prompt length (the engines').
        targets_s: TTFT target of each request.
        true_output: True output length at each instance.
        true_accuracy: True accuracy at each instance.
        price_in: Input price of each instance's model, USD per million tokens.
        price_out: Output price, USD per million tokens.
        models: The predictor's models, in its order.
        pred_accuracy: Predicted accuracy per model.
        pred_output: Predicted output length per model.
        pred_prompt: Prompt tokens per model, as the router counts them.
        pred_cost: Predicted cost per model, USD.
        tasks: Task (or dataset) of each request, for reports.
        tpot_targets_s: TPOT target of each request (seconds per output token
            after the first; ``None``: no TPOT targets, TTFT alone decides).
    """

    texts: tuple[str, ...]
    prompt_tokens: npt.NDArray[np.int64]
    targets_s: npt.NDArray[np.float64]
    true_output: npt.NDArray[np.int64]
    true_accuracy: npt.NDArray[np.float64]
    price_in: npt.NDArray[np.float64]
    price_out: npt.NDArray[np.float64]
    models: tuple[str, ...]
    pred_accuracy: npt.NDArray[np.float64]
    pred_output: npt.NDArray[np.float64]
    pred_prompt: npt.NDArray[np.float64]
    pred_cost: npt.NDArray[np.float64]
    tasks: tuple[str, ...] = ()
    tpot_targets_s: npt.NDArray[np.float64] | None = None

    def tpot_target(self, i: int) -> float | None:
        """Request ``i``'s TPOT target, as the router takes it (``None``: none)."""
        return None if self.tpot_targets_s is None else float(self.tpot_targets_s[i])

    def __len__(self) -> int:
        return len(self.texts)

    def true_cost(self) -> npt.NDArray[np.float64]:
        """True cost of each request at each instance, micro-dollars."""
        cost: npt.NDArray[np.float64] = (
            self.prompt_tokens[:, None] * self.price_in[None, :]
            + self.true_output * self.price_out[None, :]
        )
        return cost

    def prediction(self, i: int) -> PoolPrediction:
        """The predictor's output for request ``i``."""
        return PoolPrediction(
            self.models,
            self.pred_accuracy[i],
            self.pred_output[i],
            self.pred_prompt[i],
            self.pred_cost[i],
        )


@attrs.frozen
class Scenario:
    """One run: a policy at one point of a sweep.

    Attributes:
        policy: The policy.
        rate: Mean arrival rate, requests/s.
        arrivals: ``"poisson"``, ``"mmpp2:R"`` (rate ratio ``R``) or ``"trace"``.
        lam: Cost weight of the utility (policies and metric).
        delta: Latency weight of the Lagrangian policy (``None``: not applicable).
        staleness_s: Snapshot delay: one published at ``t`` reaches the router at ``t + delay``.
        seed: Workload and engine seed.
        sweep: Name of the sweep it belongs to.
        router_staleness: How the router handles snapshot age (its default:
            overlay, fast-forward, LPS fallback after 2 s).
        resident_lengths: The router's ``resident_lengths`` (``"predicted"``
            or ``"calibrated"``).
        speed: ``"learned"``: the router learns each instance's speed from its
            snapshots; ``"profile"``: it keeps the coefficients as they are.
        margin: ``"off"`` (the router's default): it uses the point
            estimates; ``"learned"``: it widens each instance's TTFT estimates
            by its first tokens' spread (:mod:`bearsdk.router.margin`).
        online_batch_time: The router follows each engine's batch records (as
            ``AsyncRouter`` follows ``/bear/batches`` from the vLLM plugin or
            the emulator) and refits its eq. 12 coefficients online
            (:class:`~bearsdk.estimators.batch_time.OnlineBatchTime`; the
            configuration's ``batch_time = "online"``).
        admission: What happens to a request no instance is predicted to serve
            on time: one of :data:`~bearsdk.gateway.config.ADMISSION_MODES`, as
            the gateway applies it (:mod:`bearsdk.sim.admission`; the oracles
            ignore it).
        queue_size: Most requests held at once (``admission = "queue"``).
        max_wait_ms: Longest a request is held, milliseconds (``0``: its target).
    """

    policy: PolicySpec
    rate: float
    arrivals: str = "poisson"
    lam: float = 5e-4
    delta: float | None = None
    staleness_s: float = 0.0
    seed: int = 0
    sweep: str = ""
    router_staleness: StalenessRules = attrs.field(factory=StalenessRules)
    resident_lengths: str = "predicted"
    speed: str = "learned"
    margin: str = "off"
    online_batch_time: bool = False
    admission: str = "best-effort"
    queue_size: int = 1024
    max_wait_ms: float = 0.0


@attrs.frozen
class RunResult:
    """What one run measured.

    Requests refused by admission control (:attr:`rejected` and
    :attr:`expired`) have no first token: they count as not on time, with
    utility 0, in every mean over requests; TTFTs are over served requests.

    Attributes:
        scenario: The run.
        n: Requests that arrived.
        on_time_utility: Eq. 6: mean true utility, 0 for requests past their
            target (or refused); with TPOT targets, past either target.
        slo_attainment: Share of requests whose TTFT met the target (and
            their TPOT theirs, with TPOT targets).
        mean_utility: Mean true utility (targets ignored; 0 for a refused request).
        mean_ttft_s: Mean TTFT of the served requests (from arrival: a held
            request's wait counts).
        p90_ttft_s: 90th percentile TTFT of the served requests.
        composition: Per instance: ``{"routed", "met", "missed"}`` counts.
        ttft_mape: MAPE of the policy's TTFT prediction for the chosen instance
            (``nan`` when it predicts none), overall and by estimator used; a
            held request's prediction and TTFT both count from its dispatch.
        ttft_mape_n: The requests each of ``ttft_mape``'s figures averages
            over (to pool runs: weigh each run's figure by its count).
        wall_s: Wall time of the run.
        decide_us: Mean wall time of a routing decision, microseconds (a held
            request's rechecks are decisions too).
        batches: Batches the engines ran.
        samples: Per-request ``(instance index, predicted TTFT, true TTFT,
            target)`` for up to 4000 requests (plots; not in JSON).
        diagnosis: With ``diagnose``: every candidate's prediction against its
            true forecast, per instance and estimator (see :class:`_Diagnosis`).
        ttft_floor: With ``diagnose``: the chosen instance's true forecast at
            the decision (exact state, lengths and batch times) against the
            TTFT it gave: ``n``, ``mape``, ``bias``. What no replay of the
            present can predict (requests arriving later share the batch that
            completes the prompt): the floor under ``ttft_mape``.
        speed: The router's learned speed factor per instance at the end, with
            its standard error, the steps it rests on, the first-token overhead,
            and the engine's true ``time_scale`` (routed policies).
        timeline: With speed changes in the pool: per window of
            :data:`TIMELINE_WINDOW_S` of arrivals, its start, requests, on-time
            share, and the router's learned factor per instance at its end.
        goodput_rps: On-time goodput: requests whose first token met their
            target, divided by the arrival span (last arrival minus first,
            seconds; ``None`` for a single request). Refused requests are not
            on time.
        rejected: Requests refused at arrival (admission ``reject``, or
            ``queue`` with the queue full): the gateway's immediate 429s.
        queued: Requests held in the admission queue at least once.
        expired: Held requests that reached their deadline unsent (429 after waiting).
        reject_decide_us_max: Wall time of the routing decision that rejected
            a request, microseconds, the most over :attr:`rejected` requests
            (``None`` if none): what an immediate 429 costs the gateway.
        reject_decide_us_p99: Its 99th percentile.
        tpot: With TPOT targets (``workload.tpot_targets``): ``ttft_attainment``
            and ``tpot_attainment`` (the shares meeting each target;
            :attr:`slo_attainment` and :attr:`on_time_utility` then need
            both), ``tpot_missed`` (served requests streamed slower than their
            target), ``mean_tpot_s`` and ``p90_tpot_s`` (TPOT as vLLM reports
            it: last token less first over outputs less one). Empty without.
    """

    scenario: Scenario
    n: int
    on_time_utility: float
    slo_attainment: float
    mean_utility: float
    mean_ttft_s: float
    p90_ttft_s: float
    composition: dict[str, dict[str, int]]
    ttft_mape: dict[str, float]
    wall_s: float
    decide_us: float
    batches: int
    samples: tuple[tuple[int, float, float, float], ...] = ()
    diagnosis: dict[str, dict[str, float]] = attrs.field(factory=dict)
    speed: dict[str, dict[str, float]] = attrs.field(factory=dict)
    timeline: tuple[dict[str, Any], ...] = ()
    # None, not NaN, where there is nothing to measure: attrs compares fields with
    # ==, and a NaN would make a result unequal to itself.
    goodput_rps: float | None = None
    rejected: int = 0
    queued: int = 0
    expired: int = 0
    reject_decide_us_max: float | None = None
    reject_decide_us_p99: float | None = None
    tpot: dict[str, float | None] = attrs.field(factory=dict)
    ttft_mape_n: dict[str, int] = attrs.field(factory=dict)
    ttft_floor: dict[str, float] = attrs.field(factory=dict)

    def as_dict(self, *, admission: bool | None = None) -> dict[str, Any]:
        """The JSON form (without samples).

        Args:
            admission: Include the admission fields (``admission``,
                ``queue_size``, ``max_wait_ms``, ``goodput_rps``, ``rejected``,
                ``queued``, ``expired``, ``reject_decide_us_max``,
                ``reject_decide_us_p99``); default: when the scenario's
                admission is not ``best-effort`` (a sweep over admission
                modes passes ``True`` for every run).
        """
        s = self.scenario
        if admission is None:
            admission = s.admission != "best-effort"
        extra: dict[str, Any] = {}
        if admission:
            extra = {
                "admission": s.admission,
                "queue_size": s.queue_size,
                "max_wait_ms": s.max_wait_ms,
                "goodput_rps": self.goodput_rps,
                "rejected": self.rejected,
                "queued": self.queued,
                "expired": self.expired,
                "reject_decide_us_max": self.reject_decide_us_max,
                "reject_decide_us_p99": self.reject_decide_us_p99,
            }
        return {
            "sweep": s.sweep,
            "policy": s.policy.display,
            "policy_name": s.policy.name,
            "rate": s.rate,
            "arrivals": s.arrivals,
            "lam": s.lam,
            "delta": s.delta,
            "staleness_ms": round(s.staleness_s * 1000, 6),
            "router_staleness": staleness_label(s.router_staleness),
            "resident_lengths": s.resident_lengths,
            "speed": s.speed,
            "margin": s.margin,
            "seed": s.seed,
            "requests": self.n,
            "on_time_utility": self.on_time_utility,
            "slo_attainment": self.slo_attainment,
            "mean_utility": self.mean_utility,
            "mean_ttft_s": self.mean_ttft_s,
            "p90_ttft_s": self.p90_ttft_s,
            "composition": self.composition,
            "ttft_mape": self.ttft_mape,
            "ttft_mape_n": self.ttft_mape_n,
            "batches": self.batches,
            "decide_us": self.decide_us,
            "wall_s": self.wall_s,
            **extra,
            **({"tpot": self.tpot} if self.tpot else {}),
            **({"diagnosis": self.diagnosis} if self.diagnosis else {}),
            **({"ttft_floor": self.ttft_floor} if self.ttft_floor else {}),
            **({"speed": self.speed} if self.speed else {}),
            **({"timeline": list(self.timeline)} if self.timeline else {}),
        }


def arrival_times(
    kind: str, n: int, rate: float, seed: int, trace_times: npt.NDArray[np.float64] | None = None
) -> npt.NDArray[np.float64]:
    """Arrival times of a scenario (``kind`` as :attr:`Scenario.arrivals`).

    Raises:
        ValueError: Unknown kind, or ``"trace"`` without trace times.
    """
    from bearsdk.workload import arrivals

    if kind == "poisson":
        return arrivals(n, rate, seed=seed + 2)
    if kind.startswith("mmpp2:"):
        try:
            ratio = float(kind.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"arrivals: {kind!r} must be mmpp2:RATIO") from None
        return arrivals(n, rate, process="mmpp2", ratio=ratio, seed=seed + 2)
    if kind == "trace":
        if trace_times is None or len(trace_times) < n:
            raise ValueError("arrivals: 'trace' needs the trace's times for every request")
        t = trace_times[:n]
        span = float(t[-1] - t[0])
        scale = (n - 1) / span / rate if span > 0 and n > 1 else 1.0
        scaled: npt.NDArray[np.float64] = (t - t[0]) * scale
        return scaled
    raise ValueError(f"arrivals must be poisson, mmpp2:RATIO or trace (got {kind!r})")


def router_params(scheduler: str, eng_policy: Policy) -> dict[str, Any]:
    """The engine's effective flags, as the router's pool configuration states them."""
    from bearsdk.schedulers import get_scheduler

    names = set(get_scheduler(scheduler).params)
    return {k: v for k, v in eng_policy.params if k in names}


def staleness_label(policy: StalenessRules) -> str:
    """``"default"``, ``"paper"``, or the fields that differ from the default."""
    if policy == StalenessRules():
        return "default"
    if policy == StalenessRules.paper():
        return "paper"
    base = attrs.asdict(StalenessRules())
    diff = {k: v for k, v in attrs.asdict(policy).items() if base[k] != v}
    return ",".join(f"{k}={v}" for k, v in diff.items())

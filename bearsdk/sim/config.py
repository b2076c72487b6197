"""``bearsdk simulate`` configuration files (TOML), decoded strictly.

::

    [simulation]
    requests = 4000                 # per run
    seeds = [1]                     # each seed: its own workload, noise and arrivals

    [router]
    staleness = "default"           # default (overlay, fast-forward, LPS fallback) | paper
                                    # | a table of StalenessRules fields over the default
    batch_time = "profile"          # profile (each instance's eq. 12 profile) | calibrated
                                    # (fitted to the simulated instance's batches first)
                                    # | online (refitted as the engines report their
                                    # batches, as AsyncRouter follows /bear/batches)
    predictor = "default"           # default | alpaca-eval | path/to/predictor.bearpred
    resident_lengths = "predicted"  # predicted | calibrated (quantiles of completed lengths)
    speed = "learned"               # learned (each instance's speed, from its snapshots)
                                    # | profile (the coefficients as they are)
    margin = "off"                  # off (the point estimates, the router's default) |
                                    # learned (widen each instance's TTFT estimates by
                                    # its first tokens' spread: bearsdk.router.margin)

    [[pool]]                        # one table per instance
    name = "qwen3-8b"
    model = "Qwen/Qwen3-8B"         # the predictor's model name (accuracy, prices)
    engine = "qwen3-8b-h100"        # emulator profile: the ground truth
    profile = "qwen3-8b-h100"       # the router's eq. 12 profile (default: engine)
    scheduler = "vllm-v1"             # a registered name, or a spec file (relative: to here)
    params = {}                     # engine flags (default: vllm serve's on that hardware)
    ground_truth = {}               # GroundTruthParams overrides (noise_sigma, ...)
    speed_changes = []              # [[time_s, multiplier], ...]: from time_s on, every
                                    # batch takes multiplier x its ground-truth time
    time_scale_range = [0.5, 2.0]   # optional: each seed draws this engine's time scale
                                    # log-uniformly in it (the same for every policy)
    snapshots = "push"              # a registered snapshot source with a simulated form
                                    # (push, poll, shm, redis deliver the engine's own)

    [workload]
    prompts = "tasks"               # tasks (Table 2 generator) | alpaca-eval (real data)
    unique_prompts = 2000           # distinct prompts the requests draw from
    mix = {alpaca = 1, govreport = 1, hotpotqa = 1, writingprompts = 1}
    lengths = "engine"              # engine (emulator model) | data (alpaca-eval) | trace
    prompt_tokens = "prompt"        # prompt | trace
    trace = "azure-conv"            # azure-conv | azure-code | a CSV path
    trace_start = 0                 # first trace row used
    targets = "paper"               # appendix A.2 rule, or a fixed number of seconds
    tpot_targets = "none"           # none | tasks (bearsdk.workload.TPOT_TARGETS_S) | seconds:
                                    # a request is on time only if it meets both targets
    data_dir = ""                   # data folder (default: $BEARSDK_DATA, see docs/data.md)

    [policies]                      # built-in selectors, their parameters; lists make variants
    bear = {}
    score = {latency_weight = [0.1, 1.0]}
    oracle = {}

    [[sweep]]                       # each sweep: the cartesian product of its axes
    name = "rates"
    rates = [2, 4, 6, 8]
    arrivals = ["poisson"]          # poisson | mmpp2:R | trace
    lam = [5e-4]
    delta = [1.0]                   # the lagrangian policy's
    staleness_ms = [0]
    admission = ["best-effort"]     # best-effort | reject | queue: what the router does with
                                    # a request no instance is predicted to serve on time
                                    # (the gateway's [admission] modes; oracles ignore it)
    queue_size = 1024               # admission = "queue": most requests held at once
    max_wait_ms = 0                 # longest a request is held (0: its TTFT target)
    policies = ["bear", "score"]    # default: every policy
    figures = [1, 8]                # default: inferred from the axes

Unknown keys are errors naming the section and the key.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from bearsdk.errors import BearError
from bearsdk.gateway.config import ADMISSION_MODES
from bearsdk.sim.scenario import (
    BATCH_TIME_MODES,
    MARGIN_MODES,
    ORACLE,
    ORACLE_LATENCY,
    SPEED_MODES,
    InstanceSpec,
    PolicySpec,
    Scenario,
)
from bearsdk.state import StalenessRules

__all__ = [
    "BASELINES",
    "PAPER_POOL",
    "POLICIES",
    "SimConfig",
    "SimConfigError",
    "SweepSpec",
    "WorkloadSpec",
    "load_config",
    "parse_config",
]

BASELINES: Final = (
    "latency-agnostic",
    "round-robin",
    "shortest-queue",
    "lmdeploy-proxy",
    "semantic-router",
    "score",
    "routebalance",
)
"""The paper's baselines (section 5.1): what BEAR's gain is measured against."""
FIGURES: Final = (1, 4, 8, 9, 10, 14, 16, 17, 18)
POLICIES: Final = (
    "bear",
    "lagrangian",
    "prefill-tps",
    *BASELINES,
)
"""The ten built-in policies: BEAR, its relaxation and ablation, the baselines."""
PAPER_POOL: Final = (
    InstanceSpec("qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3-0.6b-h100"),
    InstanceSpec("qwen3-8b", "Qwen/Qwen3-8B", "qwen3-8b-h100"),
    InstanceSpec("qwen3-32b", "Qwen/Qwen3-32B", "qwen3-32b-2xh100"),
)
"""The paper's pool: Qwen3-0.6B and 8B on one H100 each, 32B on two (TP 2)."""


class SimConfigError(BearError, ValueError):
    """A simulation configuration is invalid; the message names the section and key."""


@attrs.frozen
class WorkloadSpec:
    """The ``[workload]`` section (see the module docstring)."""

    prompts: str = "tasks"
    unique_prompts: int = 2000
    mix: tuple[tuple[str, float], ...] = ()
    lengths: str = "engine"
    prompt_tokens: str = "prompt"
    trace: str = "azure-conv"
    trace_start: int = 0
    targets: str | float = "paper"
    tpot_targets: str | float = "none"
    data_dir: str = ""


@attrs.frozen
class SweepSpec:
    """One ``[[sweep]]`` table."""

    name: str
    rates: tuple[float, ...]
    arrivals: tuple[str, ...] = ("poisson",)
    lam: tuple[float, ...] = (5e-4,)
    delta: tuple[float, ...] = (1.0,)
    staleness_ms: tuple[float, ...] = (0.0,)
    admission: tuple[str, ...] = ("best-effort",)
    queue_size: int = 1024
    max_wait_ms: float = 0.0
    policies: tuple[str, ...] = ()
    figures: tuple[int, ...] = ()

    @property
    def admission_axis(self) -> bool:
        """Its runs report admission: it varies the mode, or sets one other than the default."""
        return self.admission != ("best-effort",)

    def inferred_figures(self) -> tuple[int, ...]:
        """The paper's figures this sweep feeds (explicit, else from its axes)."""
        if self.figures:
            return self.figures
        figs: list[int] = []
        steady = "poisson" in self.arrivals or "trace" in self.arrivals
        # A sweep over another axis plots that axis, whatever its rates. Admission
        # modes have no figure: their table is the summary's (a rate figure would
        # draw the modes of a policy as one line).
        other = (
            len(self.delta) > 1
            or len(self.staleness_ms) > 1
            or len(self.lam) > 1
            or len(self.admission) > 1
        )
        if len(self.rates) > 1 and steady and not other:
            figs += [1, 4, 8, 16, 18]
        if len(self.delta) > 1:
            figs.append(9)
        if any(a.startswith("mmpp2:") for a in self.arrivals):
            figs.append(10)
        if len(self.staleness_ms) > 1:
            figs.append(14)
        if len(self.lam) > 1:
            figs.append(17)
        if not figs and len(self.rates) > 1 and not other:
            figs.append(8)
        return tuple(figs)


@attrs.frozen
class SimConfig:
    """A whole simulation configuration.

    Attributes:
        name: Its name (reports).
        requests: Requests per run.
        seeds: Seeds; every run repeats for each.
        router_staleness: The router's staleness handling.
        batch_time: ``"profile"``, ``"calibrated"`` or ``"online"`` (the
            router's eq. 12: see :data:`BATCH_TIME_MODES`).
        resident_lengths: The router's ``resident_lengths``.
        speed: ``"learned"`` (the router learns each instance's speed from its
            snapshots) or ``"profile"`` (it replays with the coefficients as
            they are).
        margin: ``"off"`` (the router's default) or ``"learned"`` (the
            router widens each instance's TTFT estimates by its first tokens'
            spread).
        predictor: ``"default"``, ``"alpaca-eval"`` or a predictor file.
        pool: The instances.
        workload: The workload.
        policies: Policy variants (a list of parameter values makes one per value).
        sweeps: The sweeps.
        source: The file it came from (relative paths resolve against its folder).
    """

    name: str
    requests: int
    seeds: tuple[int, ...]
    router_staleness: StalenessRules
    batch_time: str
    resident_lengths: str
    predictor: str
    pool: tuple[InstanceSpec, ...]
    workload: WorkloadSpec
    policies: tuple[PolicySpec, ...]
    sweeps: tuple[SweepSpec, ...]
    source: str = ""
    speed: str = "learned"
    margin: str = "off"

    def base_dir(self) -> Path:
        """Folder that relative paths in the configuration are relative to."""
        return Path(self.source).resolve().parent if self.source else Path.cwd()

    def scenarios(self) -> list[Scenario]:
        """Every run of every sweep, in a stable order."""
        out: list[Scenario] = []
        for sw in self.sweeps:
            wanted = set(sw.policies) if sw.policies else None
            pols = [p for p in self.policies if wanted is None or p.name in wanted]
            for seed, rate, arr, lam, st, adm, pol in itertools.product(
                self.seeds, sw.rates, sw.arrivals, sw.lam, sw.staleness_ms, sw.admission, pols
            ):
                deltas: Sequence[float | None] = sw.delta if pol.name == "lagrangian" else [None]
                for d in deltas:
                    out.append(
                        Scenario(
                            policy=pol,
                            rate=rate,
                            arrivals=arr,
                            lam=lam,
                            delta=d,
                            staleness_s=st / 1000.0,
                            seed=seed,
                            sweep=sw.name,
                            router_staleness=self.router_staleness,
                            resident_lengths=self.resident_lengths,
                            speed=self.speed,
                            margin=self.margin,
                            online_batch_time=self.batch_time == "online",
                            admission=adm,
                            queue_size=sw.queue_size,
                            max_wait_ms=sw.max_wait_ms,
                        )
                    )
        return out


def _where(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _check_keys(section: str, d: Mapping[str, Any], known: Sequence[str]) -> None:
    if not isinstance(d, Mapping):
        raise SimConfigError(f"{section} must be a table (got {d!r})")
    for k in d:
        if k not in known:
            raise SimConfigError(
                f"{_where(section, k)} is not a known key (known: {', '.join(known)})"
            )


def _str(section: str, d: Mapping[str, Any], key: str, default: str) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise SimConfigError(f"{_where(section, key)} must be a string (got {v!r})")
    return v


def _int(section: str, d: Mapping[str, Any], key: str, default: int, lo: int = 0) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SimConfigError(f"{_where(section, key)} must be an integer >= {lo} (got {v!r})")
    return v


def _number(section: str, key: str, v: object, lo: float, strict: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise SimConfigError(f"{_where(section, key)} must be a finite number (got {v!r})")
    if v < lo or (strict and v == lo):
        op = ">" if strict else ">="
        raise SimConfigError(f"{_where(section, key)} must be {op} {lo:g} (got {v!r})")
    return float(v)


def _numbers(
    section: str, d: Mapping[str, Any], key: str, default: Sequence[float], lo: float, strict: bool
) -> tuple[float, ...]:
    v = d.get(key, list(default))
    if not isinstance(v, list):
        v = [v]
    if not v:
        raise SimConfigError(f"{_where(section, key)} must not be empty")
    return tuple(_number(section, key, x, lo, strict) for x in v)


def _scheduler(sec: str, value: str, base: Path) -> str:
    """A pool entry's scheduler: a registered name, or a spec file registered here.

    A relative file is relative to the configuration's folder. Worker processes get
    the spec from the parent (see ``bearsdk.sim.sweep``).
    """
    if not (value.endswith(".toml") or "/" in value or "\\" in value):
        return value
    from bearsdk.schedulers import register_scheduler

    path = Path(value)
    try:
        return register_scheduler(path if path.is_absolute() else base / path, replace=True).name
    except OSError as exc:
        raise SimConfigError(f"{sec}.scheduler {value!r} cannot be read ({exc.strerror})") from None
    except (BearError, ValueError) as exc:
        raise SimConfigError(f"{sec}.scheduler {value!r}: {exc}") from None


def _pool(raw: object, base: Path) -> tuple[InstanceSpec, ...]:
    from bearsdk.emulator import profile_names

    if not isinstance(raw, list) or not raw:
        raise SimConfigError("pool must be a non-empty array of tables ([[pool]])")
    known = (
        "name",
        "model",
        "engine",
        "profile",
        "batch_time",
        "scheduler",
        "params",
        "ground_truth",
        "snapshots",
        "speed_changes",
        "time_scale_range",
    )
    out: list[InstanceSpec] = []
    for i, d in enumerate(raw):
        sec = f"pool[{i}]"
        _check_keys(sec, d, known)
        for key in ("name", "model", "engine"):
            if key not in d:
                raise SimConfigError(f"{sec}.{key} is required")
        name = _str(sec, d, "name", "")
        sec = f"pool[{name!r}]"
        engine = _str(sec, d, "engine", "")
        if engine not in profile_names():
            raise SimConfigError(
                f"{sec}.engine: unknown emulator profile {engine!r} "
                f"(known: {', '.join(profile_names())})"
            )
        bt = d.get("batch_time")
        if bt is not None:
            if not isinstance(bt, list) or len(bt) not in (4, 5):
                raise SimConfigError(f"{sec}.batch_time must be [b0, b1, b2, b3] (got {bt!r})")
            bt = tuple(_number(sec, "batch_time", x, 0.0) for x in bt)
        params = d.get("params", {})
        gt = d.get("ground_truth", {})
        for key, v in (("params", params), ("ground_truth", gt)):
            if not isinstance(v, Mapping):
                raise SimConfigError(f"{sec}.{key} must be a table (got {v!r})")
        from bearsdk.emulator import GroundTruthParams

        gt_known = [f.name for f in attrs.fields(GroundTruthParams)]
        _check_keys(f"{sec}.ground_truth", gt, gt_known)
        spec = InstanceSpec(
            name=name,
            model=_str(sec, d, "model", ""),
            engine=engine,
            profile=d.get("profile"),
            batch_time=bt,
            scheduler=_scheduler(sec, _str(sec, d, "scheduler", "vllm-v1"), base),
            params=tuple(sorted(params.items())),
            ground_truth=tuple(sorted(gt.items())),
            snapshots=_snapshots(sec, _str(sec, d, "snapshots", "push")),
            speed_changes=_speed_changes(sec, d.get("speed_changes", [])),
            time_scale_range=_time_scale_range(sec, d.get("time_scale_range")),
        )
        try:
            spec.time_params()
        except (TypeError, ValueError) as exc:
            raise SimConfigError(f"{sec}.ground_truth: {exc}") from None
        if spec.profile is not None and not isinstance(spec.profile, str):
            raise SimConfigError(f"{sec}.profile must be a string (got {spec.profile!r})")
        if bt is None:
            from bearsdk.estimators.profiles import profile_names as batch_profiles

            prof = spec.profile or engine
            if prof not in batch_profiles():
                raise SimConfigError(
                    f"{sec}.profile: no eq. 12 profile {prof!r} (known: "
                    f"{', '.join(batch_profiles())}; or give batch_time = [b0, b1, b2, b3])"
                )
        if any(s.name == name for s in out):
            raise SimConfigError(f"{sec}: duplicate instance name")
        out.append(spec)
    return tuple(out)


def _time_scale_range(sec: str, raw: object) -> tuple[float, float] | None:
    key = f"{sec}.time_scale_range"
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == 2):
        raise SimConfigError(f"{key} must be [low, high] (got {raw!r})")
    lo = _number(key, "low", raw[0], 0.0, strict=True)
    hi = _number(key, "high", raw[1], 0.0, strict=True)
    if not lo <= hi <= 100.0:
        raise SimConfigError(f"{key} must have low <= high <= 100 (got {raw!r})")
    return (lo, hi)


def _speed_changes(sec: str, raw: object) -> tuple[tuple[float, float], ...]:
    key = f"{sec}.speed_changes"
    if not isinstance(raw, list):
        raise SimConfigError(f"{key} must be an array of [time_s, multiplier] (got {raw!r})")
    out: list[tuple[float, float]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            raise SimConfigError(f"{key}: each change must be [time_s, multiplier] (got {item!r})")
        t = _number(key, "time_s", item[0], 0.0)
        m = _number(key, "multiplier", item[1], 0.0, strict=True)
        if m > 100.0:
            raise SimConfigError(f"{key}: multiplier must be <= 100 (got {m})")
        if out and t <= out[-1][0]:
            raise SimConfigError(f"{key}: times must increase (got {t} after {out[-1][0]})")
        out.append((t, m))
    return tuple(out)


def _workload(d: Mapping[str, Any]) -> WorkloadSpec:
    from bearsdk.sim.inputs import LENGTH_SOURCES
    from bearsdk.workload import TASKS

    known = [f.name for f in attrs.fields(WorkloadSpec)]
    _check_keys("workload", d, known)
    prompts = _str("workload", d, "prompts", "tasks")
    if prompts not in ("tasks", "alpaca-eval"):
        raise SimConfigError(f"workload.prompts must be 'tasks' or 'alpaca-eval' (got {prompts!r})")
    mix = d.get("mix", {})
    _check_keys("workload.mix", mix, list(TASKS))
    for k, v in mix.items():
        _number("workload.mix", k, v, 0.0)
    lengths = _str("workload", d, "lengths", "engine")
    if lengths not in LENGTH_SOURCES:
        raise SimConfigError(
            f"workload.lengths must be one of {', '.join(LENGTH_SOURCES)} (got {lengths!r})"
        )
    ptok = _str("workload", d, "prompt_tokens", "prompt")
    if ptok not in ("prompt", "trace"):
        raise SimConfigError(f"workload.prompt_tokens must be 'prompt' or 'trace' (got {ptok!r})")
    targets = d.get("targets", "paper")
    if targets != "paper":
        targets = _number("workload", "targets", targets, 0.0, strict=True)
    tpot = d.get("tpot_targets", "none")
    if tpot not in ("none", "tasks"):
        if isinstance(tpot, str):
            raise SimConfigError(
                f"workload.tpot_targets must be 'none', 'tasks' or a number of seconds "
                f"(got {tpot!r})"
            )
        tpot = _number("workload", "tpot_targets", tpot, 0.0, strict=True)
    return WorkloadSpec(
        prompts=prompts,
        unique_prompts=_int("workload", d, "unique_prompts", 2000, 1),
        mix=tuple(sorted((k, float(v)) for k, v in mix.items())),
        lengths=lengths,
        prompt_tokens=ptok,
        trace=_str("workload", d, "trace", "azure-conv"),
        trace_start=_int("workload", d, "trace_start", 0),
        targets=targets,
        tpot_targets=tpot,
        data_dir=_str("workload", d, "data_dir", ""),
    )


def _policies(d: Mapping[str, Any]) -> tuple[PolicySpec, ...]:
    from bearsdk.selectors import SELECTORS, SelectorError, make_selector

    if not isinstance(d, Mapping) or not d:
        raise SimConfigError("policies must be a non-empty table of policy = {params}")
    out: list[PolicySpec] = []
    for name, params in d.items():
        sec = f"policies.{name}"
        if name not in SELECTORS and name not in (ORACLE, ORACLE_LATENCY):
            raise SimConfigError(
                f"{sec}: unknown policy (known: {', '.join([*SELECTORS, ORACLE, ORACLE_LATENCY])})"
            )
        if not isinstance(params, Mapping):
            raise SimConfigError(f"{sec} must be a table of parameters (got {params!r})")
        for k in ("lam", "delta"):
            if k in params:
                raise SimConfigError(f"{sec}.{k}: set it in the sweep (lam = [...], delta = [...])")
        keys = sorted(params)
        values = [v if isinstance(v, list) else [v] for v in (params[k] for k in keys)]
        for combo in itertools.product(*values):
            p = tuple(zip(keys, combo, strict=True))
            if name in SELECTORS:
                try:
                    make_selector(name, **dict(p))
                except SelectorError as exc:
                    raise SimConfigError(f"{sec}: {exc}") from None
            elif p:
                raise SimConfigError(f"{sec}: the oracle takes no parameters")
            out.append(PolicySpec(name, p))
    return tuple(out)


def _sweeps(raw: object, policies: Sequence[PolicySpec]) -> tuple[SweepSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise SimConfigError("sweep must be a non-empty array of tables ([[sweep]])")
    known = [f.name for f in attrs.fields(SweepSpec)]
    names = {p.name for p in policies}
    out: list[SweepSpec] = []
    for i, d in enumerate(raw):
        sec = f"sweep[{i}]"
        _check_keys(sec, d, known)
        name = _str(sec, d, "name", f"sweep{i}")
        sec = f"sweep[{name!r}]"
        if "rates" not in d:
            raise SimConfigError(f"{sec}.rates is required")
        arrivals = d.get("arrivals", ["poisson"])
        if not isinstance(arrivals, list) or not arrivals:
            raise SimConfigError(f"{sec}.arrivals must be a non-empty list (got {arrivals!r})")
        for a in arrivals:
            ok = a in ("poisson", "trace")
            if isinstance(a, str) and a.startswith("mmpp2:"):
                try:
                    ok = float(a.split(":", 1)[1]) >= 1.0
                except ValueError:
                    ok = False
            if not ok:
                raise SimConfigError(
                    f"{sec}.arrivals: {a!r} must be poisson, trace or mmpp2:R with R >= 1"
                )
        pols = d.get("policies", [])
        if not isinstance(pols, list) or any(p not in names for p in pols):
            raise SimConfigError(
                f"{sec}.policies must list configured policies ({', '.join(sorted(names))}) "
                f"(got {pols!r})"
            )
        admission = d.get("admission", ["best-effort"])
        if not isinstance(admission, list) or not admission:
            raise SimConfigError(f"{sec}.admission must be a non-empty list (got {admission!r})")
        for a in admission:
            if a not in ADMISSION_MODES:
                raise SimConfigError(
                    f"{sec}.admission: {a!r} must be one of {', '.join(ADMISSION_MODES)}"
                )
        if len(set(admission)) != len(admission):
            raise SimConfigError(f"{sec}.admission lists a mode twice (got {admission!r})")
        figs = d.get("figures", [])
        if not isinstance(figs, list) or any(f not in FIGURES for f in figs):
            raise SimConfigError(
                f"{sec}.figures must list figures of {', '.join(map(str, FIGURES))} (got {figs!r})"
            )
        out.append(
            SweepSpec(
                name=name,
                rates=_numbers(sec, d, "rates", (), 0.0, True),
                arrivals=tuple(arrivals),
                lam=_numbers(sec, d, "lam", (5e-4,), 0.0, False),
                delta=_numbers(sec, d, "delta", (1.0,), 0.0, False),
                staleness_ms=_numbers(sec, d, "staleness_ms", (0.0,), 0.0, False),
                admission=tuple(admission),
                queue_size=_int(sec, d, "queue_size", 1024, 1),
                max_wait_ms=_number(sec, "max_wait_ms", d.get("max_wait_ms", 0.0), 0.0),
                policies=tuple(pols),
                figures=tuple(figs),
            )
        )
    if len({s.name for s in out}) != len(out):
        raise SimConfigError("sweep: names must be unique")
    return tuple(out)


def _snapshots(sec: str, kind: str) -> str:
    """A registered snapshot source kind with a simulated form."""
    from bearsdk.router.sources import SourceError, get_snapshot_source

    try:
        simulated = get_snapshot_source(kind).simulated
    except SourceError as exc:
        raise SimConfigError(f"{sec}.{exc}") from None
    if simulated is None:
        raise SimConfigError(
            f"{sec}.snapshots: source {kind!r} has no simulated form "
            "(register it with register_snapshot_source(..., simulated=...))"
        )
    return kind


def _staleness(v: object) -> StalenessRules:
    if v == "default":
        return StalenessRules()
    if v == "paper":
        return StalenessRules.paper()
    if not isinstance(v, Mapping):
        raise SimConfigError(
            f"router.staleness must be 'default', 'paper' or a table of fields (got {v!r})"
        )
    known = [f.name for f in attrs.fields(StalenessRules)]
    _check_keys("router.staleness", v, known)
    try:
        return StalenessRules(**dict(v))
    except (TypeError, ValueError) as exc:
        raise SimConfigError(f"router.staleness: {exc}") from None


def parse_config(doc: Mapping[str, Any], source: str = "") -> SimConfig:
    """Decode a parsed configuration document (see the module docstring).

    Raises:
        SimConfigError: A missing, unknown or invalid key.
    """
    _check_keys("", doc, ("simulation", "router", "pool", "workload", "policies", "sweep"))
    sim = doc.get("simulation", {})
    _check_keys("simulation", sim, ("name", "requests", "seeds"))
    seeds = sim.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
    ):
        raise SimConfigError(f"simulation.seeds must be a list of integers >= 0 (got {seeds!r})")
    router = doc.get("router", {})
    _check_keys(
        "router",
        router,
        ("staleness", "batch_time", "predictor", "resident_lengths", "speed", "margin"),
    )
    staleness = _staleness(router.get("staleness", "default"))
    batch_time = _str("router", router, "batch_time", "profile")
    if batch_time not in BATCH_TIME_MODES:
        raise SimConfigError(
            f"router.batch_time must be one of {', '.join(map(repr, BATCH_TIME_MODES))} "
            f"(got {batch_time!r})"
        )
    lengths = _str("router", router, "resident_lengths", "predicted")
    if lengths not in ("predicted", "calibrated"):
        raise SimConfigError(
            f"router.resident_lengths must be 'predicted' or 'calibrated' (got {lengths!r})"
        )
    speed = _str("router", router, "speed", "learned")
    if speed not in SPEED_MODES:
        raise SimConfigError(f"router.speed must be 'learned' or 'profile' (got {speed!r})")
    margin = _str("router", router, "margin", "off")
    if margin not in MARGIN_MODES:
        raise SimConfigError(f"router.margin must be 'learned' or 'off' (got {margin!r})")
    policies = _policies(doc.get("policies", {}))
    cfg = SimConfig(
        name=_str("simulation", sim, "name", Path(source).stem if source else "simulation"),
        requests=_int("simulation", sim, "requests", 4000, 1),
        seeds=tuple(seeds),
        router_staleness=staleness,
        batch_time=batch_time,
        resident_lengths=lengths,
        predictor=_str("router", router, "predictor", "default"),
        pool=_pool(doc.get("pool"), Path(source).resolve().parent if source else Path.cwd()),
        workload=_workload(doc.get("workload", {})),
        policies=policies,
        sweeps=_sweeps(doc.get("sweep"), policies),
        source=source,
        speed=speed,
        margin=margin,
    )
    return cfg


def load_config(path: str | Path) -> SimConfig:
    """Read and decode a configuration file.

    Raises:
        SimConfigError: Unreadable, not TOML, or invalid.
    """
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimConfigError(f"{p}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1]
        raise SimConfigError(f"{p}: not UTF-8 text (byte {exc.start} is {bad!r})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SimConfigError(f"{p}: not valid TOML ({exc})") from None
    return parse_config(doc, str(p))

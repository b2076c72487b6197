"""Running a configuration: inputs once per seed, every run in parallel, a summary.

Inputs (the workload's requests with their truth and predictions) are built once
per seed in the calling process; the runs are spread over worker processes.
Each run depends on its scenario and its seed's inputs alone, so results are
the same whatever the number of workers. Runs that differ only in settings a
policy ignores (the oracle and staleness or admission, policies other than the
Lagrangian and ``delta``, admission modes other than ``queue`` and the queue's
settings, a sweep's name) are run once.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.errors import BearError
from bearsdk.predictors import Predictor
from bearsdk.sim.calibrate import Calibration, calibrate_pool
from bearsdk.sim.config import BASELINES, SimConfig
from bearsdk.sim.run import run_scenario
from bearsdk.sim.scenario import (
    ORACLE,
    ORACLE_LATENCY,
    InstanceSpec,
    RequestSet,
    RunResult,
    Scenario,
    arrival_times,
)
from bearsdk.state import StalenessRules

__all__ = [
    "Inputs",
    "Progress",
    "SimInterrupted",
    "SimReport",
    "format_summary",
    "load_predictor",
    "prepare_inputs",
    "run_config",
    "summarize",
]

_ORACLES: Final = (ORACLE, ORACLE_LATENCY)


@attrs.frozen(eq=False)
class Inputs:
    """What every run of one seed shares.

    Attributes:
        seed: The seed.
        requests: Truth and predictions per request.
        trace_times: The trace window's arrival times, when the workload has a trace.
        build_s: Time it took to build them.
    """

    seed: int
    requests: RequestSet
    trace_times: npt.NDArray[np.float64] | None
    build_s: float


@attrs.frozen
class SimReport:
    """A configuration's results.

    Attributes:
        config: The configuration.
        results: One per scenario, in :meth:`SimConfig.scenarios` order.
        prepare_s: Time spent building inputs.
        wall_s: Total wall time.
        workers: Worker processes used.
        calibrations: The router's eq. 12 fits (``batch_time = "calibrated"``).
    """

    config: SimConfig
    results: tuple[RunResult, ...]
    prepare_s: float
    wall_s: float
    workers: int
    calibrations: tuple[Calibration, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"results": [...], "summary": {...}, ...}``.

        Runs of a sweep with an admission axis carry the admission fields
        (:meth:`RunResult.as_dict`); other runs only when their mode is not ``best-effort``.
        """
        axis = {sw.name for sw in self.config.sweeps if sw.admission_axis}
        return {
            "config": self.config.name,
            "requests_per_run": self.config.requests,
            "pool": [s.name for s in self.config.pool],
            "batch_time": self.config.batch_time,
            "calibrations": [
                {
                    "instance": c.instance,
                    "batches": c.batches,
                    "coefficients": list(c.model.extended_coeffs),
                    "fit_mape": c.fit_mape,
                    "profile_mape": c.profile_mape,
                    "profile_bias": c.profile_bias,
                }
                for c in self.calibrations
            ],
            "results": [r.as_dict(admission=r.scenario.sweep in axis) for r in self.results],
            "summary": summarize(self.results),
            "prepare_s": self.prepare_s,
            "wall_s": self.wall_s,
            "workers": self.workers,
        }


# -- inputs ---------------------------------------------------------------------------


def _data_dir(cfg: SimConfig, dataset: str) -> Path:
    """The folder holding ``dataset``: ``workload.data_dir``, else as :mod:`bearsdk.data` finds it.

    Raises:
        DataNotFoundError: Not there (the message names the data set's public source).
    """
    from bearsdk.data import data_dir

    d = cfg.workload.data_dir
    p = Path(d) if d else None
    if p is not None and not p.is_absolute():
        p = cfg.base_dir() / p
    return data_dir(p, dataset)


def _alpaca_split(n: int = 805) -> tuple[list[int], list[int]]:
    """AlpacaEval prompts the predictor trains on (even ids) and the runs route (odd ids)."""
    ids = list(range(n))
    return ids[0::2], ids[1::2]


def load_predictor(cfg: SimConfig) -> Predictor:
    """The router's predictor as the configuration names it.

    ``"alpaca-eval"`` trains one in place on the AlpacaEval prompts with even
    ids, for the pool's models; runs then route the odd ones (held out).
    """
    kind = cfg.predictor
    if kind == "default":
        return Predictor.load_default()
    if kind == "alpaca-eval":
        from bearsdk.predictors.dataset import read_alpaca_eval
        from bearsdk.predictors.pool import POOLS, ModelSpec
        from bearsdk.predictors.training import TrainConfig, train_predictor

        data = _data_dir(cfg, "alpaca-eval")
        known = {m.name: m for pool in POOLS.values() for m in pool}
        models: list[str] = []
        for s in cfg.pool:
            if s.model not in models:
                models.append(s.model)
        pool = tuple(known.get(m, ModelSpec(m)) for m in models)
        ts = read_alpaca_eval(data / "alpaca_eval", pool)
        train, _ = _alpaca_split(len(ts.prompts))
        return train_predictor(ts.select_prompts(train), TrainConfig(quantiles=()))
    path = Path(kind)
    if not path.is_absolute():
        path = cfg.base_dir() / path
    return Predictor.load(path)


def prepare_inputs(cfg: SimConfig, seed: int, predictor: Predictor) -> Inputs:
    """Build one seed's requests: prompts, lengths, targets, truth and predictions."""
    from bearsdk.router.targets import FixedTarget, PaperTargets, TargetRule
    from bearsdk.sim.inputs import build_requests
    from bearsdk.workload import alpaca_prompts, read_trace, requests_at, task_prompts

    t0 = time.perf_counter()
    w = cfg.workload
    n = cfg.requests
    if w.prompts == "tasks":
        mix = dict(w.mix) or None
        bank = task_prompts(min(w.unique_prompts, n), mix=mix, seed=seed)
    else:
        data = _data_dir(cfg, "alpaca-eval")
        models = list(dict.fromkeys(s.model for s in cfg.pool))
        ids = _alpaca_split()[1] if cfg.predictor == "alpaca-eval" else None
        bank = alpaca_prompts(data / "alpaca_eval", models, prompt_ids=ids)
        bank = bank[: w.unique_prompts]
    uses_trace = (
        w.prompt_tokens == "trace"
        or w.lengths == "trace"
        or any("trace" in sw.arrivals for sw in cfg.sweeps)
    )
    trace = None
    if uses_trace:
        from bearsdk.workload import TRACES

        where = _data_dir(cfg, "azure-llm-2023") if w.trace in TRACES else None
        trace = read_trace(w.trace, where).window(n, w.trace_start)
    rule: TargetRule = (
        PaperTargets(seed=seed + 3) if w.targets == "paper" else FixedTarget(float(w.targets))
    )
    lengths = None
    if trace is not None and w.prompt_tokens == "trace":
        lengths = trace.prompt_tokens
    items = requests_at(bank, np.zeros(n), seed=seed, targets=rule, prompt_tokens=lengths)
    rs = build_requests(
        items,
        cfg.pool,
        predictor,
        lengths=w.lengths,
        trace_outputs=trace.output_tokens if trace is not None else None,
    )
    if w.tpot_targets != "none":
        from bearsdk.workload import TPOT_TARGETS_S

        if w.tpot_targets == "tasks":
            # A dataset outside the four tasks (alpaca-eval's) reads as chat.
            tp = [TPOT_TARGETS_S.get(it.task, TPOT_TARGETS_S["alpaca"]) for it in items]
        else:
            tp = [float(w.tpot_targets)] * len(items)
        rs = attrs.evolve(rs, tpot_targets_s=np.array(tp, dtype=np.float64))
    return Inputs(seed, rs, None if trace is None else trace.times_s, time.perf_counter() - t0)


# -- running --------------------------------------------------------------------------

_SHARED: dict[str, Any] = {}


class SimInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_config`; carries the runs that had finished.

    Attributes:
        partial: The report of the finished scenarios (in scenario order; the others
            are left out).
        total: How many scenarios the configuration has.
    """

    def __init__(self, partial: SimReport, total: int) -> None:
        super().__init__()
        self.partial = partial
        self.total = total


def _init_worker(shared: dict[str, Any], quiet_sigint: bool = False) -> None:
    if quiet_sigint:
        # Ctrl-C reaches the whole process group: the parent ends the pool (SIGTERM),
        # a worker must neither die on its own nor print a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _SHARED.clear()
    _SHARED.update(shared)
    from bearsdk.schedulers import register_scheduler, scheduler_names

    # Plugins and specs registered in the parent: a forked worker has them already, a
    # spawned one gets them here.
    plugins = [m for m in os.environ.get("BEARSDK_PLUGINS", "").split(",") if m]
    for module in plugins:
        try:
            importlib.import_module(module)
        except Exception as exc:  # a user's module: one line, not a traceback
            raise BearError(
                f"BEARSDK_PLUGINS: cannot import {module!r} ({type(exc).__name__}: {exc})"
            ) from None
    for spec in shared.get("schedulers", ()):
        if spec.name not in scheduler_names():
            register_scheduler(spec)


def _run_one(task: tuple[int, Scenario]) -> tuple[int, RunResult]:
    idx, sc = task
    inputs: Inputs = _SHARED["inputs"][sc.seed]
    pool: Sequence[InstanceSpec] = _SHARED["pool"]
    n = len(inputs.requests)
    times = arrival_times(sc.arrivals, n, sc.rate, sc.seed, inputs.trace_times)
    return idx, run_scenario(
        inputs.requests,
        pool,
        sc,
        times,
        decode_runs=_SHARED["decode_runs"],
        diagnose=_SHARED.get("diagnose", False),
    )


def _canonical(sc: Scenario) -> Scenario:
    """The scenario with what its policy ignores normalised (dedupes runs)."""
    out = attrs.evolve(sc, sweep="")
    if sc.admission != "queue" or sc.policy.name in _ORACLES:
        out = attrs.evolve(out, queue_size=1024, max_wait_ms=0.0)
    if sc.policy.name in _ORACLES:
        out = attrs.evolve(
            out,
            staleness_s=0.0,
            router_staleness=StalenessRules.paper(),
            delta=None,
            admission="best-effort",
        )
    elif sc.policy.name != "lagrangian":
        out = attrs.evolve(out, delta=None)
    return out


@attrs.define
class Progress:
    """A progress bar on a stream (redrawn in place on a terminal, else a line per 10%).

    Args:
        total: Runs to do.
        stream: Where to draw (default: standard error).
        label: Prefix.
    """

    total: int
    stream: TextIO | None = None
    label: str = "simulate"
    _done: int = attrs.field(init=False, default=0)
    _t0: float = attrs.field(init=False, factory=time.perf_counter)
    _last_decile: int = attrs.field(init=False, default=-1)

    def advance(self, what: str = "") -> None:
        """One more run done."""
        self._done += 1
        out = self.stream if self.stream is not None else sys.stderr
        el = time.perf_counter() - self._t0
        frac = self._done / max(self.total, 1)
        eta = el / frac - el if frac > 0 else math.inf
        width = 30
        bar = "#" * round(width * frac) + "." * (width - round(width * frac))
        line = (
            f"{self.label} [{bar}] {self._done}/{self.total} runs, {el:5.1f} s, "
            f"ETA {eta:5.1f} s {what}"
        )
        if out.isatty():
            out.write("\r" + line[:120].ljust(120))
            if self._done >= self.total:
                out.write("\n")
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or self._done >= self.total:
                self._last_decile = decile
                out.write(line + "\n")
        out.flush()


def run_config(
    cfg: SimConfig,
    *,
    workers: int | None = None,
    progress: Callable[[int], Progress] | None = None,
    decode_runs: bool = True,
    predictor: Predictor | None = None,
    diagnose: bool = False,
) -> SimReport:
    """Run every scenario of a configuration.

    Args:
        cfg: The configuration.
        workers: Worker processes (default: one per CPU; 1 runs in this process).
        progress: Builds a progress bar for a number of runs (``None``: no bar).
        decode_runs: Let engines advance decode stretches in closed form.
        predictor: The router's predictor (default: as the configuration names it).
        diagnose: Score every candidate's TTFT estimate against its engine's
            true forecast, and the chosen one's forecast against the TTFT it
            gave (:attr:`RunResult.diagnosis`, :attr:`RunResult.ttft_floor`).

    Returns:
        The results, in scenario order.

    Raises:
        SimInterrupted: Ctrl-C; it holds the runs that had finished.
    """
    t0 = time.perf_counter()
    pred = predictor if predictor is not None else load_predictor(cfg)
    inputs = {seed: prepare_inputs(cfg, seed, pred) for seed in cfg.seeds}
    pool = cfg.pool
    cals: tuple[Calibration, ...] = ()
    if cfg.batch_time == "calibrated":
        first = inputs[cfg.seeds[0]]
        # Its own seed: calibration traffic shares nothing with the runs but the hardware.
        pool, cals = calibrate_pool(pool, first.requests, seed=first.seed + 7_000_001)
    prep = time.perf_counter() - t0
    scenarios = cfg.scenarios()
    unique: dict[Scenario, int] = {}
    order: list[Scenario] = []
    for sc in scenarios:
        key = _canonical(sc)
        if key not in unique:
            unique[key] = len(order)
            order.append(key)
    tasks = list(enumerate(order))
    from bearsdk.schedulers import get_scheduler

    schedulers = [get_scheduler(name) for name in sorted({s.scheduler for s in pool})]
    shared = {
        "inputs": inputs,
        "pool": pool,
        "decode_runs": decode_runs,
        "diagnose": diagnose,
        "schedulers": schedulers,
    }
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    bar = progress(len(tasks)) if progress is not None else None
    done: dict[int, RunResult] = {}

    def report() -> SimReport:
        results = []
        for sc in scenarios:
            r = done.get(unique[_canonical(sc)])
            if r is not None:
                results.append(attrs.evolve(r, scenario=sc))
        return SimReport(cfg, tuple(results), prep, time.perf_counter() - t0, n_workers, cals)

    try:
        if n_workers == 1:
            _init_worker(shared)
            for t in tasks:
                i, r = _run_one(t)
                done[i] = r
                if bar is not None:
                    bar.advance(r.scenario.policy.display)
        else:
            ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            # Workers start with Ctrl-C ignored (no window before their initializer runs);
            # leaving the block on Ctrl-C terminates them at once.
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            try:
                procs = ctx.Pool(n_workers, initializer=_init_worker, initargs=(shared, True))
            finally:
                if main:
                    signal.signal(signal.SIGINT, previous)
            with procs:
                for i, r in procs.imap_unordered(_run_one, tasks, chunksize=1):
                    done[i] = r
                    if bar is not None:
                        bar.advance(r.scenario.policy.display)
    except KeyboardInterrupt:
        raise SimInterrupted(report(), len(scenarios)) from None
    return report()


# -- summary --------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def summarize(results: Sequence[RunResult]) -> dict[str, Any]:
    """Gains, oracle fractions and staleness losses, averaged over seeds.

    * ``gain``: per sweep, arrival process, lambda and rate (zero staleness):
      BEAR's OnTimeUtility, the best baseline's (over :data:`BASELINES` and
      their variants), the gain in percent, the oracles' and BEAR's fraction of
      the oracle; ``mean_gain`` averages the per-rate gains of sweeps over
      several rates (the paper's +30.5% figure).
    * ``staleness``: per sweep with several delays, BEAR's OnTimeUtility per
      delay and its loss against zero delay, in percent.
    * ``admission`` (only with runs whose admission is not ``best-effort``):
      see :func:`_admission_rows`.

    Gains and staleness losses compare ``best-effort`` runs: the policies as
    they route, before admission control refuses anything.
    """
    table: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for r in results:
        s = r.scenario
        if s.admission != "best-effort":
            continue
        key = (s.sweep, s.arrivals, s.lam, s.staleness_s, s.rate)
        name = s.policy.name if s.policy.name != "lagrangian" else f"lagrangian:{s.delta}"
        cell = table.setdefault(key, {})
        cell.setdefault(s.policy.display, []).append(r.on_time_utility)
        cell.setdefault(f"@{name}", [])
    gains: list[dict[str, Any]] = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for key, cell in sorted(table.items(), key=lambda kv: (str(kv[0][:2]), kv[0][2:])):
        sweep, arr, lam, st, rate = key
        if st != 0.0 or "bear" not in cell:
            continue
        bear = _mean(cell["bear"])
        base = {
            label: _mean(v)
            for label, v in cell.items()
            if not label.startswith("@") and label.split("(")[0] in BASELINES
        }
        row: dict[str, Any] = {
            "sweep": sweep,
            "arrivals": arr,
            "lam": lam,
            "rate": rate,
            "bear": bear,
        }
        if base:
            best = max(base, key=lambda k: base[k])
            row["best_baseline"] = best
            row["best_baseline_otu"] = base[best]
            row["gain_pct"] = 100.0 * (bear / base[best] - 1.0) if base[best] > 0 else math.nan
            row["bear_ahead_of_all"] = all(bear > v for v in base.values())
        for o in _ORACLES:
            if o in cell:
                row[o] = _mean(cell[o])
                row[f"bear_fraction_of_{o}"] = bear / row[o] if row[o] > 0 else math.nan
        if "prefill-tps" in cell:
            row["prefill_tps"] = _mean(cell["prefill-tps"])
        gains.append(row)
        groups.setdefault((sweep, arr, lam), []).append(row)
    mean_gain = []
    for (sweep, arr, lam), rows in groups.items():
        g = [r["gain_pct"] for r in rows if "gain_pct" in r and math.isfinite(r["gain_pct"])]
        if len(g) < 2:
            continue  # an average over rates needs several
        fr = [r[f"bear_fraction_of_{ORACLE}"] for r in rows if f"bear_fraction_of_{ORACLE}" in r]
        mean_gain.append(
            {
                "sweep": sweep,
                "arrivals": arr,
                "lam": lam,
                "rates": [r["rate"] for r in rows],
                "mean_gain_pct": _mean(g),
                "min_gain_pct": min(g) if g else math.nan,
                "bear_ahead_everywhere": all(r.get("bear_ahead_of_all", False) for r in rows),
                "mean_fraction_of_oracle": _mean(fr),
            }
        )
    stale: list[dict[str, Any]] = []
    by_sweep: dict[tuple[Any, ...], dict[float, list[float]]] = {}
    for r in results:
        s = r.scenario
        if s.policy.name == "bear" and s.admission == "best-effort":
            by_sweep.setdefault((s.sweep, s.arrivals, s.lam, s.rate), {}).setdefault(
                s.staleness_s, []
            ).append(r.on_time_utility)
    for (sweep, arr, lam, rate), per in sorted(
        by_sweep.items(), key=lambda kv: (str(kv[0][:2]), kv[0][2:])
    ):
        if len(per) < 2 or 0.0 not in per:
            continue
        zero = _mean(per[0.0])
        stale.append(
            {
                "sweep": sweep,
                "arrivals": arr,
                "lam": lam,
                "rate": rate,
                "bear": {f"{d * 1000:g}": _mean(v) for d, v in sorted(per.items())},
                "loss_pct": {
                    f"{d * 1000:g}": 100.0 * (1.0 - _mean(v) / zero) if zero > 0 else math.nan
                    for d, v in sorted(per.items())
                },
            }
        )
    out: dict[str, Any] = {"gain": gains, "mean_gain": mean_gain, "staleness": stale}
    admission = _admission_rows(results)
    if admission:
        out["admission"] = admission
    return out


def _admission_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per sweep with an admission axis, arrival process, lambda, staleness, rate,
    policy and admission mode, averaged over seeds: ``on_time_utility``,
    ``slo_attainment``, ``goodput_rps``, ``goodput_vs_best_effort`` (its ratio to
    the same cell's ``best-effort`` goodput, when the sweep has one),
    ``rejected``, ``queued``, ``expired`` (per run), ``mean_ttft_s`` (served
    requests), and ``reject_decide_us_max`` / ``reject_decide_us_p99`` (the
    most over seeds: the slowest immediate 429 of any run; ``None`` without one).
    """
    sweeps = {r.scenario.sweep for r in results if r.scenario.admission != "best-effort"}
    cells: dict[tuple[Any, ...], list[RunResult]] = {}
    for r in results:
        s = r.scenario
        if s.sweep in sweeps:
            cell = (s.sweep, s.arrivals, s.lam, s.staleness_s, s.rate, s.policy.display)
            cells.setdefault((*cell, s.admission), []).append(r)
    rows: list[dict[str, Any]] = []
    for key, rs in cells.items():
        sweep, arr, lam, st, rate, pol, adm = key
        base = cells.get((*key[:-1], "best-effort"))
        good = _mean([r.goodput_rps for r in rs if r.goodput_rps is not None])
        ref = _mean([r.goodput_rps for r in base or () if r.goodput_rps is not None])

        def worst(vals: Sequence[float | None]) -> float | None:
            got = [v for v in vals if v is not None]
            return max(got) if got else None

        rows.append(
            {
                "sweep": sweep,
                "arrivals": arr,
                "lam": lam,
                "staleness_ms": round(st * 1000, 6),
                "rate": rate,
                "policy": pol,
                "admission": adm,
                "seeds": len(rs),
                "on_time_utility": _mean([r.on_time_utility for r in rs]),
                "slo_attainment": _mean([r.slo_attainment for r in rs]),
                "goodput_rps": good,
                "goodput_vs_best_effort": good / ref if ref > 0 else math.nan,
                "rejected": _mean([float(r.rejected) for r in rs]),
                "queued": _mean([float(r.queued) for r in rs]),
                "expired": _mean([float(r.expired) for r in rs]),
                "mean_ttft_s": _mean([r.mean_ttft_s for r in rs]),
                "reject_decide_us_max": worst([r.reject_decide_us_max for r in rs]),
                "reject_decide_us_p99": worst([r.reject_decide_us_p99 for r in rs]),
            }
        )
    return rows


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a few human-readable tables."""
    lines: list[str] = []
    # The table shows the rate sweeps (those the averages cover).
    swept = {(m["sweep"], m["arrivals"], m["lam"]) for m in summary.get("mean_gain", [])}
    gains = [g for g in summary.get("gain", []) if (g["sweep"], g["arrivals"], g["lam"]) in swept]
    if gains:
        lines.append(
            f"{'sweep':<10} {'arrivals':<9} {'rate':>5} {'BEAR':>7} {'best baseline':<26} "
            f"{'gain %':>7} {'oracle':>7} {'BEAR/oracle':>11}"
        )
        for g in gains:
            best = f"{g.get('best_baseline', '-')} {g.get('best_baseline_otu', math.nan):.4f}"
            lines.append(
                f"{g['sweep']:<10} {g['arrivals']:<9} {g['rate']:>5g} {g['bear']:>7.4f} "
                f"{best:<26} {g.get('gain_pct', math.nan):>7.1f} "
                f"{g.get(ORACLE, math.nan):>7.4f} "
                f"{g.get(f'bear_fraction_of_{ORACLE}', math.nan):>11.3f}"
            )
    for m in summary.get("mean_gain", []):
        lines.append(
            f"{m['sweep']} ({m['arrivals']}, lam {m['lam']:g}): mean gain over the best baseline "
            f"{m['mean_gain_pct']:+.1f}% (min {m['min_gain_pct']:+.1f}%), BEAR ahead everywhere: "
            f"{m['bear_ahead_everywhere']}, BEAR/oracle {m['mean_fraction_of_oracle']:.3f}"
        )
    for s in summary.get("staleness", []):
        losses = ", ".join(f"{d} ms {v:+.1f}%" for d, v in s["loss_pct"].items())
        lines.append(f"{s['sweep']} (rate {s['rate']:g}): BEAR loss vs zero staleness: {losses}")
    adm = summary.get("admission", [])
    if adm:
        lines.append(
            f"{'sweep':<10} {'rate':>5} {'policy':<16} {'admission':<11} {'OnTimeUtil':>10} "
            f"{'SLO':>6} {'goodput/s':>9} {'x BE':>5} {'rejected':>8} {'queued':>7} "
            f"{'expired':>7} {'TTFT ms':>7} {'429 us max':>10} {'p99':>6}"
        )
        for a in adm:
            lines.append(
                f"{a['sweep']:<10} {a['rate']:>5g} {a['policy']:<16} {a['admission']:<11} "
                f"{a['on_time_utility']:>10.4f} {a['slo_attainment']:>6.1%} "
                f"{a['goodput_rps']:>9.2f} {a['goodput_vs_best_effort']:>5.2f} "
                f"{a['rejected']:>8.1f} {a['queued']:>7.1f} {a['expired']:>7.1f} "
                f"{a['mean_ttft_s'] * 1e3:>7.1f} {_us(a['reject_decide_us_max']):>10} "
                f"{_us(a['reject_decide_us_p99']):>6}"
            )
    return "\n".join(lines)


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"

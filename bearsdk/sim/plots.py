"""The paper's figures from simulation results (matplotlib: the ``plot`` extra).

=======  =============================================================  =======================
figure   what                                                           from sweeps with
=======  =============================================================  =======================
1        routing composition by rate, met (solid) / missed (hatched)    several rates
4        predicted vs observed TTFT at the smallest instance            several rates
         (prefill-throughput estimator vs BEA)
8        OnTimeUtility by arrival rate                                  several rates
9        mean utility vs mean TTFT, the Lagrangian over delta           several deltas
10       OnTimeUtility under MMPP-2 arrivals (one panel per ratio)      ``mmpp2:R`` arrivals
14       BEAR's OnTimeUtility by snapshot staleness                     several staleness values
16       BEA vs prefill-throughput estimator (same rule)                several rates
17       OnTimeUtility by cost weight lambda                            several lambdas
18       TTFT SLO attainment by rate                                    several rates
=======  =============================================================  =======================

Results are averaged over seeds. A sweep feeds the figures its axes imply
(or those its ``figures`` key lists).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from bearsdk.errors import BearError
from bearsdk.sim.config import SimConfig
from bearsdk.sim.scenario import ORACLE, ORACLE_LATENCY, RunResult

__all__ = ["PlotError", "write_plots"]

_COLORS: Final = {
    "bear": "#d62728",
    "lagrangian": "#ff7f0e",
    "prefill-tps": "#9467bd",
    "latency-agnostic": "#1f77b4",
    "round-robin": "#8c564b",
    "shortest-queue": "#2ca02c",
    "lmdeploy-proxy": "#e377c2",
    "semantic-router": "#7f7f7f",
    "score": "#bcbd22",
    "routebalance": "#17becf",
    ORACLE: "#000000",
    ORACLE_LATENCY: "#555555",
}
_NAMES: Final = {
    "bear": "BEAR",
    "lagrangian": "Lagrangian",
    "prefill-tps": "Prefill-TPS",
    "latency-agnostic": "Latency-Agnostic",
    "round-robin": "Round Robin",
    "shortest-queue": "Shortest Queue",
    "lmdeploy-proxy": "LMDeploy-Proxy",
    "semantic-router": "vLLM Semantic Router",
    "score": "SCORE",
    "routebalance": "RouteBalance",
    ORACLE: "Oracle",
    ORACLE_LATENCY: "Oracle TTFT",
}


class PlotError(BearError, RuntimeError):
    """Plots were asked for but cannot be drawn (matplotlib is missing)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotError(
            "plots need matplotlib: pip install 'bearsdk[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(name: str) -> str:
    return _NAMES.get(name, name)


def _style(name: str) -> dict[str, Any]:
    oracle = name in (ORACLE, ORACLE_LATENCY)
    return {
        "color": _COLORS.get(name, None),
        "linestyle": "--" if oracle else "-",
        "marker": "" if oracle else "o",
        "linewidth": 2.5 if name == "bear" else 1.5,
        "markersize": 4,
    }


def _mean(v: Sequence[float]) -> float:
    return float(np.mean(v)) if v else math.nan


def _best_variant(
    results: Sequence[RunResult],
    x: Callable[[RunResult], float],
    metric: Callable[[RunResult], float],
) -> dict[str, dict[float, float]]:
    """Per policy name and x: the metric, seed-averaged, of its best variant there
    (by OnTimeUtility: the paper's tuned baselines)."""
    cells: dict[tuple[str, str, float], list[RunResult]] = {}
    for r in results:
        cells.setdefault((r.scenario.policy.name, r.scenario.policy.display, x(r)), []).append(r)
    best: dict[tuple[str, float], tuple[float, float]] = {}
    for (name, _, xv), rs in cells.items():
        otu = _mean([r.on_time_utility for r in rs])
        val = _mean([metric(r) for r in rs])
        cur = best.get((name, xv))
        if cur is None or otu > cur[0]:
            best[(name, xv)] = (otu, val)
    out: dict[str, dict[float, float]] = {}
    for (name, xv), (_, val) in best.items():
        out.setdefault(name, {})[xv] = val
    return out


def _order(names: Sequence[str]) -> list[str]:
    rank = {n: i for i, n in enumerate(_COLORS)}
    return sorted(names, key=lambda n: rank.get(n, 99))


def _lines(
    ax: Any,
    series: dict[str, dict[float, float]],
    *,
    only: Sequence[str] | None = None,
) -> None:
    for name in _order(list(series)):
        if only is not None and name not in only:
            continue
        pts = sorted(series[name].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=_label(name), **_style(name))


def _base(results: Sequence[RunResult]) -> list[RunResult]:
    """Zero staleness, the lambda nearest the paper's, Poisson arrivals (else the
    sweep's first arrival process), admission ``best-effort`` (else the sweep's first mode)."""
    if not results:
        return []
    lam = sorted({r.scenario.lam for r in results}, key=lambda v: abs(v - 5e-4))[0]
    kinds = [r.scenario.arrivals for r in results]
    arrivals = "poisson" if "poisson" in kinds else kinds[0]
    modes = [r.scenario.admission for r in results]
    admission = "best-effort" if "best-effort" in modes else modes[0]
    return [
        r
        for r in results
        if r.scenario.staleness_s == 0.0
        and r.scenario.lam == lam
        and r.scenario.arrivals == arrivals
        and r.scenario.admission == admission
        and (r.scenario.policy.name != "lagrangian" or r.scenario.delta == 1.0)
    ]


def _fig8(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = _best_variant(rs, lambda r: r.scenario.rate, lambda r: r.on_time_utility)
    _lines(ax, series)
    ax.set_xlabel("arrival rate (queries/s)")
    ax.set_ylabel("OnTimeUtility")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _fig18(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = _best_variant(rs, lambda r: r.scenario.rate, lambda r: 100 * r.slo_attainment)
    _lines(ax, series)
    ax.set_xlabel("arrival rate (queries/s)")
    ax.set_ylabel("TTFT SLO attainment (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return fig


def _fig16(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    series = _best_variant(rs, lambda r: r.scenario.rate, lambda r: r.on_time_utility)
    _lines(ax, series, only=("bear", "prefill-tps", ORACLE_LATENCY))
    ax.set_xlabel("arrival rate (queries/s)")
    ax.set_ylabel("OnTimeUtility")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _fig1(plt: Any, rs: Sequence[RunResult], title: str, instances: Sequence[str]) -> Any:
    shown = ("bear", "latency-agnostic", "round-robin", "shortest-queue")
    pols = [p for p in shown if any(r.scenario.policy.name == p for r in rs)]
    if not pols:
        return None
    fig, axes = plt.subplots(1, len(pols), figsize=(4 * len(pols), 4), sharey=True, squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for ax, pol in zip(axes[0], pols, strict=True):
        runs = [r for r in rs if r.scenario.policy.name == pol]
        rates = sorted({r.scenario.rate for r in runs})
        bottom = np.zeros(len(rates))
        for k, inst in enumerate(instances):
            for part, hatch in (("met", ""), ("missed", "///")):
                vals = []
                for rate in rates:
                    cell = [r for r in runs if r.scenario.rate == rate]
                    vals.append(
                        _mean([100 * r.composition[inst][part] / max(r.n, 1) for r in cell])
                    )
                v = np.array(vals)
                ax.bar(
                    [str(f"{x:g}") for x in rates],
                    v,
                    bottom=bottom,
                    color=colors[k % len(colors)],
                    hatch=hatch,
                    edgecolor="white" if not hatch else "black",
                    linewidth=0.3,
                    label=f"{inst} ({part})" if ax is axes[0][0] else None,
                )
                bottom += v
        ax.set_title(_label(pol))
        ax.set_xlabel("arrival rate (qps)")
    axes[0][0].set_ylabel("queries routed (%)")
    fig.legend(loc="lower center", ncol=min(6, 2 * len(instances)), fontsize=7)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _fig4(plt: Any, rs: Sequence[RunResult], title: str, index: int) -> Any:
    """Predicted against observed TTFT at one instance, every run of each estimator pooled."""
    panels = []
    for pol in ("prefill-tps", "bear"):
        pts = [
            (p, t)
            for r in rs
            if r.scenario.policy.name == pol
            for j, p, t, _ in r.samples
            if j == index and math.isfinite(p) and p > 0 and t > 0
        ]
        if pts:
            panels.append((pol, pts))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5), squeeze=False)
    for ax, (pol, pts) in zip(axes[0], panels, strict=True):
        pred = np.array([p for p, _ in pts]) * 1e3
        true = np.array([t for _, t in pts]) * 1e3
        mape = float(np.mean(np.abs(pred - true) / true)) * 100
        ax.scatter(true, pred, s=4, alpha=0.35, color=_COLORS.get(pol), linewidths=0)
        lo = float(min(true.min(), pred.min()))
        hi = float(max(true.max(), pred.max()))
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        name = "BEA" if pol == "bear" else _label(pol)
        ax.set_title(f"{name}: MAPE {mape:.0f}% ({len(pts)} requests)")
        ax.set_xlabel("observed TTFT (ms)")
        ax.set_ylabel("predicted TTFT (ms)")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _fig9(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    lag = [r for r in rs if r.scenario.policy.name == "lagrangian"]
    if not lag:
        return None
    rate = lag[0].scenario.rate
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    by_delta: dict[float, list[RunResult]] = {}
    for r in lag:
        if r.scenario.rate == rate and r.scenario.delta is not None:
            by_delta.setdefault(r.scenario.delta, []).append(r)
    pts = sorted(
        (
            d,
            _mean([r.mean_ttft_s * 1e3 for r in v]),
            _mean([r.mean_utility for r in v]),
        )
        for d, v in by_delta.items()
    )
    ax.plot([p[1] for p in pts], [p[2] for p in pts], **_style("lagrangian"), label="Lagrangian")
    for d, x, y in pts:
        ax.annotate(f"δ={d:g}", (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    others = _best_variant(
        [r for r in rs if r.scenario.policy.name != "lagrangian" and r.scenario.rate == rate],
        lambda r: 0.0,
        lambda r: r.mean_ttft_s * 1e3,
    )
    utils = _best_variant(
        [r for r in rs if r.scenario.policy.name != "lagrangian" and r.scenario.rate == rate],
        lambda r: 0.0,
        lambda r: r.mean_utility,
    )
    for name in _order(list(others)):
        ax.scatter(
            [others[name][0.0]],
            [utils[name][0.0]],
            color=_COLORS.get(name),
            label=_label(name),
            marker="s",
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("mean utility")
    ax.set_title(f"{title} (rate {rate:g} qps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _fig10(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    kinds = sorted({r.scenario.arrivals for r in rs if r.scenario.arrivals.startswith("mmpp2:")})
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        sub = [r for r in rs if r.scenario.arrivals == kind and r.scenario.staleness_s == 0.0]
        _lines(ax, _best_variant(sub, lambda r: r.scenario.rate, lambda r: r.on_time_utility))
        ax.set_title(f"MMPP-2, r = {kind.split(':', 1)[1]}")
        ax.set_xlabel("mean arrival rate (queries/s)")
        ax.set_ylabel("OnTimeUtility")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _fig14(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("bear", ORACLE):
        for rate in sorted({r.scenario.rate for r in rs}):
            sub = [r for r in rs if r.scenario.policy.name == name and r.scenario.rate == rate]
            per: dict[float, list[float]] = {}
            for r in sub:
                per.setdefault(r.scenario.staleness_s * 1e3, []).append(r.on_time_utility)
            if not per:
                continue
            pts = sorted((k, _mean(v)) for k, v in per.items())
            st = _style(name)
            st["marker"] = "o" if rate == min(r.scenario.rate for r in rs) else "s"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                label=f"{_label(name)}, {rate:g} qps",
                **st,
            )
    ax.set_xscale("symlog", linthresh=25)
    ax.set_xlabel("snapshot staleness (ms)")
    ax.set_ylabel("OnTimeUtility")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _fig17(plt: Any, rs: Sequence[RunResult], title: str) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    sub = [r for r in rs if r.scenario.staleness_s == 0.0 and r.scenario.arrivals == "poisson"]
    _lines(ax, _best_variant(sub, lambda r: r.scenario.lam, lambda r: r.on_time_utility))
    ax.set_xlabel("cost weight λ")
    ax.set_ylabel("OnTimeUtility")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _draw(
    plt: Any,
    num: int,
    rs: Sequence[RunResult],
    title: str,
    instances: Sequence[str],
) -> Any:
    base = _base(rs)
    if num == 1:
        return _fig1(plt, base, f"{title}: routing composition", instances)
    if num == 4:
        return _fig4(plt, base, f"{title}: TTFT at {instances[0]}", 0)
    if num == 8:
        return _fig8(plt, base, f"{title}: OnTimeUtility")
    if num == 9:
        return _fig9(plt, [r for r in rs if r.scenario.staleness_s == 0.0], title)
    if num == 10:
        return _fig10(plt, rs, f"{title}: bursty arrivals")
    if num == 14:
        return _fig14(plt, rs, f"{title}: snapshot staleness")
    if num == 16:
        return _fig16(plt, base, f"{title}: BEA vs prefill throughput")
    if num == 17:
        return _fig17(plt, rs, f"{title}: cost weight")
    return _fig18(plt, base, f"{title}: SLO attainment")


def write_plots(cfg: SimConfig, results: Sequence[RunResult], out_dir: str | Path) -> list[Path]:
    """Draw every figure the configuration's sweeps feed into ``out_dir`` (PNG).

    Returns:
        The files written.

    Raises:
        PlotError: matplotlib is not installed.
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    instances = [s.name for s in cfg.pool]
    written: list[Path] = []
    for sw in cfg.sweeps:
        rs = [r for r in results if r.scenario.sweep == sw.name]
        for num in sw.inferred_figures():
            fig = _draw(plt, num, rs, f"{cfg.name}: {sw.name}", instances)
            if fig is None:
                continue
            path = out / f"{cfg.name}-fig{num:02d}-{sw.name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written

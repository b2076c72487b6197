"""``bearsdk simulate``: the paper's routing experiments in fast, virtual-time simulation.

Examples::

    bearsdk simulate --config examples/simulate/paper.toml
    bearsdk simulate --config examples/simulate/paper.toml --sweep rates --json > rates.json
    bearsdk simulate --config examples/simulate/paper.toml --plots docs/figures/simulation

The configuration names the pool, the workload, the policies and the sweeps
(see :mod:`bearsdk.sim.config` and ``docs/simulation.md``). Every run routes the
workload with the real router over simulated engines; runs are spread over
worker processes (results do not depend on their number).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson

from bearsdk.cli import positive_int, writable_dir, writable_file

if TYPE_CHECKING:
    from bearsdk.sim.sweep import SimReport

__all__ = ["format_runs", "register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="route workloads over simulated engines with the real router; sweep policies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, metavar="FILE.toml", help="simulation config")
    p.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    p.add_argument("--plots", metavar="DIR", help="write the paper's figures (PNG) into DIR")
    p.add_argument(
        "--workers", type=positive_int, default=None, help="processes (default: one per CPU)"
    )
    p.add_argument("--requests", type=positive_int, default=None, help="override requests per run")
    p.add_argument(
        "--seeds", default=None, metavar="S1,S2", help="override the seeds (comma-separated)"
    )
    p.add_argument(
        "--sweep", action="append", default=[], metavar="NAME", help="run only this sweep"
    )
    p.add_argument(
        "--batch-time",
        choices=("profile", "calibrated", "online"),  # (sim.scenario.BATCH_TIME_MODES)
        default=None,
        help="override router.batch_time (the router's eq. 12 coefficients: the "
        "profiles, fitted before the runs, or refitted online from the engines' batches)",
    )
    p.add_argument(
        "--router-staleness",
        choices=("default", "paper"),
        default=None,
        help="override router.staleness",
    )
    p.add_argument(
        "--resident-lengths",
        choices=("predicted", "calibrated"),
        default=None,
        help="override router.resident_lengths (how BEA sizes residents' outputs)",
    )
    p.add_argument(
        "--speed",
        choices=("learned", "profile"),
        default=None,
        help="override router.speed (learn each instance's speed from its snapshots, or not)",
    )
    p.add_argument(
        "--margin",
        choices=("learned", "off"),
        default=None,
        help="override router.margin (widen TTFT estimates by each instance's first "
        "tokens' spread, or not)",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="also score every candidate's TTFT estimate against its engine's true "
        "forecast, and that forecast against the TTFT it gave: the floor under the "
        "MAPE that no replay of the present removes (slower: a forecast per "
        "instance and decision; 'diagnosis' and 'ttft_floor' in the JSON)",
    )
    p.add_argument("--out", metavar="FILE", help="also write the JSON results to FILE")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding the public data sets (overrides workload.data_dir; "
        "default: $BEARSDK_DATA, see docs/data.md)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from bearsdk.sim.config import SimConfigError, load_config
    from bearsdk.sim.plots import write_plots
    from bearsdk.sim.sweep import Progress, SimInterrupted, run_config

    cfg = load_config(args.config)
    if args.requests is not None:
        cfg = attrs.evolve(cfg, requests=args.requests)
    if args.seeds is not None:
        try:
            seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        except ValueError:
            raise SimConfigError(
                f"--seeds must be integers like 1,2,3 (got {args.seeds!r})"
            ) from None
        if not seeds or min(seeds) < 0:
            raise SimConfigError(f"--seeds must be integers >= 0 (got {args.seeds!r})")
        cfg = attrs.evolve(cfg, seeds=seeds)
    if args.sweep:
        known = {s.name for s in cfg.sweeps}
        for name in args.sweep:
            if name not in known:
                raise SimConfigError(
                    f"--sweep {name!r}: not in the config ({', '.join(sorted(known))})"
                )
        cfg = attrs.evolve(cfg, sweeps=tuple(s for s in cfg.sweeps if s.name in args.sweep))
    if args.batch_time is not None:
        cfg = attrs.evolve(cfg, batch_time=args.batch_time)
    if args.router_staleness is not None:
        from bearsdk.state import StalenessRules

        st = StalenessRules() if args.router_staleness == "default" else StalenessRules.paper()
        cfg = attrs.evolve(cfg, router_staleness=st)
    if args.resident_lengths is not None:
        cfg = attrs.evolve(cfg, resident_lengths=args.resident_lengths)
    if args.speed is not None:
        cfg = attrs.evolve(cfg, speed=args.speed)
    if args.margin is not None:
        cfg = attrs.evolve(cfg, margin=args.margin)
    if args.data_dir:
        cfg = attrs.evolve(
            cfg, workload=attrs.evolve(cfg.workload, data_dir=str(Path(args.data_dir).resolve()))
        )
    if args.plots:
        # Fail before hours of simulation, not after.
        from bearsdk.sim.plots import _pyplot

        _pyplot()
        writable_dir(args.plots, "--plots")
    if args.out:
        writable_file(args.out, "--out")
    progress = None if args.no_progress else (lambda n: Progress(n))
    try:
        report = run_config(cfg, workers=args.workers, progress=progress, diagnose=args.diagnose)
    except SimInterrupted as stop:
        # Runs that finished are kept, where the whole result would have gone.
        done = len(stop.partial.results)
        if done:
            _emit(args, stop.partial, {"interrupted": True, "scenarios": stop.total})
        where = f" (in {args.out})" if args.out and done else ""
        raise KeyboardInterrupt(f"{done} of {stop.total} runs had finished{where}") from None
    _emit(args, report, {})
    if args.plots:
        for path in write_plots(cfg, report.results, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _emit(args: argparse.Namespace, report: SimReport, extra: dict[str, Any]) -> None:
    from bearsdk.sim.sweep import format_summary

    doc = {**report.as_dict(), **extra}
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
        return
    cfg = report.config
    print(
        f"{cfg.name}: {len(report.results)} results ({cfg.requests} requests each, "
        f"seeds {', '.join(map(str, cfg.seeds))}) in {report.wall_s:.1f} s "
        f"on {report.workers} worker(s) (inputs {report.prepare_s:.1f} s)"
    )
    summary = format_summary(doc["summary"])
    # A configuration without baselines to beat (one instance, estimators compared)
    # has no summary: its comparison is the runs themselves.
    if summary and not extra:
        print(summary)
    else:
        print(format_runs(doc["results"]))


def format_runs(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per run: the policy's utility, SLO attainment, TTFT and its prediction error.

    Args:
        rows: The ``results`` of a report's JSON form.

    Returns:
        The table, runs in the report's order.
    """
    floors = any("ttft_floor" in r for r in rows)
    lines = [
        f"{'sweep':<10} {'rate':>5} {'stale ms':>8} {'policy':<28} {'OnTimeUtil':>10} "
        f"{'SLO':>6} {'mean TTFT ms':>12} {'p90 TTFT ms':>11} {'TTFT MAPE':>9}"
        + (f" {'floor':>6}" if floors else "")
    ]
    for r in rows:
        mape = (r.get("ttft_mape") or {}).get("all")
        line = (
            f"{r['sweep']:<10} {r['rate']:>5g} {r['staleness_ms']:>8g} {r['policy']:<28} "
            f"{r['on_time_utility']:>10.4f} {r['slo_attainment']:>6.1%} "
            f"{r['mean_ttft_s'] * 1e3:>12.2f} {r['p90_ttft_s'] * 1e3:>11.2f} {_pct(mape):>9}"
        )
        if floors:
            line += f" {_pct((r.get('ttft_floor') or {}).get('mape')):>6}"
        lines.append(line)
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v * 100:.1f}%"

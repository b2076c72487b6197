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
import sys
from pathlib import Path

import attrs
import orjson

__all__ = ["register"]


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
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    p.add_argument("--requests", type=int, default=None, help="override requests per run")
    p.add_argument(
        "--seeds", default=None, metavar="S1,S2", help="override the seeds (comma-separated)"
    )
    p.add_argument(
        "--sweep", action="append", default=[], metavar="NAME", help="run only this sweep"
    )
    p.add_argument(
        "--batch-time",
        choices=("profile", "calibrated"),
        default=None,
        help="override router.batch_time (the router's eq. 12 coefficients)",
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
    from bearsdk.sim.sweep import Progress, format_summary, run_config

    cfg = load_config(args.config)
    if args.requests is not None:
        if args.requests < 1:
            raise SimConfigError(f"--requests must be >= 1 (got {args.requests})")
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
        from bearsdk.state import StalenessPolicy

        st = StalenessPolicy() if args.router_staleness == "default" else StalenessPolicy.paper()
        cfg = attrs.evolve(cfg, router_staleness=st)
    if args.resident_lengths is not None:
        cfg = attrs.evolve(cfg, resident_lengths=args.resident_lengths)
    if args.data_dir:
        cfg = attrs.evolve(
            cfg, workload=attrs.evolve(cfg.workload, data_dir=str(Path(args.data_dir).resolve()))
        )
    if args.workers is not None and args.workers < 1:
        raise SimConfigError(f"--workers must be >= 1 (got {args.workers})")
    if args.plots:
        # Fail before hours of simulation, not after.
        from bearsdk.sim.plots import _pyplot

        _pyplot()
    progress = None if args.no_progress else (lambda n: Progress(n))
    report = run_config(cfg, workers=args.workers, progress=progress)
    doc = report.as_dict()
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode()
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    if args.json:
        sys.stdout.write(text + "\n")
    else:
        print(
            f"{cfg.name}: {len(report.results)} results ({cfg.requests} requests each, "
            f"seeds {', '.join(map(str, cfg.seeds))}) in {report.wall_s:.1f} s "
            f"on {report.workers} worker(s) (inputs {report.prepare_s:.1f} s)"
        )
        print(format_summary(doc["summary"]))
    if args.plots:
        for path in write_plots(cfg, report.results, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0

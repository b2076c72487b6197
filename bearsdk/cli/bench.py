"""``bearsdk bench NAME``: run one of the package's benchmarks."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import bearsdk.bench

LOADS_ON_USE = True
"""Its benchmarks are registered only when ``bench`` is the command run (see
:func:`bearsdk.cli.build_parser`): they import most of the package."""


def register(sub: argparse._SubParsersAction, full: bool = True) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="run a benchmark (medians and p99s measured in one run)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    bsub.required = True
    if not full:
        return
    for info in sorted(pkgutil.iter_modules(bearsdk.bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"bearsdk.bench.{info.name}")
        reg = getattr(module, "register", None)
        if reg is not None:
            reg(bsub)

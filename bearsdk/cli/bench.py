"""``bearsdk bench NAME``: run one of the package's benchmarks."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Sequence

import bearsdk.bench

LOADS_ON_USE = True
"""Its benchmarks are registered only when ``bench`` is the command run (see
:func:`bearsdk.cli.build_parser`): they import most of the package."""


def register(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    full: bool = True,
    argv: Sequence[str] | None = None,
) -> None:
    """Add ``bench`` and, with ``full``, its benchmarks: only the one ``argv``
    names where it names one (each imports much of the package: the others
    are not needed to run it), else every one (for ``bench --help``)."""
    p = sub.add_parser("bench", help="run a benchmark (medians and p99s measured in one run)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    bsub.required = True
    if not full:
        return
    names = [
        info.name
        for info in sorted(pkgutil.iter_modules(bearsdk.bench.__path__), key=lambda m: m.name)
        if not info.name.startswith("_")
    ]
    named = _named(argv)
    if named in names:
        names = [named]
    for name in names:
        module = importlib.import_module(f"bearsdk.bench.{name}")
        reg = getattr(module, "register", None)
        if reg is not None:
            reg(bsub)


def _named(argv: Sequence[str] | None) -> str | None:
    """The module of the benchmark ``argv`` names (the word after ``bench``)."""
    words = list(argv or ())
    if "bench" not in words:
        return None
    word = next((w for w in words[words.index("bench") + 1 :] if not w.startswith("-")), None)
    return None if word is None else word.replace("-", "_")

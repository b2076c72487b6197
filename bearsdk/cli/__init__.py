"""The ``bearsdk`` command line.

Every module in this package that defines ``register(subparsers)`` contributes one
sub-command (``bearsdk replay``, ``bearsdk bench``, ...): ``register`` adds its
parser and sets ``func`` to a callable taking the parsed arguments and returning
the exit status. Adding a command never means editing this file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from bearsdk.errors import BearError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every sub-command registered."""
    from bearsdk import __version__
    from bearsdk.replay import IMPLEMENTATION

    parser = argparse.ArgumentParser(
        prog="bearsdk",
        description="Latency-aware LLM routing: BEA time-to-first-token replay and BEAR routing.",
    )
    parser.add_argument(
        "--version", action="version", version=f"bearsdk {__version__} (replay: {IMPLEMENTATION})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except BearError as exc:
        print(f"bearsdk {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `bearsdk ... | head`
        return 0
    return status

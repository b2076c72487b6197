"""The ``bearsdk`` command line.

Every module in this package that defines ``register(subparsers)`` contributes one
sub-command (``bearsdk replay``, ``bearsdk bench``, ...): ``register`` adds its
parser and sets ``func`` to a callable taking the parsed arguments and returning
the exit status. Adding a command never means editing this file.

Every way a command can fail on its input ends the same way: one line
``bearsdk COMMAND: error: MESSAGE`` on standard error and exit status 2 (bad
arguments, missing or unreadable files, unwritable outputs, invalid specs), or
``bearsdk COMMAND: interrupted`` and status 130 on Ctrl-C. Any other exception
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import pkgutil
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from bearsdk._sigint import redeliver_lost_interrupts
from bearsdk.errors import BearError

__all__ = [
    "ArgumentParser",
    "build_parser",
    "error_line",
    "main",
    "nonnegative_float",
    "nonnegative_int",
    "plain_text",
    "positive_float",
    "positive_int",
    "scheduler_arg",
    "writable_dir",
    "writable_file",
]

_MAX_MESSAGE = 500
"""Characters of an error message shown; a value's repr may be arbitrarily long."""


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors are one line (usage stays behind ``--help``).

    Sub-parsers inherit the class, so every ``bearsdk`` command gets it.
    """

    def format_help(self) -> str:
        """The help as plain text: docstrings' reST markup is for Sphinx, not a terminal."""
        # Stripped before formatting, so that paragraphs are wrapped at their real width.
        if self.description:
            self.description = plain_text(self.description)
        if self.epilog:
            self.epilog = plain_text(self.epilog)
        for action in self._actions:
            if isinstance(action.help, str):
                action.help = plain_text(action.help)
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        """The usage line as plain text."""
        return plain_text(super().format_usage())

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {error_line(message)} (see {self.prog} --help)\n")


_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``")


def plain_text(text: str) -> str:
    """``text`` without reST markup: roles and literals keep their words.

    ``:class:`~bearsdk.router.AsyncRouter``` becomes ``AsyncRouter``, a double-backquoted
    literal loses its backquotes and a paragraph ending in ``::`` ends in ``:``.

    Args:
        text: Help text built from docstrings.

    Returns:
        The text a terminal shows.
    """

    def role(m: re.Match[str]) -> str:
        target = m.group(1)
        # `~a.b.C` shows as `C` in Sphinx: do the same.
        return target.rsplit(".", 1)[-1] if m.group(0).count("~") else target

    text = _ROLE.sub(role, text)
    text = _LITERAL.sub(r"\1", text)
    return re.sub(r"(\S)::$", r"\1:", text, flags=re.MULTILINE)


def error_line(message: object) -> str:
    """``message`` as one line of at most a few hundred characters.

    Args:
        message: An exception or a string.

    Returns:
        The text with line breaks folded into spaces and the tail cut with ``...``.
    """
    if isinstance(message, OSError) and message.strerror:
        where = message.filename if message.filename is not None else None
        text = f"{where}: {message.strerror}" if where is not None else message.strerror
    elif isinstance(message, KeyError) and message.args:
        text = str(message.args[0])
    else:
        text = str(message) or type(message).__name__
    text = " ".join(text.split())
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return text


_N = TypeVar("_N", int, float)


def _number(
    kind: Callable[[str], _N], test: Callable[[_N], bool], what: str
) -> Callable[[str], _N]:
    def parse(text: str) -> _N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"must be {what} (got {text!r})")
        return value

    parse.__name__ = what  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
"""``type=`` for counts: an integer >= 1."""

nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
"""``type=`` for seeds and ports: an integer >= 0."""

positive_float = _number(float, lambda v: v > 0, "a finite number > 0")
"""``type=`` for rates, durations and scales: a finite number > 0."""

nonnegative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
"""``type=`` for delays and weights: a finite number >= 0."""


def scheduler_arg(text: str) -> str:
    """``type=`` for ``--scheduler``: a registered name, or a spec file to register.

    A value naming a file (a ``.toml`` ending or a path separator) is loaded and
    registered, and its spec's name is returned; any other value is a name, checked
    where it is used.

    Raises:
        argparse.ArgumentTypeError: The file cannot be read or holds an invalid spec.
    """
    if not (text.endswith(".toml") or os.sep in text or (os.altsep or os.sep) in text):
        return text
    from bearsdk.schedulers import register_scheduler

    try:
        return register_scheduler(text, replace=True).name
    except (BearError, OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(error_line(exc)) from None


def writable_file(path: str, what: str = "output") -> None:
    """Check, before any work, that file ``path`` can be written.

    It is opened for appending (and removed again when it did not exist): permission
    bits say little to root or on special file systems.

    Args:
        path: The output file (``-`` is standard output, always fine).
        what: The option it came from, for the message.

    Raises:
        BearError: It is a folder, its folder does not exist, or it cannot be written.
    """
    if path == "-":
        return
    if os.path.isdir(path):
        raise BearError(f"{what} {path!r} is a folder, not a file")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise BearError(f"{what} {path!r} cannot be written ({exc.strerror or exc})") from None
    if not existed:
        os.unlink(path)


def writable_dir(path: str, what: str = "output folder") -> None:
    """Check, before any work, that folder ``path`` can hold new files; create it if needed.

    Args:
        path: The folder.
        what: The option it came from, for the message.

    Raises:
        BearError: It cannot be created, or a file cannot be created in it.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise BearError(
            f"{what} {path!r} is not a writable folder ({exc.strerror or exc})"
        ) from None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with every sub-command registered.

    Args:
        argv: The words to be parsed, when known: a command whose module sets
            ``LOADS_ON_USE`` (``bench``, whose benchmarks import most of the
            package) then registers its subcommands only if it is named there,
            so that ``bearsdk serve`` starts without them, and of those only
            the one named, where one is (``bearsdk bench router``).
    """
    from bearsdk import __version__, _twins

    parser = ArgumentParser(
        prog="bearsdk",
        description="Latency-aware LLM routing: BEA time-to-first-token replay and BEAR routing.",
    )
    twins = ", ".join(f"{pair}: {impl}" for pair, impl in _twins.loaded().items())
    parser.add_argument("--version", action="version", version=f"bearsdk {__version__} ({twins})")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (repeatable): it registers its own schedulers, snapshot "
        "sources, estimators or selectors, which configs may then name",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is None:
            continue
        if not getattr(module, "LOADS_ON_USE", False):
            register(sub)
        elif argv is not None and info.name not in argv:
            register(sub, full=False)
        else:
            register(sub, argv=argv)
    return parser


def _leaf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for dest in ("command", "bench"):
        name = getattr(args, dest, None)
        found = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                found = action.choices[name]
        if found is None:
            break
        parser = found
    return parser


def _command(args: argparse.Namespace | None, argv: Sequence[str]) -> str:
    if args is not None:
        words = [getattr(args, "command", None), getattr(args, "bench", None)]
        if args.command != "bench":
            words = words[:1]
        return " ".join(["bearsdk", *(w for w in words if w)])
    first = next((a for a in argv if not a.startswith("-")), None)
    return f"bearsdk {first}" if first else "bearsdk"


def _quiet_stdout() -> None:
    # A closed pipe (`bearsdk ... | head`) must not print a second error when Python
    # flushes stdout on exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


PLUGINS_ENV = "BEARSDK_PLUGINS"
"""Plugin modules the command line loaded, comma-separated: worker processes a
command spawns load them too."""


def load_plugins(modules: Sequence[str]) -> None:
    """Import each plugin module (it registers what it brings), and remember them
    for worker processes (:data:`PLUGINS_ENV`).

    Raises:
        BearError: A module cannot be imported (one line naming it).
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure of a user's module is one line
            raise BearError(f"--plugin {name!r}: cannot import it ({error_line(exc)})") from None
    if modules:
        known = [m for m in os.environ.get(PLUGINS_ENV, "").split(",") if m]
        os.environ[PLUGINS_ENV] = ",".join(dict.fromkeys([*known, *modules]))


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe
            stream.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        0 on success, 2 on bad input (one line on standard error), 130 on Ctrl-C,
        or the command's own status.

    Raises:
        SystemExit: From argparse: ``--help``, ``--version``, or a bad argument (one
            line on standard error, status 2).
    """
    words = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    if argv is None:
        # (The process's own command line, not a caller's in-process call.)
        redeliver_lost_interrupts()
    try:
        parser = build_parser(words)
        args, extra = parser.parse_known_args(words)
        if extra:
            # Said by the command's own parser: `bearsdk replay: error: ...`.
            _leaf(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        load_plugins(args.plugin)
        status: int = args.func(args)
    except KeyboardInterrupt as exc:
        # No second Ctrl-C traceback while the interpreter shuts down.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A command may say what it kept: `raise KeyboardInterrupt("3 of 8 runs ...")`.
        detail = f": {error_line(exc)}" if str(exc) else ""
        print(f"{_command(args, words)}: interrupted{detail}", file=sys.stderr, flush=True)
        if argv is None:
            # The process ends here, at once: the interpreter's finalization
            # would collect every loaded module (lightgbm, numpy, ...) for half a
            # second more, and under load it was seen to end the process by
            # SIGINT (status -2, not 130) in about one Ctrl-C in ten. What the
            # command owned is already closed; the output is flushed.
            _flush_streams()
            os._exit(130)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except (BearError, OSError, ValueError) as exc:
        print(f"{_command(args, words)}: error: {error_line(exc)}", file=sys.stderr, flush=True)
        return 2
    return status

"""Ctrl-C that lands where Python cannot raise it is delivered again.

The command line turns Ctrl-C into ``KeyboardInterrupt`` and exits 130. But the
signal handler runs between any two bytecodes, and some code runs where an
exception cannot propagate: a weakref callback (importlib's module locks have
one, so any import is exposed), a ``__del__``, a finalizer. There Python prints
"Exception ignored in ..." with a traceback and goes on, and the interrupt is
lost: the command ran to its end and exited 0. :func:`redeliver_lost_interrupts`
installs an unraisable-exception hook that, for a ``KeyboardInterrupt``, prints
nothing and raises the signal again in the main thread, where it is handled as
any Ctrl-C (asyncio's own handler included); other unraisable exceptions are
reported as before.
"""

from __future__ import annotations

import _thread
import sys
from typing import Any

__all__ = ["redeliver_lost_interrupts"]


def _hook(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _thread.interrupt_main()
        return
    sys.__unraisablehook__(unraisable)


def redeliver_lost_interrupts() -> None:
    """Install the hook (the command line's; a library leaves the process's hooks alone)."""
    sys.unraisablehook = _hook

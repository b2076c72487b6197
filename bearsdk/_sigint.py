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

The signal is raised again from a helper thread once the hook has returned:
raised from the hook itself, its handler runs at the hook's next bytecode
check, inside the hook, where the new ``KeyboardInterrupt`` is lost as well
("Exception ignored in sys.unraisablehook"; seen under load).
"""

from __future__ import annotations

import _thread
import sys
import threading
import time
from typing import Any

__all__ = ["redeliver_lost_interrupts"]

# Hooks running in the main thread (a hook may run inside another's callback).
_inside = 0


def _deliver() -> None:
    while _inside:
        time.sleep(0.001)
    _thread.interrupt_main()


def _hook(unraisable: Any) -> None:
    global _inside
    _inside += 1
    try:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            threading.Thread(target=_deliver, name="bearsdk-sigint", daemon=True).start()
            return
        sys.__unraisablehook__(unraisable)
    finally:
        _inside -= 1


def redeliver_lost_interrupts() -> None:
    """Install the hook (the command line's; a library leaves the process's hooks alone)."""
    sys.unraisablehook = _hook

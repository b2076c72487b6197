"""The replay loop: batch formation from a snapshot up to a new request's first token.

Two implementations honour one contract:

* ``_replay_c`` (built from ``cext/_replay_c.pyx``): the compiled loop, used by default.
* ``_replay_py``: the pure-Python twin, the readable reference and the test oracle.

Setting ``BEARSDK_NO_EXTENSIONS=1`` selects the twin (as does a build without
extensions). :data:`IMPLEMENTATION` says which one is loaded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from bearsdk.replay import _replay_py
from bearsdk.replay._replay_py import ScheduledBatch, SchedulerCore, StepOutput
from bearsdk.replay.types import BatchRecord, ReplayerProtocol, ReplayResult, StopReason

if TYPE_CHECKING:
    # Typing only: the scheduler package compiles specs for the replay and so
    # imports it; the replay just runs the bound Policy it is handed.
    from bearsdk.schedulers.spec import Policy

__all__ = [
    "IMPLEMENTATION",
    "BatchRecord",
    "ReplayResult",
    "Replayer",
    "ReplayerProtocol",
    "ScheduledBatch",
    "SchedulerCore",
    "StepOutput",
    "StopReason",
    "implementations",
]

_FLAG = os.environ.get("BEARSDK_NO_EXTENSIONS", "").strip().lower()
_NO_EXT = _FLAG not in {"", "0", "no", "false"}

if TYPE_CHECKING:
    ReplayerFactory = Callable[[Policy], ReplayerProtocol]
    Replayer = ReplayerProtocol
else:
    Replayer = _replay_py.Replayer
    if not _NO_EXT:
        with contextlib.suppress(ImportError):  # built without extensions
            from bearsdk.replay._replay_c import Replayer

IMPLEMENTATION: str = str(getattr(Replayer, "implementation", _replay_py.IMPLEMENTATION))
"""``"cython"`` or ``"python"``: the implementation :class:`Replayer` refers to."""


def implementations() -> dict[str, ReplayerFactory]:
    """Return every importable implementation by name (tests run against each)."""
    out: dict[str, ReplayerFactory] = {"python": _replay_py.Replayer}
    try:
        import bearsdk.replay._replay_c as compiled
    except ImportError:
        return out
    out["cython"] = compiled.Replayer
    return out

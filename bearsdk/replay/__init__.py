"""The replay loop: batch formation from a snapshot up to a new request's first token.

Two implementations honour one contract:

* ``_replay_c`` (built from ``cext/_replay_c.pyx``): the compiled loop, used by default.
  A snapshot prepared with its block pool (``prepare(..., cache=...)`` under a
  prefix-caching policy) runs in its sibling ``_replay_apc_c``
  (``cext/_replay_apc_c.pyx``), which forms batches block by block.
* ``_replay_py``: the pure-Python twin, the readable reference and the test oracle.

The twin runs the live scheduler (:mod:`bearsdk.replay.scheduler`,
:class:`SchedulerCore`, which the emulator, the simulator and fast-forward also
run) in zero time; the request state both share is in :mod:`bearsdk.replay.requests`.

Setting ``BEARSDK_NO_EXTENSIONS=1`` selects the twin (as does a build without
extensions). :data:`IMPLEMENTATION` says which one is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bearsdk import _twins
from bearsdk.replay import _replay_py
from bearsdk.replay.scheduler import ScheduledBatch, SchedulerCore, StepOutput
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

if TYPE_CHECKING:
    ReplayerFactory = Callable[[Policy], ReplayerProtocol]
    Replayer = ReplayerProtocol
else:
    _compiled = _twins.compiled("bearsdk.replay._replay_c")
    Replayer = _replay_py.Replayer if _compiled is None else _compiled.Replayer

IMPLEMENTATION: str = str(getattr(Replayer, "implementation", _replay_py.IMPLEMENTATION))
"""``"cython"`` or ``"python"``: the implementation :class:`Replayer` refers to."""


def implementations() -> dict[str, ReplayerFactory]:
    """Return every importable implementation by name (tests run against each)."""
    out: dict[str, ReplayerFactory] = {"python": _replay_py.Replayer}
    compiled = _twins.available("bearsdk.replay._replay_c")
    if compiled is not None:
        out["cython"] = compiled.Replayer
    return out

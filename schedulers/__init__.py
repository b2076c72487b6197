"""Engine scheduling policies as data (scheduler specs), and their compiler.

Specs are TOML files (``specs/*.toml`` hold the built-ins) made of the building
blocks documented in :mod:`bearsdk.schedulers.spec`. :func:`bind_scheduler`
binds a registered spec to parameter values, giving a :class:`BoundScheduler`;
:func:`compile_scheduler` returns the replay loop for it, compiled once and
cached. The compile step lives beside the replay it feeds
(:mod:`bearsdk.replay.compile`) and is loaded on first use, so reading and
validating specs does not load the replay.

The old names ``Policy``, ``policy`` and ``compile_policy`` stay as aliases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bearsdk.schedulers.compiler import bind_scheduler, policy
from bearsdk.schedulers.registry import (
    get_scheduler,
    register_scheduler,
    scheduler_names,
    unregister_scheduler,
)
from bearsdk.schedulers.spec import (
    BoundScheduler,
    Policy,
    SchedulerSpec,
    load_spec,
    spec_from_dict,
)

if TYPE_CHECKING:
    from bearsdk.replay.compile import compile_policy, compile_scheduler

__all__ = [
    "BoundScheduler",
    "Policy",
    "SchedulerSpec",
    "bind_scheduler",
    "compile_policy",
    "compile_scheduler",
    "get_scheduler",
    "load_spec",
    "policy",
    "register_scheduler",
    "scheduler_names",
    "spec_from_dict",
    "unregister_scheduler",
]


def __getattr__(name: str) -> Any:
    if name not in ("compile_policy", "compile_scheduler"):
        raise AttributeError(f"module 'bearsdk.schedulers' has no attribute {name!r}")
    from bearsdk.schedulers import compiler

    value = getattr(compiler, name)
    globals()[name] = value  # the next access is a plain attribute
    return value

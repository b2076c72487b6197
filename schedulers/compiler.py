"""Bind a registered scheduler spec to parameter values; its compile step is the replay's.

:func:`bind_scheduler` turns a registered spec and engine-flag overrides into a
:class:`~bearsdk.schedulers.spec.BoundScheduler`. Compiling that into the
replay's program (:func:`compile_scheduler`) sits beside the replay it feeds, in
:mod:`bearsdk.replay.compile`; it is re-exported here and loaded on first use,
so that reading and validating specs does not load the replay and its compiled
extension.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bearsdk.schedulers.registry import get_scheduler
from bearsdk.schedulers.spec import BoundScheduler

if TYPE_CHECKING:
    from bearsdk.replay.compile import compile_policy, compile_scheduler

__all__ = ["bind_scheduler", "compile_policy", "compile_scheduler", "policy"]


def bind_scheduler(name: str, params: Mapping[str, object] | None = None) -> BoundScheduler:
    """Bind the registered scheduler ``name`` to parameter overrides.

    Args:
        name: Registered scheduler name.
        params: Overrides by engine flag name.

    Returns:
        The validated, bound scheduler.

    Raises:
        SpecError: Unknown scheduler, parameter or bad value.
    """
    return get_scheduler(name).bind(params)


def __getattr__(name: str) -> Any:
    if name not in ("compile_policy", "compile_scheduler"):
        raise AttributeError(f"module 'bearsdk.schedulers.compiler' has no attribute {name!r}")
    # The replay imports nothing of this package at runtime: no cycle.
    value = getattr(importlib.import_module("bearsdk.replay.compile"), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


# The old name, kept as an alias for one release.
policy = bind_scheduler

"""Scheduler policies as data, and their compiler.

Policies are TOML specs (``specs/*.toml`` hold the built-ins) made of the building
blocks documented in :mod:`bearsdk.schedulers.spec`. :func:`policy` binds a spec
to parameter values; :func:`compile_policy` returns the replay loop for the bound
policy, compiled once and cached. The compile step lives beside the replay it
feeds (:mod:`bearsdk.replay.compile`) and is loaded on first use, so reading and
validating specs does not load the replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bearsdk.schedulers.compiler import policy
from bearsdk.schedulers.registry import (
    get_scheduler,
    register_scheduler,
    scheduler_names,
    unregister_scheduler,
)
from bearsdk.schedulers.spec import Policy, SchedulerSpec, load_spec, spec_from_dict

if TYPE_CHECKING:
    from bearsdk.replay.compile import compile_policy

__all__ = [
    "Policy",
    "SchedulerSpec",
    "compile_policy",
    "get_scheduler",
    "load_spec",
    "policy",
    "register_scheduler",
    "scheduler_names",
    "spec_from_dict",
    "unregister_scheduler",
]


def __getattr__(name: str) -> Any:
    if name != "compile_policy":
        raise AttributeError(f"module 'bearsdk.schedulers' has no attribute {name!r}")
    from bearsdk.schedulers import compiler

    value = compiler.compile_policy
    globals()[name] = value  # the next access is a plain attribute
    return value

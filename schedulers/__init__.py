"""Scheduler policies as data, and their compiler.

Policies are TOML specs (``specs/*.toml`` hold the built-ins) made of the building
blocks documented in :mod:`bearsdk.schedulers.spec`. :func:`compile_policy` binds a
spec to parameter values and returns the replay loop for it, compiled once and
cached.
"""

from bearsdk.schedulers.compiler import compile_policy, policy
from bearsdk.schedulers.registry import (
    get_scheduler,
    register_scheduler,
    scheduler_names,
    unregister_scheduler,
)
from bearsdk.schedulers.spec import Policy, SchedulerSpec, load_spec, spec_from_dict

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

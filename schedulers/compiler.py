"""Compile a bound policy into its replay loop, once per policy.

A :class:`~bearsdk.schedulers.spec.Policy` is a flat, hashable value; compiling it
means building the replay implementation's state for it: the compiled loop picks
the specialisation matching the policy's allocation mode, budget counting and
pipeline depth (instantiated at build time with fused types), and stores the
scalar parameters in a C struct. Any spec composed of the documented building
blocks therefore runs compiled, built-in or registered at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bearsdk.schedulers.registry import get_scheduler
from bearsdk.schedulers.spec import Policy

if TYPE_CHECKING:
    from bearsdk.replay import Replayer

__all__ = ["compile_policy", "policy"]


def policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """Bind the registered scheduler ``name`` to parameter overrides.

    Args:
        name: Registered scheduler name.
        params: Overrides by engine flag name.

    Returns:
        The validated policy.

    Raises:
        SpecError: Unknown scheduler, parameter or bad value.
    """
    return get_scheduler(name).bind(params)


@functools.lru_cache(maxsize=256)
def _compile(p: Policy, implementation: str) -> Replayer:
    from bearsdk.replay import implementations

    impls = implementations()
    return impls[implementation](p)


def compile_policy(p: Policy, implementation: str | None = None) -> Replayer:
    """Return the (cached) replay loop for a bound policy.

    Args:
        p: The policy.
        implementation: ``"cython"`` or ``"python"``; default: the loaded one
            (see :data:`bearsdk.replay.IMPLEMENTATION`).

    Returns:
        A replayer for ``p``.

    Raises:
        KeyError: The requested implementation is not available.
    """
    # Imported when first called, so that reading and validating specs does
    # not load the replay and its compiled extension. (The replay imports
    # nothing of this package at runtime: no cycle is hidden here.)
    from bearsdk.replay import IMPLEMENTATION, implementations

    impl = implementation or IMPLEMENTATION
    if impl not in implementations():
        raise KeyError(
            f"replay implementation {impl!r} is not available (have: {sorted(implementations())})"
        )
    return _compile(p, impl)

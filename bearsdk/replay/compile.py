"""Compile a bound scheduler spec into its replay loop, once per binding.

A :class:`~bearsdk.schedulers.Policy` is a flat, hashable value; compiling it
means building the replay implementation's state for it: the compiled loop picks
the specialisation matching the policy's allocation mode, budget counting and
pipeline depth (instantiated at build time with fused types), and stores the
scalar parameters in a C struct. Any spec composed of the documented building
blocks therefore runs compiled, built-in or registered at run time.

This step sits beside the replay it feeds; the specs, their registry and
binding stay in :mod:`bearsdk.schedulers`, which re-exports
:func:`compile_scheduler` (``compile_policy`` is its old name), loading this
module on first use, so that reading and validating specs does not load the
replay and its compiled extension.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from bearsdk.replay import IMPLEMENTATION, Replayer, implementations

if TYPE_CHECKING:
    # Typing only: the scheduler package imports this module, not the reverse.
    from bearsdk.schedulers.spec import Policy

__all__ = ["compile_policy", "compile_scheduler"]


@functools.lru_cache(maxsize=256)
def _compile(p: Policy, implementation: str) -> Replayer:
    return implementations()[implementation](p)


def compile_scheduler(p: Policy, implementation: str | None = None) -> Replayer:
    """Return the (cached) replay loop for a bound scheduler spec.

    Args:
        p: The bound scheduler.
        implementation: ``"cython"`` or ``"python"``; default: the loaded one
            (see :data:`bearsdk.replay.IMPLEMENTATION`).

    Returns:
        A replayer for ``p``.

    Raises:
        KeyError: The requested implementation is not available.
    """
    impl = implementation or IMPLEMENTATION
    impls = implementations()
    if impl not in impls:
        raise KeyError(f"replay implementation {impl!r} is not available (have: {sorted(impls)})")
    return _compile(p, impl)


compile_policy = compile_scheduler  # the old name, kept for one release

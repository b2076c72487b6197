"""``async with`` for an object whose ``run`` serves until cancelled.

:class:`~bearsdk.router.AsyncRouter`, :class:`~bearsdk.emulator.core.EngineCore`,
:class:`~bearsdk.emulator.EmulatedEngine` and :class:`~bearsdk.emulator.EnginePool`
each have a ``run(*, task_status)`` that signals readiness through its
``task_status`` and then serves until cancelled, for
``await tg.start(obj.run)`` in a caller's task group. :class:`Runs` makes the same
object an async context manager: the block's own task group starts ``run`` and
the block begins once it is ready; leaving the block cancels it.

The task group is entered with ``async with`` and nothing else, so its rules are
anyio's own, but for two: a failure before readiness (a port in use) is raised
as it is, not in a group of one; and the block's own error, or a cancellation
from outside (Ctrl-C under ``asyncio.run``), leaves unchanged and never passes
through the group, so the code after the ``async with`` does not run as if the
block had finished. A failure of ``run`` while the block runs cancels the block
and is raised in an exception group, as anyio raises a child's error.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any, Self

import anyio
import anyio.abc

__all__ = ["Runs"]


class Runs(anyio.AsyncContextManagerMixin):
    """Mixin: ``async with obj`` runs ``obj.run`` for the duration of the block."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[Any]) -> None:
        """Serve until cancelled, calling ``task_status.started()`` once ready."""
        raise NotImplementedError

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[Self]:
        ready = False
        escaping: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.run)
                ready = True
                try:
                    yield self
                except BaseException as exc:
                    # Only a failing ``run`` cancels this group: then the group raises
                    # that failure. Anything else (the block's own error, a
                    # cancellation from outside) must leave as it is, even if the
                    # task's cancel count was reset on the way (by another library's
                    # cancel scope): handing it to the group could have it taken for
                    # the group's own cancellation, and swallowed.
                    if isinstance(exc, Exception) or not tg.cancel_scope.cancel_called:
                        escaping = exc
                    else:
                        raise
                # The block finished: stop serving (run only ends when cancelled).
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # ``run`` failed before it was ready (a port in use): raise that error
            # itself, not the group of one the task group wraps it in.
            if not ready and len(group.exceptions) == 1:
                first = group.exceptions[0]
                if isinstance(first, Exception):
                    raise first from None
            raise
        if escaping is not None:
            raise escaping

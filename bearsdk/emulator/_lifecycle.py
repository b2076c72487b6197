"""Entering and leaving an object whose ``run`` serves in a task group of its own.

:class:`~bearsdk.emulator.EmulatedEngine` and :class:`~bearsdk.emulator.EnginePool`
are both used as ``async with``: entering starts ``run`` (which signals readiness
through its ``task_status``) in a task group left open, leaving cancels it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

import anyio
import anyio.abc


async def start_running(run: Callable[..., Coroutine[Any, Any, Any]]) -> anyio.abc.TaskGroup:
    """Start ``run`` in a new task group and return the group, still open.

    If ``run`` fails before it is ready, the group is closed and that error raised.
    """
    tg = anyio.create_task_group()
    await tg.__aenter__()
    try:
        await tg.start(run)
    except BaseException as exc:
        tg.cancel_scope.cancel()
        with contextlib.suppress(BaseException):
            await tg.__aexit__(None, None, None)
        raise exc from None
    return tg


async def stop_running(
    tg: anyio.abc.TaskGroup,
    exc_type: type[BaseException] | None,
    exc: BaseException | None,
    tb: TracebackType | None,
) -> bool | None:
    """Cancel and close a group from :func:`start_running` (an ``__aexit__``).

    Never swallows the block's exception: a cancellation from outside (Ctrl-C
    under ``asyncio.run``) or an interrupt goes on up, so the code after the
    ``async with`` does not run as if the block had finished.
    """
    # Set only when a child failed: then the block's CancelledError is this
    # group's own, and the group's ``__aexit__`` turns it into the child's error.
    cancelled_by_child = tg.cancel_scope.cancel_called
    tg.cancel_scope.cancel()
    if isinstance(exc, Exception) or (exc is not None and not cancelled_by_child):
        # The block's own error, or a cancellation from outside, propagates as it
        # is, not wrapped in a group nor taken for this group's own cancellation.
        await tg.__aexit__(None, None, None)
        return None
    return await tg.__aexit__(exc_type, exc, tb)

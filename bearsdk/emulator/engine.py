"""The emulated vLLM instance: the engine core served over vLLM's HTTP API.

:class:`EmulatedEngine` is the composition users run (``async with
EmulatedEngine(cfg) as e: e.url``): an :class:`~bearsdk.emulator.core.EngineCore`
(scheduling, timing, snapshots, metrics, faults; no HTTP) and, unless
``serve_http=False``, an :class:`~bearsdk.emulator.server.HttpServer` built
around it. The server is loaded only when one is served, so the core and this
module need no aiohttp.

The configuration and request types live in ``config.py`` and ``requests.py``;
they are importable from here as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Self

import anyio
import anyio.abc
import attrs

from bearsdk.emulator.config import EngineConfig, EngineConfigError
from bearsdk.emulator.core import EngineCore
from bearsdk.emulator.loopstats import LoopStats
from bearsdk.emulator.requests import GenerationPlan, RequestHandle, RequestRecord

if TYPE_CHECKING:
    from bearsdk.emulator.server import HttpServer

__all__ = [
    "EmulatedEngine",
    "EngineConfig",
    "EngineConfigError",
    "EngineCore",
    "GenerationPlan",
    "LoopStats",
    "RequestHandle",
    "RequestRecord",
]


@attrs.define(eq=False)
class EmulatedEngine(EngineCore):
    """One emulated vLLM instance: the engine core and its HTTP API.

    Use as an async context manager (starts the loop and, unless
    ``serve_http=False``, the HTTP server on ``host:port``; stops both on exit),
    or run :meth:`run` in a task group with ``await tg.start(engine.run)``.
    Everything else (submitting requests, snapshots, metrics, faults) is the
    :class:`~bearsdk.emulator.core.EngineCore`'s.

    Args:
        config: How to run it.

    Raises:
        EngineConfigError: The configuration is invalid.
        KeyError: Unknown profile.
        SpecError: Unknown scheduler or bad policy parameter.
    """

    _http: HttpServer | None = attrs.field(init=False, default=None)

    @property
    def port(self) -> int:
        """The bound HTTP port (after start)."""
        if self._http is None:
            raise RuntimeError("the engine's HTTP server is not running")
        return self._http.port

    @property
    def url(self) -> str:
        """Base URL of the HTTP API (after start)."""
        host = self._config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def run(self, *, task_status: anyio.abc.TaskStatus[Self]) -> None:
        """Run the engine and its HTTP server until cancelled.

        Use with ``await task_group.start(engine.run)``: it reports ready once the
        port is bound and the loop runs.
        """
        if not self._config.serve_http:
            await super().run(task_status=task_status)
            return
        if self._running:
            raise RuntimeError("this engine is already running")
        from bearsdk.emulator.server import HttpServer

        # Bind before anything else runs, so that a port in use fails plainly.
        server = HttpServer(self)
        await server.start(self._config.host, self._config.port)
        self._http = server
        try:
            await super().run(task_status=task_status)
        finally:
            # The core has dropped its requests (their handlers end): now close.
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                await server.stop()

    async def restart(self, downtime_s: float = 0.0) -> None:
        """Emulate an engine restart.

        Every open connection drops, the port refuses connections for
        ``downtime_s``, and the engine comes back with no requests, a new
        ``epoch``, ``seq`` starting over at 0 and zeroed metrics.
        """
        self._reset_for_restart(downtime_s)
        if self._http is None:
            await anyio.sleep(downtime_s)
            return
        port = self._http.port
        await self._http.stop()
        await anyio.sleep(downtime_s)
        await self._http.start(self._config.host, port)

"""Running the gateway: listening socket, workers, signals, reloads and drains.

:func:`run_gateway` serves one process until told to stop; :func:`serve` is
``bearsdk serve``: it binds the port, starts ``workers - 1`` more processes on
it (``SO_REUSEPORT``: the kernel spreads connections among them) and runs the
first worker itself.

Signals, in every worker:

* ``SIGHUP`` (or a changed file, with ``[server] watch_s``): re-read the config
  and apply it without dropping anything: keys, groups and admission at once;
  new instances join, removed ones are drained and leave once idle, changed
  ones are drained and come back with their new settings once idle. A file
  that fails to decode changes nothing (one ERROR line).
* ``SIGTERM``: stop listening, answer 503 to new requests, let in-flight ones
  finish within ``drain_grace_s``, end the streams still running with an
  in-band error event, exit 0.
* ``SIGINT`` (Ctrl-C): the same without the grace period; exit 130.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
from aiohttp import web

from bearsdk.gateway.app import GATEWAY, Gateway, build_app
from bearsdk.gateway.config import GatewayConfig, load_gateway_config
from bearsdk.gateway.discovery import DnsDiscovery, Resolver
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig

__all__ = ["listen", "run_gateway", "serve"]

log = logging.getLogger("bearsdk.gateway")

# Seconds between checks for drained instances that can leave the pool.
_REAP_S = 0.25


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The gateway's listening socket.

    Raises:
        OSError: The address is in use or not this machine's.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def _router(cfg: GatewayConfig) -> AsyncRouter:
    from bearsdk.selectors import make_selector

    cluster = None
    if cfg.redis_url is not None:
        from bearsdk.cluster import Cluster

        cluster = Cluster.from_url(cfg.redis_url)
    selector = make_selector(cfg.router.selector, **dict(cfg.router.selector_params))
    r = cfg.router
    return AsyncRouter(
        list(cfg.instances),
        selector,
        retries=r.retries,
        cluster=cluster,
        tokenizers=dict(r.tokenizers) or None,
        dispatch_prefixes=r.dispatch_prefixes,
        expect_arrivals=r.expect_arrivals,
    )


@attrs.define
class _Pool:
    """The static pool across reloads: removed instances drain and leave once idle,
    changed ones drain and come back with their new settings once idle."""

    router: AsyncRouter
    running: dict[str, InstanceConfig]
    # Draining instances, each with the configuration it comes back with (None: gone).
    _leaving: dict[str, InstanceConfig | None] = attrs.field(factory=dict)

    async def apply(self, new: dict[str, InstanceConfig]) -> None:
        # Drains first, all before the first await: a removed or changed instance
        # takes no new request while the added ones wait for their sources to start.
        for name, cfg in self.running.items():
            want = new.get(name)
            if want == cfg:
                if name in self._leaving:  # back as it runs: routable again
                    del self._leaving[name]
                    self.router.undrain_instance(name)
                continue
            self.router.drain_instance(name)
            self._leaving[name] = want
        for name, cfg in new.items():
            if name not in self.running:
                self.running[name] = cfg
                await self.router.add_instance(cfg)

    async def reap(self) -> None:
        for name, replacement in list(self._leaving.items()):
            if self.router.inflight(name) > 0:
                continue
            del self._leaving[name]
            self.router.remove_instance(name)
            del self.running[name]
            if replacement is not None:
                self.running[name] = replacement
                await self.router.add_instance(replacement)


async def run_gateway(
    cfg: GatewayConfig,
    sock: socket.socket,
    *,
    ready: Callable[[str], None] | None = None,
    on_signal: Callable[[int], None] | None = None,
    handle_signals: bool = True,
    resolver: Resolver | None = None,
    task_status: anyio.abc.TaskStatus[Gateway] = anyio.TASK_STATUS_IGNORED,
) -> int:
    """Serve the gateway on ``sock`` until SIGTERM (0) or SIGINT (130).

    Args:
        cfg: The configuration (reloaded from ``cfg.source`` on SIGHUP).
        sock: A listening socket.
        ready: Called with the gateway's URL once it serves.
        on_signal: Called with each signal received (the first worker passes
            them on to the others).
        handle_signals: Install the signal handlers (only the main thread can;
            without them the gateway runs until cancelled).
        resolver: DNS discovery's resolver (default: the system's).
        task_status: Started with the :class:`Gateway` (tests drive it directly).
    """
    srv = cfg.server
    async with _router(cfg) as router:
        app = build_app(router, cfg)
        gw = app[GATEWAY]
        runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=srv.header_timeout_s,
            shutdown_timeout=1.0,
            max_line_size=srv.max_header_bytes,
            max_field_size=srv.max_header_bytes,
            max_headers=srv.max_headers,
        )
        await runner.setup()
        try:
            site = web.SockSite(runner, sock)
            await site.start()
            async with anyio.create_task_group() as tg:
                # Always running: a reload may add the first DNS source.
                discovery = DnsDiscovery(router, cfg.dns, resolver=resolver)
                await tg.start(discovery.run)
                await tg.start(gw.admission.run)
                pool = _Pool(router, {c.name: c for c in cfg.instances})
                stop = anyio.Event()
                status = [0]

                async def reload() -> None:
                    nonlocal cfg
                    if cfg.source is None:
                        return
                    try:
                        new = load_gateway_config(cfg.source)
                    except ConfigError as exc:
                        log.error("reload refused, the running config stays: %s", exc)
                        return
                    moved = [
                        f
                        for f in ("host", "port", "workers")
                        if getattr(new.server, f) != getattr(cfg.server, f)
                    ]
                    if moved:
                        log.warning("reload: [server] %s take effect at restart", ", ".join(moved))
                    if new.router.at_start() != cfg.router.at_start():
                        log.warning(
                            "reload: [router] tokenizers, dispatch_prefixes and "
                            "expect_arrivals take effect at restart"
                        )
                    try:
                        gw.reconfigure(new)
                    except ConfigError as exc:
                        log.error("reload refused, the running config stays: %s", exc)
                        return
                    await pool.apply({c.name: c for c in new.instances})
                    discovery.replace(new.dns)
                    cfg = new
                    log.info("reloaded %s", cfg.source)

                async def on_signals() -> None:
                    with anyio.open_signal_receiver(
                        signal.SIGHUP, signal.SIGTERM, signal.SIGINT
                    ) as signals:
                        async for signum in signals:
                            if on_signal is not None:
                                on_signal(signum)
                            if signum == signal.SIGHUP:
                                await reload()
                                continue
                            status[0] = 130 if signum == signal.SIGINT else 0
                            stop.set()
                            return

                async def reaper() -> None:
                    while True:
                        await anyio.sleep(_REAP_S)
                        await pool.reap()

                async def watch() -> None:
                    src = cfg.source
                    if src is None or srv.watch_s <= 0:
                        return
                    seen = _mtime(src)
                    while True:
                        await anyio.sleep(srv.watch_s)
                        now = _mtime(src)
                        if now != seen:
                            seen = now
                            await reload()

                if handle_signals:
                    tg.start_soon(on_signals)
                tg.start_soon(reaper)
                tg.start_soon(watch)
                host, port = sock.getsockname()[:2]
                url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
                if ready is not None:
                    ready(url)
                task_status.started(gw)
                await stop.wait()
                # Stop listening first, so a load balancer moves on while we drain.
                await site.stop()
                grace = srv.drain_grace_s if status[0] == 0 else 0.0
                cut = await gw.drain(grace)
                if cut:
                    log.warning(
                        "drain: %d stream(s) still running after %.1f s were ended", cut, grace
                    )
                tg.cancel_scope.cancel()
            return status[0]
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return -1.0


def backend_options(cfg: GatewayConfig) -> dict[str, Any]:
    """anyio's asyncio options for ``[server] event_loop``."""
    choice = cfg.server.event_loop
    if choice == "auto":
        choice = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return {"use_uvloop": choice == "uvloop"}


def _worker(path: str, host: str, port: int, index: int, plugins: str) -> None:
    # A spawned worker: its own interpreter, its own socket on the shared port.
    if plugins:
        os.environ["BEARSDK_PLUGINS"] = plugins
        from bearsdk.cli import load_plugins

        load_plugins(plugins.split(","))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C arrives as SIGTERM
    logging.basicConfig(level=logging.INFO, format=f"[worker {index}] %(message)s")
    cfg = load_gateway_config(path)
    sock = listen(host, port, reuse_port=True)
    status = anyio.run(run_gateway, cfg, sock, backend_options=backend_options(cfg))
    sys.exit(status)


def serve(
    cfg: GatewayConfig,
    *,
    ready: Callable[[str], None] | None = None,
) -> int:
    """``bearsdk serve``: bind, start the other workers, run the first one here.

    Returns:
        0 after SIGTERM, 130 after Ctrl-C.

    Raises:
        OSError: The address cannot be bound.
    """
    srv = cfg.server
    workers = srv.workers
    sock = listen(srv.host, srv.port, reuse_port=workers > 1)
    port = sock.getsockname()[1]
    procs: list[Any] = []
    if workers > 1:
        if cfg.source is None:
            raise ConfigError("server: workers > 1 needs the config in a file (workers re-read it)")
        if cfg.redis_url is None:
            log.warning(
                "%d workers without [cluster] redis_url: each routes without seeing the "
                "others' dispatches until the engines' snapshots show them",
                workers,
            )
        ctx = multiprocessing.get_context("spawn")
        plugins = os.environ.get("BEARSDK_PLUGINS", "")
        for i in range(1, workers):
            p = ctx.Process(
                target=_worker, args=(str(cfg.source), srv.host, port, i, plugins), daemon=False
            )
            p.start()
            procs.append(p)
    try:

        def forward(signum: int) -> None:
            # Ctrl-C reaches the workers as SIGTERM: they drain, the first one stops.
            sig = signal.SIGTERM if signum == signal.SIGINT else signum
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, sig)

        status: int = anyio.run(
            _serve_here, cfg, sock, ready, forward, backend_options=backend_options(cfg)
        )
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(timeout=srv.drain_grace_s + 10.0)
            if p.is_alive():
                p.kill()
    return status


async def _serve_here(
    cfg: GatewayConfig,
    sock: socket.socket,
    ready: Callable[[str], None] | None,
    forward: Callable[[int], None],
) -> int:
    return await run_gateway(cfg, sock, ready=ready, on_signal=forward)

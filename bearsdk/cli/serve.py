"""``bearsdk serve``: the OpenAI-compatible gateway around AsyncRouter.

``bearsdk serve --config gateway.toml`` serves ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` over the configured pool, with keys,
budgets, admission, ``/metrics``, ``/healthz`` and ``/readyz``
(``docs/gateway.md``). ``--check`` decodes the file and exits;
``--hash-key`` prints the stored form of an API key read from standard input
(or of a new random key, which it prints first).
"""

from __future__ import annotations

import argparse
import logging
import sys

import attrs

from bearsdk.cli import nonnegative_int, positive_int

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "serve",
        help="the OpenAI-compatible gateway: BEAR routing for any client, as a process",
        description=(
            "Serve OpenAI's chat and completion endpoints over a pool of vLLM instances, "
            "each request routed by BEAR; API keys with budgets, admission on predicted "
            "TTFT, Prometheus metrics, reloads on SIGHUP, drains on SIGTERM."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="gateway.toml (see docs/gateway.md)")
    p.add_argument("--host", help="address to bind (overrides [server] host)")
    p.add_argument("--port", type=nonnegative_int, help="port (overrides [server] port; 0: any)")
    p.add_argument("--workers", type=positive_int, help="processes (overrides [server] workers)")
    p.add_argument("--check", action="store_true", help="decode the config and exit")
    p.add_argument(
        "--hash-key",
        action="store_true",
        help="print the stored form of the API key on standard input (none: a new key)",
    )
    p.set_defaults(func=_run)


def _hash_key() -> int:
    from bearsdk.gateway.keys import hash_key, new_key

    secret = "" if sys.stdin.isatty() else sys.stdin.readline().strip()
    if not secret:
        secret = new_key()
        print(f"key:  {secret}")
    print(f"hash: {hash_key(secret)}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from bearsdk.errors import BearError

    if args.hash_key:
        return _hash_key()
    if not args.config:
        raise BearError("--config FILE is required (see docs/gateway.md)")
    from bearsdk.gateway.config import load_gateway_config
    from bearsdk.gateway.server import serve

    cfg = load_gateway_config(args.config)
    over = {
        k: v
        for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers))
        if v is not None
    }
    if over:
        cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, **over))
    if args.check:
        n = len(cfg.instances)
        print(
            f"{args.config}: ok ({n} instance{'s' if n != 1 else ''}, {len(cfg.dns)} DNS "
            f"source(s), {len(cfg.groups)} group(s), {len(cfg.keys)} key(s), "
            f"admission {cfg.admission.mode})"
        )
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cfg.keys and cfg.server.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("bearsdk.gateway").warning(
            "no [[keys]]: anyone who reaches %s can use the pool", cfg.server.host
        )

    from bearsdk.gateway.server import backend_options

    loop = "uvloop" if backend_options(cfg)["use_uvloop"] else "asyncio"

    def ready(url: str) -> None:
        print(f"bearsdk serve: {url} ({cfg.server.workers} worker(s), {loop})", flush=True)

    try:
        status = serve(cfg, ready=ready)
    except OSError as exc:
        raise BearError(
            f"cannot listen on {cfg.server.host}:{cfg.server.port}: {exc.strerror or exc}"
        ) from None
    if status == 130:
        raise KeyboardInterrupt
    return status

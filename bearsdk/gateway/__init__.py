"""``bearsdk serve``: an OpenAI-compatible gateway around :class:`~bearsdk.AsyncRouter`.

For the teams that do not embed Python: any OpenAI client talks to the gateway
as to one server, and each request goes where BEAR sends it. The parts, one
job each:

* :mod:`~bearsdk.gateway.config`: ``gateway.toml``, decoded strictly;
* :mod:`~bearsdk.gateway.bodies`: request bodies and target headers;
* :mod:`~bearsdk.gateway.keyspec`: API keys (salted hashes), per-key models
  and limits, decoded strictly;
* :mod:`~bearsdk.gateway.keys`: the keys at run time: authentication, request
  and token budgets, concurrency caps;
* :mod:`~bearsdk.gateway.admission`: best-effort, reject or queue when no
  instance is predicted on time;
* :mod:`~bearsdk.gateway.dns`: DNS sources (A/AAAA or SRV) and resolvers;
* :mod:`~bearsdk.gateway.discovery`: instances from DNS, added and drained;
* :mod:`~bearsdk.gateway.state`: the state behind one gateway process;
* :mod:`~bearsdk.gateway.app`: the HTTP endpoints;
* :mod:`~bearsdk.gateway.server`: workers, signals, reloads, drains.

``docs/gateway.md`` is the reference. Names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bearsdk.gateway.app import build_app
    from bearsdk.gateway.config import GatewayConfig, load_gateway_config
    from bearsdk.gateway.keys import KeyRing, KeySpec, hash_key
    from bearsdk.gateway.server import run_gateway, serve
    from bearsdk.gateway.state import Gateway

__all__ = [
    "Gateway",
    "GatewayConfig",
    "KeyRing",
    "KeySpec",
    "build_app",
    "hash_key",
    "load_gateway_config",
    "run_gateway",
    "serve",
]

_WHERE = {
    "Gateway": "state",
    "build_app": "app",
    "GatewayConfig": "config",
    "load_gateway_config": "config",
    "KeyRing": "keys",
    "KeySpec": "keys",
    "hash_key": "keys",
    "run_gateway": "server",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'bearsdk.gateway' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bearsdk.gateway.{module}"), name)
    globals()[name] = value
    return value

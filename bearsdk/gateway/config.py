"""The gateway's configuration file (``gateway.toml``), decoded strictly.

Every section, key and value is checked when the file is read (at start and at
each reload): an unknown key is an error with a "did you mean", a bad value an
error naming the section, the key and the value. A reload that fails to decode
changes nothing. The full reference is ``docs/gateway.md``.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from bearsdk.router.config import (
    ConfigError,
    InstanceConfig,
    load_pool_config,
)
from bearsdk.router.errors import short

__all__ = [
    "ADMISSION_MODES",
    "AdmissionConfig",
    "GatewayConfig",
    "GroupConfig",
    "RouterSection",
    "ServerConfig",
    "load_gateway_config",
]

ADMISSION_MODES: Final = ("best-effort", "reject", "queue")
"""What the gateway does with a request no instance is predicted to serve on time."""

AdmissionMode = Literal["best-effort", "reject", "queue"]

EVENT_LOOPS: Final = ("auto", "uvloop", "asyncio")
"""``[server] event_loop``: uvloop halves the gateway's own cost per request."""

# The group every pool has unless the file defines one of that name: all instances.
DEFAULT_GROUP: Final = "auto"


class _Table:
    """Reads one TOML table strictly: each key once, typed and bounded; unknown keys refused."""

    def __init__(self, where: str, raw: object) -> None:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a table (got {short(raw)})")
        self.where = where
        self.raw = raw
        self.read: set[str] = set()

    def _get(self, key: str) -> Any:
        self.read.add(key)
        return self.raw.get(key)

    def has(self, key: str) -> bool:
        return key in self.raw

    def number(self, key: str, default: float, lo: float, hi: float) -> float:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not (lo <= v <= hi):
            raise ConfigError(
                f"{self.where}: {key} must be a number in [{lo:g}, {hi:g}] (got {short(v)})"
            )
        return float(v)

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int) or not (lo <= v <= hi):
            raise ConfigError(
                f"{self.where}: {key} must be an integer in [{lo}, {hi}] (got {short(v)})"
            )
        return v

    def string(self, key: str, default: str, *, choices: Sequence[str] = ()) -> str:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, str) or not v or len(v) > 4096:
            raise ConfigError(f"{self.where}: {key} must be a non-empty string (got {short(v)})")
        if choices and v not in choices:
            raise ConfigError(
                f"{self.where}: {key} must be one of {', '.join(choices)} (got {short(v)})"
            )
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self._get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: {key} must be true or false (got {short(v)})")
        return v

    def names(self, key: str) -> tuple[str, ...]:
        v = self._get(key)
        if v is None:
            return ()
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise ConfigError(f"{self.where}: {key} must be a list of names (got {short(v)})")
        return tuple(dict.fromkeys(v))

    def table(self, key: str) -> Mapping[str, Any]:
        v = self._get(key)
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            raise ConfigError(f"{self.where}: {key} must be a table (got {short(v)})")
        return v

    def done(self) -> None:
        for key in self.raw:
            if key not in self.read:
                known = sorted(self.read)
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{self.where}: {key} is not a known key{hint} (known: {', '.join(known)})"
                )


def _known(table: _Table, *keys: str) -> None:
    table.read.update(keys)


@attrs.frozen
class ServerConfig:
    """``[server]``: where the gateway listens and how much it accepts.

    Attributes:
        host: Address to bind (``127.0.0.1`` unless told otherwise).
        port: TCP port (0: any free port, printed at start).
        workers: Processes sharing the port (``SO_REUSEPORT``), one per core.
        max_body_bytes: Largest request body (larger: 413 before it is read).
        max_header_bytes: Largest request line or header field.
        max_headers: Most header fields in one request.
        header_timeout_s: A connection idle this long (no complete request
            head, or an idle keep-alive) is closed.
        body_timeout_s: Longest time to receive a request body.
        drain_grace_s: On SIGTERM, how long in-flight requests may take to
            finish before they are ended with an error.
        decision_history: Decisions kept for ``GET /bear/decisions/{id}``.
        access_log: One JSON line per request on the ``bearsdk.gateway.access``
            logger (stderr by default).
        watch_s: Re-read the config file when it changes, checking this often
            (0: only on SIGHUP).
        event_loop: ``auto`` (uvloop when installed, else asyncio's own),
            ``uvloop`` or ``asyncio``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 16 << 10
    max_headers: int = 128
    header_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    drain_grace_s: float = 30.0
    decision_history: int = 10_000
    access_log: bool = True
    watch_s: float = 0.0
    event_loop: str = "auto"


@attrs.frozen
class RouterSection:
    """``[router]``: the AsyncRouter behind the gateway.

    Attributes:
        selector: A registered selector name (``bear``, ``lagrangian``...).
        selector_params: Its parameters (``lam``...).
        retries: Further instances tried when one fails before answering.
        ttft_target_ms: TTFT target of requests that carry none (0: the
            paper's rule by prompt length).
        max_timeout_s: Longest time a request may take, first byte to last.
        tokenizers: Per model, its Hugging Face model directory (tokenizer and
            chat template; the ``tokenizers`` extra): requests are tokenized as
            the engines do, and BEA prices each instance's cached prefix
            (``docs/prefix-caching.md``). Read at start.
        dispatch_prefixes: Without tokenizers or KV events, estimate cached
            prefixes from what was sent where (approximate). Read at start.
        expect_arrivals: Fold the prompts still to come into TTFT estimates.
            Read at start.
    """

    selector: str = "bear"
    selector_params: tuple[tuple[str, Any], ...] = ()
    retries: int = 2
    ttft_target_ms: float = 0.0
    max_timeout_s: float = 600.0
    tokenizers: tuple[tuple[str, str], ...] = ()
    dispatch_prefixes: bool = False
    expect_arrivals: bool = False

    def at_start(self) -> tuple[object, ...]:
        """What a reload cannot change (the router is built with it)."""
        return (self.tokenizers, self.dispatch_prefixes, self.expect_arrivals)


@attrs.frozen
class AdmissionConfig:
    """``[admission]``: requests no instance is predicted to serve on time.

    Attributes:
        mode: ``best-effort`` (send to the selector's fallback choice),
            ``reject`` (429 with ``Retry-After`` from the predicted drain time),
            or ``queue`` (hold, re-decide as snapshots arrive, give up at the
            deadline with a 429).
        queue_size: Most requests held at once (beyond: rejected).
        max_wait_ms: Longest a held request waits (0: its TTFT target).
        recheck_ms: How often a held request is decided again.
    """

    mode: AdmissionMode = "best-effort"
    queue_size: int = 1024
    max_wait_ms: float = 0.0
    recheck_ms: float = 10.0


@attrs.frozen
class GroupConfig:
    """``[[groups]]``: a name a client may put in ``model``, routed among its members.

    Attributes:
        name: The name clients send.
        models: Member models (every instance serving one is a member).
        instances: Member instances by name.
    """

    name: str
    models: tuple[str, ...] = ()
    instances: tuple[str, ...] = ()

    def members(self, pool: Sequence[InstanceConfig]) -> frozenset[str]:
        """Names of the instances of ``pool`` in the group."""
        models = set(self.models)
        names = set(self.instances)
        return frozenset(
            c.name for c in pool if c.name in names or c.model in models or c.engine_model in models
        )


@attrs.frozen
class GatewayConfig:
    """A decoded ``gateway.toml``.

    Attributes:
        server: ``[server]``.
        router: ``[router]``.
        admission: ``[admission]``.
        instances: The static pool (``[[instances]]``, or the ``pool`` file).
        groups: ``[[groups]]``, with ``auto`` (every instance) added unless defined.
        default_model: The group or model of requests that name none.
        keys: ``[[keys]]`` (:class:`~bearsdk.gateway.keys.KeySpec`); none: no
            authentication (only sensible on loopback).
        dns: ``[[discovery.dns]]`` (:class:`~bearsdk.gateway.discovery.DnsSource`).
        redis_url: ``[cluster] redis_url``: share state with the other workers
            and replicas over Redis.
        source: The file it was read from (reloads read it again).
    """

    server: ServerConfig = ServerConfig()
    router: RouterSection = RouterSection()
    admission: AdmissionConfig = AdmissionConfig()
    instances: tuple[InstanceConfig, ...] = ()
    groups: tuple[GroupConfig, ...] = ()
    default_model: str = DEFAULT_GROUP
    keys: tuple[Any, ...] = ()
    dns: tuple[Any, ...] = ()
    redis_url: str | None = None
    source: Path | None = None

    def group(self, name: str) -> GroupConfig | None:
        """The group called ``name``, if any."""
        return next((g for g in self.groups if g.name == name), None)


def _server(raw: object) -> ServerConfig:
    t = _Table("server", raw)
    out = ServerConfig(
        host=t.string("host", "127.0.0.1"),
        port=t.integer("port", 8000, 0, 65535),
        workers=t.integer("workers", 1, 1, 256),
        max_body_bytes=t.integer("max_body_bytes", 8 << 20, 1024, 1 << 30),
        max_header_bytes=t.integer("max_header_bytes", 16 << 10, 1024, 1 << 20),
        max_headers=t.integer("max_headers", 128, 8, 4096),
        header_timeout_s=t.number("header_timeout_s", 15.0, 0.1, 3600.0),
        body_timeout_s=t.number("body_timeout_s", 30.0, 0.1, 3600.0),
        drain_grace_s=t.number("drain_grace_s", 30.0, 0.0, 3600.0),
        decision_history=t.integer("decision_history", 10_000, 0, 10_000_000),
        access_log=t.flag("access_log", True),
        watch_s=t.number("watch_s", 0.0, 0.0, 3600.0),
        event_loop=t.string("event_loop", "auto", choices=EVENT_LOOPS),
    )
    t.done()
    if out.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise ConfigError(
            "server: event_loop = 'uvloop' needs uvloop: pip install 'bearsdk[gateway]'"
        )
    return out


def _router(raw: object) -> RouterSection:
    t = _Table("router", raw)
    from bearsdk.selectors import SELECTORS

    selector = t.string("selector", "bear", choices=tuple(SELECTORS))
    params = t.table("selector_params")
    out = RouterSection(
        selector=selector,
        selector_params=tuple(sorted(params.items())),
        retries=t.integer("retries", 2, 0, 64),
        ttft_target_ms=t.number("ttft_target_ms", 0.0, 0.0, 3_600_000.0),
        max_timeout_s=t.number("max_timeout_s", 600.0, 0.01, 86_400.0),
        tokenizers=_tokenizer_dirs(t.table("tokenizers")),
        dispatch_prefixes=t.flag("dispatch_prefixes", False),
        expect_arrivals=t.flag("expect_arrivals", False),
    )
    t.done()
    # Build it once now, so a bad parameter fails at load time, not at start.
    from bearsdk.selectors import SelectorError, make_selector

    try:
        make_selector(out.selector, **dict(out.selector_params))
    except SelectorError as exc:
        raise ConfigError(f"router: {exc}") from None
    return out


def _tokenizer_dirs(raw: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """``[router] tokenizers``: model -> an existing model directory or tokenizer.json."""
    out = []
    for model, path in raw.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(
                f"router: tokenizers.{model} must be a model directory (got {short(path)})"
            )
        if not Path(path).exists():
            raise ConfigError(f"router: tokenizers.{model}: {path} does not exist")
        out.append((str(model), path))
    return tuple(sorted(out))


def _admission(raw: object) -> AdmissionConfig:
    t = _Table("admission", raw)
    mode = t.string("mode", "best-effort", choices=ADMISSION_MODES)
    out = AdmissionConfig(
        mode=mode,  # type: ignore[arg-type]  # checked against ADMISSION_MODES
        queue_size=t.integer("queue_size", 1024, 1, 1_000_000),
        max_wait_ms=t.number("max_wait_ms", 0.0, 0.0, 3_600_000.0),
        recheck_ms=t.number("recheck_ms", 10.0, 1.0, 10_000.0),
    )
    t.done()
    return out


def _groups(
    raw: object, pool: Sequence[InstanceConfig], dns: Sequence[Any]
) -> tuple[GroupConfig, ...]:
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ConfigError(f"groups must be an array of tables (got {short(raw)})")
    models = {c.model for c in pool} | {c.engine_model for c in pool}
    for src in dns:
        model = dict(src.template).get("model")
        if isinstance(model, str):
            models.add(model)
    names = {c.name for c in pool}
    out: list[GroupConfig] = []
    for i, g in enumerate(raw):
        t = _Table(f"groups[{i}]", g)
        name = t.string("name", "")
        if not name:
            raise ConfigError(f"groups[{i}]: name is required")
        t.where = f"group {name!r}"
        group = GroupConfig(name=name, models=t.names("models"), instances=t.names("instances"))
        t.done()
        if not group.models and not group.instances:
            raise ConfigError(f"group {name!r}: needs models or instances")
        for m in group.models:
            if m not in models:
                raise ConfigError(
                    f"group {name!r}: model {m!r} is served by no instance "
                    f"(served: {', '.join(sorted(models)) or 'none'})"
                )
        for n in group.instances:
            if n not in names:
                raise ConfigError(f"group {name!r}: instance {n!r} is not in the pool")
        if any(o.name == name for o in out):
            raise ConfigError(f"group {name!r}: duplicate name")
        out.append(group)
    if not any(g.name == DEFAULT_GROUP for g in out):
        out.append(GroupConfig(name=DEFAULT_GROUP, models=tuple(sorted(models))))
    return tuple(out)


def gateway_config_from_dict(doc: Mapping[str, Any], source: Path | None = None) -> GatewayConfig:
    """Decode a parsed ``gateway.toml``.

    Raises:
        ConfigError: Anything unknown or out of bounds, named with its value.
    """
    from bearsdk.gateway.discovery import dns_source_from_dict
    from bearsdk.gateway.keys import keys_from_list

    top = _Table("gateway", doc)
    server = _server(top.table("server"))
    router = _router(top.table("router"))
    admission = _admission(top.table("admission"))
    _known(top, "instances", "pool", "groups", "keys", "discovery", "cluster", "default_model")
    if top.has("instances") and top.has("pool"):
        raise ConfigError("gateway: give instances or pool, not both")
    instances: list[InstanceConfig] = []
    if top.has("pool"):
        pool = top.raw["pool"]
        if not isinstance(pool, str) or not pool:
            raise ConfigError(f"gateway: pool must be a file name (got {short(pool)})")
        path = Path(pool)
        if not path.is_absolute() and source is not None:
            path = source.parent / path
        try:
            instances = load_pool_config(path)
        except OSError as exc:
            raise ConfigError(f"gateway: pool {pool}: {exc.strerror or exc}") from None
    elif top.has("instances"):
        raw = top.raw["instances"]
        if not isinstance(raw, list):
            raise ConfigError(f"gateway: instances must be an array of tables (got {short(raw)})")
        if raw:  # decoded as a pool file's: the same fields, checks and messages
            instances = load_pool_config({"instances": raw})
    for inst in instances:
        inst.batch_time_model()  # an unknown profile fails at load time
    disc = _Table("discovery", top.raw.get("discovery", {}))
    raw_dns = disc.raw.get("dns", [])
    _known(disc, "dns")
    disc.done()
    if not isinstance(raw_dns, list):
        raise ConfigError(f"discovery: dns must be an array of tables (got {short(raw_dns)})")
    dns = tuple(dns_source_from_dict(d, f"discovery.dns[{i}]") for i, d in enumerate(raw_dns))
    if not instances and not dns:
        raise ConfigError("gateway: no instances: give [[instances]], pool or [[discovery.dns]]")
    groups = _groups(top.raw.get("groups"), instances, dns)
    models = {c.model for c in instances} | {c.engine_model for c in instances}
    models |= {m for s in dns if isinstance(m := dict(s.template).get("model"), str)}
    routable = models | {g.name for g in groups}
    default_model = top.raw.get("default_model", DEFAULT_GROUP)
    if not isinstance(default_model, str) or default_model not in routable:
        raise ConfigError(
            f"gateway: default_model must be a group or a served model (got {short(default_model)})"
        )
    keys = keys_from_list(top.raw.get("keys", []))
    for key in keys:
        for m in key.models:
            if m not in routable:
                raise ConfigError(
                    f"key {key.name!r}: model {m!r} is neither a group nor a served model"
                )
    cluster = _Table("cluster", top.raw.get("cluster", {}))
    redis_url = cluster.raw.get("redis_url")
    _known(cluster, "redis_url")
    cluster.done()
    if redis_url is not None and not (
        isinstance(redis_url, str) and redis_url.split("://", 1)[0] in ("redis", "rediss", "unix")
    ):
        raise ConfigError(f"cluster: redis_url must be a redis:// URL (got {short(redis_url)})")
    top.done()
    return GatewayConfig(
        server=server,
        router=router,
        admission=admission,
        instances=tuple(instances),
        groups=groups,
        default_model=default_model,
        keys=keys,
        dns=dns,
        redis_url=redis_url,
        source=source,
    )


def load_gateway_config(path: str | Path) -> GatewayConfig:
    """Read and decode a ``gateway.toml``.

    Raises:
        ConfigError: The file cannot be read, is not TOML, or holds a bad value.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    return gateway_config_from_dict(doc, source=p)


def ttft_target_s(cfg: GatewayConfig) -> float | None:
    """The default TTFT target in seconds, or ``None`` for the paper's rule."""
    ms = cfg.router.ttft_target_ms
    return None if ms <= 0 or not math.isfinite(ms) else ms / 1e3

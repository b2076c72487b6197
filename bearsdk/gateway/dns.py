"""DNS sources and resolvers: the names discovery resolves, and how.

A :class:`DnsSource` is one ``[[discovery.dns]]`` table, decoded strictly by
:func:`dns_source_from_dict`: a DNS name (A/AAAA, or SRV), the instances'
port and scheme, how often to resolve it, and the template every discovered
instance is configured from. A :class:`Resolver` answers the lookups:
:class:`SystemResolver` (the operating system; ``aiodns`` for SRV records) or
:class:`StaticResolver` (in memory, for tests and records pinned by hand).
Which instances the answers become, and when, is
:mod:`bearsdk.gateway.discovery`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import ipaddress
import math
import re
import socket
import types
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, Protocol

import anyio
import anyio.lowlevel
import attrs

from bearsdk._validators import unknown_field
from bearsdk.errors import short_repr
from bearsdk.router.config import ConfigError, InstanceConfig, instance_from_dict

__all__ = [
    "DnsSource",
    "Resolver",
    "StaticResolver",
    "SystemResolver",
    "dns_source_from_dict",
    "require_srv_support",
]

MAX_HOST_CHARS: Final = 253
"""Longest DNS name (RFC 1035), for sources' hosts and SRV targets."""
MIN_INTERVAL_S: Final = 0.05
MAX_INTERVAL_S: Final = 3600.0
MAX_INSTANCES_LIMIT: Final = 4096
"""Largest ``max_instances`` a source may ask for."""

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_LABEL: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
_FIELDS: Final = (
    "name",
    "host",
    "record",
    "port",
    "scheme",
    "interval_s",
    "template",
    "max_instances",
)
# Set per instance from the record, never by the template.
_NOT_IN_TEMPLATE: Final = ("name", "url", "snapshot_url", "shm_name")
_PLACEHOLDER_URL: Final = "http://127.0.0.1:1"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _valid_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def _valid_host(host: str) -> bool:
    if not host or len(host) > MAX_HOST_CHARS:
        return False
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return True
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    return all(_LABEL.match(label) for label in labels)


def _ip(value: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``value`` as an address usable in a URL, else ``None``."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return None
    # A zone (fe80::1%eth0) only means something on this host's links.
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return None
    return ip


def _frozen(value: object) -> object:
    # A copy: the caller's dict may change after the source was validated.
    if isinstance(value, Mapping):
        return types.MappingProxyType(copy.deepcopy(dict(value)))
    return value


def require_srv_support(where: str = "SRV discovery") -> None:
    """Check that SRV records can be resolved here (they need ``aiodns``).

    Raises:
        ConfigError: ``aiodns`` is not installed.
    """
    try:
        importlib.import_module("aiodns")
    except ImportError:
        raise ConfigError(
            f'{where}: record = "SRV" needs the aiodns package, which is not installed '
            '(pip install aiodns), or record = "A" with a port'
        ) from None


@attrs.frozen
class DnsSource:
    """A DNS name whose records are instances of one configuration.

    Attributes:
        name: The source's name; its instances are named
            ``"{name}/{address}:{port}"``.
        host: For ``"A"``, a host name resolved to its A and AAAA records; for
            ``"SRV"``, the SRV name (``_http._tcp.vllm.default.svc.cluster.local``),
            whose targets are then resolved to their addresses.
        record: ``"A"`` or ``"SRV"``.
        port: The instances' port: required for ``"A"``, absent for ``"SRV"``
            (the records give it).
        scheme: ``"http"`` or ``"https"``.
        interval_s: How often the name is resolved again, in
            [:data:`MIN_INTERVAL_S`, :data:`MAX_INTERVAL_S`].
        max_instances: Most instances taken from one answer (the lowest
            addresses, then ports); in [1, :data:`MAX_INSTANCES_LIMIT`].
        template: :class:`~bearsdk.router.InstanceConfig` fields of every
            instance (``model``, ``profile``, ``scheduler``...), except
            ``name``, ``url`` and ``snapshot_url``, which come from the record;
            ``snapshot_port`` gives each instance a ``snapshot_url`` on that
            port of its address (the vLLM plugin's side server).

    Raises:
        ConfigError: A field out of bounds, or a template that does not make a
            valid instance (checked by building one).
    """

    name: str
    host: str
    record: Literal["A", "SRV"] = "A"
    port: int | None = None
    scheme: Literal["http", "https"] = "http"
    interval_s: float = 5.0
    max_instances: int = 256
    template: Mapping[str, Any] = attrs.field(kw_only=True, converter=_frozen, hash=False)
    _prototype: InstanceConfig = attrs.field(init=False, eq=False, repr=False, hash=False)

    def __attrs_post_init__(self) -> None:
        name: object = self.name
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(
                "dns source name must be 1 to 63 letters, digits, '_', '.' or '-', "
                f"starting with a letter or digit (got {short_repr(name)})"
            )
        label = f"dns source {name!r}"

        def bad(field: str, must: str, value: object) -> ConfigError:
            return ConfigError(f"{label}: {field} must be {must} (got {short_repr(value)})")

        host: object = self.host
        if not isinstance(host, str) or not _valid_host(host):
            raise bad(
                "host", f"a DNS name or an IP address of at most {MAX_HOST_CHARS} chars", host
            )
        if self.record not in ("A", "SRV"):
            raise bad("record", "'A' or 'SRV'", self.record)
        if self.record == "A" and not _valid_port(self.port):
            raise bad("port", 'an integer in [1, 65535] with record = "A"', self.port)
        if self.record == "SRV" and self.port is not None:
            raise bad("port", 'absent with record = "SRV"', self.port)
        if self.scheme not in ("http", "https"):
            raise bad("scheme", "'http' or 'https'", self.scheme)
        iv: object = self.interval_s
        if not (
            isinstance(iv, int | float)
            and not isinstance(iv, bool)
            and math.isfinite(iv)
            and MIN_INTERVAL_S <= iv <= MAX_INTERVAL_S
        ):
            raise bad("interval_s", f"a number in [{MIN_INTERVAL_S}, {MAX_INTERVAL_S:g}]", iv)
        if not _is_int(self.max_instances) or not 1 <= self.max_instances <= MAX_INSTANCES_LIMIT:
            raise bad(
                "max_instances", f"an integer in [1, {MAX_INSTANCES_LIMIT}]", self.max_instances
            )
        object.__setattr__(self, "_prototype", self._check_template(label))

    def _check_template(self, label: str) -> InstanceConfig:
        tpl: object = self.template
        if not isinstance(tpl, Mapping):
            raise ConfigError(f"{label}: template must be a table (got {short_repr(tpl)})")
        for key in _NOT_IN_TEMPLATE:
            if key in tpl:
                why = "use snapshot_port" if key == "snapshot_url" else "each record gives its own"
                raise ConfigError(f"{label}: template: {key} is not allowed ({why})")
        fields = dict(tpl)
        if "snapshot_port" in fields:
            sp = fields.pop("snapshot_port")
            if not _valid_port(sp):
                raise ConfigError(
                    f"{label}: template: snapshot_port must be an integer in [1, 65535] "
                    f"(got {short_repr(sp)})"
                )
        if fields.get("snapshots") == "shm":
            # One segment name per engine on this host: not a fleet behind a DNS name.
            raise ConfigError(
                f"{label}: template: snapshots = 'shm' cannot be discovered "
                "(shared memory is for an engine on this host): use push, poll or metrics"
            )
        fields["name"] = tmp = f"{self.name}/template"
        fields["url"] = _PLACEHOLDER_URL
        prefix = f"instance {tmp!r}: "
        try:
            proto = instance_from_dict(fields, f"{label}: template")
            proto.batch_time_model()  # an unknown profile fails now, not at the first record
        except ConfigError as exc:
            msg = str(exc)
            msg = msg.removeprefix(prefix)
            raise ConfigError(f"{label}: template: {msg}") from None
        return proto

    def instance_config(self, address: str, port: int) -> InstanceConfig:
        """The configuration of the instance a record gives.

        Args:
            address: Its IP address.
            port: Its port.
        """
        host = f"[{address}]" if ":" in address else address
        snapshot_port = self.template.get("snapshot_port")
        return attrs.evolve(
            self._prototype,
            name=f"{self.name}/{host}:{port}",
            url=f"{self.scheme}://{host}:{port}",
            snapshot_url=(
                None if snapshot_port is None else f"{self.scheme}://{host}:{snapshot_port}"
            ),
        )


def dns_source_from_dict(d: Mapping[str, Any], where: str = "discovery.dns[0]") -> DnsSource:
    """Build a :class:`DnsSource` from its dict form (a ``[[discovery.dns]]`` table), strictly.

    Args:
        d: The table.
        where: Where it is, for messages about it before its name is known.

    Raises:
        ConfigError: Unknown or missing keys, a bad value, a template that does
            not make a valid instance, or ``record = "SRV"`` without ``aiodns``.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a table (got {short_repr(d)})")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a non-empty string (got {short_repr(name)})")
    label = f"dns source {short_repr(name)}"
    for key in d:
        if key not in _FIELDS:
            raise ConfigError(unknown_field(label, key, sorted(_FIELDS)))
    for key in ("host", "template"):
        if key not in d:
            raise ConfigError(f"{label}: {key} is required")
    try:
        source = DnsSource(**d)
    except TypeError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    if source.record == "SRV":
        require_srv_support(label)
    return source


# ---------------------------------------------------------------------- resolvers


class Resolver(Protocol):
    """What :class:`DnsDiscovery` asks DNS; errors of any kind count as transient."""

    async def addresses(self, host: str) -> list[str]:
        """The IP addresses of ``host`` (its A and AAAA records)."""
        ...

    async def srv(self, name: str) -> list[tuple[str, int]]:
        """The ``(target host, port)`` of each SRV record of ``name``."""
        ...


class SystemResolver:
    """The operating system's resolver for addresses; ``aiodns`` for SRV records.

    SRV needs ``aiodns`` (asyncio only), which :class:`DnsDiscovery` checks
    when it is given an SRV source (:func:`require_srv_support`).
    """

    def __init__(self) -> None:
        self._dns: Any = None
        self._loop: object = None

    async def addresses(self, host: str) -> list[str]:
        """The addresses ``getaddrinfo`` gives for ``host``, deduplicated and sorted."""
        infos = await anyio.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})

    async def srv(self, name: str) -> list[tuple[str, int]]:
        """The SRV records of ``name``, through ``aiodns``."""
        require_srv_support()
        loop = asyncio.get_running_loop()
        if self._dns is None or self._loop is not loop:
            # A resolver belongs to the loop it was made on.
            self._dns = importlib.import_module("aiodns").DNSResolver(loop=loop)
            self._loop = loop
        if hasattr(self._dns, "query_dns"):  # aiodns >= 4 (query() is deprecated there)
            result = await self._dns.query_dns(name, "SRV")
            return [
                (str(rec.data.target), int(rec.data.port))
                for rec in result.answer
                if hasattr(rec.data, "target") and hasattr(rec.data, "port")
            ]
        records = await self._dns.query(name, "SRV")
        return [(str(r.host), int(r.port)) for r in records]


@attrs.define
class StaticResolver:
    """An in-memory resolver: for tests, and for pinning records by hand.

    A host that was never :meth:`set` fails as an unknown name does (an IP
    address resolves to itself); :meth:`fail` makes a name fail until it is set
    again.

    Attributes:
        lookups: Lookups answered or failed so far.
    """

    _hosts: dict[str, list[str]] = attrs.field(factory=dict, init=False)
    _srv: dict[str, list[tuple[str, int]]] = attrs.field(factory=dict, init=False)
    _failing: set[str] = attrs.field(factory=set, init=False)
    lookups: int = attrs.field(default=0, init=False)

    def set(self, host: str, addresses: Iterable[str]) -> None:
        """Give ``host`` these addresses (``[]``: an empty answer)."""
        self._hosts[host] = list(addresses)
        self._failing.discard(host)

    def set_srv(self, name: str, records: Iterable[tuple[str, int]]) -> None:
        """Give ``name`` these ``(target, port)`` SRV records (``[]``: an empty answer)."""
        self._srv[name] = list(records)
        self._failing.discard(name)

    def fail(self, host: str) -> None:
        """Make lookups of ``host`` (addresses or SRV) fail until it is set again."""
        self._failing.add(host)

    async def addresses(self, host: str) -> list[str]:
        """The addresses set for ``host``."""
        await anyio.lowlevel.checkpoint()
        self.lookups += 1
        if host in self._failing:
            raise OSError(f"{host}: lookup failed (StaticResolver.fail)")
        if host in self._hosts:
            return list(self._hosts[host])
        if _ip(host) is not None:
            return [host]
        raise socket.gaierror(socket.EAI_NONAME, f"{host}: unknown host (StaticResolver)")

    async def srv(self, name: str) -> list[tuple[str, int]]:
        """The SRV records set for ``name``."""
        await anyio.lowlevel.checkpoint()
        self.lookups += 1
        if name in self._failing:
            raise OSError(f"{name}: lookup failed (StaticResolver.fail)")
        if name in self._srv:
            return list(self._srv[name])
        raise socket.gaierror(socket.EAI_NONAME, f"{name}: no SRV records (StaticResolver)")

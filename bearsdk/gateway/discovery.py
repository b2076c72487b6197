"""Instance discovery by DNS: the records of a name become the router's instances.

A Kubernetes headless Service gives each ready pod an A (or AAAA) record
under the Service's name, and an SRV record per named port
(``_http._tcp.vllm.default.svc.cluster.local``). :class:`DnsDiscovery`
resolves each :class:`DnsSource` every ``interval_s`` and keeps the router's
pool in step with the answer::

    source = dns_source_from_dict(
        {
            "name": "vllm",
            "host": "vllm.default.svc.cluster.local",
            "port": 8000,
            "template": {"model": "Qwen/Qwen3-8B", "profile": "qwen3-8b-h100"},
        }
    )
    async with AsyncRouter(static_pool) as router, anyio.create_task_group() as tg:
        discovery = DnsDiscovery(router, [source])
        await tg.start(discovery.run)  # ready after the first resolution
        ...

Each address and port of the answer is one instance, named
``"{source}/{address}:{port}"`` (an IPv6 address in brackets) and configured
by the source's ``template``. The rules:

* A record appearing is added to the pool; one that comes back while its
  instance is still draining makes it routable again.
* A record disappearing drains its instance at once (no new requests); the
  instance leaves the pool once its requests in flight have ended, checked on
  each round, or ``drain_timeout_s`` after the drain at the latest (the
  streams still running then keep running).
* A failed resolution (any exception, or ``resolve_timeout_s`` running out:
  NXDOMAIN and a timeout look alike from here) keeps the instances as they
  are; one WARNING per source and failure streak. For SRV, a target that
  fails to resolve fails the source's round.
* An empty answer drains the source's instances only when the answer before
  it was empty too: one bad answer of a flapping DNS server must not drain a
  fleet. A failed resolution in between starts the count again.
* An answer larger than ``max_instances`` keeps the lowest addresses (then
  ports), with a WARNING: DNS is untrusted input.
* An instance whose configuration changes (a :meth:`DnsDiscovery.replace`
  with a new template, scheme or snapshot port) is drained and added again
  under its new configuration once idle: the router cannot change a live
  instance's configuration, and requests in flight must finish under the old
  one. The source serves less meanwhile.
* Instances this class did not add (the static pool) are never touched; a
  record whose instance name is already taken by one is skipped with a
  WARNING.

SRV priority and weight are ignored (the router balances by its own
estimates), and a target of ``"."`` (RFC 2782: no service) is skipped.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import attrs

from bearsdk.errors import BearError, short_repr
from bearsdk.gateway.dns import (
    DnsSource,
    Resolver,
    StaticResolver,
    SystemResolver,
    _ip,
    _valid_host,
    _valid_port,
    dns_source_from_dict,
    require_srv_support,
)
from bearsdk.router.config import ConfigError, InstanceConfig

if TYPE_CHECKING:
    from bearsdk.router import AsyncRouter

__all__ = [
    "DnsDiscovery",
    "DnsSource",
    "Resolver",
    "StaticResolver",
    "SystemResolver",
    "dns_source_from_dict",
    "require_srv_support",
]

_log = logging.getLogger("bearsdk.gateway")

EMPTY_ANSWERS_TO_DRAIN: Final = 2
"""Consecutive empty answers after which a source's instances are drained."""
DRAIN_POLL_S: Final = 1.0
"""While an instance drains, :meth:`DnsDiscovery.run` looks at least this often
whether it is idle (its source's interval may be much longer)."""


@attrs.define
class _Member:
    """An instance this discovery added, and where it stands."""

    source: str
    address: str
    port: int
    config: InstanceConfig
    draining_since: float | None = None
    # Set while draining for a configuration change: added again with it once idle.
    successor: InstanceConfig | None = None


@attrs.define
class _SourceState:
    next_at: float = -math.inf
    empties: int = 0
    # Warnings logged in the current streak, and those raised since the last round:
    # a condition warns once, and again only after a round without it.
    warned: set[str] = attrs.Factory(set)
    raised: set[str] = attrs.Factory(set)


def _index(sources: Sequence[DnsSource]) -> dict[str, DnsSource]:
    out: dict[str, DnsSource] = {}
    for src in sources:
        if not isinstance(src, DnsSource):
            raise ConfigError(f"dns sources must be DnsSource values (got {short_repr(src)})")
        if src.name in out:
            raise ConfigError(f"dns source {src.name!r}: duplicate name")
        out[src.name] = src
    return out


def _default_resolver(resolver: Resolver | None) -> Resolver:
    return SystemResolver() if resolver is None else resolver


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        raise ConfigError(f"{att.name.lstrip('_')} must be a finite number > 0 (got {value!r})")


@attrs.define
class DnsDiscovery:
    """Keeps a router's pool in step with DNS records (see the module's rules).

    Args:
        router: The router whose pool it changes (running, for added instances'
            snapshot sources to start).
        sources: The DNS sources (unique names).
        resolver: How names are resolved (default :class:`SystemResolver`).
        clock: Time source of drain timeouts and intervals (seconds).
        drain_timeout_s: Longest wait for a drained instance's requests in
            flight before it is removed anyway (they keep running).
        resolve_timeout_s: Longest resolution of one source in one round
            (longer: a failed resolution).

    Raises:
        ConfigError: Duplicate source names, a bound out of range, or an SRV
            source with :class:`SystemResolver` where ``aiodns`` is missing.
    """

    _router: AsyncRouter
    _sources: dict[str, DnsSource] = attrs.field(converter=_index)
    _resolver: Resolver = attrs.field(default=None, converter=_default_resolver, kw_only=True)
    _clock: Callable[[], float] = attrs.field(default=time.monotonic, kw_only=True)
    _drain_timeout_s: float = attrs.field(default=600.0, kw_only=True, validator=_positive)
    _resolve_timeout_s: float = attrs.field(default=10.0, kw_only=True, validator=_positive)
    _states: dict[str, _SourceState] = attrs.field(init=False, factory=dict)
    _members: dict[str, _Member] = attrs.field(init=False, factory=dict)
    _lock: anyio.Lock = attrs.field(init=False, factory=anyio.Lock)
    _wake: anyio.Event | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self._check_srv(self._sources.values())
        self._states = {name: _SourceState() for name in self._sources}

    def _check_srv(self, sources: Iterable[DnsSource]) -> None:
        if isinstance(self._resolver, SystemResolver):
            for src in sources:
                if src.record == "SRV":
                    require_srv_support(f"dns source {src.name!r}")

    # ------------------------------------------------------------------ views

    @property
    def sources(self) -> list[DnsSource]:
        """The sources, in the order given."""
        return list(self._sources.values())

    def members(self) -> dict[str, list[str]]:
        """Per source name, the names of its instances routed now (not draining), sorted."""
        out: dict[str, list[str]] = {name: [] for name in self._sources}
        for name, m in sorted(self._members.items()):
            if m.draining_since is None and m.source in out:
                out[m.source].append(name)
        return out

    def draining(self) -> list[str]:
        """Names of the instances this discovery is draining, sorted."""
        return sorted(n for n, m in self._members.items() if m.draining_since is not None)

    # ------------------------------------------------------------------ running

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Resolve every source, apply, signal readiness, then keep each source current.

        Each source is resolved again every ``interval_s`` until cancelled; a
        source added or changed by :meth:`replace` at once. Cancelling it
        leaves the pool as it is (draining instances stay drained).
        """
        await self.refresh()
        task_status.started()
        try:
            while True:
                # State says what is due, so a replace() during a round is not missed;
                # the event only cuts a sleep short.
                self._wake = wake = anyio.Event()
                delay = self._next_delay()
                if delay > 0:
                    with anyio.move_on_after(delay):
                        await wake.wait()
                now = self._clock()
                due = [s for s in self._sources.values() if self._states[s.name].next_at <= now]
                await self._round(due)
        finally:
            self._wake = None

    async def refresh(self) -> None:
        """One round now: resolve every source, apply the answers, retire idle drained ones."""
        await self._round(list(self._sources.values()))

    def replace(self, sources: Sequence[DnsSource]) -> None:
        """Replace the sources (a configuration reload).

        A removed source's instances are drained as if their records had gone.
        An added or changed source is resolved at the next round (at once
        under :meth:`run`). Instances of a changed source whose configuration
        changes (template, scheme) are drained now and added again under the
        new configuration once idle; until its next answer, a changed source
        keeps its instances.

        Raises:
            ConfigError: As the constructor; nothing is changed then.
        """
        new = _index(sources)
        self._check_srv(new.values())
        now = self._clock()
        for name in [n for n in self._sources if n not in new]:
            del self._sources[name]
            del self._states[name]
            for mname, m in sorted(self._members.items()):
                if m.source == name:
                    m.successor = None
                    if m.draining_since is None:
                        self._drain(mname, m, now, "its source was removed")
        for name, src in new.items():
            old = self._sources.get(name)
            if old == src:
                continue  # the same object stays: a round in progress still applies it
            self._sources[name] = src
            self._states[name] = _SourceState()
            if old is None:
                continue
            for mname, m in sorted(self._members.items()):
                if m.source != name:
                    continue
                cfg = src.instance_config(m.address, m.port)
                if cfg == m.config:
                    m.successor = None  # back to its own: the next answer undrains it
                elif m.draining_since is None:
                    m.successor = cfg
                    self._drain(mname, m, now, "its configuration changed")
                elif m.successor is not None:
                    m.successor = cfg
        # The caller's order (members() and rounds follow it).
        ordered = [self._sources[name] for name in new]
        self._sources.clear()
        self._sources.update((src.name, src) for src in ordered)
        if self._wake is not None:
            self._wake.set()

    def _next_delay(self) -> float:
        now = self._clock()
        delay = min((st.next_at for st in self._states.values()), default=math.inf) - now
        if any(m.draining_since is not None for m in self._members.values()):
            delay = min(delay, DRAIN_POLL_S)
        return max(delay, 0.0)

    async def _round(self, sources: Sequence[DnsSource]) -> None:
        async with self._lock:
            answers: dict[str, list[tuple[str, int]] | Exception] = {}
            async with anyio.create_task_group() as tg:
                for src in sources:
                    tg.start_soon(self._lookup, src, self._states[src.name], answers)
            for src in sources:
                if self._sources.get(src.name) is not src:
                    continue  # removed or changed while it was resolved
                state = self._states[src.name]
                state.next_at = self._clock() + src.interval_s
                try:
                    await self._apply(src, state, answers[src.name])
                finally:
                    state.warned &= state.raised
                    state.raised.clear()
            await self._sweep()

    # ------------------------------------------------------------------ resolution

    def _warn(self, state: _SourceState, key: str, msg: str, *args: object) -> None:
        state.raised.add(key)
        if key not in state.warned:
            state.warned.add(key)
            _log.warning(msg, *args)

    async def _lookup(
        self,
        src: DnsSource,
        state: _SourceState,
        answers: dict[str, list[tuple[str, int]] | Exception],
    ) -> None:
        try:
            with anyio.fail_after(self._resolve_timeout_s):
                answers[src.name] = await self._resolve(src, state)
        except Exception as exc:  # DNS errors have no common type: all are transient
            answers[src.name] = exc

    async def _resolve(self, src: DnsSource, state: _SourceState) -> list[tuple[str, int]]:
        """The source's ``(address, port)`` pairs: valid, unique, sorted, truncated."""
        pairs: list[tuple[object, int]] = []
        if src.record == "A":
            assert src.port is not None
            pairs = [(a, src.port) for a in _listed(await self._resolver.addresses(src.host))]
        else:
            targets: dict[str, set[int]] = {}
            bad = 0
            for rec in _listed(await self._resolver.srv(src.host)):
                target, port = rec if isinstance(rec, tuple) and len(rec) == 2 else (None, None)
                if not (isinstance(target, str) and isinstance(port, int) and _valid_port(port)):
                    bad += 1
                    continue
                target = target.rstrip(".")
                if not target:
                    continue  # ".": the service is decidedly not available there
                if not _valid_host(target):
                    bad += 1
                    continue
                targets.setdefault(target, set()).add(port)
            if bad:
                self._warn(
                    state,
                    "invalid-srv",
                    "dns source %r: %d invalid SRV records of %r ignored",
                    src.name,
                    bad,
                    src.host,
                )
            # Every target gives at least one instance: no need to look up more.
            names = sorted(targets)[: src.max_instances]
            found = await self._addresses_of(names)
            pairs = [(a, p) for t in names for a in found[t] for p in sorted(targets[t])]
        valid: dict[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int], None] = {}
        bad = 0
        for address, port in pairs:
            ip = _ip(address)
            if ip is None:
                bad += 1
            else:
                valid[ip, port] = None
        if bad:
            self._warn(
                state,
                "invalid-address",
                "dns source %r: %d unusable addresses for %r ignored",
                src.name,
                bad,
                src.host,
            )
        ordered = sorted(valid, key=lambda k: (k[0].version, int(k[0]), k[1]))
        if len(ordered) > src.max_instances:
            self._warn(
                state,
                "truncated",
                "dns source %r: %r gives %d instances, more than max_instances = %d: "
                "keeping the %d lowest addresses",
                src.name,
                src.host,
                len(ordered),
                src.max_instances,
                src.max_instances,
            )
            ordered = ordered[: src.max_instances]
        return [(str(ip), port) for ip, port in ordered]

    async def _addresses_of(self, hosts: Sequence[str]) -> dict[str, list[object]]:
        """Each host's addresses, looked up side by side (an IP address is its own)."""
        found: dict[str, list[object]] = {}
        errors: list[Exception] = []
        limit = anyio.CapacityLimiter(16)

        async def one(host: str) -> None:
            if _ip(host) is not None:
                found[host] = [host]
                return
            async with limit:
                try:
                    found[host] = _listed(await self._resolver.addresses(host))
                except Exception as exc:  # the round fails: raised below
                    errors.append(exc)

        async with anyio.create_task_group() as tg:
            for host in hosts:
                tg.start_soon(one, host)
        if errors:
            raise errors[0]
        return found

    # ------------------------------------------------------------------ pool changes

    async def _apply(
        self, src: DnsSource, state: _SourceState, answer: list[tuple[str, int]] | Exception
    ) -> None:
        if isinstance(answer, Exception):
            state.empties = 0
            self._warn(
                state,
                "failure",
                "dns source %r: cannot resolve %s %r (%s): keeping its %d instances, "
                "retrying every %gs",
                src.name,
                src.record,
                src.host,
                _describe(answer),
                len(self._routed(src.name)),
                src.interval_s,
            )
            return
        if "failure" in state.warned:
            _log.info("dns source %r: %r resolves again", src.name, src.host)
        if answer:
            state.empties = 0
        else:
            state.empties += 1
            routed = self._routed(src.name)
            if routed and state.empties < EMPTY_ANSWERS_TO_DRAIN:
                self._warn(
                    state,
                    "empty",
                    "dns source %r: %r has no records: keeping its %d instances until "
                    "the next answer confirms it",
                    src.name,
                    src.host,
                    len(routed),
                )
                return
            if routed:
                _log.warning(
                    "dns source %r: %r has no records again: draining its %d instances",
                    src.name,
                    src.host,
                    len(routed),
                )
        now = self._clock()
        desired = {}
        for address, port in answer:
            cfg = src.instance_config(address, port)
            desired[cfg.name] = (address, port, cfg)
        for name, (address, port, cfg) in desired.items():
            if self._sources.get(src.name) is not src:
                return  # replaced while a previous add was awaited
            m = self._members.get(name)
            if m is None:
                await self._add(src, state, address, port, cfg)
            elif m.config == cfg:
                if m.draining_since is not None and self._call(self._router.undrain_instance, name):
                    m.draining_since = None
                    m.successor = None
                    _log.info("dns source %r: %s is back: routing to it again", src.name, name)
            else:
                m.successor = cfg
                if m.draining_since is None:
                    self._drain(name, m, now, "its configuration changed")
        for name, m in sorted(self._members.items()):
            if m.source == src.name and name not in desired:
                m.successor = None
                if m.draining_since is None:
                    self._drain(name, m, now, "its record is gone")

    def _routed(self, source: str) -> list[str]:
        return [
            n for n, m in self._members.items() if m.source == source and m.draining_since is None
        ]

    async def _add(
        self, src: DnsSource, state: _SourceState, address: str, port: int, cfg: InstanceConfig
    ) -> None:
        name = cfg.name
        if name in self._router.instances:
            self._warn(
                state,
                f"taken:{name}",
                "dns source %r: an instance named %r is already in the pool and was not "
                "discovered: leaving it alone, and its record unused",
                src.name,
                name,
            )
            return
        # Ours from here: even if the add is cancelled midway, the instance is ours to drain.
        self._members[name] = _Member(src.name, address, port, cfg)
        try:
            await self._router.add_instance(cfg)
        except Exception as exc:  # one bad record must not stop discovery
            del self._members[name]
            if name in self._router.instances:  # in the pool, but its source did not start
                with contextlib.suppress(BearError):
                    self._router.remove_instance(name)
            self._warn(
                state,
                f"add:{name}",
                "dns source %r: cannot add %s (%s): retrying next round",
                src.name,
                name,
                _describe(exc),
            )
            return
        _log.info("dns source %r: added %s", src.name, name)

    def _drain(self, name: str, m: _Member, now: float, why: str) -> None:
        if self._call(self._router.drain_instance, name):
            m.draining_since = now
            _log.info(
                "dns source %r: draining %s (%s; %d requests in flight)",
                m.source,
                name,
                why,
                self._router.inflight(name),
            )

    def _call(self, op: Callable[[str], object], name: str) -> bool:
        """``op(name)``; an instance someone else removed from the pool is forgotten."""
        try:
            op(name)
        except BearError:
            if name in self._router.instances:
                raise
            self._forget(name)
            return False
        return True

    def _forget(self, name: str) -> None:
        m = self._members.pop(name, None)
        _log.warning(
            "dns source %r: %s was removed from the pool by someone else: forgetting it",
            None if m is None else m.source,
            name,
        )

    async def _sweep(self) -> None:
        """Remove drained instances that are idle, or whose drain timed out."""
        now = self._clock()
        for name in sorted(self._members):
            m = self._members.get(name)
            if m is None:
                continue
            src = self._sources.get(m.source)
            if src is None and m.draining_since is None:
                self._drain(name, m, now, "its source was removed")  # added during a replace
            if m.draining_since is None:
                continue
            try:
                busy = self._router.inflight(name)
            except BearError:
                if name in self._router.instances:
                    raise
                self._forget(name)
                continue
            if busy and now - m.draining_since < self._drain_timeout_s:
                continue
            if busy:
                _log.warning(
                    "dns source %r: removing %s after drain_timeout_s = %gs with %d requests "
                    "still in flight (they keep running)",
                    m.source,
                    name,
                    self._drain_timeout_s,
                    busy,
                )
            if not self._call(self._router.remove_instance, name):
                continue
            del self._members[name]
            _log.info("dns source %r: removed %s", m.source, name)
            if m.successor is not None and src is not None and self._sources.get(m.source) is src:
                await self._add(src, self._states[src.name], m.address, m.port, m.successor)


def _listed(value: object) -> list[Any]:
    """A resolver's answer as a list (anything else is a failed resolution)."""
    if not isinstance(value, list | tuple):
        raise BearError(f"resolver answered {short_repr(value)}, not a list")
    return list(value)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else f"{text[:180]}...[{len(text)} chars]"

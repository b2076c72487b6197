"""DNS discovery (bearsdk.gateway.discovery): records in, instances added, drained and removed.

Rounds are driven with ``refresh()``; a StaticResolver stands in for DNS. The
acceptance test points SRV records at live emulated engines and holds a stream
open across its record's disappearance.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.gateway.discovery import (
    DnsDiscovery,
    DnsSource,
    StaticResolver,
    SystemResolver,
    dns_source_from_dict,
)
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig
from bearsdk.selectors import RoundRobin

MODEL = "Qwen/Qwen3-0.6B"
PROFILE = "qwen3-0.6b-h100"
TEMPLATE: dict[str, Any] = {"model": MODEL, "profile": PROFILE}
HOST = "vllm.default.svc.cluster.local"
SRV = "_http._tcp.vllm.default.svc.cluster.local"
MSG = [{"role": "user", "content": "Explain in 2 sentences why the sky is blue."}]
LOG = "bearsdk.gateway"


def static(name: str = "static") -> InstanceConfig:
    return InstanceConfig(name=name, url="http://127.0.0.1:1", model=MODEL, profile=PROFILE)


def idle_router(*extra: InstanceConfig) -> AsyncRouter:
    # Not started: instances join and leave the pool without any connection.
    return AsyncRouter([static(), *extra], RoundRobin())


def a_source(name: str = "vllm", **kw: Any) -> DnsSource:
    kw.setdefault("template", TEMPLATE)
    return DnsSource(name, kw.pop("host", HOST), port=kw.pop("port", 8000), **kw)


def inst(address: str, port: int = 8000, source: str = "vllm") -> str:
    return f"{source}/{address}:{port}"


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOG and r.levelno == logging.WARNING and text in r.getMessage()
    ]


def hold(router: AsyncRouter, name: str) -> Callable[[], None]:
    """Count one request in flight to ``name`` (no engine needed); returns its completion."""
    d = router.decide(MSG)
    router.record_dispatch(d, name)
    return lambda: router.record_complete(d, name)


async def until(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.01)


# ---------------------------------------------------------------------- decoding

GOOD: dict[str, Any] = {"name": "vllm", "host": HOST, "port": 8000, "template": TEMPLATE}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"interval_s": 0},
            "dns source 'vllm': interval_s must be a number in [0.05, 3600] (got 0)",
        ),
        ({"interval_s": 3601}, "interval_s must be a number in [0.05, 3600] (got 3601)"),
        ({"interval_s": True}, "interval_s must be a number in [0.05, 3600] (got True)"),
        ({"interval_s": float("nan")}, "interval_s must be a number in [0.05, 3600] (got nan)"),
        ({"intervl_s": 5}, "dns source 'vllm': 'intervl_s' is not a known field; did you mean "),
        ({"port": None}, 'port must be an integer in [1, 65535] with record = "A" (got None)'),
        ({"port": 65536}, "port must be an integer in [1, 65535]"),
        ({"port": True}, "port must be an integer in [1, 65535]"),
        ({"record": "SRV", "host": SRV}, 'port must be absent with record = "SRV" (got 8000)'),
        ({"record": "MX"}, "record must be 'A' or 'SRV' (got 'MX')"),
        ({"scheme": "ftp"}, "scheme must be 'http' or 'https' (got 'ftp')"),
        ({"host": "bad host"}, "host must be a DNS name or an IP address"),
        ({"host": "a." * 127}, "host must be a DNS name or an IP address of at most 253 chars"),
        ({"host": "-x.example"}, "host must be a DNS name"),
        ({"host": 7}, "host must be a DNS name"),
        ({"max_instances": 0}, "max_instances must be an integer in [1, 4096] (got 0)"),
        ({"max_instances": 4097}, "max_instances must be an integer in [1, 4096] (got 4097)"),
        ({"name": "a/b"}, "dns source name must be 1 to 63 letters"),
        ({"name": ""}, r"discovery.dns\[3\].name must be a non-empty string"),
        (
            {"template": {**TEMPLATE, "profle": "x"}},
            "dns source 'vllm': template: profle is not a known field; did you mean 'profile'?",
        ),
        ({"template": {"profile": PROFILE}}, "dns source 'vllm': template: model is required"),
        ({"template": {**TEMPLATE, "url": "http://x"}}, "template: url is not allowed"),
        ({"template": {**TEMPLATE, "snapshot_url": "http://x"}}, "use snapshot_port"),
        ({"template": {**TEMPLATE, "name": "x"}}, "template: name is not allowed"),
        ({"template": {**TEMPLATE, "profile": "no-such-profile"}}, "template: profile"),
        ({"template": {**TEMPLATE, "snapshot_port": 0}}, "snapshot_port must be an integer"),
        ({"template": {**TEMPLATE, "snapshots": "shm"}}, "snapshots = 'shm' cannot be discovered"),
        ({"template": {**TEMPLATE, "timeout_s": 0}}, "template: timeout_s must be a number > 0"),
        ({"template": {**TEMPLATE, "scheduler": "nope"}}, "dns source 'vllm': template: "),
        ({"template": [1]}, "template must be a table"),
    ],
)
def test_decoding_is_strict(change: dict[str, Any], message: str) -> None:
    d = {**GOOD, **change}
    with pytest.raises(ConfigError) as ei:
        dns_source_from_dict(d, "discovery.dns[3]")
    if message.startswith("discovery"):
        assert ei.match(message)
    else:
        assert message in str(ei.value)


def test_decoding_required_fields_and_tables() -> None:
    with pytest.raises(ConfigError, match=r"discovery.dns\[0\] must be a table"):
        dns_source_from_dict([1])  # type: ignore[arg-type]
    for key in ("host", "template"):
        d = {k: v for k, v in GOOD.items() if k != key}
        with pytest.raises(ConfigError, match=f"dns source 'vllm': {key} is required"):
            dns_source_from_dict(d)


def test_decoded_source_and_its_instances() -> None:
    tpl = {**TEMPLATE, "snapshot_port": 8001, "timeout_s": 20}
    src = dns_source_from_dict({**GOOD, "interval_s": 2, "scheme": "https", "template": tpl})
    assert src == DnsSource("vllm", HOST, port=8000, scheme="https", interval_s=2, template=tpl)
    assert hash(src) == hash(
        DnsSource("vllm", HOST, port=8000, scheme="https", interval_s=2, template=tpl)
    )
    tpl["timeout_s"] = 99  # the source keeps its own copy
    assert src.template["timeout_s"] == 20
    cfg = src.instance_config("10.0.0.5", 8000)
    assert (cfg.name, cfg.url, cfg.snapshot_url) == (
        "vllm/10.0.0.5:8000",
        "https://10.0.0.5:8000",
        "https://10.0.0.5:8001",
    )
    assert (cfg.model, cfg.profile, cfg.timeout_s) == (MODEL, PROFILE, 20)
    v6 = src.instance_config("fd00::5", 9000)
    assert (v6.name, v6.url) == ("vllm/[fd00::5]:9000", "https://[fd00::5]:9000")
    assert a_source().instance_config("10.0.0.5", 8000).snapshot_url is None


def test_srv_needs_aiodns_at_load_time(monkeypatch: pytest.MonkeyPatch) -> None:
    srv = {"name": "vllm", "host": SRV, "record": "SRV", "template": TEMPLATE}
    monkeypatch.setitem(sys.modules, "aiodns", None)  # import aiodns raises ImportError
    with pytest.raises(ConfigError, match=r"dns source 'vllm': .*needs the aiodns package"):
        dns_source_from_dict(srv)
    src = DnsSource("vllm", SRV, record="SRV", template=TEMPLATE)
    with pytest.raises(ConfigError, match="needs the aiodns package"):
        DnsDiscovery(idle_router(), [src])  # the system resolver: checked at start
    DnsDiscovery(idle_router(), [src], resolver=StaticResolver())  # pinned records: no DNS
    monkeypatch.setitem(sys.modules, "aiodns", types.ModuleType("aiodns"))
    assert dns_source_from_dict(srv) == src


async def test_system_resolver_srv_without_aiodns_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "aiodns", None)
    with pytest.raises(ConfigError, match=r"pip install aiodns"):
        await SystemResolver().srv(SRV)


def fake_aiodns(api: str) -> types.ModuleType:
    """A stand-in for aiodns: ``query_dns`` (aiodns 4) or the older ``query``."""
    ns = types.SimpleNamespace
    records = [("pod-a.vllm.ns.svc.cluster.local", 8000, 10), ("pod-b.vllm", 8001, 5)]

    class DNSResolver:
        def __init__(self, loop: object = None) -> None:
            self.loop = loop

        async def query_dns(self, name: str, kind: str) -> Any:
            assert (name, kind) == (SRV, "SRV")
            answer = [ns(data=ns(target=t, port=p, priority=0, weight=w)) for t, p, w in records]
            return ns(answer=[*answer, ns(data=ns(cname="elsewhere"))])

        async def query(self, name: str, kind: str) -> Any:
            assert (name, kind) == (SRV, "SRV")
            return [ns(host=t, port=p, priority=0, weight=w) for t, p, w in records]

    if api == "query":
        del DNSResolver.query_dns
    module = types.ModuleType("aiodns")
    module.DNSResolver = DNSResolver  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("api", ["query_dns", "query"])
async def test_system_resolver_srv_through_aiodns(
    monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    monkeypatch.setitem(sys.modules, "aiodns", fake_aiodns(api))
    assert await SystemResolver().srv(SRV) == [
        ("pod-a.vllm.ns.svc.cluster.local", 8000),
        ("pod-b.vllm", 8001),
    ]


async def test_system_resolver_addresses() -> None:
    # An address literal: getaddrinfo answers it without any resolver or /etc/hosts.
    assert await SystemResolver().addresses("127.0.0.1") == ["127.0.0.1"]


def test_discovery_bounds() -> None:
    with pytest.raises(ConfigError, match="dns source 'vllm': duplicate name"):
        DnsDiscovery(idle_router(), [a_source(), a_source(host="other")])
    with pytest.raises(ConfigError, match=r"drain_timeout_s must be a finite number > 0 \(got 0\)"):
        DnsDiscovery(idle_router(), [], drain_timeout_s=0)


# ---------------------------------------------------------------------- acceptance


async def test_instance_appears_and_disappears_without_failed_requests() -> None:
    async with EnginePool.of(PROFILE, PROFILE, PROFILE) as pool:
        e0, e1, e2 = pool.engines
        tpl = {"model": e0.model_name, "profile": PROFILE, "timeout_s": 20.0}
        first = InstanceConfig(name="static", url=e0.url, model=e0.model_name, profile=PROFILE)
        async with AsyncRouter([first], RoundRobin(), retries=0) as router:
            # Only discovered instances take requests here (discovery never undrains it).
            router.drain_instance("static")
            res = StaticResolver()
            res.set_srv(SRV, [("127.0.0.1", e1.port), ("127.0.0.1", e2.port)])
            src = DnsSource("vllm", SRV, record="SRV", template=tpl)
            disc = DnsDiscovery(router, [src], resolver=res)
            await disc.refresh()
            n1, n2 = inst("127.0.0.1", e1.port), inst("127.0.0.1", e2.port)
            assert disc.members() == {"vllm": sorted([n1, n2])}
            assert sorted(router.instances) == sorted(["static", n1, n2])
            assert router.instance_config(n1).url == e1.url

            stream = await router.chat(MSG, stream=True, max_tokens=30)
            victim = stream.instance
            (other,) = {n1, n2} - {victim}
            head = await stream.__anext__()  # the stream is open on the victim
            assert router.inflight(victim) == 1

            res.set_srv(SRV, [("127.0.0.1", e2.port if victim == n1 else e1.port)])
            await disc.refresh()
            assert disc.members() == {"vllm": [other]}
            assert disc.draining() == [victim]
            assert victim in router.instances  # its request is still in flight
            for _ in range(4):
                body = await router.chat(MSG, max_tokens=3)
                assert body.instance == other
            await disc.refresh()
            assert victim in router.instances

            rest = [chunk async for chunk in stream]  # ends normally
            assert head["choices"]
            assert stream.usage is not None
            assert stream.usage["completion_tokens"] == 30
            assert rest
            assert router.inflight(victim) == 0
            await disc.refresh()
            assert sorted(router.instances) == sorted(["static", other])
            assert disc.draining() == []
            assert router.core.slot("static").draining  # a static instance: left as it was

            # It comes back: a fresh instance, routed again.
            res.set_srv(SRV, [("127.0.0.1", e1.port), ("127.0.0.1", e2.port)])
            await disc.refresh()
            assert disc.members() == {"vllm": sorted([n1, n2])}
            seen = {(await router.chat(MSG, max_tokens=2)).instance for _ in range(4)}
            assert seen == {n1, n2}


# ---------------------------------------------------------------------- rules


async def test_record_back_while_draining_is_undrained() -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    disc = DnsDiscovery(router, [a_source()], resolver=res)
    await disc.refresh()
    a, b = inst("10.0.0.2"), inst("10.0.0.3")
    assert disc.members() == {"vllm": [a, b]}
    done = hold(router, a)
    res.set(HOST, ["10.0.0.3"])
    await disc.refresh()
    assert disc.members() == {"vllm": [b]}
    assert disc.draining() == [a]
    assert router.core.slot(a).draining
    res.set(HOST, ["10.0.0.3", "10.0.0.2"])
    await disc.refresh()
    assert disc.members() == {"vllm": [a, b]}
    assert disc.draining() == []
    assert not router.core.slot(a).draining
    assert router.inflight(a) == 1  # the same instance, its request still counted
    done()
    await disc.refresh()
    assert router.instances == ["static", a, b]


async def test_busy_instance_is_removed_at_the_drain_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    disc = DnsDiscovery(
        router, [a_source()], resolver=res, clock=lambda: now[0], drain_timeout_s=30.0
    )
    await disc.refresh()
    a, b = inst("10.0.0.2"), inst("10.0.0.3")
    hold(router, a)
    res.set(HOST, ["10.0.0.3"])
    await disc.refresh()  # drained at t = 100
    now[0] = 129.9
    await disc.refresh()
    assert router.instances == ["static", a, b]
    assert disc.draining() == [a]
    assert warnings_of(caplog, "drain_timeout_s") == []
    now[0] = 130.0
    await disc.refresh()
    assert router.instances == ["static", b]
    assert disc.draining() == []
    assert warnings_of(caplog, "drain_timeout_s") == [
        f"dns source 'vllm': removing {a} after drain_timeout_s = 30s with 1 requests "
        "still in flight (they keep running)"
    ]


async def test_failed_resolution_keeps_members_and_warns_once_per_streak(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    disc = DnsDiscovery(router, [a_source()], resolver=res)
    await disc.refresh()
    members = {"vllm": [inst("10.0.0.2"), inst("10.0.0.3")]}
    res.fail(HOST)
    for _ in range(3):
        await disc.refresh()
        assert disc.members() == members
        assert disc.draining() == []
    assert len(warnings_of(caplog, "cannot resolve")) == 1
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    await disc.refresh()
    res.fail(HOST)
    await disc.refresh()
    await disc.refresh()
    assert disc.members() == members
    assert len(warnings_of(caplog, "cannot resolve")) == 2  # a new streak warns again
    assert warnings_of(caplog, "cannot resolve")[0] == (
        f"dns source 'vllm': cannot resolve A '{HOST}' ({HOST}: lookup failed "
        "(StaticResolver.fail)): keeping its 2 instances, retrying every 5s"
    )
    # An unknown name (NXDOMAIN) is transient too.
    res2 = StaticResolver()
    disc2 = DnsDiscovery(idle_router(), [a_source(host="unknown.example")], resolver=res2)
    await disc2.refresh()
    assert disc2.members() == {"vllm": []}


class SlowResolver(StaticResolver):
    slow: bool = False

    async def addresses(self, host: str) -> list[str]:
        if self.slow:
            await anyio.sleep_forever()
        return await super().addresses(host)


async def test_resolution_timeout_is_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    res = SlowResolver()
    res.set(HOST, ["10.0.0.2"])
    disc = DnsDiscovery(idle_router(), [a_source()], resolver=res, resolve_timeout_s=0.05)
    await disc.refresh()
    res.slow = True
    with anyio.fail_after(5):
        await disc.refresh()
    assert disc.members() == {"vllm": [inst("10.0.0.2")]}
    assert len(warnings_of(caplog, "cannot resolve")) == 1


async def test_empty_answer_drains_only_when_the_next_confirms_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = idle_router()
    res = StaticResolver()
    addrs = ["10.0.0.2", "10.0.0.3"]
    res.set(HOST, addrs)
    disc = DnsDiscovery(router, [a_source()], resolver=res)
    await disc.refresh()
    members = {"vllm": [inst(a) for a in addrs]}
    res.set(HOST, [])
    await disc.refresh()
    assert disc.members() == members  # one empty answer: kept
    assert disc.draining() == []
    res.set(HOST, addrs)
    await disc.refresh()
    res.set(HOST, [])
    await disc.refresh()
    res.fail(HOST)
    await disc.refresh()  # a failure in between: the count starts again
    res.set(HOST, [])
    await disc.refresh()
    assert disc.members() == members
    await disc.refresh()  # second empty answer in a row
    assert disc.members() == {"vllm": []}
    assert router.instances == ["static"]  # idle: removed in the same round
    # One per streak (empty, then empty after a good answer, then after a failure).
    assert len(warnings_of(caplog, "has no records: keeping")) == 3
    assert warnings_of(caplog, "again") == [
        f"dns source 'vllm': '{HOST}' has no records again: draining its 2 instances"
    ]


async def test_answer_larger_than_max_instances_is_truncated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(
        HOST,
        ["10.0.0.10", "fd00::1", "10.0.0.9", "10.0.0.200", "10.0.0.9", "10.0.0.11", "bogus"],
    )
    disc = DnsDiscovery(router, [a_source(max_instances=3)], resolver=res)
    await disc.refresh()
    await disc.refresh()
    kept = [inst("10.0.0.10"), inst("10.0.0.11"), inst("10.0.0.9")]
    assert disc.members() == {"vllm": kept}  # sorted by address: .9, .10, .11 kept
    assert sorted(router.instances) == sorted(["static", *kept])
    assert warnings_of(caplog, "max_instances") == [
        f"dns source 'vllm': '{HOST}' gives 5 instances, more than max_instances = 3: "
        "keeping the 3 lowest addresses"
    ]
    assert len(warnings_of(caplog, "unusable addresses")) == 1


async def test_static_instances_are_never_touched(caplog: pytest.LogCaptureFixture) -> None:
    taken = inst("10.0.0.2")
    router = idle_router(static(taken))
    router.drain_instance("static")
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    disc = DnsDiscovery(router, [a_source()], resolver=res)
    await disc.refresh()
    await disc.refresh()
    assert disc.members() == {"vllm": [inst("10.0.0.3")]}
    assert router.instance_config(taken).url == "http://127.0.0.1:1"  # not replaced
    assert len(warnings_of(caplog, "already in the pool")) == 1
    res.set(HOST, ["10.0.0.4"])
    await disc.refresh()
    res.set(HOST, [])
    await disc.refresh()
    await disc.refresh()
    assert disc.members() == {"vllm": []}
    assert router.instances == ["static", taken]
    assert router.core.slot("static").draining
    assert not router.core.slot(taken).draining


async def test_instance_that_cannot_be_added_is_retried(caplog: pytest.LogCaptureFixture) -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2"])
    # Loads (a known kind), but this router has no cluster for it.
    src = a_source(template={**TEMPLATE, "snapshots": "redis"})
    disc = DnsDiscovery(router, [src], resolver=res)
    await disc.refresh()
    await disc.refresh()
    assert disc.members() == {"vllm": []}
    assert router.instances == ["static"]
    assert len(warnings_of(caplog, "cannot add")) == 1


async def test_srv_records_and_their_targets(caplog: pytest.LogCaptureFixture) -> None:
    router = idle_router()
    res = StaticResolver()
    res.set_srv(
        SRV,
        [
            ("pod-a.vllm.", 8000),
            ("pod-b.vllm", 8001),
            ("10.0.0.7", 8002),  # an address as its own target
            (".", 8000),  # RFC 2782: no service here
            ("pod-a.vllm", 0),  # invalid port
            ("pod a", 8000),  # invalid name
            ("pod-a.vllm", 8000),  # a duplicate
        ],
    )
    res.set("pod-a.vllm", ["10.0.0.5"])
    res.set("pod-b.vllm", ["fd00::2"])
    disc = DnsDiscovery(
        router, [DnsSource("vllm", SRV, record="SRV", template=TEMPLATE)], resolver=res
    )
    await disc.refresh()
    names = ["vllm/10.0.0.5:8000", "vllm/10.0.0.7:8002", "vllm/[fd00::2]:8001"]
    assert disc.members() == {"vllm": names}
    assert router.instance_config("vllm/[fd00::2]:8001").url == "http://[fd00::2]:8001"
    assert warnings_of(caplog, "invalid SRV") == [
        f"dns source 'vllm': 2 invalid SRV records of '{SRV}' ignored"
    ]
    res.fail("pod-b.vllm")  # one target failing fails the round: nothing drained
    await disc.refresh()
    assert disc.members() == {"vllm": names}
    assert len(warnings_of(caplog, "cannot resolve")) == 1
    res.set("pod-b.vllm", [])  # resolved, no address: its instance goes
    await disc.refresh()
    assert disc.members() == {"vllm": names[:2]}
    assert router.instances == ["static", *names[:2]]


async def test_replace_sources() -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2", "10.0.0.3"])
    res.set("old.example", ["10.0.1.2"])
    res.set("new.example", ["10.0.2.2"])
    vllm = a_source(template={**TEMPLATE, "timeout_s": 20.0})
    old = a_source("old", host="old.example")
    disc = DnsDiscovery(router, [vllm, old], resolver=res)
    await disc.refresh()
    a, b = inst("10.0.0.2"), inst("10.0.0.3")
    gone = inst("10.0.1.2", source="old")
    assert disc.members() == {"vllm": [a, b], "old": [gone]}

    # Equal sources: nothing changes.
    disc.replace([a_source(template={**TEMPLATE, "timeout_s": 20.0}), old])
    assert disc.draining() == []
    with pytest.raises(ConfigError, match="duplicate name"):
        disc.replace([vllm, vllm])
    assert disc.members() == {"vllm": [a, b], "old": [gone]}

    done = hold(router, a)
    vllm2 = a_source(template={**TEMPLATE, "timeout_s": 60.0})
    disc.replace([vllm2, a_source("new", host="new.example")])
    # A removed source's instances, and those whose configuration changes: drained now.
    assert disc.draining() == [gone, a, b]
    assert disc.members() == {"vllm": [], "new": []}
    await disc.refresh()
    fresh = inst("10.0.2.2", source="new")
    assert disc.members() == {"vllm": [b], "new": [fresh]}  # b was idle: re-added
    assert disc.draining() == [a]  # a request in flight: under its old configuration
    assert sorted(router.instances) == sorted(["static", a, b, fresh])
    assert router.instance_config(b).timeout_s == 60.0
    assert router.instance_config(a).timeout_s == 20.0
    done()
    await disc.refresh()
    assert disc.members() == {"vllm": [a, b], "new": [fresh]}
    assert router.instance_config(a).timeout_s == 60.0
    assert sorted(router.instances) == sorted(["static", a, b, fresh])


async def test_run_follows_records_until_cancelled() -> None:
    router = idle_router()
    res = StaticResolver()
    res.set(HOST, ["10.0.0.2"])
    disc = DnsDiscovery(router, [a_source(interval_s=0.05)], resolver=res)
    a, b = inst("10.0.0.2"), inst("10.0.0.3")
    async with anyio.create_task_group() as tg:
        await tg.start(disc.run)
        assert disc.members() == {"vllm": [a]}  # ready after the first resolution
        res.set(HOST, ["10.0.0.2", "10.0.0.3"])
        await until(lambda: disc.members() == {"vllm": [a, b]})
        res.set(HOST, ["10.0.0.3"])
        await until(lambda: router.instances == ["static", b])
        res.set("other.example", ["10.0.0.9"])
        disc.replace([a_source("other", host="other.example", interval_s=3600)])
        # Resolved at once, not an hour later; b leaves with its source.
        await until(lambda: router.instances == ["static", inst("10.0.0.9", source="other")])
        tg.cancel_scope.cancel()
    assert disc.members() == {"other": [inst("10.0.0.9", source="other")]}

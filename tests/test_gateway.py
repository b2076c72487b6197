"""``bearsdk serve`` against emulated engines, over real sockets, as clients use it.

The official ``openai`` client (sync and async, streamed and not) and curl talk
to the gateway; a bad key, a disallowed model, an exhausted budget and a bad
body each get OpenAI's error shape and status, and nothing reaches an engine.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import openai
import orjson
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.gateway import Gateway
from bearsdk.gateway.config import load_gateway_config
from bearsdk.gateway.keys import hash_key
from bearsdk.gateway.server import listen, run_gateway

KEY = "test-key-0123456789abcdef"
NARROW = "test-key-narrow-0123456789"
TINY = "test-key-tiny-budget-01234"
MSGS = [{"role": "user", "content": "Name three rivers."}]


def pool_toml(pool: EnginePool) -> str:
    lines = []
    for e in pool:
        lines += [
            "[[instances]]",
            f'name = "{e.instance}"',
            f'url = "{e.url}"',
            f'model = "{e.model_name}"',
            f'profile = "{e.config.profile}"',
            "",
        ]
    return "\n".join(lines)


def keys_toml() -> str:
    return f"""
[[keys]]
name = "main"
hash = "{hash_key(KEY)}"

[[keys]]
name = "narrow"
hash = "{hash_key(NARROW)}"
models = ["Qwen/Qwen3-0.6B"]

[[keys]]
name = "tiny"
hash = "{hash_key(TINY)}"
rpm = 1
"""


@asynccontextmanager
async def gateway(
    tmp_path: Path, pool: EnginePool, extra: str = "", keys: bool = True, signals: bool = True
) -> AsyncIterator[tuple[str, Gateway]]:
    path = tmp_path / "gateway.toml"
    path.write_text(
        "[server]\nport = 0\n" + extra + "\n" + pool_toml(pool) + (keys_toml() if keys else ""),
        encoding="utf-8",
    )
    cfg = load_gateway_config(path)
    sock = listen("127.0.0.1", 0)
    urls: list[str] = []
    async with anyio.create_task_group() as tg:
        gw = await tg.start(
            lambda task_status: run_gateway(
                cfg, sock, ready=urls.append, handle_signals=signals, task_status=task_status
            )
        )
        try:
            yield urls[0], gw
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def served(
    tmp_path: Path, extra: str = "", keys: bool = True
) -> AsyncIterator[tuple[str, Gateway, EnginePool]]:
    # Not a fixture: the engines' and the gateway's task groups must be entered and
    # left by the test's own task.
    async with (
        EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100") as pool,
        gateway(tmp_path, pool, extra, keys) as (url, gw),
    ):
        yield url, gw, pool


def requests_seen(pool: EnginePool) -> int:
    return sum(len(e.request_log) for e in pool)


async def test_openai_async_client_chat_and_completions(tmp_path: Path) -> None:
    async with served(tmp_path) as (url, gw, engines):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        async with client:
            models = await client.models.list()
            ids = [m.id for m in models.data]
            assert ids[0] == "auto"
            assert set(ids) == {"auto", "Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"}
            raw = await client.chat.completions.with_raw_response.create(
                model="auto",
                messages=MSGS,
                max_tokens=8,  # type: ignore[arg-type]
            )
            chat = raw.parse()
            assert chat.choices[0].message.content
            assert chat.usage is not None
            assert chat.usage.completion_tokens > 0
            inst = raw.headers["x-bear-instance"]
            assert inst in {e.instance for e in engines}
            rec = gw.decision(raw.headers["x-bear-decision"])
            assert rec is not None
            assert rec.outcome == "ok"
            stream = await client.chat.completions.create(
                model="Qwen/Qwen3-8B",
                messages=MSGS,  # type: ignore[arg-type]
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
            )
            pieces = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            assert pieces[-1].usage is not None  # kept: the caller asked for it
            comp = await client.completions.create(model="auto", prompt="Once upon", max_tokens=6)
            assert comp.choices[0].text
            cstream = await client.completions.create(
                model="Qwen/Qwen3-0.6B", prompt="Once upon", max_tokens=6, stream=True
            )
            texts = [c.choices[0].text async for c in cstream if c.choices]
            assert "".join(texts)
        # The decision is one GET away, with its candidates, its explanation and,
        # for a stream, the first token's time.
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "auto", "messages": MSGS, "max_tokens": 4, "stream": True}
        async with aiohttp.ClientSession(headers=auth) as s:
            async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                inst = r.headers["x-bear-instance"]
                rid = r.headers["x-bear-decision"]
            async with s.get(f"{url}/bear/decisions/{rid}") as r:
                doc = await r.json()
        assert r.status == 200
        assert doc["instance"] == inst
        assert {c["instance"] for c in doc["candidates"]} == {e.instance for e in engines}
        assert doc["explain"].startswith("bear: ")
        assert doc["observed_ttft_s"] > 0


async def test_model_names_route_only_within_their_instances(
    tmp_path: Path,
) -> None:
    async with served(tmp_path) as (url, gw, engines):
        small = next(e for e in engines if e.model_name == "Qwen/Qwen3-0.6B")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        async with client:
            for _ in range(3):
                raw = await client.chat.completions.with_raw_response.create(
                    model="Qwen/Qwen3-0.6B",
                    messages=MSGS,
                    max_tokens=4,  # type: ignore[arg-type]
                )
                assert raw.headers["x-bear-instance"] == small.instance
                rid = raw.headers["x-bear-decision"]
                rec = gw.decision(rid)
                assert rec is not None
                assert [c.instance for c in rec.decision.candidates] == [small.instance]


def test_openai_sync_client(tmp_path: Path, engines_sync: Callable[..., Any]) -> None:
    engines_sync(tmp_path)


@pytest.fixture
def engines_sync() -> Callable[..., Any]:
    # The sync client blocks: the gateway runs on its own event loop in a thread.
    def run(tmp_path: Path) -> None:
        import threading

        ready = threading.Event()
        done = threading.Event()
        box: dict[str, Any] = {}

        async def serve() -> None:
            async with (
                EnginePool.of("qwen3-0.6b-h100") as pool,
                gateway(tmp_path, pool, signals=False) as (url, _),
            ):
                box["url"] = url
                ready.set()
                await anyio.to_thread.run_sync(done.wait)

        t = threading.Thread(target=lambda: anyio.run(serve))
        t.start()
        try:
            assert ready.wait(60)
            client = openai.OpenAI(base_url=box["url"] + "/v1", api_key=KEY, max_retries=0)
            with client:
                chat = client.chat.completions.create(
                    model="auto",
                    messages=MSGS,
                    max_tokens=6,  # type: ignore[arg-type]
                )
                assert chat.choices[0].message.content
                with client.chat.completions.create(
                    model="auto",
                    messages=MSGS,
                    max_tokens=6,
                    stream=True,  # type: ignore[arg-type]
                ) as stream:
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text
                with pytest.raises(openai.AuthenticationError):
                    openai.OpenAI(
                        base_url=box["url"] + "/v1", api_key="wrong-key-0123456789ab", max_retries=0
                    ).models.list()
        finally:
            done.set()
            t.join(60)

    return run


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl(tmp_path: Path) -> None:
    async with served(tmp_path) as (url, _, _engines):
        body = orjson.dumps({"model": "auto", "messages": MSGS, "max_tokens": 5, "stream": True})
        cmd = [
            "curl", "-sS", "-N", url + "/v1/chat/completions",
            "-H", f"Authorization: Bearer {KEY}",
            "-H", "Content-Type: application/json",
            "-H", "x-slo-ttft-ms: 2000",
            "--data-binary", body.decode(),
        ]  # fmt: skip
        out = await anyio.run_process(cmd, check=False)
        text = out.stdout.decode()
        assert out.returncode == 0, out.stderr
        assert text.rstrip().endswith("data: [DONE]")
        events = [
            orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")
        ]
        assert events
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        bad = await anyio.run_process(
            ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", url + "/v1/models"],
            check=False,
        )
        assert bad.stdout.decode() == "401"


async def call(url: str, body: Any, key: str | None = KEY, **headers: str) -> tuple[int, Any, Any]:
    h = dict(headers)
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", data=data, headers=h) as r,
    ):
        text = await r.read()
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            doc = text
        return r.status, doc, r.headers


@pytest.mark.parametrize(
    ("key", "body", "status", "code", "param"),
    [
        (None, {"model": "auto", "messages": MSGS}, 401, "invalid_api_key", None),
        (
            "not-a-key-0123456789abcdef",
            {"model": "auto", "messages": MSGS},
            401,
            "invalid_api_key",
            None,
        ),
        (NARROW, {"model": "auto", "messages": MSGS}, 403, "model_not_allowed", None),
        (NARROW, {"model": "Qwen/Qwen3-8B", "messages": MSGS}, 403, "model_not_allowed", None),
        (KEY, {"model": "gpt-9", "messages": MSGS}, 404, "model_not_found", "model"),
        (KEY, {"model": "auto", "messages": []}, 400, "invalid_value", "messages"),
        (
            KEY,
            {"model": "auto", "messages": MSGS, "colour": "blue"},
            400,
            "invalid_value",
            "colour",
        ),
        (
            KEY,
            {"model": "auto", "messages": MSGS, "max_tokens": 0},
            400,
            "invalid_value",
            "max_tokens",
        ),
        (
            KEY,
            {"model": "auto", "messages": MSGS, "bear": {"ttft_ms": -1}},
            400,
            "invalid_value",
            "bear.ttft_ms",
        ),
        (KEY, b"{", 400, "invalid_value", None),
        (KEY, [1, 2], 400, "invalid_value", None),
    ],
)
async def test_refusals_reach_no_engine(
    tmp_path: Path,
    key: str | None,
    body: Any,
    status: int,
    code: str,
    param: str | None,
) -> None:
    async with served(tmp_path) as (url, _, engines):
        before = requests_seen(engines)
        got, doc, _ = await call(url, body, key)
        assert got == status
        err = doc["error"]
        assert err["code"] == code
        assert err["param"] == param
        assert isinstance(err["message"], str)
        assert err["message"]
        if key is not None:
            assert key not in err["message"]
        assert requests_seen(engines) == before


async def test_budget_429_with_retry_after(tmp_path: Path) -> None:
    async with served(tmp_path) as (url, _, engines):
        status, _, _ = await call(url, {"model": "auto", "messages": MSGS, "max_tokens": 2}, TINY)
        assert status == 200
        before = requests_seen(engines)
        status, doc, headers = await call(url, {"model": "auto", "messages": MSGS}, TINY)
        assert status == 429
        assert doc["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert requests_seen(engines) == before
        # Other keys are not affected.
        status, _, _ = await call(url, {"model": "auto", "messages": MSGS, "max_tokens": 2})
        assert status == 200


async def test_bad_target_header_is_a_400(tmp_path: Path) -> None:
    async with served(tmp_path) as (url, _, _engines):
        for name in ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"):
            status, doc, _ = await call(url, {"model": "auto", "messages": MSGS}, **{name: "soon"})
            assert status == 400
            assert doc["error"]["param"] == name


async def test_target_header_sets_the_decisions_target(tmp_path: Path) -> None:
    async with served(tmp_path) as (url, gw, _engines):
        for header, value, want in (
            ("x-slo-ttft-ms", "1234", 1.234),
            ("x-llm-d-slo-ttft-ms", "777", 0.777),
        ):
            status, _, headers = await call(
                url, {"model": "auto", "messages": MSGS, "max_tokens": 2}, **{header: value}
            )
            assert status == 200
            rec = gw.decision(headers["x-bear-decision"])
            assert rec is not None
            assert rec.decision.ttft_target_s == pytest.approx(want)
        # A TPOT target routes: each candidate's TPOT is predicted (issue 21).
        status, _, headers = await call(
            url,
            {"model": "auto", "messages": MSGS, "max_tokens": 2},
            **{"x-llm-d-slo-tpot-ms": "40"},
        )
        rec = gw.decision(headers["x-bear-decision"])
        assert rec is not None
        assert rec.tpot_target_s == pytest.approx(0.04)
        assert rec.decision.tpot_target_s == pytest.approx(0.04)
        replayed = [
            c.tpot_s for c in rec.decision.candidates if c.estimator not in ("lps", "unpriced")
        ]
        assert replayed
        assert all(t > 0 for t in replayed)
        # The body's bear object wins over a header.
        status, _, headers = await call(
            url,
            {"model": "auto", "messages": MSGS, "max_tokens": 2, "bear": {"ttft_ms": 321}},
            **{"x-slo-ttft-ms": "999"},
        )
        rec = gw.decision(headers["x-bear-decision"])
        assert rec is not None
        assert rec.decision.ttft_target_s == pytest.approx(0.321)


async def test_reject_admission_answers_429_without_sending(tmp_path: Path) -> None:
    async with served(tmp_path, '[admission]\nmode = "reject"\n') as (url, _, engines):
        before = requests_seen(engines)
        # 1 ms for a first token: no instance can, every one is predicted late.
        status, doc, headers = await call(
            url, {"model": "auto", "messages": MSGS}, **{"x-slo-ttft-ms": "1"}
        )
        assert status == 429
        assert doc["error"]["code"] == "slo_unattainable"
        assert int(headers["Retry-After"]) >= 1
        assert requests_seen(engines) == before
        status, _, _ = await call(url, {"model": "auto", "messages": MSGS, "max_tokens": 2})
        assert status == 200


async def test_queue_admission_gives_up_at_the_deadline(tmp_path: Path) -> None:
    extra = '[admission]\nmode = "queue"\nrecheck_ms = 5\n'
    async with served(tmp_path, extra) as (url, gw, engines):
        before = requests_seen(engines)
        status, doc, _ = await call(
            url, {"model": "auto", "messages": MSGS}, **{"x-slo-ttft-ms": "1"}
        )
        assert status == 429
        assert "after waiting" in doc["error"]["message"]
        assert gw.admission.held == 0
        assert requests_seen(engines) == before


async def test_health_readiness_and_metrics(tmp_path: Path) -> None:
    async with served(tmp_path, keys=False) as (url, _gw, _engines):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/healthz") as r:
                assert r.status == 200
            with anyio.fail_after(30):
                while True:
                    async with s.get(url + "/readyz") as r:
                        if r.status == 200:
                            break
                    await anyio.sleep(0.02)
            body = {"model": "auto", "messages": MSGS, "max_tokens": 2, "stream": True}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        for name in (
            "bearsdk_gateway_request_total",
            "bearsdk_gateway_request_ttft_seconds_bucket",
            "bearsdk_gateway_request_predicted_ttft_seconds_bucket",
            "bearsdk_gateway_request_ttft_prediction_duration_seconds_bucket",
            "bearsdk_speed_factor",
        ):
            assert name in text, name
        assert 'code="200"' in text


async def test_drain_ends_streams_cleanly(tmp_path: Path) -> None:
    async with served(tmp_path, keys=False) as (url, gw, _engines), aiohttp.ClientSession() as s:
        body = {"model": "auto", "messages": MSGS, "max_tokens": 4000, "stream": True,
                "bear": {"ttft_ms": 60000}}  # fmt: skip
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is running
            cut = await gw.drain(0.05)
            assert cut == 1
            rest = (await r.read()).decode()
        assert '"code":"draining"' in rest
        assert gw.in_flight == 0
        status, _doc, _ = await call(url, {"model": "auto", "messages": MSGS}, None)
        assert status == 503


async def test_dns_discovered_instances_serve_requests(tmp_path: Path) -> None:
    from bearsdk.gateway.discovery import StaticResolver

    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        eng = pool[0]
        path = tmp_path / "gateway.toml"
        path.write_text(
            "[server]\nport = 0\naccess_log = false\n"
            "[[discovery.dns]]\n"
            f'name = "vllm"\nhost = "vllm.test"\nport = {eng.port}\ninterval_s = 0.05\n'
            f'template = {{ model = "{eng.model_name}", profile = "{eng.config.profile}" }}\n',
            encoding="utf-8",
        )
        cfg = load_gateway_config(path)
        resolver = StaticResolver()
        resolver.set("vllm.test", ["127.0.0.1"])
        sock = listen("127.0.0.1", 0)
        urls: list[str] = []
        async with anyio.create_task_group() as tg:

            async def go(*, task_status: anyio.abc.TaskStatus[Gateway]) -> None:
                await run_gateway(
                    cfg,
                    sock,
                    ready=urls.append,
                    handle_signals=False,
                    resolver=resolver,
                    task_status=task_status,
                )

            gw = await tg.start(go)
            name = f"vllm/127.0.0.1:{eng.port}"
            assert gw.router.instances == [name]
            status, _, headers = await call(
                urls[0], {"model": eng.model_name, "messages": MSGS, "max_tokens": 2}, None
            )
            assert status == 200
            assert headers["x-bear-instance"] == name
            tg.cancel_scope.cancel()


async def test_access_log_names_the_key_never_the_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="bearsdk.gateway.access"):
        async with served(tmp_path) as (url, _, _engines):
            status, _, headers = await call(
                url, {"model": "auto", "messages": MSGS, "max_tokens": 2}
            )
            assert status == 200
            await call(url, {"model": "auto", "messages": MSGS}, "wrong-key-0123456789abcdef")
    lines = [
        orjson.loads(r.getMessage()) for r in caplog.records if r.name == "bearsdk.gateway.access"
    ]
    ok, refused = lines
    assert ok["status"] == 200
    assert ok["key"] == "main"
    assert ok["model"] == "auto"
    assert ok["decision"] == headers["x-bear-decision"]
    assert ok["instance"] == headers["x-bear-instance"]
    assert refused["status"] == 401
    assert refused["key"] is None
    assert KEY not in caplog.text
    assert "wrong-key" not in caplog.text


async def test_a_client_that_leaves_mid_stream_frees_everything(tmp_path: Path) -> None:
    async with served(tmp_path, keys=False) as (url, gw, engines):
        body = {"model": "Qwen/Qwen3-8B", "messages": MSGS, "max_tokens": 4000, "stream": True,
                "bear": {"ttft_ms": 60000}}  # fmt: skip
        async with aiohttp.ClientSession() as s:
            r = await s.post(url + "/v1/chat/completions", json=body)
            assert r.status == 200
            await r.content.readline()
            rid = r.headers["x-bear-decision"]
            r.close()  # the client goes away mid-stream
        with anyio.fail_after(30):
            while gw.in_flight:  # noqa: ASYNC110  (no event to wait on)
                await anyio.sleep(0.01)
        rec = gw.decision(rid)
        assert rec is not None
        assert rec.outcome == "cancelled"
        assert all(gw.router.inflight(n) == 0 for n in gw.router.instances)
        # The engine stopped generating for it.
        big = next(e for e in engines if e.model_name == "Qwen/Qwen3-8B")
        with anyio.fail_after(30):
            while big.num_running:  # noqa: ASYNC110
                await anyio.sleep(0.01)


async def test_gateways_share_dispatches_over_redis(tmp_path: Path, redis_url: str) -> None:
    # What --workers N runs: N gateways, one Redis bus; each sees the others' sends.
    cluster = f'[cluster]\nredis_url = "{redis_url}"\n'
    async with EnginePool.of("qwen3-8b-h100") as pool:
        a_dir, b_dir = tmp_path / "a", tmp_path / "b"
        a_dir.mkdir()
        b_dir.mkdir()
        async with (
            gateway(a_dir, pool, cluster, keys=False, signals=False) as (url_a, _),
            gateway(b_dir, pool, cluster, keys=False, signals=False) as (_, gw_b),
        ):
            cl_b = gw_b.router.cluster
            assert cl_b is not None
            overlay = cl_b.overlay
            assert overlay is not None
            body = {"model": "auto", "messages": MSGS, "max_tokens": 2, "bear": {"ttft_ms": 60000}}
            status, _, _ = await call(url_a, body, None)
            assert status == 200
            with anyio.fail_after(30):
                while overlay.stats().applied + overlay.stats().shown == 0:  # noqa: ASYNC110
                    await anyio.sleep(0.01)


def test_decision_history_is_bounded_by_candidates_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import attrs as _attrs

    from bearsdk.gateway import state as gw_state
    from bearsdk.router import Candidate, Decision

    monkeypatch.setattr(gw_state, "_MAX_KEPT_CANDIDATES", 10)
    cand = Candidate("a", "m", 0.5, 1.0, 0.4, 0.1, True, 0.4, "bea")
    base = Decision("r0", "bear", "a", (cand,) * 4, 0, 1.0, "best", 10, 10, 0.0, 1e-5)

    # Only the history's own state: no router behind it.
    gw = object.__new__(gw_state.Gateway)
    gw.config = load_gateway_config_text("[server]\ndecision_history = 100\n")
    gw._history = gw_state.OrderedDict()
    gw._history_candidates = 0
    for i in range(5):
        gw.record(_attrs.evolve(base, request_id=f"r{i}"), None, "auto")
    # 4 candidates each, at most 10 kept: the two newest decisions.
    assert list(gw._history) == ["r3", "r4"]
    assert gw._history_candidates == 8


def load_gateway_config_text(text: str) -> Any:
    import tomllib

    from bearsdk.gateway.config import gateway_config_from_dict

    doc = tomllib.loads(
        text + '[[instances]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
        'model = "Qwen/Qwen3-8B"\nprofile = "qwen3-8b-h100"\n'
    )
    return gateway_config_from_dict(doc)

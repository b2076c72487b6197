"""Emulated engine over HTTP: vLLM's API with the openai package and aiohttp, snapshots,
batch records, metrics, errors and injected faults."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from bearsdk.emulator import EmulatedEngine, EngineConfig, EnginePool, GroundTruthParams
from bearsdk.estimators.batch_time import BatchObservation
from bearsdk.snapshot import decode_snapshot

PROFILE = "qwen3-0.6b-h100"


def _engine() -> EmulatedEngine:
    # Engines run a task group, which must be entered and left in one task: tests
    # start them in their own body (pytest-asyncio runs fixture teardown elsewhere).
    cfg = EngineConfig(profile=PROFILE, publish_output_len=True, heartbeat_s=0.2, seed=1)
    return EmulatedEngine(cfg)


async def _until(cond: Callable[[], bool], within: float = 5.0) -> None:
    with anyio.fail_after(within):
        for _ in range(100_000):
            if cond():
                return
            await anyio.sleep(0.01)


async def _sse(resp: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """Parse an SSE stream: the JSON events, and whether it ended with [DONE]."""
    events, done = [], False
    async for line in resp.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        if line == b"data: [DONE]":
            done = True
            continue
        events.append(orjson.loads(line[6:]))
    return events, done


async def test_openai_client_streams_with_usage() -> None:
    async with _engine() as engine:
        await _test_openai_client_streams_with_usage(engine)


async def _test_openai_client_streams_with_usage(engine: EmulatedEngine) -> None:
    openai = pytest.importorskip("openai")
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="none") as client:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["Qwen/Qwen3-0.6B"]
        stream = await client.completions.create(
            model="Qwen/Qwen3-0.6B",
            prompt="Tell me about the sea",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        prompt_tokens = engine.tokenizer.count("Tell me about the sea")
        assert usage is not None
        assert usage.prompt_tokens == prompt_tokens
        assert usage.completion_tokens == 12
        assert usage.total_tokens == prompt_tokens + 12
        assert finish == "length"
        assert len(text.split()) >= 6

        stream = await client.chat.completions.create(
            model="Qwen/Qwen3-0.6B",
            messages=[{"role": "user", "content": "Say hello"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"bear_output_len": 4},
        )
        roles, pieces, finishes, usage = [], [], [], None
        async for chunk in stream:
            for c in chunk.choices:
                roles.append(c.delta.role)
                pieces.append(c.delta.content)
                finishes.append(c.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        assert roles[0] == "assistant"
        assert finishes[-1] == "stop"  # the forced length ends with end-of-sequence
        assert usage is not None
        assert usage.completion_tokens == 4

        reply = await client.chat.completions.create(
            model="Qwen/Qwen3-0.6B", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 3
        assert reply.choices[0].finish_reason == "length"
        assert reply.choices[0].message.content

        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(model="Qwen/Qwen3-0.6B", prompt="x", max_tokens=-1)
        assert err.value.status_code == 400


async def test_aiohttp_streaming_matches_vllm_chunk_format() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_aiohttp_streaming_matches_vllm_chunk_format(engine, http)


async def _test_aiohttp_streaming_matches_vllm_chunk_format(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Bear-Output-Len": "6", "X-Request-Id": "abc"}
    async with http.post(engine.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events, done = await _sse(r)
    assert done
    *chunks, usage = events
    assert {c["id"] for c in events} == {"cmpl-abc"}
    assert chunks[0]["object"] == "text_completion"
    assert set(chunks[0]["choices"][0]) == {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
        "token_ids", "weight_versions",
    }  # fmt: skip
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6
    assert set(usage["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    rec = engine.request_log[-1]
    assert (rec.id, rec.output_tokens, rec.finish_reason) == ("cmpl-abc", 6, "stop")

    chat = {
        "messages": [{"role": "user", "content": "List three colours"}],
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    async with http.post(engine.url + "/v1/chat/completions", json=chat) as r:
        events, done = await _sse(r)
    assert done
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    content = [e for e in events[1:] if e["choices"]]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert [e["usage"]["completion_tokens"] for e in content][-1] == 3
    assert events[-1]["usage"]["completion_tokens"] == 3

    # No usage chunk without stream_options; stop strings end the text before them.
    probe = {"prompt": "Tell a story", "max_tokens": 40, "bear_output_len": 40}
    async with http.post(engine.url + "/v1/completions", json=probe) as r:
        full = (await r.json())["choices"][0]["text"]
    stop_word = full.split()[5]
    async with http.post(
        engine.url + "/v1/completions", json={**probe, "stream": True, "stop": [stop_word]}
    ) as r:
        events, _ = await _sse(r)
    assert all(e["choices"] for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == full[: full.index(stop_word)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop_word


async def test_non_streaming_responses() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_non_streaming_responses(engine, http)


async def _test_non_streaming_responses(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 5, "bear_output_len": 9}
    async with http.post(engine.url + "/v1/completions", json=body) as r:
        out = await r.json()
    assert out["object"] == "text_completion"
    assert out["usage"] == {
        "prompt_tokens": 4, "total_tokens": 9, "completion_tokens": 5,
        "prompt_tokens_details": None, "completion_tokens_details": None,
    }  # fmt: skip
    assert out["choices"][0]["finish_reason"] == "length"
    async with http.post(
        engine.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
              "bear_output_len": 2},
    ) as r:  # fmt: skip
        out = await r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == 2
    async with http.get(engine.url + "/health") as r:
        assert r.status == 200
    async with http.get(engine.url + "/version") as r:
        assert "version" in await r.json()
    async with http.post(
        engine.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    ) as r:
        tok = await r.json()
    assert tok["count"] == 2
    assert tok["token_strs"] == ["Hello", " world"]
    assert tok["max_model_len"] == engine.max_model_len


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str, str]] = [
    ("/v1/completions", {"max_tokens": 5}, 400, "body.prompt", "Field required"),
    ("/v1/chat/completions", {"model": "Qwen/Qwen3-0.6B"}, 400, "body.messages", "missing"),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": -3},
        400,
        "max_tokens",
        "max_tokens must be at least 1, got -3.",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": "lots"},
        400,
        "body.max_tokens",
        "int_parsing",
    ),
    (
        "/v1/completions",
        {"prompt": "word " * 41000},
        400,
        "input_tokens",
        "This model's maximum context length is 40960 tokens. However, your prompt contains",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": 50000},
        400,
        "max_tokens",
        "max_tokens=50000 cannot be greater than max_model_len=40960",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"content": "x"}]},
        400,
        "body.messages.0.role",
        "must be a non-empty string",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "model": "gpt-4"},
        404,
        "model",
        "The model `gpt-4` does not exist.",
    ),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", "n must be 1"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "body",
        "Stream options can only be defined when `stream=True`.",
    ),
]


async def test_bad_requests_get_vllm_style_errors() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        for path, body, status, param, fragment in BAD_REQUESTS:
            async with http.post(engine.url + path, json=body) as r:
                assert r.status == status, (path, body)
                err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == status
            assert err["param"] == param, (body, err)
            assert fragment in err["message"], (body, err)
            assert err["type"] in ("BadRequestError", "Bad Request", "NotFoundError")
        for path in ("/v1/completions", "/v1/chat/completions"):
            async with http.post(engine.url + path, data=b"{not json") as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "body.0"
        assert not engine.request_log  # nothing reached the scheduler


async def test_client_ttft_matches_engine_record() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_client_ttft_matches_engine_record(engine, http)


async def _test_client_ttft_matches_engine_record(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    diffs = []
    for i in range(10):
        body = {"prompt": "x " * (50 * i + 10), "max_tokens": 3, "stream": True}
        t0 = time.monotonic()
        first = None
        async with http.post(
            engine.url + "/v1/completions", json=body, headers={"X-Request-Id": f"t{i}"}
        ) as r:
            async for line in r.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - t0
        assert first is not None
        rec = next(x for x in engine.request_log if x.id == f"cmpl-t{i}")
        assert rec.ttft is not None
        diffs.append(first - rec.ttft)
    # The client sees the first token after the engine emitted it, a loopback hop later.
    assert min(diffs) > -0.0005
    assert statistics.median(diffs) < 0.005
    assert max(diffs) < 0.05


async def test_metrics_follow_vllm() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_metrics_follow_vllm(engine, http)


async def _test_metrics_follow_vllm(engine: EmulatedEngine, http: aiohttp.ClientSession) -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    for i in range(3):
        body = {"prompt": "hello " * (i + 1), "max_tokens": 4}
        async with http.post(engine.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    async with http.get(engine.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}

    def value(name: str, sample: str | None = None) -> float:
        return sum(s.value for s in fams[name].samples if sample is None or s.name == sample)

    assert value("vllm:num_requests_running") == 0
    assert value("vllm:num_requests_waiting") == 0
    assert value("vllm:kv_cache_usage_perc") == 0
    assert value("vllm:generation_tokens") == 12
    assert value("vllm:prompt_tokens") == sum(
        engine.tokenizer.count("hello " * n) for n in (1, 2, 3)
    )
    assert value("vllm:num_preemptions") == 0
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 9
    assert value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    info = fams["vllm:cache_config_info"].samples[0].labels
    assert info["num_gpu_blocks"] == str(engine.policy.num_blocks)
    assert info["block_size"] == "16"


async def test_snapshots_push_stream_and_batches() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_snapshots_push_stream_and_batches(engine, http)


async def _test_snapshots_push_stream_and_batches(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    async with http.get(engine.url + "/bear/snapshot") as r:
        first = decode_snapshot(await r.read())
    assert first.epoch == engine.epoch
    assert len(first) == 0
    lines: list[bytes] = []
    batches: list[bytes] = []

    async def read_stream(path: str, out: list[bytes], n: int) -> None:
        async with http.get(engine.url + path) as r:
            assert r.headers["Content-Type"] == "application/x-ndjson"
            async for line in r.content:
                out.append(line)
                if len(out) >= n:
                    return

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_stream, "/bear/snapshots", lines, 12)
        tg.start_soon(read_stream, "/bear/batches", batches, 6)
        await anyio.sleep(0.3)  # idle: heartbeats only
        body = {"prompt": "a b c d", "max_tokens": 20, "bear_output_len": 20}
        async with http.post(engine.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    assert lines[0].strip()  # the current snapshot comes first
    assert b"\n" in lines  # a heartbeat while idle
    snaps = [decode_snapshot(x) for x in lines if x.strip()]
    seqs = [s.seq for s in snaps]
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    busy = [s for s in snaps if len(s)]
    assert busy
    assert busy[-1].requests()[0].output_len == 20
    assert any(s.inflight_remaining_s is not None for s in busy)
    obs = [BatchObservation.from_dict(orjson.loads(x)) for x in batches if x.strip()]
    assert obs
    assert obs[0].prefill_tokens == 4
    assert all(o.duration_s > 0 for o in obs)


async def test_faults_errors_drops_latency_stall() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_faults_errors_drops_latency_stall(engine, http)


async def _test_faults_errors_drops_latency_stall(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    url = engine.url
    async with http.post(url + "/bear/faults", json={"fail_next": 1, "error_status": 503}) as r:
        assert (await r.json())["pending_failures"] == 1
    body = {"prompt": "x", "max_tokens": 8, "stream": True, "bear_output_len": 8}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 503
        assert (await r.json())["error"]["type"] == "ServiceUnavailableError"
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        await r.read()

    engine.faults.drop_next(1, after_chunks=2)
    got: list[bytes] = []

    async def read_all() -> None:
        async with http.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    got.append(line)

    with pytest.raises(aiohttp.ClientPayloadError):
        await read_all()
    assert len(got) == 2
    await _until(lambda: engine.request_log[-1].finish_reason == "abort")

    engine.faults.drop_next(1, after_chunks=0)

    async def post() -> None:
        async with http.post(url + "/v1/completions", json=body) as r:
            await r.read()

    with pytest.raises(aiohttp.ClientError):
        await post()

    async with http.post(url + "/bear/faults", json={"latency_s": 0.05}) as r:
        assert r.status == 200
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json={**body, "stream": False}) as r:
        assert r.status == 200
    elapsed = time.monotonic() - t0
    rec = engine.request_log[-1]
    assert elapsed >= 2 * 0.05 + (rec.finished - rec.arrival) - 0.002
    engine.faults.clear()

    engine.faults.stall(0.3)
    t0 = time.monotonic()
    async with http.post(url + "/v1/completions", json={**body, "stream": False}) as r:
        assert r.status == 200
    assert time.monotonic() - t0 >= 0.3

    async with http.post(url + "/bear/faults", json={"error_rate": 3}) as r:
        assert r.status == 400
        assert "error_rate must be in [0, 1] (got 3)" in (await r.json())["error"]["message"]


async def test_slow_snapshot_publishing() -> None:
    async with _engine() as engine:
        await _test_slow_snapshot_publishing(engine)


async def _test_slow_snapshot_publishing(engine: EmulatedEngine) -> None:
    engine.faults.snapshot_delay_s = 0.2
    h = engine.submit_tokens(10, 40)
    await anyio.sleep(0.1)
    assert engine.latest_snapshot.seq < engine.captured_snapshot.seq
    await h.result()
    await _until(lambda: engine.latest_snapshot.seq == engine.captured_snapshot.seq)
    assert engine.latest_snapshot.captured_at <= anyio.current_time() - 0.2


async def test_restart_drops_connections_and_starts_a_new_epoch() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        await _test_restart_drops_connections_and_starts_a_new_epoch(engine, http)


async def _test_restart_drops_connections_and_starts_a_new_epoch(
    engine: EmulatedEngine, http: aiohttp.ClientSession
) -> None:
    old_epoch = engine.epoch
    url = engine.url
    body = {"prompt": "x", "max_tokens": 500, "stream": True, "bear_output_len": 500}

    old_seq = [0]

    async def stream_and_restart() -> None:
        chunks = 0
        async with http.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                if chunks == 20:  # the old epoch well past its first snapshots
                    async with http.get(url + "/bear/snapshot") as rs:
                        old_seq[0] = decode_snapshot(await rs.read()).seq
                    async with http.post(url + "/bear/restart", json={"downtime_s": 0.3}) as rr:
                        assert (await rr.json())["restarting"] is True

    with pytest.raises(aiohttp.ClientError):
        await stream_and_restart()
    await anyio.sleep(0.1)

    async def health() -> None:
        async with http.get(url + "/health") as r:
            await r.read()

    with pytest.raises(aiohttp.ClientConnectionError):
        await health()
    with anyio.fail_after(10):  # back after the downtime (later on a busy machine)
        while True:
            try:
                await health()
                break
            except aiohttp.ClientConnectionError:
                await anyio.sleep(0.05)
    async with http.get(url + "/bear/snapshot") as r:
        snap = decode_snapshot(await r.read())
    assert snap.epoch == engine.epoch != old_epoch
    # seq started over (the aborted requests' clean-up may publish a few more).
    assert old_seq[0] >= 20
    assert snap.seq < old_seq[0]
    assert len(snap) == 0
    async with http.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 200


async def test_pool_runs_several_engines_on_one_loop() -> None:
    fast = GroundTruthParams(time_scale=0.5)
    async with (
        EnginePool.of(
            "qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-0.6b-h100", time_model=fast
        ) as pool,
        aiohttp.ClientSession() as http,
    ):
        assert [e.instance for e in pool] == [
            "qwen3-0.6b-h100-0", "qwen3-8b-h100-0", "qwen3-0.6b-h100-1",
        ]  # fmt: skip
        assert len(set(pool.urls)) == 3

        async def one(url: str) -> int:
            async with http.post(
                url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}
            ) as r:
                return int((await r.json())["usage"]["completion_tokens"])

        results: list[int] = []

        async def run(url: str) -> None:
            results.append(await one(url))

        async with anyio.create_task_group() as tg:
            for url in pool.urls * 2:
                tg.start_soon(run, url)
        assert results == [5] * 6


async def test_known_answers_set_the_natural_length() -> None:
    answers = {"Name three rivers.": 7, "Write a long essay on rivers.": 40}
    cfg = EngineConfig(profile=PROFILE, served_model_name="my-model", answer_lengths=answers)
    async with EmulatedEngine(cfg) as engine, aiohttp.ClientSession() as http:
        chat = engine.url + "/v1/chat/completions"
        for text, n in answers.items():
            # The chat's last user message is the key; earlier turns do not matter.
            messages = [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": text},
            ]
            async with http.post(chat, json={"model": "my-model", "messages": messages}) as r:
                out = await r.json()
            assert out["usage"]["completion_tokens"] == n
            assert out["choices"][0]["finish_reason"] == "stop"
        body = {"prompt": "Name three rivers.", "max_tokens": 100}
        async with http.post(engine.url + "/v1/completions", json=body) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 7
        # A cap still cuts a known answer; a forced length still wins.
        capped = {"messages": [{"role": "user", "content": "Write a long essay on rivers."}]}
        async with http.post(chat, json={**capped, "max_tokens": 5}) as r:
            out = await r.json()
        assert out["usage"]["completion_tokens"] == 5
        assert out["choices"][0]["finish_reason"] == "length"
        async with http.post(chat, json={**capped, "bear_output_len": 3}) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 3


def test_known_answers_are_validated() -> None:
    from bearsdk.emulator import EngineConfigError

    with pytest.raises(EngineConfigError, match=r"answer_lengths\['x'\] must map a str to an int"):
        EngineConfig(answer_lengths={"x": 0})
    with pytest.raises(EngineConfigError, match="answer_lengths must be a mapping"):
        EngineConfig(answer_lengths=[("x", 3)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------- admin endpoints


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stall_s": 3600}, "stall_s must be a number in [0, 60] (got 3600)"),
        ({"stall_s": 2**64 - 1}, "stall_s must be a number in [0, 60]"),
        ({"latency_s": 3600.0}, "latency_s must be a number in [0, 60] (got 3600.0)"),
        ({"snapshot_delay_s": 1e308}, "snapshot_delay_s must be a number in [0, 60]"),
        ({"fail_next": 10**12}, "fail_next must be an integer in [0, 100000]"),
        ({"drop_next": 2**63}, "drop_next must be an integer in [0, 100000]"),
        ({"fault_paths": ["/v1"] * 1000}, "fault_paths must be a list of at most 64 paths"),
        ({"x" * 10_000: 1}, "is not a fault setting"),
    ],
)
async def test_fault_settings_are_bounded(body: dict[str, Any], message: str) -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        before = engine.faults.to_dict()
        async with http.post(engine.url + "/bear/faults", json=body) as r:
            assert r.status == 400
            got = (await r.json())["error"]["message"]
        assert message in got
        assert len(got) <= 1024
        assert engine.faults.to_dict() == before  # refused whole: nothing changed
        # The engine still answers at once (a 3600 s stall would hang every request).
        with anyio.fail_after(10):
            h = engine.submit_tokens(4, 2)
            await h.result()


def test_an_integer_beyond_any_float_is_refused_by_name() -> None:
    from bearsdk.emulator import Faults
    from bearsdk.emulator.faults import FaultsError

    with pytest.raises(FaultsError, match=r"stall_s must be a number in \[0, 60\]"):
        Faults().update({"stall_s": 10**400})


async def test_pending_stalls_add_up_to_the_bound() -> None:
    async with _engine() as engine, aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(engine.url + "/bear/faults", json={"stall_s": 30}) as r:
                assert r.status == 200
        async with http.post(engine.url + "/bear/faults", json={"stall_s": 1}) as r:
            assert r.status == 400
            assert "stall_s must be a number in [0, 0]" in (await r.json())["error"]["message"]
        assert engine.faults.take_stall() == 60.0


async def test_restart_downtime_is_bounded() -> None:
    async with (
        _engine() as engine,
        aiohttp.ClientSession() as http,
        http.post(engine.url + "/bear/restart", json={"downtime_s": 3600}) as r,
    ):
        assert r.status == 400
        assert "downtime_s must be a number in [0, 60]" in (await r.json())["error"]["message"]


async def test_admin_endpoints_need_the_token_once_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BEARSDK_ADMIN_TOKEN", "tok-0123456789")
    async with _engine() as engine, aiohttp.ClientSession() as http:
        url = engine.url
        for path, body in (("/bear/faults", {"fail_next": 1}), ("/bear/restart", {})):
            for headers in ({}, {"Authorization": "Bearer wrong-token"}):
                async with http.post(url + path, json=body, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    assert r.headers["WWW-Authenticate"] == "Bearer"
        assert engine.faults.to_dict()["pending_failures"] == 0
        async with http.get(url + "/bear/faults") as r:  # reading stays open
            assert r.status == 200
        auth = {"Authorization": "Bearer tok-0123456789"}
        async with http.post(url + "/bear/faults", json={"fail_next": 1}, headers=auth) as r:
            assert r.status == 200
        assert engine.faults.to_dict()["pending_failures"] == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.invalid"])
async def test_a_non_loopback_bind_without_a_token_refuses_to_start(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bearsdk.emulator.server import AdminTokenError

    monkeypatch.delenv("BEARSDK_ADMIN_TOKEN", raising=False)
    cfg = EngineConfig(profile=PROFILE, host=host, seed=1)
    with pytest.raises(AdminTokenError, match=f"binding '{host}'.*BEARSDK_ADMIN_TOKEN"):
        async with EmulatedEngine(cfg):
            pass


def test_loopback_addresses() -> None:
    from bearsdk.emulator.server import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))

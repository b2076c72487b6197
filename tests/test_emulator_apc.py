"""The emulated engine with vLLM's automatic prefix caching (issue 15, item 4).

The scheduler's cache itself is checked against vLLM's in
``tests/test_apc_oracle_cases.py``; here: the token ids the emulator feeds it (a
conversation's next turn really contains the previous turn's prompt and output
ids), ``usage.prompt_tokens_details`` as vLLM's server reports it with
``--enable-prompt-tokens-details``, the ``vllm:prefix_cache_*`` counters, the
engine TTFT a hit saves, and the ``bearsdk emulate`` flags.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import aiohttp
import orjson
import pytest

from bearsdk.emulator import EmulatedEngine, EngineConfig, GroundTruthParams
from bearsdk.emulator.api import parse_chat, parse_completion
from bearsdk.emulator.text import EOS_ID, Tokenizer, filler_tokens
from bearsdk.replay.requests import RUNNING, WAITING

PROFILE = "qwen3-0.6b-h100"
MODEL = "Qwen/Qwen3-0.6B"
SYSTEM = (
    "You are a meticulous assistant for a logistics company. Answer in plain English, "
    "cite the relevant policy section, and never invent shipment numbers. "
) * 40


def _engine(
    apc: bool, *, details: bool = True, profile: str = PROFILE, **params: object
) -> EmulatedEngine:
    cfg = EngineConfig(
        profile=profile,
        params={"enable_prefix_caching": apc, **params},
        time_model=GroundTruthParams().without_noise(),
        enable_prompt_tokens_details=details,
        seed=3,
    )
    return EmulatedEngine(cfg)


def _messages(system: str | None, *turns: str) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return out


async def _sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events = []
    async for line in resp.content:
        line = line.strip()
        if line and line != b"data: [DONE]":
            events.append(orjson.loads(line[6:]))
    return events


async def _chat(
    http: aiohttp.ClientSession,
    engine: EmulatedEngine,
    messages: Any,
    *,
    stream: bool = False,
    max_tokens: int = 300,
) -> tuple[str, dict[str, Any]]:
    """One chat request: its reply text and usage."""
    body: dict[str, Any] = {"model": engine.model_name, "messages": messages}
    body["max_tokens"] = max_tokens
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(engine.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            out = await r.json()
            return out["choices"][0]["message"]["content"], out["usage"]
        events = await _sse(r)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    return text, events[-1]["usage"]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# -- token ids --------------------------------------------------------------------


def test_chat_ids_are_counted_and_special() -> None:
    tok = Tokenizer()
    rendered = tok.render_chat(_messages("Be brief.", "Hi there", "Hello!", "Why?"))
    ids = tok.encode_chat(rendered)
    assert len(ids) == tok.count_chat(rendered) == len(tok.chat_pieces(rendered))
    assert ids[0] == 151644  # <|im_start|>, Qwen's id
    assert ids.count(151645) == 4  # <|im_end|> closes each of the four messages
    assert tok.eos == EOS_ID == 151645
    assert tok.special_id("<|endoftext|>") == 151643
    assert 151643 <= tok.special_id("<|tool_call|>") < tok.vocab_size
    # Filler output is made of the tokenizer's own pieces (long words split).
    for seed in range(50):
        pieces = filler_tokens(300, seed)
        assert len(pieces) == 300
        assert tok.pieces("".join(pieces)) == pieces


@pytest.mark.parametrize("seed", range(8))
def test_next_turn_starts_with_the_previous_turns_ids(seed: int) -> None:
    engine = _engine(True)
    question = f"Question {seed}: how do I track a parcel that left the depot?"
    turn1 = _messages(SYSTEM[: 200 * (seed + 1)], question)
    p1 = parse_chat({"messages": turn1}, {}, engine).plan
    assert p1.prompt_ids is not None
    assert p1.output_ids is not None
    assert len(p1.prompt_ids) == p1.prompt_tokens
    assert len(p1.output_ids) == p1.output_len
    reply = "".join(p1.texts)
    if p1.finish_reason == "stop":
        assert p1.output_ids[-1] == EOS_ID
    turn2 = _messages(SYSTEM[: 200 * (seed + 1)], question, reply, "And if it is late?")
    p2 = parse_chat({"messages": turn2}, {}, engine).plan
    assert p2.prompt_ids is not None
    # The template renders the reply and then <|im_end|>: the model's own EOS.
    n = p1.prompt_tokens + p1.output_len
    head = p1.prompt_ids + p1.output_ids
    if p1.finish_reason != "stop":
        head = (*head, EOS_ID)
        n += 1
    assert p2.prompt_ids[:n] == head


def test_ids_only_with_the_cache_and_token_prompts_kept() -> None:
    off, on = _engine(False), _engine(True)
    body = {"prompt": "Tell me about the sea", "max_tokens": 5}
    assert parse_completion(body, {}, off).plan.prompt_ids is None
    plan = parse_completion(body, {}, on).plan
    assert plan.prompt_ids == tuple(on.tokenizer.encode("Tell me about the sea"))
    assert plan.prompt_tokens == on.tokenizer.count("Tell me about the sea")
    plan = parse_completion({"prompt": [5, 6, 7], "max_tokens": 2}, {}, on).plan
    assert plan.prompt_ids == (5, 6, 7)
    assert plan.output_ids is not None
    assert len(plan.output_ids) == 2


# -- over HTTP ----------------------------------------------------------------------


async def test_multi_turn_hits_previous_turn_with_vllms_usage_and_metrics() -> None:
    async with _engine(True) as engine, aiohttp.ClientSession() as http:
        bs = engine.policy.block_size
        msgs = _messages(SYSTEM[:1500], "Where is my parcel?")
        reply1, u1 = await _chat(http, engine, msgs)
        p1, o1 = u1["prompt_tokens"], u1["completion_tokens"]
        assert u1["prompt_tokens_details"] == {
            "cached_tokens": 0,
            "created_cache_tokens": bs * (p1 // bs),
            "multimodal_tokens": None,
        }
        msgs = _messages(SYSTEM[:1500], "Where is my parcel?", reply1, "Can you check again?")
        reply2, u2 = await _chat(http, engine, msgs, stream=True)
        p2 = u2["prompt_tokens"]
        # The last sampled token never got KV: the hit is every full block of
        # the previous prompt and output but the one holding that token.
        hit = bs * ((p1 + o1 - 1) // bs)
        assert hit > 0
        assert u2["prompt_tokens_details"] == {
            "cached_tokens": hit,
            "created_cache_tokens": bs * (p2 // bs) - hit,
        }
        msgs += [{"role": "assistant", "content": reply2}, {"role": "user", "content": "Ok"}]
        _, u3 = await _chat(http, engine, msgs)
        hit3 = bs * ((p2 + u2["completion_tokens"] - 1) // bs)
        assert u3["prompt_tokens_details"]["cached_tokens"] == hit3
        records = {r.prompt_tokens: r for r in engine.request_log}
        assert records[p2].ttft is not None
        async with http.get(engine.url + "/metrics") as r:
            text = await r.text()
        # Tokens: each request's whole prompt was looked up once, the hits found.
        assert _metric(text, "vllm:prefix_cache_queries_total") == p1 + p2 + u3["prompt_tokens"]
        assert _metric(text, "vllm:prefix_cache_hits_total") == hit + hit3
        assert 'enable_prefix_caching="True"' in text
        assert "# TYPE vllm:prefix_cache_hits_total counter" in text
        assert "vllm:prefix_cache_hits_created{" in text


async def test_completions_block_aligned_prompt_recomputes_its_last_block() -> None:
    async with _engine(True) as engine, aiohttp.ClientSession() as http:
        bs = engine.policy.block_size
        prompt = list(range(100, 100 + 4 * bs))
        got = []
        for stream in (False, True):
            body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
            if stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            async with http.post(engine.url + "/v1/completions", json=body) as r:
                usage = (await r.json())["usage"] if not stream else (await _sse(r))[-1]["usage"]
            got.append(usage["prompt_tokens_details"])
        # Completions leave created_cache_tokens unset; a stream drops the unset fields.
        assert got == [
            {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None},
            {"cached_tokens": 3 * bs},
        ]


async def test_shared_system_prompt_hits_and_saves_ttft() -> None:
    users = [f"User {i} asks: what does clause {i * 7} say about refunds?" for i in range(6)]
    tok = Tokenizer()
    ttfts: dict[bool, list[float]] = {}
    for apc in (False, True):
        # An 8B model, whose 1,300-token prefill takes long enough to see the saving.
        engine = _engine(apc, profile="qwen3-8b-h100")
        async with engine, aiohttp.ClientSession() as http:
            bs = engine.policy.block_size
            seen: list[list[int]] = []
            for i, q in enumerate(users):
                msgs = _messages(SYSTEM, q)
                _, usage = await _chat(http, engine, msgs, max_tokens=4)
                ids = tok.encode_chat(tok.render_chat(msgs))
                common = max((_common(ids, s) for s in seen), default=0)
                seen.append(ids)
                want = bs * min(common // bs, (len(ids) - 1) // bs) if apc else 0
                assert usage["prompt_tokens_details"]["cached_tokens"] == want
                if apc and i:
                    assert want > 0.9 * len(ids)
            ttfts[apc] = [r.ttft for r in engine.request_log if r.ttft is not None]
            async with http.get(engine.url + "/metrics") as r:
                text = await r.text()
            hits = _metric(text, "vllm:prefix_cache_hits_total")
            queries = _metric(text, "vllm:prefix_cache_queries_total")
            if apc:
                assert 0.8 * queries < hits < queries
            else:
                assert hits == queries == 0
                assert 'enable_prefix_caching="False"' in text
    # The first request computes the whole prompt either way; later ones only
    # their own question with the cache.
    assert ttfts[True][0] == pytest.approx(ttfts[False][0], rel=0.5)
    later_on, later_off = sum(ttfts[True][1:]), sum(ttfts[False][1:])
    assert later_on < 0.6 * later_off


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def test_without_details_flag_usage_is_vllms_default() -> None:
    async with _engine(True, details=False) as engine, aiohttp.ClientSession() as http:
        msgs = _messages(SYSTEM[:800], "Hi")
        _, u = await _chat(http, engine, msgs)
        assert u["prompt_tokens_details"] is None
        _, u = await _chat(http, engine, msgs, stream=True)
        assert "prompt_tokens_details" not in u
        # The cache still works: the second request was counted as a hit.
        async with http.get(engine.url + "/metrics") as r:
            assert _metric(await r.text(), "vllm:prefix_cache_hits_total") > 0


async def test_cache_off_reports_zero() -> None:
    async with _engine(False) as engine, aiohttp.ClientSession() as http:
        msgs = _messages(SYSTEM[:800], "Hi")
        for stream in (False, True, False):
            _, u = await _chat(http, engine, msgs, stream=stream)
            assert u["prompt_tokens_details"]["cached_tokens"] == 0
            assert u["prompt_tokens_details"]["created_cache_tokens"] == 0
        assert not engine.prefix_caching
        async with http.get(engine.url + "/metrics") as r:
            text = await r.text()
        assert _metric(text, "vllm:prefix_cache_queries_total") == 0
        assert _metric(text, "vllm:prefix_cache_hits_total") == 0


async def test_preempted_readmission_is_not_in_the_counters() -> None:
    # A pool of 40 blocks of 16: two requests growing to 350 tokens each cannot
    # both fit, so the newer one is preempted and later admitted again.
    engine = _engine(True, num_gpu_blocks=40, max_model_len=512)
    assert engine.policy.block_size == 16
    async with engine:
        a = engine.submit_tokens(200, 150, prompt_ids=range(1, 201))
        b = engine.submit(engine.plan(200, natural_len=150, prompt_ids=list(range(2, 202))))
        with pytest.raises(ValueError, match="prompt_ids must have prompt_tokens=5 ids"):
            engine.submit_tokens(5, 1, prompt_ids=[1, 2])
        await a.result()
        await b.result()
        pool = engine._core.pool
        assert pool is not None
        assert pool.preempted_queries > 0
        counters = engine.metrics.counters
        assert counters["vllm:num_preemptions"] >= 1
        assert counters["vllm:prefix_cache_queries"] == 400
        assert counters["vllm:prefix_cache_hits"] == pool.hits
        assert b.cached_tokens == 0
        assert a.cached_tokens == 0


async def test_created_cache_tokens_need_the_blocks_at_the_first_token() -> None:
    # vLLM counts the blocks the request holds when its first output is processed:
    # one preempted while that token was in flight (asynchronous scheduling) holds none.
    engine = _engine(True)
    bs = engine.policy.block_size
    h = engine.submit(engine.plan(5 * bs + 3, natural_len=4, prompt_ids=range(1, 5 * bs + 4)))
    h.cached_tokens = 2 * bs
    engine._core.requests[h.id].status = RUNNING
    engine._cache_created(h)
    assert h.created_cache_tokens == 3 * bs
    h.created_cache_tokens = 0
    engine._core.requests[h.id].status = WAITING
    engine._cache_created(h)
    assert h.created_cache_tokens == 0


# -- CLI ---------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bearsdk", "emulate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheduler", "sarathi", "--enable-prefix-caching"], "has no prefix cache"),
        (
            ["--enable-prefix-caching", "--param", "enable_prefix_caching=false"],
            "give one of them",
        ),
    ],
)
def test_cli_prefix_caching_errors_are_one_line(args: list[str], message: str) -> None:
    out = _cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("bearsdk emulate: error:")
    assert message in lines[0]


def test_cli_flags_reach_the_engine_config() -> None:
    import argparse

    from bearsdk.cli import emulate

    parser = argparse.ArgumentParser()
    emulate.register(parser.add_subparsers())
    cfg = emulate._configs(
        parser.parse_args(["emulate", "--enable-prefix-caching", "--enable-prompt-tokens-details"])
    )[0]
    assert cfg.params["enable_prefix_caching"] is True
    assert cfg.enable_prompt_tokens_details
    cfg = emulate._configs(parser.parse_args(["emulate", "--no-enable-prefix-caching"]))[0]
    assert cfg.params["enable_prefix_caching"] is False
    cfg = emulate._configs(parser.parse_args(["emulate"]))[0]
    assert "enable_prefix_caching" not in cfg.params
    assert not cfg.enable_prompt_tokens_details
    # A scheduler without a cache takes --no-enable-prefix-caching (it is off).
    args = parser.parse_args(["emulate", "--scheduler", "sarathi", "--no-enable-prefix-caching"])
    assert "enable_prefix_caching" not in emulate._configs(args)[0].params

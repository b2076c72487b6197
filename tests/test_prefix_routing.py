"""The router tokenizes prompts as the engines do and routes on the prefix each holds (issue 16).

With a model's tokenizer configured (here the emulated engine's own, as the
router loads it: :func:`~bearsdk.emulator.chat_tokenizer.stand_in_chat_tokenizer`),
``decide()`` on chat messages, with no ids from the caller, prices each
candidate with the prompt's exact length and the blocks its KV events say it
holds: the next turn of a conversation goes where the previous one left its
cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import aiohttp
import anyio
import attrs
import pytest

pytest.importorskip("zmq")
pytest.importorskip("jinja2")

from bearsdk.emulator import EngineConfig, EnginePool
from bearsdk.emulator.chat_tokenizer import stand_in_chat_tokenizer
from bearsdk.router import AsyncRouter, InstanceConfig
from bearsdk.router.core import RouterCore
from bearsdk.selectors import BEAR


async def _until(cond: Callable[[], bool]) -> None:
    """Poll ``cond`` for up to 10 s (the subscriber is a socket loop: no event to wait on)."""
    with anyio.fail_after(10):
        for _ in range(1_000_000):
            if cond():
                return
            await anyio.sleep(0.01)


def _conversation(seed: int, words: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    vocab = ["agent", "tool", "result", "the", "file", "bug", "search", "code", "fix", "test"]
    text = " ".join(rng.choice(vocab) for _ in range(words))
    return [
        {"role": "system", "content": "You are a coding agent. " + text},
        {"role": "user", "content": "Find the failing test."},
    ]


async def test_the_next_turn_of_a_conversation_goes_where_its_prefix_is_cached() -> None:
    params = {"enable_prefix_caching": True, "max_model_len": 16384}
    cfgs = [
        EngineConfig(
            profile="qwen3-8b-h100", params=params, instance=f"e{i}", seed=i, kv_events=True
        )
        for i in range(2)
    ]
    async with EnginePool(cfgs) as pool:
        engines = list(pool)
        confs = pool.instance_configs()
        assert all(c.kv_events is not None and c.kv_events_replay is not None for c in confs)
        own = pool.instance_configs(calibrated=True)
        assert [c.batch_time for c in own] == [e.calibrated_batch_time() for e in engines]
        model = engines[0].model_name
        tok = stand_in_chat_tokenizer(engines[0].tokenizer)
        async with AsyncRouter(confs, BEAR(), tokenizers={model: tok}) as router:
            warm, cold = engines[0].instance, engines[1].instance
            await anyio.sleep(0.2)  # the SUB sockets join
            msgs = _conversation(1, 3000)
            async with aiohttp.ClientSession() as http:
                # The first turn, sent straight to one engine (as another router would).
                body = {"model": model, "messages": msgs, "max_tokens": 8}
                async with http.post(f"{engines[0].url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    reply = (await r.json())["choices"][0]["message"]["content"]
            first = tok.encode_chat(msgs)
            index = router.core.slot(warm).kv_index
            assert index is not None
            await _until(lambda: index.hit_blocks(first.chain(16)) >= len(first) // 16 - 1)
            msgs += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Fix it."},
            ]
            d = router.decide(msgs, ttft_target=5.0)
            cached = {c.instance: c.cached_tokens for c in d.candidates}
            # Everything up to the first turn's last full block, the turn's own ids reused.
            assert cached[warm] >= (len(first) // 16 - 1) * 16
            assert cached[cold] == 0
            assert d.instance == warm
            ttft = {c.instance: c.ttft_s for c in d.candidates}
            assert ttft[warm] < 0.5 * ttft[cold]
            # The candidates' prompt length is the engine's own count.
            want = len(engines[0].tokenizer.encode_chat(engines[0].tokenizer.render_chat(msgs)))
            assert {c.prompt_tokens for c in d.candidates} == {want}
            assert tok.reused > 0


def test_a_prompt_the_tokenizer_refuses_routes_without_ids_and_is_counted() -> None:
    from bearsdk.emulator.text import Tokenizer

    core = RouterCore(
        [
            InstanceConfig(
                name="a", url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", profile="qwen3-8b-h100"
            )
        ],
        BEAR(),
        tokenizers={"Qwen/Qwen3-8B": stand_in_chat_tokenizer(Tokenizer())},
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    d = core.decide(image, ttft_target=5.0)
    assert d.candidates[0].cached_tokens == -1
    assert core.prompts.failures == {"Qwen/Qwen3-8B": 1}
    d = core.decide([{"role": "user", "content": "hello there"}], ttft_target=5.0)
    assert d.candidates[0].prompt_tokens == len(
        Tokenizer().encode_chat(
            Tokenizer().render_chat([{"role": "user", "content": "hello there"}])
        )
    )


def test_without_ids_or_events_the_router_estimates_the_prefix_from_its_dispatches() -> None:
    cfgs = [
        InstanceConfig(
            name=n,
            url="http://127.0.0.1:9",
            model="Qwen/Qwen3-8B",
            profile="qwen3-8b-h100",
            scheduler_params={"enable_prefix_caching": True, "num_gpu_blocks": 4000},
        )
        for n in ("a", "b")
    ]
    core = RouterCore(cfgs, BEAR(), dispatch_prefixes=True)
    msgs = _conversation(2, 2000)
    first = core.decide(msgs, ttft_target=5.0)
    assert {c.cache_source for c in first.candidates} == {"dispatches"}
    assert {c.cached_tokens for c in first.candidates} == {0}
    sent = first.instance
    msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    d = core.decide(msgs, ttft_target=5.0)
    cached = {c.instance: c.cached_tokens for c in d.candidates}
    other = "b" if sent == "a" else "a"
    ptok = d.candidates[0].prompt_tokens
    # Nearly the whole previous prompt, in tokens at the prompt's own ratio.
    assert 0.8 * ptok < cached[sent] < ptok
    assert cached[other] == 0
    ttft = {c.instance: c.ttft_s for c in d.candidates}
    assert ttft[sent] < 0.5 * ttft[other]
    assert "cached ~" in d.explain()
    # BEAR's options carry the same cached tokens: its home affinity finds them.
    home = RouterCore(cfgs, BEAR(affinity="home"), dispatch_prefixes=True)
    went = home.decide(_conversation(2, 2000), ttft_target=5.0).instance
    d = home.decide(msgs, ttft_target=5.0)
    assert d.instance == went
    assert d.reason == "the instance holding the request's prefix, predicted on time"
    # An instance without prefix caching gets no estimate, and none is the default.
    no_apc = attrs.evolve(cfgs[0], scheduler_params={"enable_prefix_caching": False})
    off = RouterCore([no_apc], BEAR(), dispatch_prefixes=True)
    assert off.decide(msgs, ttft_target=5.0).candidates[0].cache_source == ""
    assert RouterCore(cfgs, BEAR()).decide(msgs, ttft_target=5.0).candidates[0].cached_tokens == -1


def test_the_dispatch_index_ages_out_the_oldest_blocks() -> None:
    from bearsdk.prompts.approx import DispatchIndex

    idx = DispatchIndex(capacity=10)
    idx.record([1, 2, 3, 4, 5, 6])
    idx.record([7, 8, 9, 10, 11, 12])  # 1 and 2 age out
    assert len(idx) == 10
    assert idx.hit_blocks([1, 2, 3]) == 0
    assert idx.hit_blocks([3, 4, 5, 99]) == 3
    idx.record([3])  # touched: now the newest
    idx.record([20, 21])
    assert idx.hit_blocks([3]) == 1
    assert idx.hit_blocks([4]) == 0

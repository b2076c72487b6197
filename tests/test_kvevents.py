"""vLLM's KV events: the wire format, and the prefix index they feed (issue 16).

The golden payload below was written by vLLM 0.33's own classes
(``vllm.distributed.kv_events``: a ``KVEventBatch`` with two ``BlockStored``,
one with an int and one with a bytes hash, a ``BlockRemoved`` and an
``AllBlocksCleared``, rank 0) and ``msgspec.msgpack.encode``.
"""

from __future__ import annotations

import base64
import contextlib
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.kvevents.index import PrefixIndex
from bearsdk.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventError,
    decode_batch,
    encode_batch,
    from_scheduler,
)
from bearsdk.replay.blocks import chain_keys, extend_chain
from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.schedulers import bind_scheduler

VLLM_0_33 = base64.b64decode(
    "k8s/+AAAAAAAAJTeAAikdHlwZatCbG9ja1N0b3JlZKxibG9ja19oYXNoZXOSe80ByLFwYXJlbnRfYmxvY2tfaGFzaMCp"
    "dG9rZW5faWRz3AAgAAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+qYmxvY2tfc2l6ZRCnbG9yYV9pZMCmbWVk"
    "aXVto0dQValsb3JhX25hbWXA3gAIpHR5cGWrQmxvY2tTdG9yZWSsYmxvY2tfaGFzaGVzkcQCAQKxcGFyZW50X2Jsb2Nr"
    "X2hhc2jNAcipdG9rZW5faWRz3AAQICEiIyQlJicoKSorLC0uL6pibG9ja19zaXplEKdsb3JhX2lkwKZtZWRpdW2jR1BV"
    "qWxvcmFfbmFtZcCDpHR5cGWsQmxvY2tSZW1vdmVkrGJsb2NrX2hhc2hlc5F7pm1lZGl1baNHUFWBpHR5cGWwQWxsQmxv"
    "Y2tzQ2xlYXJlZAA="
)


def test_vllms_own_payload_decodes_and_reencodes_to_the_same_document() -> None:
    b = decode_batch(VLLM_0_33)
    assert b.ts == 1.5
    assert b.data_parallel_rank == 0
    stored, stored2, removed, cleared = b.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [123, 456]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32))
    assert stored.block_size == 16
    assert isinstance(stored2, BlockStored)
    assert stored2.block_hashes == [b"\x01\x02"]
    assert stored2.parent_block_hash == 456
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [123]
    assert isinstance(cleared, AllBlocksCleared)
    again = encode_batch(b.ts, b.events, b.data_parallel_rank)
    assert msgspec.msgpack.decode(again) == msgspec.msgpack.decode(VLLM_0_33)


def _stored(**kw: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    doc.update(kw)
    return doc


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (_stored(token_ids=list(range(15))), "token_ids"),
        (_stored(block_size=0), "block_size"),
        (_stored(block_hashes=[b"x" * 65]), "block_hashes"),
        (_stored(parent_block_hash=b""), "parent_block_hash"),
        (_stored(block_hashes="x"), "block_hashes"),
        ({"type": "BlockEvicted", "block_hashes": [1]}, "BlockEvicted"),
        ({"type": "BlockRemoved", "block_hashes": [1] * 70_000, "medium": None}, "block_hashes"),
    ],
)
def test_an_event_that_cannot_be_what_it_claims_is_refused_by_name(
    event: dict[str, object], field: str
) -> None:
    with pytest.raises(KVEventError, match=field):
        decode_batch(msgspec.msgpack.encode([0.0, [event]]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_a_kv_event_error(data: bytes) -> None:
    with contextlib.suppress(KVEventError):
        decode_batch(data)


def test_stored_blocks_get_the_keys_a_prompts_own_chain_has() -> None:
    tokens = list(range(100))
    keys = chain_keys(tokens, 16)
    assert extend_chain(None, tokens[:32], 16) == keys[:2]
    assert extend_chain(keys[1], tokens[32:96], 16) == keys[2:6]
    idx = PrefixIndex(16, 100)
    ev = [
        BlockStored([b"h0", b"h1"], None, tokens[:32], 16, None, "GPU", None),
        BlockStored([b"h2"], b"h1", tokens[32:48], 16, None, "GPU", None),
    ]
    idx.apply(decode_batch(encode_batch(0.0, ev)))
    assert idx.hit_blocks(keys) == 3
    assert idx.hit_blocks(chain_keys([7, *tokens[1:]], 16)) == 0
    # A duplicate stays findable until both copies are removed.
    idx.apply(decode_batch(encode_batch(1.0, [ev[1]])))
    idx.apply(decode_batch(encode_batch(2.0, [BlockRemoved([b"h2"], "GPU")])))
    assert idx.hit_blocks(keys) == 3
    idx.apply(decode_batch(encode_batch(3.0, [BlockRemoved([b"h2", b"nope"], "GPU")])))
    assert idx.hit_blocks(keys) == 2
    idx.apply(decode_batch(encode_batch(4.0, [AllBlocksCleared()])))
    assert idx.hit_blocks(keys) == 0
    assert idx.blocks == 0


def test_the_index_refuses_more_blocks_than_the_engine_holds_and_other_block_sizes() -> None:
    idx = PrefixIndex(16, 2)
    too_many = BlockStored([1, 2, 3], None, list(range(48)), 16, None, "GPU", None)
    with pytest.raises(KVEventError, match="more than the 2"):
        idx.apply(decode_batch(encode_batch(0.0, [too_many])))
    other = BlockStored([1], None, list(range(32)), 32, None, "GPU", None)
    with pytest.raises(KVEventError, match="block_size 32"):
        idx.apply(decode_batch(encode_batch(0.0, [other])))


def _engine(seed: int) -> tuple[SchedulerCore, random.Random, list[list[int]]]:
    pol = bind_scheduler(
        "vllm-v1",
        {
            "max_num_batched_tokens": 1024,
            "max_num_seqs": 16,
            "block_size": 16,
            "num_gpu_blocks": 600,
            "enable_prefix_caching": True,
        },
    )
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50_000) for _ in range(rng.randint(100, 800))] for _ in range(6)]
    return SchedulerCore(pol), rng, systems


def _step(core: SchedulerCore, rng: random.Random, systems: list[list[int]], n: int) -> list[int]:
    """Maybe add a request (a shared system prompt and a user message), run a step."""
    prompt: list[int] = []
    if rng.random() < 0.5 and len(core.running) + len(core.waiting) < 40:
        prompt = rng.choice(systems) + [
            rng.randrange(1, 50_000) for _ in range(rng.randint(10, 300))
        ]
        out = [rng.randrange(1, 50_000) for _ in range(rng.randint(5, 60))]
        core.add_request(f"r{n}", len(prompt), len(out), len(out), prompt + out)
    core.process(core.schedule())
    return prompt


def test_the_index_fed_from_an_engines_events_is_its_own_lookup_under_eviction() -> None:
    # A 600-block pool, 40 residents over six shared system prompts: blocks are
    # cached, shared and evicted at every step; after each step's events the
    # index must answer every prefix as the engine's own lookup does.
    core, rng, systems = _engine(1)
    core.record_kv_events()
    idx = PrefixIndex(16, 10_000)
    prompts: list[list[int]] = []
    lookups = 0
    evicted = 0
    for step in range(1500):
        if p := _step(core, rng, systems, step):
            prompts.append(p)
        events = core.take_kv_events()
        evicted += sum(e[0] == "removed" for e in events)
        idx.apply(decode_batch(encode_batch(float(step), from_scheduler(events, 16))))
        assert core.pool is not None
        for _ in range(20):
            p = rng.choice(prompts) if prompts else systems[0]
            keys = chain_keys(p[: rng.randint(1, len(p))], 16)
            assert idx.hit_blocks(keys) == len(core.pool.lookup(keys, len(keys)))
            lookups += 1
    assert core.pool is not None
    assert idx.blocks == core.pool.num_cached
    assert evicted > 1000
    assert lookups == 30_000


def test_an_index_that_joins_late_never_claims_a_block_the_engine_lacks() -> None:
    core, rng, systems = _engine(2)
    core.record_kv_events()
    idx = PrefixIndex(16, 10_000)
    prompts: list[list[int]] = []
    for step in range(600):
        if p := _step(core, rng, systems, step):
            prompts.append(p)
        events = core.take_kv_events()
        if step >= 300:  # the first 300 steps' events were missed
            idx.apply(decode_batch(encode_batch(float(step), from_scheduler(events, 16))))
        assert core.pool is not None
        for p in prompts[-5:]:
            keys = chain_keys(p, 16)
            assert idx.hit_blocks(keys) <= len(core.pool.lookup(keys, len(keys)))
    assert idx.broken > 0


def test_a_prompts_chain_maps_to_the_engines_block_names_up_to_the_first_miss() -> None:
    from bearsdk.kvevents.index import hash_key

    tokens = list(range(64))
    keys = chain_keys(tokens, 16)
    h = [bytes([i]) * 32 for i in range(1, 5)]
    idx = PrefixIndex(16, 100)
    idx.apply(
        decode_batch(
            encode_batch(0.0, [BlockStored(h[:3], None, tokens[:48], 16, None, "GPU", None)])
        )
    )
    got = idx.engine_keys(keys)
    # vLLM's hashes by their first 8 bytes, as the bearsdk publisher names blocks.
    assert got == [int.from_bytes(x[:8], "big") & ((1 << 63) - 1) for x in h[:3]]
    assert got == [hash_key(x) for x in h[:3]]
    assert hash_key(12345) == 12345
    idx.apply(decode_batch(encode_batch(1.0, [BlockRemoved([h[1]], "GPU")])))
    assert idx.engine_keys(keys) == [hash_key(h[0])]

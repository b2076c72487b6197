"""A prefix-caching engine's snapshot, replayed, predicts the engine's own future.

The live scheduler (exact against vLLM 0.33 with prefix caching: test_apc_oracle_cases.py)
exports its block pool as ``kv.prefix_cache``; both decoders must accept it alike, and the
replay of it must form the engine's next batches, up to the new request's first token, exactly
(hits that grow or shrink before admission, evictions, preemptions included).
"""

from __future__ import annotations

import random
from collections import deque

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bearsdk
from bearsdk.errors import SnapshotError
from bearsdk.replay import ScheduledBatch, SchedulerCore, implementations
from bearsdk.replay._replay_py import Replayer as PyReplayer
from bearsdk.replay.blocks import chain_keys
from bearsdk.snapshot import decoders, snapshot_from_dict

BS = 16
POLICIES = {
    "sync-scarce": {"num_gpu_blocks": 60, "async_scheduling": False},
    "async-scarce": {"num_gpu_blocks": 70, "async_scheduling": True},
    "sync-lpt-wm": {
        "num_gpu_blocks": 120,
        "async_scheduling": False,
        "long_prefill_token_threshold": 48,
        "watermark": 0.05,
    },
    "async-roomy": {"num_gpu_blocks": 400, "async_scheduling": True},
}
# Fuller engines (24 sequences, many decodes a batch): the compiled loop folds
# them into its aggregate, and budgets, seats and blocks run out among them.
WIDE_POLICIES = {
    "wide-async": {
        "num_gpu_blocks": 260,
        "async_scheduling": True,
        "max_num_seqs": 24,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    },
    "wide-sync": {
        "num_gpu_blocks": 200,
        "async_scheduling": False,
        "max_num_seqs": 24,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    },
    "wide-async-lpt-bs8": {
        "num_gpu_blocks": 300,
        "async_scheduling": True,
        "long_prefill_token_threshold": 40,
        "block_size": 8,
        "max_num_seqs": 24,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    },
    "wide-sync-bs128": {
        "num_gpu_blocks": 48,
        "async_scheduling": False,
        "block_size": 128,
        "max_num_seqs": 24,
        "max_num_batched_tokens": 256,
        "max_model_len": 1024,
    },
}


def policy(name: str) -> bearsdk.BoundScheduler:
    return bearsdk.bind_scheduler(
        "vllm-v1",
        {
            "block_size": BS,
            "max_num_batched_tokens": 128,
            "max_num_seqs": 6,
            "max_model_len": 2048,
            "enable_prefix_caching": True,
            **(POLICIES[name] if name in POLICIES else WIDE_POLICIES[name]),
        },
    )


class Engine:
    """A SchedulerCore driven as vLLM's EngineCore loop drives its scheduler."""

    def __init__(self, core: SchedulerCore, depth: int) -> None:
        self.core = core
        self.depth = depth
        self.queue: deque[ScheduledBatch] = deque()
        self.step = 0
        self.first_token: dict[str, int] = {}
        self.batches: list[dict[str, int]] = []

    def tick(self) -> None:
        b = self.core.schedule()
        if b:
            self.step += 1
            self.batches.append(b.tokens)
            for rid in b.sampling:
                self.first_token.setdefault(rid, self.step)
        self.queue.append(b)
        if len(self.queue) < self.depth:
            return
        self.core.process(self.queue.popleft())


PREFIXES = [[1000 + 97 * p + i for i in range(400)] for p in range(3)]


def tokens(rng: random.Random, prefix: int, shared: int, total: int) -> list[int]:
    head = PREFIXES[prefix][: min(shared, total)]
    return head + [rng.randrange(5000, 100_000) for _ in range(total - len(head))]


def run_engine(
    name: str, arrivals: list[tuple[int, int, int, int, int]], at: int, seed: int
) -> tuple[bearsdk.BoundScheduler, random.Random, Engine]:
    """A live engine run for ``at`` steps, requests arriving as ``arrivals`` say.

    Each arrival is ``(step, which shared prefix, how much of it, prompt
    length, output length)``; token ids are seeded by ``seed``.
    """
    rng = random.Random(seed)
    pol = policy(name)
    eng = Engine(SchedulerCore(pol), 2 if pol.async_scheduling else 1)
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    for step in range(at):
        while i < len(pending) and pending[i][0] <= step:
            _, pfx, shared, plen, out = pending[i]
            ids = tokens(rng, pfx, shared, plen) + [
                rng.randrange(5000, 100_000) for _ in range(out)
            ]
            eng.core.add_request(f"r{i}", plen, out, out, token_ids=ids)
            i += 1
        if eng.core.has_work() or eng.queue:
            eng.tick()
    return pol, rng, eng


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 8),  # arrival step
            st.integers(0, 2),  # which shared prefix
            st.integers(0, 400),  # how much of it
            st.integers(1, 300),  # prompt length
            st.integers(1, 40),  # output length
        ),
        max_size=14,
    ),
    at=st.integers(0, 40),
    new=st.tuples(st.integers(0, 2), st.integers(0, 400), st.integers(1, 400)),
    seed=st.integers(0, 2**16),
)
def test_replay_of_a_prefix_cache_snapshot_predicts_the_engine(
    name: str,
    arrivals: list[tuple[int, int, int, int, int]],
    at: int,
    new: tuple[int, int, int],
    seed: int,
) -> None:
    pol, rng, eng = run_engine(name, arrivals, at, seed)
    doc = eng.core.snapshot(seq=eng.step, output_len=True)
    snap = snapshot_from_dict(doc)
    raw = orjson.dumps(doc)
    for decode in decoders().values():
        assert decode(raw).to_dict() == snap.to_dict()
    assert snap.prefix_cache is not None
    assert snapshot_from_dict(snap.to_dict()).to_dict() == snap.to_dict()

    pfx, shared, plen = new
    prompt = tokens(rng, pfx, shared, plen)
    step0 = eng.step
    eng.core.add_request("new", plen, 3, 3, token_ids=[*prompt, 7, 7, 7])
    for _ in range(5000):
        if "new" in eng.first_token:
            break
        eng.tick()
    assert "new" in eng.first_token
    want = eng.batches[step0 : eng.first_token["new"]]

    assert snap.kv is not None
    coeffs = (3e-3, 2e-5, 4e-8, 1e-9)
    results = []
    for impl, make in implementations().items():
        rp = make(pol)
        prepared = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        keys = chain_keys(prompt, BS)
        res = rp.replay(prepared, plen, 3, coeffs, record=True, max_tokens=3, prefix_keys=keys)
        assert res.batches is not None
        got = [dict(b.tokens_by_request or ()) for b in res.batches]
        assert [{k.replace("<new>", "new"): v for k, v in b.items()} for b in got] == want, impl
        assert res.first_token_batch == eng.first_token["new"] - step0
        # A prepared state is a template: replaying it again gives the same answer.
        again = rp.replay(prepared, plen, 3, coeffs, record=True, max_tokens=3, prefix_keys=keys)
        assert again == res
        assert rp.ttft(prepared, plen, 3, coeffs, 3, prefix_keys=keys) == res.ttft_s
        results.append(res)
    # Both twins sum the same eq. 12 terms in the same order: the same float.
    assert len({r.ttft_s for r in results}) == 1


def _apc_doc() -> dict[str, object]:
    """Two running requests sharing two cached blocks, one free cached block."""
    return {
        "schema": "bear.snapshot/1",
        "instance": "e",
        "seq": 1,
        "time": 0.0,
        "kv": {
            "block_size": 16,
            "num_blocks": 10,
            "free_blocks": 5,
            "prefix_cache": {"keys": [11, 12, 13, 99], "cached": 3, "free": [-4, 2]},
        },
        "requests": [
            {
                "id": "a",
                "state": "running",
                "prompt_tokens": 40,
                "computed_tokens": 40,
                "output_tokens": 0,
                "blocks": [[0, 2]],
                "uncached_blocks": 1,
            },
            {
                "id": "b",
                "state": "running",
                "prompt_tokens": 40,
                "computed_tokens": 20,
                "output_tokens": 0,
                "blocks": [[0, 1]],
                "uncached_blocks": 1,
                "chain": [[1, 1]],
            },
            {
                "id": "c",
                "state": "waiting",
                "prompt_tokens": 64,
                "computed_tokens": 0,
                "output_tokens": 0,
                "chain": [[0, 2], [3, 1]],
            },
        ],
    }


def test_a_shared_block_state_is_accepted_by_both_decoders() -> None:
    raw = orjson.dumps(_apc_doc())
    for decode in decoders().values():
        s = decode(raw)
        assert s.prefix_cache is not None
        assert s.prefix_cache.blocks == ((0, 1), (0,), ())
        assert s.prefix_cache.chains == ((), (1,), (0, 1, 3))
        assert s.prefix_cache.events_seq is None
    doc = _apc_doc()
    doc["kv"]["prefix_cache"]["events_seq"] = 41  # type: ignore[index]
    for decode in decoders().values():
        s = decode(orjson.dumps(doc))
        assert s.prefix_cache is not None
        assert s.prefix_cache.events_seq == 41
        assert s.to_dict()["kv"]["prefix_cache"]["events_seq"] == 41


BAD = [
    (("kv", "prefix_cache", "free"), [-5], "must hold kv.free_blocks 5 blocks (got 5)"),
    (("kv", "prefix_cache", "free"), [-4, 1], "which is in the free queue"),
    (("kv", "prefix_cache", "free"), [-4, 2, 2], "names cached block 2 twice"),
    (("kv", "prefix_cache", "cached"), 4, "neither free nor held"),
    (("kv", "prefix_cache", "keys"), [11, 12, -1, 99], "keys[2]: must be an integer"),
    (("requests", 0, "uncached_blocks"), 0, "must make the 3 blocks its 40 computed tokens hold"),
    (("requests", 0, "blocks"), [[0, 1], [0, 1]], "names a block twice"),
    (("requests", 0, "blocks"), [[1, 5]], "blocks[0][1]: must be an integer in [1, 2]"),
    (("requests", 2, "blocks"), [[0, 1]], "must be empty for a waiting request"),
    (("requests", 2, "chain"), [[0, 4], [0, 1]], "names a block twice"),
    (("requests", 1, "chain"), [[1, 3]], "more than its 40 tokens fill"),
    (("kv", "num_blocks"), 7, "kv.num_blocks: is smaller than the 9 blocks held and free"),
    (("kv", "prefix_cache", "events_seq"), -1, "events_seq: must be an integer in [0, "),
    (("kv", "prefix_cache", "events_seq"), "7", "events_seq: must be an integer in [0, "),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD)
def test_an_impossible_block_state_is_rejected_naming_the_field(
    path: tuple[object, ...], value: object, message: str
) -> None:
    doc = _apc_doc()
    node: object = doc
    for k in path[:-1]:
        node = node[k]  # type: ignore[index]
    node[path[-1]] = value  # type: ignore[index]
    if path == ("kv", "prefix_cache", "free") and value == [-5]:
        # Five blocks, all uncached: cached block 2 is then neither free nor held.
        message = "neither free nor held"
    raw = orjson.dumps(doc)
    for decode in decoders().values():
        with pytest.raises(SnapshotError, match=message.replace("[", r"\[").replace("]", r"\]")):
            decode(raw)


def test_block_fields_without_the_extension_are_rejected() -> None:
    doc = _apc_doc()
    del doc["kv"]["prefix_cache"]  # type: ignore[index]
    with pytest.raises(SnapshotError, match=r"requests\[0\].blocks: needs kv.prefix_cache"):
        snapshot_from_dict(doc)


def test_the_bea_estimator_replays_a_prefix_cache_snapshot_block_by_block() -> None:
    from bearsdk.estimators.batch_time import BatchTimeModel
    from bearsdk.estimators.bea import BEAEstimator

    pol = policy("sync-lpt-wm")
    eng = Engine(SchedulerCore(pol), 1)
    shared = PREFIXES[1][:320]
    eng.core.add_request("a", 330, 20, 20, token_ids=[*shared, *range(9000, 9030)])
    for _ in range(8):
        eng.tick()  # a's prompt is computed and cached; it decodes
    snap = snapshot_from_dict(eng.core.snapshot(output_len=True))
    assert snap.prefix_cache is not None
    est = BEAEstimator(pol, BatchTimeModel(0.004, 2e-5, 4e-8, 1e-9))
    prompt = [*shared, *range(20_000, 20_040)]
    keys = chain_keys(prompt, BS)
    hit = est.estimate(snap, len(prompt), 3, max_tokens=3, prefix_keys=keys)
    cold = est.estimate(snap, len(prompt), 3, max_tokens=3)
    # 320 shared tokens hit: 40 to compute instead of 360 (three 48-token chunks fewer).
    assert hit.first_token_batch < cold.first_token_batch
    assert hit.ttft_s < cold.ttft_s
    prep = est.prepare(snap)
    assert est.ttft(prep, len(prompt), 3, 3, prefix_keys=keys) == pytest.approx(hit.ttft_s)
    # What the engine itself does with that request.
    eng.core.add_request("new", len(prompt), 3, 3, token_ids=[*prompt, 1, 2, 3])
    step0 = eng.step
    while "new" not in eng.first_token:
        eng.tick()
    assert hit.first_token_batch == eng.first_token["new"] - step0


def test_the_bench_scenarios_hold_shared_and_cached_blocks() -> None:
    from bearsdk.bench.replay_apc import build_apc_scenarios

    a1, a2 = build_apc_scenarios()
    for sc in (a1, a2):
        pc = sc.snapshot.prefix_cache
        assert pc is not None
        assert pc.cached > 1000
    assert a2.snapshot.prefix_cache is not None
    blocks = a2.snapshot.prefix_cache.blocks
    assert sum(map(len, blocks)) > len({b for bs in blocks for b in bs}) + 1000  # shared


def test_a_huge_empty_pool_costs_nothing_to_prepare_and_replay() -> None:
    # 16M free blocks, none named: a run, not 16M entries (a hostile or simply
    # large engine must not stall the router).
    doc = {
        "schema": "bear.snapshot/1",
        "instance": "big",
        "seq": 1,
        "time": 0.0,
        "kv": {
            "block_size": 16,
            "num_blocks": 2**24,
            "free_blocks": 2**24 - 1,
            "prefix_cache": {"keys": [], "cached": 0, "free": [-(2**24 - 1)]},
        },
        "requests": [],
    }
    snap = snapshot_from_dict(doc)
    pol = bearsdk.bind_scheduler(
        "vllm-v1", {"enable_prefix_caching": True, "num_gpu_blocks": 2**24}
    )
    rp = PyReplayer(pol)
    assert snap.kv is not None
    prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
    assert prep.pool is not None
    assert prep.pool.num_free == 2**24 - 1
    assert len(prep.pool.free_queue()) == 1
    for make in implementations().values():
        rp = make(pol)
        prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        res = rp.replay(prep, 5000, 10, prefix_keys=[1, 2, 3])
        assert res.first_token_batch == 3  # 2048-token chunks

"""The plugin's prefix-cache export without vLLM: a stand-in block pool, random operations.

The stand-in has the attributes and methods of vLLM 0.33's ``BlockPool`` and
``FreeKVCacheBlockQueue`` that :class:`~bearsdk.vllm._prefix.PoolTracker`
wraps or reads, with their documented behaviour (``docs/prefix-caching.md``):
a doubly linked free queue, a hash map with duplicates in insertion order,
allocation that evicts, touch, free with the front/back split. The real pool
is exercised by ``test_apc_publish.py`` (marker ``vllm``).
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from bearsdk.snapshot import decode_snapshot
from bearsdk.vllm import _pub_py
from bearsdk.vllm._prefix import PoolTracker, PrefixExport
from bearsdk.vllm._prefix_frame import _json_ints_py, json_ints, key_of_grouped

# vLLM keys its pool map and blocks by the hash with the KV cache group id
# appended (4 bytes, big-endian: make_block_hash_with_group_id); group 0 here.
GROUP0 = (0).to_bytes(4, "big")


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: bytes | None = None
        self.ref_cnt = 0
        self.prev_free_block: Block | None = None
        self.next_free_block: Block | None = None


class Queue:
    def __init__(self, blocks: list[Block]) -> None:
        self.fake_free_list_head = Block(-1)
        self.fake_free_list_tail = Block(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def _unlink(self, b: Block) -> None:
        assert b.prev_free_block is not None
        assert b.next_free_block is not None
        b.prev_free_block.next_free_block = b.next_free_block
        b.next_free_block.prev_free_block = b.prev_free_block
        b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= 1

    # As in vLLM, the methods do not call each other (the tracker wraps each).
    def popleft(self) -> Block:
        return self._pop()

    def _pop(self) -> Block:
        b = self.fake_free_list_head.next_free_block
        assert b is not None
        assert b is not self.fake_free_list_tail
        self._unlink(b)
        return b

    def popleft_n(self, n: int) -> list[Block]:
        return [self._pop() for _ in range(n)]

    def remove(self, b: Block) -> None:
        self._unlink(b)

    def append(self, b: Block) -> None:
        self._append(b)

    def _append(self, b: Block) -> None:
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None
        last.next_free_block = b
        b.prev_free_block = last
        b.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = b
        self.num_free_blocks += 1

    def append_n(self, blocks: list[Block]) -> None:
        for b in blocks:
            self._append(b)

    def prepend_n(self, blocks: list[Block]) -> None:
        first = self.fake_free_list_head.next_free_block
        prev = self.fake_free_list_head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = first
        assert first is not None
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)


class HashMap:
    def __init__(self) -> None:
        self._cache: dict[bytes, Block | dict[int, Block]] = {}


class Pool:
    """vLLM's BlockPool, as far as the tracker sees it."""

    def __init__(self, n: int) -> None:
        self.num_gpu_blocks = n
        self.blocks = [Block(i) for i in range(n)]
        self.free_block_queue = Queue(self.blocks)
        self.cached_block_hash_to_block = HashMap()
        self.free_block_queue.popleft()  # the null block

    def _insert_block_hash(self, key: bytes, block: Block, num_tokens: Any) -> None:
        if block.block_hash == key:
            return
        block.block_hash = key
        m = self.cached_block_hash_to_block._cache
        have = m.get(key)
        if have is None:
            m[key] = block
        elif isinstance(have, Block):
            m[key] = {have.block_id: have, block.block_id: block}
        else:
            have[block.block_id] = block

    def _remove_cached_block_hashes(self, block: Block) -> list[bytes]:
        key = block.block_hash
        if key is None:
            return []
        m = self.cached_block_hash_to_block._cache
        have = m.pop(key)
        if isinstance(have, dict):
            del have[block.block_id]
            if have:
                m[key] = have
        block.block_hash = None
        return [key]

    def reset_prefix_cache(self) -> bool:
        return False

    def get_new_blocks(self, n: int) -> list[Block]:
        out = self.free_block_queue.popleft_n(n)
        for b in out:
            self._remove_cached_block_hashes(b)
            b.ref_cnt += 1
        return out

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[Block]) -> None:
        first, last = [], []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)


class Manager:
    def __init__(self) -> None:
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}


class Req:
    """The attributes of vLLM's Request that the capture and the tracker read."""

    def __init__(self, rid: str, tokens: list[int], bs: int) -> None:
        self.request_id = rid
        self.tokens = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self._output_token_ids: list[int] = []
        self.num_output_tokens = 0
        self.max_tokens = 4
        self.num_output_placeholders = 0
        self.is_prefill_chunk = False
        self.resumable = False
        # Chained like vLLM's: a block's hash stands for every token before it.
        self.block_hashes = [
            repr(tokens[: (i + 1) * bs]).encode().ljust(8, b"x")[-8:] + b"%08d" % i
            for i in range(len(tokens) // bs)
        ]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


BS = 4


def _hash(tokens: list[int], i: int) -> bytes:
    # Distinct per prefix (the stand-in's content keys).
    return (b"%016x" % (hash(tuple(tokens[: (i + 1) * BS])) & ((1 << 64) - 1)))[:8] + b"g"


class Engine:
    """Admit, grow and finish requests over a stand-in pool, as vLLM's manager does."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = Pool(n)
        self.mgr = Manager()
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.prefixes = [[self.rng.randrange(100) for _ in range(24)] for _ in range(3)]
        self.n = 0

    def new_request(self) -> None:
        p = self.rng.choice(self.prefixes)[: self.rng.randint(0, 24)]
        tokens = p + [self.rng.randrange(100) for _ in range(self.rng.randint(1, 20))]
        r = Req(f"r{self.n}", tokens, BS)
        r.block_hashes = [_hash(tokens, i) for i in range(len(tokens) // BS)]
        self.n += 1
        self.waiting.append(r)

    def admit(self) -> bool:
        if not self.waiting:
            return False
        r = self.waiting[0]
        m = self.pool.cached_block_hash_to_block._cache
        hit: list[Block] = []
        for h in r.block_hashes[: (r.num_tokens - 1) // BS]:
            b = m.get(h + GROUP0)
            if b is None:
                break
            hit.append(b if isinstance(b, Block) else next(iter(b.values())))
        if self.rng.random() < 0.3:
            hit = []  # as if admitted before the others cached it: duplicates (dup-hash)
        need = -(-r.num_tokens // BS) - len(hit)
        free = self.pool.free_block_queue.num_free_blocks
        if need + sum(1 for b in hit if b.ref_cnt == 0) > free:
            return False
        self.waiting.pop(0)
        self.pool.touch(hit)
        blocks = hit + self.pool.get_new_blocks(need)
        self.mgr.req_to_blocks[r.request_id] = blocks
        # Cache what is full; sometimes a duplicate of a cached block.
        full = r.num_tokens // BS
        if self.rng.random() < 0.3:
            full = self.rng.randint(len(hit), full)  # a chunk: later blocks not cached yet
        for i in range(len(hit), full):
            self.pool._insert_block_hash(r.block_hashes[i] + GROUP0, blocks[i], None)
        self.mgr.num_cached_block[r.request_id] = max(full, len(hit))
        r.num_computed_tokens = r.num_tokens
        self.running.append(r)
        return True

    def finish(self) -> None:
        r = self.running.pop(self.rng.randrange(len(self.running)))
        blocks = self.mgr.req_to_blocks.pop(r.request_id)
        self.mgr.num_cached_block.pop(r.request_id)
        self.pool.free_blocks(list(reversed(blocks)))

    def step(self) -> None:
        x = self.rng.random()
        if x < 0.4:
            self.new_request()
        elif x < 0.8 or not self.running:
            self.admit()
        else:
            self.finish()

    def residents(self) -> list[tuple[Req, bool]]:
        return [(r, True) for r in self.running] + [(r, False) for r in self.waiting]


def _document(engine: Engine, seq: int, cap: Any) -> bytes:
    cap.capture(
        engine.running, (engine.waiting,), seq, 1.0, engine.pool.free_block_queue.num_free_blocks
    )
    cap.encode()
    return bytes(cap.payload())


@pytest.mark.parametrize("seed", range(6))
def test_tracker_follows_the_pool_and_documents_validate(seed: int) -> None:
    e = Engine(40, seed)
    tracker = PoolTracker(e.pool, e.mgr, BS)
    cap = _pub_py.Capture("x", "e", BS, 40)
    export = PrefixExport(tracker, _pub_py.json_head("x", "e"))
    dups = evictions = 0
    for seq in range(1, 400):
        before = len(e.pool.cached_block_hash_to_block._cache)
        e.step()
        evictions += len(e.pool.cached_block_hash_to_block._cache) < before
        fresh = PoolTracker(e.pool, e.mgr, BS, install=False)
        assert tracker.free_ids() == fresh.free_ids()
        assert tracker.cached_entries() == sorted(
            tracker.cached_entries(), key=lambda bk: tracker.slot_of[bk[0]]
        )
        want: dict[int, list[int]] = {}
        for b, k in fresh.cached_entries():
            want.setdefault(k, []).append(b)
        got: dict[int, list[int]] = {}
        for b, k in tracker.cached_entries():
            got.setdefault(k, []).append(b)
        assert got == want  # the same blocks, duplicates first cached first
        dups += any(len(v) > 1 for v in got.values())
        doc = _document(e, seq, cap)
        export.capture(seq, e.running, (e.waiting,))
        out = export.splice(doc)
        assert out is not None
        assert export.failures == 0, export.last_error
        snap = decode_snapshot(out)
        assert snap.prefix_cache is not None
        d = json.loads(out)
        pc = d["kv"]["prefix_cache"]
        assert pc["cached"] == sum(len(v) for v in want.values())
        held = {
            key_of_grouped(b.block_hash)
            for r in e.running
            for b in e.mgr.req_to_blocks[r.request_id]
            if b.block_hash is not None
        }
        named = {
            pc["keys"][j]
            for r in d["requests"]
            for s, c in r.get("blocks", [])
            for j in range(s, s + c)
        }
        assert named == held
    assert evictions > 0
    assert dups > 0


def test_splice_keeps_a_document_without_its_capture() -> None:
    e = Engine(10, 0)
    export = PrefixExport(PoolTracker(e.pool, e.mgr, BS), _pub_py.json_head("x", "e"))
    cap = _pub_py.Capture("x", "e", BS, 10)
    doc = _document(e, 5, cap)
    assert export.splice(doc, wait_s=0.01) == doc
    assert export.failures == 1
    export.capture(7, (), ())
    assert export.splice(doc, wait_s=0.01) is None  # superseded by a newer capture
    assert export.superseded == 1


def test_a_pool_beyond_the_extensions_bound_publishes_plain_snapshots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Validation would reject the document with the extension: it goes out
    # without it, as with the cache off, and the export says why. (Such a pool
    # is not a physical one: 2^19 blocks are 8M tokens of KV in 16-token blocks.)
    from bearsdk.vllm import _prefix

    e = Engine(40, 1)
    tracker = PoolTracker(e.pool, e.mgr, BS)
    export = PrefixExport(tracker, _pub_py.json_head("x", "e"))
    cap = _pub_py.Capture("x", "e", BS, 40)
    for _ in range(200):
        e.step()
    cached = tracker.top - len(tracker.holes)
    assert cached > 3
    monkeypatch.setattr(_prefix, "MAX_CACHE_ENTRIES", cached - 1)
    doc = _document(e, 9, cap)
    export.capture(9, e.running, (e.waiting,))
    out = export.splice(doc)
    assert out == doc
    assert "prefix_cache" not in json.loads(out)["kv"]
    assert "more than kv.prefix_cache carries" in str(export.last_error)
    monkeypatch.setattr(_prefix, "MAX_CACHE_ENTRIES", cached)
    doc = _document(e, 10, cap)
    export.capture(10, e.running, (e.waiting,))
    out = export.splice(doc)
    assert out is not None
    assert decode_snapshot(out).prefix_cache is not None


def test_json_ints_twins_agree() -> None:
    import numpy as np

    a = np.array([0, -1, 7, (1 << 63) - 1, -(1 << 63), 1234567890123], dtype=np.int64)
    assert json_ints(a) == _json_ints_py(a) == b",".join(b"%d" % v for v in a.tolist())
    assert json_ints(np.zeros(0, dtype=np.int64)) == b""


def test_keys_text_reprints_only_what_changed_and_equals_a_full_print() -> None:
    import numpy as np

    from bearsdk.vllm._prefix_frame import KeysText

    rng = np.random.default_rng(3)
    kt = KeysText()
    kt.CHUNK = 8  # type: ignore[misc]
    keys = rng.integers(0, 1 << 62, 50, dtype=np.int64)
    occ = rng.random(50) < 0.7
    for _ in range(200):
        n = int(rng.integers(1, 80))
        keys = np.resize(keys, n).copy()
        occ = np.resize(occ, n).copy()
        for i in rng.integers(0, n, 3).tolist():
            keys[i] = rng.integers(0, 1 << 62)
            occ[i] = rng.random() < 0.7
        assert kt.text(keys, occ) == json_ints(np.ascontiguousarray(keys[occ]))

"""Automatic prefix caching in the live scheduler: the rules of docs/prefix-caching.md."""

from __future__ import annotations

import pytest

from bearsdk.errors import SpecError
from bearsdk.replay.blocks import BlockPool, chain_keys
from bearsdk.replay.scheduler import SchedulerCore
from bearsdk.schedulers import bind_scheduler, spec_from_dict

BS = 16


def core(num_blocks: int = 64, **params: object) -> SchedulerCore:
    policy = bind_scheduler(
        "vllm-v1",
        {
            "block_size": BS,
            "num_gpu_blocks": num_blocks,
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "async_scheduling": False,
            "enable_prefix_caching": True,
            **params,
        },
    )
    return SchedulerCore(policy)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def run_to_finish(c: SchedulerCore) -> None:
    while c.has_work():
        c.process(c.schedule())


def admitted_hit(c: SchedulerCore, rid: str) -> int:
    """Schedule one batch; return the prefix hit ``rid`` was admitted with."""
    b = c.schedule()
    (r,) = [r for r in b.sched if r.rid == rid]
    hit = r.computed - b.sched[r]
    c.process(b)
    return hit


def test_chain_keys_depend_on_the_whole_prefix() -> None:
    a = chain_keys(ids(64), BS)
    b = chain_keys([*ids(16, 500), *ids(48, 116)], BS)
    assert len(a) == 4
    assert all(k >= 0 for k in a)
    # Same tokens in blocks 1..3, a different first block: no key in common.
    assert not set(a) & set(b)
    assert chain_keys(ids(70), BS)[:4] == a  # a partial block has no key
    assert chain_keys(ids(64), BS, start=a[:2]) == a


def test_a_shared_prefix_is_not_computed_again() -> None:
    c = core()
    c.add_request("a", 70, 1, token_ids=ids(70))
    run_to_finish(c)
    c.add_request("b", 70, 4, token_ids=[*ids(64), *ids(6, 900)])
    # Four full blocks match; the partial fifth never does.
    assert admitted_hit(c, "b") == 64
    assert c.pool is not None
    assert (c.pool.queries, c.pool.hits) == (140, 64)


def test_a_fully_cached_block_aligned_prompt_recomputes_its_last_block() -> None:
    c = core()
    c.add_request("a", 64, 1, token_ids=ids(64))
    run_to_finish(c)
    c.add_request("b", 64, 1, token_ids=ids(64))
    # The last prompt token is never a hit, and hits are whole blocks.
    assert admitted_hit(c, "b") == 48


def test_a_request_admitted_later_in_the_same_step_hits_blocks_just_allocated() -> None:
    c = core()
    c.add_request("a", 100, 2, token_ids=ids(100))
    c.add_request("b", 100, 2, token_ids=ids(100))
    b = c.schedule()
    by_id = {r.rid: (r.computed, n) for r, n in b.sched.items()}
    # a's 100 tokens are allocated (and its 6 full blocks cached) before b is
    # looked up, though none of them is computed yet.
    assert by_id == {"a": (100, 100), "b": (100, 4)}


def test_hit_blocks_in_the_free_queue_count_against_admission() -> None:
    c = core(num_blocks=9)  # 8 usable blocks (one is the null block)
    c.add_request("a", 97, 1, token_ids=ids(97))  # 7 blocks, 6 of them full
    run_to_finish(c)
    assert c.free == 8  # all free again, 6 of them cached
    c.add_request("b", 112, 1, token_ids=[*ids(96), *ids(16, 900)])
    b = c.schedule()
    (r,) = b.sched
    assert r.computed - b.sched[r] == 96
    # 6 hit blocks leave the free queue and 1 new block is taken.
    assert c.free == 8 - 7


def test_freed_blocks_are_evicted_tail_first_and_oldest_first() -> None:
    c = core(num_blocks=9)
    c.add_request("a", 64, 1, token_ids=ids(64))  # 4 blocks, 3 cached when done
    run_to_finish(c)
    assert c.pool is not None
    queue = c.pool.free_queue()
    cached = [k for _, k in queue if k is not None]
    keys = chain_keys(ids(64), BS)
    # The never-used blocks come first, then a's blocks from its tail: the
    # last full block is the first cached block to go.
    assert cached == [keys[3], keys[2], keys[1], keys[0]][: len(cached)]
    # A 7-block request evicts the 4 never-used blocks... and a's last ones.
    c.add_request("z", 112, 1, token_ids=ids(112, 5000))
    c.schedule()
    left = {k for _, k in c.pool.free_queue() if k is not None}
    assert left == {keys[0]}


def test_a_preempted_request_hits_its_own_blocks_when_it_resumes() -> None:
    c = core(num_blocks=1000)
    c.add_request("a", 80, 20, token_ids=[*ids(80), *ids(20, 3000)])
    c.process(c.schedule())
    for _ in range(17):
        c.process(c.schedule())  # 18 outputs: 98 tokens, 6 full blocks
    (r,) = c.running
    c.running.remove(r)
    c.preempt(r)
    assert admitted_hit(c, "a") == 96
    assert c.pool is not None
    assert (c.pool.preempted_queries, c.pool.preempted_hits) == (98, 96)


def test_without_prefix_caching_nothing_is_shared() -> None:
    c = core(enable_prefix_caching=False)
    assert c.pool is None
    c.add_request("a", 70, 1, token_ids=ids(70))
    run_to_finish(c)
    c.add_request("b", 70, 1, token_ids=ids(70))
    assert admitted_hit(c, "b") == 0


def test_the_pool_refuses_an_allocation_larger_than_its_free_queue() -> None:
    pool = BlockPool(4, reserved=1)
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="cannot allocate 4 blocks: 3 free"):
        pool.allocate(4)


def test_prefix_caching_needs_on_demand_allocation() -> None:
    with pytest.raises(
        SpecError, match=r"'apc-prompt': kv.prefix_caching must be false unless kv.allocate"
    ):
        spec_from_dict(
            {
                "schema": "bear.scheduler/1",
                "name": "apc-prompt",
                "budget": {"tokens": 512, "seqs": 8},
                "batch": {"stages": ["waiting", "running"]},
                "kv": {"block_size": 16, "allocate": "prompt", "prefix_caching": True},
            }
        )


def test_a_freed_block_with_no_content_to_find_is_reused_first() -> None:
    c = core(num_blocks=12)
    c.add_request("a", 70, 2, token_ids=ids(70))  # 4 full blocks and a partial one
    c.process(c.schedule())
    (r,) = c.running
    partial = r.block_ids[-1]
    run_to_finish(c)
    assert c.pool is not None
    queue = c.pool.free_queue()
    # The partial block goes to the front, the cached ones to the back, tail first.
    assert queue[0] == (partial, None)
    keys = chain_keys(ids(70), BS)
    assert [k for _, k in queue[-4:]] == keys[::-1]

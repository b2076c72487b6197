"""A prefix-caching scheduler's blocks in a snapshot, out (:func:`export`) and in (:func:`restore`).

A live :class:`~bearsdk.replay.scheduler.SchedulerCore` with the cache on
publishes its block pool as the ``kv.prefix_cache`` extension
(:mod:`bearsdk.prefix_cache` documents the wire form); a replay rebuilds an
identical :class:`~bearsdk.replay.blocks.BlockPool` from it, so that shared
blocks, hits at admission and evictions replay as the engine would run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bearsdk.prefix_cache import runs
from bearsdk.replay.blocks import KEY_MASK, BlockPool

if TYPE_CHECKING:
    from bearsdk.prefix_cache import PrefixCacheState

__all__ = ["RestoredBlocks", "export", "restore"]


def export(
    pool: BlockPool, residents: Sequence[tuple[Sequence[int], int, Sequence[int]]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``kv.prefix_cache`` object and each resident's block fields.

    Args:
        pool: The scheduler's pool.
        residents: Per request in snapshot order: the blocks it holds, how many
            of them are cached, and the content keys of its known full blocks.

    Returns:
        ``(kv.prefix_cache, [request fields])``.
    """
    entries = pool.cached_blocks()
    index = {b: j for j, (b, _) in enumerate(entries)}
    # Keys of content only one request has are negative inside a scheduler;
    # the wire takes 63-bit keys, where they land as distinct values.
    keys = [k & KEY_MASK for _, k in entries]
    by_value: dict[int, int] = {}
    for i, k in enumerate(keys):
        by_value.setdefault(k, i)
    free: list[int] = []
    for e, content in pool.free_queue():
        if content is not None:
            free.append(index[e])
        else:
            n = 1 if e >= 0 else -e
            if free and free[-1] < 0:
                free[-1] -= n
            else:
                free.append(-n)
    fields = []
    for held, cached, known in residents:
        mine = [index[b] for b in held[:cached]]
        chain: list[int] = []
        for key in known[cached:]:
            wire = key & KEY_MASK
            at = by_value.get(wire)
            if at is None:
                if key < 0:
                    # Content nobody else has and no block holds: nothing can
                    # ever find it, so the chain need not go on.
                    break
                at = by_value[wire] = len(keys)
                keys.append(wire)
            chain.append(at)
        d: dict[str, Any] = {}
        if mine:
            d["blocks"] = runs(mine)
        if len(held) > cached:
            d["uncached_blocks"] = len(held) - cached
        if chain:
            d["chain"] = runs(chain)
        fields.append(d)
    return {"keys": keys, "cached": len(entries), "free": free}, fields


class RestoredBlocks:
    """A snapshot's pool rebuilt, with each request's blocks and keys.

    Attributes:
        pool: The rebuilt pool (a template: replays run on copies).
        block_ids: Per request: the blocks it holds, first to last.
        cached: Per request: how many of them are cached.
        keys: Per request: content keys of its known full blocks.
    """

    __slots__ = ("block_ids", "cached", "keys", "pool")

    def __init__(
        self,
        pool: BlockPool,
        block_ids: list[list[int]],
        cached: list[int],
        keys: list[list[int]],
    ) -> None:
        self.pool = pool
        self.block_ids = block_ids
        self.cached = cached
        self.keys = keys


def restore(state: PrefixCacheState) -> RestoredBlocks:
    """Rebuild the pool of a validated ``kv.prefix_cache``.

    Cached block ``j`` becomes block id ``j``; held blocks with no findable
    content get the ids after them; free ones stay unnamed runs.
    """
    n = state.cached
    block_keys: list[int | None] = list(state.keys[:n])
    refs = [0] * n
    # Runs of blocks with nothing findable stay runs: a pool of millions of
    # free blocks costs nothing until they are handed out.
    free = list(state.free)
    block_ids: list[list[int]] = []
    keys: list[list[int]] = []
    for mine, un, chain in zip(state.blocks, state.uncached, state.chains, strict=True):
        for b in mine:
            refs[b] += 1
        own = list(range(len(block_keys), len(block_keys) + un))
        block_keys.extend([None] * un)
        refs.extend([1] * un)
        block_ids.append([*mine, *own])
        keys.append([state.keys[j] for j in (*mine, *chain)])
    pool = BlockPool.restore(block_keys, refs, free)
    return RestoredBlocks(pool, block_ids, [len(m) for m in state.blocks], keys)

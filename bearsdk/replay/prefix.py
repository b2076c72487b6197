"""A prefix-caching scheduler's blocks in a snapshot, out (:func:`export`) and in (:func:`restore`).

A live :class:`~bearsdk.replay.scheduler.SchedulerCore` with the cache on
publishes its block pool as the ``kv.prefix_cache`` extension
(:mod:`bearsdk.prefix_cache` documents the wire form); a replay rebuilds an
identical :class:`~bearsdk.replay.blocks.BlockPool` from it, so that shared
blocks, hits at admission and evictions replay as the engine would run them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from bearsdk.prefix_cache import runs
from bearsdk.replay.blocks import KEY_MASK, BlockPool
from bearsdk.replay.wired import WiredPool

if TYPE_CHECKING:
    from bearsdk.prefix_cache import PrefixCacheState

__all__ = ["RestoredBlocks", "export", "export_reference", "restore"]


Resident = tuple[Sequence[int], int, Sequence[int]]
"""A resident request: the blocks it holds, how many of them are cached, the
content keys of its known full blocks."""
Export = tuple[dict[str, Any], list[dict[str, Any]]]


def export(
    pool: BlockPool, residents: Sequence[Resident], tags: Sequence[Hashable] | None = None
) -> Export:
    """The ``kv.prefix_cache`` object and each resident's block fields.

    A :class:`~bearsdk.replay.wired.WiredPool` (a live scheduler's) is
    exported from the wire numbering it keeps: the keys and the free list are
    list copies, and a resident's blocks are remembered from the last export
    (by its tag) and extended, so a snapshot costs the blocks that changed,
    not the pool. Any other pool is exported from scratch
    (:func:`export_reference`). Both give documents that restore to the same
    pool and requests; they can number the cached blocks differently.

    Args:
        pool: The scheduler's pool.
        residents: Per request in snapshot order: the blocks it holds, how many
            of them are cached, and the content keys of its known full blocks.
        tags: Per request: a value that changes whenever it gives up its
            blocks (the request and its preemption count), so that its block
            list can be remembered between exports; ``None``: remember
            nothing. With tags, a block list must be replaced, not changed in
            place (as :class:`~bearsdk.replay.requests.CachedReq` does).

    Returns:
        ``(kv.prefix_cache, [request fields])``.
    """
    if isinstance(pool, WiredPool) and (pool.wire_state.ok or pool.rewire()):
        return _export_wired(pool, residents, tags)
    return export_reference(pool, residents)


class _Held:
    """A resident at the last export: its cached blocks (ids, wire indices,
    runs) and what the cache answered for its chain's keys."""

    __slots__ = ("ats", "ids", "known", "kstart", "runs", "seen", "src", "wire")

    def __init__(self) -> None:
        self.known: Sequence[int] | None = None  # the key list the chain came from
        self.kstart = 0  # where in it the chain started
        self.ats: list[int | None] = []  # the cache's answers for known[kstart:]
        self.src: Sequence[int] | None = None  # the block list they came from
        self.ids: Sequence[int] = ()
        self.wire: list[int] = []
        self.seen: set[int] = set()
        self.runs: list[list[int]] = []

    def update(self, held: Sequence[int], cached: int, wi: list[int], renamed: set[int]) -> None:
        n = len(self.ids)
        # Block lists are replaced, never changed in place: the same list
        # object holds the same blocks.
        if held is not self.src and (n > cached or held[:n] != self.ids):
            # Blocks given up and others taken since: start again.
            self.ids, self.wire, self.seen, self.runs = (), [], set(), []
            n = 0
        elif renamed and not renamed.isdisjoint(self.seen):
            ids = self.ids
            for b in renamed.intersection(self.seen):
                self.wire[ids.index(b)] = wi[b]
            self.runs = _runs(self.wire)
        self.src = held
        if cached > n:
            new = held[n:cached]
            self.ids = held[:cached]
            self.seen.update(new)
            more = list(map(wi.__getitem__, new))
            self.wire += more
            _extend_runs(self.runs, more)

    def answers(
        self, known: Sequence[int], start: int, kw: dict[int, int], changed: set[int]
    ) -> list[int | None]:
        """The cache's answers (wire index or ``None``) for ``known[start:]``.

        The last export's, less the keys cached since, when no key of them
        changed in the cache (key lists are replaced, never changed in place).
        """
        ks = known[start:]
        if known is self.known and start >= self.kstart and changed.isdisjoint(ks):
            ats = self.ats[start - self.kstart :]
        else:
            ats = list(map(kw.get, ks))
        self.known, self.kstart, self.ats = known, start, ats
        return ats


def _export_wired(
    pool: WiredPool, residents: Sequence[Resident], tags: Sequence[Hashable] | None
) -> Export:
    pool.dense()
    w = pool.wire_state
    keys = w.wk.copy()
    n = len(keys)
    uncached = pool.num_free - len(w.fof)
    free = [-uncached] if uncached else []
    for ch in w.chunks:
        free += ch
    wi, kw, renamed = w.wi, w.kw, w.renamed
    before = w.state
    after: dict[object, object] = {}
    extra = _Extras(keys)
    fields = []
    changed = w.kchanged
    for i, (held, cached, known) in enumerate(residents):
        d: dict[str, Any] = {}
        tag = None if tags is None else tags[i]
        h = before.get(tag) if tag is not None else None
        if not isinstance(h, _Held):
            h = _Held()
        if tag is not None:
            after[tag] = h
        if cached:
            h.update(held, cached, wi, renamed)
            # The runs themselves are shared with later exports (never changed).
            d["blocks"] = list(h.runs)
        if len(held) > cached:
            d["uncached_blocks"] = len(held) - cached
        if len(known) > cached:
            ats = h.answers(known, cached, kw, changed)
            chain = (
                extra.chain(known[cached:], list(ats)) if None in ats else _runs(ats)  # type: ignore[arg-type]
            )
            if chain:
                d["chain"] = chain
        fields.append(d)
    renamed.clear()
    changed.clear()
    w.state = after
    return {"keys": keys, "cached": n, "free": free}, fields


class _Extras:
    """The keys past the cached blocks (content no block holds that a chain names).

    Each gets one index, shared by every chain naming it; the set answers the
    usual case (a chain's tail is new content) with a few C-level calls, the
    map is built only for the others.
    """

    __slots__ = ("at", "keys", "known", "where")

    def __init__(self, keys: list[int]) -> None:
        self.keys = keys
        self.at = len(keys)
        self.known: set[int] = set()
        self.where: dict[int, int] | None = None

    def chain(self, ks: Sequence[int], ats: list[int | None]) -> list[list[int]]:
        """The runs of a chain whose keys ``ks`` the cache answered with ``ats``."""
        keys = self.keys
        i0 = ats.index(None)
        tail = ks[i0:]
        m = len(tail)
        if ats.count(None) == m and min(tail) >= 0:
            known = self.known
            before = len(known)
            known.update(tail)
            if len(known) - before == m:
                # The usual tail: new content, all of it past the last hit.
                at = len(keys)
                keys += tail
                if self.where is not None:
                    self.where.update(zip(tail, range(at, at + m), strict=True))
                out = _runs(ats[:i0])  # type: ignore[arg-type]
                if out and out[-1][0] + out[-1][1] == at:
                    out[-1][1] += m
                else:
                    out.append([at, m])
                return out
            known.difference_update(tail)
            known.update(keys[self.at :])
        where = self.where
        if where is None:
            where = self.where = {k: j for j, k in enumerate(keys[self.at :], self.at)}
        chain: list[int] = []
        for key, found in zip(tail, ats[i0:], strict=True):
            if found is None:
                wire = key & KEY_MASK
                found = where.get(wire)
                if found is None:
                    if key < 0:
                        # Content nobody else has and no block holds: nothing
                        # can ever find it, so the chain need not go on.
                        break
                    found = where[wire] = len(keys)
                    keys.append(wire)
                    self.known.add(wire)
            chain.append(found)
        return _runs([*ats[:i0], *chain])  # type: ignore[list-item]


def _extend_runs(out: list[list[int]], ix: Sequence[int]) -> None:
    """Append ``ix`` to the runs ``out`` (runs are replaced, not changed: documents share them)."""
    for i in ix:
        last = out[-1] if out else None
        if last is not None and last[0] + last[1] == i:
            out[-1] = [last[0], last[1] + 1]
        else:
            out.append([i, 1])


def _runs(ix: Sequence[int]) -> list[list[int]]:
    """:func:`bearsdk.prefix_cache.runs` of a list, by slices compared in C."""
    n = len(ix)
    if n < 8 or not isinstance(ix, list):
        return runs(ix)
    out: list[list[int]] = []
    i = 0
    while i < n:
        s = ix[i]
        if ix[n - 1] - s == n - 1 - i and ix[i:] == list(range(s, s + n - i)):
            out.append([s, n - i])  # the rest is one run
            break
        # ix[i:j] is a run: double the step while the next stretch continues
        # it, then halve the step down to the run's end.
        j = i + 1
        step = 1
        while j < n:
            k = min(j + step, n)
            if ix[k - 1] - s != k - 1 - i or ix[j:k] != list(range(s + j - i, s + k - i)):
                break
            j = k
            step *= 2
        while step > 1 and j < n:
            step //= 2
            k = min(j + step, n)
            if ix[k - 1] - s == k - 1 - i and ix[j:k] == list(range(s + j - i, s + k - i)):
                j = k
        out.append([s, j - i])
        i = j
    return out


def export_reference(pool: BlockPool, residents: Sequence[Resident]) -> Export:
    """The export from scratch, O(cached blocks): walks the pool's cache and free queue.

    :func:`export` gives the same document (up to the numbering of the cached
    blocks, which the wire leaves open) and falls back to this one.

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

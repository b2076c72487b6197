"""A live scheduler's block pool that keeps its ``kv.prefix_cache`` wire form up to date.

:class:`WiredPool` extends :class:`~bearsdk.replay.blocks.BlockPool` (its
scheduling is the base class's own): it numbers cached blocks as they are
cached and evicted, so that :func:`bearsdk.replay.prefix.export` copies lists
instead of walking every block (``docs/prefix-caching.md``, "Cost of the
export"). Replays run on plain copies.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Final

from bearsdk.replay.blocks import KEY_MASK, BlockPool

__all__ = ["WiredPool"]

_FORGET: Final = 1 << 16
"""Keys changed since the last export past which it remembers nothing instead."""
_CHUNK: Final = 512
"""Entries per chunk of a wired pool's free list (small enough that removing one
from the middle is a short memmove, large enough that the export joins few)."""


class _Wire:
    """A :class:`WiredPool`'s cached blocks in their wire numbering (``kv.prefix_cache``).

    Attributes:
        wi: Block id -> wire index (``-1``: not cached).
        wb: Wire index -> block id (``-1``: a hole, an evicted block's index
            not yet reused). wk: Wire index -> the key as the wire has it
            (:data:`KEY_MASK`). wr: Wire index -> the pool's key.
        holes: The holes, a heap (the lowest is reused first, so that a
            request's blocks cached in a row get consecutive indices where
            the holes are consecutive).
        kw: Key -> wire index of its first holder.
        chunks: The free queue's cached blocks as wire indices, front first,
            in chunks. fof: Free cached block -> its chunk.
        renamed: Blocks whose wire index changed since the last export (a hole
            closed by a block from the end, equal keys put back in order).
        kchanged: Keys whose entry in ``kw`` changed since the last export.
        ok: ``False`` once a block was cached while free (no scheduler does
            that): the free list's shape is then rebuilt at the next export.
        state: What :func:`bearsdk.replay.prefix.export` keeps per request.
    """

    __slots__ = (
        "chunks",
        "fof",
        "holes",
        "kchanged",
        "kw",
        "ok",
        "renamed",
        "state",
        "wb",
        "wi",
        "wk",
        "wr",
    )

    def __init__(self) -> None:
        self.wi: list[int] = []
        self.wb: list[int] = []
        self.wk: list[int] = []
        self.wr: list[int] = []
        self.holes: list[int] = []
        self.kw: dict[int, int] = {}
        self.chunks: list[list[int]] = [[]]
        self.fof: dict[int, list[int]] = {}
        self.renamed: set[int] = set()
        self.kchanged: set[int] = set()
        self.ok = True
        self.state: dict[object, object] = {}


class WiredPool(BlockPool):
    """A :class:`BlockPool` that keeps its ``kv.prefix_cache`` wire form up to date.

    The export of a plain pool walks every cached block and every free-queue
    entry (O(cached blocks) per snapshot); a wired pool numbers its cached
    blocks as they are cached and evicted, and keeps the free queue's cached
    part as a list of those numbers, so that an export copies lists. The
    numbering is one the wire allows: any order of the cached blocks in which
    equal keys keep their first-cached-first order. Its scheduling is the
    base class's own (every method calls it first); only a live scheduler's
    pool is wired (:meth:`wire`), replays run on plain copies (:meth:`copy`).

    The free list's cached part is the free queue's tail: blocks with no
    findable content join the queue's front and cached ones its back, so a
    pool that starts empty never has an uncached entry behind a cached one
    (the wire merges the uncached ones into one run). A restored pool can;
    :meth:`wire` declines it.
    """

    __slots__ = ()

    @staticmethod
    def wire(pool: BlockPool) -> bool:
        """Make ``pool`` a wired pool in place (O(blocks), once).

        Returns:
            ``False`` (``pool`` unchanged) if an uncached free-queue entry sits
            behind a cached one.
        """
        if isinstance(pool, WiredPool):
            return pool.rewire()
        w = WiredPool._build(pool)
        if w is None:
            return False
        pool.__class__ = WiredPool
        pool._w = w
        return True

    def rewire(self) -> bool:
        """Rebuild the wire state (``False``: the free queue's shape does not allow it)."""
        w = WiredPool._build(self)
        if w is None:
            return False
        self._w = w
        return True

    @staticmethod
    def _build(pool: BlockPool) -> _Wire | None:
        key = pool._key
        seen = False
        for e in pool._free:
            if e >= 0 and key[e] is not None:
                seen = True
            elif seen:
                return None
        w = _Wire()
        wi = w.wi = [-1] * len(pool._ref)
        # The plain export's order, so that the first export of a wired pool is its twin.
        for k, holders in pool._cached.items():
            w.kw[k] = len(w.wb)
            for b in holders:
                wi[b] = len(w.wb)
                w.wb.append(b)
                w.wk.append(k & KEY_MASK)
                w.wr.append(k)
        ch = w.chunks[0]
        for e in pool._free:
            if e >= 0 and key[e] is not None:
                if len(ch) >= _CHUNK:
                    ch = []
                    w.chunks.append(ch)
                ch.append(wi[e])
                w.fof[e] = ch
        return w

    @property
    def wire_state(self) -> _Wire:
        """The wire numbering (for :func:`bearsdk.replay.prefix.export`)."""
        return self._w

    def touch(self, blocks: Iterable[int]) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        super().touch(blocks)
        w = self._w
        fof = w.fof
        if fof:
            wi = w.wi
            for b in blocks:
                ch = fof.pop(b, None)
                if ch is not None:
                    del ch[ch.index(wi[b])]

    def allocate(self, n: int) -> list[int]:
        out = super().allocate(n)
        w = self._w
        wi = w.wi
        known = len(wi)
        for b in out:
            if b < known and wi[b] >= 0:
                self._evicted(w, b, wi[b])
        if len(self._ref) > known:
            wi.extend([-1] * (len(self._ref) - known))
        return out

    def _evicted(self, w: _Wire, b: int, x: int) -> None:
        w.wi[b] = -1
        w.wb[x] = -1
        heapq.heappush(w.holes, x)
        ch = w.fof.pop(b, None)
        if ch is not None:  # (not when it was cached while free: see _Wire.ok)
            del ch[ch.index(x)]
        k = w.wr[x]
        if w.kw.get(k) == x:
            holders = self._cached.get(k)
            if holders:
                w.kw[k] = w.wi[holders[0]]
            else:
                del w.kw[k]
            w.kchanged.add(k)

    def cache(self, blocks: Sequence[int], keys: Sequence[int], start: int, stop: int) -> None:
        super().cache(blocks, keys, start, stop)
        w = self._w
        wi, key = w.wi, self._key
        shared = None
        for i in range(start, stop):
            b = blocks[i]
            if wi[b] < 0:
                k = key[b]
                if k is not None and self._cached_new(w, b, k):
                    if shared is None:
                        shared = set()
                    shared.add(k)
        if shared:
            # Once every new block has its index (several can share a key).
            for k in shared:
                self._order(w, k, self._cached[k])

    def _cached_new(self, w: _Wire, b: int, k: int) -> bool:
        """Give newly cached ``b`` an index; ``True`` if ``k`` has other holders."""
        if self._ref[b] == 0:
            w.ok = False  # a free block became findable: the free list is rebuilt
        if w.holes:
            x = heapq.heappop(w.holes)
            w.wb[x] = b
            w.wk[x] = k & KEY_MASK
            w.wr[x] = k
        else:
            x = len(w.wb)
            w.wb.append(b)
            w.wk.append(k & KEY_MASK)
            w.wr.append(k)
        w.wi[b] = x
        if len(self._cached[k]) == 1:
            w.kw[k] = x
            w.kchanged.add(k)
            if len(w.kchanged) > _FORGET:
                # No snapshot for long: forget what the exports remember
                # rather than log every change.
                w.kchanged.clear()
                w.state = {}
            return False
        return True

    def _order(self, w: _Wire, k: int, holders: Sequence[int]) -> None:
        """Give ``k``'s holders their indices in first-cached-first order (the wire's rule)."""
        wi = w.wi
        now = [wi[h] for h in holders]
        want = sorted(now)
        if now != want:
            moves = [(h, a, z) for h, a, z in zip(holders, now, want, strict=True) if a != z]
            # Where the free ones sit, found before any value changes.
            spots = []
            for h, a, z in moves:
                ch = w.fof.get(h)
                if ch is not None:
                    spots.append((ch, ch.index(a), z))
            for ch, j, z in spots:
                ch[j] = z
            for h, _, z in moves:
                w.wb[z] = h
                wi[h] = z
                w.renamed.add(h)
        if w.kw.get(k) != want[0]:
            w.kw[k] = want[0]
            w.kchanged.add(k)

    def release(self, blocks: Iterable[int]) -> None:
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        super().release(blocks)
        w = self._w
        wi, ref = w.wi, self._ref
        m = len({b for b in blocks if ref[b] == 0 and wi[b] >= 0})
        if m:
            # The base class queued them at the back, in order.
            tail = list(islice(reversed(self._free), m))
            ch = w.chunks[-1]
            for b in reversed(tail):
                if len(ch) >= _CHUNK:
                    ch = []
                    w.chunks.append(ch)
                ch.append(wi[b])
                w.fof[b] = ch

    def dense(self) -> None:
        """Close the holes: the last blocks take the evicted blocks' indices (in order)."""
        w = self._w
        holes = w.holes
        if holes:
            wb = w.wb
            n = len(wb)
            live = n - len(holes)
            targets = sorted(h for h in holes if h < live)
            movers = [x for x in range(live, n) if wb[x] >= 0]
            dups = []
            for src, dst in zip(movers, targets, strict=True):
                b = wb[src]
                wb[dst] = b
                w.wk[dst] = w.wk[src]
                k = w.wr[dst] = w.wr[src]
                w.wi[b] = dst
                ch = w.fof.get(b)
                if ch is not None:
                    ch[ch.index(src)] = dst
                w.renamed.add(b)
                if w.kw.get(k) == src:
                    w.kw[k] = dst
                    w.kchanged.add(k)
                if len(self._cached[k]) > 1:
                    dups.append(k)
            del wb[live:], w.wk[live:], w.wr[live:]
            w.holes = []
            for k in dups:
                self._order(w, k, self._cached[k])
        chunks = w.chunks
        if len(chunks) > 8 and len(chunks) * _CHUNK > 8 * len(w.fof) + 8 * _CHUNK:
            # Mostly emptied chunks: join them (amortized over the removals).
            flat = [x for ch in chunks for x in ch]
            w.chunks = []
            for i in range(0, len(flat), _CHUNK):
                ch = flat[i : i + _CHUNK]
                w.chunks.append(ch)
                for x in ch:
                    w.fof[w.wb[x]] = ch
            if not w.chunks:
                w.chunks = [[]]

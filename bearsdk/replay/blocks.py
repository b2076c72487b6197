"""vLLM's KV block pool with automatic prefix caching (APC), block by block.

:class:`~bearsdk.replay.scheduler.SchedulerCore` counts free blocks when a
policy does not cache prefixes. With ``kv.prefix_caching`` on it needs the
blocks' identities instead, because requests share blocks and a freed block
stays findable until it is reused: :class:`BlockPool` keeps them the way vLLM
0.33's ``BlockPool`` and ``FullAttentionManager`` do (``docs/prefix-caching.md``
gives each rule with its vLLM source line):

- a free queue in eviction order: allocation takes blocks from its front (a
  cached one loses its hash there: that is the eviction); a block whose
  reference count drops to zero joins its back if it is cached and its front
  if not, in the order freed (a request frees its blocks tail first);
- a map from block content to the blocks holding it; a lookup walks a request's
  chain of full-block keys from the start and stops at the first miss, and when
  two blocks hold the same content the one cached first answers;
- touching a hit takes a free block out of the free queue (it is no longer
  free, though it costs no compute).

Block content is a key: a request's chain of keys is built from its token ids
when it has them (:func:`chain_keys`), and otherwise from keys a snapshot
gives, extended with keys no other block can have.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Final

__all__ = ["KEY_MASK", "BlockPool", "WiredPool", "chain_keys"]

KEY_MASK: Final = (1 << 63) - 1
"""Content keys are non-negative 63-bit ints; keys that stand for unknown
content are negative, so the two never meet."""

_ROOT: Final = 0x5BD1E995
"""The parent key of a chain's first block."""


def chain_keys(tokens: Sequence[int], block_size: int, start: Sequence[int] = ()) -> list[int]:
    """The content keys of every full block of ``tokens``, chained like vLLM's hashes.

    Each block's key depends on its tokens and on the key of the block before
    it, so equal keys mean equal prefixes up to that block (up to a 2^-63
    collision chance per pair; vLLM itself compares hashes, not tokens).

    Args:
        tokens: Token ids.
        block_size: Tokens per block.
        start: Keys already computed for the first blocks (extended, not
            recomputed).

    Returns:
        One key per full block.
    """
    keys = list(start)
    parent = keys[-1] if keys else _ROOT
    for i in range(len(keys), len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size]))) & KEY_MASK
        keys.append(parent)
    return keys


class BlockPool:
    """The engine's KV blocks, their reference counts, the prefix cache and the free queue.

    Blocks get ids when they first matter: a free block that holds nothing
    findable and was never handed out is part of a *run* in the free queue (a
    count), so a pool of millions of blocks costs what its used blocks cost.

    Args:
        num_blocks: Blocks in the pool (``0``: unlimited, nothing is ever evicted).
        reserved: Blocks that are never free (vLLM's null block).

    Attributes:
        queries: Tokens looked up when requests were first admitted (vLLM's
            ``prefix_cache_queries``). hits: Tokens those lookups found.
        preempted_queries: Tokens looked up when preempted requests were
            admitted again. preempted_hits: Tokens those lookups found.
    """

    __slots__ = (
        "_cached",
        "_free",
        "_key",
        "_n_free",
        "_ref",
        "_runs",
        "_token",
        "_unlimited",
        "_w",
        "hits",
        "preempted_hits",
        "preempted_queries",
        "queries",
    )

    # Set only on a WiredPool (WiredPool.wire): the export's wire numbering.
    _w: _Wire

    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        self._unlimited = num_blocks == 0
        self._ref: list[int] = []
        self._key: list[int | None] = []
        # The free queue in eviction order (front first). Entries >= 0 are
        # block ids, entries < 0 name runs of unnamed blocks (_runs: their
        # counts). An OrderedDict gives the O(1) removal from the middle that a
        # touched hit needs.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._runs: dict[int, int] = {}
        self._token = 0
        self._n_free = 0
        if num_blocks > reserved:
            self._push_run(num_blocks - reserved)
        # content key -> the blocks holding it, first cached first; tuples,
        # replaced rather than changed, so that a copy of the pool can share them
        self._cached: dict[int, tuple[int, ...]] = {}
        self.queries = self.hits = 0
        self.preempted_queries = self.preempted_hits = 0

    def _push_run(self, n: int) -> None:
        self._token -= 1  # a run's name is never reused
        token = self._token
        self._runs[token] = n
        self._free[token] = None
        self._n_free += n

    @property
    def num_free(self) -> int:
        """Free blocks, cached ones included (what vLLM reports as free)."""
        return self._n_free

    @property
    def num_cached(self) -> int:
        """Blocks whose content is findable (held or free)."""
        return sum(len(v) for v in self._cached.values())

    def lookup(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """The longest run of cached blocks matching ``keys`` from the start.

        Args:
            keys: A request's chain of content keys.
            max_blocks: Stop after this many blocks.

        Returns:
            The block ids found (their tokens need no compute).
        """
        found: list[int] = []
        cached = self._cached
        for k in keys[:max_blocks]:
            holders = cached.get(k)
            if not holders:
                break
            found.append(holders[0])
        return found

    def evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them uses up free blocks)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """A request takes a hold on hit blocks; free ones leave the free queue."""
        ref = self._ref
        for b in blocks:
            if ref[b] == 0:
                del self._free[b]
                self._n_free -= 1
            ref[b] += 1

    def _name(self) -> int:
        b = len(self._ref)
        self._ref.append(0)
        self._key.append(None)
        return b

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting their content.

        Raises:
            ValueError: Fewer than ``n`` blocks are free (callers check first).
        """
        if n <= 0:
            return []
        out: list[int] = []
        if self._unlimited:
            # An unlimited pool never evicts: it grows instead.
            for _ in range(n):
                b = self._name()
                self._ref[b] = 1
                out.append(b)
            return out
        if n > self._n_free:
            raise ValueError(f"cannot allocate {n} blocks: {self._n_free} free")
        free, ref, key, runs = self._free, self._ref, self._key, self._runs
        while len(out) < n:
            e = next(iter(free))
            if e < 0:
                take = min(runs[e], n - len(out))
                runs[e] -= take
                if runs[e] == 0:
                    del runs[e]
                    del free[e]
                for _ in range(take):
                    b = self._name()
                    ref[b] = 1
                    out.append(b)
                self._n_free -= take
                continue
            del free[e]
            self._n_free -= 1
            k = key[e]
            if k is not None:
                self._forget(k, e)
                key[e] = None
            ref[e] = 1
            out.append(e)
        return out

    def _forget(self, k: int, b: int) -> None:
        holders = tuple(x for x in self._cached[k] if x != b)
        if holders:
            self._cached[k] = holders
        else:
            del self._cached[k]

    def cache(self, blocks: Sequence[int], keys: Sequence[int], start: int, stop: int) -> None:
        """Make ``blocks[start:stop]`` findable under ``keys[start:stop]`` (they are full)."""
        key, cached = self._key, self._cached
        for i in range(start, stop):
            b = blocks[i]
            if key[b] is not None:
                continue
            k = keys[i]
            key[b] = k
            cached[k] = (*cached.get(k, ()), b)

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one hold on each block and queue the blocks no one holds any more.

        Cached blocks join the back of the free queue (evicted last, oldest
        first); blocks with no content to find join its front, to be reused
        first. Both keep the order given.

        Args:
            blocks: In eviction order (a request passes its blocks tail first,
                so its tail is evicted first).
        """
        ref, free, key = self._ref, self._free, self._key
        first = []
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0:
                self._n_free += 1
                if key[b] is None:
                    first.append(b)
                else:
                    free[b] = None
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)

    @classmethod
    def restore(
        cls, keys: Sequence[int | None], refs: Sequence[int], free: Sequence[int]
    ) -> BlockPool:
        """A pool in a given state (a snapshot's), blocks ``0..len(keys) - 1``.

        Args:
            keys: Each named block's content key (``None``: no findable
                content); blocks with equal keys are found in id order.
            refs: Each named block's holders.
            free: The free queue, front first: a block id (``>= 0``, exactly the
                named blocks with no holder), or ``-n`` for ``n`` unnamed blocks.
        """
        pool = cls(0)
        pool._unlimited = False
        pool._ref = list(refs)
        pool._key = list(keys)
        for e in free:
            if e >= 0:
                pool._free[e] = None
                pool._n_free += 1
            else:
                pool._push_run(-e)
        for b, k in enumerate(keys):
            if k is not None:
                pool._cached[k] = (*pool._cached.get(k, ()), b)
        return pool

    def copy(self) -> BlockPool:
        """An independent copy (a replay runs on one, the prepared state keeps the other)."""
        c = BlockPool.__new__(BlockPool)
        c._unlimited = self._unlimited
        c._ref = list(self._ref)
        c._key = list(self._key)
        c._free = self._free.copy()
        c._runs = self._runs.copy()
        c._token = self._token
        c._n_free = self._n_free
        c._cached = self._cached.copy()
        c.queries, c.hits = self.queries, self.hits
        c.preempted_queries, c.preempted_hits = self.preempted_queries, self.preempted_hits
        return c

    def cached_blocks(self) -> list[tuple[int, int]]:
        """``(block id, content key)`` of every findable block; equal keys first cached first."""
        return [(b, k) for k, holders in self._cached.items() for b in holders]

    def key_of(self, b: int) -> int | None:
        """Block ``b``'s content key (``None``: nothing findable)."""
        return self._key[b]

    def free_queue(self) -> list[tuple[int, int | None]]:
        """The free queue, front first: ``(block id, content key or None)`` for a
        named block, ``(-n, None)`` for a run of ``n`` unnamed blocks."""
        return [(e, self._key[e]) if e >= 0 else (-self._runs[e], None) for e in self._free]

    def held(self, b: int) -> int:
        """Requests holding block ``b``."""
        return self._ref[b]


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

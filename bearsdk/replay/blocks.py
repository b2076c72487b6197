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

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from bearsdk.replay.wired import _Wire

__all__ = ["KEY_MASK", "BlockPool", "chain_keys", "extend_chain"]

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


def extend_chain(parent: int | None, tokens: Sequence[int], block_size: int) -> list[int]:
    """The keys of the full blocks of ``tokens`` following a block whose key is ``parent``.

    ``None``: they start a chain. Equal to the tail of :func:`chain_keys` over
    the whole prefix, so that blocks reported one group at a time (vLLM's KV
    events) get the keys a request's own chain has.
    """
    keys = []
    key = _ROOT if parent is None else parent
    for i in range(len(tokens) // block_size):
        key = hash((key, tuple(tokens[i * block_size : (i + 1) * block_size]))) & KEY_MASK
        keys.append(key)
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
        "events",
        "hits",
        "preempted_hits",
        "preempted_queries",
        "queries",
    )

    # Set only on a WiredPool (bearsdk.replay.wired): the export's wire numbering.
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
        # KV events (SchedulerCore.record_kv_events): evictions are appended here.
        self.events: list[Any] | None = None
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
                if self.events is not None:
                    self.events.append(("removed", k))
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
        c.events = None
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

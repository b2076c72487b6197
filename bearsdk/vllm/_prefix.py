"""The ``kv.prefix_cache`` extension from vLLM's real block pool, tracked incrementally.

With automatic prefix caching on, a snapshot must say which blocks exist, what
they hold and who holds them (``docs/contracts.md``, "Prefix caching"). Walking
vLLM's pool for that at every step costs O(cached blocks) of Python: its free
queue is a linked list of Python objects and its hash map a dict of them.
:class:`PoolTracker` instead observes the pool: it wraps, on the scheduler's own
``BlockPool`` and ``FreeKVCacheBlockQueue`` instances (nothing of vLLM's is
patched on disk or per class), the few methods through which every change
goes:

* the hash map: ``BlockPool._insert_block_hash`` (a block gets its hash:
  ``cache_full_blocks``, ``move_block_hashes``) and
  ``BlockPool._remove_cached_block_hashes`` (eviction on reuse,
  ``evict_blocks``); ``reset_prefix_cache`` rebuilds from scratch;
* the free queue: ``popleft``, ``popleft_n`` (allocation), ``remove`` (a hit
  touches a free block), ``append``, ``append_n`` and ``prepend_n`` (frees).

Each observed call costs O(1) per block it moves. The tracker keeps:

* a **slot** per cached block, into flat ``array`` columns (``slot_block``,
  ``slot_key``): slots of held blocks never move, so a running request's
  ``blocks`` runs are kept per request and only extended as it caches more.
  A freed slot is reused by the next block whose content no other block holds;
  a duplicate always takes a fresh slot above, so slot order keeps vLLM's
  "first cached first" order among equal content (``docs/prefix-caching.md``,
  ``dup-hash``). The wire's dense ``keys[:cached]`` index is slot order with the
  holes squeezed out (one cumulative sum when there are holes);
* the free queue as an ``array`` of block ids with tombstones (a touched block
  leaves a hole; compacted when holes outnumber entries).

What the wire format still makes O(cached) per snapshot, the keys and the free
queue in full, is bulk work: numpy over those arrays, and the compiled
``json_ints`` of ``bearsdk.vllm._pub_c`` to print them. Per resident it reads its
block list's length, its cached count, and the block hashes it gained since the
last capture.

:class:`PrefixExport` pairs each capture with the document the capture twins
format (by ``seq``) and splices the extension into it (:meth:`PrefixExport.splice`).
Nothing here imports vLLM: the objects come from the scheduler plugin.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np

from bearsdk.prefix_cache import MAX_CACHE_ENTRIES
from bearsdk.vllm._prefix_frame import KeysText, PrefixFrame, key_of, key_of_grouped

__all__ = ["PoolTracker", "PrefixExport", "PrefixHooks"]
_FRAMES_KEPT: Final = 64
_SPLICE_WAIT_S: Final = 1.0


class PoolTracker:
    """An incrementally kept copy of a vLLM ``BlockPool``'s hash map and free queue.

    Args:
        pool: The scheduler's ``BlockPool`` (``kv_cache_manager.block_pool``).
        manager: Its single full-attention ``SingleTypeKVCacheManager``
            (``req_to_blocks``, ``num_cached_block``).
        block_size: Tokens per block.
        install: Wrap the pool's methods (False: a passive copy for tests,
            kept current by :meth:`rebuild`).
    """

    def __init__(self, pool: Any, manager: Any, block_size: int, *, install: bool = True) -> None:
        self.pool = pool
        self.manager = manager
        self.block_size = block_size
        n = int(pool.num_gpu_blocks)
        self.num_blocks = n
        self.slot_cap = 2 * n + 64
        self.queue_cap = 4 * n + 64
        self.slot_of = array("i", [-1]) * n
        self.slot_block = array("i", [-1]) * self.slot_cap
        self.slot_key = array("q", [0]) * self.slot_cap
        self.queue = array("i", [-1]) * self.queue_cap
        self.pos = array("i", [-1]) * n
        self.top = 0
        self.holes: list[int] = []
        self.by_key: dict[int, int | list[int]] = {}  # key -> slot, or slots in cache order
        self.epoch = 0  # bumped when slots are renumbered (memos of runs go stale)
        self.head = self.tail = 0
        self.tombs = 0
        self.unsupported: str | None = None
        self.stale = False  # an observed change failed to apply: rebuild before exporting
        self.rebuilds = 0
        self.removed = 0  # cached blocks that lost their content (evictions)
        self._memo_blocks: dict[str, list[Any]] = {}
        self._memo_keys: dict[str, list[Any]] = {}
        self.rebuild()
        if install:
            self._install()

    # -- the slot columns ---------------------------------------------------------

    def _insert(self, block_id: int, key: int) -> None:
        if self.slot_of[block_id] >= 0:
            self._remove(block_id)
        have = self.by_key.get(key)
        if have is None and self.holes:
            s = self.holes.pop()
        else:
            if self.top == self.slot_cap:
                self._renumber()
                have = self.by_key.get(key)
            s = self.top
            self.top += 1
        self.slot_of[block_id] = s
        self.slot_block[s] = block_id
        self.slot_key[s] = key
        if have is None:
            self.by_key[key] = s
        elif isinstance(have, int):
            self.by_key[key] = [have, s]
        else:
            have.append(s)

    def _remove(self, block_id: int) -> None:
        s = self.slot_of[block_id]
        if s < 0:
            return
        self.removed += 1
        key = self.slot_key[s]
        self.slot_of[block_id] = -1
        self.slot_block[s] = -1
        if s == self.top - 1:
            self.top -= 1
        else:
            self.holes.append(s)
        have = self.by_key[key]
        if isinstance(have, int):
            del self.by_key[key]
        else:
            have.remove(s)
            if len(have) == 1:
                self.by_key[key] = have[0]

    def _renumber(self) -> None:
        # Squeeze the holes out, keeping slot order (and so duplicates' order).
        live = [(s, b) for s in range(self.top) if (b := self.slot_block[s]) >= 0]
        keys = [self.slot_key[s] for s, _ in live]
        for i in range(self.top):
            self.slot_block[i] = -1
        self.by_key.clear()
        self.holes = []
        self.top = 0
        for (_, b), k in zip(live, keys, strict=True):
            self.slot_of[b] = -1
            self._insert(b, k)
        self.epoch += 1

    # -- the free queue -----------------------------------------------------------

    def _q_reset(self, ids: Iterable[int]) -> None:
        q = self.queue
        for i in range(self.head, self.tail):
            q[i] = -1
        start = self.queue_cap // 4
        self.head = self.tail = start
        for b in ids:
            q[self.tail] = b
            self.pos[b] = self.tail
            self.tail += 1
        self.tombs = 0

    def _q_compact(self) -> None:
        view = np.frombuffer(self.queue, dtype=np.int32)[self.head : self.tail]
        live = view[view >= 0].tolist()
        del view
        self._q_reset(live)

    def _q_popleft(self) -> int:
        q = self.queue
        h = self.head
        while q[h] < 0:
            h += 1
            self.tombs -= 1
        b = q[h]
        q[h] = -1
        self.pos[b] = -1
        self.head = h + 1
        return b

    def _q_remove(self, b: int) -> None:
        p = self.pos[b]
        if p < 0:
            return
        self.queue[p] = -1
        self.pos[b] = -1
        self.tombs += 1
        if self.tombs > 1024 and self.tombs > (self.tail - self.head) // 2:
            self._q_compact()

    def _q_append(self, b: int) -> None:
        if self.tail == self.queue_cap:
            self._q_compact()
        self.queue[self.tail] = b
        self.pos[b] = self.tail
        self.tail += 1

    def _q_prepend(self, ids: Sequence[int]) -> None:
        k = len(ids)
        if self.head < k:
            self._q_compact()
        h = self.head - k
        for j, b in enumerate(ids):
            self.queue[h + j] = b
            self.pos[b] = h + j
        self.head = h

    # -- observing vLLM ------------------------------------------------------------

    def rebuild(self) -> None:
        """Read the pool from scratch (at start, and after ``reset_prefix_cache``)."""
        for s in range(self.top):
            b = self.slot_block[s]
            if b >= 0:
                self.slot_of[b] = -1
            self.slot_block[s] = -1
        self.top = 0
        self.holes = []
        self.by_key.clear()
        self.epoch += 1
        for h, v in self.pool.cached_block_hash_to_block._cache.items():
            k = key_of_grouped(h)
            for blk in v.values() if isinstance(v, dict) else (v,):
                self._insert(blk.block_id, k)
        q = self.pool.free_block_queue
        ids = []
        blk = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        while blk is not None and blk is not tail:
            ids.append(blk.block_id)
            blk = blk.next_free_block
        for b in range(self.num_blocks):
            self.pos[b] = -1
        self._q_reset(ids)

    def _install(self) -> None:
        pool = self.pool
        queue = pool.free_block_queue
        insert_hash = pool._insert_block_hash
        remove_hashes = pool._remove_cached_block_hashes
        reset = pool.reset_prefix_cache
        popleft = queue.popleft
        popleft_n = queue.popleft_n
        remove = queue.remove
        append = queue.append
        append_n = queue.append_n
        prepend_n = queue.prepend_n
        ins, rem = self._insert, self._remove
        qpop, qrem, qapp, qpre = self._q_popleft, self._q_remove, self._q_append, self._q_prepend

        # vLLM's own call first; then the copy, which must never raise into
        # vLLM: a failure marks the copy stale and the next export rebuilds it.
        def _insert_block_hash(key: Any, block: Any, num_tokens: Any) -> None:
            had = block.block_hash
            insert_hash(key, block, num_tokens)
            try:
                now = block.block_hash
                if had is None and now is not None:
                    ins(block.block_id, key_of_grouped(now))
                elif had is not None and now is not had:
                    self.unsupported = "a block with two hashes (several KV cache groups)"
            except Exception:
                self.stale = True

        def _remove_cached_block_hashes(block: Any) -> Any:
            had = block.block_hash
            out = remove_hashes(block)
            try:
                if had is not None and block.block_hash is None:
                    rem(block.block_id)
            except Exception:
                self.stale = True
            return out

        def reset_prefix_cache() -> bool:
            ok = bool(reset())
            if ok:
                self.stale = True
            return ok

        def q_popleft() -> Any:
            blk = popleft()
            try:
                qpop()
            except Exception:
                self.stale = True
            return blk

        def q_popleft_n(n: int) -> Any:
            out = popleft_n(n)
            try:
                for _ in range(len(out)):
                    qpop()
            except Exception:
                self.stale = True
            return out

        def q_remove(block: Any) -> None:
            remove(block)
            try:
                qrem(block.block_id)
            except Exception:
                self.stale = True

        def q_append(block: Any) -> None:
            append(block)
            try:
                qapp(block.block_id)
            except Exception:
                self.stale = True

        def q_append_n(blocks: Any) -> None:
            append_n(blocks)
            try:
                for blk in blocks:
                    qapp(blk.block_id)
            except Exception:
                self.stale = True

        def q_prepend_n(blocks: Any) -> None:
            prepend_n(blocks)
            try:
                if blocks:
                    qpre([blk.block_id for blk in blocks])
            except Exception:
                self.stale = True

        pool._insert_block_hash = _insert_block_hash
        pool._remove_cached_block_hashes = _remove_cached_block_hashes
        pool.reset_prefix_cache = reset_prefix_cache
        queue.popleft = q_popleft
        queue.popleft_n = q_popleft_n
        queue.remove = q_remove
        queue.append = q_append
        queue.append_n = q_append_n
        queue.prepend_n = q_prepend_n

    # -- the export -----------------------------------------------------------------

    def free_ids(self) -> list[int]:
        """The free queue's block ids, front first (tests)."""
        view = np.frombuffer(self.queue, dtype=np.int32)[self.head : self.tail]
        return [int(b) for b in view[view >= 0]]

    def cached_entries(self) -> list[tuple[int, int]]:
        """``(block id, key)`` of every cached block in slot order (tests)."""
        return [
            (self.slot_block[s], self.slot_key[s])
            for s in range(self.top)
            if self.slot_block[s] >= 0
        ]

    def export(self, seq: int, requests: Iterable[tuple[Any, bool]]) -> PrefixFrame:
        """The pool and the residents' blocks, now (bulk copies; formatted later).

        Args:
            seq: The snapshot's ``seq``.
            requests: ``(request, running)`` in snapshot order.
        """
        if self.unsupported is not None:
            return PrefixFrame(seq, error=self.unsupported)
        if self.stale:
            self.stale = False
            self.rebuilds += 1
            self.rebuild()
        cached = self.top - len(self.holes)
        if cached > MAX_CACHE_ENTRIES:
            # A document validation would reject loses the whole snapshot;
            # without the extension the router still replays it (blocks counted).
            return PrefixFrame(
                seq,
                error=f"{cached} cached blocks: more than kv.prefix_cache carries "
                f"({MAX_CACHE_ENTRIES})",
            )
        top = self.top
        reqs: list[tuple[Any, int, Any]] = []
        extra: dict[int, int] = {}
        bs = self.block_size
        r2b = self.manager.req_to_blocks
        ncb = self.manager.num_cached_block
        memo_b = self._memo_blocks
        memo_k = self._memo_keys
        new_b: dict[str, list[Any]] = {}
        new_k: dict[str, list[Any]] = {}
        by_key = self.by_key
        slot_of = self.slot_of
        epoch = self.epoch
        for r, running in requests:
            rid = r.request_id
            frozen: Any = None
            uncached = 0
            nmine = 0
            held = r2b.get(rid)
            if running:
                nheld = len(held) if held is not None else 0
                if nheld:
                    nc = ncb.get(rid, 0)
                    m = memo_b.get(rid)
                    if m is None or m[0] is not held or m[3] != epoch or m[1] > nc:
                        m = [held, 0, [], epoch, None]
                    if m[1] < nc:
                        # (start, count) pairs; only the last is ever replaced, so
                        # a frame keeps the list, its length and its last pair.
                        runs: list[tuple[int, int]] = m[2]
                        for blk in held[m[1] : nc]:
                            sl = slot_of[blk.block_id]
                            if sl < 0:
                                raise RuntimeError(f"{rid} holds a cached block not in the map")
                            if runs and runs[-1][0] + runs[-1][1] == sl:
                                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                            else:
                                runs.append((sl, 1))
                        m[1] = nc
                        m[4] = (runs, len(runs), runs[-1])
                    new_b[rid] = m
                    nmine = nc
                    frozen = m[4]
                    uncached = nheld - nc
            elif held:
                raise RuntimeError(f"waiting request {rid} holds blocks")
            chain: Any = None
            known = r.num_tokens // bs
            km = memo_k.get(rid)
            if known > nmine:
                hashes = r.block_hashes
                if km is None or km[0] is not hashes or len(km[1]) > len(hashes):
                    km = [hashes, []]
                ks: list[int] = km[1]
                if len(ks) < len(hashes):
                    ks.extend(map(key_of, hashes[len(ks) :]))
                new_k[rid] = km
                chain = []
                for k in ks[nmine:known]:
                    have = by_key.get(k)
                    if have is None:
                        j = extra.get(k)
                        if j is None:
                            j = extra[k] = len(extra)
                        chain.append(-1 - j)
                    else:
                        chain.append(have if isinstance(have, int) else have[0])
            elif km is not None:
                new_k[rid] = km  # the keys converted so far stay valid
            reqs.append((frozen, uncached, chain))
        self._memo_blocks = new_b
        self._memo_keys = new_k
        return PrefixFrame(
            seq,
            slot_key=self.slot_key[:top],
            slot_block=self.slot_block[:top],
            holes=bool(self.holes),
            queue=self.queue[self.head : self.tail],
            slot_of=self.slot_of[:],
            reqs=reqs,
            extra=list(extra),
        )


class PrefixHooks:
    """The publisher's engine-thread hooks, plus a pool capture after each snapshot capture.

    Args:
        inner: The capture twin's ``Hooks``.
        export: Where the pool captures go.
    """

    __slots__ = ("_captures", "export", "inner")

    def __init__(self, inner: Any, export: PrefixExport) -> None:
        self.inner = inner
        self.export = export
        self._captures = int(inner.captures)

    def _pool(self, sched: Any) -> None:
        n = self.inner.captures
        if n != self._captures:
            self._captures = n
            self.export.capture(
                int(self.inner.seq), sched.running, (sched.kv_holding_waiting, sched.waiting)
            )

    def before_schedule(self, sched: Any) -> int:
        """Start of ``schedule()``: the snapshot, then the pool."""
        r = int(self.inner.before_schedule(sched))
        self._pool(sched)
        return r

    def after_schedule(self, out: Any) -> int:
        """End of ``schedule()`` (the inner hook's)."""
        return int(self.inner.after_schedule(out))

    def before_update(self, out: Any, model_output: Any) -> int:
        """Start of ``update_from_output()`` (the inner hook's)."""
        return int(self.inner.before_update(out, model_output))

    def after_change(self, sched: Any) -> int:
        """After an update or an abort: the idle snapshot, if one was taken, then the pool."""
        r = int(self.inner.after_change(sched))
        self._pool(sched)
        return r

    def preempted(self, request: Any) -> int:
        """A preemption (the inner hook's)."""
        return int(self.inner.preempted(request))


class PrefixExport:
    """Captures a tracker's state with each snapshot and splices it into the document.

    Args:
        tracker: The pool's tracker.
        head: The documents' constant head (``json_head(instance, epoch)``).
    """

    def __init__(self, tracker: PoolTracker, head: bytes) -> None:
        self.tracker = tracker
        self._seq_at = len(head) + len(b',"seq":')
        self._cond = threading.Condition()
        self._frames: dict[int, PrefixFrame] = {}
        self.engine_ns = 0
        self.failures = 0
        self.last_error: str | None = None
        self.spliced = 0
        self.superseded = 0
        # The formatting thread's reuse of the last document's texts.
        self._texts: dict[int, tuple[Any, bytes]] = {}
        self._keys_text = KeysText()

    def capture(self, seq: int, running: Iterable[Any], waiting: Iterable[Iterable[Any]]) -> None:
        """Engine thread, right after the capture of snapshot ``seq``: keep the pool's state."""
        t0 = time.perf_counter_ns()
        reqs: list[tuple[Any, bool]] = [(r, True) for r in running]
        for q in waiting:
            reqs.extend((r, False) for r in q)
        try:
            frame = self.tracker.export(seq, reqs)
        except Exception as exc:  # never stall or break the engine
            frame = PrefixFrame(seq, error=f"export: {exc!r}")
        with self._cond:
            self._frames[seq] = frame
            if len(self._frames) > _FRAMES_KEPT:
                del self._frames[min(self._frames)]
            self._cond.notify_all()
        self.engine_ns += time.perf_counter_ns() - t0

    def _seq_of(self, payload: bytes) -> int:
        i = self._seq_at
        j = payload.index(b",", i)
        return int(payload[i:j])

    def _take(self, seq: int, wait_s: float) -> PrefixFrame | None:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while seq not in self._frames:
                if any(s > seq for s in self._frames):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            frame = self._frames[seq]
            for s in [s for s in self._frames if s < seq]:
                del self._frames[s]
            return frame

    def splice(self, payload: bytes, wait_s: float = _SPLICE_WAIT_S) -> bytes | None:
        """The document with its capture's extension.

        Returns None when the capture is gone because the engine has captured
        many newer snapshots since (a publisher thread that fell behind): the
        document is stale, and a newer one follows, so it is skipped (counted in
        ``superseded``). Any other failure returns the document unchanged and is
        counted in ``failures``.
        """
        try:
            seq = self._seq_of(payload)
            frame = self._take(seq, wait_s)
            if frame is None:
                with self._cond:
                    newer = any(s > seq for s in self._frames)
                if newer:
                    self.superseded += 1
                    return None
                raise RuntimeError(f"no pool capture for snapshot {seq}")
            out = _splice(payload, frame, self._seq_at, self._texts, self._keys_text)
            self.spliced += 1
            return out
        except Exception as exc:
            self.failures += 1
            self.last_error = repr(exc)
            return payload


_ROW: Final = b',{"id":"'


def _splice(
    payload: bytes,
    frame: PrefixFrame,
    start: int,
    memo: dict[int, tuple[Any, bytes]],
    keys_text: KeysText,
) -> bytes:
    i = payload.index(b'"free_blocks":', start)
    j = payload.index(b"}", i)
    k = payload.index(b',"requests":[', j)
    rows = payload[k + 13 : -2]
    ext, fields = frame.format(memo, keys_text)
    if not rows:
        if fields:
            raise RuntimeError(f"the document has no rows, the capture {len(fields)}")
        body = b""
    else:
        parts = rows.split(_ROW)
        if len(parts) != len(fields):
            raise RuntimeError(f"the document has {len(parts)} rows, the capture {len(fields)}")
        body = _ROW.join(
            [p[:-1] + f + b"}" if f else p for p, f in zip(parts, fields, strict=True)]
        )
    return b"".join((payload[:j], b",", ext, payload[j:k], b',"requests":[', body, b"]}"))

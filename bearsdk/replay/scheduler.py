"""The live scheduler: a bound policy's batch formation, one request at a time.

:class:`SchedulerCore` interprets a :class:`~bearsdk.schedulers.Policy` the way
an engine's scheduler does. The emulated engine drives it in real time, the
simulator and fast-forward in virtual time, and the pure-Python replay twin
(``_replay_py``) in zero time; ``cext/_replay_c.pyx`` implements the replay's
contract separately at C speed, and property tests require both to produce
identical batch sequences. The vLLM differential harness checks this scheduler
step by step against vLLM's own.

The engine loop mirrors vLLM's ``EngineCore``: in synchronous mode a batch's
outputs are processed before the next batch is scheduled; with asynchronous
scheduling one batch is always in flight, so a batch is scheduled before the
outputs of the previous one are known (placeholders stand for its tokens).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from bearsdk.replay.blocks import BlockPool, chain_keys
from bearsdk.replay.prefix import export as export_blocks
from bearsdk.replay.requests import (
    FINISHED,
    RUNNING,
    WAITING,
    CachedReq,
    PolicyGeometry,
    Prepared,
    Req,
    cdiv,
)
from bearsdk.replay.types import BatchRecord, ReplayResult, StopReason
from bearsdk.replay.wired import WiredPool

if TYPE_CHECKING:
    # Typing only: the scheduler package compiles specs for the replay, not
    # the reverse.
    from bearsdk.schedulers.spec import Policy

__all__ = ["ScheduledBatch", "SchedulerCore", "StepOutput"]


class ScheduledBatch:
    """One batch formed by :meth:`SchedulerCore.schedule`.

    Attributes:
        admitted: Requests admitted from the waiting queue into this batch.
        preempted: Ids of requests preempted while forming it.
        pre: Prefill tokens. dec: Decode tokens. dctx: Summed decode context.
        patt: Summed prefill attention (eq. 12 terms).
    """

    __slots__ = (
        "admitted",
        "carried",
        "dctx",
        "dec",
        "patt",
        "pre",
        "preempted",
        "sampled",
        "sched",
    )

    def __init__(self) -> None:
        self.sched: dict[Req, int] = {}
        # the batch in flight at a snapshot: tokens it carries per request
        self.carried: dict[Req, int] = {}
        self.sampled: list[Req] = []
        self.admitted = 0
        self.preempted: list[str] = []
        # eq. 12 terms, filled in after scheduling
        self.pre = self.dec = self.dctx = self.patt = 0

    @property
    def tokens(self) -> dict[str, int]:
        """Scheduled tokens by request id, in scheduling order."""
        return {r.rid: n for r, n in self.sched.items()}

    @property
    def sampling(self) -> list[str]:
        """Ids of the requests this batch samples a token for."""
        return [r.rid for r in self.sampled]

    @property
    def total_tokens(self) -> int:
        """Tokens in the batch."""
        return self.pre + self.dec

    def __bool__(self) -> bool:
        return bool(self.sched)

    def inert(self) -> bool:
        """Processing this batch changes nothing."""
        return not self.sched and not self.sampled


class StepOutput:
    """What processing a batch's outputs produced.

    Attributes:
        tokens: Ids of requests that received an output token (in batch order).
        finished: Ids of requests that finished (their last token is in ``tokens``).
    """

    __slots__ = ("finished", "tokens")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.finished: list[str] = []


class SchedulerCore:
    """A policy's scheduler as a live engine core, in pure Python.

    Requests arrive (:meth:`add_request`), :meth:`schedule` forms the next batch
    and :meth:`process` applies its outputs. The caller owns the pipeline: a
    synchronous engine processes a batch before scheduling the next; an engine
    with asynchronous scheduling schedules batch ``k + 1`` before it processes
    batch ``k``. The replay drives it in zero time; the emulated engine and the
    simulator drive it in real or virtual time.

    With ``kv.prefix_caching`` the scheduler keeps every block's identity in a
    :class:`~bearsdk.replay.blocks.BlockPool` (:attr:`pool`): admissions skip
    the cached prefix of a request's tokens, and ``free`` counts cached-but-free
    blocks as vLLM does.

    Args:
        policy: The bound policy (its KV geometry is the engine's).
        free_blocks: Free KV blocks at start; default: the policy's pool less
            reserved blocks (unlimited when the policy has no pool size). A
            prefix-caching scheduler starts with its whole pool free and takes
            no other count.

    Raises:
        ValueError: ``free_blocks`` given to a prefix-caching scheduler.
    """

    def __init__(self, policy: Policy, free_blocks: int | None = None) -> None:
        self.geo = PolicyGeometry(policy)
        self.p = policy
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.requests: dict[str, Req] = {}
        self.unlimited = policy.num_blocks == 0 and free_blocks is None
        if free_blocks is None:
            free_blocks = 0 if self.unlimited else policy.num_blocks - policy.reserved_blocks
        self.pool: BlockPool | None = None
        if policy.prefix_caching:
            if free_blocks != (0 if self.unlimited else policy.num_blocks - policy.reserved_blocks):
                raise ValueError("a prefix-caching scheduler starts with its whole pool free")
            self.pool = BlockPool(policy.num_blocks, policy.reserved_blocks)
        self.free = free_blocks
        self.record = False
        self.b0 = self.b1 = self.b2 = self.b3 = self.tau = self.b2s = 0.0
        self.batches: list[BatchRecord] = []
        self.queue: deque[ScheduledBatch] = deque()
        # The replay's new request, and whether an admission has looked at it
        # (before that, nothing it carries can have changed a batch).
        self.watched: Req | None = None
        self.watched_seen = False

    @classmethod
    def from_prepared(
        cls,
        geo: PolicyGeometry,
        prepared: Prepared,
        record: bool = False,
        coeffs: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
    ) -> SchedulerCore:
        """A scheduler holding a snapshot's requests (``prepared`` is not modified).

        The replay starts from here in zero time; fast-forward runs it on in
        virtual time. Requests are not indexed by id (:attr:`requests` stays
        empty): a caller that aborts by id fills it in.

        Args:
            geo: The policy's geometry (the one that prepared the state).
            prepared: From :meth:`PolicyGeometry.prepare`.
            record: Keep a :class:`~bearsdk.replay.BatchRecord` per batch.
            coeffs: Eq. 12 coefficients, as :meth:`Replayer.replay` takes them.
        """
        core = cls.__new__(cls)
        core.geo = geo
        core.p = geo.policy
        core.running = []
        core.waiting = deque()
        core.requests = {}
        for r in prepared.reqs:
            c = r.clone()
            (core.running if c.status == RUNNING else core.waiting).append(c)
        core.free = prepared.free_blocks
        core.unlimited = prepared.unlimited_kv
        # A plain bear.snapshot/1 names no blocks: its replay counts them.
        core.pool = None if prepared.pool is None else prepared.pool.copy()
        core.record = record
        core.set_coeffs(coeffs)
        core.batches = []
        core.watched = None
        core.watched_seen = False
        # The batch in flight at the snapshot (async): its sampled tokens are the
        # placeholders; partial prefill chunks in it change nothing when processed.
        core.queue = deque()
        if prepared.has_inflight:
            b0 = ScheduledBatch()
            b0.sampled = [r for r in core.running if r.ph > 0]
            for r in b0.sampled:
                r.inflight = r.ph
                b0.carried[r] = r.ph
            core.queue.append(b0)
        return core

    # -- live use -------------------------------------------------------------

    def add_request(
        self,
        rid: str,
        prompt_tokens: int,
        output_len: int,
        max_tokens: int | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """A request arrives at the end of the waiting queue.

        Args:
            rid: Unique id.
            prompt_tokens: Prompt length.
            output_len: Output tokens it will produce (its true length).
            max_tokens: Its cap, known to the scheduler (``None``: none).
            token_ids: Its prompt's token ids, optionally followed by the output
                ids it will produce: what a prefix-caching scheduler matches
                blocks by. Without them (or past them) its blocks hold content
                no other request shares.

        Raises:
            ValueError: Duplicate id, a bad length, or fewer ``token_ids`` than
                ``prompt_tokens``.
        """
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already resident")
        if prompt_tokens < 1 or output_len < 1:
            raise ValueError(
                f"prompt_tokens and output_len must be >= 1 (got {prompt_tokens}, {output_len})"
            )
        if token_ids is not None and len(token_ids) < prompt_tokens:
            raise ValueError(
                f"token_ids must cover the prompt's {prompt_tokens} tokens (got {len(token_ids)})"
            )
        limit = -1 if max_tokens is None else max_tokens
        if self.pool is None:
            r = self.geo.make_req(rid, prompt_tokens, 0, output_len, limit)
        else:
            r = c = cast(
                CachedReq, self.geo.make_req(rid, prompt_tokens, 0, output_len, limit, CachedReq)
            )
            c.tokens = token_ids
        self.requests[rid] = r
        self.waiting.append(r)

    def abort_request(self, rid: str) -> bool:
        """Remove a resident request (freeing its blocks); ``False`` if unknown."""
        r = self.requests.pop(rid, None)
        if r is None or r.status == FINISHED:
            return False
        if r.status == RUNNING:
            self.running.remove(r)
            self._free_blocks(r)
        else:
            self.waiting.remove(r)
        r.status = FINISHED
        return True

    @property
    def num_running(self) -> int:
        """Requests holding a seat (and KV blocks)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued or preempted."""
        return len(self.waiting)

    @property
    def free_blocks(self) -> int:
        """Free KV blocks (0 with an unlimited pool)."""
        return self.free

    def has_work(self) -> bool:
        """Any resident request?"""
        return bool(self.running or self.waiting)

    def snapshot(
        self, *, instance: str = "local", seq: int = 0, time: float = 0.0, output_len: bool = False
    ) -> dict[str, Any]:
        """The engine state as a ``bear.snapshot/1`` document (running, then waiting).

        Args:
            instance: Instance name. seq: Step counter. time: Capture time.
            output_len: Include each request's true output length (tests, what-if).
        """
        reqs = []
        for r in self.running:
            reqs.append(self._snap_req(r, "running", output_len))
        for r in self.waiting:
            reqs.append(self._snap_req(r, "waiting", output_len))
        doc: dict[str, Any] = {
            "schema": "bear.snapshot/1",
            "instance": instance,
            "seq": seq,
            "time": time,
            "requests": reqs,
        }
        if not self.unlimited:
            doc["kv"] = {
                "block_size": self.p.block_size,
                "num_blocks": self.p.num_blocks,
                "free_blocks": self.free,
            }
            if self.pool is not None:
                self._export_blocks(doc)
        return doc

    def rows(self) -> tuple[tuple[str, ...], list[int]]:
        """:meth:`snapshot`'s requests with their output lengths, as snapshot table rows.

        Running first, then waiting; the columns of
        :data:`bearsdk.snapshot.NCOLS` (state 0 running, 1 waiting; ``-1``:
        no cap), flat: one request's row after another (a flat list becomes an
        array in about half the time nested rows take). What a fast-forward
        exports on every step, without building a document first (no
        ``kv.prefix_cache`` fields: use :meth:`snapshot` for a caching engine).
        """
        ids: list[str] = []
        out: list[int] = []
        self._rows(self.running, 0, ids, out)
        self._rows(self.waiting, 1, ids, out)
        return tuple(ids), out

    def rows_of(self, reqs: Sequence[Req]) -> tuple[tuple[str, ...], list[int]]:
        """:meth:`rows` of ``reqs`` alone, all of them waiting (a fast-forwarded
        view patched with the requests that arrived since its last export)."""
        ids: list[str] = []
        out: list[int] = []
        self._rows(reqs, 1, ids, out)
        return tuple(ids), out

    def _rows(self, reqs: Sequence[Req], state: int, ids: list[str], out: list[int]) -> None:
        mml = self.geo.max_model_len
        for r in reqs:
            lim = r.limit
            if lim >= (1 << 61) or (mml and lim == mml - r.prompt):
                lim = -1
            ids.append(r.rid)
            if state == 0:
                out += (0, r.prompt, r.computed, r.outputs, lim, r.target, r.ph)
            else:
                out += (1, r.prompt, 0, r.outputs, lim, r.target, 0)

    def _export_blocks(self, doc: dict[str, Any]) -> None:
        """Add the ``kv.prefix_cache`` extension (:mod:`bearsdk.prefix_cache`)."""
        assert self.pool is not None
        if type(self.pool) is BlockPool:
            # The live pool keeps its wire form from now on (the export then
            # copies it); a pool whose free queue does not allow it (a restored
            # one) is exported from scratch.
            WiredPool.wire(self.pool)
        bs = self.geo.block_size
        residents = []
        tags = []
        for r in (*self.running, *self.waiting):
            c = cast(CachedReq, r)
            held = c.block_ids if r.status == RUNNING else ()
            residents.append(
                (held, c.cached_blocks if held else 0, self._keys(c, r.num_tokens // bs))
            )
            # A request gives its blocks up only when preempted (or done); the
            # object, not its id, names it (an id can come back).
            tags.append((c, c.preemptions))
        doc["kv"]["prefix_cache"], fields = export_blocks(self.pool, residents, tags)
        for d, f in zip(doc["requests"], fields, strict=True):
            d.update(f)

    def _snap_req(self, r: Req, state: str, with_len: bool) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": r.rid,
            "state": state,
            "prompt_tokens": r.prompt,
            "computed_tokens": r.computed if state == "running" else 0,
            "output_tokens": r.outputs,
        }
        if r.limit < (1 << 61) and not (
            self.geo.max_model_len and r.limit == self.geo.max_model_len - r.prompt
        ):
            d["max_tokens"] = r.limit
        if with_len:
            d["output_len"] = r.target
        if r.ph and state == "running":
            d["placeholders"] = r.ph
        return d

    # -- engine loop --------------------------------------------------------

    def go(
        self,
        new: Req,
        max_batches: int,
        max_work: int,
        horizon: float = math.inf,
        arrival: float = 0.0,
        next_tokens: int = 0,
    ) -> ReplayResult:
        """Run until ``new``'s first token (the replay; see ``Replayer.replay``).

        With ``arrival > 0``, ``new`` joins the waiting queue before the first
        batch scheduled at or after that time (as fast-forward adds a dispatch),
        and an engine idle before it waits for it; otherwise the caller has
        queued it. Times count from the end of the batch in flight. With
        ``next_tokens``, on until ``new`` has sampled that many more tokens
        (never past its output length: an async engine's wasted token past an
        unannounced stop is no token).
        """
        depth = self.geo.depth
        k = 0
        t = 0.0
        work = 0
        self.watched = new
        self.watched_seen = False
        pending = arrival > 0.0
        want = min(1 + next_tokens, new.target - new.outputs)
        tk: list[int] = []
        tt: list[float] = []
        while True:
            if pending and t >= arrival:
                self.waiting.append(new)
                pending = False
            batch = self.schedule()
            # What this loop touches per batch: the running list and the batch.
            work += 1 + len(self.running) + len(batch.sched)
            if batch.sched:
                k += 1
                dt = self.account(batch)
                t += dt
                if new in batch.sampled:
                    tk.append(k)
                    tt.append(t)
                    if len(tk) >= want:
                        return self._result(tk, tt)
                if not tk and t > horizon:
                    return ReplayResult(0, t, StopReason.HORIZON, self._batches())
            elif all(q.inert() for q in self.queue):
                if tk:
                    # Preempted past its first token and never able to resume.
                    return self._result(tk, tt)
                if not pending:
                    # Nothing scheduled and nothing in flight that could free a
                    # seat or a block: the new request can never be served.
                    return ReplayResult(0, math.inf, StopReason.NEVER_ADMITTED, self._batches())
                # Idle until the new request arrives.
                t = arrival
                self.waiting.append(new)
                pending = False
            if (batch.sched and k >= max_batches) or work >= max_work:
                if tk:
                    return self._result(tk, tt)
                # The batches so far happen before the first token: their time
                # bounds the TTFT from below.
                return ReplayResult(0, t, StopReason.BATCH_LIMIT, self._batches())
            self.queue.append(batch)
            if len(self.queue) < depth:
                continue
            self.process(self.queue.popleft())

    def run_residents(self, max_batches: int, max_work: int) -> tuple[int, float]:
        """Run the requests held alone for up to ``max_batches`` batches (see
        ``Replayer.residents``): the batches run and their summed time."""
        depth = self.geo.depth
        k = 0
        t = 0.0
        work = 0
        while k < max_batches:
            batch = self.schedule()
            work += 1 + len(self.running) + len(batch.sched)
            if batch.sched:
                k += 1
                t += self.account(batch)
            elif all(q.inert() for q in self.queue):
                break  # run dry: nothing left that could form a batch
            if work >= max_work:
                break
            self.queue.append(batch)
            if len(self.queue) < depth:
                continue
            self.process(self.queue.popleft())
        return k, t

    def _result(self, tk: list[int], tt: list[float]) -> ReplayResult:
        return ReplayResult(
            tk[0],
            tt[0],
            StopReason.FIRST_TOKEN,
            self._batches(),
            token_batches=tuple(tk),
            token_times_s=tuple(tt),
        )

    def _batches(self) -> tuple[BatchRecord, ...] | None:
        return tuple(self.batches) if self.record else None

    # -- schedule -----------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Form the next batch (it may be empty)."""
        p = self.p
        b = ScheduledBatch()
        budget = p.token_budget
        cap = p.chunk_cap
        if cap and p.cap_exempt_when_alone and len(self.running) + len(self.waiting) <= 1:
            cap = 0
        for stage in p.stages:
            if stage == "waiting":
                if b.preempted and not p.admit_after_preemption:
                    continue
                budget = self.admit(b, budget, cap)
            else:
                budget = self.serve_running(b, budget, cap, stage)
            if p.exclusive and b.sched:
                break
        self.after_schedule(b)
        return b

    def _fits(self, b: ScheduledBatch, n: int) -> bool:
        """Padded budgets charge every sequence the longest chunk in the batch."""
        if self.p.budget_count != "padded":
            return True
        longest = max(max(b.sched.values(), default=0), n)
        return (len(b.sched) + 1) * longest <= self.p.token_budget

    def serve_running(self, b: ScheduledBatch, budget: int, cap: int, stage: str) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if (
                (stage == "decodes" and not r.prefilled)
                or (stage == "prefills" and r.prefilled)
                or r in b.sched
            ):
                # (a request admitted earlier in this batch is not served twice)
                i += 1
                continue
            if r.ph > 0 and r.outputs + r.ph >= r.limit:
                # Async: its last token is in flight; it keeps seat and blocks.
                i += 1
                continue
            n = r.num_tokens + r.ph - r.computed
            if 0 < cap < n:
                n = cap
            n = min(n, budget)
            if self.geo.max_model_len:
                n = min(n, self.geo.max_model_len - r.computed - 1)
            if n <= 0 or not self._fits(b, n):
                i += 1
                continue
            ok, budget = self.grow(b, r, n, budget)
            if not ok:
                break
            b.sched[r] = n
            budget -= n
            i += 1
        return budget

    def grow(self, b: ScheduledBatch, r: Req, n: int, budget: int) -> tuple[bool, int]:
        """Allocate the blocks ``r`` needs for ``n`` more tokens, preempting if needed.

        A victim already scheduled in this batch (by an earlier stage) gives its
        tokens back to the budget, as vLLM does. Returns (allocated, budget).
        """
        one_free = self.p.decode_needs_free_block and r.prefilled
        while True:
            need = max(cdiv(r.computed + n, self.geo.block_size) - r.blocks, 0)
            if self.unlimited or max(need, one_free) <= self.free:
                r.blocks += need
                if self.pool is not None:
                    c = cast(CachedReq, r)
                    if need:
                        # A new list: clones of a prepared state share the old one.
                        c.block_ids = c.block_ids + self.pool.allocate(need)
                        self.free = self.pool.num_free
                    if min(r.computed + n, r.num_tokens) // self.geo.block_size > c.cached_blocks:
                        self._cache(c, r.computed + n)
                elif not self.unlimited:
                    self.free -= need
                return True, budget
            if self.p.victim == "none":
                return False, budget
            victim = self.running.pop()
            if victim is not r:
                budget += b.sched.pop(victim, 0)
            self.preempt(victim)
            b.preempted.append(victim.rid)
            if victim is r:
                return False, budget

    def _free_blocks(self, r: Req) -> None:
        if self.pool is not None:
            c = cast(CachedReq, r)
            # Tail first, so that a request's last blocks are evicted first.
            self.pool.release(reversed(c.block_ids))
            c.block_ids = []
            c.cached_blocks = 0
            self.free = self.pool.num_free
        elif not self.unlimited:
            self.free += r.blocks
        r.blocks = 0

    def _keys(self, r: CachedReq, nblocks: int) -> list[int]:
        """``r``'s content keys for its first ``nblocks`` full blocks (extended as needed)."""
        keys = r.keys
        if len(keys) < nblocks:
            bs = self.geo.block_size
            if r.tokens is not None:
                keys = chain_keys(r.tokens[: min(nblocks * bs, r.num_tokens)], bs, keys)
            else:
                keys = list(keys)
            # Past its known ids a request's blocks hold content only it has.
            while len(keys) < nblocks:
                self._serial -= 1
                keys.append(self._serial)
            r.keys = keys
        return keys

    # Keys of content only one request has count down from here (content keys
    # are non-negative).
    _serial = 0

    def _cache(self, r: CachedReq, tokens: int) -> None:
        """Make ``r``'s full blocks up to ``tokens`` (capped at its known tokens) findable."""
        pool = self.pool
        assert pool is not None
        full = min(tokens, r.num_tokens) // self.geo.block_size
        if full > r.cached_blocks:
            keys = self._keys(r, full)
            if pool.events is not None:
                self._stored_events(r, keys, full)
            pool.cache(r.block_ids, keys, r.cached_blocks, full)
            r.cached_blocks = full

    def _stored_events(self, r: CachedReq, keys: list[int], full: int) -> None:
        """The ``stored`` KV event of the blocks about to become findable (vLLM's
        ``BlockStored``: its new full blocks, their parent, their tokens)."""
        assert self.pool is not None
        if r.tokens is None:
            return  # content the engine cannot name (a replayed resident's)
        pool, ids, bs = self.pool, r.block_ids, self.geo.block_size
        # Blocks with content keys (a negative key: tokens the scheduler was not given).
        new = [
            i for i in range(r.cached_blocks, full) if pool.key_of(ids[i]) is None and keys[i] >= 0
        ]
        if not new:
            return
        i0, i1 = new[0], new[-1] + 1
        pool.events.append(  # type: ignore[union-attr]
            ("stored", keys[i0 - 1] if i0 else None, keys[i0:i1], r.tokens[i0 * bs : i1 * bs])
        )

    def record_kv_events(self) -> None:
        """Keep vLLM's KV events from now on (:meth:`take_kv_events`; prefix caching only).

        ``("stored", parent key, keys, tokens)`` when full blocks become
        findable, ``("removed", key)`` when one is evicted, in the order they
        happen, as vLLM's ``BlockPool`` queues its ``BlockStored`` and
        ``BlockRemoved``; a content key stands for vLLM's block hash.
        """
        if self.pool is not None and self.pool.events is None:
            self.pool.events = []

    def take_kv_events(self) -> list[tuple[Any, ...]]:
        """The KV events since the last call (see :meth:`record_kv_events`)."""
        pool = self.pool
        if pool is None or not pool.events:
            return []
        got, pool.events = pool.events, []
        return got

    def preempt(self, r: Req) -> None:
        self._free_blocks(r)
        if self.pool is not None:
            cast(CachedReq, r).preemptions += 1
        r.computed = 0
        r.ph = 0
        r.prefilled = False
        r.status = WAITING
        if not self.p.keep_outputs:
            r.outputs = 0
        if self.p.requeue == "front":
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def admit(self, b: ScheduledBatch, budget: int, cap: int) -> int:
        p = self.p
        skipped: list[Req] = []
        while budget > 0 and self.waiting:
            if len(self.running) >= p.max_seqs:
                break
            r = self.waiting[0]
            if r is self.watched:
                self.watched_seen = True
            if r.inflight > 0:
                # Preempted with output still in flight: it cannot resume until
                # that output lands, but it does not block the queue.
                skipped.append(self.waiting.popleft())
                continue
            hit: list[int] = []
            if self.pool is not None:
                # The last token is always computed (its logits are needed).
                most = (r.num_tokens - 1) // self.geo.block_size
                hit = self.pool.lookup(self._keys(cast(CachedReq, r), most), most)
            n = r.num_tokens - len(hit) * self.geo.block_size
            if 0 < cap < n:
                n = cap
            blocked = (not p.chunked_prefill and n > budget) or not self._fits(b, min(n, budget))
            if not blocked:
                n = min(n, budget)
                blocked = not (
                    self.reserve(r, n)
                    if self.pool is None
                    else self.reserve_cached(cast(CachedReq, r), n, hit)
                )
            if blocked:
                if p.on_blocked == "stop":
                    break
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            r.status = RUNNING
            self.running.append(r)
            b.sched[r] = n
            b.admitted += 1
            budget -= n
        for r in reversed(skipped):
            self.waiting.appendleft(r)
        return budget

    def _watermark(self) -> int:
        """Blocks an admission must leave free."""
        applies = self.p.watermark_applies
        if applies == "always" or (applies == "while-running" and self.running):
            return self.geo.watermark_blocks
        return 0

    def _full_tokens(self, r: Req) -> int:
        """Tokens the whole-sequence admission check sizes."""
        mml = self.geo.max_model_len
        return r.num_tokens if not mml else min(r.num_tokens, mml)

    def reserve(self, r: Req, n: int) -> bool:
        """KV admission check and allocation for a waiting request's first chunk."""
        if self.unlimited:
            return True
        p = self.p
        bs = self.geo.block_size
        wm = self._watermark()
        if p.reserve_full_sequence:
            full = self._full_tokens(r)
            if cdiv(full, bs) + wm > self.free:
                return False
        need = max(cdiv(n, bs), cdiv(self.geo.reserve_tokens(r), bs))
        if need + wm > self.free:
            return False
        r.blocks = need
        self.free -= need
        return True

    def reserve_cached(self, r: CachedReq, n: int, hit: list[int]) -> bool:
        """:meth:`reserve` with prefix caching: ``hit`` blocks cost no compute.

        A hit block that sits in the free queue still uses up a free block (it
        leaves the queue); the whole-sequence check counts only the blocks
        past the hit.
        """
        pool = self.pool
        assert pool is not None
        p = self.p
        bs = self.geo.block_size
        wm = self._watermark()
        evictable = pool.evictable(hit)
        if p.reserve_full_sequence:
            full = self._full_tokens(r)
            if max(cdiv(full, bs) - len(hit), 0) + evictable + wm > self.free:
                return False
        hit_tokens = len(hit) * bs
        new = max(cdiv(hit_tokens + n, bs) - len(hit), 0)
        if new + evictable + wm > self.free:
            return False
        pool.touch(hit)
        r.block_ids = hit + pool.allocate(new)
        r.blocks = len(r.block_ids)
        r.cached_blocks = len(hit)
        r.computed = hit_tokens
        self.free = pool.num_free
        if r.preemptions:
            pool.preempted_queries += r.num_tokens
            pool.preempted_hits += hit_tokens
        else:
            pool.queries += r.num_tokens
            pool.hits += hit_tokens
        if r.cached_tokens < 0:
            r.cached_tokens = hit_tokens
        self._cache(r, hit_tokens + n)
        return True

    def after_schedule(self, b: ScheduledBatch) -> None:
        async_ = self.geo.depth > 1
        for r, n in b.sched.items():
            c = r.computed  # context before this batch
            if r.prefilled:
                b.dec += n
                b.dctx += c * n
            else:
                b.pre += n
                b.patt += n * c + n * (n + 1) // 2
            r.computed += n
            r.inflight += n
            if r.computed >= r.num_tokens + r.ph:
                # Not a partial chunk: this step samples a token for r.
                r.prefilled = True
                b.sampled.append(r)
                if async_:
                    r.ph += 1

    # -- process outputs ----------------------------------------------------

    def process(self, b: ScheduledBatch) -> StepOutput:
        """Apply a batch's outputs: deliver sampled tokens, finish requests."""
        out = StepOutput()
        async_ = self.geo.depth > 1
        bs = self.geo.block_size
        for r, n in b.sched.items():
            r.inflight -= n
        for r, n in b.carried.items():
            r.inflight -= n
        for r in b.sampled:
            if r.status == FINISHED:
                continue
            # The batch in flight at a snapshot carries all of a request's
            # placeholders (several with speculative decoding); later batches one.
            got = b.carried.get(r, 1)
            out.tokens.append(r.rid)
            if r.status == WAITING:
                # Preempted while its token was in flight: it still receives it.
                r.outputs += got
                if r.outputs >= r.target:
                    r.status = FINISHED
                    self.waiting.remove(r)
                    self.requests.pop(r.rid, None)
                    out.finished.append(r.rid)
                continue
            r.outputs += got
            if async_:
                r.ph -= got
                if self.pool is not None:
                    # The token just landed completes blocks that were computed
                    # while it was in flight: they become findable now.
                    c = cast(CachedReq, r)
                    if min(r.computed - r.inflight, r.num_tokens) // bs > c.cached_blocks:
                        self._cache(c, r.computed - r.inflight)
            if r.outputs >= r.target:
                r.status = FINISHED
                self._free_blocks(r)
                self.running.remove(r)
                self.requests.pop(r.rid, None)
                out.finished.append(r.rid)
        return out

    # -- eq. 12 --------------------------------------------------------------

    def set_coeffs(self, coeffs: Sequence[float]) -> None:
        """Take eq. 12's coefficients as the replay loops do: ``(b0, b1, b2, b3)``,
        then optionally ``tau`` and a decode token's own keys
        (:attr:`~bearsdk.estimators.batch_model.BatchTimeModel.replay_coeffs`)."""
        if not 4 <= len(coeffs) <= 6:
            raise ValueError(f"coeffs must hold 4 to 6 numbers (got {len(coeffs)})")
        self.b0, self.b1, self.b2, self.b3 = (float(c) for c in coeffs[:4])
        self.tau = float(coeffs[4]) if len(coeffs) > 4 else 0.0
        # b2 per decode token: the compiled loops add it as a term of its own,
        # so the twins sum in the same order and agree to the bit.
        self.b2s = self.b2 * float(coeffs[5]) if len(coeffs) > 5 else 0.0

    def account(self, b: ScheduledBatch) -> float:
        dt = (
            self.b0
            + self.b1 * max(float(b.pre + b.dec), self.tau)
            + self.b2 * b.dctx
            + self.b2s * b.dec
            + self.b3 * b.patt
        )
        if self.record:
            self.batches.append(
                BatchRecord(
                    num_seqs=len(b.sched),
                    prefill_tokens=b.pre,
                    decode_tokens=b.dec,
                    decode_context=b.dctx,
                    prefill_attention=b.patt,
                    admitted=b.admitted,
                    preempted=len(b.preempted),
                    duration_s=dt,
                    tokens_by_request=tuple((r.rid, n) for r, n in b.sched.items()),
                )
            )
        return dt

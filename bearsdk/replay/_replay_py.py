"""Pure-Python replay of batch formation: the readable reference and test oracle.

This module interprets a bound :class:`~bearsdk.schedulers.Policy` one request at
a time, the way an engine's scheduler does it. ``cext/_replay_c.pyx`` implements
the same contract at C speed (aggregating plain decodes); property tests require
both to produce identical batch sequences, and the vLLM differential harness
checks this module step by step against vLLM's own scheduler.

The engine loop mirrors vLLM's ``EngineCore``: in synchronous mode a batch's
outputs are processed before the next batch is scheduled; with asynchronous
scheduling one batch is always in flight, so a batch is scheduled before the
outputs of the previous one are known (placeholders stand for its tokens).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from bearsdk.replay.types import (
    MAX_REPLAY_WORK_PY,
    MAX_TOKENS,
    BatchRecord,
    ReplayResult,
    StopReason,
    check_policy,
    check_running,
    check_table,
    check_tokens,
)
from bearsdk.snapshot import (
    COL_COMPUTED,
    COL_MAX_TOKENS,
    COL_OUTPUT,
    COL_OUTPUT_LEN,
    COL_PLACEHOLDERS,
    COL_PROMPT,
    COL_STATE,
    NCOLS,
    STATE_RUNNING,
)

if TYPE_CHECKING:
    # Typing only: the scheduler package compiles specs for the replay, not
    # the reverse.
    from bearsdk.schedulers.spec import Policy

__all__ = [
    "IMPLEMENTATION",
    "Prepared",
    "Replayer",
    "ScheduledBatch",
    "SchedulerCore",
    "StepOutput",
]

IMPLEMENTATION = "python"

_RUNNING, _WAITING, _FINISHED = 0, 1, 2
NEW_REQUEST_ID = "<new>"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Req:
    """Mutable per-request state during a replay."""

    __slots__ = (
        "blocks",
        "computed",
        "inflight",
        "limit",
        "outputs",
        "ph",
        "prefilled",
        "prompt",
        "rid",
        "status",
        "target",
    )

    def __init__(self, rid: str, prompt: int, outputs: int, target: int, limit: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.outputs = outputs  # output tokens delivered so far
        self.target = target  # output tokens at which the request finishes
        self.limit = limit  # output count the scheduler knows it stops at (max_tokens, context)
        self.computed = 0
        self.ph = 0  # async placeholders: sampled tokens in flight
        self.inflight = 0  # scheduled tokens whose batch is not processed yet
        self.blocks = 0
        self.status = _WAITING
        self.prefilled = False  # prompt (or recompute) complete since last admission

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.outputs

    def clone(self) -> _Req:
        c = _Req.__new__(_Req)
        for slot in _Req.__slots__:
            setattr(c, slot, getattr(self, slot))
        return c


class Prepared:
    """A snapshot's requests, ready to replay (built once, replayed many times)."""

    __slots__ = ("free_blocks", "has_inflight", "reqs", "unlimited_kv")

    def __init__(
        self, reqs: list[_Req], free_blocks: int, unlimited_kv: bool, has_inflight: bool
    ) -> None:
        self.reqs = reqs
        self.free_blocks = free_blocks
        self.unlimited_kv = unlimited_kv
        self.has_inflight = has_inflight

    def __len__(self) -> int:
        return len(self.reqs)


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
        self.sched: dict[_Req, int] = {}
        # the batch in flight at a snapshot: tokens it carries per request
        self.carried: dict[_Req, int] = {}
        self.sampled: list[_Req] = []
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


class Replayer:
    """Replays a policy's batch formation from a prepared snapshot.

    Args:
        policy: The bound policy to interpret.
    """

    implementation = IMPLEMENTATION

    def __init__(self, policy: Policy) -> None:
        check_policy(policy)
        self.policy = policy
        p = policy
        self._bs = p.block_size
        self._mml = p.max_model_len
        self._wm_blocks = p.watermark_blocks
        self._depth = 2 if p.async_scheduling else 1

    # -- preparation -------------------------------------------------------

    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
    ) -> Prepared:
        """Turn a snapshot table (output lengths resolved) into replay state.

        Args:
            table: ``int64`` rows in scheduling order (``bearsdk.snapshot.COLUMNS``);
                every ``output_len`` must be set (``>= 1``).
            free_blocks: Free KV blocks the engine reported; ``-1`` to derive them
                from the policy's pool size and the running requests' blocks.
            ids: Request ids (for step-by-step records); defaults to row numbers.

        Returns:
            Replay-ready state.

        Raises:
            ValueError: An output length is missing or the table is malformed.
        """
        tab = np.asarray(table, dtype=np.int64)
        if tab.ndim != 2 or tab.shape[1] != NCOLS:
            raise ValueError(f"table must have shape (n, {NCOLS}) (got {tab.shape})")
        check_table(tab)
        check_running(self.policy, int(np.count_nonzero(tab[:, COL_STATE] == STATE_RUNNING)))
        reqs: list[_Req] = []
        held = freed = 0
        has_inflight = False
        for i, row in enumerate(tab.tolist()):
            rid = ids[i] if ids is not None else f"#{i}"
            if row[COL_OUTPUT_LEN] < 1:
                got = row[COL_OUTPUT_LEN]
                raise ValueError(f"row {i}: output_len must be resolved before replay (got {got})")
            r = self._make_req(
                rid, row[COL_PROMPT], row[COL_OUTPUT], row[COL_OUTPUT_LEN], row[COL_MAX_TOKENS]
            )
            if row[COL_STATE] == STATE_RUNNING:
                r.status = _RUNNING
                r.computed = row[COL_COMPUTED]
                r.ph = row[COL_PLACEHOLDERS]
                need = r.num_tokens + r.ph - r.computed
                r.prefilled = r.outputs + r.ph >= 1 and need <= 1
                r.blocks = self._held_blocks(r)
                held += r.blocks
                if r.ph and self._depth == 1:
                    # A synchronous engine has processed its outputs before it
                    # schedules again: fold any placeholder into the outputs.
                    r.outputs += r.ph
                    r.ph = 0
                    if r.outputs >= r.target:
                        freed += r.blocks
                        continue
                has_inflight = has_inflight or r.ph > 0
            reqs.append(r)
        p = self.policy
        unlimited = p.num_blocks == 0 and free_blocks < 0
        if free_blocks < 0:
            free_blocks = 0 if unlimited else p.num_blocks - p.reserved_blocks - held
            if free_blocks < 0:
                raise ValueError(
                    f"running requests hold {held} KV blocks, more than the pool of {p.num_blocks} "
                    f"minus {p.reserved_blocks} reserved"
                )
        else:
            free_blocks += freed
        return Prepared(reqs, free_blocks, unlimited, has_inflight)

    def _make_req(
        self, rid: str, prompt: int, outputs: int, output_len: int, max_tokens: int
    ) -> _Req:
        limit = max_tokens if max_tokens > 0 else 1 << 62
        if self._mml > 0:
            limit = min(limit, self._mml - prompt)
        target = max(min(output_len, limit), outputs + 1)
        return _Req(rid, prompt, outputs, target, limit)

    def _reserve_tokens(self, r: _Req) -> int:
        """Tokens whose blocks an admission reserves, by allocation mode."""
        alloc = self.policy.allocate
        if alloc == "prompt":
            return r.num_tokens
        if alloc == "max-length":
            return r.prompt + r.limit  # limit <= max_model_len - prompt (validated)
        return 0

    def _held_blocks(self, r: _Req) -> int:
        """Blocks a running request holds, from its counts (snapshots do not list them).

        Whole-prompt allocation holds the (re)compute length until the prompt is
        done; max-length allocation holds its reservation throughout.
        """
        held = _cdiv(r.computed, self._bs)
        alloc = self.policy.allocate
        if alloc == "max-length" or (alloc == "prompt" and not r.prefilled):
            held = max(held, _cdiv(self._reserve_tokens(r), self._bs))
        return held

    # -- replay ------------------------------------------------------------

    def ttft(
        self,
        prepared: Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
    ) -> float:
        """Return only the predicted time to first token (``inf`` when never)."""
        return self.replay(
            prepared, prompt_tokens, output_len, coeffs, max_tokens=max_tokens
        ).ttft_s

    def replay(
        self,
        prepared: Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        record: bool = False,
        max_batches: int = 1_000_000,
        max_tokens: int = -1,
        max_work: int | None = None,
    ) -> ReplayResult:
        """Replay batch formation until the new request's first token.

        Args:
            prepared: State from :meth:`prepare` (not modified).
            prompt_tokens: The new request's prompt length.
            output_len: Its (predicted) output length.
            coeffs: Eq. 12 coefficients ``(b0, b1, b2, b3)`` in seconds, optionally
                followed by the richer dense term's floor ``tau`` (tokens): the dense
                part then costs ``b1 * max(tokens, tau)``.
            record: Return the simulated batches.
            max_batches: Give up after this many batches.
            max_tokens: The new request's output cap (``-1``: none).
            max_work: Give up after this much work: one unit per batch and per
                request in it or in the running list (default
                :data:`~bearsdk.replay.types.MAX_REPLAY_WORK_PY`).

        Returns:
            The first-token batch, the summed batch times, and optionally the
            batches. A replay that gives up returns
            :attr:`~bearsdk.replay.types.StopReason.BATCH_LIMIT` with the time of
            the batches replayed: a lower bound of the TTFT.
        """
        prompt_tokens = check_tokens(prompt_tokens, "prompt_tokens", 1)
        output_len = check_tokens(output_len, "output_len", -MAX_TOKENS)
        max_tokens = check_tokens(max_tokens, "max_tokens", -MAX_TOKENS)
        max_batches = check_tokens(max_batches, "max_batches", -MAX_TOKENS)
        work = MAX_REPLAY_WORK_PY if max_work is None else max_work
        work = check_tokens(work, "max_work", -MAX_TOKENS)
        run = SchedulerCore._from_prepared(self, prepared, record, coeffs)
        new = self._make_req(NEW_REQUEST_ID, prompt_tokens, 0, max(output_len, 1), max_tokens)
        run.waiting.append(new)
        return run.go(new, max_batches, work)


class SchedulerCore:
    """A policy's scheduler as a live engine core, in pure Python.

    Requests arrive (:meth:`add_request`), :meth:`schedule` forms the next batch
    and :meth:`process` applies its outputs. The caller owns the pipeline: a
    synchronous engine processes a batch before scheduling the next; an engine
    with asynchronous scheduling schedules batch ``k + 1`` before it processes
    batch ``k``. The replay drives it in zero time; the emulated engine and the
    simulator drive it in real or virtual time.

    Args:
        policy: The bound policy (its KV geometry is the engine's).
        free_blocks: Free KV blocks at start; default: the policy's pool less
            reserved blocks (unlimited when the policy has no pool size).
    """

    def __init__(self, policy: Policy, free_blocks: int | None = None) -> None:
        self.rp = Replayer(policy)
        self.p = policy
        self.running: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.requests: dict[str, _Req] = {}
        self.unlimited = policy.num_blocks == 0 and free_blocks is None
        if free_blocks is None:
            free_blocks = 0 if self.unlimited else policy.num_blocks - policy.reserved_blocks
        self.free = free_blocks
        self.record = False
        self.b0 = self.b1 = self.b2 = self.b3 = self.tau = 0.0
        self.batches: list[BatchRecord] = []
        self.queue: deque[ScheduledBatch] = deque()

    @classmethod
    def _from_prepared(
        cls, rp: Replayer, prepared: Prepared, record: bool, coeffs: Sequence[float]
    ) -> SchedulerCore:
        core = cls.__new__(cls)
        core.rp = rp
        core.p = rp.policy
        core.running = []
        core.waiting = deque()
        core.requests = {}
        for r in prepared.reqs:
            c = r.clone()
            (core.running if c.status == _RUNNING else core.waiting).append(c)
        core.free = prepared.free_blocks
        core.unlimited = prepared.unlimited_kv
        core.record = record
        core.b0, core.b1, core.b2, core.b3 = (float(c) for c in coeffs[:4])
        core.tau = float(coeffs[4]) if len(coeffs) > 4 else 0.0
        core.batches = []
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
        self, rid: str, prompt_tokens: int, output_len: int, max_tokens: int | None = None
    ) -> None:
        """A request arrives at the end of the waiting queue.

        Args:
            rid: Unique id.
            prompt_tokens: Prompt length.
            output_len: Output tokens it will produce (its true length).
            max_tokens: Its cap, known to the scheduler (``None``: none).

        Raises:
            ValueError: Duplicate id or a bad length.
        """
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already resident")
        if prompt_tokens < 1 or output_len < 1:
            raise ValueError(
                f"prompt_tokens and output_len must be >= 1 (got {prompt_tokens}, {output_len})"
            )
        r = self.rp._make_req(
            rid, prompt_tokens, 0, output_len, -1 if max_tokens is None else max_tokens
        )
        self.requests[rid] = r
        self.waiting.append(r)

    def abort_request(self, rid: str) -> bool:
        """Remove a resident request (freeing its blocks); ``False`` if unknown."""
        r = self.requests.pop(rid, None)
        if r is None or r.status == _FINISHED:
            return False
        if r.status == _RUNNING:
            self.running.remove(r)
            if not self.unlimited:
                self.free += r.blocks
            r.blocks = 0
        else:
            self.waiting.remove(r)
        r.status = _FINISHED
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
        return doc

    def _snap_req(self, r: _Req, state: str, with_len: bool) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": r.rid,
            "state": state,
            "prompt_tokens": r.prompt,
            "computed_tokens": r.computed if state == "running" else 0,
            "output_tokens": r.outputs,
        }
        if r.limit < (1 << 61) and not (self.rp._mml and r.limit == self.rp._mml - r.prompt):
            d["max_tokens"] = r.limit
        if with_len:
            d["output_len"] = r.target
        if r.ph and state == "running":
            d["placeholders"] = r.ph
        return d

    # -- engine loop --------------------------------------------------------

    def go(self, new: _Req, max_batches: int, max_work: int) -> ReplayResult:
        depth = self.rp._depth
        k = 0
        t = 0.0
        work = 0
        while True:
            batch = self.schedule()
            # What this loop touches per batch: the running list and the batch.
            work += 1 + len(self.running) + len(batch.sched)
            if batch.sched:
                k += 1
                dt = self.account(batch)
                t += dt
                if new in batch.sampled:
                    return ReplayResult(k, t, StopReason.FIRST_TOKEN, self._batches())
            elif all(q.inert() for q in self.queue):
                # Nothing scheduled and nothing in flight that could free a seat
                # or a block: the new request can never be served.
                return ReplayResult(0, math.inf, StopReason.NEVER_ADMITTED, self._batches())
            if (batch.sched and k >= max_batches) or work >= max_work:
                # The batches so far happen before the first token: their time
                # bounds the TTFT from below.
                return ReplayResult(0, t, StopReason.BATCH_LIMIT, self._batches())
            self.queue.append(batch)
            if len(self.queue) < depth:
                continue
            self.process(self.queue.popleft())

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
            if self.rp._mml:
                n = min(n, self.rp._mml - r.computed - 1)
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

    def grow(self, b: ScheduledBatch, r: _Req, n: int, budget: int) -> tuple[bool, int]:
        """Allocate the blocks ``r`` needs for ``n`` more tokens, preempting if needed.

        A victim already scheduled in this batch (by an earlier stage) gives its
        tokens back to the budget, as vLLM does. Returns (allocated, budget).
        """
        one_free = self.p.decode_needs_free_block and r.prefilled
        while True:
            need = max(_cdiv(r.computed + n, self.rp._bs) - r.blocks, 0)
            if self.unlimited or max(need, one_free) <= self.free:
                r.blocks += need
                if not self.unlimited:
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

    def preempt(self, r: _Req) -> None:
        if not self.unlimited:
            self.free += r.blocks
        r.blocks = 0
        r.computed = 0
        r.ph = 0
        r.prefilled = False
        r.status = _WAITING
        if not self.p.keep_outputs:
            r.outputs = 0
        if self.p.requeue == "front":
            self.waiting.appendleft(r)
        else:
            self.waiting.append(r)

    def admit(self, b: ScheduledBatch, budget: int, cap: int) -> int:
        p = self.p
        skipped: list[_Req] = []
        while budget > 0 and self.waiting:
            if len(self.running) >= p.max_seqs:
                break
            r = self.waiting[0]
            if r.inflight > 0:
                # Preempted with output still in flight: it cannot resume until
                # that output lands, but it does not block the queue.
                skipped.append(self.waiting.popleft())
                continue
            n = r.num_tokens
            if 0 < cap < n:
                n = cap
            blocked = (not p.chunked_prefill and n > budget) or not self._fits(b, min(n, budget))
            if not blocked:
                n = min(n, budget)
                blocked = not self.reserve(r, n)
            if blocked:
                if p.on_blocked == "stop":
                    break
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            r.status = _RUNNING
            self.running.append(r)
            b.sched[r] = n
            b.admitted += 1
            budget -= n
        for r in reversed(skipped):
            self.waiting.appendleft(r)
        return budget

    def reserve(self, r: _Req, n: int) -> bool:
        """KV admission check and allocation for a waiting request's first chunk."""
        if self.unlimited:
            return True
        p = self.p
        bs = self.rp._bs
        applies = p.watermark_applies
        wm = (
            self.rp._wm_blocks
            if applies == "always" or (applies == "while-running" and self.running)
            else 0
        )
        if p.reserve_full_sequence:
            full = r.num_tokens if not self.rp._mml else min(r.num_tokens, self.rp._mml)
            if _cdiv(full, bs) + wm > self.free:
                return False
        need = max(_cdiv(n, bs), _cdiv(self.rp._reserve_tokens(r), bs))
        if need + wm > self.free:
            return False
        r.blocks = need
        self.free -= need
        return True

    def after_schedule(self, b: ScheduledBatch) -> None:
        async_ = self.rp._depth > 1
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
        async_ = self.rp._depth > 1
        for r, n in b.sched.items():
            r.inflight -= n
        for r, n in b.carried.items():
            r.inflight -= n
        for r in b.sampled:
            if r.status == _FINISHED:
                continue
            # The batch in flight at a snapshot carries all of a request's
            # placeholders (several with speculative decoding); later batches one.
            got = b.carried.get(r, 1)
            out.tokens.append(r.rid)
            if r.status == _WAITING:
                # Preempted while its token was in flight: it still receives it.
                r.outputs += got
                if r.outputs >= r.target:
                    r.status = _FINISHED
                    self.waiting.remove(r)
                    self.requests.pop(r.rid, None)
                    out.finished.append(r.rid)
                continue
            r.outputs += got
            if async_:
                r.ph -= got
            if r.outputs >= r.target:
                r.status = _FINISHED
                if not self.unlimited:
                    self.free += r.blocks
                r.blocks = 0
                self.running.remove(r)
                self.requests.pop(r.rid, None)
                out.finished.append(r.rid)
        return out

    # -- eq. 12 --------------------------------------------------------------

    def account(self, b: ScheduledBatch) -> float:
        dt = (
            self.b0
            + self.b1 * max(float(b.pre + b.dec), self.tau)
            + self.b2 * b.dctx
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

"""Request state and KV geometry shared by the live scheduler and the replay twin.

:class:`~bearsdk.replay.scheduler.SchedulerCore` keeps one :class:`Req` per
resident request and asks :class:`PolicyGeometry` how a bound policy counts
blocks and caps outputs. The pure-Python replay (``_replay_py``) turns a
snapshot table into :class:`Prepared` state with :meth:`PolicyGeometry.prepare`
and runs the scheduler from it; the simulator, the emulator and fast-forward
run the same scheduler live. Nothing here is twinned: the compiled loop has its
own representation of all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, cast

import numpy as np
import numpy.typing as npt

from bearsdk.errors import short_repr
from bearsdk.replay.blocks import KEY_MASK
from bearsdk.replay.prefix import restore
from bearsdk.replay.types import check_policy, check_running, check_table
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
    from bearsdk.prefix_cache import PrefixCacheState
    from bearsdk.replay.blocks import BlockPool
    from bearsdk.schedulers.spec import Policy

__all__ = [
    "FINISHED",
    "NEW_REQUEST_ID",
    "RUNNING",
    "WAITING",
    "CachedReq",
    "PolicyGeometry",
    "Prepared",
    "Req",
    "cdiv",
]

RUNNING: Final = 0
WAITING: Final = 1
FINISHED: Final = 2
NEW_REQUEST_ID: Final = "<new>"
"""The id a replay gives the request it predicts for."""

UNCAPPED: Final = 1 << 62
"""The output limit of a request with neither ``max_tokens`` nor a context cap."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class Req:
    """Mutable per-request state inside a scheduler."""

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
        self.status = WAITING
        self.prefilled = False  # prompt (or recompute) complete since last admission

    @property
    def num_tokens(self) -> int:
        return self.prompt + self.outputs

    def clone(self) -> Req:
        c = Req.__new__(Req)
        for slot in Req.__slots__:
            setattr(c, slot, getattr(self, slot))
        return c


class CachedReq(Req):
    """A request in a prefix-caching scheduler: :class:`Req` plus its blocks' identities.

    A subclass, so that schedulers without a prefix cache pay nothing for it.
    The lists are replaced, never changed in place.

    Attributes:
        block_ids: Blocks held, first to last.
        cached_blocks: How many of them are findable by content.
        keys: Content keys of its full blocks known so far.
        tokens: The token ids the keys come from (prompt, then outputs), if known.
        cached_tokens: The prefix hit of its first admission (``-1``: not admitted).
        preemptions: Times it was preempted.
    """

    __slots__ = ("block_ids", "cached_blocks", "cached_tokens", "keys", "preemptions", "tokens")

    def __init__(self, rid: str, prompt: int, outputs: int, target: int, limit: int) -> None:
        super().__init__(rid, prompt, outputs, target, limit)
        self.block_ids: list[int] = []
        self.cached_blocks = 0
        self.keys: list[int] = []
        self.tokens: Sequence[int] | None = None
        self.cached_tokens = -1
        self.preemptions = 0

    def clone(self) -> CachedReq:
        c = CachedReq.__new__(CachedReq)
        for slot in _CACHED_SLOTS:
            setattr(c, slot, getattr(self, slot))
        return c


_CACHED_SLOTS: Final = Req.__slots__ + CachedReq.__slots__


def content_key(k: object, i: int) -> int:
    """``prefix_keys[i]``, checked: exactly an int in ``[0, 2**63)``."""
    if type(k) is not int or not 0 <= k <= KEY_MASK:
        raise ValueError(f"prefix_keys[{i}] must be an integer in [0, 2**63) (got {short_repr(k)})")
    return k


class Prepared:
    """A snapshot's requests, ready to run (built once, replayed many times).

    ``pool`` is the rebuilt block pool of a snapshot with ``kv.prefix_cache``
    replayed by a prefix-caching policy (its requests are then
    :class:`CachedReq`), else ``None``.
    """

    __slots__ = ("free_blocks", "has_inflight", "pool", "reqs", "unlimited_kv")

    def __init__(
        self,
        reqs: list[Req],
        free_blocks: int,
        unlimited_kv: bool,
        has_inflight: bool,
        pool: BlockPool | None = None,
    ) -> None:
        self.reqs = reqs
        self.free_blocks = free_blocks
        self.unlimited_kv = unlimited_kv
        self.has_inflight = has_inflight
        self.pool = pool

    def __len__(self) -> int:
        return len(self.reqs)

    def hit_blocks(self, keys: Sequence[int]) -> int:
        """How many of a chain of content keys, from the start, the pool holds cached.

        What an admission at the snapshot would hit (no block limit); ``0``
        without a pool.
        """
        ks = [content_key(k, i) for i, k in enumerate(keys)]
        return 0 if self.pool is None else len(self.pool.lookup(ks, len(ks)))


class PolicyGeometry:
    """How a bound policy sizes requests: KV blocks, output caps, pipeline depth.

    Args:
        policy: The bound policy.

    Raises:
        ValueError: A policy number neither replay implementation accepts.
    """

    __slots__ = ("block_size", "depth", "max_model_len", "policy", "watermark_blocks")

    def __init__(self, policy: Policy) -> None:
        check_policy(policy)
        self.policy = policy
        self.block_size = policy.block_size
        self.max_model_len = policy.max_model_len
        self.watermark_blocks = policy.watermark_blocks
        self.depth = 2 if policy.async_scheduling else 1

    def make_req(
        self,
        rid: str,
        prompt: int,
        outputs: int,
        output_len: int,
        max_tokens: int,
        cls: type[Req] = Req,
    ) -> Req:
        """A request's state with its output limit and target resolved."""
        limit = max_tokens if max_tokens > 0 else UNCAPPED
        if self.max_model_len > 0:
            limit = min(limit, self.max_model_len - prompt)
        target = max(min(output_len, limit), outputs + 1)
        return cls(rid, prompt, outputs, target, limit)

    def reserve_tokens(self, r: Req) -> int:
        """Tokens whose blocks an admission reserves, by allocation mode."""
        alloc = self.policy.allocate
        if alloc == "prompt":
            return r.num_tokens
        if alloc == "max-length":
            return r.prompt + r.limit  # limit <= max_model_len - prompt (validated)
        return 0

    def held_blocks(self, r: Req) -> int:
        """Blocks a running request holds, from its counts (snapshots do not list them).

        Whole-prompt allocation holds the (re)compute length until the prompt is
        done; max-length allocation holds its reservation throughout.
        """
        held = cdiv(r.computed, self.block_size)
        alloc = self.policy.allocate
        if alloc == "max-length" or (alloc == "prompt" and not r.prefilled):
            held = max(held, cdiv(self.reserve_tokens(r), self.block_size))
        return held

    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
        cache: PrefixCacheState | None = None,
    ) -> Prepared:
        """Turn a snapshot table (output lengths resolved) into scheduler state.

        Args:
            table: ``int64`` rows in scheduling order (``bearsdk.snapshot.COLUMNS``);
                every ``output_len`` must be set (``>= 1``).
            free_blocks: Free KV blocks the engine reported; ``-1`` to derive them
                from the policy's pool size and the running requests' blocks.
            ids: Request ids (for step-by-step records); defaults to row numbers.
            cache: The snapshot's ``kv.prefix_cache`` (validated with the same
                table); a prefix-caching policy then replays block by block, and
                the blocks it names replace the counts.

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
        reqs: list[Req] = []
        held = freed = 0
        has_inflight = False
        restored = None
        if cache is not None and self.policy.prefix_caching:
            if len(cache.blocks) != len(tab):
                raise ValueError(
                    f"cache describes {len(cache.blocks)} requests, the table {len(tab)}"
                )
            restored = restore(cache)
        for i, row in enumerate(tab.tolist()):
            rid = ids[i] if ids is not None else f"#{i}"
            if row[COL_OUTPUT_LEN] < 1:
                got = row[COL_OUTPUT_LEN]
                raise ValueError(f"row {i}: output_len must be resolved before replay (got {got})")
            r = self.make_req(
                rid,
                row[COL_PROMPT],
                row[COL_OUTPUT],
                row[COL_OUTPUT_LEN],
                row[COL_MAX_TOKENS],
                Req if restored is None else CachedReq,
            )
            if restored is not None:
                c = cast(CachedReq, r)
                c.block_ids = restored.block_ids[i]
                c.cached_blocks = restored.cached[i]
                c.keys = restored.keys[i]
                # Stats only: a waiting request with outputs was preempted.
                c.preemptions = int(row[COL_STATE] != STATE_RUNNING and r.outputs > 0)
            if row[COL_STATE] == STATE_RUNNING:
                r.status = RUNNING
                r.computed = row[COL_COMPUTED]
                r.ph = row[COL_PLACEHOLDERS]
                need = r.num_tokens + r.ph - r.computed
                r.prefilled = r.outputs + r.ph >= 1 and need <= 1
                r.blocks = self.held_blocks(r) if restored is None else len(restored.block_ids[i])
                held += r.blocks
                if r.ph and self.depth == 1:
                    # A synchronous engine has processed its outputs before it
                    # schedules again: fold any placeholder into the outputs.
                    r.outputs += r.ph
                    r.ph = 0
                    if r.outputs >= r.target:
                        freed += r.blocks
                        if restored is not None:
                            restored.pool.release(reversed(restored.block_ids[i]))
                        continue
                has_inflight = has_inflight or r.ph > 0
            reqs.append(r)
        if restored is not None:
            pool = restored.pool
            return Prepared(reqs, pool.num_free, False, has_inflight, pool)
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

"""The dispatch overlay: what this router sent to an instance that its snapshot cannot show yet.

A snapshot is a picture of the past. Requests this router dispatched after it
was captured (or just before, still in transit) are missing from it, so two
back-to-back routing decisions between two snapshots would not see each other
and would pile onto the same instance. The overlay remembers each dispatch, in
order, and the view the estimator replays from adds them as waiting requests
(or, when fast-forwarding, as arrivals at their dispatch times) until a
snapshot shows them, the router sees them complete, or they expire.

Engines may not use the router's request id verbatim (vLLM prefixes and
suffixes it, e.g. ``cmpl-<id>-0``); with ``match_substring`` a snapshot id that
contains the router's id counts as showing it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.snapshot import (
    MAX_REQUESTS,
    NCOLS,
    STATE_RUNNING,
    STATE_WAITING,
    KVState,
    Snapshot,
)

__all__ = ["Dispatch", "DispatchOverlay"]


def _non_negative(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{att.name} must be a number >= 0 (got {value!r})")


@attrs.frozen
class Dispatch:
    """One request this router sent to the instance.

    Attributes:
        rid: The router's request id.
        time: Dispatch time (the cache's clock).
        prompt_tokens: Prompt length.
        output_len: Known or predicted output length (``None``: the estimator predicts).
        max_tokens: The request's output cap, if any.
        prefix_keys: Its prompt's full-block keys as the instance's snapshots
            name blocks (with a prefix-caching engine): a view that adds it
            lets it hit what is cached, as the engine will.
    """

    rid: str
    time: float
    prompt_tokens: int
    output_len: int | None = None
    max_tokens: int | None = None
    outputs: int = 0
    prefix_keys: tuple[int, ...] = ()

    @property
    def started(self) -> bool:
        """The router has seen its first token: it runs, its prompt is computed."""
        return self.outputs > 0

    def row(self) -> list[int]:
        """The request as a row of a snapshot table (running once started, else waiting)."""
        cap = -1 if self.max_tokens is None else self.max_tokens
        out = -1 if self.output_len is None else self.output_len
        if cap > 0 and out > cap:
            out = cap
        if not self.started:
            return [STATE_WAITING, self.prompt_tokens, 0, 0, cap, out, 0]
        done = self.outputs
        if cap > 0:
            done = min(done, cap - 1)
        if 0 < out <= done:
            out = done + 1
        # The last streamed token is sampled, not yet computed.
        return [STATE_RUNNING, self.prompt_tokens, self.prompt_tokens + done - 1, done, cap, out, 0]


# Validators run at init only: a hook on every private-state write costs
# microseconds per snapshot.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class DispatchOverlay:
    """Dispatches not yet visible in the instance's snapshots.

    Args:
        grace_s: A dispatch counts as not yet visible when it happened after the
            snapshot's capture less this margin (transit to the engine and its
            intake delay); older unseen dispatches are assumed served already.
        expire_s: Unseen dispatches older than this (relative to the newest
            snapshot's capture) are forgotten (finished unseen, or ids that never match).
        match_substring: A snapshot id containing the router's id shows it.
        max_pending: At most this many unseen dispatches are kept; beyond it the
            oldest is forgotten (counted as expired). Other replicas' events come
            from the bus, so a flood of forged ones must not grow the router
            without bound; the default is the most requests a snapshot may hold.
    """

    grace_s: float = attrs.field(default=0.05, validator=_non_negative)
    expire_s: float = attrs.field(default=30.0, validator=_non_negative)
    match_substring: bool = True
    max_pending: int = attrs.field(default=MAX_REQUESTS, validator=attrs.validators.ge(1))
    _pending: dict[str, Dispatch] = attrs.field(init=False, factory=dict)
    _version: int = attrs.field(init=False, default=0)
    _shown: int = attrs.field(init=False, default=0)
    _expired: int = attrs.field(init=False, default=0)

    @property
    def version(self) -> int:
        """Changes whenever the set of pending dispatches changes."""
        return self._version

    def __contains__(self, rid: object) -> bool:
        return rid in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[Dispatch]:
        return iter(self._pending.values())

    @property
    def shown(self) -> int:
        """Dispatches a snapshot has shown so far."""
        return self._shown

    @property
    def expired(self) -> int:
        """Dispatches forgotten unseen so far."""
        return self._expired

    def add(self, dispatch: Dispatch) -> None:
        """Record a dispatch (call it when the request is sent).

        Raises:
            ValueError: The id is already pending, or a length is not positive.
        """
        if dispatch.rid in self._pending:
            raise ValueError(f"request id {dispatch.rid!r} is already pending")
        for name in ("prompt_tokens", "output_len", "max_tokens"):
            v = getattr(dispatch, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
        if len(self._pending) >= self.max_pending:
            # Dicts keep insertion order: the first key is the oldest dispatch.
            del self._pending[next(iter(self._pending))]
            self._expired += 1
        self._pending[dispatch.rid] = dispatch
        self._version += 1

    def progress(self, rid: str, outputs: int) -> bool:
        """The router has received ``outputs`` tokens of ``rid`` (its first token and on).

        A started dispatch joins the view as a running request with its prompt
        computed, instead of a waiting one; ``False`` if ``rid`` is not pending.
        """
        d = self._pending.get(rid)
        if d is None or outputs <= d.outputs:
            return False
        self._pending[rid] = attrs.evolve(d, outputs=outputs)
        self._version += 1
        return True

    def discard(self, rid: str) -> bool:
        """Forget a dispatch (the router saw it finish or fail); ``False`` if not pending."""
        if self._pending.pop(rid, None) is None:
            return False
        self._version += 1
        return True

    def reconcile(self, snapshot: Snapshot, captured: float) -> None:
        """Drop the dispatches ``snapshot`` shows, and those expired at its capture.

        Args:
            snapshot: A newly accepted snapshot.
            captured: Its capture time on the overlay's clock.
        """
        if not self._pending:
            return
        ids = set(snapshot.ids)
        gone = []
        for rid, d in self._pending.items():
            if rid in ids or (self.match_substring and any(rid in e for e in snapshot.ids)):
                gone.append(rid)
                self._shown += 1
            elif d.time < captured - self.expire_s:
                gone.append(rid)
                self._expired += 1
        for rid in gone:
            del self._pending[rid]
        if gone:
            self._version += 1

    def unseen(self, captured: float) -> list[Dispatch]:
        """Pending dispatches a snapshot captured at ``captured`` cannot show, in dispatch order."""
        edge = captured - self.grace_s
        return [d for d in self._pending.values() if d.time >= edge]

    @staticmethod
    def apply(
        snapshot: Snapshot, dispatches: Sequence[Dispatch], max_running: int | None = None
    ) -> Snapshot:
        """``snapshot`` with ``dispatches`` added, in order.

        Dispatches not started join the end of the waiting queue; started ones
        (first token seen) the end of the running requests, holding the KV blocks
        of their computed tokens, as long as the engine has seats for them
        (``max_running``, its ``max_num_seqs``): with every seat taken in the
        snapshot, a request seen running has taken the seat of one the snapshot
        still shows, and the view keeps that one in its place.
        """
        if not dispatches:
            return snapshot
        taken = set(snapshot.ids)
        seats = math.inf if max_running is None else max_running - snapshot.num_running
        run_ids: list[str] = []
        run_rows: list[list[int]] = []
        wait_ids: list[str] = []
        wait_rows: list[list[int]] = []
        waiting: list[Dispatch] = []
        for d in dispatches:
            if d.rid in taken:
                continue
            if d.started:
                if len(run_ids) >= seats:
                    continue
                run_ids.append(d.rid)
                run_rows.append(d.row())
            else:
                wait_ids.append(d.rid)
                wait_rows.append(d.row())
                waiting.append(d)
        table = snapshot.table
        n_run = snapshot.num_running
        parts = [table[:n_run]]
        if run_rows:
            parts.append(np.array(run_rows, dtype=np.int64).reshape(len(run_rows), NCOLS))
        parts.append(table[n_run:])
        if wait_rows:
            parts.append(np.array(wait_rows, dtype=np.int64).reshape(len(wait_rows), NCOLS))
        ids = snapshot.ids[:n_run] + tuple(run_ids) + snapshot.ids[n_run:] + tuple(wait_ids)
        kv = snapshot.kv
        if kv is not None and run_rows:
            held = sum(-(-row[2] // kv.block_size) for row in run_rows)
            kv = KVState(kv.block_size, kv.num_blocks, max(0, kv.free_blocks - held))
        merged: npt.NDArray[np.int64] = np.concatenate(parts)
        pc = snapshot.prefix_cache
        if pc is not None and not run_rows:
            # Waiting dispatches hold no blocks: the block pool stands as it is,
            # and each hits what of its chain is cached at its admission.
            # Their keys join the key table as entries of their own: a chain
            # names content by value (an entry past `cached` is no block), so
            # nothing needs the snapshot's keys indexed.
            added: list[int] = []
            chains = []
            for d in waiting:
                start = len(pc.keys) + len(added)
                added.extend(d.prefix_keys)
                chains.append(tuple(range(start, start + len(d.prefix_keys))))
            extra = len(wait_rows)
            pc = attrs.evolve(
                pc,
                keys=pc.keys + tuple(added),
                blocks=pc.blocks + ((),) * extra,
                uncached=pc.uncached + (0,) * extra,
                chains=pc.chains + tuple(chains),
            )
        else:
            # A started dispatch holds blocks the pool does not show: blocks
            # counted, as without the cache.
            pc = None
        return Snapshot(
            instance=snapshot.instance,
            seq=snapshot.seq,
            time=snapshot.time,
            kv=kv,
            ids=ids,
            table=merged,
            inflight_remaining_s=snapshot.inflight_remaining_s,
            epoch=snapshot.epoch,
            prefix_cache=pc,
        )

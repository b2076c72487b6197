"""Shadow view: a snapshot of an unmodified vLLM built from what the router itself knows.

Without the snapshot endpoints, the router still sees every request it sent:
its prompt length, the tokens streamed back so far, and its completion. That is
exactly a snapshot's content for *its own* requests: a request with a first
token is running, with ``prompt + streamed - 1`` tokens computed (the last
sampled token is computed in the next step); one without is waiting (or being
prefilled). vLLM's ``/metrics`` adds what the router cannot see: the engine's
running and waiting counts, KV usage and pool geometry. :class:`ShadowView`
reconciles the two:

* requests the engine counts beyond the router's own (other clients, or the
  router's records lagging) become *phantom* requests: running phantoms share
  the KV blocks the engine uses beyond the router's requests (so their contexts
  come from ``kv_cache_usage_perc``), waiting phantoms have the mean prompt of
  the router's requests;
* the KV state is ``num_gpu_blocks`` and ``(1 - usage)`` of it free, when
  ``vllm:cache_config_info`` and usage are reported.

The result is offered to the instance's cache as an ordinary snapshot (its own
``epoch``, ``seq`` counting up), so BEA, the overlay and the fallback work on
it unchanged. What this loses against a real snapshot is in ``docs/snapshots.md``.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from bearsdk.snapshot import NCOLS, STATE_RUNNING, STATE_WAITING, KVState, Snapshot
from bearsdk.state.cache import Outcome, SnapshotCache

if TYPE_CHECKING:
    from bearsdk.io.metrics import EngineMetrics

__all__ = ["ShadowView"]


@attrs.define
class _Req:
    prompt: int
    dispatched: float
    max_tokens: int | None
    output_len: int | None
    outputs: int = 0


@attrs.frozen
class _Foreign:
    """Load the engine reported beyond the router's own requests (at the last metrics)."""

    running: int
    waiting: int
    blocks: int | None  # KV blocks they hold, when usage and pool size are reported
    prompt: int  # assumed prompt length of each


def _positive_int(inst: object, att: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{att.name} must be an integer >= 1 (got {value!r})")


# Validators run at init only: a hook on every private-state write costs
# microseconds per snapshot.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class ShadowView:
    """The router's own picture of an instance, reconciled with vLLM's metrics.

    Args:
        instance: Instance name (the synthesized snapshots carry it).
        default_prompt_tokens: Prompt length of a waiting phantom while the
            router has no request of its own to average.
        phantom_output_tokens: Output tokens a running phantom is assumed to
            have produced (its remaining length is then predicted as usual).
        metrics_max_age_s: Metrics older than this are ignored (no phantoms, no KV).
        prefill_tokens_per_s: The engine's prefill rate (e.g.
            :func:`~bearsdk.estimators.prefill.nominal_theta_pre` of its batch-time
            model). When set, the router's requests without a first token are
            assumed prefilled at that rate since their dispatch, one after the
            other; otherwise they count as waiting with nothing computed.
        clock: Must be the cache's clock.
    """

    instance: str
    default_prompt_tokens: int = attrs.field(default=512, validator=_positive_int)
    phantom_output_tokens: int = attrs.field(default=64, validator=_positive_int)
    metrics_max_age_s: float = 5.0
    prefill_tokens_per_s: float | None = None
    clock: Callable[[], float] = time.time
    _reqs: dict[str, _Req] = attrs.field(init=False, factory=dict)
    _metrics: EngineMetrics | None = attrs.field(init=False, default=None)
    _foreign: _Foreign | None = attrs.field(init=False, default=None)
    _metrics_at: float = attrs.field(init=False, default=-math.inf)
    _seq: int = attrs.field(init=False, default=0)
    _epoch: str = attrs.field(init=False, factory=lambda: "shadow-" + secrets.token_hex(6))
    _dirty: bool = attrs.field(init=False, default=True)

    @property
    def dirty(self) -> bool:
        """Router events changed the view since the last :meth:`refresh`."""
        return self._dirty

    def __len__(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------------ router events

    def on_dispatch(
        self,
        rid: str,
        prompt_tokens: int,
        *,
        max_tokens: int | None = None,
        output_len: int | None = None,
        now: float | None = None,
    ) -> None:
        """The router sent ``rid`` (prompt of ``prompt_tokens``) to this instance.

        Raises:
            ValueError: A duplicate id or a bad length.
        """
        if rid in self._reqs:
            raise ValueError(f"request id {rid!r} is already in flight")
        for name, v in (
            ("prompt_tokens", prompt_tokens),
            ("max_tokens", max_tokens),
            ("output_len", output_len),
        ):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 (got {v!r})")
        t = self.clock() if now is None else now
        self._reqs[rid] = _Req(prompt_tokens, t, max_tokens, output_len)
        self._dirty = True

    def on_tokens(self, rid: str, output_tokens: int) -> None:
        """``rid`` has streamed ``output_tokens`` tokens so far (cumulative count)."""
        r = self._reqs.get(rid)
        if r is not None and output_tokens > r.outputs:
            r.outputs = output_tokens
            self._dirty = True

    def on_complete(self, rid: str) -> None:
        """``rid`` finished or failed: it no longer loads the instance."""
        if self._reqs.pop(rid, None) is not None:
            self._dirty = True

    def on_metrics(self, metrics: EngineMetrics, *, now: float | None = None) -> None:
        """The engine's latest ``/metrics``.

        What the engine counts beyond the router's own requests *now* is foreign
        load, fixed until the next metrics: comparing old counts with the
        router's later records would mistake its own completions since then
        for other clients' requests.
        """
        t = self.clock() if now is None else now
        running, waiting = self._own(t)
        extra = max(0, (metrics.running + metrics.waiting) - (len(running) + len(waiting)))
        # One of ours being prefilled counts as running there and waiting here:
        # only the excess over the router's total is foreign.
        n_run = min(extra, max(0, metrics.running - len(running)))
        blocks = None
        used = metrics.used_blocks
        if used is not None and metrics.block_size and metrics.num_gpu_blocks:
            blocks = max(0, used - self._held(running, metrics.block_size))
        prompts = [row[1] for _, row in running + waiting]
        self._foreign = _Foreign(
            running=n_run,
            waiting=extra - n_run,
            blocks=blocks,
            prompt=round(sum(prompts) / len(prompts)) if prompts else self.default_prompt_tokens,
        )
        self._metrics = metrics
        self._metrics_at = t
        self._dirty = True

    # ------------------------------------------------------------------ snapshot

    def _own(
        self, now: float | None = None
    ) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
        running: list[tuple[str, list[int]]] = []
        waiting: list[tuple[str, list[int]]] = []
        theta = self.prefill_tokens_per_s
        busy_until = -math.inf  # the engine's prefill work ahead, in FCFS order
        for rid, r in self._reqs.items():
            cap = -1 if r.max_tokens is None else r.max_tokens
            out = r.outputs
            if cap > 0 and out >= cap:
                continue  # its last token arrived; the completion is on its way
            ol = -1
            if r.output_len is not None and r.output_len > out:
                ol = r.output_len if cap < 0 else min(r.output_len, cap)
            if out > 0:
                # The last streamed token is sampled, not yet computed.
                running.append(
                    (rid, [STATE_RUNNING, r.prompt, r.prompt + out - 1, out, cap, ol, 0])
                )
                continue
            done = 0
            if theta is not None and now is not None:
                # No first token yet: its prompt may be partly computed. Estimate
                # it from the time since dispatch, prompts served one after the
                # other at the engine's prefill rate.
                start = max(r.dispatched, busy_until)
                busy_until = start + r.prompt / theta
                done = min(r.prompt - 1, max(0, int((now - start) * theta)))
            if done > 0:
                running.append((rid, [STATE_RUNNING, r.prompt, done, 0, cap, ol, 0]))
            else:
                waiting.append((rid, [STATE_WAITING, r.prompt, 0, 0, cap, ol, 0]))
        return running, waiting

    @staticmethod
    def _held(running: list[tuple[str, list[int]]], block_size: int) -> int:
        return sum(-(-row[2] // block_size) for _, row in running)

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The reconciled view as a snapshot captured at ``now``."""
        t = self.clock() if now is None else now
        running, waiting = self._own(t)
        kv = None
        m = self._metrics if t - self._metrics_at <= self.metrics_max_age_s else None
        if m is not None and self._foreign is not None:
            f = self._foreign
            if f.blocks is not None and m.block_size and m.num_gpu_blocks:
                held = self._held(running, m.block_size)
                if held <= m.num_gpu_blocks:  # else the records contradict the pool: no KV
                    free = max(0, m.num_gpu_blocks - held - f.blocks)
                    kv = KVState(m.block_size, m.num_gpu_blocks, free)
            running += self._phantom_running(f, m.block_size if kv is not None else None)
            waiting = [
                (f"~phantom-wait-{i}", [STATE_WAITING, f.prompt, 0, 0, -1, -1, 0])
                for i in range(f.waiting)
            ] + waiting
        rows = [row for _, row in running] + [row for _, row in waiting]
        ids = tuple(rid for rid, _ in running) + tuple(rid for rid, _ in waiting)
        self._seq += 1
        return Snapshot(
            instance=self.instance,
            seq=self._seq,
            time=t,
            kv=kv,
            ids=ids,
            table=np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS),
            epoch=self._epoch,
        )

    def refresh(self, cache: SnapshotCache, *, source: str = "shadow") -> Outcome:
        """Offer the current view to ``cache``."""
        self._dirty = False
        return cache.offer(self.snapshot(cache.clock()), source=source)

    def _phantom_running(self, f: _Foreign, block_size: int | None) -> list[tuple[str, list[int]]]:
        if not f.running:
            return []
        o = self.phantom_output_tokens
        ctx = f.prompt + o
        if block_size is not None and f.blocks is not None:
            # Running phantoms share the blocks the engine uses beyond the
            # router's requests, in whole blocks each (so they fit the pool).
            ctx = max(o + 1, f.blocks // f.running * block_size)
        prompt = max(1, ctx - o)
        return [
            (f"~phantom-run-{i}", [STATE_RUNNING, prompt, prompt + o - 1, o, -1, -1, 0])
            for i in range(f.running)
        ]

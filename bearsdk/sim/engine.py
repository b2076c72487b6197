"""A simulated engine instance in virtual time: the real scheduler, the emulator's clock.

:class:`SimEngine` is the emulated engine's loop (:mod:`bearsdk.emulator.engine`)
without real time or HTTP: a :class:`~bearsdk.replay.SchedulerCore` bound to the
instance's policy (with the defaults ``vllm serve`` picks on its hardware, as the
emulator binds them) forms every batch, and the emulator's ground-truth time
model (:class:`~bearsdk.emulator.GroundTruthTimeModel`, a roofline model, not
eq. 12) says how long it runs. Batch ``k``'s duration is the model's expected
time times the ``k``-th draw of its noise (log-normal jitter and rare outliers,
as :meth:`GroundTruthTimeModel.sample` applies them), drawn ahead from the
instance's seed so that the oracle can look ahead exactly.

The loop mirrors the emulator's with ``schedule_lead_s = 0``. With asynchronous
scheduling, at the end of batch ``k`` the engine schedules batch ``k + 1`` (its
sampled tokens as placeholders), processes batch ``k``'s outputs, and publishes
a snapshot with batch ``k + 1`` in flight. Without it, batch ``k`` is processed
when it ends and the snapshot is taken right after scheduling the next one.
A request's first token arrives when the batch that samples it ends.

**Decode runs.** Between events (an arrival, a capture, a request that finishes
or reaches its cap) an engine whose running requests all decode and whose
waiting queue is empty forms the same batch every step: one token per running
request. :meth:`SimEngine.advance` advances such stretches in closed form, up to
the next event, and hands every other step to the scheduler. A run changes the
requests' counters and block holdings exactly as the scheduler's steps would;
``tests/test_sim_engine.py`` checks the equivalence against plain stepping.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.emulator import BatchShape, EmulatedEngine, EngineConfig, GroundTruthParams
from bearsdk.emulator.timing import GroundTruthTimeModel
from bearsdk.replay import ScheduledBatch, SchedulerCore, StepOutput
from bearsdk.schedulers import Policy, compile_scheduler, get_scheduler
from bearsdk.snapshot import NCOLS, KVState, Snapshot

__all__ = ["BatchNoise", "EngineEvent", "SimEngine", "bind_engine"]

FIRST_TOKEN: Final = 0
"""Event kind: a request's first token reached the client."""
COMPLETE: Final = 1
"""Event kind: a request finished (its last token reached the client)."""

_NOISE_CHUNK: Final = 1 << 14
_RUN_CHUNK: Final = 1024
_EPOCH: Final = "sim"


@attrs.frozen
class EngineEvent:
    """Something a client of the engine observes.

    Attributes:
        time: When (virtual seconds).
        kind: :data:`FIRST_TOKEN` or :data:`COMPLETE`.
        rid: The request.
        engine: The engine's name.
    """

    time: float
    kind: int
    rid: str
    engine: str


@attrs.define
class BatchNoise:
    """Per-batch duration multipliers of one engine, drawn ahead from its seed.

    Batch ``k`` lasts its expected time times :meth:`at` ``(k)``: ``exp(N(0,
    sigma))``, times ``U(outlier_min, outlier_max)`` with probability
    ``outlier_prob``, as :meth:`GroundTruthTimeModel.sample` draws them.

    Args:
        params: The ground-truth model's constants.
        seed: Seeds the draws.
    """

    params: GroundTruthParams
    seed: int
    _rng: np.random.Generator = attrs.field(init=False)
    _values: npt.NDArray[np.float64] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._values = np.empty(0)

    def _extend(self, upto: int) -> None:
        p = self.params
        chunks = [self._values]
        n = len(self._values)
        while n <= upto:
            # Fixed-size chunks, each drawn the same way: the k-th multiplier is
            # the same however far ahead anyone looked.
            g = self._rng.standard_normal(_NOISE_CHUNK)
            u = self._rng.random(_NOISE_CHUNK)
            f = self._rng.uniform(
                p.outlier_min, max(p.outlier_min, p.outlier_max), size=_NOISE_CHUNK
            )
            m = np.exp(p.noise_sigma * g) if p.noise_sigma > 0 else np.ones(_NOISE_CHUNK)
            if p.outlier_prob > 0:
                m = np.where(u < p.outlier_prob, m * f, m)
            chunks.append(m)
            n += _NOISE_CHUNK
        self._values = np.concatenate(chunks)

    def at(self, k: int) -> float:
        """Multiplier of batch ``k`` (0-based)."""
        if k >= len(self._values):
            self._extend(k)
        return float(self._values[k])

    def span(self, start: int, count: int) -> npt.NDArray[np.float64]:
        """Multipliers of batches ``start .. start + count - 1``."""
        if start + count > len(self._values):
            self._extend(start + count)
        return self._values[start : start + count]


def bind_engine(
    profile: str, scheduler: str = "vllm-v1", params: Mapping[str, object] | None = None
) -> EmulatedEngine:
    """An unstarted emulated engine of ``profile``: its bound policy (the flags
    ``vllm serve`` picks on that hardware under ``params``), profile and time model.

    Raises:
        KeyError: Unknown profile.
        EngineConfigError: Inconsistent parameters.
        SpecError: Unknown scheduler or bad parameter.
    """
    p = dict(params or {})
    if "enable_prefix_caching" in get_scheduler(scheduler).params:
        # The simulator's workloads carry no token ids, so a cache could hit
        # only a preempted request's own blocks, and its closed-form decode runs
        # count blocks: its engines leave the cache off unless a pool entry's
        # params turn it on.
        p.setdefault("enable_prefix_caching", False)
    cfg = EngineConfig(profile=profile, scheduler=scheduler, params=p, serve_http=False)
    return EmulatedEngine(cfg)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@attrs.define(eq=False)
class SimEngine:
    """One engine instance in virtual time.

    Args:
        name: Instance name (snapshots' ``instance``).
        policy: Bound scheduler policy, KV geometry included.
        max_model_len: Context length (prompt + output).
        time_model: Ground-truth batch-time model.
        noise: Per-batch multipliers.
        on_event: Receives every :class:`EngineEvent` (per engine, in time order).
        decode_runs: Advance decode-only stretches in closed form.
        log_batches: Keep every batch's composition and duration (:meth:`batch_log`).
        speed_changes: ``(time_s, multiplier)`` steps, times increasing: a batch
            starting at or after ``time_s`` takes ``multiplier`` times its
            ground-truth time (until the next step).
    """

    name: str
    policy: Policy
    max_model_len: int
    time_model: GroundTruthTimeModel
    noise: BatchNoise
    on_event: Callable[[EngineEvent], None] = attrs.field(default=lambda e: None)
    decode_runs: bool = True
    log_batches: bool = False
    speed_changes: tuple[tuple[float, float], ...] = ()
    _core: SchedulerCore = attrs.field(init=False)
    _depth: int = attrs.field(init=False)
    _t: float = attrs.field(init=False, default=0.0)  # start of the next step
    _idle: bool = attrs.field(init=False, default=True)
    _batches: int = attrs.field(init=False, default=0)
    _seq: int = attrs.field(init=False, default=0)
    _last_start: float = attrs.field(init=False, default=0.0)  # the published snapshot's time
    _inflight_end: float = attrs.field(init=False, default=0.0)
    _new: int = attrs.field(init=False, default=0)  # arrivals since the last step
    _first: set[str] = attrs.field(init=False, factory=set)
    _captures: list[tuple[float, int]] = attrs.field(init=False, factory=list)
    _captured: dict[int, Snapshot] = attrs.field(init=False, factory=dict)
    _published: Snapshot | None = attrs.field(init=False, default=None)
    _oracle: Any = attrs.field(init=False, default=None)
    _run_steps: int = attrs.field(init=False, default=0)
    _lines: dict[int, tuple[float, float] | None] = attrs.field(init=False, factory=dict)
    _log: list[tuple[float, float, float, float, float]] = attrs.field(init=False, factory=list)
    _log_runs: list[npt.NDArray[np.float64]] = attrs.field(init=False, factory=list)
    _taken: tuple[int, int] = attrs.field(init=False, default=(0, 0))  # take_batches' cursor

    def __attrs_post_init__(self) -> None:
        self._core = SchedulerCore(self.policy)
        self._depth = 2 if self.policy.async_scheduling else 1

    # -- properties ---------------------------------------------------------

    @property
    def core(self) -> SchedulerCore:
        """The scheduler (read-only use)."""
        return self._core

    @property
    def next_step(self) -> float:
        """Start of the next step (meaningless while idle)."""
        return self._t

    @property
    def idle(self) -> bool:
        """Nothing to do until a request arrives."""
        return self._idle

    @property
    def batches(self) -> int:
        """Non-empty batches scheduled so far."""
        return self._batches

    def batch_log(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """``(features, durations)`` of every batch so far (``log_batches``): features
        are ``prefill_tokens, decode_tokens, decode_context, prefill_attention``,
        as :func:`~bearsdk.estimators.batch_time.fit_batch_time` takes them."""
        parts = [np.array(self._log, dtype=np.float64).reshape(-1, 5), *self._log_runs]
        a = np.concatenate(parts) if parts else np.zeros((0, 5))
        return a[:, :4].copy(), a[:, 4].copy()

    def take_batches(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """:meth:`batch_log`'s batches logged since the last call (what an engine's
        ``/bear/batches`` stream has sent meanwhile; the batch in flight's
        record comes as it starts, its duration already drawn)."""
        i, j = self._taken
        parts = [np.array(self._log[i:], dtype=np.float64).reshape(-1, 5), *self._log_runs[j:]]
        self._taken = (len(self._log), len(self._log_runs))
        a = np.concatenate(parts)
        return a[:, :4], a[:, 4]

    @property
    def run_steps(self) -> int:
        """Steps advanced in closed form (decode runs) so far."""
        return self._run_steps

    # -- requests -------------------------------------------------------------

    def add_request(
        self,
        rid: str,
        prompt_tokens: int,
        output_len: int,
        now: float,
        token_ids: Sequence[int] | None = None,
    ) -> int:
        """A request arrives at ``now`` (after :meth:`advance` up to ``now``).

        Args:
            rid: Unique id.
            prompt_tokens: Prompt length (``< max_model_len``).
            output_len: Its true output length.
            now: Arrival time.
            token_ids: Its prompt's token ids and then its output's, as far as
                known (a prefix-caching engine caches and hits blocks by them).

        Returns:
            The output length it will produce (clamped to the context left).
        """
        out = max(1, min(output_len, self.max_model_len - prompt_tokens))
        if token_ids is not None:
            token_ids = token_ids[: prompt_tokens + out]
        self._core.add_request(rid, prompt_tokens, out, None, token_ids)
        self._new += 1
        if self._idle:
            self._idle = False
            self._t = now
        return out

    # -- the loop -----------------------------------------------------------

    def plan_captures(self, times: Sequence[float]) -> None:
        """Keep the snapshot visible at each of ``times`` (ascending).

        The snapshot visible at ``x`` is the one published by the last step
        starting at or before ``x``; fetch it with :meth:`captured`.
        """
        self._captures = [(float(x), i) for i, x in enumerate(times)]
        self._captures.reverse()  # popped from the end: earliest first

    def captured(self, index: int) -> Snapshot:
        """The snapshot kept for capture ``index`` (once :meth:`advance` went past it)."""
        return self._captured.pop(index)

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until``; keep the captures up to ``until``."""
        caps = self._captures
        while not self._idle and self._t < until:
            if caps and caps[-1][0] < self._t:
                snap = self.snapshot()
                while caps and caps[-1][0] < self._t:
                    self._captured[caps.pop()[1]] = snap
            horizon = min(until, caps[-1][0]) if caps else until
            if self.speed_changes:
                # A closed-form run never crosses a change of speed.
                horizon = min(horizon, self._next_change(self._t))
            if not (self.decode_runs and self._decode_run(until, horizon)):
                self._step()
        if caps and caps[-1][0] <= until:
            snap = self.snapshot()
            while caps and caps[-1][0] <= until:
                self._captured[caps.pop()[1]] = snap

    def drain(self) -> None:
        """Run until every request has finished."""
        self.advance(math.inf)

    def speed_at(self, t: float) -> float:
        """The speed multiplier of a batch starting at ``t`` (1 with no changes)."""
        changes = self.speed_changes
        if not changes or t < changes[0][0]:
            return 1.0
        return changes[bisect.bisect_right(changes, (t, math.inf)) - 1][1]

    def _next_change(self, t: float) -> float:
        for at, _ in self.speed_changes:
            if at > t:
                return at
        return math.inf

    def _duration(self, b: ScheduledBatch) -> float:
        shape = BatchShape(b.pre, b.dec, b.dctx, b.patt, len(b.sched), len(b.sampled))
        return (
            self.time_model.expected(shape) * self.noise.at(self._batches) * self.speed_at(self._t)
        )

    def _finished(self, out: StepOutput, t: float) -> None:
        for rid in out.finished:
            self.on_event(EngineEvent(t, COMPLETE, rid, self.name))

    def _step(self) -> None:
        core = self._core
        t = self._t
        q = core.queue
        self._published = None
        self._new = 0
        self._seq += 1
        self._last_start = t
        if self._depth == 1 and q:
            self._finished(core.process(q.popleft()), t)
        b = core.schedule()
        if not b and all(x.inert() for x in q):
            while q:
                self._finished(core.process(q.popleft()), t)
            self._idle = True
            self._inflight_end = t
            return
        dt = 0.0
        if b:
            dt = self._duration(b)
            self._batches += 1
            if self.log_batches:
                self._log.append((b.pre, b.dec, b.dctx, b.patt, dt))
            first = self._first
            for r in b.sampled:
                if r.rid not in first:
                    first.add(r.rid)
                    self.on_event(EngineEvent(t + dt, FIRST_TOKEN, r.rid, self.name))
        q.append(b)
        if self._depth > 1 and len(q) >= self._depth:
            self._finished(core.process(q.popleft()), t)
        self._inflight_end = t + dt
        self._t = t + dt

    # -- decode runs ----------------------------------------------------------

    def _decode_line(self, n: int) -> tuple[float, float] | None:
        """``(a, k)``: a batch of ``n`` decodes over total context ``c`` lasts
        ``a + k * c`` on average, when the time model is linear in ``c`` there."""
        if n not in self._lines:
            tm = self.time_model
            e0, e1, e2 = (tm.expected(BatchShape(0, n, c, 0, n, n)) for c in (0, 1 << 20, 1 << 21))
            k = (e1 - e0) / (1 << 20)
            linear = abs(e0 + k * (1 << 21) - e2) <= 1e-9 * max(e2, 1e-12)
            self._lines[n] = (e0, k) if linear else None
        return self._lines[n]

    def _decode_run(self, until: float, horizon: float) -> bool:
        """Advance a stretch of identical decode steps in closed form; ``False`` if none.

        Async engines only. The stretch starts when nothing waits and the batch
        in flight samples a token for every running request (decodes, or the
        last chunk of a prompt; requests finished meanwhile aside), and ends
        before the first step that would differ: one that admits a request or
        takes a capture (``horizon``), or in which a request's next token is
        its last or at its cap, or a KV block could run short.
        """
        core = self._core
        if self._depth != 2 or core.waiting or len(core.queue) != 1 or core.pool is not None:
            # (a prefix-caching pool names every block: no closed form)
            return False
        prev = core.queue[0]
        running = core.running
        n = len(running)
        if n == 0 or len(prev.sampled) < n or prev.carried or prev.preempted:
            return False
        p = self.policy
        if p.budget_count == "padded" or n > p.token_budget:
            return False
        sched = prev.sched
        steps = _RUN_CHUNK
        ctx = 0
        for r in running:
            # In flight: exactly this step's token (requests out of the running
            # list since were finished: the step skips them).
            k = sched.get(r)
            if k is None or r.ph != 1 or r.inflight != k or not r.prefilled:
                return False
            if r.prompt + r.outputs + 1 - r.computed != 1:
                return False
            steps = min(steps, min(r.target, r.limit) - r.outputs - 1)
            ctx += r.computed
        if steps < 2:
            return False
        bs = p.block_size
        unlimited = core.unlimited
        if not unlimited:
            while steps >= 2:
                need = 0
                for r in running:
                    grow = _cdiv(r.computed + steps, bs) - r.blocks
                    if grow > 0:
                        need += grow
                # A decode may need one block free even when it allocates none.
                if core.free - need >= 1:
                    break
                steps //= 2
            if steps < 2:
                return False
        line = self._decode_line(n)
        if line is not None:
            expected = line[0] + line[1] * (ctx + n * np.arange(steps, dtype=np.float64))
        else:
            tm = self.time_model
            expected = np.array(
                [tm.expected(BatchShape(0, n, ctx + n * i, 0, n, n)) for i in range(steps)]
            )
        dur = expected * self.noise.span(self._batches, steps)
        if self.speed_changes:
            dur *= self.speed_at(self._t)
        ends = self._t + np.cumsum(dur)
        # Step i starts when step i - 1 ends: it belongs to the run if it starts
        # before ``until`` and not after a pending capture.
        m = 1 + int(np.searchsorted(ends[:-1], until, side="left"))
        if horizon < until:
            m = min(m, 1 + int(np.searchsorted(ends[:-1], horizon, side="right")))
        m = min(m, steps)
        if m < 2:
            return False
        for r in running:
            r.computed += m
            r.outputs += m
            r.inflight = 1
            if not unlimited:
                grown = _cdiv(r.computed, bs) - r.blocks
                if grown > 0:
                    r.blocks += grown
                    core.free -= grown
        if self.log_batches:
            rows = np.zeros((m, 5))
            rows[:, 1] = n
            rows[:, 2] = ctx + n * np.arange(m)
            rows[:, 4] = dur[:m]
            self._log_runs.append(rows)
        # The batch now in flight: the run's last step, one decode per request.
        last = ScheduledBatch()
        last.sched = dict.fromkeys(running, 1)
        last.sampled = list(running)
        last.dec = n
        last.dctx = ctx + n * (m - 1)
        core.queue[0] = last
        self._published = None
        self._new = 0
        self._batches += m
        self._seq += m
        self._run_steps += m
        self._last_start = float(ends[m - 2])
        self._t = float(ends[m - 1])
        self._inflight_end = self._t
        return True

    # -- what the router and the oracle see -------------------------------------

    def _rows(self, oracle: bool) -> tuple[list[str], list[tuple[int, ...]]]:
        """The resident requests as snapshot rows (as ``SchedulerCore.snapshot``).

        The router's view is the published one: without output lengths, and
        without the requests that arrived since the last step. The oracle's is
        the engine's true state.
        """
        core = self._core
        mml = self.policy.max_model_len
        big = 1 << 61
        ids: list[str] = []
        rows: list[tuple[int, ...]] = []
        sync_sampled: set[str] = set()
        if self._depth == 1 and core.queue:
            # A synchronous core has no placeholders: the batch in flight's sampled
            # tokens become theirs, as the emulator publishes them.
            sync_sampled = {r.rid for r in core.queue[-1].sampled}
        for r in core.running:
            lim = r.limit
            cap = lim if lim < big and not (mml and lim == mml - r.prompt) else -1
            ph = r.ph + 1 if r.rid in sync_sampled else r.ph
            ids.append(r.rid)
            rows.append((0, r.prompt, r.computed, r.outputs, cap, r.target if oracle else -1, ph))
        waiting = core.waiting
        shown = len(waiting) if oracle else len(waiting) - self._new
        for i, r in enumerate(waiting):
            if i >= shown:
                break
            lim = r.limit
            cap = lim if lim < big and not (mml and lim == mml - r.prompt) else -1
            ids.append(r.rid)
            rows.append((1, r.prompt, 0, r.outputs, cap, r.target if oracle else -1, 0))
        return ids, rows

    def snapshot(self) -> Snapshot:
        """The latest snapshot the engine published (taken after its last step)."""
        if self._published is not None:
            return self._published
        core = self._core
        if core.pool is not None:
            # The block pool too (kv.prefix_cache): the document the emulator publishes.
            from bearsdk.snapshot import snapshot_from_dict

            t = self._last_start
            doc = core.snapshot(instance=self.name, seq=self._seq, time=t)
            doc["epoch"] = _EPOCH
            if self._inflight_end > t:
                doc["inflight"] = {"remaining_s": self._inflight_end - t}
            self._published = snapshot_from_dict(doc)
            return self._published
        ids, rows = self._rows(False)
        kv = None
        if not core.unlimited:
            kv = KVState(self.policy.block_size, self.policy.num_blocks, core.free)
        t = self._last_start
        remaining = self._inflight_end - t if self._inflight_end > t else None
        snap = Snapshot(
            instance=self.name,
            seq=self._seq,
            time=t,
            kv=kv,
            ids=tuple(ids),
            table=np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS),
            inflight_remaining_s=remaining,
            epoch=_EPOCH,
        )
        self._published = snap
        return snap

    # -- the oracle -------------------------------------------------------------

    def streamed_at(self, now: float) -> float | None:
        """When the latest token a client streaming from here received was produced:
        the end of the step before the one in flight at ``now``, while a running
        request decodes (``None`` when idle, or when nothing decodes)."""
        if self._idle or self._last_start > now:
            return None
        if not any(r.outputs > 0 for r in self._core.running):
            return None
        return self._last_start

    def forecast_ttft(self, prompt_tokens: int, output_len: int, now: float) -> float:
        """True TTFT of a request arriving now, were no other request to arrive after it.

        Replays the scheduler (compiled) from the engine's exact state with the
        true output lengths, and times each batch with the ground-truth model
        and the noise draws the engine will use.
        """
        if self._oracle is None:
            self._oracle = compile_scheduler(self.policy)
        rp = self._oracle
        ids, rows = self._rows(True)
        core = self._core
        table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
        prep = rp.prepare(table, -1 if core.unlimited else core.free, ids)
        out = max(1, min(output_len, self.max_model_len - prompt_tokens))
        res = rp.replay(prep, prompt_tokens, out, (0.0, 0.0, 0.0, 0.0), True)
        if res.first_token_batch == 0 or res.batches is None:
            return math.inf
        total = 0.0 if self._idle else max(0.0, self._t - now)
        expected = self.time_model.expected
        k = self._batches
        for rec in res.batches:
            # Records carry no sampled count: every decode samples, and so is
            # taken every prefill chunk (it matters only to the LM-head term of
            # a batch of partial chunks alone).
            shape = BatchShape(
                rec.prefill_tokens,
                rec.decode_tokens,
                rec.decode_context,
                rec.prefill_attention,
                rec.num_seqs,
                rec.num_seqs,
            )
            total += expected(shape) * self.noise.at(k) * self.speed_at(now + total)
            k += 1
        return total

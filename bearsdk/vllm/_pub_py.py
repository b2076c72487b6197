"""Pure-Python twin of ``bearsdk.vllm._pub_c`` (built from ``cext/_vllm_pub_c.pyx``).

The reference for the compiled capture: the same API, byte-identical documents
and identical batch terms (differential tests pin both). It reads the public
attributes of every vLLM ``Request`` at every capture and keeps no shadow of
their counters (``shadow`` is accepted and ignored; :meth:`Capture.batch_done`
and :meth:`Capture.preempted` do nothing), so it is also the fallback when the
extension is not built (``BEARSDK_NO_EXTENSIONS=1``). It costs the engine
several times what the compiled capture does.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

__all__ = [
    "IMPLEMENTATION",
    "INLINE_BATCHES",
    "INLINE_DOCUMENT",
    "Capture",
    "Hooks",
    "id_fragment",
    "json_head",
]

IMPLEMENTATION: Final = "python"

_ESCAPE = re.compile(rb'["\\\x00-\x1f]')

# One request row: id fragment, prompt, computed, outputs, max_tokens, placeholders, running.
Row = tuple[bytes, int, int, int, int, int, bool]


def _escape_one(m: re.Match[bytes]) -> bytes:
    ch = m.group()[0]
    if ch in (34, 92):
        return b"\\" + bytes((ch,))
    return b"\\u%04x" % ch


def _json_str(raw: bytes) -> bytes:
    return b'"' + _ESCAPE.sub(_escape_one, raw) + b'"'


@functools.lru_cache(maxsize=8192)
def id_fragment(rid: str) -> bytes:
    """The constant head of a request's row: ``{"id":"<id>","state":"``."""
    return b'{"id":' + _json_str(rid.encode("utf-8", "replace")) + b',"state":"'


def json_head(instance: str, epoch: str) -> bytes:
    """The document's constant head (schema, instance, epoch)."""
    return (
        b'{"schema":"bear.snapshot/1","instance":'
        + _json_str(instance.encode("utf-8", "replace"))
        + b',"epoch":'
        + _json_str(epoch.encode("utf-8", "replace"))
    )


def _float(v: float) -> bytes:
    text = repr(float(v)).encode()
    if len(text) > 40:
        raise ValueError(f"{v!r} does not fit the document")
    return text


def _int(v: Any) -> int:
    return -1 if v is None else int(v)


class _Frame:
    __slots__ = ("free_blocks", "inflight_s", "rows", "seq", "time_s")

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.seq = 0
        self.free_blocks = 0
        self.time_s = b"0.0"
        self.inflight_s = b""


def _format(f: _Frame, head: bytes, block_size: int, num_blocks: int) -> bytes:
    free = min(max(f.free_blocks, 0), num_blocks)
    parts = [
        head,
        b',"seq":%d,"time":' % f.seq,
        f.time_s,
        b',"kv":{"block_size":%d,"num_blocks":%d,"free_blocks":%d}'
        % (block_size, num_blocks, free),
    ]
    if f.inflight_s:
        parts.append(b',"inflight":{"remaining_s":' + f.inflight_s + b"}")
    parts.append(b',"requests":[')
    rows = []
    for frag, prompt, computed, outputs, max_tokens, ph, running in f.rows:
        # Clamped exactly as the compiled encoder clamps (see there why).
        prompt = max(prompt, 1)
        outputs = max(outputs, 0)
        ph = max(ph, 0)
        computed = min(max(computed, 0), prompt + outputs + ph)
        row = (
            frag
            + (b"running" if running else b"waiting")
            + b'","prompt_tokens":%d,"computed_tokens":%d,"output_tokens":%d'
            % (prompt, computed, outputs)
        )
        if max_tokens > outputs:
            row += b',"max_tokens":%d' % max_tokens
        if ph > 0:
            row += b',"placeholders":%d' % ph
        rows.append(row + b"}")
    parts.append(b",".join(rows))
    parts.append(b"]}")
    return b"".join(parts)


class Capture:
    """Captures a vLLM scheduler's resident requests as ``bear.snapshot/1`` documents.

    Args:
        instance: The instance name the documents carry.
        epoch: This engine run's id.
        block_size: Tokens per KV block.
        num_blocks: Blocks in the KV pool.
        placeholders: Read ``num_output_placeholders`` (async scheduling).
        threaded: Allow :meth:`commit` / :meth:`take_and_encode` (a publisher thread).
    """

    def __init__(
        self,
        instance: str,
        epoch: str,
        block_size: int,
        num_blocks: int,
        placeholders: bool = True,
        threaded: bool = False,
        shadow: bool = False,
        audit: int = 2,
        poll_us: float = 500.0,
    ) -> None:
        if not poll_us > 0:
            raise ValueError(f"poll_us must be > 0 (got {poll_us!r})")
        if block_size < 1 or num_blocks < 1:
            raise ValueError(
                f"block_size and num_blocks must be >= 1 (got {block_size}, {num_blocks})"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_running = 0
        self.num_waiting = 0
        self.shadow = False
        self.mismatches = 0
        self._head = json_head(instance, epoch)
        self._placeholders = placeholders
        self._threaded = threaded
        self._frame = _Frame()
        self._payload = b""
        self._taken = b""
        self._run: dict[str, tuple[int, bool]] = {}
        self._waiting: dict[str, Any] = {}
        self._valid = False
        self._cond = threading.Condition()
        self._pending: _Frame | None = None
        self._closed = False

    @property
    def cached(self) -> int:
        """Requests in the constant-part cache (this twin keeps none)."""
        return 0

    def capture(
        self,
        running: list[Any],
        waiting: tuple[Iterable[Any], ...],
        seq: int,
        time_s: float,
        free_blocks: int,
        inflight_s: float = -1.0,
        batch_terms: bool = False,
    ) -> int:
        """Capture the resident requests (see the compiled twin)."""
        self._valid = False
        f = _Frame()
        f.seq = seq
        f.free_blocks = free_blocks
        f.time_s = _float(time_s)
        f.inflight_s = _float(inflight_s) if inflight_s >= 0.0 else b""
        run: dict[str, tuple[int, bool]] = {}
        rows = f.rows
        for r in running:
            prompt = _int(r.num_prompt_tokens)
            outputs = _int(r.num_output_tokens)
            computed = _int(r.num_computed_tokens)
            ph = _int(r.num_output_placeholders) if self._placeholders else 0
            chunk = getattr(r, "is_prefill_chunk", None)
            if chunk is True or chunk is False:
                prefilled = not chunk
            else:
                prefilled = outputs + ph >= 1 and computed >= prompt + outputs + ph - 1
            run[r.request_id] = (computed, prefilled)
            rows.append(
                (id_fragment(r.request_id), prompt, computed, outputs, _int(r.max_tokens), ph, True)
            )
        self.num_running = len(rows)
        self._waiting = {}
        for q in waiting:
            for r in q:
                self._waiting[r.request_id] = r
                rows.append(
                    (
                        id_fragment(r.request_id),
                        _int(r.num_prompt_tokens),
                        0,
                        _int(r.num_output_tokens),
                        _int(r.max_tokens),
                        0,
                        False,
                    )
                )
        self.num_waiting = len(rows) - self.num_running
        self._frame = f
        self._run = run
        self._valid = True
        return len(rows)

    def encode(self) -> int:
        """Format the last capture; returns its length."""
        self._payload = _format(self._frame, self._head, self.block_size, self.num_blocks)
        return len(self._payload)

    def payload(self) -> bytes:
        """The document :meth:`encode` formatted last."""
        return self._payload

    def commit(self) -> None:
        """Hand the last capture to the publisher thread (never waits)."""
        if not self._threaded:
            raise RuntimeError("this Capture was not created with threaded=True")
        with self._cond:
            self._pending = self._frame
            self._cond.notify()
        self._frame = _Frame()

    def take_and_encode(self) -> int:
        """Publisher thread: wait for a committed capture and format it (-1 once closed)."""
        if not self._threaded:
            raise RuntimeError("this Capture was not created with threaded=True")
        with self._cond:
            while self._pending is None and not self._closed:
                self._cond.wait()
            if self._closed:
                return -1
            f, self._pending = self._pending, None
        assert f is not None
        self._taken = _format(f, self._head, self.block_size, self.num_blocks)
        return len(self._taken)

    def taken_payload(self) -> bytes:
        """The document :meth:`take_and_encode` formatted last."""
        return self._taken

    def close(self) -> None:
        """Wake the publisher thread for good."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def after_schedule(
        self, scheduled: Mapping[str, int], key: object = None
    ) -> tuple[int, int, int, int, int]:
        """Eq. 12 terms of the batch schedule() formed since the last :meth:`capture`.

        A request running at the capture is a decode when its last chunk had
        completed its known tokens (vLLM's ``is_prefill_chunk``, read then);
        the others were admitted by this schedule() and carry their computed
        tokens (prefix-cache hits included) already.
        """
        if not self._valid:
            return (0, 0, 0, 0, 0)
        self._valid = False
        run = self._run
        seqs = pre = dec = dctx = patt = 0
        for rid, n in scheduled.items():
            if n <= 0:
                continue
            known = run.get(rid)
            if known is not None:
                seqs += 1
                c, prefilled = known
                if prefilled:
                    dec += n
                    dctx += c * n
                    continue
            else:
                r = self._waiting.get(rid)
                if r is None:
                    continue  # not resident at the capture (the compiled twin skips it too)
                seqs += 1
                c = max(0, r.num_computed_tokens - n)
            pre += n
            patt += n * c + n * (n + 1) // 2
        return (seqs, pre, dec, dctx, patt)

    def batch_done(self, key: object = None) -> None:
        """Nothing to do: this twin reads every request at every capture."""

    def preempted(self, request: Any) -> None:
        """Nothing to do: this twin reads every request at every capture."""


INLINE_DOCUMENT: Final = 1
INLINE_BATCHES: Final = 2
_FIFO: Final = 16


class Hooks:
    """What the scheduler plugin calls on vLLM's engine thread (see the compiled twin).

    Args:
        capture: The capture.
        free_blocks: Returns the free KV blocks.
        on_failure: Called with ``(where, exception)`` on each failure.
        threaded: Documents go through ``capture.commit`` to a publisher thread.
        batch_time: Eq. 12 coefficients for ``inflight.remaining_s``, or None.
        batch_buffer: Batch records kept until taken (the oldest go first).
    """

    def __init__(
        self,
        capture: Any,
        free_blocks: Callable[[], int],
        on_failure: Callable[[str, BaseException], None],
        threaded: bool,
        batch_time: tuple[float, float, float, float] | None = None,
        batch_buffer: int = 4096,
    ) -> None:
        self.cap = capture
        self.free_fn = free_blocks
        self.on_failure = on_failure
        self.threaded = threaded
        self.model = batch_time
        self.want_terms = batch_time is not None
        self.seq = 0
        self.captures = 0
        self.failures = 0
        self.batches = 0
        self.dropped = 0
        self.engine_ns = 0  # time spent in the hooks (their own measure)
        self.closed = False
        # (output, t_sched, seq, terms or None)
        self._fifo: deque[tuple[object, float, int, tuple[int, int, int, int, int] | None]] = (
            deque()
        )
        self._last_done = 0.0
        self._ring: deque[tuple[int, float, int, int, int, int, int, float]] = deque()
        self._ring_cap = max(1, batch_buffer)

    def _fail(self, where: str, exc: BaseException) -> None:
        self.failures += 1
        with contextlib.suppress(Exception):
            self.on_failure(where, exc)

    def _inflight(self) -> float:
        if self.model is None or not self._fifo:
            return -1.0
        _, t_sched, _, terms = self._fifo[0]
        if terms is None:
            return -1.0
        b0, b1, b2, b3 = self.model
        predicted = b0 + b1 * (terms[1] + terms[2]) + b2 * terms[3] + b3 * terms[4]
        predicted -= time.monotonic() - max(t_sched, self._last_done)
        return max(0.0, predicted)

    def before_schedule(self, sched: Any) -> int:
        """Start of ``schedule()``: capture the resident requests."""
        t0 = time.perf_counter_ns()
        r = self._before_schedule(sched)
        self.engine_ns += time.perf_counter_ns() - t0
        return r

    def _before_schedule(self, sched: Any) -> int:
        if self.closed:
            return 0
        try:
            running = sched.running
            waiting = (sched.kv_holding_waiting, sched.waiting)
            free = self.free_fn()
            self.seq += 1
            self.cap.capture(
                running, waiting, self.seq, time.time(), free, self._inflight(), self.want_terms
            )
            self.captures += 1
            if self.threaded:
                self.cap.commit()
                return 0
            return INLINE_DOCUMENT
        except Exception as exc:
            self._fail("capture", exc)
            return 0

    def after_schedule(self, out: Any) -> int:
        """End of ``schedule()``: the batch's terms."""
        t0 = time.perf_counter_ns()
        self._after_schedule(out)
        self.engine_ns += time.perf_counter_ns() - t0
        return 0

    def _after_schedule(self, out: Any) -> int:
        if self.closed:
            return 0
        try:
            wanted = self.want_terms and out.total_num_scheduled_tokens > 0
            terms = self.cap.after_schedule(out.num_scheduled_tokens) if wanted else None
            if len(self._fifo) == _FIFO:
                self._fifo.popleft()
            self._fifo.append((out, time.monotonic(), self.seq, terms))
        except Exception as exc:
            self._fail("batch terms", exc)
        return 0

    def before_update(self, out: Any, model_output: Any) -> int:
        """Start of ``update_from_output()``: the batch's record."""
        t0 = time.perf_counter_ns()
        r = self._before_update(out)
        self.engine_ns += time.perf_counter_ns() - t0
        return r

    def _before_update(self, out: Any) -> int:
        if self.closed:
            return 0
        now = time.monotonic()
        found = None
        while self._fifo:
            entry = self._fifo.popleft()
            if entry[0] is out:
                found = entry
                break
        last, self._last_done = self._last_done, now
        if found is None:
            return 0
        _, t_sched, seq, terms = found
        if terms is None or terms[1] + terms[2] <= 0:
            return 0
        duration = now - max(t_sched, last)
        if duration <= 0.0:
            return 0
        if len(self._ring) == self._ring_cap:
            self._ring.popleft()
            self.dropped += 1
        self._ring.append((seq, time.time(), *terms, duration))
        self.batches += 1
        return 0 if self.threaded else INLINE_BATCHES

    def after_change(self, sched: Any) -> int:
        """After ``update_from_output()`` or an abort: capture once more if now idle."""
        t0 = time.perf_counter_ns()
        r = self._after_change(sched)
        self.engine_ns += time.perf_counter_ns() - t0
        return r

    def _after_change(self, sched: Any) -> int:
        if self.closed:
            return 0
        try:
            if sched.running or sched.waiting or sched.kv_holding_waiting:
                return 0
            if sched.has_requests():
                return 0
        except Exception as exc:
            self._fail("read scheduler state", exc)
            return 0
        return self._before_schedule(sched)

    def preempted(self, request: Any) -> int:
        """vLLM preempted ``request`` (nothing to do: this twin keeps no shadow)."""
        return 0

    def take_batches(self) -> list[tuple[int, float, int, int, int, int, int, float]]:
        """The batch records not taken yet, oldest first."""
        out = list(self._ring)
        self._ring.clear()
        return out

    def close(self) -> None:
        """Stop: hooks do nothing from now on."""
        self.closed = True

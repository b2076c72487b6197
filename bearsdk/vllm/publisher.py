"""The engine-side publisher: captures, formats and delivers snapshots and batch records.

:class:`Publisher` owns the configuration, the transports and the publisher
thread. What runs on vLLM's engine thread is its :attr:`Publisher.hooks`
(``Hooks`` of ``bearsdk.vllm._pub_c``, or of the pure-Python twin
``bearsdk.vllm._pub_py``), which the scheduler plugin
(:mod:`bearsdk.vllm.scheduler`) calls with the scheduler's own objects:

* ``before_schedule(sched)``, at the start of every ``schedule()``: captures
  the resident requests, the state right before the scheduler forms its next
  batch, the state the replay starts from;
* ``after_schedule(output)``: the batch's eq. 12 terms, and (shadow mode) its
  scheduled tokens into the capture's copy of the requests' counters;
* ``before_update(output, model_output)``, when the batch's output reaches
  the scheduler: its tokens into the counters (shadow mode: one per request
  whose chunk completed in it) and its duration, measured from when it was
  scheduled (or, with a batch running ahead of it, from when that one's
  output came back) to now: a ``bear.batch/1`` record;
* ``after_change(sched)``, after an update or an abort: one more capture if
  the engine is left with nothing to schedule (it then sleeps);
* ``preempted(request)``.

The engine thread only captures; the publisher thread formats the JSON and
delivers documents and batch records (``threaded=False`` does it inline: the
hooks then say what to deliver, :meth:`Publisher.deliver`). No hook ever
raises: a failure is logged (the first few with a traceback, then every
thousandth) and counted in :meth:`Publisher.stats`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Final

import attrs

from bearsdk import _twins
from bearsdk.vllm import _pub_py
from bearsdk.vllm._prefix import PoolTracker, PrefixExport, PrefixHooks
from bearsdk.vllm.config import PublisherConfig
from bearsdk.vllm.transports import FileTransport, ShmTransport, Transport

__all__ = [
    "IMPLEMENTATION",
    "INLINE_BATCHES",
    "INLINE_DOCUMENT",
    "Publisher",
    "PublisherStats",
    "implementations",
]

log = logging.getLogger("bearsdk.vllm")

_LOG_FIRST: Final = 3
INLINE_DOCUMENT: Final = 1
INLINE_BATCHES: Final = 2


def implementations() -> dict[str, ModuleType]:
    """Every importable capture implementation by name (tests run against each)."""
    out: dict[str, ModuleType] = {"python": _pub_py}
    compiled = _twins.available("bearsdk.vllm._pub_c")
    if compiled is not None:
        out["cython"] = compiled
    return out


def _default() -> ModuleType:
    return _twins.compiled("bearsdk.vllm._pub_c") or _pub_py


IMPLEMENTATION: Final[str] = str(_default().IMPLEMENTATION)
"""``"cython"`` or ``"python"``: the capture used by default."""


@attrs.frozen
class PublisherStats:
    """A publisher's counters.

    Attributes:
        instance: The instance name.
        epoch: This engine run's id.
        seq: ``seq`` of the last capture.
        captures: Snapshots captured (one per ``schedule()`` call, plus idle ones).
        published: Documents delivered to the transports (fewer than captures
            when the publisher thread skipped to a newer capture).
        batches: Batch records delivered (made while a consumer wanted them).
        failures: Failures (captures, deliveries, batch terms), each logged.
        last_error: The last failure, if any.
        implementation: ``"cython"`` or ``"python"``.
        threaded: Whether a publisher thread formats and delivers.
        shadow: Whether the capture keeps the counters itself (shadow mode).
        mismatches: Counters the shadow had wrong when re-read (repaired then).
        engine_s: Time the engine thread spent in the publisher's hooks
            (their own measure; the scheduler plugin's few Python lines
            around them are not in it).
        transports: The transports' names.
    """

    instance: str
    epoch: str
    seq: int
    captures: int
    published: int
    batches: int
    failures: int
    last_error: str | None
    implementation: str
    threaded: bool
    shadow: bool
    mismatches: int
    engine_s: float
    transports: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """The counters as a JSON-ready mapping."""
        d = attrs.asdict(self)
        d["transports"] = list(self.transports)
        return d


def _open_transports(config: PublisherConfig, epoch: str) -> tuple[list[Transport], list[str]]:
    out: list[Transport] = []
    errors: list[str] = []
    if config.shm_path is not None:
        try:
            out.append(ShmTransport(config.shm_path, config.shm_capacity))
        except (OSError, ValueError) as exc:
            errors.append(f"shm {config.shm_path}: {exc}")
    if config.file is not None:
        try:
            out.append(
                FileTransport(
                    config.file,
                    config.file + ".batches",
                    instance=config.instance,
                    epoch=epoch,
                )
            )
        except OSError as exc:
            errors.append(f"file {config.file}: {exc}")
    return out, errors


class Publisher:
    """Publishes one engine's snapshots and batch records.

    Args:
        config: Destinations and options.
        block_size: Tokens per KV block.
        num_blocks: Blocks in the KV pool.
        free_blocks: Returns the free KV blocks (vLLM's ``get_num_free_blocks``).
        async_scheduling: Whether the scheduler runs ahead of the model
            (placeholders are read only then).
        shadow_safe: Whether the engine's counters move only the ways shadow
            mode follows (see :mod:`bearsdk.vllm.scheduler`); shadow mode is on
            when this and ``config.shadow`` are.
        transports: Destinations to use in addition to the configured ones.
        epoch: This engine run's id (default: random hex).
        prefix_tracker: With prefix caching on, the tracker of the engine's
            block pool: every document then carries ``kv.prefix_cache`` and
            the requests' block fields (:mod:`bearsdk.vllm._prefix`).

    Attributes:
        hooks: The capture twin's hooks.
        engine_hooks: What the scheduler plugin calls on the engine thread
            (``hooks``, plus the pool's capture when ``prefix`` is set).
        prefix: The block pool's export, or None (prefix caching off).
    """

    def __init__(
        self,
        config: PublisherConfig,
        *,
        block_size: int,
        num_blocks: int,
        free_blocks: Callable[[], int],
        async_scheduling: bool,
        shadow_safe: bool = True,
        transports: Sequence[Transport] = (),
        epoch: str | None = None,
        prefix_tracker: PoolTracker | None = None,
    ) -> None:
        self.config = config
        self.instance = config.instance
        self.epoch = epoch if epoch is not None else secrets.token_hex(8)
        impls = implementations()
        mod = impls.get(config.implementation) if config.implementation else _default()
        if mod is None:
            raise ValueError(
                f"capture implementation {config.implementation!r} is not available "
                f"(have {sorted(impls)})"
            )
        self.implementation = str(mod.IMPLEMENTATION)
        self._capture: Any = mod.Capture(
            self.instance,
            self.epoch,
            block_size,
            num_blocks,
            async_scheduling,
            config.threaded,
            config.shadow and shadow_safe,
            config.audit,
            config.poll_us,
        )
        self.hooks: Any = mod.Hooks(
            self._capture,
            free_blocks,
            self._hook_failed,
            config.threaded,
            config.batch_time,
            config.batch_buffer,
        )
        self.prefix: PrefixExport | None = None
        self.engine_hooks: Any = self.hooks
        if prefix_tracker is not None:
            self.prefix = PrefixExport(prefix_tracker, mod.json_head(self.instance, self.epoch))
            self.engine_hooks = PrefixHooks(self.hooks, self.prefix)
        self._lock = threading.Lock()  # the transports list and failure counters
        self._transports: list[Transport] = []
        self._published = 0
        self._delivered_batches = 0
        self._failures = 0
        self._last_error: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        opened, errors = _open_transports(config, self.epoch)
        for err in errors:
            self.record_failure("open transport", err)
        self._transports = [*opened, *transports]
        if config.http is not None:
            from bearsdk.vllm.server import SideServer

            host, port = config.http
            try:
                self._transports.append(
                    SideServer(
                        host,
                        port,
                        instance=self.instance,
                        epoch=self.epoch,
                        heartbeat_s=config.heartbeat_s,
                        batch_buffer=config.batch_buffer,
                        stats=lambda: self.stats().to_dict(),
                    )
                )
            except OSError as exc:
                self.record_failure("open transport", exc)
        self._update_want_terms()
        # The seq 0 document, so that a reader never waits for the first step.
        self._capture.capture([], (), 0, time.time(), free_blocks())
        if self.prefix is not None:
            self.prefix.capture(0, (), ())
        self._capture.encode()
        self._deliver(self._capture.payload())
        if config.threaded:
            self._thread = threading.Thread(
                target=self._run, name=f"bearsdk-publisher-{self.instance}", daemon=True
            )
            self._thread.start()

    # -- delivery -------------------------------------------------------------------

    def deliver(self, what: int) -> None:
        """Inline publishing: deliver what a hook said is ready (its return value)."""
        if what & INLINE_DOCUMENT:
            try:
                self._capture.encode()
                self._deliver(self._capture.payload())
            except Exception as exc:
                self.record_failure("encode", exc)
        if what & INLINE_BATCHES:
            self._deliver_batches()

    def _deliver(self, payload: bytes) -> None:
        prefix = self.prefix
        if prefix is not None:
            failed = prefix.failures
            spliced = prefix.splice(payload)
            if prefix.failures != failed:
                self.record_failure("prefix cache export", str(prefix.last_error))
            if spliced is None:
                return  # superseded: a newer document follows
            payload = spliced
        for t in self._transports:
            try:
                t.send(payload)
            except Exception as exc:
                self.record_failure(f"deliver to {t.name}", exc)
        self._published += 1
        self._update_want_terms()

    def _deliver_batches(self) -> None:
        for rec in self.hooks.take_batches():
            self._delivered_batches += 1
            for t in self._transports:
                if t.wants_batches:
                    try:
                        t.send_batch(rec)
                    except Exception as exc:
                        self.record_failure(f"deliver batch to {t.name}", exc)

    def _update_want_terms(self) -> None:
        # Batch terms cost the engine a little: only while someone wants them.
        # Refreshed with every document, so a new /bear/batches reader is
        # served from the next step on.
        self.hooks.want_terms = self.config.batch_time is not None or any(
            t.wants_batches for t in self._transports
        )

    def _run(self) -> None:
        cap = self._capture
        while True:
            try:
                n = cap.take_and_encode()
            except Exception as exc:
                self.record_failure("encode", exc)
                time.sleep(0.01)  # a persistent failure must not spin
                continue
            if n < 0:
                return
            self._deliver(cap.taken_payload())
            self._deliver_batches()

    def _hook_failed(self, where: str, exc: BaseException) -> None:
        # The hooks counted it already.
        self._log_failure(self.hooks.failures + self._failures, where, exc)

    def record_failure(self, where: str, exc: BaseException | str) -> None:
        """Count and log a failure (never raises); the scheduler plugin reports its own here."""
        with self._lock:
            self._failures += 1
            n = self._failures + self.hooks.failures
        self._log_failure(n, where, exc)

    def _log_failure(self, n: int, where: str, exc: BaseException | str) -> None:
        self._last_error = f"{where}: {exc!r}" if isinstance(exc, BaseException) else exc
        if n <= _LOG_FIRST:
            log.warning(
                "bearsdk publisher %s: %s failed: %s",
                self.instance,
                where,
                exc,
                exc_info=isinstance(exc, BaseException),
            )
        elif n % 1000 == 0:
            log.warning(
                "bearsdk publisher %s: %d failures so far; last: %s",
                self.instance,
                n,
                self._last_error,
            )

    # -- lifecycle ------------------------------------------------------------------

    def add_transport(self, transport: Transport) -> None:
        """Deliver to ``transport`` too, from the next document on."""
        with self._lock:
            self._transports = [*self._transports, transport]
        self._update_want_terms()

    @property
    def transports(self) -> tuple[Transport, ...]:
        """The destinations."""
        return tuple(self._transports)

    @property
    def seq(self) -> int:
        """``seq`` of the last capture."""
        return int(self.hooks.seq)

    def stats(self) -> PublisherStats:
        """The counters so far."""
        return PublisherStats(
            instance=self.instance,
            epoch=self.epoch,
            seq=int(self.hooks.seq),
            captures=int(self.hooks.captures),
            published=self._published,
            batches=self._delivered_batches,
            failures=int(self.hooks.failures) + self._failures,
            last_error=self._last_error,
            implementation=self.implementation,
            threaded=self._thread is not None,
            shadow=bool(self._capture.shadow),
            mismatches=int(self._capture.mismatches),
            engine_s=(int(self.hooks.engine_ns) + (self.prefix.engine_ns if self.prefix else 0))
            / 1e9,
            transports=tuple(t.name for t in self._transports),
        )

    def close(self) -> None:
        """Stop the hooks and the publisher thread, close every transport (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.hooks.close()
        self._capture.close()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self._deliver_batches()
        for t in self._transports:
            try:
                t.close()
            except Exception as exc:
                self.record_failure(f"close {t.name}", exc)

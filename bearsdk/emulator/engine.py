"""The emulated engine: vLLM's engine-core loop, run in real time on a ground-truth clock.

A :class:`~bearsdk.replay.SchedulerCore` bound to a registered policy (``vllm-v1``
by default) forms every batch; :class:`~bearsdk.emulator.timing.GroundTruthTimeModel`
says how long the batch runs on the emulated GPU, and the loop sleeps until then,
so tokens reach clients when the batch completes.

With asynchronous scheduling (vLLM's default) the loop mirrors ``EngineCore``'s
batch queue: batch ``k + 1`` is scheduled, with placeholders for batch ``k``'s
tokens, while batch ``k`` still runs, and batch ``k``'s outputs are processed
when it completes. The emulator schedules batch ``k + 1`` *just in time*
(``schedule_lead_s`` before batch ``k`` completes, the latest moment that keeps
the GPU busy) rather than right after processing batch ``k - 1``, so that the
snapshot it publishes after processing a batch (one batch in flight, as
``bear.snapshot/1`` describes) stays exact for requests that arrive during
almost the whole step. Without asynchronous scheduling, the snapshot is
published right after scheduling, with that batch in flight. Either way a replay
from the latest snapshot, with a new request appended to the waiting queue,
forms the batches the engine forms next (``tests/test_emulator_replay.py``).
"""

from __future__ import annotations

import math
import secrets
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import attrs

from bearsdk.emulator._lifecycle import start_running, stop_running
from bearsdk.emulator.faults import Faults
from bearsdk.emulator.hubs import BatchHub, PublishedSnapshot, SnapshotHub
from bearsdk.emulator.metrics import EngineMetrics, GaugeValues
from bearsdk.emulator.profiles import EmulatorProfile, get_profile
from bearsdk.emulator.text import Tokenizer, filler_tokens
from bearsdk.emulator.timing import BatchShape, GroundTruthParams, GroundTruthTimeModel
from bearsdk.errors import BearError
from bearsdk.replay import ScheduledBatch, SchedulerCore
from bearsdk.schedulers import Policy, get_scheduler
from bearsdk.schedulers import policy as bind_policy

if TYPE_CHECKING:
    from bearsdk.emulator.server import HttpServer
    from bearsdk.estimators.batch_time import BatchTimeModel

__all__ = [
    "EmulatedEngine",
    "EngineConfig",
    "EngineConfigError",
    "GenerationPlan",
    "LoopStats",
    "RequestHandle",
    "RequestRecord",
]

_LAG_SAMPLES: Final = 100_000


class EngineConfigError(BearError, ValueError):
    """An engine configuration is invalid (the message names the field and value)."""


def _config_check(cond: bool, field: str, message: str, value: object) -> None:
    if not cond:
        raise EngineConfigError(f"{field} {message} (got {value!r})")


@attrs.frozen
class EngineConfig:
    """How to run one emulated engine instance.

    Attributes:
        profile: Emulator profile (``bearsdk emulate --list-profiles``).
        scheduler: Registered scheduler policy that forms the batches.
        params: Policy parameter overrides, named as the engine's flags
            (``max_num_batched_tokens``, ``max_num_seqs``, ``num_gpu_blocks``, ...).
            vLLM-named flags the policy has default to what ``vllm serve`` picks
            on the profile's hardware.
        instance: Instance name in snapshots (default ``<profile>-0``).
        served_model_name: Model name in the API (default: the profile's model).
        host: Address to bind.
        port: Port to bind (0: any free port).
        seed: Seeds batch-time noise and fault draws.
        time_model: Ground-truth time-model constants (noise, overheads, speed).
        schedule_lead_s: How long before the running batch completes the next one
            is scheduled (async scheduling).
        publish_output_len: Put each request's true ``output_len`` in snapshots (tests).
        heartbeat_s: Empty line on push streams after this long without data.
        batch_buffer: Unsent records a ``/bear/batches`` reader may have.
        log_size: Finished-request and batch records kept in memory.
        serve_http: Serve the HTTP API (``False``: in-process use only).
        answer_lengths: Known answers: the natural output length, in tokens, of
            prompts whose text (a completion's prompt, a chat's last user
            message) is a key, as when replaying a dataset's real answers
            (``bearsdk demo --workload alpaca-eval``). Other prompts draw from the
            profile's length model; ``bear_output_len`` still overrides both.
    """

    profile: str = "qwen3-8b-h100"
    scheduler: str = "vllm-v1"
    params: Mapping[str, object] = attrs.field(factory=dict, hash=False)
    instance: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    time_model: GroundTruthParams = attrs.field(factory=GroundTruthParams)
    schedule_lead_s: float = 0.002
    publish_output_len: bool = False
    heartbeat_s: float = 1.0
    batch_buffer: int = 4096
    log_size: int = 10_000
    serve_http: bool = True
    answer_lengths: Mapping[str, int] = attrs.field(factory=dict, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        _config_check(0 <= self.port <= 65535, "port", "must be in [0, 65535]", self.port)
        lead = self.schedule_lead_s
        _config_check(math.isfinite(lead) and lead >= 0, "schedule_lead_s", "must be >= 0", lead)
        hb = self.heartbeat_s
        _config_check(math.isfinite(hb) and hb > 0, "heartbeat_s", "must be > 0", hb)
        _config_check(self.batch_buffer >= 1, "batch_buffer", "must be >= 1", self.batch_buffer)
        _config_check(self.log_size >= 1, "log_size", "must be >= 1", self.log_size)
        if not isinstance(self.params, Mapping):
            raise EngineConfigError(f"params must be a mapping (got {self.params!r})")
        if not isinstance(self.answer_lengths, Mapping):
            raise EngineConfigError(
                f"answer_lengths must be a mapping (got {type(self.answer_lengths).__name__})"
            )
        for text, n in self.answer_lengths.items():
            if not isinstance(text, str) or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise EngineConfigError(
                    f"answer_lengths[{str(text)[:40]!r}] must map a str to an int >= 1 (got {n!r})"
                )


@attrs.frozen
class GenerationPlan:
    """What a request will generate, fixed at arrival (the emulator knows the future).

    Attributes:
        prompt_tokens: Prompt length.
        max_tokens: Effective output cap (``max_tokens`` clamped to the context).
        output_len: True output length (``<= max_tokens``).
        texts: Text of each output token (an end-of-sequence token is ``""``;
            text from a stop string on is cut).
        finish_reason: ``"stop"`` or ``"length"``.
        stop_reason: The stop string that ended it, if any.
        requested_max_tokens: ``max_tokens`` as requested (metrics).
    """

    prompt_tokens: int
    max_tokens: int
    output_len: int
    texts: tuple[str, ...]
    finish_reason: str
    stop_reason: str | None = None
    requested_max_tokens: int | None = None


@attrs.frozen
class RequestRecord:
    """A finished request, as the engine timed it (loop clock, seconds).

    Attributes:
        id: Request id.
        prompt_tokens: Prompt length.
        output_tokens: Tokens generated.
        finish_reason: ``stop``, ``length`` or ``abort``.
        arrival: When the engine received it.
        first_token: When its first token was emitted (``None``: never).
        finished: When it finished.
        first_token_batch: 1-based index (since engine start) of the batch that sampled
            its first token (0: never).
    """

    id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    arrival: float
    first_token: float | None
    finished: float
    first_token_batch: int

    @property
    def ttft(self) -> float | None:
        """Time to first token as the engine measured it."""
        return None if self.first_token is None else self.first_token - self.arrival


@attrs.define(eq=False)
class RequestHandle:
    """A request in flight: the engine appends tokens, the HTTP layer streams them.

    Attributes:
        id: Engine request id.
        plan: What it generates.
        arrival: Loop clock at arrival.
        produced: Output tokens emitted so far.
        token_times: Loop clock at each emitted token.
        done: Finished (or aborted).
        finish_reason: ``stop``, ``length``, ``abort`` (when done).
        dropped: The connection must be dropped (engine restart).
        first_token_batch: Batch index that sampled its first token (0: not yet).
        scheduled_at: Loop clock when first scheduled (``None``: not yet).
    """

    id: str
    plan: GenerationPlan
    arrival: float
    produced: int = 0
    token_times: list[float] = attrs.field(factory=list)
    done: bool = False
    finish_reason: str | None = None
    dropped: bool = False
    first_token_batch: int = 0
    scheduled_at: float | None = None
    _event: anyio.Event | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length."""
        return self.plan.prompt_tokens

    @property
    def ttft(self) -> float | None:
        """Engine-measured time to first token (``None`` before it)."""
        return self.token_times[0] - self.arrival if self.token_times else None

    def text(self, start: int = 0, stop: int | None = None) -> str:
        """Concatenated text of output tokens ``start..stop``."""
        return "".join(self.plan.texts[start : self.produced if stop is None else stop])

    def notify(self) -> None:
        """Wake the task waiting on this request."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def changed(self) -> None:
        """Wait until a token arrives or the request ends (returns at once if it has)."""
        if self.done:
            return
        self._event = anyio.Event()
        await self._event.wait()

    async def result(self) -> RequestHandle:
        """Wait until the request is done; return itself."""
        while not self.done:
            await self.changed()
        return self


@attrs.frozen
class LoopStats:
    """How well the engine loop kept real time.

    Attributes:
        steps: Batches completed.
        lag_median_s: Median lateness of the loop waking for a batch's completion.
        lag_p99_s: Its 99th percentile.
        lag_max_s: Its maximum.
        idle_gpu_s: Time the emulated GPU idled although work was waiting, because
            the loop scheduled late (CPU-bound emulator).
    """

    steps: int
    lag_median_s: float
    lag_p99_s: float
    lag_max_s: float
    idle_gpu_s: float


@attrs.define(eq=False)
class _InFlight:
    batch: ScheduledBatch
    start: float
    end: float
    shape: BatchShape | None


def _defaults_for(
    spec_params: Mapping[str, object], profile: EmulatorProfile, user: Mapping[str, object]
) -> dict[str, object]:
    """Profile-derived defaults for the flags a scheduler spec takes, under the user's.

    Every scheduler with vLLM's KV flags gets the profile's pool size, and its
    context length when the spec leaves ``max_model_len`` at 0; ``vllm serve``'s
    hardware-dependent token budget and sequence cap apply to specs that take
    vLLM V1's flags (``long_prefill_token_threshold`` among them).
    """
    block = user.get("block_size", spec_params.get("block_size", 16))
    try:
        block_size = max(int(str(block)), 1)
    except ValueError:
        block_size = 16
    defaults = profile.engine_defaults(block_size)
    out: dict[str, object] = {}
    if "num_gpu_blocks" in spec_params:
        out["num_gpu_blocks"] = defaults["num_gpu_blocks"]
    if spec_params.get("max_model_len") == 0:
        out["max_model_len"] = defaults["max_model_len"]
    if "long_prefill_token_threshold" in spec_params:
        for k in ("max_num_batched_tokens", "max_num_seqs"):
            if k in spec_params:
                out[k] = defaults[k]
    out.update(user)
    return out


def _bind(config: EngineConfig, profile: EmulatorProfile) -> tuple[Policy, int]:
    spec = get_scheduler(config.scheduler)
    pol = bind_policy(config.scheduler, _defaults_for(dict(spec.params), profile, config.params))
    if pol.num_blocks <= 0:
        pol = pol.with_kv(pol.block_size, profile.num_gpu_blocks(pol.block_size))
    mml = pol.max_model_len if pol.max_model_len > 0 else profile.max_model_len
    usable = (pol.num_blocks - pol.reserved_blocks) * pol.block_size
    if usable < mml:
        raise EngineConfigError(
            f"the KV pool holds {usable} tokens ({pol.num_blocks} blocks of {pol.block_size}), "
            f"fewer than max_model_len={mml}: lower max_model_len or raise num_gpu_blocks"
        )
    return pol, mml


@attrs.define(eq=False)
class EmulatedEngine:
    """One emulated vLLM instance: engine loop, HTTP API, snapshots, metrics, faults.

    Use as an async context manager (starts the loop and, unless
    ``serve_http=False``, the HTTP server; stops both on exit), or run
    :meth:`run` in a task group with ``await tg.start(engine.run)``.

    Args:
        config: How to run it.

    Raises:
        EngineConfigError: The configuration is invalid.
        KeyError: Unknown profile.
        SpecError: Unknown scheduler or bad policy parameter.
    """

    _config: EngineConfig = attrs.field(factory=EngineConfig)
    _profile: EmulatorProfile = attrs.field(init=False)
    _policy: Policy = attrs.field(init=False)
    _max_model_len: int = attrs.field(init=False)
    _timer: GroundTruthTimeModel = attrs.field(init=False)
    _tokenizer: Tokenizer = attrs.field(init=False)
    _faults: Faults = attrs.field(init=False)
    _metrics: EngineMetrics = attrs.field(init=False)
    _snapshots: SnapshotHub = attrs.field(init=False)
    _batch_hub: BatchHub = attrs.field(init=False)
    _core: SchedulerCore = attrs.field(init=False)
    _depth: int = attrs.field(init=False)
    _reqs: dict[str, RequestHandle] = attrs.field(init=False, factory=dict)
    _queue: deque[_InFlight] = attrs.field(init=False, factory=deque)
    _gpu_free: float = attrs.field(init=False, default=0.0)
    _wake: anyio.Event | None = attrs.field(init=False, default=None)
    _epoch: str = attrs.field(init=False, default="")
    _seq: int = attrs.field(init=False, default=0)
    _batches: int = attrs.field(init=False, default=0)
    _next_id: int = attrs.field(init=False, default=0)
    _version: int = attrs.field(init=False, default=0)
    _published_version: int = attrs.field(init=False, default=-1)
    _captured: PublishedSnapshot | None = attrs.field(init=False, default=None)
    _delayed: deque[PublishedSnapshot] = attrs.field(init=False, factory=deque)
    _delay_event: anyio.Event | None = attrs.field(init=False, default=None)
    _lags: deque[float] = attrs.field(init=False, factory=lambda: deque(maxlen=_LAG_SAMPLES))
    _steps: int = attrs.field(init=False, default=0)
    _idle_gpu_s: float = attrs.field(init=False, default=0.0)
    _request_log: deque[RequestRecord] = attrs.field(init=False)
    _batch_log: deque[dict[str, Any]] = attrs.field(init=False)
    _http: HttpServer | None = attrs.field(init=False, default=None)
    _loop_scope: anyio.CancelScope | None = attrs.field(init=False, default=None)
    _tg: anyio.abc.TaskGroup | None = attrs.field(init=False, default=None)
    _run_tg: anyio.abc.TaskGroup | None = attrs.field(init=False, default=None)
    _running: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        cfg = self._config
        self._profile = get_profile(cfg.profile)
        self._policy, self._max_model_len = _bind(cfg, self._profile)
        self._depth = 2 if self._policy.async_scheduling else 1
        self._timer = GroundTruthTimeModel(self._profile, cfg.time_model, cfg.seed)
        self._tokenizer = Tokenizer(self._profile.arch.vocab)
        self._faults = Faults(seed=cfg.seed)
        p = self._policy
        self._metrics = EngineMetrics(
            self.model_name,
            self._max_model_len,
            {
                "block_size": str(p.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": "False",
                "gpu_memory_utilization": "0.92",
                "num_cpu_blocks": "None",
                "num_gpu_blocks": str(p.num_blocks),
                "num_gpu_blocks_override": "None",
            },
        )
        self._request_log = deque(maxlen=cfg.log_size)
        self._batch_log = deque(maxlen=cfg.log_size)
        self._batch_hub = BatchHub(cfg.batch_buffer)
        self._reset_state()

    def _reset_state(self) -> None:
        self._core = SchedulerCore(self._policy)
        self._reqs.clear()
        self._queue.clear()
        self._gpu_free = 0.0
        self._epoch = secrets.token_hex(8)
        self._seq = 0
        self._batches = 0
        self._version = 0
        self._published_version = -1
        self._delayed.clear()
        self._metrics.reset()
        first = PublishedSnapshot(0, self._snapshot_doc(None, 0.0), 0, 0.0)
        self._captured = first
        if hasattr(self, "_snapshots"):
            self._snapshots.publish(first)
        else:
            self._snapshots = SnapshotHub(first)

    # -- properties -----------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The configuration."""
        return self._config

    @property
    def profile(self) -> EmulatorProfile:
        """The emulated model/GPU profile."""
        return self._profile

    @property
    def policy(self) -> Policy:
        """The bound scheduler policy (with the engine's KV geometry)."""
        return self._policy

    @property
    def max_model_len(self) -> int:
        """Context length the engine accepts."""
        return self._max_model_len

    @property
    def instance(self) -> str:
        """Instance name in snapshots."""
        return self._config.instance or f"{self._config.profile}-0"

    @property
    def model_name(self) -> str:
        """Served model name."""
        return self._config.served_model_name or self._profile.model

    @property
    def tokenizer(self) -> Tokenizer:
        """The stand-in tokenizer."""
        return self._tokenizer

    def answer_length(self, text: str) -> int | None:
        """The known natural output length of a prompt (``EngineConfig.answer_lengths``)."""
        return self._config.answer_lengths.get(text)

    @property
    def time_model(self) -> GroundTruthTimeModel:
        """The ground-truth batch-time model."""
        return self._timer

    def calibrated_batch_time(self) -> BatchTimeModel:
        """Eq. 12 coefficients from a profiling sweep of this engine's own GPU, within its
        scheduler's token and sequence budgets (what ``bearsdk calibrate`` would fit)."""
        return self._timer.fit_eq12(
            max_batched_tokens=self._policy.token_budget, max_seqs=self._policy.max_seqs
        )

    @property
    def faults(self) -> Faults:
        """Fault settings (mutable)."""
        return self._faults

    @property
    def metrics(self) -> EngineMetrics:
        """The Prometheus metrics."""
        return self._metrics

    @property
    def epoch(self) -> str:
        """Identifies this run of the engine (changes on restart)."""
        return self._epoch

    @property
    def snapshots(self) -> SnapshotHub:
        """Published snapshots (after any publishing delay)."""
        return self._snapshots

    @property
    def batch_hub(self) -> BatchHub:
        """Batch-record readers."""
        return self._batch_hub

    @property
    def latest_snapshot(self) -> PublishedSnapshot:
        """The latest published snapshot, as readers see it."""
        return self._snapshots.latest

    @property
    def captured_snapshot(self) -> PublishedSnapshot:
        """The latest captured snapshot (before any publishing delay)."""
        assert self._captured is not None
        return self._captured

    @property
    def snapshot_current(self) -> bool:
        """Whether nothing changed since the latest snapshot was captured."""
        return self._published_version == self._version

    @property
    def batches_scheduled(self) -> int:
        """Non-empty batches scheduled since start (or restart)."""
        return self._batches

    @property
    def num_running(self) -> int:
        """Running requests."""
        return self._core.num_running

    @property
    def num_waiting(self) -> int:
        """Waiting requests."""
        return self._core.num_waiting

    @property
    def request_log(self) -> Sequence[RequestRecord]:
        """Recently finished requests (bounded by ``log_size``)."""
        return self._request_log

    def request(self, rid: str) -> RequestHandle | None:
        """The handle of a resident (waiting or running) request, ``None`` if not resident."""
        return self._reqs.get(rid)

    @property
    def batch_log(self) -> Sequence[dict[str, Any]]:
        """Recent ``bear.batch/1`` records (bounded by ``log_size``)."""
        return self._batch_log

    @property
    def port(self) -> int:
        """The bound HTTP port (after start)."""
        if self._http is None:
            raise RuntimeError("the engine's HTTP server is not running")
        return self._http.port

    @property
    def url(self) -> str:
        """Base URL of the HTTP API (after start)."""
        host = self._config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def gauges(self) -> GaugeValues:
        """Running/waiting counts and KV usage, as ``/metrics`` reports them."""
        core, p = self._core, self._policy
        total = p.num_blocks - p.reserved_blocks
        usage = 1.0 - core.free_blocks / total if total > 0 else 0.0
        return GaugeValues(core.num_running, core.num_waiting, usage)

    def loop_stats(self) -> LoopStats:
        """Lateness of the loop against real time, over the recent steps."""
        lags = sorted(self._lags)
        if not lags:
            return LoopStats(self._steps, 0.0, 0.0, 0.0, self._idle_gpu_s)
        p99 = lags[min(len(lags) - 1, round(0.99 * (len(lags) - 1)))]
        return LoopStats(self._steps, statistics.median(lags), p99, lags[-1], self._idle_gpu_s)

    def lag_samples(self) -> list[float]:
        """The recent per-step lateness samples (seconds)."""
        return list(self._lags)

    def reset_loop_stats(self) -> None:
        """Forget lag samples (e.g. after a warm-up)."""
        self._lags.clear()
        self._idle_gpu_s = 0.0

    # -- requests ---------------------------------------------------------------------

    def plan(
        self,
        prompt_tokens: int,
        *,
        natural_len: int,
        max_tokens: int | None = None,
        seed: int = 0,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
    ) -> GenerationPlan:
        """Fix what a request generates.

        Args:
            prompt_tokens: Prompt length (``<= max_model_len - 1``; validated by callers).
            natural_len: Where the model would stop by itself (end of sequence).
            max_tokens: Requested cap (``None``: the context's remainder).
            seed: Seeds the filler text.
            stop: Stop strings.
            ignore_eos: Generate until the cap.
            min_tokens: No end of sequence before this many tokens.
        """
        cap = self._max_model_len - prompt_tokens
        if max_tokens is not None:
            cap = min(cap, max_tokens)
        cap = max(cap, 1)
        natural = cap if ignore_eos else max(natural_len, min_tokens, 1)
        n = min(natural, cap)
        finish = "stop" if natural <= cap and not ignore_eos else "length"
        texts = filler_tokens(n, seed)
        if finish == "stop":
            texts[-1] = ""  # the end-of-sequence token has no text
        stop_reason = None
        if stop:
            n, texts, hit = _apply_stop(texts, stop)
            if hit is not None:
                finish, stop_reason = "stop", hit
        return GenerationPlan(prompt_tokens, cap, n, tuple(texts), finish, stop_reason, max_tokens)

    def submit(self, plan: GenerationPlan, request_id: str | None = None) -> RequestHandle:
        """Add a request to the waiting queue.

        Args:
            plan: What it generates (see :meth:`plan`).
            request_id: Engine id (default: a fresh ``req-N``); made unique if resident.

        Returns:
            Its handle.

        Raises:
            ValueError: The prompt does not fit the context.
        """
        if plan.prompt_tokens >= self._max_model_len or plan.prompt_tokens < 1:
            raise ValueError(
                f"prompt_tokens must be in [1, {self._max_model_len - 1}] "
                f"(got {plan.prompt_tokens})"
            )
        self._next_id += 1
        rid = request_id or f"req-{self._next_id}"
        if rid in self._reqs:
            rid = f"{rid}-{self._next_id}"
        h = RequestHandle(rid, plan, anyio.current_time())
        self._core.add_request(rid, plan.prompt_tokens, plan.output_len, plan.max_tokens)
        self._reqs[rid] = h
        m = self._metrics
        m.observe("vllm:request_params_n", 1)
        if plan.requested_max_tokens is not None:
            m.observe("vllm:request_params_max_tokens", plan.requested_max_tokens)
        m.observe("vllm:request_max_num_generation_tokens", plan.max_tokens)
        self._touch()
        return h

    def submit_tokens(
        self,
        prompt_tokens: int,
        output_len: int,
        *,
        max_tokens: int | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Submit a request by lengths alone (tests, simulations): shorthand for
        :meth:`plan` with ``natural_len=output_len`` and :meth:`submit`."""
        plan = self.plan(prompt_tokens, natural_len=output_len, max_tokens=max_tokens)
        return self.submit(plan, request_id)

    def abort(self, rid: str, *, reason: str = "abort") -> bool:
        """Abort a resident request (client gone); ``False`` if it is not resident."""
        h = self._reqs.pop(rid, None)
        if h is None:
            return False
        self._core.abort_request(rid)
        self._finish(h, reason, anyio.current_time())
        self._touch()
        return True

    def _touch(self) -> None:
        self._version += 1
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    def _finish(self, h: RequestHandle, reason: str, now: float) -> None:
        h.done = True
        h.finish_reason = reason
        h.notify()
        m = self._metrics
        m.success[reason if reason in m.success else "abort"] += 1
        e2e = now - h.arrival
        m.observe("vllm:e2e_request_latency_seconds", e2e)
        if reason != "abort":
            m.observe("vllm:request_prompt_tokens", h.plan.prompt_tokens)
            m.observe("vllm:request_generation_tokens", h.produced)
            if h.scheduled_at is not None:
                m.observe("vllm:request_queue_time_seconds", h.scheduled_at - h.arrival)
                m.observe("vllm:request_inference_time_seconds", now - h.scheduled_at)
                if h.token_times:
                    m.observe(
                        "vllm:request_prefill_time_seconds", h.token_times[0] - h.scheduled_at
                    )
            if len(h.token_times) > 1:
                decode = h.token_times[-1] - h.token_times[0]
                m.observe("vllm:request_decode_time_seconds", decode)
                m.observe(
                    "vllm:request_time_per_output_token_seconds",
                    decode / (len(h.token_times) - 1),
                )
        self._request_log.append(
            RequestRecord(
                h.id,
                h.plan.prompt_tokens,
                h.produced,
                reason,
                h.arrival,
                h.token_times[0] if h.token_times else None,
                now,
                h.first_token_batch,
            )
        )

    # -- snapshots --------------------------------------------------------------------

    def _snapshot_doc(self, inflight: _InFlight | None, now: float) -> dict[str, Any]:
        doc = self._core.snapshot(
            instance=self.instance,
            seq=self._seq,
            time=time.time(),
            output_len=self._config.publish_output_len,
        )
        doc["epoch"] = self._epoch
        if inflight is not None and inflight.shape is not None:
            doc["inflight"] = {"remaining_s": max(0.0, inflight.end - now)}
            if self._depth == 1:
                # A synchronous core counts the in-flight batch's tokens as computed
                # but has no placeholders: give its sampled tokens theirs, as the
                # snapshot contract describes the batch in flight.
                sampled = set(inflight.batch.sampling)
                for r in doc["requests"]:
                    if r["id"] in sampled and r["state"] == "running":
                        r["placeholders"] = r.get("placeholders", 0) + 1
        return doc

    def _publish(self, inflight: _InFlight | None) -> None:
        if self._published_version == self._version:
            return
        now = anyio.current_time()
        self._seq += 1
        snap = PublishedSnapshot(self._seq, self._snapshot_doc(inflight, now), self._batches, now)
        self._captured = snap
        self._published_version = self._version
        if self._faults.snapshot_delay_s > 0 or self._delayed:
            self._delayed.append(snap)
            if self._delay_event is not None:
                self._delay_event.set()
                self._delay_event = None
        else:
            self._snapshots.publish(snap)

    async def _delay_line(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        while True:
            while not self._delayed:
                self._delay_event = anyio.Event()
                await self._delay_event.wait()
            snap = self._delayed[0]
            await anyio.sleep_until(snap.captured_at + self._faults.snapshot_delay_s)
            if self._delayed and self._delayed[0] is snap:
                self._delayed.popleft()
                self._snapshots.publish(snap)

    # -- the engine loop --------------------------------------------------------------

    def _launch(self, b: ScheduledBatch) -> _InFlight:
        now = anyio.current_time()
        if not b:
            return _InFlight(b, now, now, None)
        self._batches += 1
        self._version += 1
        shape = BatchShape(b.pre, b.dec, b.dctx, b.patt, len(b.sched), len(b.sampled))
        dur = self._timer.sample(shape) + self._faults.take_stall()
        start = max(now, self._gpu_free)
        if self._queue and now > self._gpu_free:
            self._idle_gpu_s += now - self._gpu_free
        end = start + dur
        self._gpu_free = end
        k = self._batches
        reqs = self._reqs
        for rid in b.sampling:
            h = reqs.get(rid)
            if h is not None and h.first_token_batch == 0:
                h.first_token_batch = k
        if b.admitted:
            for rid in b.tokens:
                h = reqs.get(rid)
                if h is not None and h.scheduled_at is None:
                    h.scheduled_at = now
        m = self._metrics
        m.observe("vllm:iteration_tokens_total", b.pre + b.dec)
        if b.preempted:
            m.inc("vllm:num_preemptions", len(b.preempted))
        return _InFlight(b, start, end, shape)

    def _complete(self, f: _InFlight) -> None:
        out = self._core.process(f.batch)
        self._version += 1
        now = anyio.current_time()
        if f.shape is not None:
            self._steps += 1
            self._record_batch(f)
        m = self._metrics
        reqs = self._reqs
        if out.tokens:
            m.inc("vllm:generation_tokens", len(out.tokens))
        itl = m.histograms["vllm:inter_token_latency_seconds"]
        for rid in out.tokens:
            h = reqs.get(rid)
            if h is None:
                continue
            times = h.token_times
            if times:
                itl.observe(now - times[-1])
            else:
                m.observe("vllm:time_to_first_token_seconds", now - h.arrival)
                m.inc("vllm:prompt_tokens", h.plan.prompt_tokens)
            times.append(now)
            h.produced += 1
            h.notify()
        for rid in out.finished:
            h = reqs.pop(rid, None)
            if h is not None:
                self._finish(h, h.plan.finish_reason, now)

    def _record_batch(self, f: _InFlight) -> None:
        s = f.shape
        assert s is not None
        rec = {
            "schema": "bear.batch/1",
            "instance": self.instance,
            "epoch": self._epoch,
            "time": time.time(),
            "num_seqs": s.num_seqs,
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
            "decode_context": s.decode_context,
            "prefill_attention": s.prefill_attention,
            "duration_s": f.end - f.start,
        }
        self._batch_log.append(rec)
        if self._batch_hub.has_readers:
            self._batch_hub.publish(rec)

    async def _sleep_until(self, deadline: float, *, measure: bool) -> None:
        await anyio.sleep_until(deadline)
        if measure:
            self._lags.append(max(0.0, anyio.current_time() - deadline))

    async def _engine_loop(self) -> None:
        core, q, depth = self._core, self._queue, self._depth
        lead = self._config.schedule_lead_s
        while True:
            if len(q) >= depth:
                f = q.popleft()
                if f.shape is not None:
                    await self._sleep_until(f.end, measure=True)
                self._complete(f)
                if depth > 1:
                    self._publish(q[0] if q else None)
                continue
            if q:
                head = q[0]
                if head.shape is not None:
                    await self._sleep_until(
                        head.end - min(lead, 0.8 * (head.end - head.start)), measure=False
                    )
            b = core.schedule()
            if not b and all(x.batch.inert() for x in q):
                # Nothing scheduled and nothing in flight that could change that:
                # sleep until a request arrives or leaves.
                while q:
                    self._complete(q.popleft())
                self._publish(None)
                if self._published_version == self._version:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                continue
            f = self._launch(b)
            q.append(f)
            if depth == 1 or len(q) == 1:
                self._publish(f)

    async def _supervise(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        while True:
            with anyio.CancelScope() as scope:
                self._loop_scope = scope
                await self._engine_loop()
            # The loop was cancelled for a restart: the state is already reset.

    # -- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[EmulatedEngine]) -> None:
        """Run the engine (and its HTTP server) until cancelled.

        Use with ``await task_group.start(engine.run)``: it reports ready once the
        port is bound.
        """
        if self._running:
            raise RuntimeError("this engine is already running")
        self._running = True
        try:
            if self._config.serve_http:
                from bearsdk.emulator.server import HttpServer

                # Bind before anything else runs, so that a port in use fails plainly.
                self._http = HttpServer(self)
                await self._http.start(self._config.host, self._config.port)
            try:
                async with anyio.create_task_group() as tg:
                    self._run_tg = tg
                    await tg.start(self._supervise)
                    await tg.start(self._delay_line)
                    task_status.started(self)
                    await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await self._shutdown()
        finally:
            self._running = False
            self._run_tg = None

    def request_restart(self, downtime_s: float = 0.0) -> None:
        """Start :meth:`restart` in the background (for callers a restart would wait on,
        such as an HTTP handler: stopping the server waits for its handlers)."""
        if self._run_tg is None:
            raise RuntimeError("the engine is not running")
        self._run_tg.start_soon(self.restart, downtime_s)

    async def _shutdown(self) -> None:
        for h in list(self._reqs.values()):
            h.dropped = True
            self.abort(h.id)
        self._snapshots.close()
        self._batch_hub.close()
        if self._http is not None:
            await self._http.stop()

    async def restart(self, downtime_s: float = 0.0) -> None:
        """Emulate an engine restart.

        Every open connection drops, the port refuses connections for
        ``downtime_s``, and the engine comes back with no requests, a new
        ``epoch``, ``seq`` starting over at 0 and zeroed metrics.
        """
        _config_check(
            math.isfinite(downtime_s) and downtime_s >= 0, "downtime_s", "must be >= 0", downtime_s
        )
        # Everything synchronous first: the loop, cancelled here, restarts on the
        # fresh state the next time it runs.
        if self._loop_scope is not None:
            self._loop_scope.cancel()
        for h in list(self._reqs.values()):
            h.dropped = True
            h.done = True
            h.finish_reason = "abort"
            h.notify()
        self._snapshots.close()
        self._batch_hub.close()
        self._snapshots = SnapshotHub(self._snapshots.latest)
        self._batch_hub = BatchHub(self._config.batch_buffer)
        self._reset_state()
        if self._http is None:
            await anyio.sleep(downtime_s)
            return
        port = self._http.port
        await self._http.stop()
        await anyio.sleep(downtime_s)
        await self._http.start(self._config.host, port)

    async def __aenter__(self) -> EmulatedEngine:
        self._tg = await start_running(self.run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        assert tg is not None
        return await stop_running(tg, exc_type, exc, tb)


def _apply_stop(texts: list[str], stops: Sequence[str]) -> tuple[int, list[str], str | None]:
    """Cut the output at the first stop string (its text excluded, as vLLM does)."""
    full = "".join(texts)
    best_end, best_start, hit = len(full) + 1, 0, None
    for s in stops:
        if not s:
            continue
        i = full.find(s)
        if i >= 0 and i + len(s) < best_end:
            best_end, best_start, hit = i + len(s), i, s
    if hit is None:
        return len(texts), texts, None
    out: list[str] = []
    pos = 0
    for t in texts:
        nxt = pos + len(t)
        out.append(full[min(pos, best_start) : min(nxt, best_start)])
        pos = nxt
        if pos >= best_end:
            break
    return len(out), out, hit

"""Prometheus metrics of an emulated engine, with vLLM 0.33's names, labels and buckets.

A small self-contained registry (one per engine, so several engines in one process
never share state) rendered in the Prometheus text exposition format the way
``prometheus_client`` renders vLLM's (``name_total`` counter families and
``name_created`` gauges, cumulative ``_bucket`` samples, labels sorted, Go-style
float formatting), so
scrapers and ``prometheus_client``'s parser read it as they read vLLM's
``/metrics``. Gauges are sampled from the engine at scrape time.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from bearsdk.emulator.requests import GenerationPlan, RequestHandle
    from bearsdk.replay.blocks import BlockPool
    from bearsdk.schedulers import Policy

__all__ = [
    "CONTENT_TYPE",
    "FINISH_REASONS",
    "EngineMetrics",
    "Histogram",
    "request_tokens_buckets",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")

# vLLM 0.33 default buckets (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
REQUEST_PARAMS_N_BUCKETS: Final = (1, 2, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series capped at ``max_model_len`` (token-count histograms)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > max_model_len:
                return tuple(out)
            out.append(v)
        scale *= 10


def go_float(v: float) -> str:
    """Format a float as the Prometheus Go client (and ``prometheus_client``) does."""
    if v == float("inf"):
        return "+Inf"
    if v == float("-inf"):
        return "-Inf"
    if v != v:
        return "NaN"
    s = repr(float(v))
    dot = s.find(".")
    if v > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs)) + "}"


@attrs.define
class Histogram:
    """One labelled histogram series.

    Attributes:
        bounds: Upper bounds of the finite buckets, ascending.
    """

    bounds: tuple[float, ...]
    _counts: list[int] = attrs.field(init=False)
    _sum: float = attrs.field(init=False, default=0.0)
    _count: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value
        self._count += 1

    @property
    def count(self) -> int:
        """Observations recorded."""
        return self._count

    @property
    def sum(self) -> float:
        """Sum of the observations."""
        return self._sum

    def render(self, name: str, labels: Sequence[tuple[str, str]]) -> list[str]:
        """Exposition lines of this series (buckets cumulative, then count and sum)."""
        lines = []
        acc = 0
        for bound, c in zip((*self.bounds, float("inf")), self._counts, strict=True):
            acc += c
            lines.append(f"{name}_bucket{_labels((*labels, ('le', go_float(bound))))} {acc}.0")
        lab = _labels(labels)
        lines.append(f"{name}_count{lab} {self._count}.0")
        lines.append(f"{name}_sum{lab} {go_float(self._sum)}")
        return lines


_HISTOGRAMS: Final = (
    # name, help, bucket family
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iter"),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "tokens",
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "tokens"),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "itl",
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "lat"),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        "lat",
    ),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "lat",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "lat",
    ),
    (
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        "lat",
    ),
)
_COUNTERS: Final = (
    # Registered (and 0) with the cache off too, as in vLLM (v1/metrics/loggers.py:661-678).
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
)


@attrs.frozen
class GaugeValues:
    """Scheduler state sampled at scrape time.

    Attributes:
        running: Requests in model execution batches.
        waiting: Requests waiting to be processed.
        kv_cache_usage: Fraction of KV blocks in use (1 means 100 percent).
    """

    running: int
    waiting: int
    kv_cache_usage: float


@attrs.define
class EngineMetrics:
    """All metrics of one engine (labels ``model_name`` and ``engine="0"``, as vLLM).

    Args:
        model_name: The served model name.
        max_model_len: Caps the token-count buckets.
        cache_info: Labels of ``vllm:cache_config_info`` (CacheConfig fields as strings).
    """

    model_name: str
    max_model_len: int
    cache_info: Mapping[str, str]
    histograms: dict[str, Histogram] = attrs.field(init=False)
    counters: dict[str, float] = attrs.field(init=False)
    success: dict[str, float] = attrs.field(init=False)
    created: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero everything (a restarted engine starts its counters over)."""
        fam = {
            "tokens": request_tokens_buckets(self.max_model_len),
            "iter": tuple(float(b) for b in ITERATION_TOKENS_BUCKETS),
            "n": tuple(float(b) for b in REQUEST_PARAMS_N_BUCKETS),
            "ttft": TTFT_BUCKETS,
            "itl": ITL_BUCKETS,
            "lat": REQUEST_LATENCY_BUCKETS,
        }
        self.histograms = {name: Histogram(fam[f]) for name, _, f in _HISTOGRAMS}
        self.counters = {name: 0.0 for name, _ in _COUNTERS}
        self.success = {r: 0.0 for r in FINISH_REASONS}
        self.created = time.time()

    def observe(self, name: str, value: float) -> None:
        """Record one observation of the histogram ``name``."""
        self.histograms[name].observe(value)

    def inc(self, name: str, amount: float = 1.0) -> None:
        """Increase the counter ``name``."""
        self.counters[name] += amount

    @classmethod
    def for_policy(cls, model_name: str, max_model_len: int, policy: Policy) -> EngineMetrics:
        """Metrics of an engine running ``policy`` (its KV geometry in ``cache_config_info``)."""
        return cls(
            model_name,
            max_model_len,
            {
                "block_size": str(policy.block_size),
                "cache_dtype": "auto",
                "enable_prefix_caching": str(bool(policy.prefix_caching)),
                "gpu_memory_utilization": "0.92",
                "num_cpu_blocks": "None",
                "num_gpu_blocks": str(policy.num_blocks),
                "num_gpu_blocks_override": "None",
            },
        )

    def observe_prefix_cache(self, pool: BlockPool) -> None:
        """Take the prefix-cache counters from the scheduler's block pool.

        vLLM counts tokens looked up and found at first admissions only
        (re-admissions after a preemption are not in these counters) and reports
        them with the output of the step that admitted them (sync) or of the one
        before (async): the emulator reads them when it processes a batch's
        outputs, after the next batch was scheduled in the async case, which is
        the same moment.
        """
        self.counters["vllm:prefix_cache_queries"] = float(pool.queries)
        self.counters["vllm:prefix_cache_hits"] = float(pool.hits)

    def observe_submitted(self, plan: GenerationPlan) -> None:
        """Record a request's parameters as it arrives."""
        self.observe("vllm:request_params_n", 1)
        if plan.requested_max_tokens is not None:
            self.observe("vllm:request_params_max_tokens", plan.requested_max_tokens)
        self.observe("vllm:request_max_num_generation_tokens", plan.max_tokens)

    def observe_finished(self, h: RequestHandle, reason: str, now: float) -> None:
        """Record a request that finished (or was aborted) at loop time ``now``."""
        self.success[reason if reason in self.success else "abort"] += 1
        self.observe("vllm:e2e_request_latency_seconds", now - h.arrival)
        if reason == "abort":
            return
        self.observe("vllm:request_prompt_tokens", h.plan.prompt_tokens)
        self.observe("vllm:request_generation_tokens", h.produced)
        times = h.token_times
        if h.scheduled_at is not None:
            self.observe("vllm:request_queue_time_seconds", h.scheduled_at - h.arrival)
            self.observe("vllm:request_inference_time_seconds", now - h.scheduled_at)
            if times:
                self.observe("vllm:request_prefill_time_seconds", times[0] - h.scheduled_at)
        if len(times) > 1:
            decode = times[-1] - times[0]
            self.observe("vllm:request_decode_time_seconds", decode)
            self.observe("vllm:request_time_per_output_token_seconds", decode / (len(times) - 1))

    def render(self, gauges: GaugeValues | Callable[[], GaugeValues]) -> bytes:
        """The text exposition of every metric."""
        g = gauges() if callable(gauges) else gauges
        base = (("model_name", self.model_name), ("engine", "0"))
        lab = _labels(base)
        out: list[str] = []

        def gauge(name: str, help_: str, value: float) -> None:
            out.extend(
                (f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{lab} {go_float(value)}")
            )

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", g.running
        )
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", g.waiting)
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            g.kv_cache_usage,
        )
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        info = _labels((*self.cache_info.items(), ("engine", "0")))
        out.append(f"vllm:cache_config_info{info} 1.0")
        created = go_float(self.created)

        def created_gauge(name: str, help_: str, labels: list[str]) -> None:
            out.append(f"# HELP {name}_created {help_}")
            out.append(f"# TYPE {name}_created gauge")
            out.extend(f"{name}_created{lab_} {created}" for lab_ in labels)

        for name, help_ in _COUNTERS:
            out.append(f"# HELP {name}_total {help_}")
            out.append(f"# TYPE {name}_total counter")
            out.append(f"{name}_total{lab} {go_float(self.counters[name])}")
            created_gauge(name, help_, [lab])
        name = "vllm:request_success"
        help_ = "Count of successfully processed requests."
        out.append(f"# HELP {name}_total {help_}")
        out.append(f"# TYPE {name}_total counter")
        reasons = [_labels((*base, ("finished_reason", r))) for r in FINISH_REASONS]
        for reason, rl in zip(FINISH_REASONS, reasons, strict=True):
            out.append(f"{name}_total{rl} {go_float(self.success[reason])}")
        created_gauge(name, help_, reasons)
        for name, help_, _ in _HISTOGRAMS:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} histogram")
            out.extend(self.histograms[name].render(name, base))
            created_gauge(name, help_, [lab])
        out.append("")
        return "\n".join(out).encode()

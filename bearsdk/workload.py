"""Synthetic routing workloads: the paper's four tasks, arrivals, TTFT targets, true accuracies.

Used by ``bearsdk demo``, the examples and the simulator. Nothing here reads
the public data sets at run time: the task length distributions are log-normal
summaries of their traces (derivation below) and the accuracies follow the
paper's Table 2.

==============  ===================================  ===============  ===============
task            trace rows (public data sets)        log prompt       log output
==============  ===================================  ===============  ===============
alpaca          ShareGPT, prefill <= 512             4.506 +- 1.199   5.626 +- 1.125
govreport       arXiv summarization, prefill >= 1024 7.877 +- 0.314   5.084 +- 0.599
hotpotqa        Azure conv 2023, 512-4096 context    7.240 +- 0.476   5.344 +- 0.884
writingprompts  ShareGPT, prefill <= 128, out >= 256 3.616 +- 0.722   6.328 +- 0.349
==============  ===================================  ===============  ===============

(means and standard deviations of the logarithms, clipped to the trace's range;
computed once from the files named, 7160 / 26118 / 11322 / 2882 rows).

**True accuracy** of a request at each model: a latent difficulty shared by the
models plus per-model noise, through a logistic link whose per-(task, model)
offsets are calibrated so the means equal Table 2. A request's output length is
not drawn here: the engine that serves it decides (the emulator's own model).

**Arrivals**: Poisson, or the paper's MMPP-2 (appendix B): a two-state
Markov-modulated Poisson process with mean rate ``rate``, rate ratio ``r``,
20% of the time in the high state and transition rates 0.1/s and 0.4/s; or a
real trace's timestamps (:func:`read_trace`: the Azure 2023 traces, read in
place from the data folder :func:`bearsdk.data.data_dir` finds), time-scaled to
a mean rate.
**TTFT targets**: the paper's appendix A.2 rule.

Workloads compose: a set of distinct prompts (:func:`task_prompts`, the four
tasks; :func:`alpaca_prompts`, the 805 AlpacaEval instructions with their real
per-model judge scores and output lengths, CC BY-NC, read in place and never
shipped), arrival times, and :func:`requests_at` to draw a prompt for each
arrival and give it its target (and, from a trace, its prompt length).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from bearsdk.router.targets import PaperTargets, TargetRule

__all__ = [
    "TABLE2_MODELS",
    "TASKS",
    "TPOT_TARGETS_S",
    "TRACES",
    "TaskProfile",
    "Trace",
    "WorkItem",
    "alpaca_prompts",
    "arrivals",
    "read_trace",
    "requests_at",
    "synthetic_workload",
    "task_prompts",
]

TABLE2_MODELS: Final = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", "Qwen/Qwen3-32B")


@attrs.frozen
class TaskProfile:
    """One task's length distributions and Table 2 accuracies.

    Attributes:
        name: Task name.
        prompt: ``(mu, sd, lo, hi)`` of log prompt tokens, clip range in tokens.
        output: ``(mu, sd, lo, hi)`` of log output tokens, clip range in tokens.
        accuracy: Mean judge score per model (Table 2).
    """

    name: str
    prompt: tuple[float, float, int, int]
    output: tuple[float, float, int, int]
    accuracy: Mapping[str, float]


def _acc(a: float, b: float, c: float) -> dict[str, float]:
    return dict(zip(TABLE2_MODELS, (a, b, c), strict=True))


TPOT_TARGETS_S: Final = {
    "alpaca": 0.05,
    "hotpotqa": 0.05,
    "govreport": 0.1,
    "writingprompts": 0.1,
}
"""Default TPOT target per task (seconds per output token after the first).

Interactive answers (chat, QA) stream at 20 tokens/s or faster, about three
times a fast reader's pace, the interactive TPOT that SLO-aware routers are
configured with; long outputs read as a document (summaries, stories) get
100 ms. DistServe (Zhong et al., OSDI 2024, Table 1) set 0.1-0.2 s for
chatbot and summarization on 13B-175B models on A100s: the paper's pool
(0.6B-32B on H100s) decodes several times faster, so the same user
experience is the tighter number here.
"""

TASKS: Final = {
    "alpaca": TaskProfile(
        "alpaca", (4.506, 1.199, 1, 512), (5.626, 1.125, 1, 1024), _acc(0.5349, 0.8267, 0.8885)
    ),
    "govreport": TaskProfile(
        "govreport",
        (7.877, 0.314, 1024, 4054),
        (5.084, 0.599, 1, 3028),
        _acc(0.2902, 0.8662, 0.9593),
    ),
    "hotpotqa": TaskProfile(
        "hotpotqa", (7.240, 0.476, 512, 4096), (5.344, 0.884, 1, 1000), _acc(0.4098, 0.8828, 0.9269)
    ),
    "writingprompts": TaskProfile(
        "writingprompts",
        (3.616, 0.722, 4, 128),
        (6.328, 0.349, 256, 1023),
        _acc(0.1773, 0.5747, 0.8069),
    ),
}
"""The paper's four tasks."""


@attrs.frozen
class WorkItem:
    """One request of a workload.

    Attributes:
        index: Position in the workload.
        arrival_s: Arrival time, seconds from the start.
        task: Task name.
        prompt: Prompt text.
        prompt_tokens: Its nominal length in tokens (the text is about 4
            characters per token).
        output_tokens: Nominal output length (the serving engine decides the real one).
        accuracy: True judge score per model.
        ttft_target_s: TTFT target (appendix A.2).
        outputs: True output length per model, when the data give it
            (AlpacaEval); empty otherwise (the serving engine decides).
    """

    index: int
    arrival_s: float
    task: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    accuracy: Mapping[str, float]
    ttft_target_s: float
    outputs: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as one user message."""
        return [{"role": "user", "content": self.prompt}]


def arrivals(
    n: int, rate: float, *, process: str = "poisson", ratio: float = 3.0, seed: int = 0
) -> np.ndarray:
    """``n`` arrival times (seconds) of a Poisson or MMPP-2 process with mean rate ``rate``.

    Args:
        n: Number of arrivals.
        rate: Mean arrivals per second.
        process: ``"poisson"`` or ``"mmpp2"``.
        ratio: MMPP-2 high/low rate ratio ``r`` (appendix B uses 3 and 6).
        seed: Generator seed.

    Raises:
        ValueError: A bad process name or rate.
    """
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0 (got {rate!r})")
    rng = np.random.default_rng(seed)
    if process == "poisson":
        return np.cumsum(rng.exponential(1.0 / rate, size=n))
    if process != "mmpp2":
        raise ValueError(f"process must be 'poisson' or 'mmpp2' (got {process!r})")
    p_high, to_high, to_low = 0.2, 0.1, 0.4
    lo = rate / ((1 - p_high) + p_high * ratio)
    rates = (lo, lo * ratio)
    switch = (to_high, to_low)
    out = np.empty(n)
    t, state, i = 0.0, 0, 0
    next_switch = rng.exponential(1.0 / switch[0])
    while i < n:
        dt = rng.exponential(1.0 / rates[state])
        if t + dt >= next_switch:
            # Memorylessness: restart the arrival clock in the new state.
            t = next_switch
            state = 1 - state
            next_switch = t + rng.exponential(1.0 / switch[state])
            continue
        t += dt
        out[i] = t
        i += 1
    return out


def _calibrated_offsets(
    rng: np.random.Generator, spread: float, noise: float
) -> dict[tuple[str, str], float]:
    """Logistic offsets whose mean accuracy equals Table 2 for each (task, model)."""
    z = rng.standard_normal(4000)
    e = rng.standard_normal(4000)
    out = {}
    for task, tp in TASKS.items():
        for model, target in tp.accuracy.items():
            lo, hi = -12.0, 12.0
            for _ in range(60):
                mid = (lo + hi) / 2
                m = float(np.mean(1 / (1 + np.exp(-(mid - spread * z + noise * e)))))
                lo, hi = (mid, hi) if m < target else (lo, mid)
            out[(task, model)] = (lo + hi) / 2
    return out


def _check_mix(mix: Mapping[str, float] | None) -> tuple[list[str], npt.NDArray[np.float64]]:
    weights = dict(mix or {t: 1.0 for t in TASKS})
    for t, w in weights.items():
        if t not in TASKS:
            raise ValueError(f"mix: unknown task {t!r} (known: {', '.join(TASKS)})")
        if not (w >= 0 and math.isfinite(w)):
            raise ValueError(f"mix[{t!r}] must be a finite number >= 0 (got {w!r})")
    names = list(weights)
    p = np.array([weights[t] for t in names], dtype=float)
    if p.sum() <= 0:
        raise ValueError("mix: weights must not all be 0")
    return names, p / p.sum()


def task_prompts(
    n: int,
    *,
    mix: Mapping[str, float] | None = None,
    seed: int = 0,
    models: Sequence[str] = TABLE2_MODELS,
) -> list[WorkItem]:
    """``n`` prompts of the four tasks, with their true accuracies (arrival 0).

    The prompts, lengths and accuracies of ``synthetic_workload(n, ..., seed=seed)``;
    each item's target follows the A.2 rule (a request drawing it gets its own,
    see :func:`requests_at`).

    Args:
        n: Number of prompts.
        mix: Task weights (default: equal).
        seed: Seed of everything.
        models: Models to give true accuracies for (Table 2's by default).

    Raises:
        ValueError: Unknown task or model, bad weights.
    """
    from bearsdk.predictors.synthetic import synthetic_prompt

    names, p = _check_mix(mix)
    for m in models:
        if m not in TABLE2_MODELS:
            raise ValueError(
                f"models: {m!r} has no Table 2 accuracy (known: {', '.join(TABLE2_MODELS)})"
            )
    rng = np.random.default_rng(seed)
    spread, noise = 1.2, 0.8
    offsets = _calibrated_offsets(np.random.default_rng(seed + 1), spread, noise)
    targets = PaperTargets(seed=seed + 3)
    items = []
    for i in range(n):
        task = names[int(rng.choice(len(names), p=p))]
        tp = TASKS[task]
        pt = int(
            np.clip(
                round(math.exp(rng.normal(tp.prompt[0], tp.prompt[1]))), tp.prompt[2], tp.prompt[3]
            )
        )
        ot = int(
            np.clip(
                round(math.exp(rng.normal(tp.output[0], tp.output[1]))), tp.output[2], tp.output[3]
            )
        )
        text, ot_adj = synthetic_prompt(rng, task, pt, ot)
        z = rng.standard_normal()
        acc = {
            m: float(
                1
                / (1 + math.exp(-(offsets[(task, m)] - spread * z + noise * rng.standard_normal())))
            )
            for m in models
        }
        items.append(
            WorkItem(i, 0.0, task, text, pt, max(1, int(ot_adj)), acc, targets.target_for(pt))
        )
    return items


def synthetic_workload(
    n: int,
    rate: float,
    *,
    mix: Mapping[str, float] | None = None,
    process: str = "poisson",
    ratio: float = 3.0,
    seed: int = 0,
    models: Sequence[str] = TABLE2_MODELS,
) -> list[WorkItem]:
    """``n`` requests of the four tasks arriving at ``rate`` per second.

    Args:
        n: Number of requests.
        rate: Mean arrival rate, requests/s.
        mix: Task weights (default: equal).
        process: ``"poisson"`` or ``"mmpp2"``.
        ratio: MMPP-2 rate ratio.
        seed: Seed of everything (same seed, same workload).
        models: Models to give true accuracies for (Table 2's by default).

    Raises:
        ValueError: Unknown task or model, bad weights.
    """
    _check_mix(mix)
    items = task_prompts(n, mix=mix, seed=seed, models=models)
    times = arrivals(n, rate, process=process, ratio=ratio, seed=seed + 2)
    return [attrs.evolve(it, arrival_s=float(times[i])) for i, it in enumerate(items)]


def requests_at(
    prompts: Sequence[WorkItem],
    times: Sequence[float] | npt.NDArray[np.float64],
    *,
    seed: int = 0,
    targets: TargetRule | None = None,
    prompt_tokens: Sequence[int] | npt.NDArray[np.int64] | None = None,
    order: str = "random",
) -> list[WorkItem]:
    """One request per arrival time, each a prompt of ``prompts`` with its own target.

    Args:
        prompts: The distinct prompts to draw from.
        times: Arrival times, seconds (ascending).
        seed: Seeds the draws and the targets.
        targets: Target rule (default: the A.2 rule seeded with ``seed + 3``).
        prompt_tokens: Per-request prompt lengths overriding the prompts' own
            (a trace's), the text standing for the request's last turn.
        order: ``"random"`` (uniform draws) or ``"cycle"`` (in order, repeating).

    Raises:
        ValueError: No prompts, a bad order, or lengths that do not match the times.
    """
    if not prompts:
        raise ValueError("prompts must not be empty")
    if order not in ("random", "cycle"):
        raise ValueError(f"order must be 'random' or 'cycle' (got {order!r})")
    n = len(times)
    if prompt_tokens is not None and len(prompt_tokens) != n:
        raise ValueError(
            f"prompt_tokens must give one length per arrival ({n}; got {len(prompt_tokens)})"
        )
    rule: TargetRule = targets if targets is not None else PaperTargets(seed=seed + 3)
    if order == "cycle":
        picks = np.arange(n) % len(prompts)
    else:
        picks = np.random.default_rng(seed).integers(0, len(prompts), size=n)
    out = []
    for i in range(n):
        it = prompts[int(picks[i])]
        pt = it.prompt_tokens if prompt_tokens is None else max(1, int(prompt_tokens[i]))
        out.append(
            attrs.evolve(
                it,
                index=i,
                arrival_s=float(times[i]),
                prompt_tokens=pt,
                ttft_target_s=rule.target_for(pt),
            )
        )
    return out


# -- traces ----------------------------------------------------------------------

TRACES: Final = {
    "azure-conv": "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
}
"""Public traces with timestamps and token counts, by name (paths under the data folder)."""


@attrs.frozen(eq=False)
class Trace:
    """A request trace: arrival times and token counts.

    Attributes:
        name: Where it came from.
        times_s: Arrival times, seconds from the first request (ascending).
        prompt_tokens: Prompt (context) tokens of each request.
        output_tokens: Generated tokens of each request.
    """

    name: str
    times_s: npt.NDArray[np.float64]
    prompt_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.times_s)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the trace's span."""
        span = float(self.times_s[-1] - self.times_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else math.inf

    def window(self, n: int, start: int = 0) -> Trace:
        """Requests ``start .. start + n - 1`` (wrapping around), times from the first.

        Raises:
            ValueError: ``n`` < 1 or an empty trace.
        """
        if n < 1 or len(self) == 0:
            raise ValueError(f"n must be >= 1 and the trace non-empty (got {n}, {len(self)})")
        idx = (start + np.arange(n)) % len(self)
        t = self.times_s
        span = float(t[-1] - t[0])
        gap = span / max(len(self) - 1, 1)
        # A wrapped-around window continues after the end, one mean gap later.
        times = t[idx] + (start + np.arange(n)) // len(self) * (span + gap)
        return Trace(self.name, times - times[0], self.prompt_tokens[idx], self.output_tokens[idx])

    def arrivals(self, rate: float | None = None) -> npt.NDArray[np.float64]:
        """The arrival times, scaled so that their mean rate is ``rate`` (as is: ``None``)."""
        if rate is None:
            return self.times_s.copy()
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a finite number > 0 (got {rate!r})")
        scaled: npt.NDArray[np.float64] = self.times_s * (self.mean_rate / rate)
        return scaled


def _seconds(stamps: Sequence[str]) -> npt.NDArray[np.float64]:
    # datetime64 parses the fractional digits the trace has (7) exactly.
    t = np.array([s.strip().replace(" ", "T") for s in stamps], dtype="datetime64[ns]")
    ns = (t - t[0]).astype(np.int64)
    out: npt.NDArray[np.float64] = ns / 1e9
    return out


def read_trace(name: str, data_dir: str | Path | None = None) -> Trace:
    """Read a trace with timestamps and token counts, in place.

    Args:
        name: One of :data:`TRACES` (resolved under ``data_dir``), or the path of
            a CSV with the Azure columns ``TIMESTAMP,ContextTokens,GeneratedTokens``.
        data_dir: The data folder (``--data-dir``; default: ``$BEARSDK_DATA`` and
            the other places :func:`bearsdk.data.data_dir` looks).

    Raises:
        DataNotFoundError: A named trace's data set is not on this machine (the
            message names its public source).
        FileNotFoundError: The file is not on this machine.
        ValueError: The CSV lacks a column or has a bad row.
    """
    if name in TRACES:
        from bearsdk.data import data_dir as find

        path = find(data_dir, "azure-llm-2023") / TRACES[name]
    else:
        path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"trace {name!r}: {path} does not exist")
    with path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    try:
        stamps = [r["TIMESTAMP"] for r in rows]
        ctx = np.array([int(r["ContextTokens"]) for r in rows], dtype=np.int64)
        gen = np.array([int(r["GeneratedTokens"]) for r in rows], dtype=np.int64)
    except KeyError as exc:
        raise ValueError(f"trace {path}: missing column {exc}") from None
    except ValueError as exc:
        raise ValueError(f"trace {path}: bad row ({exc})") from None
    if not rows:
        raise ValueError(f"trace {path}: no rows")
    times = _seconds(stamps)
    order = np.argsort(times, kind="stable")
    return Trace(name, times[order], ctx[order], gen[order])


# -- AlpacaEval --------------------------------------------------------------------


def alpaca_prompts(
    alpaca_dir: str | Path | None = None,
    models: Sequence[str] | None = None,
    *,
    prompt_ids: Sequence[int] | None = None,
) -> list[WorkItem]:
    """The AlpacaEval instructions with each model's real judge score and output length.

    Accuracy is the AlpacaEval 2.0 weighted preference over the GPT-4-1106
    baseline minus one; output lengths are characters / 4 (as
    :func:`bearsdk.predictors.dataset.read_alpaca_eval` reads them); prompt
    lengths are characters / 4. Prompts lacking a value for some model are
    left out. The data are CC BY-NC 4.0: read in place, for evaluation only.

    Args:
        alpaca_dir: The AlpacaEval folder (default: ``alpaca_eval`` in the data
            folder :func:`bearsdk.data.data_dir` finds).
        models: Models (table columns; default: the FuseChat-3.0 pool).
        prompt_ids: Prompts to keep (default: all).

    Raises:
        DataNotFoundError: The data are not on this machine (the message names
            their public source).
        FileNotFoundError: ``alpaca_dir`` has no ``prompts.csv``.
        PredictorError: A table is malformed or lacks a model.
    """
    from bearsdk.predictors.dataset import ALPACA_CHARS_PER_TOKEN, read_alpaca_eval
    from bearsdk.predictors.pool import FUSECHAT3_POOL, ModelSpec

    if alpaca_dir is None:
        from bearsdk.data import data_dir

        alpaca_dir = data_dir(None, "alpaca-eval") / "alpaca_eval"
    if not (Path(alpaca_dir) / "prompts.csv").is_file():
        raise FileNotFoundError(f"AlpacaEval: {alpaca_dir} has no prompts.csv")
    names = list(models) if models is not None else [m.name for m in FUSECHAT3_POOL]
    data = read_alpaca_eval(alpaca_dir, tuple(ModelSpec(m) for m in names))
    n = len(data.prompts)
    acc = np.full((n, len(names)), np.nan)
    out = np.full((n, len(names)), np.nan)
    acc[data.prompt_index, data.model_index] = data.accuracy
    out[data.prompt_index, data.model_index] = data.output_tokens
    keep = set(range(n)) if prompt_ids is None else {int(i) for i in prompt_ids}
    items = []
    for i, text in enumerate(data.prompts):
        if i not in keep or np.isnan(acc[i]).any() or np.isnan(out[i]).any():
            continue
        pt = max(1, round(len(text) / ALPACA_CHARS_PER_TOKEN))
        lens = {m: max(1, round(float(out[i, j]))) for j, m in enumerate(names)}
        items.append(
            WorkItem(
                index=i,
                arrival_s=0.0,
                task=data.groups[i] if data.groups else "alpaca_eval",
                prompt=text,
                prompt_tokens=pt,
                output_tokens=round(sum(lens.values()) / len(lens)),
                accuracy={m: float(acc[i, j]) for j, m in enumerate(names)},
                ttft_target_s=PaperTargets(seed=i).target_for(pt),
                outputs=lens,
            )
        )
    return items

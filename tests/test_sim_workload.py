"""Workloads: task prompts, requests at arrival times, traces and AlpacaEval read in place."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bearsdk.estimators.dense import shared_data_dir
from bearsdk.router.targets import FixedTarget
from bearsdk.workload import (
    TABLE2_MODELS,
    TASKS,
    Trace,
    alpaca_prompts,
    arrivals,
    read_trace,
    requests_at,
    synthetic_workload,
    task_prompts,
)

DATA = shared_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="the shared data are not on this machine")


def test_synthetic_workload_is_task_prompts_at_arrival_times() -> None:
    w = synthetic_workload(12, 4.0, seed=5, mix={"alpaca": 1, "govreport": 2})
    p = task_prompts(12, seed=5, mix={"alpaca": 1, "govreport": 2})
    times = arrivals(12, 4.0, seed=7)
    for a, b, t in zip(w, p, times, strict=True):
        assert (a.prompt, a.prompt_tokens, a.accuracy, a.ttft_target_s) == (
            b.prompt,
            b.prompt_tokens,
            b.accuracy,
            b.ttft_target_s,
        )
        assert a.arrival_s == t
        assert a.task in ("alpaca", "govreport")
        assert set(a.accuracy) == set(TABLE2_MODELS)
        assert 0.150 <= a.ttft_target_s <= 1.120
        lo, hi = TASKS[a.task].prompt[2:]
        assert lo <= a.prompt_tokens <= hi


def test_requests_at_draws_prompts_and_gives_each_its_target() -> None:
    bank = task_prompts(5, seed=1)
    times = np.arange(20) * 0.5
    reqs = requests_at(bank, times, seed=3)
    assert [r.index for r in reqs] == list(range(20))
    assert [r.arrival_s for r in reqs] == times.tolist()
    assert {r.prompt for r in reqs} <= {b.prompt for b in bank}
    assert requests_at(bank, times, seed=3) == reqs
    assert requests_at(bank, times, seed=4) != reqs
    cyc = requests_at(bank, times[:7], order="cycle", targets=FixedTarget(0.3))
    assert [r.prompt for r in cyc] == [bank[i % 5].prompt for i in range(7)]
    assert {r.ttft_target_s for r in cyc} == {0.3}
    long = requests_at(bank, times[:3], prompt_tokens=[400_000, 7, 0])
    assert [r.prompt_tokens for r in long] == [400_000, 7, 1]
    assert long[0].ttft_target_s == pytest.approx(1.120)  # A.2's cap
    with pytest.raises(ValueError, match="one length per arrival"):
        requests_at(bank, times, prompt_tokens=[1, 2])
    with pytest.raises(ValueError, match="order"):
        requests_at(bank, times, order="shuffle")


def test_mmpp2_keeps_the_mean_rate_and_is_burstier() -> None:
    pois = np.diff(arrivals(20_000, 6.0, seed=2))
    mmpp = np.diff(arrivals(20_000, 6.0, process="mmpp2", ratio=6.0, seed=2))
    assert 1 / pois.mean() == pytest.approx(6.0, rel=0.05)
    assert 1 / mmpp.mean() == pytest.approx(6.0, rel=0.1)
    scv = lambda g: g.var() / g.mean() ** 2  # noqa: E731
    assert scv(mmpp) > 1.3 * scv(pois)


def test_trace_windows_and_time_scaling() -> None:
    t = Trace("t", np.array([0.0, 1.0, 3.0, 4.0]), np.array([5, 6, 7, 8]), np.array([1, 2, 3, 4]))
    assert t.mean_rate == pytest.approx(0.75)
    w = t.window(6, start=2)
    assert w.prompt_tokens.tolist() == [7, 8, 5, 6, 7, 8]
    assert np.all(np.diff(w.times_s) > 0)
    assert w.times_s[0] == 0.0
    fast = t.arrivals(rate=1.5)
    assert fast.tolist() == pytest.approx([0.0, 0.5, 1.5, 2.0])
    with pytest.raises(ValueError, match="n must be"):
        t.window(0)


@needs_data
def test_read_the_azure_trace_in_place() -> None:
    tr = read_trace("azure-conv")
    assert len(tr) == 19_366
    assert tr.times_s[0] == 0.0
    assert np.all(np.diff(tr.times_s) >= 0)
    assert tr.mean_rate == pytest.approx(5.53, rel=0.01)
    assert tr.prompt_tokens.mean() == pytest.approx(1155, rel=0.01)
    assert tr.output_tokens.mean() == pytest.approx(211, rel=0.01)
    with pytest.raises(FileNotFoundError):
        read_trace("no/such/trace.csv")


@needs_data
def test_alpaca_prompts_carry_real_per_model_truth() -> None:
    items = alpaca_prompts(prompt_ids=range(0, 805, 2))
    assert 390 <= len(items) <= 403
    assert all(it.index % 2 == 0 for it in items)
    for it in items:
        assert set(it.accuracy) == set(it.outputs)
        assert all(0.0 <= a <= 1.0 for a in it.accuracy.values())
        assert all(n >= 1 for n in it.outputs.values())
    means = {m: float(np.mean([it.accuracy[m] for it in items])) for m in items[0].accuracy}
    # The larger FuseChat-3.0 model wins more often against the baseline.
    assert means["FuseChat-Gemma-2-9B-Instruct"] > means["FuseChat-Llama-3.2-1B-Instruct"]
    assert not math.isnan(sum(means.values()))

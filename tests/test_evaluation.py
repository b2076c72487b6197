"""Scoring runs (eq. 6) and driving workloads through the router in real time."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from bearsdk.cli import main
from bearsdk.emulator import EnginePool
from bearsdk.evaluation import RequestResult, drive_workload, summarize
from bearsdk.router import AsyncRouter, InstanceConfig
from bearsdk.selectors import RoundRobin
from bearsdk.workload import synthetic_workload


def _r(
    instance: str | None, ttft: float | None, target: float, acc: float, cost: float
) -> RequestResult:
    model = None if instance is None else f"m-{instance}"
    return RequestResult(0, "t", instance, model, ttft, target, ttft, acc, cost, 10, 10)


def test_on_time_utility_is_eq6() -> None:
    lam = 1e-3
    results = [
        _r("a", 0.10, 0.20, 0.9, 100.0),  # on time: 0.9 - 0.1 = 0.8
        _r("b", 0.30, 0.20, 0.8, 50.0),  # late: counts 0 (its utility 0.75 is lost)
        _r("a", 0.20, 0.20, 0.5, 0.0),  # exactly on the target: 0.5
        _r(None, None, 0.20, 0.0, 0.0),  # failed: 0
    ]
    s = summarize("p", 4.0, results, lam=lam)
    assert s.on_time_utility == pytest.approx((0.8 + 0.5) / 4)
    assert s.attainment == pytest.approx(2 / 4)
    assert s.mean_utility == pytest.approx((0.8 + 0.75 + 0.5) / 4)
    assert s.composition == {"": 0.25, "a": 0.5, "b": 0.25}
    assert s.failed == 1
    assert s.mean_accuracy == pytest.approx((0.9 + 0.8 + 0.5) / 3)
    with pytest.raises(ValueError, match="no requests"):
        summarize("p", 1.0, [], lam=lam)


async def test_drive_workload_gives_every_request_one_result() -> None:
    items = synthetic_workload(12, 12.0, seed=3)
    async with EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100") as pool:
        cfgs = [
            InstanceConfig(name=e.instance, url=e.url, model=e.model_name, profile=e.config.profile)
            for e in pool
        ]
        engines = {e.instance: e for e in pool}
        async with AsyncRouter(cfgs, RoundRobin()) as router:
            seen: list[int] = []

            def lookup(instance: str, rid: str) -> tuple[int, int] | None:
                h = engines[instance].request(f"chatcmpl-{rid}")
                return None if h is None else (h.plan.prompt_tokens, h.plan.output_len)

            # cut off shortly after the last arrival: most answers are unfinished
            results, lag = await drive_workload(
                router,
                items,
                tail_s=0.5,
                lookup=lookup,
                on_result=lambda r: seen.append(r.index),
            )
    assert [r.index for r in results] == [it.index for it in items]
    assert sorted(seen) == sorted(r.index for r in results)
    assert lag >= 0.0
    for r, it in zip(results, items, strict=True):
        assert r.instance in engines  # round robin over two healthy engines
        assert r.ttft_s is not None
        assert r.ttft_s < 0.5
        assert r.accuracy == it.accuracy[r.model]  # type: ignore[index]
        assert r.output_tokens >= 1
        assert r.prompt_tokens >= 1
        assert r.cost > 0
    assert {r.instance for r in results} == set(engines)


def test_demo_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "demo.svg"
    argv = ["demo", "--rates", "6", "--policies", "bear,round-robin", "--duration", "1.5"]
    assert main([*argv, "--jobs", "1", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "arrival rate 6 req/s (9 requests)" in out
    for policy in ("bear", "round-robin"):
        assert policy in out
    rows = [ln for ln in out.splitlines() if ln[2:].startswith(("bear ", "round-robin "))]
    assert len(rows) == 2
    otu = float(rows[0][2:].split()[1])  # the best policy first, marked with a star
    # (after a "!" when a busy machine made that run unreliable even on rerun)
    assert rows[0][1] == "*"
    assert 0.0 <= otu <= 1.0
    assert not math.isnan(otu)
    assert plot.read_text().startswith("<svg")
    assert "bear" in plot.read_text()


SHARED = Path(os.environ.get("BEARSDK_SHARED", Path(__file__).resolve().parents[2] / "shared"))
ALPACA = SHARED / "data" / "alpaca_eval"


@pytest.mark.skipif(
    not (ALPACA / "prompts.csv").is_file(), reason="AlpacaEval data (shared) not found"
)
def test_demo_on_real_data(capsys: pytest.CaptureFixture[str]) -> None:
    from bearsdk.cli.demo import ALPACA_INSTANCES, _alpaca, _engines, _Job

    pred, held_out = _alpaca()
    assert pred.models == tuple(m for _, m, _ in ALPACA_INSTANCES)
    assert all(it.index % 2 == 1 for it in held_out)  # routed prompts were not trained on
    configs, items, predictor = _engines(_Job("bear", 6.0, 9, 0, 5e-4, 10.0, "alpaca-eval"))
    assert predictor is not None
    assert predictor.relative is pred.relative  # the trained heads, a fresh token counter
    assert predictor.tokens is not pred.tokens
    by_prompt = {it.prompt: it for it in held_out}
    for cfg, (name, model, profile) in zip(configs, ALPACA_INSTANCES, strict=True):
        assert (cfg.instance, cfg.served_model_name, cfg.profile) == (name, model, profile)
        assert cfg.answer_lengths == {p: it.outputs[model] for p, it in by_prompt.items()}
    assert [it.index for it in items] == list(range(9))
    assert all(by_prompt[it.prompt].accuracy == it.accuracy for it in items)
    argv = ["demo", "--workload", "alpaca-eval", "--rates", "6", "--policies", "bear"]
    assert main([*argv, "--duration", "1.5", "--jobs", "1", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "FuseChat-Gemma-2-9B-Instruct on llama-3-8b-a100" in out
    assert "10x slower" in out
    assert "qwen-7b" in out or "gemma-9b" in out
    row = next(ln for ln in out.splitlines() if ln[1:].startswith("*bear"))  # "!": unreliable
    assert 0.0 <= float(row[2:].split()[1]) <= 1.0

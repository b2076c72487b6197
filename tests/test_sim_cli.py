"""``bearsdk simulate`` configurations, the command, parallel sweeps, plots, the benchmark."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from bearsdk.cli import main
from bearsdk.estimators.dense import shared_data_dir
from bearsdk.sim import (
    PlotError,
    SimConfigError,
    load_config,
    parse_config,
    run_config,
    write_plots,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "simulate"

SMALL = """
[simulation]
name = "small"
requests = 120
seeds = [3]

[[pool]]
name = "small"
model = "Qwen/Qwen3-0.6B"
engine = "qwen3-0.6b-h100"

[[pool]]
name = "large"
model = "Qwen/Qwen3-32B"
engine = "qwen3-32b-2xh100"
ground_truth = { noise_sigma = 0.0 }

[workload]
unique_prompts = 25

[policies]
bear = {}
lagrangian = {}
score = { latency_weight = [0.1, 1.0] }
oracle = {}

[[sweep]]
name = "rates"
rates = [6, 12]

[[sweep]]
name = "stale"
rates = [12]
staleness_ms = [0, 200]
delta = [0.5, 2.0]
policies = ["bear", "lagrangian", "oracle"]
"""


@pytest.fixture
def small(tmp_path: Path) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL)
    return p


def test_example_configs_parse() -> None:
    paper = load_config(EXAMPLES / "paper.toml")
    assert [s.name for s in paper.pool] == ["qwen3-0.6b", "qwen3-8b", "qwen3-32b"]
    assert {p.name for p in paper.policies} >= {"bear", "oracle", "routebalance", "score"}
    names = [sc.sweep for sc in paper.scenarios()]
    assert {"rates", "delta", "mmpp", "staleness", "lambda"} == set(names)
    rates = [sc for sc in paper.scenarios() if sc.sweep == "rates"]
    assert max(sc.rate for sc in rates) >= 10
    alpaca = load_config(EXAMPLES / "alpaca-azure.toml")
    assert alpaca.workload.prompts == "alpaca-eval"
    assert alpaca.predictor == "alpaca-eval"
    assert all(sc.arrivals == "trace" for sc in alpaca.scenarios())


def test_scenarios_expand_variants_and_axes(small: Path) -> None:
    cfg = load_config(small)
    scs = cfg.scenarios()
    rates = [sc for sc in scs if sc.sweep == "rates"]
    # 2 rates x (bear, lagrangian, 2 score variants, oracle)
    assert len(rates) == 10
    stale = [sc for sc in scs if sc.sweep == "stale"]
    # 2 delays x (bear, lagrangian at 2 deltas, oracle)
    assert len(stale) == 8
    assert {sc.delta for sc in stale if sc.policy.name == "lagrangian"} == {0.5, 2.0}
    assert {sc.delta for sc in stale if sc.policy.name != "lagrangian"} == {None}
    assert cfg.pool[1].time_params().noise_sigma == 0.0
    assert not any(sc.online_batch_time for sc in scs)
    online = attrs.evolve(cfg, batch_time="online")
    assert all(sc.online_batch_time for sc in online.scenarios())


POOL_8B = {"name": "a", "model": "Qwen/Qwen3-8B", "engine": "qwen3-8b-h100"}


def test_drawn_time_scales_are_per_seed_and_instance_and_in_range() -> None:
    cfg = load_config(EXAMPLES / "random-speeds.toml")
    draws = {(s.name, seed): s.drawn_scale(seed) for s in cfg.pool for seed in range(1, 6)}
    assert all(0.5 <= v <= 2.0 for v in draws.values())
    assert len(set(draws.values())) == len(draws)  # every instance and seed its own
    again = load_config(EXAMPLES / "random-speeds.toml")
    assert {(s.name, k): s.drawn_scale(k) for s in again.pool for k in range(1, 6)} == draws
    spec = cfg.pool[0]
    assert spec.time_params(3).time_scale == pytest.approx(spec.drawn_scale(3))
    assert spec.time_params().time_scale == 1.0


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"simulation": {"requests": 0}}, "simulation.requests must be an integer >= 1"),
        ({"simulation": {"reqs": 5}}, "simulation.reqs is not a known key"),
        ({"policies": {"bear": {"lam": 1e-3}}}, "policies.bear.lam: set it in the sweep"),
        ({"policies": {"magic": {}}}, "policies.magic: unknown policy"),
        ({"policies": {"score": {"weight": 1}}}, "policies.score: selector 'score'"),
        ({"sweep": [{"name": "x", "rates": [1], "arrivals": ["mmpp2:0.5"]}]}, "mmpp2:R"),
        ({"sweep": [{"name": "x", "rates": [0]}]}, r"sweep\['x'\].rates must be > 0"),
        ({"sweep": [{"name": "x", "rates": [1], "policies": ["nope"]}]}, "must list configured"),
        ({"pool": [{"name": "a", "model": "m", "engine": "h200"}]}, "unknown emulator profile"),
        ({"pool": [{"name": "a", "model": "m"}]}, r"pool\[0\].engine is required"),
        (
            {"pool": [{"name": "a", "model": "m", "engine": "qwen3-8b-h100", "profile": "x"}]},
            "no eq. 12 profile 'x'",
        ),
        ({"router": {"staleness": {"overlay": 1, "bad": 2}}}, "router.staleness.bad"),
        ({"router": {"batch_time": "fitted"}}, "router.batch_time must be"),
        ({"router": {"resident_lengths": "mean"}}, "router.resident_lengths must be"),
        ({"workload": {"lengths": "guess"}}, "workload.lengths must be one of"),
        ({"router": {"speed": "fast"}}, "router.speed must be 'learned' or 'profile'"),
        (
            {"pool": [{**POOL_8B, "time_scale_range": [2.0, 0.5]}]},
            r"pool\['a'\].time_scale_range must have low <= high",
        ),
        (
            {"pool": [{**POOL_8B, "time_scale_range": [0, 1]}]},
            r"pool\['a'\].time_scale_range.low must be > 0",
        ),
        (
            {"pool": [{**POOL_8B, "speed_changes": [[10, 2.0], [5, 1.0]]}]},
            r"pool\['a'\].speed_changes: times must increase",
        ),
        (
            {"pool": [{**POOL_8B, "speed_changes": [[10, 0]]}]},
            r"speed_changes.multiplier must be > 0",
        ),
    ],
)
def test_config_errors_name_the_key(edit: dict[str, Any], message: str) -> None:
    import tomllib

    doc = tomllib.loads(SMALL)
    for key, value in edit.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict) and key != "policies":
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    with pytest.raises(SimConfigError, match=message):
        parse_config(doc)


def test_results_do_not_depend_on_the_number_of_workers(small: Path) -> None:
    cfg = load_config(small)
    one = run_config(cfg, workers=1)
    two = run_config(cfg, workers=2)
    # repr: nan (the oracles predict no TTFT) equals itself there.
    same = lambda r: repr(attrs.evolve(r, wall_s=0.0, decide_us=0.0))  # noqa: E731
    assert [same(r) for r in one.results] == [same(r) for r in two.results]
    assert len(one.results) == len(cfg.scenarios())
    # The oracle ignores staleness: one run serves both delays.
    oracles = [r for r in one.results if r.scenario.policy.name == "oracle"]
    stale = [r for r in oracles if r.scenario.sweep == "stale"]
    assert stale[0].on_time_utility == stale[1].on_time_utility


def test_the_command_prints_json_results(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--config", str(small), "--json", "--sweep", "rates", "--workers", "1"])
    assert rc == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert "simulate [" in err  # the progress bar
    rows = doc["results"]
    assert len(rows) == 10
    for key in ("policy", "rate", "on_time_utility", "slo_attainment", "mean_utility"):
        assert key in rows[0]
    assert set(rows[0]["composition"]) == {"small", "large"}
    assert doc["summary"]["gain"][0]["rate"] == 6
    assert any(r["policy"] == "score(latency_weight=1)" for r in rows)


def test_the_command_rejects_bad_overrides(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--config", str(small), "--sweep", "nope"]) == 2
    assert "--sweep 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--config", str(small) + ".missing"]) == 2


def test_plots_are_written(small: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    cfg = load_config(small)
    report = run_config(cfg, workers=1)
    files = write_plots(cfg, report.results, tmp_path / "plots")
    names = {f.name for f in files}
    assert {"small-fig08-rates.png", "small-fig01-rates.png", "small-fig18-rates.png"} <= names
    assert {"small-fig14-stale.png", "small-fig09-stale.png"} <= names
    assert all(f.stat().st_size > 1000 for f in files)


def test_missing_matplotlib_is_a_clear_error(
    small: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(PlotError, match=r"pip install 'bearsdk\[plot\]'"):
        write_plots(load_config(small), [], "unused")
    rc = main(["simulate", "--config", str(small), "--plots", "x"])
    assert rc == 2
    assert "bearsdk[plot]" in capsys.readouterr().err


def test_the_benchmark_reports_its_timings() -> None:
    from bearsdk.bench.simulate import run

    res = run(requests=80, rate=6.0, workers=1, unique_prompts=20)
    assert res["policies"] == 10
    assert res["instances"] == 3
    assert len(res["runs"]) == 10
    assert res["total_s"] > 0
    # The 60 s target is for 10,000 requests: an 80-request run is not held against it.
    assert res["target_s"] is None
    assert res["within_target"] is None


def test_text_mode_prints_the_comparison_when_there_is_no_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The estimators' figure: one instance, BEA against Prefill-TPS; no baselines to beat.
    cfg = (EXAMPLES / "estimators.toml").read_text().replace("requests = 3000", "requests = 60")
    cfg = cfg.replace("rates = [4, 8, 10, 12, 14]", "rates = [4, 8]")
    path = tmp_path / "estimators.toml"
    path.write_text(cfg)
    assert main(["simulate", "--config", str(path), "--workers", "1", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("estimators: 4 results")
    assert "TTFT MAPE" in lines[1]
    rows = [ln.split() for ln in lines[2:]]
    assert [(r[1], r[3]) for r in rows] == [
        ("4", "bear"),
        ("4", "prefill-tps"),
        ("8", "bear"),
        ("8", "prefill-tps"),
    ]
    assert all(r[-1].endswith("%") for r in rows)  # both predict a TTFT: both have an error
    # --diagnose adds the floor under each MAPE (the exact forecast's error).
    assert (
        main(["simulate", "--config", str(path), "--workers", "1", "--no-progress", "--diagnose"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "floor"
    rows = [ln.split() for ln in lines[2:]]
    assert all(r[-1].endswith("%") and float(r[-1][:-1]) >= 0.0 for r in rows)


@pytest.mark.skipif(shared_data_dir() is None, reason="the shared data are not on this machine")
def test_the_real_data_config_runs(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLES / "alpaca-azure.toml")
    cfg = attrs.evolve(
        cfg,
        requests=150,
        sweeps=(attrs.evolve(cfg.sweeps[0], rates=(6.0,), policies=("bear", "oracle")),),
    )
    report = run_config(cfg, workers=1)
    bear, oracle = report.results
    assert bear.n == 150
    assert 0.0 < bear.on_time_utility <= oracle.on_time_utility + 0.05
    assert not math.isnan(bear.mean_ttft_s)


def test_a_pool_scheduler_can_be_a_spec_file(tmp_path: Path) -> None:
    specs = Path(__file__).resolve().parents[1] / "bearsdk" / "schedulers" / "specs"
    spec = (specs / "vllm-v1.toml").read_text().replace('name = "vllm-v1"', 'name = "sim-mine"')
    (tmp_path / "mine.toml").write_text(spec)
    text = SMALL.replace(
        'engine = "qwen3-0.6b-h100"', 'engine = "qwen3-0.6b-h100"\nscheduler = "mine.toml"'
    )
    (tmp_path / "small.toml").write_text(text.replace("requests = 120", "requests = 40"))
    cfg = load_config(tmp_path / "small.toml")  # relative to the configuration's folder
    assert cfg.pool[0].scheduler == "sim-mine"
    cfg = attrs.evolve(cfg, sweeps=cfg.sweeps[:1])
    assert len(run_config(cfg, workers=2).results) == 10  # the workers know the spec too
    (tmp_path / "small.toml").write_text(text.replace("mine.toml", "nope.toml"))
    with pytest.raises(SimConfigError, match=r"\['small'\]\.scheduler 'nope.toml' cannot be read"):
        load_config(tmp_path / "small.toml")

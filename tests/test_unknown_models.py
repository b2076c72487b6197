"""Models the predictor was not trained on route with a documented prior (issue 19, defect 16)."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import numpy as np
import pytest

from bearsdk.emulator import EnginePool
from bearsdk.predictors import Predictor, PredictorError
from bearsdk.router import AsyncRouter, ConfigError, InstanceConfig, load_pool_config
from bearsdk.selectors import BEAR

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
MISTRAL = "mistralai/Mistral-7B-Instruct-v0.3"
# Long enough that prefill on the 32B profile's GPUs takes far longer than on the 0.6B's.
PROMPT = "Summarise the following report for the board in three sentences. " + " ".join(
    ["The quarterly figures show steady growth in every region we serve."] * 300
)


def _pool_file(tmp_path: Path, pool: EnginePool) -> Path:
    slow, fast = pool  # Llama on the slow engine, Mistral on the fast one
    f = tmp_path / "pool.toml"
    f.write_text(
        f'[[instances]]\nname = "llama"\nurl = "{slow.url}"\nmodel = "{LLAMA}"\n'
        f'served_model = "{slow.model_name}"\nprofile = "{slow.config.profile}"\n'
        "accuracy_prior = 0.9\n"
        f'[[instances]]\nname = "mistral"\nurl = "{fast.url}"\nmodel = "{MISTRAL}"\n'
        f'served_model = "{fast.model_name}"\nprofile = "{fast.config.profile}"\n',
        encoding="utf-8",
    )
    return f


async def test_a_pool_of_unknown_models_routes_on_latency_with_the_prior(tmp_path: Path) -> None:
    trained = Predictor.load_default().predict(PROMPT, quantiles=False)
    async with (
        EnginePool.of("qwen3-32b-2xh100", "qwen3-0.6b-h100") as pool,
        # (price_all: the test compares both instances' estimates.)
        AsyncRouter(_pool_file(tmp_path, pool), BEAR(price_all=True)) as router,
    ):
        with anyio.fail_after(20):
            for name in router.instances:
                await router.cache(name).wait_version(0)
        loose = await router.route(PROMPT, ttft_target=60.0)
        llama, mistral = loose.candidates
        assert (llama.model, mistral.model) == (LLAMA, MISTRAL)
        # The configured score, and the neutral one: the trained models' mean.
        assert llama.accuracy == pytest.approx(0.9)
        assert mistral.accuracy == pytest.approx(float(np.mean(trained.accuracy)))
        assert llama.cost == pytest.approx(mistral.cost)
        assert loose.instance == "llama"  # both meet the target: the better prior wins
        assert mistral.ttft_s < llama.ttft_s  # the replay sees the engines' real speed
        tight = (llama.ttft_s + mistral.ttft_s) / 2
        d = await router.route(PROMPT, ttft_target=tight)
        assert [c.feasible for c in d.candidates] == [False, True]
        assert d.instance == "mistral"
        # And requests go through to the engine under the prior.
        resp = await router.chat([{"role": "user", "content": "Hi!"}], max_tokens=8)
        assert resp.instance in ("llama", "mistral")
        assert resp["choices"][0]["message"]["content"]


async def test_the_prior_is_announced_once_with_how_to_train(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = "example-org/only-in-this-test-7B"
    cfg = [InstanceConfig(name="x", url="http://127.0.0.1:9", model=model, profile="qwen3-8b-h100")]
    with caplog.at_level(logging.WARNING, logger="bearsdk.router"):
        AsyncRouter(cfg)
        AsyncRouter(cfg)
    warnings = [r for r in caplog.records if model in r.getMessage()]
    assert len(warnings) == 1
    assert "bearsdk train" in warnings[0].getMessage()


def test_prior_values_are_checked() -> None:
    with pytest.raises(
        ConfigError, match=r"accuracy_prior must be a number in \[0, 1\] \(got 1.5\)"
    ):
        load_pool_config(
            {
                "instances": [
                    {"name": "a", "url": "http://x:1", "model": LLAMA, "accuracy_prior": 1.5}
                ]
            }
        )
    two = [
        InstanceConfig(
            name=n, url="http://x:1", model=LLAMA, profile="qwen3-8b-h100", accuracy_prior=p
        )
        for n, p in (("a", 0.5), ("b", 0.6))
    ]
    with pytest.raises(ConfigError, match=r"accuracy_prior 0\.6 differs"):
        AsyncRouter(two)
    with pytest.raises(PredictorError, match="must be a number in"):
        Predictor.load_default().with_priors({LLAMA: float("nan")})


def test_prior_predictions_and_learned_token_counts() -> None:
    base = Predictor.load_default()
    base.observe_usage("Qwen/Qwen3-8B", "x" * 4000, 600)
    p = base.with_priors({LLAMA: None, MISTRAL: 0.25})
    assert p.models == (*base.models, LLAMA, MISTRAL)
    assert p.trained_models == base.models
    assert base.models == p.trained_models  # the original is left as it was
    r, t = p.predict(PROMPT), base.predict(PROMPT)
    k = len(base.models)
    np.testing.assert_allclose(r.accuracy[:k], t.accuracy)
    assert r.accuracy[k] == pytest.approx(t.accuracy.mean())
    assert r.accuracy[k + 1] == 0.25
    assert r.output_tokens[k:] == pytest.approx([t.output_tokens.mean()] * 2)
    for q, v in r.output_quantiles.items():
        assert v[k:] == pytest.approx([t.output_quantiles[q].mean()] * 2)
    # What the counter learned for the trained models survives the extension.
    assert p.tokens.reports("Qwen/Qwen3-8B") == 1
    assert p.tokens.count("Qwen/Qwen3-8B", "y" * 4000) == base.tokens.count(
        "Qwen/Qwen3-8B", "y" * 4000
    )
    p.observe_usage(MISTRAL, "z" * 400, 90)
    assert p.tokens.reports(MISTRAL) == 1
    assert p.predict(PROMPT, prompt_tokens=50).prompt_tokens.tolist() == [50.0] * (k + 2)
    assert p.with_priors({LLAMA: 0.5}) is p  # already covered: left as it is


def test_a_saved_predictor_holds_only_what_was_trained(tmp_path: Path) -> None:
    p = Predictor.load_default().with_priors({LLAMA: 0.5})
    back = Predictor.load(p.save(tmp_path / "p.bearpred"))
    assert back.models == p.trained_models
    assert back.predict(PROMPT).accuracy.tolist() == p.predict(PROMPT).accuracy[:-1].tolist()

"""``bearsdk serve`` with prefix-aware routing: ``[router]`` tokenizers and the prefix options."""

from __future__ import annotations

from pathlib import Path

import pytest

from bearsdk.gateway.config import ConfigError, load_gateway_config
from bearsdk.gateway.server import _router

TOKENIZER = Path(__file__).parent / "data" / "chatml-bpe"
INSTANCE = (
    '[[instances]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    'model = "Qwen/Qwen3-8B"\nprofile = "qwen3-8b-h100"\n'
    "scheduler_params = { enable_prefix_caching = true }\n"
)


def _config(tmp_path: Path, router: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text("[router]\n" + router + "\n" + INSTANCE, encoding="utf-8")
    return path


def test_the_router_gets_the_tokenizers_and_the_prefix_options(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    cfg = load_gateway_config(
        _config(
            tmp_path,
            f'tokenizers = {{ "Qwen/Qwen3-8B" = "{TOKENIZER.as_posix()}" }}\n'
            "dispatch_prefixes = true\nexpect_arrivals = true\n",
        )
    )
    assert cfg.router.tokenizers == (("Qwen/Qwen3-8B", TOKENIZER.as_posix()),)
    router = _router(cfg)
    core = router.core
    assert core.prompts is not None
    assert core.dispatch_prefixes
    assert core.expect_arrivals
    d = core.decide([{"role": "user", "content": "Name three rivers."}], ttft_target=5.0)
    # Tokenized as the engine does: the prompt's length is the tokenizer's count,
    # and the candidate was priced with the prompt's blocks (nothing cached yet).
    assert d.candidates[0].cached_tokens == 0
    assert d.candidates[0].prompt_tokens > 0


def test_by_default_the_gateway_routes_without_them(tmp_path: Path) -> None:
    cfg = load_gateway_config(_config(tmp_path, ""))
    assert cfg.router.tokenizers == ()
    core = _router(cfg).core
    assert not core.dispatch_prefixes
    assert not core.expect_arrivals


@pytest.mark.parametrize(
    ("router", "message"),
    [
        (
            'tokenizers = { "Qwen/Qwen3-8B" = "/no/such/model" }',
            "router: tokenizers.Qwen/Qwen3-8B: /no/such/model does not exist",
        ),
        (
            'tokenizers = { "Qwen/Qwen3-8B" = 3 }',
            "router: tokenizers.Qwen/Qwen3-8B must be a model directory (got 3)",
        ),
        ('tokenizers = "Qwen/Qwen3-8B"', "router: tokenizers must be a table"),
        ("expect_arrivals = 1", "router: expect_arrivals must be true or false (got 1)"),
        ("dispatch_prefix = true", "did you mean 'dispatch_prefixes'?"),
    ],
)
def test_bad_prefix_options_are_refused_by_name(tmp_path: Path, router: str, message: str) -> None:
    with pytest.raises(ConfigError) as got:
        load_gateway_config(_config(tmp_path, router))
    assert message in str(got.value)

"""Emulated engine, unit level: profiles, ground-truth time, text, lengths, metrics, faults."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import attrs
import numpy as np
import pytest

from bearsdk.emulator import (
    BatchShape,
    EmulatedEngine,
    EngineConfig,
    EngineConfigError,
    Faults,
    FaultsError,
    GroundTruthParams,
    GroundTruthTimeModel,
    Tokenizer,
    get_profile,
    profile_names,
)
from bearsdk.emulator.metrics import EngineMetrics, GaugeValues, go_float, request_tokens_buckets
from bearsdk.emulator.text import (
    CODE_CATEGORY,
    CONVERSATION_CATEGORY,
    classify_prompt,
    filler_tokens,
    prompt_seed,
)
from bearsdk.errors import SpecError

SHARED_DATA = Path(os.environ.get("BEARSDK_SHARED", Path(__file__).parents[2] / "shared")) / "data"


def test_required_profiles_are_shipped() -> None:
    names = profile_names()
    for name in ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100"):
        assert name in names
    p = get_profile("qwen3-32b-2xh100")
    assert p.tp == 2
    assert p.model == "Qwen/Qwen3-32B"
    assert p.allreduce[0] > 0
    assert p.allreduce[1] > 0
    assert list(p.dense_knots_s) == sorted(p.dense_knots_s)
    d = p.engine_defaults()
    assert d["max_num_batched_tokens"] == 8192
    assert d["max_num_seqs"] == 1024
    assert (d["num_gpu_blocks"] - 1) * 16 >= p.max_model_len
    assert get_profile("llama-3-8b-a100").engine_defaults()["max_num_batched_tokens"] == 2048
    with pytest.raises(KeyError, match="unknown emulator profile 'nope'; known: "):
        get_profile("nope")


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared data not on this machine")
def test_shipped_table_is_reproducible_from_the_shared_data() -> None:
    from bearsdk.emulator.derive import main

    assert main(["--data", str(SHARED_DATA), "--check"]) == 0


def _model(name: str = "qwen3-8b-h100", **kw: float) -> GroundTruthTimeModel:
    return GroundTruthTimeModel(get_profile(name), GroundTruthParams(**kw).without_noise())  # type: ignore[arg-type]


def test_ground_truth_is_plausible_and_monotone() -> None:
    m = _model()
    decode1 = m.expected(BatchShape(0, 1, 1000, 0, 1, 1))
    assert 0.004 < decode1 < 0.012  # an 8B decode step on an H100
    prefill = m.expected(BatchShape(2048, 0, 0, 2048 * 2049 // 2, 1, 1))
    assert 0.03 < prefill < 0.08
    base = BatchShape(256, 32, 32 * 1500, 256 * 1000, 33, 33)
    t0 = m.expected(base)
    for field in ("prefill_tokens", "decode_tokens", "decode_context", "prefill_attention"):
        bigger = attrs.evolve(base, **{field: getattr(base, field) * 4})
        assert m.expected(bigger) > t0, field
    assert m.expected(BatchShape(0, 0, 0, 0, 0, 0)) == 0.0
    assert _model(time_scale=0.5).expected(base) == pytest.approx(t0 / 2)


def test_ground_truth_is_not_eq12() -> None:
    """The best eq. 12 fit to the ground truth is off by several percent: the
    estimators are tested against a functional form they do not share."""
    m = _model()
    rng = random.Random(1)
    rows, ys = [], []
    for _ in range(400):
        dec = rng.choice([0, 1, 4, 16, 64, 256])
        pre = rng.choice([0, 0, 16, 128, 512, 2048])
        if pre + dec == 0:
            dec = 1
        ctx = dec * rng.randint(100, 4000)
        c = rng.randint(0, 2000)
        patt = pre * c + pre * (pre + 1) // 2 if pre else 0
        s = BatchShape(pre, dec, ctx, patt, dec + (1 if pre else 0), dec + (1 if pre else 0))
        rows.append([1.0, pre + dec, ctx, patt])
        ys.append(m.expected(s))
    a, y = np.array(rows), np.array(ys)
    # Relative least squares, as calibration does.
    coef = np.linalg.lstsq(a / y[:, None], np.ones_like(y), rcond=None)[0]
    mape = float(np.mean(np.abs(a @ coef - y) / y))
    assert mape > 0.02


def test_noise_is_seeded_with_rare_outliers() -> None:
    prof = get_profile("qwen3-8b-h100")
    shape = BatchShape(0, 8, 8000, 0, 8, 8)
    params = GroundTruthParams(outlier_prob=0.05)
    a = GroundTruthTimeModel(prof, params, seed=3)
    b = GroundTruthTimeModel(prof, params, seed=3)
    xs = [a.sample(shape) for _ in range(2000)]
    assert xs == [b.sample(shape) for _ in range(2000)]
    ratio = np.array(xs) / a.expected(shape)
    assert 0.005 < float(np.mean(ratio > 1.3)) < 0.12
    assert float(np.median(ratio)) == pytest.approx(1.0, abs=0.01)
    with pytest.raises(ValueError, match="noise_sigma must be a finite number >= 0"):
        GroundTruthParams(noise_sigma=-1.0)
    with pytest.raises(ValueError, match=r"outlier_prob must be in \[0, 1\] \(got 2.0\)"):
        GroundTruthParams(outlier_prob=2.0)


def test_tokenizer_round_trips_and_counts() -> None:
    tok = Tokenizer()
    text = "Hello, world!  The quick brown fox jumps over 12345 lazy dogs...\n\nOK"
    pieces = tok.pieces(text)
    assert "".join(pieces) == text
    assert tok.count(text) == len(pieces) == len(tok.encode(text))
    assert all(0 < i < tok.vocab_size for i in tok.encode(text))
    assert tok.encode("same text") == tok.encode("same text")
    chat = tok.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert chat.endswith("<|im_start|>assistant\n")
    # Per message: marker, role, newline, content, marker, newline; then the
    # assistant header (marker, "assista" + "nt", newline).
    assert tok.count_chat(chat) == 2 * 5 + tok.count("Be brief.") + tok.count("Hi") + 4
    with pytest.raises(ValueError, match=r"messages\.0\.role must be a non-empty string"):
        tok.render_chat([{"content": "x"}])
    with pytest.raises(ValueError, match=r"messages\.0\.content\.0 must be a text part"):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def test_prompt_categories() -> None:
    assert classify_prompt("Write a Python function that sorts a list", chat=True) == "code"
    assert classify_prompt("Summarize this article in two lines", chat=True) == "summarize"
    assert classify_prompt("Is the sky green? Answer true or false.", chat=True) == "short"
    assert classify_prompt("Give me some ideas for a party", chat=True) == "list"
    assert classify_prompt("Write a poem about autumn", chat=True) == "creative"
    assert classify_prompt("Why is the sky blue?", chat=True) == "qa"
    code = "def f(x):\n    return x;\nimport os\nclass A:\n    pass;\n"
    assert classify_prompt(code, chat=False) == CODE_CATEGORY
    assert classify_prompt("the weather today is fine and", chat=False) == CONVERSATION_CATEGORY


def test_output_lengths_are_deterministic_task_dependent_and_per_model() -> None:
    m8 = get_profile("qwen3-8b-h100").lengths
    m06 = get_profile("qwen3-0.6b-h100").lengths
    seed = prompt_seed("Qwen/Qwen3-8B", "Why is the sky blue?")
    assert m8.sample("qa", 7, seed) == m8.sample("qa", 7, seed)
    draws = {c: [m8.sample(c, 30, s) for s in range(400)] for c in ("short", "qa", "azure-code")}
    med = {c: float(np.median(v)) for c, v in draws.items()}
    assert med["azure-code"] < med["short"] < med["qa"]
    assert 100 < med["qa"] < 1000
    assert m06.median("qa", 30) > m8.median("qa", 30)  # the small model rambles more
    assert m8.median("rewrite", 400) > m8.median("rewrite", 20)  # rewrites scale with input
    with pytest.raises(ValueError, match="category must be one of"):
        m8.sample("nope", 10, 1)


def test_filler_text_is_plausible() -> None:
    toks = filler_tokens(200, 7)
    assert toks == filler_tokens(200, 7)
    assert toks != filler_tokens(200, 8)
    text = "".join(toks)
    assert len(text.split()) > 100
    assert "." in text
    assert text[0].isupper()


async def test_plans_cap_stop_and_force() -> None:
    eng = EmulatedEngine(
        EngineConfig(profile="qwen3-0.6b-h100", params={"max_model_len": 4096}, serve_http=False)
    )
    p = eng.plan(100, natural_len=50, max_tokens=20)
    assert (p.output_len, p.finish_reason, p.max_tokens) == (20, "length", 20)
    p = eng.plan(100, natural_len=10, max_tokens=20)
    assert (p.output_len, p.finish_reason) == (10, "stop")
    assert p.texts[-1] == ""  # the end-of-sequence token has no text
    p = eng.plan(4000, natural_len=500)
    assert (p.output_len, p.max_tokens, p.finish_reason) == (96, 96, "length")
    p = eng.plan(10, natural_len=5, max_tokens=30, ignore_eos=True)
    assert (p.output_len, p.finish_reason) == (30, "length")
    full = "".join(eng.plan(10, natural_len=40, seed=5).texts)
    word = full.split()[6]
    p = eng.plan(10, natural_len=40, seed=5, stop=[word])
    assert p.finish_reason == "stop"
    assert p.stop_reason == word
    assert "".join(p.texts) == full[: full.index(word)]
    assert p.output_len < 40


def test_engine_config_errors_name_the_field() -> None:
    with pytest.raises(EngineConfigError, match=r"port must be in \[0, 65535\] \(got 70000\)"):
        EngineConfig(port=70000)
    with pytest.raises(EngineConfigError, match="fewer than max_model_len=40960"):
        EmulatedEngine(EngineConfig(params={"num_gpu_blocks": 100}))
    with pytest.raises(SpecError, match="max_num_seqs must be an integer"):
        EmulatedEngine(EngineConfig(params={"max_num_seqs": "many"}))
    eng = EmulatedEngine(EngineConfig(scheduler="sarathi", params={"chunk_size": 256}))
    assert eng.policy.num_blocks == get_profile("qwen3-8b-h100").num_gpu_blocks()
    assert eng.max_model_len == 40960


def test_metrics_exposition_parses_with_vllm_names() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    m = EngineMetrics("Qwen/Qwen3-8B", 40960, {"block_size": "16", "num_gpu_blocks": "100"})
    m.observe("vllm:time_to_first_token_seconds", 0.03)
    m.observe("vllm:time_to_first_token_seconds", 3.0)
    m.inc("vllm:generation_tokens", 5)
    m.success["length"] += 1
    text = m.render(GaugeValues(3, 2, 0.25)).decode()
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:num_preemptions",
        "vllm:request_success",
    ):
        assert name in fams, name
    assert fams["vllm:num_requests_running"].samples[0].value == 3
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    ttft = {s.labels.get("le"): s.value for s in fams["vllm:time_to_first_token_seconds"].samples}
    assert ttft["0.04"] == 1
    assert ttft["2.5"] == 1
    assert ttft["5.0"] == 2
    assert ttft["+Inf"] == 2
    gen = fams["vllm:generation_tokens"]
    assert gen.type == "counter"
    assert gen.samples[0].value == 5
    assert gen.samples[0].labels == {"model_name": "Qwen/Qwen3-8B", "engine": "0"}
    reasons = {s.labels["finished_reason"]: s.value for s in fams["vllm:request_success"].samples}
    assert reasons["length"] == 1
    assert reasons["stop"] == 0
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.labels["num_gpu_blocks"] == "100"
    assert info.value == 1
    assert request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert [go_float(x) for x in (1.0, 0.001, 2e7, math.inf)] == ["1.0", "0.001", "2e+07", "+Inf"]


def test_fault_settings_validate() -> None:
    f = Faults(seed=1)
    f.update({"latency_s": 0.01, "fail_next": 2, "error_status": 503})
    assert f.decide("/v1/completions").error_status == 503
    assert f.decide("/bear/snapshot").error_status == 0  # not a fault path
    assert f.decide("/v1/chat/completions").error_status == 503
    assert f.decide("/v1/completions").error_status == 0
    f.update({"drop_next": 1, "drop_after_chunks": 3})
    assert f.decide("/v1/completions").drop_after_chunks == 3
    f.stall(0.5)
    assert f.take_stall() == 0.5
    assert f.take_stall() == 0.0
    f.update({"clear": True})
    assert f.to_dict()["latency_s"] == 0.0
    with pytest.raises(FaultsError, match=r"error_rate must be in \[0, 1\] \(got 2\)"):
        f.update({"error_rate": 2})
    with pytest.raises(FaultsError, match="error_status must be a 5xx HTTP status"):
        f.update({"error_status": 404})
    with pytest.raises(FaultsError, match="bogus is not a fault setting"):
        f.update({"bogus": 1})
    f.update({"error_rate": 0.5})
    hits = sum(f.decide("/v1/completions").error_status > 0 for _ in range(400))
    assert 120 < hits < 280


def test_cli_lists_profiles_and_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from bearsdk.cli import build_parser, main

    assert main(["emulate", "--list-profiles"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-8b-h100" in out
    assert "Qwen/Qwen3-32B" in out
    assert main(["emulate", "--profile", "nope"]) == 2
    assert "unknown emulator profile 'nope'" in capsys.readouterr().err
    assert main(["emulate", "--param", "max_num_seqs"]) == 2
    assert "--param must be KEY=VALUE (got 'max_num_seqs')" in capsys.readouterr().err
    assert main(["emulate", "--profile", "qwen3-8b-h100", "--profile", "qwen3-8b-h100",
                 "--instance", "x"]) == 2  # fmt: skip
    args = build_parser().parse_args(["bench", "emulator", "--rate", "5", "--json"])
    assert args.rate == 5


async def test_sse_encoder_matches_the_response_shapes() -> None:
    import orjson

    from bearsdk.emulator.api import (
        ParsedRequest,
        SseEncoder,
        chat_chunk,
        chat_role_chunk,
        completion_chunk,
        usage_chunk,
    )

    eng = EmulatedEngine(EngineConfig(profile="qwen3-0.6b-h100", serve_http=False))
    plan = eng.plan(5, natural_len=3)
    for chat in (False, True):
        req = ParsedRequest(chat, 'm "x"', plan, True, True, False, "id-1", 123)
        enc = SseEncoder(req)
        shape = chat_chunk if chat else completion_chunk
        for args in (
            ('a\n"b', None, None, None),
            ("", "stop", "END", (5, 2)),
            ("x", "length", None, None),
        ):
            want = b"data: " + orjson.dumps(shape(req, *args)) + b"\n\n"  # type: ignore[arg-type]
            assert enc.content(*args) == want  # type: ignore[arg-type]
        assert enc.usage(5, 2) == b"data: " + orjson.dumps(usage_chunk(req, 5, 2)) + b"\n\n"
        if chat:
            for u in (None, (5, 0)):
                assert enc.role(u) == b"data: " + orjson.dumps(chat_role_chunk(req, u)) + b"\n\n"

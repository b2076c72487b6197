"""Scheduler-policy specs: strict decoding, validation messages, the registry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bearsdk
from bearsdk import SpecError
from bearsdk.replay import IMPLEMENTATION, implementations
from bearsdk.schedulers import (
    compile_scheduler,
    get_scheduler,
    load_spec,
    register_scheduler,
    scheduler_names,
    spec_from_dict,
    unregister_scheduler,
)

BUILTINS = {"vllm-v1", "sarathi", "prefill-first", "vidur-vllm", "vidur-sarathi", "vidur-orca"}


def minimal(**over: object) -> dict[str, object]:
    d: dict[str, object] = {
        "name": "mini",
        "params": {"chunk_size": 512, "max_num_seqs": 64},
        "budget": {"tokens": "$chunk_size", "seqs": "$max_num_seqs"},
        "batch": {"stages": ["decodes", "prefills", "waiting"]},
        "kv": {"block_size": 16},
    }
    d.update(over)
    return d


def test_builtins_are_registered_and_valid() -> None:
    assert set(scheduler_names()) >= BUILTINS
    for name in BUILTINS:
        pol = bearsdk.bind_scheduler(name)
        assert pol.name == name
        assert compile_scheduler(pol).policy == pol


def test_vllm_v1_mirrors_engine_flags() -> None:
    spec = get_scheduler("vllm-v1")
    assert set(spec.params) == {
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "block_size",
        "num_gpu_blocks",
        "long_prefill_token_threshold",
        "watermark",
        "enable_chunked_prefill",
        "async_scheduling",
        "scheduler_reserve_full_isl",
        "enable_prefix_caching",
    }
    pol = spec.bind(
        {
            "max_num_batched_tokens": "4096",
            "async_scheduling": "false",
            "watermark": 0.01,
            "num_gpu_blocks": 1000,
        }
    )
    assert pol.token_budget == 4096
    assert not pol.async_scheduling
    assert pol.watermark_blocks == 10
    assert pol.reserved_blocks == 1


def test_error_names_policy_param_and_value() -> None:
    with pytest.raises(SpecError) as ei:
        bearsdk.bind_scheduler("sarathi", {"chunk_size": 0})
    assert str(ei.value) == "scheduler 'sarathi': chunk_size must be > 0 (got 0)"
    assert (ei.value.scheduler, ei.value.field, ei.value.value) == ("sarathi", "chunk_size", 0)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"colour": 1}, r"colour is not a parameter of this scheduler \(known: "),
        ({"max_num_seqs": "many"}, r"max_num_seqs must be an integer \(got 'many'\)"),
        ({"enable_chunked_prefill": 3}, r"enable_chunked_prefill must be true or false \(got 3\)"),
        ({"watermark": 1.5}, r"watermark must be a fraction in \[0, 1\) \(got 1.5\)"),
        (
            {"max_num_seqs": 4096},
            r"max_num_seqs must be <= max_num_batched_tokens 2048 \(got 4096\)",
        ),
        (
            {"enable_chunked_prefill": False, "max_model_len": 4096},
            r"max_num_batched_tokens must be >= max_model_len 4096 when chunked prefill is off",
        ),
        (
            {"long_prefill_token_threshold": 900, "max_model_len": 512},
            r"long_prefill_token_threshold must be <= max_model_len 512 \(got 900\)",
        ),
    ],
)
def test_bad_parameter_values(params: dict[str, object], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        bearsdk.bind_scheduler("vllm-v1", params)


@pytest.mark.parametrize(
    ("mutation", "match"),
    [
        (
            {"budget": {"tokens": "$chunk_size", "seqs": "$max_num_seqs", "colour": 1}},
            r"'mini': budget.colour is not a known field",
        ),
        ({"extra": {}}, r"'mini': extra is not a known section"),
        (
            {"batch": {"stages": ["running", "decodes", "prefills", "waiting"]}},
            r"'running' already covers 'decodes' and 'prefills'",
        ),
        (
            {"batch": {"stages": ["decodes", "waiting", "prefills"]}},
            r"'prefills' must directly follow 'decodes'",
        ),
        ({"batch": {"stages": ["running"]}}, r"must include 'waiting'"),
        (
            {"batch": {"stages": ["running", "queue"]}},
            r"batch.stages must be one of .* \(got 'queue'\)",
        ),
        (
            {
                "batch": {
                    "stages": ["running", "waiting"],
                    "exclusive": True,
                    "async_scheduling": True,
                }
            },
            r"batch.async_scheduling must be false when batch.exclusive is true",
        ),
        (
            {"kv": {"block_size": 16, "allocate": "lazy"}},
            r"kv.allocate must be one of .* \(got 'lazy'\)",
        ),
        ({"kv": {"block_size": "$bs"}}, r"kv.block_size refers to unknown parameter 'bs'"),
        (
            {"kv": {"block_size": 16, "allocate": "max-length"}},
            r"budget.max_model_len must be > 0 when kv.allocate",
        ),
        ({"preemption": {"victim": "oldest"}}, r"preemption.victim must be one of"),
        ({"schema": "bear.scheduler/9"}, r"schema must be 'bear.scheduler/1'"),
    ],
)
def test_strict_spec_decoding(mutation: dict[str, object], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        spec_from_dict(minimal(**mutation))


def test_register_from_file_replays_compiled(tmp_path: Path) -> None:
    src = Path(__file__).parent.parent / "bearsdk" / "schedulers" / "specs" / "vllm-v1.toml"
    text = (
        src.read_text()
        .replace('name = "vllm-v1"', 'name = "my-engine"')
        .replace('requeue = "front"', 'requeue = "back"')
    )
    f = tmp_path / "my-engine.toml"
    f.write_text(text)
    spec = register_scheduler(f)
    try:
        assert spec.name == "my-engine"
        assert "my-engine" in scheduler_names()
        with pytest.raises(SpecError, match="already registered"):
            register_scheduler(f)
        pol = bearsdk.bind_scheduler("my-engine", {"num_gpu_blocks": 64, "async_scheduling": False})
        assert pol.requeue == "back"
        assert compile_scheduler(pol).implementation == IMPLEMENTATION
        if "cython" in implementations():
            # a runtime-registered spec runs on the compiled loop like a built-in
            assert compile_scheduler(pol, "cython").implementation == "cython"
        # Memory-tight: the new request's prompt waits for a completion.
        table = np.array(
            [[0, 300, 320, 21, 60, 60, 0], [0, 300, 330, 31, 40, 40, 0], [1, 200, 0, 0, 20, 20, 0]],
            dtype=np.int64,
        )
        results = {
            impl: compile_scheduler(pol, impl).replay(
                compile_scheduler(pol, impl).prepare(table), 150, 10, record=True
            )
            for impl in implementations()
        }
        ref = results["python"]
        assert ref.first_token_batch > 5
        for res in results.values():
            assert res.first_token_batch == ref.first_token_batch
            assert res.batches == ref.batches
    finally:
        unregister_scheduler("my-engine")
    assert "my-engine" not in scheduler_names()


def test_builtins_cannot_be_replaced() -> None:
    with pytest.raises(SpecError, match="built-in"):
        register_scheduler(get_scheduler("sarathi"), replace=True)
    with pytest.raises(SpecError, match="is not a registered scheduler"):
        get_scheduler("nope")


def test_load_spec_reports_bad_toml(tmp_path: Path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text("name = [\n")
    with pytest.raises(SpecError, match="is not valid TOML"):
        load_spec(f)


def test_policies_are_hashable_and_cached() -> None:
    a = bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 8})
    b = bearsdk.bind_scheduler("vllm-v1", {"max_num_seqs": 8})
    assert a == b
    assert hash(a) == hash(b)
    assert compile_scheduler(a) is compile_scheduler(b)

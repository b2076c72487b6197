"""Scheduler specs as untrusted files (issue 19, "Specs"): clean errors, physical bounds.

A spec file is typed by a person and read by ``--scheduler ./mine.toml``: any
mistake must be one :class:`SpecError` naming the scheduler, the field and the
value, never a ``UnicodeDecodeError``, ``RecursionError`` or ``MemoryError``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bearsdk
from bearsdk import SpecError
from bearsdk.replay import implementations
from bearsdk.schedulers import compile_scheduler, load_spec, spec_from_dict
from bearsdk.snapshot import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, MAX_REQUEST_TOKENS, MAX_REQUESTS

SPECS = Path(__file__).parent.parent / "bearsdk" / "schedulers" / "specs"
MAX_MESSAGE = 1024


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


def nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


def test_non_utf8_file_is_a_spec_error_naming_the_file(tmp_path: Path) -> None:
    f = tmp_path / "latin.toml"
    f.write_bytes((SPECS / "sarathi.toml").read_bytes() + b"\n# caf\xe9 \xff\n")
    with pytest.raises(SpecError, match=r"is not UTF-8") as ei:
        load_spec(f)
    assert str(f) in str(ei.value)


def test_a_utf8_bom_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf" + (SPECS / "sarathi.toml").read_bytes())
    assert load_spec(f).name == "sarathi"


@pytest.mark.parametrize("depth", [900, 5000, 100_000])
def test_deep_nesting_in_a_file_is_a_spec_error(tmp_path: Path, depth: int) -> None:
    f = tmp_path / "deep.toml"
    f.write_text('name = "deep"\nx = ' + "[" * depth + "1" + "]" * depth + "\n")
    with pytest.raises(SpecError) as ei:
        load_spec(f)
    assert len(str(ei.value).encode()) <= MAX_MESSAGE


@pytest.mark.parametrize("where", ["name", "description", "params", "budget", "kv.block_size"])
def test_deep_values_in_a_dict_are_a_spec_error(where: str) -> None:
    deep = nested(sys.getrecursionlimit() * 2)
    d = minimal()
    if where == "kv.block_size":
        d["kv"] = {"block_size": deep}
    elif where == "params":
        d["params"] = {"chunk_size": deep, "max_num_seqs": 64}
    else:
        d[where] = deep
    with pytest.raises(SpecError) as ei:
        spec_from_dict(d)
    assert len(str(ei.value).encode()) <= MAX_MESSAGE


def test_huge_values_give_short_messages() -> None:
    with pytest.raises(SpecError) as ei:
        spec_from_dict(minimal(description=["x" * 10**7]))
    assert len(str(ei.value).encode()) <= MAX_MESSAGE
    with pytest.raises(SpecError) as ei:
        spec_from_dict(minimal(kv={"block_size": "$" + "b" * 10**7}))
    assert len(str(ei.value).encode()) <= MAX_MESSAGE


def test_an_unused_param_is_an_error_with_a_suggestion() -> None:
    d = minimal(params={"chunk_size": 512, "max_num_seqs": 64, "max_num_seqz": 3})
    with pytest.raises(SpecError, match=r"params.max_num_seqz is not used by any block"):
        spec_from_dict(d)


def test_a_typo_in_a_param_suggests_the_right_name() -> None:
    d = minimal(params={"chunk_sise": 512, "max_num_seqs": 64})
    with pytest.raises(SpecError) as ei:
        spec_from_dict(d)
    msg = str(ei.value)
    assert "chunk_size" in msg
    assert "did you mean 'chunk_sise'?" in msg or "did you mean 'chunk_size'?" in msg


def test_an_unknown_override_suggests_the_right_name() -> None:
    with pytest.raises(SpecError, match=r"did you mean 'max_num_seqs'\?"):
        bearsdk.bind_scheduler("vllm-v1", {"max_num_seq": 8})
    with pytest.raises(SpecError, match=r"colour is not a parameter of this scheduler"):
        bearsdk.bind_scheduler("vllm-v1", {"colour": 1})


def test_an_unknown_block_field_suggests_the_right_name() -> None:
    with pytest.raises(
        SpecError, match=r"kv.blocksize is not a known field.*did you mean 'block_size'"
    ):
        spec_from_dict(minimal(kv={"blocksize": 16}))


@pytest.mark.parametrize("impl", implementations())
@pytest.mark.parametrize("bs", [MAX_BLOCK_SIZE + 1, 10**12, 2**61, 2**63 - 1])
def test_a_huge_block_size_is_a_spec_error_in_every_implementation(impl: str, bs: int) -> None:
    with pytest.raises(SpecError) as ei:
        compile_scheduler(bearsdk.bind_scheduler("vllm-v1", {"block_size": bs}), impl)
    assert str(ei.value) == (
        f"scheduler 'vllm-v1': block_size must be <= {MAX_BLOCK_SIZE} (got {bs})"
    )
    d = minimal(kv={"block_size": bs})
    with pytest.raises(SpecError, match=r"'mini': kv.block_size must be <= "):
        spec_from_dict(d)


@pytest.mark.parametrize(
    ("param", "value", "cap"),
    [
        ("num_gpu_blocks", MAX_NUM_BLOCKS + 1, MAX_NUM_BLOCKS),
        ("max_num_batched_tokens", MAX_REQUEST_TOKENS + 1, MAX_REQUEST_TOKENS),
        ("max_num_seqs", MAX_REQUESTS + 1, MAX_REQUESTS),
        ("max_model_len", MAX_REQUEST_TOKENS + 1, MAX_REQUEST_TOKENS),
        ("long_prefill_token_threshold", MAX_REQUEST_TOKENS + 1, MAX_REQUEST_TOKENS),
        ("num_gpu_blocks", 2**63 - 1, MAX_NUM_BLOCKS),
    ],
)
def test_numeric_params_are_bounded_physically(param: str, value: int, cap: int) -> None:
    params: dict[str, object] = {param: value}
    if param == "max_num_seqs":
        params["max_num_batched_tokens"] = MAX_REQUEST_TOKENS
    with pytest.raises(SpecError) as ei:
        bearsdk.bind_scheduler("vllm-v1", params)
    assert str(ei.value) == f"scheduler 'vllm-v1': {param} must be <= {cap} (got {value})"


def test_policies_at_the_caps_replay_in_every_implementation() -> None:
    pol = bearsdk.bind_scheduler(
        "vllm-v1",
        {"block_size": MAX_BLOCK_SIZE, "num_gpu_blocks": MAX_NUM_BLOCKS, "max_model_len": 2**20},
    )
    table = np.array([[0, 300, 300, 2, 60, 60, 0], [1, 200, 0, 0, 20, 20, 0]], dtype=np.int64)
    out = {}
    for impl in implementations():
        rep = compile_scheduler(pol, impl)
        out[impl] = rep.replay(rep.prepare(table), 150, 10).first_token_batch
    assert len(set(out.values())) == 1


def test_with_kv_is_bounded() -> None:
    pol = bearsdk.bind_scheduler("vllm-v1")
    with pytest.raises(SpecError, match=r"kv.block_size must be in \[1, "):
        pol.with_kv(10**12, 100)
    with pytest.raises(SpecError, match=r"kv.num_blocks must be in \[0, "):
        pol.with_kv(16, 2**40)
    assert pol.with_kv(MAX_BLOCK_SIZE, MAX_NUM_BLOCKS).block_size == MAX_BLOCK_SIZE

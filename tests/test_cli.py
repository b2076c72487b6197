"""The command line: `bearsdk replay` (CONTRACTS.md section 2) and friends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bearsdk.cli import main

SNAP = {
    "schema": "bear.snapshot/1",
    "instance": "i0",
    "seq": 1,
    "time": 0.0,
    "kv": {"block_size": 16, "num_blocks": 1000, "free_blocks": 500},
    "requests": [
        {
            "id": "r1",
            "state": "running",
            "prompt_tokens": 700,
            "computed_tokens": 512,
            "output_tokens": 0,
            "max_tokens": 256,
            "output_len": 40,
        },
        {
            "id": "r2",
            "state": "waiting",
            "prompt_tokens": 90,
            "computed_tokens": 0,
            "output_tokens": 0,
            "max_tokens": 64,
            "output_len": 41,
        },
    ],
}


def case(cid: str, **over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "case_id": cid,
        "scheduler": "vllm-v1",
        "params": {
            "max_num_batched_tokens": 512,
            "max_num_seqs": 8,
            "block_size": 16,
            "num_gpu_blocks": 1000,
        },
        "snapshot": SNAP,
        "new": {"prompt_tokens": 300, "output_len": 5},
        "batch_time": [0.004, 2.0e-5, 4.0e-8, 1.0e-10],
    }
    c.update(over)
    return c


def run_cases(
    tmp_path: Path, lines: list[str], capsys: pytest.CaptureFixture[str]
) -> list[dict[str, Any]]:
    f = tmp_path / "cases.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--cases", str(f), "--json"]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def test_cases_mode_one_result_per_line_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps(case("c1")),
        "{not json",
        json.dumps(case("c2", params={"max_num_seqs": 0})),
        json.dumps(case("c3", batch_time=None)),
        json.dumps(case("c4", new={"prompt_tokens": 300, "colour": 1})),
        json.dumps(case("c5", scheduler="sarathi", params={"chunk_size": 256})),
    ]
    out = run_cases(tmp_path, lines, capsys)
    assert [o.get("case_id") for o in out] == ["c1", None, "c2", "c3", "c4", "c5"]
    assert out[0]["first_token_batch"] == 2
    assert out[0]["ttft_s"] > 0
    assert out[1]["error"].startswith("line 2: not valid JSON")
    assert out[2]["error"] == "line 3: scheduler 'vllm-v1': max_num_seqs must be > 0 (got 0)"
    assert out[3]["ttft_s"] is None
    assert out[3]["first_token_batch"] == 2
    assert out[4]["error"] == "line 5: new.colour is not a known field"
    assert out[5]["first_token_batch"] >= 2


def test_single_mode_prints_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "snap.json"
    f.write_text(json.dumps(SNAP))
    assert (
        main(
            [
                "replay",
                "--snapshot",
                str(f),
                "--prompt-tokens",
                "300",
                "--output-len",
                "5",
                "--param",
                "max_num_batched_tokens=512",
                "--batch-time",
                "0.004,2e-5,4e-8,1e-10",
                "--batches",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "first token in batch 2" in out
    assert "TTFT" in out
    assert (
        main(["replay", "--snapshot", str(f), "--prompt-tokens", "300", "--json", "--batches"]) == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["stop_reason"] == "first-token"
    assert res["ttft_s"] is None
    assert len(res["batches"]) >= 1


def test_single_mode_bad_param_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "snap.json"
    f.write_text(json.dumps(SNAP))
    assert (
        main(["replay", "--snapshot", str(f), "--prompt-tokens", "10", "--param", "max_num_seqs=x"])
        == 2
    )
    assert "max_num_seqs must be an integer (got 'x')" in capsys.readouterr().err

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
    tmp_path: Path, lines: list[str], capsys: pytest.CaptureFixture[str], status: int = 0
) -> list[dict[str, Any]]:
    f = tmp_path / "cases.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert main(["replay", "--cases", str(f), "--json"]) == status
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
    # Bad lines get their error result and the others still run; the status says so.
    out = run_cases(tmp_path, lines, capsys, status=2)
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


def test_single_mode_shows_the_batch_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "snap.json"
    f.write_text(json.dumps({**SNAP, "inflight": {"remaining_s": 0.0123}}))
    argv = ["replay", "--snapshot", str(f), "--prompt-tokens", "300", "--output-len", "5"]
    argv += ["--batch-time", "0.004,2e-5,4e-8,1e-10"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "including 12.300 ms left of the batch in flight" in out
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["inflight_s"] == pytest.approx(0.0123)
    assert res["ttft_s"] > 0.0123


def test_a_scheduler_spec_file_is_accepted_where_a_name_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = Path(__file__).resolve().parents[1] / "bearsdk" / "schedulers" / "specs"
    text = (specs / "sarathi.toml").read_text()
    spec = tmp_path / "mine.toml"
    spec.write_text(text.replace('name = "sarathi"', 'name = "my-sarathi"'))
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(SNAP))
    argv = ["replay", "--snapshot", str(snap), "--prompt-tokens", "300", "--scheduler"]
    assert main([*argv, str(spec)]) == 0
    assert capsys.readouterr().out.startswith("scheduler my-sarathi: 2 resident requests")
    with pytest.raises(SystemExit, match="2"):
        main([*argv, str(tmp_path / "nope.toml")])
    assert "nope.toml: No such file" in capsys.readouterr().err
    spec.write_text(text)  # a built-in's name cannot be taken over
    with pytest.raises(SystemExit, match="2"):
        main([*argv, str(spec)])
    assert "built-in" in capsys.readouterr().err


def test_bench_emulator_verdict_names_the_bound_and_the_value() -> None:
    from bearsdk.bench.emulator import failed_checks

    ok = {"sent": 10, "completed": 10, "errors": 0, "usage_mismatches": 0}
    assert failed_checks([0.001] * 100, ok) == []
    lags = [0.001] * 90 + [0.0213] * 10
    bad = {"sent": 10, "completed": 8, "errors": 2, "usage_mismatches": 1}
    assert failed_checks(lags, bad) == [
        "p99 loop lag 21.30 ms is over the 5 ms bound",
        "2 requests failed (bound: 0)",
        "8 of 10 requests completed (bound: all)",
        "1 usage mismatches (bound: 0)",
    ]
    assert failed_checks([], ok) == ["no batch completed: no loop lag was measured"]

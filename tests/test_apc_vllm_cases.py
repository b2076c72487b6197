"""The replay of vLLM 0.33's own prefix-caching states, on committed cases.

Each case is a snapshot of vLLM's real V1 scheduler with its block pool
(``kv.prefix_cache``: shared blocks, cached and free blocks in eviction order,
the residents' hash chains) taken mid-run on a token-id workload (agent
sessions, shared system prompts, few-shot bursts, Mooncake block hashes), a new
request sharing a prefix with it, and vLLM's batches to its first token. The
snapshot must pass validation and the replay must form every batch as vLLM did
(tokens and contexts). The full run (1,598 cases) is tests/oracle/apc_cases.py
with apc_replay.py (docs/prefix-caching.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle.apc_live import vllm_v1_params
from oracle.apc_replay import check, load

CASES = load(str(Path(__file__).parent / "data" / "apc_vllm_cases.jsonl.gz"))


def _config(case: dict[str, Any]) -> str:
    return str(case["name"].split("@")[1].split("#")[0])


def test_sample_covers_the_hard_parts() -> None:
    assert {c["name"].split("/")[0] for c in CASES} == {"agent", "fewshot", "mooncake", "system"}
    assert len({_config(c) for c in CASES}) >= 8
    snaps = [c["snapshot"] for c in CASES]
    assert any(any(e >= 0 for e in s["kv"]["prefix_cache"]["free"]) for s in snaps)
    assert any(r["state"] == "waiting" and r.get("chain") for s in snaps for r in s["requests"])
    assert max(len(c["vllm_batches"]) for c in CASES) > 20
    cached = [
        set(s["kv"]["prefix_cache"]["keys"][: s["kv"]["prefix_cache"]["cached"]]) for s in snaps
    ]
    hits = sum(
        bool(c["new"]["prefix_keys"]) and c["new"]["prefix_keys"][0] in k
        for c, k in zip(CASES, cached, strict=True)
    )
    assert hits > len(CASES) // 3


@pytest.mark.parametrize("config", sorted({_config(c) for c in CASES}))
def test_replay_forms_vllms_batches(config: str) -> None:
    diffs = [f"{c['name']}: {d}" for c in CASES if _config(c) == config and (d := check(c))]
    assert not diffs, diffs[:3]


def test_bearsdk_replay_cases_takes_the_extension_and_prefix_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import orjson

    from bearsdk.cli import main

    lines = []
    want = {}
    for c in CASES[::3]:
        params = vllm_v1_params(c["config"])
        new = {k: c["new"][k] for k in ("prompt_tokens", "output_len", "max_tokens", "prefix_keys")}
        lines.append(
            {"case_id": c["name"], "scheduler": "vllm-v1", "params": params,
             "snapshot": c["snapshot"], "new": new}
        )  # fmt: skip
        want[c["name"]] = len(c["vllm_batches"])
    f = tmp_path / "cases.jsonl"
    f.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    capsys.readouterr()
    assert main(["replay", "--cases", str(f), "--json"]) == 0
    out = capsys.readouterr().out.split()
    got = {d["case_id"]: d["first_token_batch"] for d in map(orjson.loads, out)}
    assert got == want

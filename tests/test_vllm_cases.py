"""The replay against vLLM 0.33's real V1 scheduler, on committed oracle cases.

The full differential run (thousands of cases, regenerated from vLLM itself)
is tests/oracle/vllm_diff.py; this keeps a representative sample in CI.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from oracle.compare import Tally, compare, ttft_agree

from bearsdk.replay import implementations

DATA = Path(__file__).parent / "data" / "vllm_oracle_cases.jsonl.gz"


def _cases() -> list[dict[str, Any]]:
    with gzip.open(DATA, "rt") as f:
        return [json.loads(line) for line in f]


CASES = _cases()


def test_sample_covers_the_hard_parts() -> None:
    configs = {c["case_id"].split("-")[0] for c in CASES}
    assert len(configs) == 13
    assert any(c["config"]["async_scheduling"] for c in CASES)
    assert any(not c["config"]["enable_chunked_prefill"] for c in CASES)
    assert any(any(b[2] for b in c["vllm_batches"]) for c in CASES), "no preemption"
    assert any(c["config"]["block_size"] == 32 for c in CASES)
    assert max(c["isolated_first_token_batch"] for c in CASES) > 300


@pytest.mark.parametrize("config", sorted({c["case_id"].split("-")[0] for c in CASES}))
def test_matches_vllm(config: str, impl: str) -> None:
    tally: dict[str, Tally] = {}
    cases = [c for c in CASES if c["case_id"].startswith(config + "-")]
    for c in cases:
        compare(c, c["vllm_batches"], [impl], tally)
    t = tally[impl]
    assert t.failures == []
    assert t.first_token_exact == t.batches_exact == len(cases)
    if impl == "python":
        assert t.per_request_exact == len(cases)


@pytest.mark.skipif(len(implementations()) < 2, reason="compiled replay not built")
def test_implementations_agree_on_ttft() -> None:
    assert all(ttft_agree(c, sorted(implementations())) for c in CASES[::7])

"""The live scheduler with prefix caching against vLLM 0.33's, on committed cases.

Each case is a workload of real token ids (multi-turn agent sessions, shared
system prompts, few-shot bursts, Mooncake block hashes) that vLLM's own V1
scheduler ran with automatic prefix caching; bearsdk's scheduler must form the
same batches step by step, with the same prefix hit at every admission, the
same preemptions and the same free-block count. Regenerate the sample with
tests/oracle/apc_sweep.py and apc_live.py --write-fixture (docs/prefix-caching.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from oracle.apc_live import check_case, read_fixture

DATA = Path(__file__).parent / "data" / "apc_oracle_cases.jsonl.gz"
CASES = read_fixture(DATA)


def _config(case: dict[str, Any]) -> str:
    return str(case["name"].rsplit("@", 1)[1])


def test_sample_covers_the_hard_parts() -> None:
    kinds = {c["name"].split("/")[0] for c in CASES}
    assert kinds == {"agent", "fewshot", "mooncake", "system"}
    assert len({_config(c) for c in CASES}) >= 8
    steps = [r for c in CASES for r in c["trace"]]
    assert any(r["preempted"] for r in steps), "no preemption"
    assert any(a["resumed"] and a["computed"] > 0 for r in steps for a in r["admitted"].values())
    hits = [a["computed"] for r in steps for a in r["admitted"].values()]
    assert sum(h > 0 for h in hits) > len(hits) // 3
    assert any(c["config"].get("use_async") for c in CASES)
    assert any(not c["config"].get("prefix_caching", True) for c in CASES)


@pytest.mark.parametrize("config", sorted({_config(c) for c in CASES}))
def test_live_scheduler_matches_vllm_step_by_step(config: str) -> None:
    diffs = [
        f"{c['name']}: {d}"
        for c in CASES
        if _config(c) == config and (d := check_case(c)) is not None
    ]
    assert not diffs, diffs[:3]

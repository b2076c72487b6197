"""Every output token's batch, against vLLM 0.33's own scheduler, on committed cases.

Each case is a snapshot of vLLM's real V1 scheduler taken mid-run (with its
block pool when prefix caching is on), a new request, and the batch in which
vLLM computed each of the new request's tokens, through its last. Both replay
twins, run with ``next_tokens``, must put every one of its first 33 tokens in
vLLM's batch, including after a preemption past its first token, and the pure
twin must form vLLM's batches up to the last of them. The full run is
tests/oracle/tpot_cases.py (vLLM's environment) with tpot_check.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from oracle.apc_replay import load
from oracle.tpot_check import check

CASES = load(str(Path(__file__).parent / "data" / "tpot_vllm_cases.jsonl.gz"))


def _config(case: dict[str, Any]) -> str:
    return str(case["name"].split("@")[1].split("#")[0])


def test_sample_covers_the_hard_parts() -> None:
    assert len({_config(c) for c in CASES}) >= 12
    assert {c["config"]["use_async"] for c in CASES} == {False, True}
    assert {c["config"]["prefix_caching"] for c in CASES} == {False, True}
    tb = [c["token_batches"][:33] for c in CASES]
    # Preempted past the first token (a gap between tokens), in both modes.
    gapped = [
        c
        for c, t in zip(CASES, tb, strict=True)
        if any(b - a > 1 for a, b in itertools.pairwise(t))
    ]
    assert {c["config"]["use_async"] for c in gapped} == {False, True}
    assert sum(len(t) == 33 for t in tb) > len(CASES) // 2


@pytest.mark.parametrize("config", sorted({_config(c) for c in CASES}))
def test_every_token_lands_in_vllms_batch(config: str) -> None:
    diffs = [f"{c['name']}: {d}" for c in CASES if _config(c) == config and (d := check(c, 32))]
    assert not diffs, diffs[:3]

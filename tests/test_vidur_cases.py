"""The replay against Vidur's own schedulers, timed exactly (issue 17, item 6).

Each case in ``data/vidur_cases.jsonl.gz`` is a snapshot of Vidur's
``VLLMReplicaScheduler`` or ``SarathiReplicaScheduler`` taken mid-run, a new
request, Vidur's batches up to its first token and the TTFT Vidur gives it when
every batch costs eq. 12 in Vidur's terms (``tests/oracle/vidur_cases.py``).
Vidur prices a decode by ``num_processed_tokens``, the keys it attends: with
``decode_keys="attended"`` both twins form Vidur's batches and give its TTFT
to 1e-9 s; counting only the context before the batch falls short by exactly
``b2`` per decode token in the window.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.replay import implementations
from bearsdk.schedulers import get_scheduler
from bearsdk.snapshot import snapshot_from_dict

CASES = Path(__file__).parent / "data" / "vidur_cases.jsonl.gz"


def _cases() -> list[dict[str, Any]]:
    with gzip.open(CASES, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _replay(case: dict[str, Any], impl: str, decode_keys: str) -> tuple[float, list[list[int]]]:
    pol = get_scheduler(case["scheduler"]).bind(case["params"])
    snap = snapshot_from_dict(case["snapshot"])
    assert snap.kv is not None
    b0, b1, b2, b3, tau = case["coeffs"]
    model = BatchTimeModel(b0, b1, b2, b3, dense_floor_tokens=tau, decode_keys=decode_keys)
    rp = implementations()[impl](pol)
    res = rp.replay(
        rp.prepare(snap.table, snap.kv.free_blocks),
        case["new"]["prompt_tokens"],
        case["new"]["output_len"],
        model.replay_coeffs,
        record=True,
    )
    records = [
        [b.num_seqs, b.prefill_tokens, b.decode_tokens, b.decode_context, b.prefill_attention]
        for b in res.batches
    ]
    return res.ttft_s, records


def test_the_cases_cover_both_schedulers_restarts_and_decodes() -> None:
    cases = _cases()
    assert len(cases) >= 500
    for spec in ("vidur-vllm", "vidur-sarathi"):
        mine = [c for c in cases if c["scheduler"] == spec]
        assert len(mine) >= 250
        assert sum(c["restarts"] > 0 for c in mine) >= 10
        # Vidur's vllm admits a new request at once unless the pool is short:
        # decodes before its prefill need a blocked queue.
        assert sum(any(b[2] for b in c["vidur_batches"]) for c in mine) >= 30


@pytest.mark.parametrize("impl", sorted(implementations()))
def test_attended_decodes_give_vidurs_batches_and_ttft(impl: str) -> None:
    bad = []
    for case in _cases():
        ttft, records = _replay(case, impl, "attended")
        if records != case["vidur_batches"] or abs(ttft - case["vidur_ttft_s"]) > 1e-9:
            bad.append((case["scheduler"], case["seed"], ttft - case["vidur_ttft_s"]))
    assert not bad, f"{len(bad)} cases differ from Vidur, e.g. {bad[:3]}"


@pytest.mark.parametrize("impl", sorted(implementations()))
def test_the_context_before_the_batch_is_short_by_b2_per_decode(impl: str) -> None:
    short = 0
    for case in _cases():
        ttft, records = _replay(case, impl, "before")
        decodes = sum(b[2] for b in records)
        b2 = case["coeffs"][2]
        assert ttft == pytest.approx(case["vidur_ttft_s"] - b2 * decodes, abs=1e-9)
        short += decodes > 0
    assert short >= 200

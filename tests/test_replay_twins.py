"""The two replay twins agree on every small single-resident snapshot (issue 19, defect 4).

The hypothesis suites draw snapshots as an engine produces them; a snapshot
comes from the network, though, and the validator accepts any running request
with ``computed_tokens <= prompt + outputs + placeholders``. Here every such
one-request snapshot of a tiny grid is replayed by the twin, by the compiled
loop and by the compiled loop with its exact path forced, under every built-in
spec (sync and async), and all three must form the same batches.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from oracle.compare import Tally, compare

from bearsdk.replay import ReplayResult, implementations
from bearsdk.schedulers import BoundScheduler, get_scheduler
from bearsdk.snapshot import NCOLS

pytestmark = pytest.mark.skipif(
    "cython" not in implementations(), reason="compiled replay not built"
)

COEFFS = (0.003, 2e-5, 5e-8, 1e-10)
VLLM_CASES = Path(__file__).parent / "data" / "vllm_single_resident_cases.jsonl.gz"

SPECS: list[tuple[str, dict[str, object]]] = [
    ("vllm-v1", {"async_scheduling": True}),
    ("vllm-v1", {"async_scheduling": False}),
    ("sarathi", {}),
    ("prefill-first", {}),
    ("vidur-vllm", {}),
    ("vidur-sarathi", {}),
    ("vidur-orca", {}),
]


def single_resident_rows() -> Iterator[list[int]]:
    """One running or waiting request with tiny counts, as the validator accepts them."""
    for prompt, out in itertools.product((1, 3), (0, 1, 2)):
        for total, capped in itertools.product((out + 1, out + 2), (False, True)):
            mt = total if capped else -1
            yield [1, prompt, 0, out, mt, total, 0]
            for ph in (0, 1, 3):
                for computed in range(prompt + out + ph + 1):
                    yield [0, prompt, computed, out, mt, total, ph]


def _replay(
    pol: BoundScheduler, impl: str, row: list[int], free: int, prompt: int, slow: bool
) -> object:
    rp = implementations()[impl](pol)
    if slow:
        rp.force_slow = True  # type: ignore[attr-defined]
    table = np.array([row], dtype=np.int64).reshape(1, NCOLS)
    try:
        res = rp.replay(rp.prepare(table, free), prompt, 2, COEFFS, record=True, max_batches=60)
    except ValueError as e:  # both twins must refuse alike
        return ("refused", str(e))
    assert isinstance(res, ReplayResult)
    return (res.first_token_batch, res.stop_reason, res.batches)


@pytest.mark.parametrize(("name", "over"), SPECS, ids=[f"{n}-{o}" for n, o in SPECS])
def test_single_resident_snapshots_agree(name: str, over: dict[str, object]) -> None:
    base = get_scheduler(name).bind({**over, "block_size": 2})
    bad: list[str] = []
    n = 0
    for num_blocks, free in ((0, -1), (4, -1), (40, 1)):
        pol = base.with_kv(base.block_size, num_blocks)
        for row in single_resident_rows():
            for prompt in (1, 3):
                n += 1
                ref = _replay(pol, "python", row, free, prompt, False)
                for slow in (False, True):
                    got = _replay(pol, "cython", row, free, prompt, slow)
                    if got != ref:
                        bad.append(f"pool {num_blocks}/{free} row {row} new {prompt} slow={slow}")
    assert not bad, f"{len(bad)} of {n} disagree, e.g. {bad[:3]}"


@pytest.mark.parametrize("impl", sorted(implementations()))
@pytest.mark.parametrize(
    ("async_", "row"), [(False, [0, 3, 6, 3, 10, 10, 0]), (True, [0, 3, 6, 2, 10, 10, 1])]
)
def test_a_request_with_everything_computed_is_not_served(
    impl: str, async_: bool, row: list[int]
) -> None:
    # computed == prompt + outputs + placeholders. vLLM 0.33's scheduler, given
    # this state (r0 decoding, num_computed_tokens bumped by one, r1 with a
    # 5-token prompt added), schedules {r1: 5}, {r1: 1}: num_new_tokens is 0 for
    # r0, which is skipped. The twin did that; the compiled loop served r0 as a
    # decode (num_seqs 2, decode_tokens 1 in the first batch).
    params = {
        "async_scheduling": async_,
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "max_model_len": 64,
    }
    pol = get_scheduler("vllm-v1").bind(params).with_kv(4, 64)
    rp = implementations()[impl](pol)
    res = rp.replay(rp.prepare(np.array([row], dtype=np.int64)), 5, 2, COEFFS, record=True)
    assert res.first_token_batch == 1
    assert res.batches is not None
    first = res.batches[0]
    assert (first.num_seqs, first.prefill_tokens, first.decode_tokens) == (1, 5, 0)


def test_real_vllm_single_resident_snapshots(impl: str) -> None:
    # 1784 snapshots vLLM itself produced (tests/oracle/gen_single_resident.py):
    # both twins match vLLM's batches on every one, sync and async.
    with gzip.open(VLLM_CASES, "rt") as f:
        cases = [json.loads(line) for line in f]
    assert len(cases) == 1784
    tally: dict[str, Tally] = {}
    for c in cases:
        compare(c, c["vllm_batches"], [impl], tally)
    t = tally[impl]
    assert t.failures == []
    assert t.first_token_exact == t.batches_exact == len(cases)

"""Cases the hypothesis soak found where the compiled loop and its twin once disagreed.

Each is replayed by the twin, the compiled loop, and the compiled loop with its
exact path forced; all three must form the same batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import bearsdk
from bearsdk.replay import implementations
from bearsdk.schedulers import BoundScheduler, compile_scheduler, spec_from_dict

pytestmark = pytest.mark.skipif(
    "cython" not in implementations(), reason="compiled replay not built"
)


def custom(**blocks: Any) -> BoundScheduler:
    doc: dict[str, Any] = {
        "name": "custom",
        "params": {"budget": 16},
        "budget": {
            "tokens": "$budget",
            "seqs": blocks.pop("seqs", 3),
            "max_model_len": 0,
            "count": blocks.pop("count", "tokens"),
        },
        "batch": {
            "stages": blocks.pop("stages", ["running", "waiting"]),
            "async_scheduling": blocks.pop("async_scheduling", True),
            "admit_after_preemption": blocks.pop("admit_after_preemption", False),
        },
        "prefill": {"chunked": blocks.pop("chunked", True)},
        "kv": {"block_size": 1, **blocks.pop("kv", {})},
        "preemption": {"keep_outputs": blocks.pop("keep_outputs", True)},
    }
    assert not blocks
    return spec_from_dict(doc).bind()


V1_TINY = {
    "async_scheduling": True,
    "block_size": 1,
    "enable_chunked_prefill": False,
    "max_model_len": 32,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 2,
    "scheduler_reserve_full_isl": False,
}

CASES: list[tuple[str, BoundScheduler, list[list[int]], int | None, int, int]] = [
    # (what went wrong, policy, snapshot rows, pool size or None for unlimited, prompt, output)
    (
        "admitted request served twice when admissions come first",
        custom(stages=["waiting", "running"], chunked=False, seqs=1, async_scheduling=False),
        [],
        None,
        1,
        1,
    ),
    (
        "unserved zombie given a wasted token after its last one landed",
        custom(stages=["waiting", "running"]),
        [[0, 1, 1, 0, 2, 1, 1], [0, 1, 1, 0, 1, 1, 1]],
        None,
        17,
        1,
    ),
    (
        "explicit zombie kept a stale output/placeholder count",
        custom(chunked=False, seqs=9, kv={"watermark": 0.1}),
        [
            [0, 1, 1, 1, 5, 5, 0],
            [0, 1, 1, 0, 1, 1, 1],
            [0, 1, 1, 1, 5, 4, 0],
            [0, 1, 1, 1, 5, 4, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 3, 3, 0],
            [1, 1, 0, 0, 3, 3, 0],
            [1, 4, 0, 0, 2, 2, 0],
            [1, 1, 0, 0, 1, 1, 0],
        ],
        36,
        1,
        1,
    ),
    (
        "a token delivered twice to a request that went lazy and back",
        bearsdk.bind_scheduler("vllm-v1", V1_TINY),
        [[1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 2, 2, 0]],
        None,
        1,
        1,
    ),
    (
        "closed-form run over a padded budget with admissions first",
        custom(stages=["waiting", "running"], count="padded", seqs=2, async_scheduling=False),
        [[1, 1, 0, 0, 3, 3, 0]],
        None,
        25,
        1,
    ),
    (
        "stale preempted request admitted while its token was in flight",
        custom(chunked=False, seqs=1, admit_after_preemption=True, keep_outputs=False),
        [[0, 1, 2, 1, 4, 3, 1], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 0]],
        3,
        1,
        1,
    ),
    (
        "padded width kept a preempted victim's chunk after it left the batch",
        BoundScheduler(
            name="custom",
            token_budget=400,
            max_seqs=5,
            max_model_len=0,
            budget_count="padded",
            stages=("waiting", "running"),
            exclusive=False,
            admit_after_preemption=False,
            async_scheduling=True,
            chunked_prefill=False,
            chunk_cap=200,
            cap_exempt_when_alone=False,
            on_blocked="stop",
            reserve_full_sequence=False,
            block_size=1,
            num_blocks=669,
            reserved_blocks=0,
            allocate="on-demand",
            watermark=0.0,
            watermark_applies="always",
            decode_needs_free_block=False,
            victim="newest",
            requeue="front",
            keep_outputs=False,
            params=(("budget", 400),),
        ),
        [
            [0, 1, 1, 0, 1, 1, 1],
            [0, 1, 1, 1, 9, 9, 0],
            [0, 156, 439, 283, 288, 288, 1],
            [0, 1, 1, 0, 1, 1, 1],
            [0, 227, 226, 0, 1, 1, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 62, 0, 0, 1, 1, 0],
            [1, 200, 0, 0, 2, 2, 0],
            [1, 200, 0, 0, 1, 1, 0],
            *[[1, 1, 0, 0, 1, 1, 0]] * 7,
        ],
        669,
        1,
        1,
    ),
    (
        "closed-form run with nothing in flight left its last batch unprocessed",
        bearsdk.bind_scheduler("vllm-v1", V1_TINY),
        [[0, 1, 1, 1, 3, 2, 0], [0, 1, 1, 1, 4, 3, 0]],
        None,
        1,
        1,
    ),
]


@pytest.mark.parametrize(
    ("why", "pol", "rows", "pool", "prompt", "out"), CASES, ids=[c[0] for c in CASES]
)
def test_compiled_equals_twin(
    why: str, pol: BoundScheduler, rows: list[list[int]], pool: int | None, prompt: int, out: int
) -> None:
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 7)
    pol = pol.with_kv(pol.block_size, pool or 0)
    tw = compile_scheduler(pol, "python")
    ref = tw.replay(tw.prepare(table), prompt, out, record=True, max_batches=100)
    c = compile_scheduler(pol, "cython")
    for slow in (False, True):
        c.force_slow = slow
        try:
            got = c.replay(c.prepare(table), prompt, out, record=True, max_batches=100)
        finally:
            c.force_slow = False
        assert got.first_token_batch == ref.first_token_batch
        assert got.batches == ref.batches

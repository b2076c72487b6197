"""The live scheduler core: a snapshot it exports, replayed, predicts its own future."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bearsdk
from bearsdk.replay import ScheduledBatch, SchedulerCore
from bearsdk.schedulers import compile_scheduler
from bearsdk.snapshot import snapshot_from_dict

POLICIES = {
    "vllm-v1-async": (
        "vllm-v1",
        {
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "num_gpu_blocks": 200,
            "long_prefill_token_threshold": 64,
            "async_scheduling": True,
        },
    ),
    "vllm-v1-sync": (
        "vllm-v1",
        {
            "max_num_batched_tokens": 256,
            "max_num_seqs": 8,
            "num_gpu_blocks": 150,
            "watermark": 0.05,
            "async_scheduling": False,
        },
    ),
    "sarathi": ("sarathi", {"chunk_size": 128, "max_num_seqs": 8, "num_gpu_blocks": 200}),
    "prefill-first": (
        "prefill-first",
        {
            "max_num_batched_tokens": 1024,
            "max_num_seqs": 8,
            "max_model_len": 1024,
            "num_gpu_blocks": 200,
        },
    ),
}


class Engine:
    """Drives a SchedulerCore the way vLLM's EngineCore loop does."""

    def __init__(self, core: SchedulerCore, depth: int) -> None:
        self.core = core
        self.depth = depth
        self.queue: deque[ScheduledBatch] = deque()
        self.step = 0
        self.first_token: dict[str, int] = {}

    def tick(self) -> None:
        b = self.core.schedule()
        if b:
            self.step += 1
            for rid in b.sampling:
                self.first_token.setdefault(rid, self.step)
        self.queue.append(b)
        if len(self.queue) < self.depth:
            return
        self.core.process(self.queue.popleft())

    def snapshot(self) -> dict[str, object]:
        return self.core.snapshot(seq=self.step, output_len=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(POLICIES)),
    arrivals=st.lists(
        st.tuples(
            st.integers(0, 6), st.integers(1, 400), st.integers(1, 60), st.sampled_from([0, 0, 7])
        ),
        max_size=30,
    ),
    at=st.integers(0, 40),
    new=st.tuples(st.integers(1, 500), st.integers(1, 50)),
)
# A waiting request is admitted, preempted, and resumes on its own cached blocks.
@example(
    name="vllm-v1-sync",
    arrivals=[
        (0, 1, 1, 0),
        (0, 1, 1, 0),
        (0, 10, 19, 7),
        (0, 4, 49, 0),
        (0, 189, 38, 7),
        (0, 279, 51, 0),
        (0, 393, 48, 0),
        (0, 334, 50, 7),
        (0, 265, 45, 7),
        (0, 255, 43, 7),
        (0, 216, 35, 0),
        (0, 268, 12, 0),
    ],
    at=5,
    new=(36, 50),
)
def test_replay_of_exported_snapshot_predicts_the_core(
    name: str, arrivals: list[tuple[int, int, int, int]], at: int, new: tuple[int, int]
) -> None:
    sched, params = POLICIES[name]
    pol = bearsdk.bind_scheduler(sched, params)
    depth = 2 if pol.async_scheduling else 1
    eng = Engine(SchedulerCore(pol), depth)
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    for step in range(at):
        while i < len(pending) and pending[i][0] <= step:
            # slack > 0: the request stops before its max_tokens (unannounced stop)
            _, prompt, out, slack = pending[i]
            eng.core.add_request(f"r{i}", prompt, out, out + slack)
            i += 1
        if eng.core.has_work() or eng.queue:
            eng.tick()
    snap = snapshot_from_dict(eng.snapshot())
    step0 = eng.step
    eng.core.add_request("new", new[0], new[1], new[1])
    for _ in range(5000):
        if "new" in eng.first_token:
            break
        eng.tick()
    assert "new" in eng.first_token
    for impl in ("python", "cython"):
        if impl not in bearsdk.replay.implementations():
            continue
        rp = compile_scheduler(pol, impl)
        assert snap.kv is not None
        # With its prefix cache: the vllm-v1 engines run APC, and a preempted
        # request re-hits its own cached blocks when it resumes.
        prepared = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids, cache=snap.prefix_cache)
        res = rp.replay(prepared, new[0], new[1], max_tokens=new[1])
        assert res.first_token_batch == eng.first_token["new"] - step0, impl


def test_core_lifecycle() -> None:
    pol = bearsdk.bind_scheduler("vllm-v1", {"async_scheduling": False, "num_gpu_blocks": 100})
    core = SchedulerCore(pol)
    core.add_request("a", 20, 3)
    with pytest.raises(ValueError, match="already resident"):
        core.add_request("a", 5, 1)
    got: list[str] = []
    finished: list[str] = []
    for _ in range(4):
        out = core.process(core.schedule())
        got += out.tokens
        finished += out.finished
    assert got == ["a", "a", "a"]
    assert finished == ["a"]
    assert not core.has_work()
    assert core.free_blocks == 99
    core.add_request("b", 40, 5)
    core.process(core.schedule())
    assert core.num_running == 1
    assert core.abort_request("b")
    assert not core.abort_request("b")
    assert core.free_blocks == 99

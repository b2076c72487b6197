"""The vLLM publisher without vLLM: capture twins, publisher hooks, configuration, transports.

Requests are stand-ins with the attributes vLLM 0.33's ``Request`` has (the
real scheduler is exercised by ``test_oracle.py``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.estimators.batch_time import BatchObservation
from bearsdk.io.shm import ShmReader
from bearsdk.snapshot import decode_snapshot
from bearsdk.vllm import (
    FileTransport,
    Publisher,
    PublisherConfig,
    PublisherConfigError,
    RecordingTransport,
    ShmTransport,
    batch_record,
    implementations,
)
from bearsdk.vllm.server import SideServer

IMPLS = sorted(implementations())


class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the capture reads."""

    def __init__(
        self,
        rid: str,
        prompt: int,
        computed: int = 0,
        outputs: int = 0,
        max_tokens: int | None = 64,
        ph: int = 0,
        chunk: bool = False,
    ) -> None:
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self._output_token_ids = [7] * outputs
        self.max_tokens = max_tokens
        self.num_output_placeholders = ph
        self.is_prefill_chunk = chunk
        self.resumable = False

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)


class SlotRequest:
    """A request without an instance dict: the compiled capture must fall back to getattr."""

    __slots__ = (
        "is_prefill_chunk",
        "max_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_output_tokens",
        "num_prompt_tokens",
        "request_id",
    )

    def __init__(self, rid: str, prompt: int, computed: int, outputs: int, ph: int) -> None:
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.num_computed_tokens = computed
        self.num_output_tokens = outputs
        self.max_tokens = 1000
        self.num_output_placeholders = ph
        self.is_prefill_chunk = False


def _capture(impl: str, **kw: Any) -> Any:
    args = {"instance": "inst", "epoch": "ep", "block_size": 16, "num_blocks": 1000, **kw}
    return implementations()[impl].Capture(
        args["instance"],
        args["epoch"],
        args["block_size"],
        args["num_blocks"],
        args.get("placeholders", True),
        args.get("threaded", False),
        args.get("shadow", False),
        args.get("audit", 8),
        args.get("poll_us", 200.0),
    )


def _encode(impl: str, running: list[Any], waiting: list[Any], **kw: Any) -> bytes:
    cap = _capture(impl, placeholders=kw.pop("placeholders", True))
    cap.capture(running, (waiting,), kw.get("seq", 5), kw.get("time_s", 1.5), kw.get("free", 10))
    cap.encode()
    return bytes(cap.payload())


# -- capture ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_document_is_a_valid_snapshot_in_scheduling_order(impl: str) -> None:
    running = [FakeRequest("a", 700, 512), FakeRequest("b", 90, 91, 2, ph=1)]
    waiting = [FakeRequest("c", 300), FakeRequest("d", 50, 0, 3, max_tokens=None)]
    cap = _capture(impl)
    cap.capture(running, ((), waiting), 7, 1764480000.25, 123, 0.004)
    cap.encode()
    snap = decode_snapshot(cap.payload())
    assert (snap.instance, snap.seq, snap.time, snap.epoch) == ("inst", 7, 1764480000.25, "ep")
    assert snap.kv is not None
    assert (snap.kv.block_size, snap.kv.free_blocks) == (16, 123)
    assert snap.inflight_remaining_s == 0.004
    assert snap.ids == ("a", "b", "c", "d")
    reqs = {r.id: r for r in snap.requests()}
    assert (reqs["a"].state, reqs["a"].computed_tokens, reqs["a"].max_tokens) == (
        "running",
        512,
        64,
    )
    assert (reqs["b"].output_tokens, reqs["b"].placeholders) == (2, 1)
    assert (reqs["c"].state, reqs["c"].computed_tokens) == ("waiting", 0)
    assert reqs["d"].max_tokens is None
    assert reqs["d"].output_tokens == 3
    assert all(r.output_len is None for r in reqs.values())
    assert (cap.num_running, cap.num_waiting) == (2, 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_sync_scheduler_skips_placeholders(impl: str) -> None:
    doc = json.loads(_encode(impl, [FakeRequest("a", 10, 10, 1, ph=3)], [], placeholders=False))
    assert "placeholders" not in doc["requests"][0]


@pytest.mark.parametrize("impl", IMPLS)
def test_values_vllm_never_reports_are_clamped_not_fatal(impl: str) -> None:
    running = [FakeRequest("a", 0, 99, 1, max_tokens=1)]  # prompt 0, computed past the end
    doc = _encode(impl, running, [], free=5000)
    snap = decode_snapshot(doc)
    r = snap.requests()[0]
    assert (r.prompt_tokens, r.computed_tokens, r.max_tokens) == (1, 2, None)
    assert snap.kv is not None
    assert snap.kv.free_blocks == 1000


ids = st.text(min_size=1, max_size=12)
req = st.tuples(
    ids,
    st.integers(1, 5000),
    st.integers(0, 6000),
    st.integers(0, 300),
    st.one_of(st.none(), st.integers(1, 400)),
    st.integers(0, 2),
)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(st.tuples(req, st.booleans()), max_size=12, unique_by=lambda x: x[0][0]),
    seq=st.integers(0, 2**40),
    t=st.floats(0, 2e9, allow_nan=False),
    free=st.integers(-5, 2000),
    inflight=st.one_of(st.just(-1.0), st.floats(0, 10, allow_nan=False)),
)
def test_twins_write_identical_documents(
    rows: list[Any], seq: int, t: float, free: int, inflight: float
) -> None:
    running = [FakeRequest(r[0], r[1], r[2], r[3], r[4], r[5]) for r, run in rows if run]
    waiting = [FakeRequest(r[0], r[1], 0, r[3], r[4]) for r, run in rows if not run]
    docs = set()
    for impl in IMPLS:
        cap = _capture(impl)
        cap.capture(running, (waiting,), seq, t, free, inflight)
        cap.encode()
        docs.add(bytes(cap.payload()))
    assert len(docs) == 1
    doc = docs.pop()
    snap = decode_snapshot(doc)  # escapes, unicode and clamps all validate
    assert list(snap.ids) == [r.request_id for r in running + waiting]
    assert json.loads(doc)["time"] == t


def test_compiled_capture_falls_back_to_getattr() -> None:
    if "cython" not in IMPLS:
        pytest.skip("compiled capture not built")
    running = [SlotRequest("s", 100, 101, 2, 1)]
    assert _encode("cython", running, []) == _encode("python", running, [])


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_terms(impl: str) -> None:
    # decode (caught up, sampled before), mid-prompt chunk, and an admission.
    a = FakeRequest("a", 100, 102, 3, chunk=False)
    b = FakeRequest("b", 900, 512, 0, chunk=True)
    c = FakeRequest("c", 40, 0)
    cap = _capture(impl)
    cap.capture([a, b], ((c,),), 1, 0.0, 100, batch_terms=True)
    # what schedule() leaves behind: counters advanced by the scheduled tokens
    a.num_computed_tokens += 1
    b.num_computed_tokens += 300
    c.num_computed_tokens = 40
    sched = {a.request_id: 1, b.request_id: 300, c.request_id: 40}
    got = cap.after_schedule(sched)
    patt = 300 * 512 + 300 * 301 // 2 + 40 * 41 // 2
    assert got == (3, 340, 1, 102, patt)
    obs = BatchObservation(got[1], got[2], got[3], got[4], 0.01)
    assert obs.total_tokens == 341


@pytest.mark.parametrize("impl", IMPLS)
def test_a_last_one_token_recompute_chunk_is_a_prefill(impl: str) -> None:
    # Counts alone make it look like a decode; is_prefill_chunk tells.
    r = FakeRequest("r", 100, 104, 5, chunk=True)
    cap = _capture(impl)
    cap.capture([r], (), 1, 0.0, 100, batch_terms=True)
    r.num_computed_tokens += 1
    assert cap.after_schedule({r.request_id: 1}) == (1, 1, 0, 0, 1 * 104 + 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_without_capture_is_empty(impl: str) -> None:
    cap = _capture(impl)
    assert cap.after_schedule({"x": 3}) == (0, 0, 0, 0, 0)
    cap.capture([], (), 1, 0.0, 1)
    assert cap.after_schedule({"x": 3}) == (0, 0, 0, 0, 0)  # not resident: skipped


class _Engine:
    """A toy scheduler that moves vLLM's counters the way vLLM does (no KV limits)."""

    def __init__(self, rng: random.Random, async_: bool) -> None:
        self.rng = rng
        self.async_ = async_
        self.running: list[FakeRequest] = []
        self.waiting: list[FakeRequest] = []
        self.n = 0

    def arrive(self) -> None:
        self.n += 1
        self.waiting.append(FakeRequest(f"q{self.n}", self.rng.randint(1, 300), max_tokens=50))

    def schedule(self) -> dict[str, int]:
        out: dict[str, int] = {}
        budget = 256
        for r in self.running:
            need = r.num_prompt_tokens + r.num_output_tokens + r.num_output_placeholders
            n = min(need - r.num_computed_tokens, budget)
            if n > 0 and self.rng.random() < 0.9:
                out[r.request_id] = n
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < 8:
            r = self.waiting.pop(0)
            r.num_computed_tokens = self.rng.choice((0, 0, r.num_prompt_tokens // 2))  # cache
            n = min(r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens, budget)
            out[r.request_id] = n
            budget -= n
            self.running.append(r)
        by_id = {r.request_id: r for r in self.running}
        for rid, n in out.items():
            r = by_id[rid]
            ph0 = r.num_output_placeholders
            r.num_computed_tokens += n
            known = r.num_prompt_tokens + r.num_output_tokens + ph0
            r.is_prefill_chunk = r.num_computed_tokens < known
            if self.async_ and not r.is_prefill_chunk:
                r.num_output_placeholders += 1
        return out

    def update(self, out: dict[str, int], prefill: dict[str, bool]) -> None:
        by_id = {r.request_id: r for r in self.running + self.waiting}
        for rid in out:
            r = by_id.get(rid)
            if r is not None and not prefill[rid]:
                r._output_token_ids.append(7)
                if r.num_output_placeholders:
                    r.num_output_placeholders -= 1
                if r.num_output_tokens >= 50 and r in self.running:
                    self.running.remove(r)

    def preempt(self) -> FakeRequest | None:
        if not self.running:
            return None
        r = self.running.pop()
        r.num_computed_tokens = 0
        r.num_output_placeholders = 0
        self.waiting.insert(0, r)
        return r


@pytest.mark.parametrize("async_", [False, True])
def test_shadow_counters_follow_the_engine(async_: bool) -> None:
    if "cython" not in IMPLS:
        pytest.skip("compiled capture not built")
    rng = random.Random(11)
    eng = _Engine(rng, async_)
    shadow = _capture("cython", shadow=True, audit=0, placeholders=async_)
    truth = _capture("python", placeholders=async_)
    queue: list[tuple[dict[str, int], dict[str, bool]]] = []
    for step in range(400):
        for _ in range(rng.randint(0, 2)):
            eng.arrive()
        docs = []
        for cap in (shadow, truth):
            cap.capture(eng.running, (eng.waiting,), step, 1.0, 10)
            cap.encode()
            docs.append(cap.payload())
        assert docs[0] == docs[1], step
        if rng.random() < 0.05:
            r = eng.preempt()
            if r is not None:
                shadow.preempted(r)
            out: dict[str, int] = {}
        else:
            out = eng.schedule()
        terms = [cap.after_schedule(out) for cap in (shadow, truth)]
        assert terms[0] == terms[1], step
        by_id = {r.request_id: r for r in eng.running}
        queue.append((out, {rid: by_id[rid].is_prefill_chunk for rid in out}))
        if len(queue) > (1 if async_ else 0):
            done, prefill = queue.pop(0)
            eng.update(done, prefill)
            shadow.batch_done()
    assert shadow.mismatches == 0


def test_audit_repairs_what_the_shadow_missed() -> None:
    if "cython" not in IMPLS:
        pytest.skip("compiled capture not built")
    reqs = [FakeRequest(f"a{i}", 10, 10, 1) for i in range(20)]
    cap = _capture("cython", shadow=True, audit=5)
    cap.capture(reqs, (), 1, 0.0, 1)
    for r in reqs:
        r._output_token_ids.append(7)  # behind the shadow's back
    for seq in range(2, 7):
        cap.capture(reqs, (), seq, 0.0, 1)
    assert cap.mismatches == 20  # each request re-read once in four captures, then right
    cap.encode()
    assert all(r.output_tokens == 2 for r in decode_snapshot(cap.payload()).requests())


@pytest.mark.parametrize("impl", IMPLS)
def test_threaded_capture_coalesces_to_the_latest(impl: str) -> None:
    cap = _capture(impl, threaded=True)
    got: list[bytes] = []

    def run() -> None:
        while cap.take_and_encode() >= 0:
            got.append(bytes(cap.taken_payload()))

    th = threading.Thread(target=run)
    th.start()
    reqs = [FakeRequest(f"r{i}", 10 + i) for i in range(50)]
    for seq in range(1, 2001):
        cap.capture(reqs[: seq % 50], (), seq, float(seq), 10)
        cap.commit()
    deadline = time.time() + 10
    while (not got or json.loads(got[-1])["seq"] != 2000) and time.time() < deadline:
        time.sleep(0.001)
    cap.close()
    th.join(10)
    assert not th.is_alive()
    seqs = [json.loads(d)["seq"] for d in got]
    assert seqs[-1] == 2000
    assert seqs == sorted(set(seqs))
    assert all(decode_snapshot(d).seq == s for d, s in zip(got, seqs, strict=True))


def test_compiled_cache_forgets_departed_requests() -> None:
    if "cython" not in IMPLS:
        pytest.skip("compiled capture not built")
    cap = _capture("cython")
    first = [FakeRequest(f"a{i}", 10) for i in range(100)]
    ref = weakref.ref(first[0])
    cap.capture(first, (), 1, 0.0, 1)
    assert cap.cached == 100
    del first
    for seq in range(2, 10):
        cap.capture([FakeRequest(f"b{seq}-{i}", 10) for i in range(10)], (), seq, 0.0, 1)
    gc.collect()
    assert ref() is None  # the cache let go of it
    assert cap.cached <= 2 * 10 + 64


# -- publisher -------------------------------------------------------------------------


class FakeScheduler:
    """What the hooks read of a vLLM scheduler."""

    def __init__(self, running: list[Any] | None = None, waiting: list[Any] | None = None):
        self.running = running or []
        self.waiting = deque(waiting or [])
        self.kv_holding_waiting: deque[Any] = deque()
        self.free = 90

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting)


class Out:
    """A ``SchedulerOutput``'s fields the hooks read."""

    def __init__(self, scheduled: dict[str, int]) -> None:
        self.num_scheduled_tokens = scheduled
        self.total_num_scheduled_tokens = sum(scheduled.values())


class ModelOut:
    """A ``ModelRunnerOutput``'s fields the hooks read."""

    def __init__(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        self.req_ids = req_ids
        self.sampled_token_ids = sampled


def _publisher(
    impl: str, sched: FakeScheduler | None = None, **kw: Any
) -> tuple[Publisher, RecordingTransport]:
    rec = RecordingTransport()
    cfg = PublisherConfig(
        instance="p",
        threaded=kw.pop("threaded", False),
        implementation=impl,
        batch_time=kw.pop("batch_time", None),
    )
    s = sched or FakeScheduler()
    pub = Publisher(
        cfg,
        block_size=16,
        num_blocks=100,
        free_blocks=lambda: s.free,
        async_scheduling=kw.pop("async_scheduling", False),
        transports=[*kw.pop("transports", []), rec],
        **kw,
    )
    return pub, rec


def _step(pub: Publisher, sched: Any, scheduled: dict[str, int]) -> Out:
    """One inline engine step as the scheduler plugin drives the hooks (schedule half)."""
    h = pub.hooks
    pub.deliver(h.before_schedule(sched))
    out = Out(scheduled)
    h.after_schedule(out)
    return out


def _done(pub: Publisher, sched: Any, out: Out, tokens: dict[str, int]) -> None:
    """The update half: the batch's output reaches the scheduler."""
    h = pub.hooks
    ids = list(out.num_scheduled_tokens)
    what = h.before_update(out, ModelOut(ids, [[7] * tokens.get(r, 0) for r in ids]))
    pub.deliver(what | h.after_change(sched))


@pytest.mark.parametrize("impl", IMPLS)
def test_hooks_publish_each_step_and_time_batches(impl: str) -> None:
    a = FakeRequest("a", 50)
    sched = FakeScheduler(waiting=[a])
    pub, rec = _publisher(impl, sched)
    assert decode_snapshot(rec.documents[0]).seq == 0
    for step in range(1, 4):
        if step == 2:
            sched.waiting.popleft()
            sched.running.append(a)
        a.num_computed_tokens = 50 if step == 1 else a.num_computed_tokens + 1
        out = _step(pub, sched, {a.request_id: 50 if step == 1 else 1})
        time.sleep(0.002)
        a._output_token_ids.append(7)
        _done(pub, sched, out, {"a": 1})
    assert [decode_snapshot(d).seq for d in rec.documents] == [0, 1, 2, 3]
    assert [b[0] for b in rec.batches] == [1, 2, 3]
    assert rec.batches[0][3:5] == (50, 0)
    assert rec.batches[1][3:5] == (0, 1)
    assert all(b[7] >= 0.002 for b in rec.batches)
    s = pub.stats()
    assert (s.captures, s.published, s.batches, s.failures) == (3, 4, 3, 0)
    pub.close()
    assert rec.closed


@pytest.mark.parametrize("impl", IMPLS)
def test_idle_engine_publishes_its_empty_state(impl: str) -> None:
    a = FakeRequest("a", 10, 10, 1)
    sched = FakeScheduler(running=[a])
    pub, rec = _publisher(impl, sched)
    out = _step(pub, sched, {"a": 1})
    sched.running.clear()  # finished
    _done(pub, sched, out, {"a": 1})
    last = decode_snapshot(rec.documents[-1])
    assert (last.seq, len(last)) == (2, 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_async_durations_start_when_the_batch_ahead_returns(impl: str) -> None:
    a = FakeRequest("a", 10, 10, 1)
    sched = FakeScheduler(running=[a])
    pub, rec = _publisher(impl, sched, async_scheduling=True)
    o1 = _step(pub, sched, {"a": 1})
    o2 = _step(pub, sched, {"a": 1})
    time.sleep(0.05)
    _done(pub, sched, o1, {"a": 1})
    time.sleep(0.01)
    _done(pub, sched, o2, {"a": 1})
    d1, d2 = rec.batches[0][7], rec.batches[1][7]
    assert d1 >= 0.05
    assert 0.01 <= d2 < 0.05


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_time_model_reports_the_batch_in_flight(impl: str) -> None:
    a = FakeRequest("a", 10, 10, 1)
    sched = FakeScheduler(running=[a])
    pub, rec = _publisher(impl, sched, async_scheduling=True, batch_time=(0.5, 0.0, 0.0, 0.0))
    _step(pub, sched, {"a": 1})
    assert "inflight" not in json.loads(rec.documents[-1])
    _step(pub, sched, {"a": 1})
    remaining = json.loads(rec.documents[-1])["inflight"]["remaining_s"]
    assert 0.4 < remaining <= 0.5


class _Broken:
    name = "broken"
    wants_batches = True

    def send(self, payload: bytes) -> None:
        raise OSError("disk full")

    def send_batch(self, batch: Any) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise OSError("already gone")


@pytest.mark.parametrize("impl", IMPLS)
def test_failures_are_counted_never_raised(impl: str, caplog: pytest.LogCaptureFixture) -> None:
    sched = FakeScheduler(running=[object()])  # not a request
    pub, rec = _publisher(impl, sched, transports=[_Broken()])
    h = pub.hooks
    pub.deliver(h.before_schedule(sched))
    pub.deliver(h.before_schedule(object()))  # not a scheduler
    sched.running = "not a list"  # type: ignore[assignment]
    pub.deliver(h.before_schedule(sched))
    a = FakeRequest("a", 10)
    sched.running = [a]
    out = _step(pub, sched, {"a": 1})
    h.after_schedule(object())  # not an output
    _done(pub, sched, out, {"a": 1})
    pub.close()
    s = pub.stats()
    assert s.failures >= 7
    assert s.last_error is not None
    assert len(rec.documents) == 2  # seq 0 and the good capture reached the other transport
    assert "failed" in caplog.text


@pytest.mark.parametrize("impl", IMPLS)
def test_publisher_thread_delivers_the_latest(impl: str) -> None:
    sched = FakeScheduler(running=[FakeRequest(f"r{i}", 10) for i in range(20)])
    pub, rec = _publisher(impl, sched, threaded=True)
    for _ in range(500):
        pub.hooks.before_schedule(sched)
    deadline = time.time() + 10
    while decode_snapshot(rec.documents[-1]).seq != 500 and time.time() < deadline:
        time.sleep(0.001)
    pub.close()
    s = pub.stats()
    assert s.threaded
    assert s.captures == 500
    assert s.failures == 0
    assert decode_snapshot(rec.documents[-1]).seq == 500
    assert 2 <= s.published <= 501


# -- configuration ---------------------------------------------------------------------


def test_config_from_env() -> None:
    env = {
        "BEARSDK_INSTANCE": "qwen-0",
        "BEARSDK_PUBLISH_SHM": "1",
        "BEARSDK_PUBLISH_HTTP": ":8100",
        "BEARSDK_PUBLISH_THREAD": "0",
        "BEARSDK_BATCH_TIME": "0.004, 2e-5, 4e-8, 1e-10",
    }
    c = PublisherConfig.from_env(env, default_instance="served")
    assert c.instance == "qwen-0"
    assert c.shm_path is not None
    assert c.shm_path.endswith("bear.qwen-0")
    assert c.http == ("0.0.0.0", 8100)
    assert not c.threaded
    assert c.has_transport
    assert c.batch_time == (0.004, 2e-5, 4e-8, 1e-10)
    dp = PublisherConfig.from_env(env, default_instance="served", dp_rank=2, dp_size=4)
    assert dp.instance == "qwen-0-dp2"
    assert dp.http == ("0.0.0.0", 8102)
    assert dp.shm_path is not None
    assert dp.shm_path.endswith("bear.qwen-0-dp2")
    d = PublisherConfig.from_env({}, default_instance="served")
    assert d.instance == "served"
    assert not d.has_transport
    assert d.threaded
    assert d.enabled
    named = PublisherConfig.from_env({"BEARSDK_PUBLISH_SHM": "seg"}, default_instance="x")
    assert named.shm_path is not None
    assert named.shm_path.endswith("bear.seg")
    off = PublisherConfig.from_env({"BEARSDK_PUBLISH": "off"}, default_instance="x")
    assert not off.enabled


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("BEARSDK_PUBLISH_HTTP", "host:port"),
        ("BEARSDK_PUBLISH_HTTP", "99999"),
        ("BEARSDK_PUBLISH_THREAD", "maybe"),
        ("BEARSDK_HEARTBEAT_S", "-1"),
        ("BEARSDK_PUBLISH_SHM_CAPACITY", "0"),
        ("BEARSDK_BATCH_TIME", "1,2,3"),
        ("BEARSDK_PUBLISH_IMPL", "rust"),
    ],
)
def test_config_errors_name_the_variable(var: str, value: str) -> None:
    with pytest.raises(PublisherConfigError, match=var):
        PublisherConfig.from_env({var: value}, default_instance="x")


# -- transports ------------------------------------------------------------------------


def test_shm_transport_round_trip(tmp_path: Path) -> None:
    seg = tmp_path / "bear.t"
    cfg = PublisherConfig(instance="t", shm_path=str(seg), threaded=False)
    sched = FakeScheduler(running=[FakeRequest("a", 10, 5)])
    pub = Publisher(
        cfg, block_size=16, num_blocks=100, free_blocks=lambda: 80, async_scheduling=False
    )
    pub.deliver(pub.hooks.before_schedule(sched))
    with ShmReader(seg) as reader:
        res = reader.read()
        assert res.status == "ok"
        assert res.payload is not None
        snap = decode_snapshot(bytes(res.payload))
    assert snap.seq == 1
    assert snap.ids == ("a",)
    pub.close()
    assert not seg.exists()


def test_shm_transport_refuses_oversize(tmp_path: Path) -> None:
    t = ShmTransport(tmp_path / "bear.small", capacity=64)
    with pytest.raises(OSError, match="capacity"):
        t.send(b"x" * 65)
    t.close()


def test_file_transport_lines(tmp_path: Path) -> None:
    t = FileTransport(tmp_path / "s.ndjson", tmp_path / "b.ndjson", instance="i", epoch="e")
    t.send(b'{"a":1}')
    t.send(b'{"a":2}')
    t.send_batch((3, 1.0, 2, 10, 1, 5, 55, 0.01))
    t.close()
    assert (tmp_path / "s.ndjson").read_bytes() == b'{"a":1}\n{"a":2}\n'
    rec = json.loads((tmp_path / "b.ndjson").read_text())
    assert rec == batch_record("i", "e", (3, 1.0, 2, 10, 1, 5, 55, 0.01))
    assert BatchObservation.from_dict(rec).prefill_tokens == 10


def _wait(cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    # The server's state lives on another thread: wait for it on a worker thread.
    await anyio.to_thread.run_sync(_wait, cond, timeout_s)


async def _lines(resp: aiohttp.ClientResponse, n: int) -> list[bytes]:
    out = []
    while len(out) < n:
        out.append((await asyncio.wait_for(resp.content.readline(), 5)).rstrip(b"\n"))
    return out


async def test_side_server_endpoints() -> None:
    srv = SideServer(
        "127.0.0.1",
        0,
        instance="h",
        epoch="e1",
        heartbeat_s=0.05,
        batch_buffer=2,
        stats=lambda: {"captures": 7},
    )
    base = f"http://127.0.0.1:{srv.port}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(base + "/bear/snapshot") as r:
                first = decode_snapshot(await r.read())
            assert (first.seq, first.epoch, len(first)) == (0, "e1", 0)
            doc = _encode("python", [FakeRequest("a", 10)], [], seq=4)
            srv.send(doc)
            await asyncio.sleep(0.05)
            async with s.get(base + "/bear/snapshot") as r:
                assert await r.read() == doc
            async with s.get(base + "/bear/publisher") as r:
                assert await r.json() == {"captures": 7}
            async with s.get(base + "/bear/snapshots") as stream:
                assert (await _lines(stream, 1))[0] == doc
                later = _encode("python", [], [], seq=9)
                srv.send(later)
                got = [x for x in await _lines(stream, 3) if x]
                assert got[0] == later
            async with s.get(base + "/bear/batches") as bstream:
                await _until(lambda: srv.wants_batches)
                # A buffer of 2: whatever a reader misses, the next line it
                # gets says how many.
                for seq in range(1, 6):
                    srv.send_batch((seq, 1.0, 1, 0, 1, 10, 0, 0.01))
                got: list[dict[str, Any]] = []
                while not got or got[-1]["seq"] != 5:
                    got += [json.loads(x) for x in await _lines(bstream, 1) if x]
                seqs = [x["seq"] for x in got]
                assert seqs == sorted(seqs)
                assert len(got) + sum(x.get("dropped", 0) for x in got) == 5
                assert (await _lines(bstream, 1)) == [b""]  # heartbeat
    finally:
        srv.close()


def test_side_server_port_in_use() -> None:
    srv = SideServer("127.0.0.1", 0, instance="h", epoch="e")
    try:
        with pytest.raises(OSError, match="cannot serve"):
            SideServer("127.0.0.1", srv.port, instance="h2", epoch="e")
    finally:
        srv.close()


def test_random_fake_workload_matches_between_twins() -> None:
    rng = random.Random(3)
    pool = [FakeRequest(f"q{i}", rng.randint(1, 900)) for i in range(300)]
    caps = {impl: _capture(impl) for impl in IMPLS}
    for seq in range(1, 40):
        rng.shuffle(pool)
        running, waiting = pool[: rng.randint(0, 256)], pool[256:]
        for r in running:
            r.num_computed_tokens = rng.randint(0, r.num_prompt_tokens + 5)
            r.num_output_placeholders = rng.randint(0, 1)
        docs = set()
        for cap in caps.values():
            cap.capture(running, (waiting,), seq, 1.0, 50)
            cap.encode()
            docs.add(bytes(cap.payload()))
        assert len(docs) == 1

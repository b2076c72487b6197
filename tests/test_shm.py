"""Shared-memory seqlock: writer and reader (compiled and pure-Python twin), and ShmSource."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import anyio
import orjson
import pytest

from bearsdk.io import ShmError, ShmReader, ShmSource, ShmWriter, _shm_py, segment_path
from bearsdk.io import shm as shm_mod
from bearsdk.io.base import Backoff
from bearsdk.state import SnapshotCache

IMPLS = sorted(shm_mod.implementations())
FAST = Backoff(initial_s=0.005, max_s=0.02)


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def seg(tmp_path: Path) -> Path:
    return segment_path("eng/0 test", tmp_path)


def doc(seq: int, epoch: str = "e1", n: int = 1) -> bytes:
    return orjson.dumps(
        {
            "schema": "bear.snapshot/1",
            "instance": "eng-0",
            "seq": seq,
            "time": 1.0e9,
            "epoch": epoch,
            "requests": [
                {
                    "id": f"r{i}",
                    "state": "waiting",
                    "prompt_tokens": 5,
                    "computed_tokens": 0,
                    "output_tokens": 0,
                }
                for i in range(n)
            ],
        }
    )


def test_segment_path_is_sanitised(tmp_path: Path) -> None:
    assert segment_path("a/b c", tmp_path).name == "bear.a_b_c"
    with pytest.raises(ValueError, match="instance must be a non-empty string"):
        segment_path("")


def test_bare_names_live_in_the_shm_directory(tmp_path: Path) -> None:
    assert shm_mod.resolve_segment("bear.x") == segment_path("x")
    assert shm_mod.resolve_segment(tmp_path / "bear.x") == tmp_path / "bear.x"
    assert shm_mod.resolve_segment("./bear.x") == Path("./bear.x")
    assert ShmSource("bear.x").path == segment_path("x")


def test_round_trip(seg: Path, impl: str) -> None:
    with ShmWriter(seg, 4096, implementation=impl) as w, ShmReader(seg, implementation=impl) as r:
        assert r.read().status == "empty"
        c1 = w.write(b"hello")
        assert c1 % 2 == 0
        res = r.read()
        assert res.status == "ok"
        assert res.payload is not None
        assert bytes(res.payload) == b"hello"
        assert res.counter == c1
        res.payload.release()
        assert r.read(if_changed=True).status == "unchanged"
        w.write(b"")
        res = r.read(if_changed=True)
        assert res.status == "ok"
        assert res.payload is not None
        assert bytes(res.payload) == b""
        assert r.capacity == w.capacity == 4096


def test_implementations_interoperate(seg: Path) -> None:
    if len(IMPLS) < 2:
        pytest.skip("compiled seqlock not built")
    with ShmWriter(seg, 1024, implementation="cython") as w:
        w.write(b"from C")
        with ShmReader(seg, implementation="python") as r:
            res = r.read()
            assert res.payload is not None
            assert bytes(res.payload) == b"from C"
    with ShmWriter(seg, 1024, implementation="python") as w:
        c = w.write(b"from Python")
        with ShmReader(seg, implementation="cython") as r:
            res = r.read()
            assert res.payload is not None
            assert bytes(res.payload) == b"from Python"
            assert res.counter == c


def test_a_write_in_progress_is_never_read(seg: Path, impl: str) -> None:
    with ShmWriter(seg, 64, implementation=impl) as w, ShmReader(seg, implementation=impl) as r:
        w.write(b"complete")
        # a writer dying mid-write leaves the counter odd and half a payload
        with open(seg, "r+b") as f:
            f.seek(16)
            (c,) = struct.unpack("=Q", f.read(8))
            f.seek(16)
            f.write(struct.pack("=Q", c + 1))
            f.seek(64)
            f.write(b"garb")
        assert r.read(retries=2).status == "busy"
        # the next writer completes its write and the counter is even again
        c2 = w.write(b"next one")
        assert c2 % 2 == 0
        res = r.read()
        assert res.payload is not None
        assert bytes(res.payload) == b"next one"


def test_oversized_payload_is_refused_and_counted(seg: Path, impl: str) -> None:
    with ShmWriter(seg, 8, implementation=impl) as w, ShmReader(seg, implementation=impl) as r:
        w.write(b"ok")
        with pytest.raises(ShmError, match="exceeds the capacity of 8 bytes"):
            w.write(b"123456789")
        assert w.oversize == 1
        res = r.read()
        assert res.payload is not None
        assert bytes(res.payload) == b"ok"


def test_restarted_writer_grows_the_segment_and_readers_remap(seg: Path, impl: str) -> None:
    w = ShmWriter(seg, 16, implementation=impl)
    r = ShmReader(seg, implementation=impl)
    c1 = w.write(b"small")
    w.close()
    w2 = ShmWriter(seg, 4096, implementation=impl)  # restarted with a larger capacity
    c2 = w2.write(b"x" * 100)
    assert c2 > c1  # the counter continues: readers never see it go back
    assert r.read().status == "too-large"
    r.reopen()
    res = r.read()
    assert res.payload is not None
    assert bytes(res.payload) == b"x" * 100
    r.close()
    w2.close(unlink=True)
    assert not seg.exists()


def test_reader_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ShmError, match="no such segment"):
        ShmReader(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_bytes(b"NOTBEAR!" + bytes(100))
    with pytest.raises(ShmError, match="not a snapshot segment"):
        ShmReader(bad)
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"x")
    with pytest.raises(ShmError, match="too small"):
        ShmReader(tiny)
    with pytest.raises(ValueError, match="implementation must be one of"):
        ShmReader(bad, implementation="fortran")


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll ``cond``: the state under test has no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.002)


def seq_is(cache: SnapshotCache, seq: int) -> Callable[[], bool]:
    return lambda: cache.entry is not None and cache.entry.seq == seq


def rejections(cache: SnapshotCache, n: int) -> Callable[[], bool]:
    return lambda: cache.stats().rejected_total >= n


async def test_source_follows_the_segment(seg: Path, impl: str) -> None:
    cache = SnapshotCache("eng-0")
    src = ShmSource(seg, interval_s=0.001, implementation=impl, backoff=FAST)
    async with anyio.create_task_group() as tg:
        with ShmWriter(seg, 1 << 16, implementation=impl) as w:
            w.write(doc(0))
            await tg.start(src.run, cache)
            assert cache.entry is not None  # ready after the first read
            for seq in range(1, 20):
                w.write(doc(seq, n=seq % 5))
                await until(seq_is(cache, seq))
            # out of order, malformed and wrong-schema payloads: rejected, cache kept
            good = cache.entry
            for bad in (doc(3), b"{oops", orjson.dumps({"schema": "x"})):
                n = cache.stats().rejected_total
                w.write(bad)
                await until(rejections(cache, n + 1))
                assert cache.entry is good
            # the engine restarts: new epoch, seq starting over
            w.write(doc(0, epoch="e2"))
            await until(lambda: cache.entry is not None and cache.entry.snapshot.epoch == "e2")
        tg.cancel_scope.cancel()
    assert cache.stats().rejected == {"stale-seq": 1, "malformed": 1, "schema": 1}
    assert cache.stats().restarts == 1


async def test_source_waits_for_the_segment_and_follows_a_replacement(seg: Path) -> None:
    cache = SnapshotCache("eng-0")
    src = ShmSource(seg, interval_s=0.001, backoff=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(src.run, cache)  # no segment yet: ready after the failed attempt
        assert src.stats().failures >= 1
        w = ShmWriter(seg, 4096)
        w.write(doc(7))
        await until(seq_is(cache, 7))
        # the engine restarts and recreates (unlinks and creates) its segment
        w.close(unlink=True)
        w = ShmWriter(seg, 4096)
        w.write(doc(0, epoch="e9"))
        await until(lambda: cache.entry is not None and cache.entry.snapshot.epoch == "e9")
        w.close(unlink=True)
        tg.cancel_scope.cancel()


class _TornOnce:
    """A seqlock implementation whose first reads are torn (a write overlapped them)."""

    def __init__(self, real: ModuleType, torn: int) -> None:
        self.real = real
        self.torn = torn
        self.IMPLEMENTATION = "torn"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def read(self, segment: Any, out: Any) -> tuple[int, int, int]:
        status, n, counter = self.real.read(segment, out)
        if self.torn > 0:
            self.torn -= 1
            out[:4] = b"XXXX"  # what a torn copy could look like
            return _shm_py.TORN, 0, counter
        return status, n, counter


async def test_torn_reads_are_rejected_counted_and_never_cached(
    seg: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torn = _TornOnce(shm_mod._IMPL, torn=6)
    monkeypatch.setattr(shm_mod, "_IMPL", torn)
    cache = SnapshotCache("eng-0")
    src = ShmSource(seg, interval_s=0.001, retries=3, backoff=FAST)
    with ShmWriter(seg, 4096) as w:
        w.write(doc(1))
        async with anyio.create_task_group() as tg:
            await tg.start(src.run, cache)
            await until(seq_is(cache, 1))
            tg.cancel_scope.cancel()
    # 4 torn copies in the first poll (gave up), 2 in the second, then a clean read
    assert cache.stats().rejected == {"torn": 6}
    assert cache.stats().accepted == 1


def test_python_twin_is_selected_without_extensions() -> None:
    import subprocess
    import sys

    code = "import bearsdk.io.shm as s, bearsdk.snapshot as n; print(s.IMPLEMENTATION, n.DECODER)"
    env = {**os.environ, "BEARSDK_NO_EXTENSIONS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["python", "python"]


def test_namespace_sanity() -> None:
    # the status codes of both implementations agree
    for m in shm_mod.implementations().values():
        ns = SimpleNamespace(OK=m.OK, BUSY=m.BUSY, TORN=m.TORN, TOO_LARGE=m.TOO_LARGE)
        assert ns == SimpleNamespace(OK=0, BUSY=1, TORN=2, TOO_LARGE=3)


def test_a_huge_segment_is_refused_not_allocated(tmp_path: Path) -> None:
    # A hostile or broken writer sizes the file: the reader's buffer must not follow it.
    huge = tmp_path / "bear.huge"
    with ShmWriter(huge, capacity=1024):
        pass
    with huge.open("r+b") as f:
        f.truncate(shm_mod.HEADER_SIZE + (1 << 34))  # 16 GiB, sparse
    with pytest.raises(ShmError, match=r"capacity must be <= 67108864 bytes \(got 17179869184\)"):
        ShmReader(huge)
    with pytest.raises(ValueError, match=r"capacity must be in \[1, 67108864\] bytes"):
        ShmWriter(tmp_path / "bear.big", capacity=1 << 30)

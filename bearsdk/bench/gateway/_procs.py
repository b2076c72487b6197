"""The child processes of ``bearsdk bench gateway``: stub engines, the gateway, /proc.

The engines run in one child process (:func:`_engines_main`); :class:`_Procs`
starts every child and stops them all on any way out; the gateway is started,
signalled and stopped here; RSS and CPU accounting read ``/proc``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.abc
import attrs
import orjson
from aiohttp import web

from bearsdk.bench.gateway._common import _START_S, _STOP_S, MODEL, PROFILE, _until
from bearsdk.errors import BearError

# ------------------------------------------------------------------ engines (child process)


async def _slow_engine(interval_s: float, *, task_status: anyio.abc.TaskStatus[str]) -> None:
    """An engine that streams ``max_tokens`` chunks, ``interval_s`` apart: a long stream."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        doc = {
            "id": "s",
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    usage = {
        "id": "s",
        "object": "chat.completion.chunk",
        "created": created,
        "model": "m",
        "choices": [],
    }

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = body.get("max_tokens") or 16
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                if i:
                    await anyio.sleep(interval_s)
                await resp.write(chunk({"content": f"t{i} "}, "length" if i == n - 1 else None))
            tokens = {"prompt_tokens": 50, "completion_tokens": n, "total_tokens": 50 + n}
            await resp.write(b"data: " + orjson.dumps({**usage, "usage": tokens}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the gateway gave up on it (a drain cut it): nothing left to send
        return resp

    from bearsdk.bench._stubs import serve_stub

    await serve_stub(chat, "slow", task_status, backlog=4096)


async def _engines(interval_s: float) -> None:
    # Only the engines' child process needs the router bench's stubs (and what they import).
    from bearsdk.bench._stubs import stub_engine

    async with anyio.create_task_group() as tg:
        fast = [await tg.start(stub_engine) for _ in range(2)]
        slow = [await tg.start(_slow_engine, interval_s) for _ in range(2)]
        print(json.dumps({"fast": fast, "slow": slow}), flush=True)
        # The bench closes our stdin when it ends, however it ends: no orphan engines.
        await anyio.to_thread.run_sync(sys.stdin.buffer.read, abandon_on_cancel=True)
        tg.cancel_scope.cancel()


def _engines_main() -> None:
    """Entry point of the engines' child process: ``argv[1]`` is the slow interval."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops us, Ctrl-C or not
    anyio.run(_engines, float(sys.argv[1]))


async def _proxy(upstream: str, port: int) -> None:
    """A bare aiohttp streaming proxy (aiohttp server and client): a reference hop.

    Reads the body, posts it upstream on a kept-alive session and passes the
    response back piece by piece; no routing, checks or accounting.
    """
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        url = upstream + "/v1/chat/completions"
        async with session.post(url, data=body, headers=headers) as up:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            async for piece in up.content.iter_any():
                await resp.write(piece)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("ready", flush=True)
        await anyio.sleep_forever()
    finally:
        await session.close()
        await runner.cleanup()


def _proxy_main() -> None:
    """Entry point of the bare proxy's process: ``argv[1]`` upstream, ``argv[2]`` port."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The same event loop as the gateway's default (uvloop when installed).
    uv = importlib.util.find_spec("uvloop") is not None
    anyio.run(_proxy, sys.argv[1], int(sys.argv[2]), backend_options={"use_uvloop": uv})


def _start_proxy(procs: _Procs, tmp: Path, upstream: str) -> str:
    """Start the bare proxy in its own process; its URL once it listens."""
    port = _free_port()
    code = "from bearsdk.bench.gateway._procs import _proxy_main; _proxy_main()"
    log = tmp / "proxy.log"
    p = procs.start([sys.executable, "-c", code, upstream, str(port)], log, stdin=subprocess.PIPE)
    assert p.stdout is not None
    deadline = time.monotonic() + _START_S
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, min(left, 0.5)))
        if ready and p.stdout.readline().strip() == b"ready":
            return f"http://127.0.0.1:{port}"
        if _exited(p) or left <= 0:
            raise BearError(f"the bare proxy did not start: {_tail(log) or 'no output'}")


# ------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-n:])


_TROUBLE = re.compile(r"Traceback|Error|error|exception|refused|warning|WARNING|killed")


def _trouble(path: Path) -> list[str]:
    """Log lines that point at a problem (at most 20, duplicates dropped)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(ln for ln in lines if _TROUBLE.search(ln)))[:20]


def _exited(p: subprocess.Popen[bytes]) -> bool:
    """Whether ``p`` ended, without reaping it.

    Until it is reaped its pid, and so its process group's id, stays ours: a
    ``killpg`` then never reaches a stranger that was given the same number.
    """
    if p.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    # Not Popen.send_signal: it reaps a process that has just ended (see _exited).
    if p.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


class _Procs:
    """Every child process the bench started, stopped on any way out (Ctrl-C included)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, argv: list[str], log: Path, *, stdin: int | None = None
    ) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            # Its own session: a Ctrl-C at the terminal reaches the bench alone, which then
            # stops the children itself; killpg also reaches the gateway's worker processes.
            p = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=out if stdin is None else subprocess.PIPE,
                stderr=out,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    @staticmethod
    def kill(p: subprocess.Popen[bytes]) -> None:
        """SIGKILL the process's whole group (its workers too) and reap it."""
        if p.returncode is not None:
            return  # reaped: its group id may be someone else's by now
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10.0)

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
            if p.stdout is not None:
                p.stdout.close()
            self.kill(p)
        self.procs.clear()


def _start_engines(
    procs: _Procs, tmp: Path, interval_s: float
) -> tuple[subprocess.Popen[bytes], dict[str, list[str]]]:
    code = "from bearsdk.bench.gateway._procs import _engines_main; _engines_main()"
    log = tmp / "engines.log"
    p = procs.start([sys.executable, "-c", code, str(interval_s)], log, stdin=subprocess.PIPE)
    assert p.stdout is not None
    deadline = time.monotonic() + _START_S
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, min(left, 0.5)))
        if ready:
            line = p.stdout.readline()
            if line:
                urls: dict[str, list[str]] = json.loads(line)
                return p, urls
        if _exited(p) or left <= 0:
            raise BearError(f"the stub engines did not start: {_tail(log) or 'no output'}")


def _listeners(port: int) -> int:
    """Sockets listening on ``port`` (one per gateway worker), -1 if unknown."""
    try:
        text = Path("/proc/net/tcp").read_text()
    except OSError:
        return -1
    want = f":{port:04X}"
    return sum(
        1
        for ln in text.splitlines()[1:]
        if (f := ln.split()) and len(f) > 3 and f[1].endswith(want) and f[3] == "0A"
    )


def _gateway_toml(
    port: int,
    instances: Iterable[tuple[str, str]],
    keys: Iterable[tuple[str, str]],
    *,
    workers: int = 1,
    grace_s: float = 5.0,
    history: int | None = None,
) -> str:
    from bearsdk.gateway.keys import hash_key

    out = [
        "[server]",
        f"port = {port}",
        f"workers = {workers}",
        "access_log = false",
        f"drain_grace_s = {grace_s}",
        *([] if history is None else [f"decision_history = {history}"]),
        "",
    ]
    for name, url in instances:
        out += [
            "[[instances]]",
            f'name = "{name}"',
            f'url = "{url}"',
            f'model = "{MODEL}"',
            f'profile = "{PROFILE}"',
            'snapshots = "poll"',  # the stubs serve GET /bear/snapshot, not the push stream
            "",
        ]
    for name, secret in keys:
        out += ["[[keys]]", f'name = "{name}"', f'hash = "{hash_key(secret)}"', ""]
    return "\n".join(out)


def _write(path: Path, text: str) -> None:
    # Atomic: a reload never reads half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@attrs.define
class _Gateway:
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    config: Path
    log: Path
    workers: int


async def _start_gateway(
    procs: _Procs, tmp: Path, label: str, toml: Callable[[int], str], workers: int = 1
) -> _Gateway:
    """Start ``bearsdk serve`` and wait until every worker listens and it is ready.

    Raises:
        BearError: It exited or was not ready in time (with its last log line).
    """
    port = _free_port()
    path = tmp / f"gateway-{label}.toml"
    _write(path, toml(port))
    log = tmp / f"gateway-{label}.log"
    argv = [sys.executable, "-m", "bearsdk", "serve", "--config", str(path)]
    gw = _Gateway(procs.start(argv, log), f"http://127.0.0.1:{port}", port, path, log, workers)
    deadline = time.monotonic() + _START_S
    ok = 0
    while ok < 3:
        if _exited(gw.proc):
            procs.kill(gw.proc)
            raise BearError(
                f"the gateway exited with status {gw.proc.returncode} before it was ready: "
                f"{_tail(log) or 'no output'}"
            )
        if time.monotonic() > deadline:
            raise BearError(f"the gateway was not ready in {_START_S:g} s: {_tail(log)}")
        await anyio.sleep(0.1)
        # Every worker must listen, or the kernel sends all connections to those that do.
        if 0 <= _listeners(port) < workers:
            continue
        try:
            async with aiohttp.ClientSession() as s, s.get(gw.url + "/readyz") as r:
                ok = ok + 1 if r.status == 200 else 0
        except (aiohttp.ClientError, OSError):
            ok = 0
    return gw


async def _stop_gateway(gw: _Gateway, sig: int = signal.SIGTERM) -> int | None:
    """Signal the gateway, wait for it; kill what is left. Its exit status (None: killed)."""
    if not _exited(gw.proc):
        _signal(gw.proc, sig)
    exited = await _until(lambda: _exited(gw.proc), _STOP_S)
    _Procs.kill(gw.proc)  # and the workers it left behind, if any
    return gw.proc.returncode if exited else None


def _rss_kib(pid: int) -> int:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    except (OSError, ValueError):
        pass
    return 0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """Parent pid and CPU seconds (user + system) of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rindex(")") + 2 :].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / _TICK


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds of ``root`` and of each of its descendants (the gateway's workers)."""
    stats: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            stats[int(d)] = st
    out: dict[int, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
        todo += [c for c, (parent, _) in stats.items() if parent == pid]
    return out


def _machine_busy_s() -> float:
    """CPU seconds all processes of the machine used (``/proc/stat``), steal included."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return math.nan
    # user nice system idle iowait irq softirq steal: all but idle and iowait are busy.
    ticks = [int(x) for x in fields[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK


class _Cpu:
    """Cores used by the generator, the engines, the gateway and the rest over a window.

    The machine may be shared: ``other`` (everything else, hypervisor steal
    included) says how much of it the bench did not have.
    """

    def __init__(self, engines: int, gateway: int | None) -> None:
        self.engines = engines
        self.gateway = gateway
        self.t0 = time.perf_counter()
        self.c0 = self._now()

    def _now(self) -> dict[str | int, float]:
        # The generator alone: its descendants are the other two.
        out: dict[str | int, float] = {"machine": _machine_busy_s()}
        out["generator"] = sum(os.times()[:2])
        out["engines"] = sum(_tree_cpu(self.engines).values())
        if self.gateway is not None:
            for pid, v in _tree_cpu(self.gateway).items():
                out[pid] = v
        return out

    def cores(self) -> dict[str, Any]:
        """Cores busy per role; ``gateway_processes``: each gateway process (busiest first)."""
        dt = time.perf_counter() - self.t0
        now = self._now()
        share = {k: (v - self.c0.get(k, 0.0)) / dt for k, v in now.items()}
        out: dict[str, Any] = {"generator": round(share["generator"], 2)}
        out["engines"] = round(share["engines"], 2)
        procs = sorted((v for k, v in share.items() if isinstance(k, int)), reverse=True)
        if self.gateway is not None:
            out["gateway"] = round(sum(procs), 2)
            # A process under 1% is the multiprocessing resource tracker, not a worker.
            out["gateway_processes"] = [round(v, 2) for v in procs if v >= 0.01]
        ours = share["generator"] + share["engines"] + sum(procs)
        other = share["machine"] - ours
        out["other"] = None if math.isnan(other) else round(max(0.0, other), 2)
        return out


def _fd_limit(need: int) -> dict[str, Any]:
    """Raise the soft open-files limit to the hard one (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        target = hard if hard != resource.RLIM_INFINITY else need
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return {"soft": soft, "hard": hard, "needed": need, "enough": soft >= need}

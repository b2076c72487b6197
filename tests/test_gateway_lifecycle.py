"""``bearsdk serve`` through reloads and stops, with streams in flight.

A reload (SIGHUP) that changes the pool and the keys while streams run fails
none of them; SIGTERM lets in-flight streams finish within the grace period
and exits 0; Ctrl-C exits 130 with one line; a bad config or a taken port is
one line and exit 2.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
import orjson
import pytest

from bearsdk.emulator import EngineConfig, EnginePool, GroundTruthParams
from bearsdk.gateway import Gateway
from bearsdk.gateway.config import load_gateway_config
from bearsdk.gateway.keys import hash_key
from bearsdk.gateway.server import listen, run_gateway

OLD_KEY = "old-key-0123456789abcdef"
NEW_KEY = "new-key-0123456789abcdef"
MSGS = [{"role": "user", "content": "Tell me a long story."}]
DEAD_INSTANCE = (
    '[[instances]]\nname = "a"\nurl = "http://127.0.0.1:9"\n'
    'model = "Qwen/Qwen3-8B"\nprofile = "qwen3-8b-h100"\n'
)
SLACK_S = 60.0  # a loaded machine's scheduling delays; never a speed claim


def instance(e: object) -> str:
    return "\n".join(
        [
            "[[instances]]",
            f'name = "{e.instance}"',  # type: ignore[attr-defined]
            f'url = "{e.url}"',  # type: ignore[attr-defined]
            f'model = "{e.model_name}"',  # type: ignore[attr-defined]
            f'profile = "{e.config.profile}"',  # type: ignore[attr-defined]
            "",
        ]
    )


def key(name: str, secret: str) -> str:
    return f'[[keys]]\nname = "{name}"\nhash = "{hash_key(secret)}"\n'


def slow_pool() -> EnginePool:
    # Slower than the profile, so that streams are still running when the test acts.
    slow = GroundTruthParams(time_scale=4.0)
    return EnginePool(
        [
            EngineConfig(profile="qwen3-0.6b-h100", time_model=slow, seed=1),
            EngineConfig(profile="qwen3-0.6b-h100", time_model=slow, seed=2),
        ]
    )


async def until(cond: Callable[[], bool], limit_s: float = SLACK_S) -> None:
    """Poll ``cond``: a reload and a drain have no event to wait on."""
    with anyio.fail_after(limit_s):
        while not cond():  # noqa: ASYNC110
            await anyio.sleep(0.01)


@asynccontextmanager
async def running(path: Path) -> AsyncIterator[tuple[str, Gateway]]:
    cfg = load_gateway_config(path)
    sock = listen("127.0.0.1", 0)
    urls: list[str] = []
    async with anyio.create_task_group() as tg:

        async def go(*, task_status: anyio.abc.TaskStatus[Gateway]) -> None:
            await run_gateway(cfg, sock, ready=urls.append, task_status=task_status)

        gw = await tg.start(go)
        try:
            yield urls[0], gw
        finally:
            tg.cancel_scope.cancel()


async def stream_once(
    s: aiohttp.ClientSession, url: str, secret: str, started: anyio.Event | None, out: list[str]
) -> None:
    body = {"model": "auto", "messages": MSGS, "max_tokens": 48, "stream": True,
            "bear": {"ttft_ms": 60000}}  # fmt: skip
    async with s.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
    ) as r:
        if r.status != 200:
            out.append(f"status {r.status}")
            return
        await r.content.readline()
        if started is not None:
            started.set()
        text = (await r.read()).decode()
    out.append("ok" if text.rstrip().endswith("data: [DONE]") and '"error"' not in text else text)


async def test_reload_under_load_fails_no_stream(tmp_path: Path) -> None:
    n = 120
    async with slow_pool() as pool:
        a, b = pool[0], pool[1]
        path = tmp_path / "gateway.toml"
        path.write_text(
            "[server]\nport = 0\naccess_log = false\n" + instance(a) + key("old", OLD_KEY)
        )
        async with running(path) as (url, gw):
            results: list[str] = []
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as s, anyio.create_task_group() as tg:
                events = [anyio.Event() for _ in range(n)]
                for ev in events:
                    tg.start_soon(stream_once, s, url, OLD_KEY, ev, results)
                with anyio.fail_after(SLACK_S):
                    for ev in events:
                        await ev.wait()
                assert gw.in_flight == n
                # The pool moves from a to b and the key changes, with n streams on a.
                path.write_text(
                    "[server]\nport = 0\naccess_log = false\n" + instance(b) + key("new", NEW_KEY)
                )
                os.kill(os.getpid(), signal.SIGHUP)
                await until(lambda: "new" in gw.keys.usage())
                assert gw.router.instances == [a.instance, b.instance]
                # New requests: the new key works and goes to b; the old one is refused.
                after: list[str] = []
                await stream_once(s, url, NEW_KEY, None, after)
                refused: list[str] = []
                await stream_once(s, url, OLD_KEY, None, refused)
                assert after == ["ok"]
                assert refused == ["status 401"]
            # Every stream that was running at the reload finished normally.
            assert results == ["ok"] * n
            assert sum(1 for r in b.request_log) == 1
            # a left the pool once idle.
            await until(lambda: a.instance not in gw.router.instances)
            assert gw.router.instances == [b.instance]


async def test_reload_with_a_bad_file_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        path = tmp_path / "gateway.toml"
        path.write_text(
            "[server]\nport = 0\naccess_log = false\n" + instance(pool[0]) + key("old", OLD_KEY)
        )
        async with running(path) as (_url, gw):
            path.write_text("[server]\nport = 0\nworkerz = 2\n" + instance(pool[0]))
            os.kill(os.getpid(), signal.SIGHUP)
            await until(lambda: any("reload refused" in r.getMessage() for r in caplog.records))
            msg = next(r.getMessage() for r in caplog.records if "reload refused" in r.getMessage())
            assert "workerz is not a known key; did you mean 'workers'?" in msg
            assert gw.keys.enabled
            assert list(gw.keys.usage()) == ["old"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_cli(path: Path) -> tuple[anyio.abc.Process, str]:
    proc = await anyio.open_process(
        [sys.executable, "-m", "bearsdk", "serve", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = b""
    with anyio.fail_after(SLACK_S):
        while not line.endswith(b"\n"):
            line += await proc.stdout.receive(1)
    text = line.decode()
    assert text.startswith("bearsdk serve: http://127.0.0.1:"), text
    return proc, text.split()[2]


async def test_sigterm_drains_streams_and_exits_0(tmp_path: Path) -> None:
    async with slow_pool() as pool:
        path = tmp_path / "gateway.toml"
        path.write_text(
            f"[server]\nport = {free_port()}\ndrain_grace_s = 30\naccess_log = false\n"
            + instance(pool[0])
            + instance(pool[1])
        )
        proc, url = await start_cli(path)
        async with proc:
            results: list[str] = []
            async with aiohttp.ClientSession() as s, anyio.create_task_group() as tg:
                events = [anyio.Event() for _ in range(8)]
                for ev in events:
                    tg.start_soon(stream_once, s, url, "", ev, results)
                with anyio.fail_after(SLACK_S):
                    for ev in events:
                        await ev.wait()
                proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(SLACK_S):
                code = await proc.wait()
            assert code == 0
            assert results == ["ok"] * 8
            # It stopped listening.
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as s, s.get(url + "/healthz"):
                    pass


async def test_ctrl_c_exits_130_in_one_line(tmp_path: Path) -> None:
    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        path = tmp_path / "gateway.toml"
        path.write_text(f"[server]\nport = {free_port()}\n" + instance(pool[0]))
        proc, _ = await start_cli(path)
        async with proc:
            proc.send_signal(signal.SIGINT)
            with anyio.fail_after(SLACK_S):
                code = await proc.wait()
            assert proc.stderr is not None
            err = b""
            async for chunk in proc.stderr:
                err += chunk
        assert code == 130
        assert err.decode().strip().splitlines()[-1] == "bearsdk serve: interrupted"
        assert b"Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nport = 70000\n", "server: port must be an integer in [0, 65535] (got 70000)"),
        (
            '[admission]\nmode = "wait"\n',
            "admission: mode must be one of best-effort, reject, queue (got 'wait')",
        ),
        ('[[keys]]\nname = "a"\nkey = "plaintext-secret-123456"\n', "plaintext"),
        ('[router]\nselector = "fastest"\n', "router: selector must be one of"),
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(text + DEAD_INSTANCE)
    out = subprocess.run(
        [sys.executable, "-m", "bearsdk", "serve", "--config", str(path), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("bearsdk serve: error: ")
    assert message in lines[0]
    assert "plaintext-secret-123456" not in out.stderr


def test_taken_port_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        path = tmp_path / "gateway.toml"
        path.write_text(f"[server]\nport = {port}\n" + DEAD_INSTANCE)
        out = subprocess.run(
            [sys.executable, "-m", "bearsdk", "serve", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == f"bearsdk serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_hash_key_prints_the_stored_form() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bearsdk", "serve", "--hash-key"],
        input="my-secret-key-0123456789\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0
    assert "my-secret-key" not in out.stdout
    stored = out.stdout.strip().removeprefix("hash: ")
    from bearsdk.gateway.keys import KeyRing, KeySpec

    ring = KeyRing([KeySpec(name="k", hash=stored)])
    spec = ring.authenticate("Bearer my-secret-key-0123456789")
    assert spec is not None
    assert spec.name == "k"
    assert orjson.dumps(stored)  # one printable line


async def test_pool_reloads_drain_before_adding_and_swap_changed_instances_when_idle() -> None:
    from bearsdk.gateway.server import _Pool
    from bearsdk.router import InstanceConfig

    def cfg(name: str, timeout_s: float = 300.0) -> InstanceConfig:
        return InstanceConfig(
            name=name, url="http://127.0.0.1:9", model="Qwen/Qwen3-8B", timeout_s=timeout_s
        )

    class Router:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []
            self.busy: set[str] = set()

        async def add_instance(self, c: InstanceConfig) -> None:
            self.calls.append(("add", f"{c.name}@{c.timeout_s:g}"))

        def drain_instance(self, name: str) -> None:
            self.calls.append(("drain", name))

        def undrain_instance(self, name: str) -> None:
            self.calls.append(("undrain", name))

        def remove_instance(self, name: str) -> None:
            self.calls.append(("remove", name))

        def inflight(self, name: str) -> int:
            return 1 if name in self.busy else 0

    r = Router()
    pool = _Pool(r, {"a": cfg("a"), "b": cfg("b")})  # type: ignore[arg-type]
    r.busy = {"a", "b"}
    # a removed, b changed, c added: both drains come before the add.
    await pool.apply({"b": cfg("b", 60.0), "c": cfg("c")})
    assert r.calls == [("drain", "a"), ("drain", "b"), ("add", "c@300")]
    r.calls.clear()
    await pool.reap()
    assert r.calls == []  # both still busy
    r.busy = {"a"}
    await pool.reap()
    assert r.calls == [("remove", "b"), ("add", "b@60")]
    r.calls.clear()
    # a comes back as it runs while still draining: routable again, never removed.
    await pool.apply({"a": cfg("a"), "b": cfg("b", 60.0), "c": cfg("c")})
    assert r.calls == [("undrain", "a")]
    r.busy = set()
    r.calls.clear()
    await pool.reap()
    assert r.calls == []


async def test_a_changed_file_is_reloaded_with_watch_s(tmp_path: Path) -> None:
    async with EnginePool.of("qwen3-0.6b-h100") as pool:
        path = tmp_path / "gateway.toml"
        head = "[server]\nport = 0\naccess_log = false\nwatch_s = 0.05\n" + instance(pool[0])
        path.write_text(head + key("old", OLD_KEY))
        cfg = load_gateway_config(path)
        sock = listen("127.0.0.1", 0)
        async with anyio.create_task_group() as tg:

            async def go(*, task_status: anyio.abc.TaskStatus[Gateway]) -> None:
                await run_gateway(cfg, sock, handle_signals=False, task_status=task_status)

            gw = await tg.start(go)
            assert list(gw.keys.usage()) == ["old"]
            path.write_text(head + key("new", NEW_KEY))
            # No signal: the file's change alone reloads it.
            await until(lambda: list(gw.keys.usage()) == ["new"])
            tg.cancel_scope.cancel()

"""examples/chat_service.py as a careless operator would use it.

The process fails in one line when its port is taken, and Ctrl-C ends it with
130. What a service must do with untrusted bodies, deadlines and slow sockets is
the gateway's (tests/test_gateway_limits.py); this example stays short.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / "chat_service.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=EXAMPLES,
    )


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = _start("--port", str(port))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert err.count("\n") == 1
    assert err.startswith(f"chat_service.py: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_ctrl_c_exits_130_cleanly(when: str) -> None:
    proc = _start("--port", "0")
    assert proc.stdout is not None
    if when == "serving":
        assert "chat service on" in proc.stdout.readline()
    else:
        # Past the interpreter's own start-up (the script's first lines install
        # its handler), still loading libraries or starting the engines.
        maps = Path(f"/proc/{proc.pid}/maps")
        if not maps.exists():
            proc.kill()
            proc.communicate()
            pytest.skip("needs /proc to see how far the process got")
        deadline = time.monotonic() + 60
        while "aiohttp" not in maps.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, out + err
    assert err == "interrupted\n"  # no traceback, no "Unclosed client session"

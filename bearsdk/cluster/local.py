"""A throw-away ``redis-server`` on loopback, for tests and ``bearsdk bench replicas``.

It runs the ``redis-server`` binary (Debian: ``apt-get install redis-server``)
on 127.0.0.1 with a free port (Redis cannot pick one itself: ``--port 0``
turns TCP off), in a temporary directory, without persistence, and can be
killed and restarted on the same port to test outages.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import attrs

from bearsdk.errors import BearError

__all__ = ["LocalRedis", "LocalRedisError", "free_port"]


class LocalRedisError(BearError, RuntimeError):
    """``redis-server`` is missing or did not start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@attrs.define
class LocalRedis:
    """A ``redis-server`` process of its own (use as a context manager).

    Args:
        binary: The server executable.
        port: TCP port on 127.0.0.1 (default: a free one).
        start_timeout_s: How long :meth:`start` waits for the first ``PONG``.
    """

    binary: str = "redis-server"
    port: int = attrs.field(factory=free_port)
    start_timeout_s: float = 5.0
    _dir: Path | None = attrs.field(init=False, default=None)
    _proc: subprocess.Popen[bytes] | None = attrs.field(init=False, default=None)

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:{port}/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """The server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedis:
        """Start the server (again, on the same port) and wait until it answers.

        Raises:
            LocalRedisError: The binary is missing, or the server did not answer
                within ``start_timeout_s`` (its log is in the message).
        """
        exe = shutil.which(self.binary)
        if exe is None:
            raise LocalRedisError(
                f"{self.binary!r} not found on PATH (Debian: apt-get install redis-server)"
            )
        if self.running:
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="bearsdk-redis-"))
        log = self._dir / "redis.log"
        # No persistence: a restarted server starts empty, as after a crash
        # without an append-only file.
        self._proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self._dir), "--logfile", str(log),
             "--protected-mode", "yes", "--daemonize", "no"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout_s
        while not _pong(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                text = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise LocalRedisError(
                    f"redis-server on port {self.port} did not start: {text.strip() or 'no log'}"
                )
            time.sleep(0.01)
        return self

    def kill(self) -> None:
        """Kill the server at once (SIGKILL: clients see their connections reset)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(OSError):
            self.stop()

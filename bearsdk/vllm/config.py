"""Configuration of the vLLM snapshot publisher, from environment variables.

``vllm serve`` offers no way to pass options to a ``--scheduler-cls`` class, so
the publisher reads its configuration from the environment of the engine
process (``docs/vllm-plugin.md`` lists the variables). A malformed value is an
error that names the variable: the operator asked for publishing, and a typo
should stop the server rather than leave the router blind.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Final

import attrs

from bearsdk.io.shm import segment_path

__all__ = ["ENV_PREFIX", "PublisherConfig", "PublisherConfigError"]

ENV_PREFIX: Final = "BEARSDK_"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})
_IMPLEMENTATIONS: Final = frozenset({"cython", "python"})


class PublisherConfigError(ValueError):
    """An environment variable of the publisher has a malformed value.

    Attributes:
        variable: The variable's name.
    """

    def __init__(self, variable: str, message: str, value: str) -> None:
        self.variable = variable
        super().__init__(f"{variable} {message} (got {value!r})")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise PublisherConfigError(name, "must be 1/0, true/false, yes/no or on/off", raw)


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = float(raw)
    except ValueError:
        raise PublisherConfigError(name, "must be a number > 0", raw) from None
    if not (math.isfinite(v) and v > 0):
        raise PublisherConfigError(name, "must be a number > 0", raw)
    return v


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = int(raw)
    except ValueError:
        raise PublisherConfigError(name, "must be an integer >= 1", raw) from None
    if v < 1:
        raise PublisherConfigError(name, "must be an integer >= 1", raw)
    return v


def _http(env: Mapping[str, str], name: str, rank: int) -> tuple[str, int] | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise PublisherConfigError(name, "must be HOST:PORT, :PORT or PORT", raw) from None
    if not 0 <= port + rank <= 65535:
        raise PublisherConfigError(name, "must name a port in 0..65535", raw)
    # Data-parallel engines run one scheduler each: rank r serves on PORT + r
    # (port 0: each binds a free port of its own).
    return host, port + rank if port else 0


def _batch_time(env: Mapping[str, str], name: str) -> tuple[float, float, float, float] | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    parts = [p.strip() for p in raw.split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise PublisherConfigError(name, "must be four numbers b0,b1,b2,b3 >= 0", raw) from None
    if len(vals) != 4 or not all(math.isfinite(v) and v >= 0 for v in vals):
        raise PublisherConfigError(name, "must be four numbers b0,b1,b2,b3 >= 0", raw)
    return (vals[0], vals[1], vals[2], vals[3])


@attrs.frozen
class PublisherConfig:
    """Where and how an engine publishes its snapshots.

    Attributes:
        instance: The instance name in every document (and the default segment name).
        shm_path: The shared-memory segment to write, or None.
        shm_capacity: Largest document the segment holds, in bytes.
        http: ``(host, port)`` of the side HTTP server, or None. Port 0 binds any free port.
        file: Append every document to this NDJSON file (debugging), or None.
        threaded: Format and deliver documents on a publisher thread (the
            engine thread only captures); False does everything inline.
        heartbeat_s: Idle interval of the HTTP streams' heartbeats.
        batch_buffer: ``/bear/batches`` records a slow reader may have unsent.
        batch_time: Eq. 12 coefficients ``(b0, b1, b2, b3)`` in seconds; when
            set, documents carry ``inflight.remaining_s`` for the batch in flight.
        implementation: ``"cython"`` or ``"python"`` capture, or None for the default.
        shadow: Keep the requests' counters up to date from the scheduler's
            outputs instead of reading every request at every step (the
            compiled capture only; the plugin turns it off where vLLM's
            counters move in ways it does not follow).
        audit: Requests re-read from vLLM and checked per step in shadow mode;
            -1: all of them (every step exact, at the cost of a full read).
        poll_us: How often the publisher thread looks for a new capture.
        enabled: False: the scheduler behaves exactly as vLLM's own.
    """

    instance: str
    shm_path: str | None = None
    shm_capacity: int = 4 << 20
    http: tuple[str, int] | None = None
    file: str | None = None
    threaded: bool = True
    heartbeat_s: float = 1.0
    batch_buffer: int = 4096
    batch_time: tuple[float, float, float, float] | None = None
    implementation: str | None = None
    shadow: bool = True
    audit: int = 2
    poll_us: float = 500.0
    enabled: bool = True

    @property
    def has_transport(self) -> bool:
        """Whether any destination is configured."""
        return self.shm_path is not None or self.http is not None or self.file is not None

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        default_instance: str,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> PublisherConfig:
        """Read the configuration from environment variables.

        Args:
            env: The environment (default: ``os.environ``).
            default_instance: Instance name when ``BEARSDK_INSTANCE`` is unset
                (the served model name).
            dp_rank: This engine's data-parallel rank.
            dp_size: Data-parallel engines in the deployment; above 1 every
                rank gets ``-dp<rank>`` appended to its instance and segment
                names and serves HTTP on ``PORT + rank``.

        Returns:
            The configuration.

        Raises:
            PublisherConfigError: A variable is malformed.
        """
        e = os.environ if env is None else env
        p = ENV_PREFIX
        rank = dp_rank if dp_size > 1 else 0
        suffix = f"-dp{dp_rank}" if dp_size > 1 else ""
        instance = (e.get(p + "INSTANCE") or "").strip() or default_instance
        if not instance:
            raise PublisherConfigError(p + "INSTANCE", "must be a non-empty name", instance)
        instance += suffix
        shm_path: str | None = None
        shm = (e.get(p + "PUBLISH_SHM") or "").strip()
        if shm and shm.lower() not in _FALSE:
            if shm.lower() in _TRUE or shm.lower() == "auto":
                shm_path = str(segment_path(instance))
            elif "/" in shm:
                shm_path = shm + suffix
            else:
                shm_path = str(segment_path(shm + suffix))
        impl = (e.get(p + "PUBLISH_IMPL") or "").strip().lower() or None
        if impl is not None and impl not in _IMPLEMENTATIONS:
            raise PublisherConfigError(p + "PUBLISH_IMPL", "must be cython or python", impl)
        file = (e.get(p + "PUBLISH_FILE") or "").strip() or None
        audit_raw = (e.get(p + "PUBLISH_AUDIT") or "").strip().lower()
        if audit_raw == "all":
            audit = -1
        elif not audit_raw:
            audit = 2
        else:
            try:
                audit = int(audit_raw)
            except ValueError:
                audit = -2
            if audit < 0:
                raise PublisherConfigError(
                    p + "PUBLISH_AUDIT", "must be an integer >= 0 or 'all'", audit_raw
                )
        return cls(
            instance=instance,
            shm_path=shm_path,
            shm_capacity=_count(e, p + "PUBLISH_SHM_CAPACITY", 4 << 20),
            http=_http(e, p + "PUBLISH_HTTP", rank),
            file=None if file is None else file + suffix,
            threaded=_flag(e, p + "PUBLISH_THREAD", True),
            heartbeat_s=_positive(e, p + "HEARTBEAT_S", 1.0),
            batch_buffer=_count(e, p + "PUBLISH_BATCH_BUFFER", 4096),
            batch_time=_batch_time(e, p + "BATCH_TIME"),
            implementation=impl,
            shadow=_flag(e, p + "PUBLISH_SHADOW", True),
            audit=audit,
            poll_us=_positive(e, p + "PUBLISH_POLL_US", 500.0),
            enabled=_flag(e, p + "PUBLISH", True),
        )

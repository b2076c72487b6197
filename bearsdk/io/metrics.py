"""Unmodified vLLM: its Prometheus ``/metrics`` as an I/O edge of the router.

An engine without the snapshot endpoints still reports its load through
``/metrics``. :func:`parse_vllm_metrics` reads the four series the shadow view
reconciles against (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` and the labels of ``vllm:cache_config_info``), and
:class:`MetricsSource` polls them into a :class:`~bearsdk.state.shadow.ShadowView`,
which offers its synthesized snapshots to the instance's cache.
"""

from __future__ import annotations

import math
import random
import re
from typing import TYPE_CHECKING, Final

import aiohttp
import anyio
import anyio.abc
import attrs

from bearsdk import _validators as _v
from bearsdk.errors import BearError
from bearsdk.io.base import Backoff, _Health, _Tracked
from bearsdk.io.http import _RETRY, _base, _Failure, _session

if TYPE_CHECKING:
    from bearsdk.state.cache import SnapshotCache
    from bearsdk.state.shadow import ShadowView

__all__ = ["EngineMetrics", "MetricsError", "MetricsSource", "parse_vllm_metrics"]

_LINE: Final = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL: Final = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_WANTED: Final = frozenset(
    (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",  # the name before vLLM 0.10
        "vllm:cache_config_info",
    )
)


class MetricsError(BearError, ValueError):
    """A ``/metrics`` page lacks a series the shadow view needs, or has a bad value."""


@attrs.frozen
class EngineMetrics:
    """The load vLLM reports (summed over its engines when data-parallel).

    Attributes:
        running: ``vllm:num_requests_running``.
        waiting: ``vllm:num_requests_waiting``.
        kv_usage: ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1]), if reported.
        block_size: ``block_size`` label of ``vllm:cache_config_info``, if reported.
        num_gpu_blocks: ``num_gpu_blocks`` label of ``vllm:cache_config_info``.
    """

    running: int
    waiting: int
    kv_usage: float | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def used_blocks(self) -> int | None:
        """KV blocks in use, when usage and pool size are both known."""
        if self.kv_usage is None or self.num_gpu_blocks is None:
            return None
        return round(self.kv_usage * self.num_gpu_blocks)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """Extract the shadow view's series from a Prometheus text page.

    Raises:
        MetricsError: The running or waiting count is missing or not a count.
    """
    sums: dict[str, float] = {}
    usage: list[float] = []
    info: dict[str, str] | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _LINE.match(line)
        if m is None or m.group(1) not in _WANTED:
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            raise MetricsError(f"metric {name}: value must be a number (got {raw!r})") from None
        if name == "vllm:cache_config_info":
            if info is None and labels:
                info = dict(_LABEL.findall(labels))
        elif name.endswith("_usage_perc"):
            if math.isfinite(value):
                usage.append(value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    counts = []
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        v = sums.get(name)
        if v is None or not math.isfinite(v) or v < 0:
            raise MetricsError(f"metric {name}: must be present and a count >= 0 (got {v!r})")
        counts.append(round(v))
    kv = None
    if usage:
        kv = min(1.0, max(0.0, sum(usage) / len(usage)))
    return EngineMetrics(
        running=counts[0],
        waiting=counts[1],
        kv_usage=kv,
        block_size=None if info is None else _int_label(info, "block_size"),
        num_gpu_blocks=None if info is None else _int_label(info, "num_gpu_blocks"),
    )


@attrs.define
class MetricsSource(_Tracked):
    """Polls vLLM's ``/metrics`` into a shadow view and refreshes the instance's cache from it.

    Two loops in one task: metrics every ``interval_s``; the shadow's snapshot
    every ``refresh_s`` when the router's own events changed it.

    Args:
        url: The engine's base URL.
        view: The instance's shadow view.
        interval_s: Time between ``/metrics`` polls.
        refresh_s: Time between snapshot refreshes from router events.
        timeout_s: Limit on one poll.
        backoff: Delays between failed polls.
        session: A shared client session (default: an own one per :meth:`run`).
        name: Label in logs (default: ``metrics:{url}``).
    """

    url: str = attrs.field(converter=_base)
    view: ShadowView
    interval_s: float = attrs.field(default=0.5, validator=_v.positive)
    refresh_s: float = attrs.field(default=0.02, validator=_v.positive)
    timeout_s: float = attrs.field(default=1.0, validator=_v.positive)
    backoff: Backoff = attrs.field(factory=Backoff)
    session: aiohttp.ClientSession | None = None
    _name: str = attrs.field(default="", alias="name")
    _health: _Health = attrs.field(init=False)
    _rng: random.Random = attrs.field(init=False, factory=random.Random)
    _delay: float = attrs.field(init=False, default=0.0)

    def __attrs_post_init__(self) -> None:
        self._name = self._name or f"metrics:{self.url}"
        self._health = _Health(self._name)

    async def run(
        self,
        cache: SnapshotCache,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Poll and refresh until cancelled; ready after the first poll (answered or failed)."""
        async with _session(self.session) as session, anyio.create_task_group() as tg:
            await self._poll(session, cache)
            tg.start_soon(self._refresh_loop, cache)
            task_status.started()
            while True:
                await anyio.sleep(self._delay)
                await self._poll(session, cache)

    async def _poll(self, session: aiohttp.ClientSession, cache: SnapshotCache) -> None:
        try:
            with anyio.fail_after(self.timeout_s):
                async with session.get(f"{self.url}/metrics") as resp:
                    if resp.status != 200:
                        raise _Failure(f"GET /metrics: HTTP {resp.status}")
                    text = await resp.text()
            metrics = parse_vllm_metrics(text)
        except (*_RETRY, _Failure, MetricsError, UnicodeDecodeError) as exc:
            streak = self._health.fail(exc)
            self._delay = self.backoff.delay(streak, self._rng)
            return
        self._health.ok()
        self._health.documents += 1
        self._delay = self.interval_s
        self.view.on_metrics(metrics, now=cache.clock())
        self.view.refresh(cache, source=self._name)

    async def _refresh_loop(self, cache: SnapshotCache) -> None:
        while True:
            await anyio.sleep(self.refresh_s)
            if self.view.dirty:
                self.view.refresh(cache, source=self._name)

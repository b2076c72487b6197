"""Snapshot sources by name: how the router learns an instance's state.

An instance's ``snapshots`` setting names a registered source kind; when the
router starts (or the instance is added at run time) it builds that kind's
source from a :class:`SourceContext` and runs it in its task group, feeding the
instance's :class:`~bearsdk.state.SnapshotCache`. The built-ins (``push``,
``poll``, ``shm``, ``metrics``, ``redis``) are registered below exactly as a
user registers their own::

    class FileSource:  # any SnapshotSource: run(cache, *, task_status)
        ...

    register_snapshot_source("file", lambda ctx: FileSource(ctx.config.name))

A source's contract (readiness after its first attempt, retries with backoff,
nothing outside its own ``run``) is :class:`bearsdk.io.SnapshotSource`'s.

``bearsdk simulate`` runs in virtual time, so it cannot run a source's ``run``;
a kind may also give a *simulated form* (``simulated=``): a factory of
:class:`SimulatedSource`, which the simulator hands every snapshot its engine
publishes, with the time the router would receive it, and which returns what
the router's cache is offered, and when (or nothing). The built-ins that carry
the engine's own snapshots (push, poll, shm, redis) deliver them unchanged, at
``published + staleness_ms``; ``metrics`` has no simulated form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs

from bearsdk.errors import BearError

if TYPE_CHECKING:
    import aiohttp

    from bearsdk.cluster import Cluster
    from bearsdk.io import SnapshotSource
    from bearsdk.io.hop import HopSession
    from bearsdk.router.config import InstanceConfig
    from bearsdk.snapshot import Snapshot
    from bearsdk.state import ShadowView

__all__ = [
    "SimulatedSource",
    "SimulatedSourceFactory",
    "SourceContext",
    "SourceError",
    "SourceFactory",
    "SourceKind",
    "get_snapshot_source",
    "register_snapshot_source",
    "snapshot_source_names",
    "unregister_snapshot_source",
]


class SourceError(BearError, ValueError):
    """A source kind that is not registered, or a registration that clashes."""


@attrs.frozen(eq=False)
class SourceContext:
    """What a source factory builds one instance's source from.

    Attributes:
        config: The instance's configuration (URLs, intervals, names).
        session: The router's HTTP session (reuse it: one connection pool).
        cluster: The router's cluster, for kinds that need one.
        shadow: The router's shadow view of the instance, for kinds that
            declared ``shadow=True`` (engines that publish no snapshots).
        hop: The router's own HTTP/1.1 client (:class:`~bearsdk.io.hop.HopSession`),
            when it owns its session and ``httptools`` is installed: cheaper
            than ``session`` for the kinds that poll.
    """

    config: InstanceConfig
    session: aiohttp.ClientSession
    cluster: Cluster | None = None
    shadow: ShadowView | None = None
    hop: HopSession | None = None


SourceFactory = Callable[[SourceContext], "SnapshotSource"]
"""Builds one instance's snapshot source."""


class SimulatedSource(Protocol):
    """A source's form in the simulator (virtual time, no I/O)."""

    def deliver(self, snapshot: Snapshot, received: float) -> tuple[Snapshot, float] | None:
        """What the router's cache is offered for one published snapshot.

        Args:
            snapshot: What the simulated engine published (its ``time`` is when).
            received: When a push stream would deliver it (published plus the
                scenario's staleness).

        Returns:
            The snapshot to offer and when it is received (not before
            ``received``: the simulator offers it once the clock gets there), or
            ``None`` to deliver nothing for this one.
        """
        ...


SimulatedSourceFactory = Callable[["InstanceConfig"], SimulatedSource]
"""Builds one instance's simulated source from its configuration."""


class _Unchanged:
    """The simulated form of a source that carries the engine's own snapshots."""

    def deliver(self, snapshot: Snapshot, received: float) -> tuple[Snapshot, float] | None:
        return snapshot, received


def _unchanged(config: InstanceConfig) -> SimulatedSource:
    return _Unchanged()


@attrs.frozen
class SourceKind:
    """A registered source kind.

    Attributes:
        name: What an instance's ``snapshots`` setting says.
        factory: Builds the source of one instance.
        needs_cluster: Only with ``AsyncRouter(..., cluster=...)``.
        shadow: The router keeps a shadow view of its own dispatches for the
            instance (:class:`~bearsdk.state.ShadowView`), handed to the factory.
        simulated: Its form in ``bearsdk simulate`` (``None``: it has none,
            and a simulation that names it is refused).
    """

    name: str
    factory: SourceFactory
    needs_cluster: bool = False
    shadow: bool = False
    simulated: SimulatedSourceFactory | None = None


_REGISTRY: dict[str, SourceKind] = {}


def register_snapshot_source(
    name: str,
    factory: SourceFactory,
    *,
    needs_cluster: bool = False,
    shadow: bool = False,
    simulated: SimulatedSourceFactory | None = None,
    replace: bool = False,
) -> None:
    """Register a snapshot source kind under ``name``.

    Args:
        name: What instances' ``snapshots`` setting will say.
        factory: Builds one instance's source from its :class:`SourceContext`.
        needs_cluster: The kind needs the router's cluster.
        shadow: The router keeps a shadow view of the instance for the source.
        simulated: Builds the kind's :class:`SimulatedSource`, for
            ``bearsdk simulate`` (default: the simulator refuses the kind).
        replace: Replace a kind of that name (default: refuse).

    Raises:
        SourceError: ``name`` is empty or taken (and ``replace`` is false), or
            ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise SourceError(f"snapshot source name must be a non-empty string (got {name!r})")
    if not callable(factory):
        raise SourceError(f"snapshot source {name!r}: factory must be callable (got {factory!r})")
    if simulated is not None and not callable(simulated):
        raise SourceError(
            f"snapshot source {name!r}: simulated must be callable (got {simulated!r})"
        )
    if name in _REGISTRY and not replace:
        raise SourceError(f"snapshot source {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = SourceKind(
        name, factory, needs_cluster=needs_cluster, shadow=shadow, simulated=simulated
    )


def unregister_snapshot_source(name: str) -> None:
    """Remove a registered source kind (instances already running keep theirs).

    Raises:
        SourceError: ``name`` is not registered.
    """
    if _REGISTRY.pop(name, None) is None:
        raise SourceError(_unknown(name))


def snapshot_source_names() -> list[str]:
    """The registered source kinds, in registration order."""
    return list(_REGISTRY)


def get_snapshot_source(name: str) -> SourceKind:
    """The registered kind ``name``.

    Raises:
        SourceError: It is not registered.
    """
    kind = _REGISTRY.get(name)
    if kind is None:
        raise SourceError(_unknown(name))
    return kind


def _unknown(name: object) -> str:
    return f"snapshots must be one of {', '.join(_REGISTRY)} (got {name!r})"


def _push(ctx: SourceContext) -> SnapshotSource:
    from bearsdk.io import PushSource

    return PushSource(ctx.config.bear_url, session=ctx.session, name=f"push:{ctx.config.name}")


def _poll(ctx: SourceContext) -> SnapshotSource:
    from bearsdk.io import PollSource

    cfg = ctx.config
    return PollSource(
        cfg.bear_url,
        interval_s=cfg.poll_interval_s,
        session=ctx.session,
        name=f"poll:{cfg.name}",
        hop=ctx.hop,
    )


def _shm(ctx: SourceContext) -> SnapshotSource:
    from bearsdk.io import ShmSource, segment_path

    cfg = ctx.config
    return ShmSource(cfg.shm_name or segment_path(cfg.name), name=f"shm:{cfg.name}")


def _metrics(ctx: SourceContext) -> SnapshotSource:
    from bearsdk.io import MetricsSource

    cfg = ctx.config
    assert ctx.shadow is not None  # the kind asks for one
    return MetricsSource(
        cfg.url,
        ctx.shadow,
        interval_s=max(cfg.poll_interval_s, 0.2),
        session=ctx.session,
        name=f"metrics:{cfg.name}",
    )


def _redis(ctx: SourceContext) -> SnapshotSource:
    assert ctx.cluster is not None  # the kind needs one
    # The engine's own push stream stands in while Redis is unusable.
    return ctx.cluster.source(ctx.config.name, _push(ctx))


register_snapshot_source("push", _push, simulated=_unchanged)
register_snapshot_source("poll", _poll, simulated=_unchanged)
register_snapshot_source("shm", _shm, simulated=_unchanged)
register_snapshot_source("metrics", _metrics, shadow=True)
register_snapshot_source("redis", _redis, needs_cluster=True, simulated=_unchanged)

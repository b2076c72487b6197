"""Several emulated engines on one event loop (tests, examples, the demo)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self

import anyio
import anyio.abc
import attrs

from bearsdk._lifecycle import Runs
from bearsdk.emulator.engine import EmulatedEngine, EngineConfig

if TYPE_CHECKING:
    from bearsdk.router import InstanceConfig

__all__ = ["EnginePool"]


@attrs.define(eq=False)
class EnginePool(Runs):
    """A set of emulated engines started and stopped together.

    ``async with EnginePool.of("qwen3-0.6b-h100", "qwen3-8b-h100") as pool:`` starts
    every engine (each on its own port, 0 by default) in one task group and stops
    them all on exit; ``pool.urls`` lists their base URLs.

    Args:
        configs: One configuration per engine.
    """

    _configs: Sequence[EngineConfig]
    _engines: list[EmulatedEngine] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        names = [c.instance for c in self._configs if c.instance]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique (got {names})")
        self._engines = []
        counts: dict[str, int] = {}
        for cfg in self._configs:
            if cfg.instance is None:
                i = counts.get(cfg.profile, 0)
                counts[cfg.profile] = i + 1
                cfg = attrs.evolve(cfg, instance=f"{cfg.profile}-{i}")
            self._engines.append(EmulatedEngine(cfg))

    @classmethod
    def of(cls, *profiles: str, seed: int = 0, **config: object) -> EnginePool:
        """A pool with one engine per profile name (seeds ``seed``, ``seed + 1``, ...).

        Args:
            profiles: Emulator profile names.
            seed: Seed of the first engine.
            config: Further :class:`EngineConfig` fields, the same for every engine.
        """
        return cls(
            [
                EngineConfig(profile=p, seed=seed + i, **config)  # type: ignore[arg-type]
                for i, p in enumerate(profiles)
            ]
        )

    @property
    def engines(self) -> list[EmulatedEngine]:
        """The engines, in configuration order."""
        return self._engines

    @property
    def urls(self) -> list[str]:
        """Base URLs of the engines (after start)."""
        return [e.url for e in self._engines]

    def instance_configs(
        self, *, calibrated: bool = False, **overrides: Any
    ) -> list[InstanceConfig]:
        """The router's view of these engines (after start): one
        :class:`~bearsdk.router.InstanceConfig` each, with the engine's name, URL,
        model, scheduler and batch-time profile, push snapshots, and its KV-event
        sockets where it publishes them (``kv_events=True``).

        Args:
            calibrated: Give each instance its engine's own eq. 12 fit
                (:meth:`EmulatedEngine.calibrated_batch_time`) instead of the
                profile: what ``bearsdk calibrate`` would measure there.
            overrides: Further ``InstanceConfig`` fields, the same for every engine.
        """
        from bearsdk.router import InstanceConfig

        out = []
        for e in self._engines:
            fields: dict[str, Any] = {
                "name": e.instance,
                "url": e.url,
                "model": e.model_name,
                "scheduler": e.config.scheduler,
                "scheduler_params": dict(e.config.params),
                "profile": e.config.profile,
                "snapshots": "push",
            }
            ends = e.kv_events_endpoints
            if ends is not None:
                fields["kv_events"], fields["kv_events_replay"] = ends
            if calibrated:
                fields["batch_time"] = e.calibrated_batch_time()
            out.append(InstanceConfig(**{**fields, **overrides}))
        return out

    def __iter__(self) -> Iterator[EmulatedEngine]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def __getitem__(self, i: int) -> EmulatedEngine:
        return self._engines[i]

    async def run(self, *, task_status: anyio.abc.TaskStatus[Self]) -> None:
        """Run every engine until cancelled (``await tg.start(pool.run)``)."""
        try:
            async with anyio.create_task_group() as tg:
                for e in self._engines:
                    await tg.start(e.run)
                task_status.started(self)
        except BaseExceptionGroup as group:
            # One engine failed to start (a port in use): report that error itself.
            if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
                raise group.exceptions[0] from None
            raise

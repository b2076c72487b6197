"""vLLM scheduler classes that publish snapshots: the ``--scheduler-cls`` plugin.

``vllm serve MODEL --scheduler-cls bearsdk.vllm.BearScheduler`` makes vLLM's
engine core build :class:`BearScheduler`, which returns an instance of
:class:`BearAsyncScheduler` (a subclass of vLLM's ``AsyncScheduler``) when the
engine schedules asynchronously, vLLM's default, and of :class:`BearSyncScheduler`
(a subclass of ``Scheduler``) otherwise. vLLM does not pick between the two
for a custom class, and the wrong one would corrupt async scheduling, hence
the dispatch. Both behave exactly as vLLM's own and call the publisher's
hooks (:attr:`~bearsdk.vllm.publisher.Publisher.hooks`):

* at the start of ``schedule()``: capture ``running`` and the waiting queues
  (``kv_holding_waiting`` first, as the scheduler drains them) and the free
  KV blocks. Everything the engine did since the last batch (outputs
  processed, arrivals and aborts applied) is in, and with async scheduling
  the batch still in flight shows as placeholders: the state the replay of
  ``vllm-v1`` starts from (the vllm-oracle tool's ``gen_cases.py`` captures
  the same);
* after ``schedule()``: the batch's composition;
* at the start of ``update_from_output()``: the batch is done (its duration;
  its sampled tokens). When the engine is then left with nothing to schedule
  (it sleeps until a request comes), and after an abort that empties it, one
  more capture publishes the idle state;
* in ``_preempt_request()``: the preemption.

The last three keep the capture's own copy of the requests' counters current
("shadow mode", see ``cext/_vllm_pub_c.pyx``), so that a capture need not read
every request. That copy follows vLLM's plain generation path; where counters
also move otherwise (speculative decoding, KV connectors, pooling or
encoder-only models) every capture reads every request instead.

Configuration is by environment variable (:mod:`bearsdk.vllm.config`). This
module imports vLLM; nothing else in bearsdk imports it.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable
from typing import Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from bearsdk.vllm._prefix import PoolTracker
from bearsdk.vllm.config import PublisherConfig, PublisherConfigError
from bearsdk.vllm.publisher import INLINE_DOCUMENT, Publisher

__all__ = ["BearAsyncScheduler", "BearScheduler", "BearSyncScheduler", "publisher_of"]

log = logging.getLogger("bearsdk.vllm")


def _instance_name(vllm_config: Any) -> str:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    if not name:
        name = getattr(vllm_config.model_config, "model", None)
    return str(name or "vllm")


def _start_publisher(sched: Any) -> Publisher | None:
    vc = sched.vllm_config
    pc = vc.parallel_config
    config = PublisherConfig.from_env(
        os.environ,
        default_instance=_instance_name(vc),
        dp_rank=int(getattr(pc, "data_parallel_rank", 0) or 0),
        dp_size=int(getattr(pc, "data_parallel_size", 1) or 1),
    )
    if not config.enabled:
        return None
    if not config.has_transport:
        log.warning(
            "bearsdk: no snapshot destination configured (set BEARSDK_PUBLISH_SHM, "
            "BEARSDK_PUBLISH_HTTP or BEARSDK_PUBLISH_FILE); publishing only to "
            "transports added in code"
        )
    pub = Publisher(
        config,
        block_size=int(sched.block_size),
        num_blocks=int(sched.kv_cache_config.num_blocks),
        free_blocks=_free_blocks_reader(sched),
        async_scheduling=bool(sched.scheduler_config.async_scheduling),
        shadow_safe=_shadow_safe(sched),
        prefix_tracker=_prefix_tracker(sched),
    )
    stats = pub.stats()
    log.info(
        "bearsdk: publishing instance %r (epoch %s) to %s; capture %s%s, %s%s",
        pub.instance,
        pub.epoch,
        ", ".join(t.name for t in pub.transports) or "nothing yet",
        pub.implementation,
        " (shadow)" if stats.shadow else "",
        "threaded" if config.threaded else "inline",
        ", with the prefix cache" if pub.prefix is not None else "",
    )
    return pub


def _prefix_tracker(sched: Any) -> PoolTracker | None:
    # The extension models one full-attention KV cache group whose hashes are
    # the block size's (docs/prefix-caching.md, "Scope"); anything else
    # publishes without it, as with the cache off.
    mgr = sched.kv_cache_manager
    if not getattr(mgr, "enable_caching", False):
        return None
    managers: tuple[Any, ...] = tuple(
        getattr(getattr(mgr, "coordinator", None), "single_type_managers", ())
    )
    groups = sched.kv_cache_config.kv_cache_groups
    if len(managers) != 1 or len(groups) != 1:
        log.warning("bearsdk: prefix caching with %d KV cache groups is not exported", len(groups))
        return None
    if type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec" or int(
        mgr.block_pool.hash_block_size
    ) != int(sched.block_size):
        log.warning("bearsdk: prefix caching of this KV cache layout is not exported")
        return None
    return PoolTracker(mgr.block_pool, managers[0], int(sched.block_size))


def _free_blocks_reader(sched: Any) -> Callable[[], int]:
    # vLLM's get_num_free_blocks() returns free_block_queue.num_free_blocks;
    # reading the attribute through C (attrgetter) spares the engine thread a
    # cold Python frame every step. The method is the fallback.
    pool = sched.kv_cache_manager.block_pool
    queue = getattr(pool, "free_block_queue", None)
    if queue is not None and isinstance(getattr(queue, "num_free_blocks", None), int):
        return functools.partial(operator.attrgetter("num_free_blocks"), queue)
    return cast(Callable[[], int], pool.get_num_free_blocks)


def _shadow_safe(sched: Any) -> bool:
    # Shadow mode follows vLLM's counters through schedule(), the sampled
    # tokens and preemptions; these features move them along other paths.
    return (
        getattr(sched, "connector", None) is None
        and getattr(sched, "ec_connector", None) is None
        and getattr(sched, "num_spec_tokens", 0) == 0
        and getattr(sched, "num_sampled_tokens_per_step", 1) == 1
        and not getattr(sched, "is_mm_encoder_only", False)
        and getattr(sched.vllm_config.model_config, "runner_type", "generate") == "generate"
    )


# The methods below run on vLLM's engine thread every step: each is a few
# bytecodes around one call into the hooks, which never raise. `_bear_hooks`
# is None when publishing is off.


def _init(base: type[Any]) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.bear_publisher = None
        self._bear_hooks = None
        try:
            self.bear_publisher = _start_publisher(self)
        except PublisherConfigError:
            raise
        except Exception:
            log.exception("bearsdk: the snapshot publisher failed to start; serving without it")
        if self.bear_publisher is not None:
            self._bear_hooks = self.bear_publisher.engine_hooks

    return __init__


def _schedule(base: type[Any]) -> Any:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        hooks = self._bear_hooks
        if hooks is None:
            return base.schedule(self, *args, **kwargs)
        if hooks.before_schedule(self):
            self.bear_publisher.deliver(INLINE_DOCUMENT)
        out = base.schedule(self, *args, **kwargs)
        hooks.after_schedule(out)
        return out

    return schedule


def _update_from_output(base: type[Any]) -> Any:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        hooks = self._bear_hooks
        if hooks is None:
            return base.update_from_output(self, scheduler_output, model_runner_output)
        what = hooks.before_update(scheduler_output, model_runner_output)
        out = base.update_from_output(self, scheduler_output, model_runner_output)
        what |= hooks.after_change(self)
        if what:
            self.bear_publisher.deliver(what)
        return out

    return update_from_output


def _finish_requests(base: type[Any]) -> Any:
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        out = base.finish_requests(self, request_ids, finished_status)
        hooks = self._bear_hooks
        if hooks is not None and hooks.after_change(self):
            self.bear_publisher.deliver(INLINE_DOCUMENT)
        return out

    return finish_requests


def _preempt_request(base: type[Any]) -> Any:
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        out = base._preempt_request(self, request, *args, **kwargs)
        hooks = self._bear_hooks
        if hooks is not None:
            hooks.preempted(request)
        return out

    return _preempt_request


def _shutdown(base: type[Any]) -> Any:
    def shutdown(self: Any) -> None:
        try:
            base.shutdown(self)
        finally:
            pub: Publisher | None = self.bear_publisher
            if pub is not None:
                pub.close()

    return shutdown


def _publishing(base: type[Any], name: str) -> type[Any]:
    ns = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": (
            f"vLLM's ``{base.__name__}`` that publishes ``bear.snapshot/1`` documents "
            "(see :mod:`bearsdk.vllm.scheduler`).\n\n"
            "Attributes:\n    bear_publisher: The publisher, or None when disabled."
        ),
        "__init__": _init(base),
        "schedule": _schedule(base),
        "update_from_output": _update_from_output(base),
        "finish_requests": _finish_requests(base),
        "_preempt_request": _preempt_request(base),
        "shutdown": _shutdown(base),
    }
    return type(name, (base,), ns)


BearSyncScheduler: type[Any] = _publishing(Scheduler, "BearSyncScheduler")
BearAsyncScheduler: type[Any] = _publishing(AsyncScheduler, "BearAsyncScheduler")


class BearScheduler:
    """The ``--scheduler-cls`` entry point: builds the variant vLLM's config calls for.

    ``BearScheduler(vllm_config=..., ...)`` takes vLLM's scheduler arguments and
    returns a :class:`BearAsyncScheduler` when
    ``vllm_config.scheduler_config.async_scheduling`` is on, a
    :class:`BearSyncScheduler` otherwise.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Build the scheduler variant for the engine's scheduling mode."""
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if vllm_config.scheduler_config.async_scheduling:
            return BearAsyncScheduler(*args, **kwargs)
        return BearSyncScheduler(*args, **kwargs)


def publisher_of(scheduler: Any) -> Publisher | None:
    """The publisher of a scheduler built by this plugin (None if disabled or another class)."""
    pub = getattr(scheduler, "bear_publisher", None)
    return pub if isinstance(pub, Publisher) else None

"""RouterCore: the synchronous, I/O-free heart of the router.

It holds what the router knows of each instance (snapshot cache and state,
statistics, breaker, the estimators its selector asks for), turns a request
into a :class:`~bearsdk.router.Decision` (predictors, then one TTFT estimate per
instance, then the selector), and learns from what happened to the requests it
routed (dispatches, first tokens, completions: :mod:`bearsdk.router.feedback`,
which it inherits). It does no I/O and starts no
task, so a simulator, a benchmark or an application with its own HTTP client
drives it directly::

    core = RouterCore(pool, BEAR(lam=5e-4))
    core.cache("a").offer(snapshot)
    d = core.decide(prompt, ttft_target=0.4)
    core.record_dispatch(d)
    ...
    core.record_first_token(d, d.instance, ttft_s)

:class:`~bearsdk.router.AsyncRouter` is this core, plus the instance runtime
(snapshot sources, calibration) and dispatch (HTTP, retries, streaming).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs

from bearsdk.errors import BearError
from bearsdk.estimators.base import InstanceView
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.estimators.bea import BEAEstimator
from bearsdk.estimators.length import RememberedLengths
from bearsdk.estimators.lps import LPSEstimator
from bearsdk.estimators.prefill import nominal_theta_pre
from bearsdk.estimators.registry import (
    EstimatorContext,
    EstimatorError,
    InstanceEstimator,
    build_estimator,
    estimator_names,
)
from bearsdk.estimators.stats import InstanceStats
from bearsdk.kvevents.index import text_chain
from bearsdk.predictors.protocol import PoolPredictor
from bearsdk.prompts.approx import BLOCK_CHARS
from bearsdk.prompts.ids import PromptIds
from bearsdk.router.breaker import CircuitBreaker
from bearsdk.router.candidates import Candidates
from bearsdk.router.config import ConfigError, InstanceConfig, cover_models, load_pool_config
from bearsdk.router.decision import Decision
from bearsdk.router.errors import (
    NoInstanceError,
    RequestError,
    check_max_tokens,
    check_target,
    check_token_ids,
    prompt_text,
    short,
)
from bearsdk.router.explore import Exploration, Explorer
from bearsdk.router.feedback import RouterFeedback
from bearsdk.router.hooks import RouterHooks
from bearsdk.router.margin import TtftMargin
from bearsdk.router.pricing import (
    Ask,
    PruningMemo,
    Row,
    price,
    price_best_first,
    price_least_late,
    reprice_lowest,
)
from bearsdk.router.prompts import PromptEncoders
from bearsdk.router.slot import (
    InstanceSlot,
    dispatch_index,
)
from bearsdk.router.sources import get_snapshot_source
from bearsdk.router.targets import PaperTargets, TargetRule
from bearsdk.schedulers import bind_scheduler
from bearsdk.selectors import BEAR, Option, Selection, Selector
from bearsdk.state import CachedSnapshot, InstanceState, ShadowView, SnapshotCache, StalenessRules
from bearsdk.state.speed import SpeedEstimate, SpeedTracker, interval_evidence

if TYPE_CHECKING:
    from bearsdk.prompts.tokenizer import ChatTokenizer

__all__ = ["InstanceSlot", "RouterCore", "RouterHooks"]

_MAX_DISPATCH_KEYS: Final = 4096
_FALLBACK_REACH: Final = 8.0
"""When no instance is on time and every estimate is a lower bound, the decision
is priced again this many times further past the target."""
"""Decisions' prompt keys kept for their dispatch (oldest out first)."""

DEFAULT_SPEED: Final = SpeedTracker(BatchTimeModel(0.0, 0.0, 0.0, 0.0), min_factor=1.0)
"""The speed tracker's settings each instance copies by default (its base is the instance's).

Slower than its profile is believed at once, faster never (``min_factor=1``):
believing an instance faster than it is misses deadlines, the reverse only
costs some utility. Measured on the paper's setup, learning down to 0.05 cost
BEAR up to 2.1% of on-time utility at 16-20 qps (the emulator runs the 32B
faster than its profile at light load), the floor costs 0.1-0.3% at any rate;
pass a tracker with a lower ``min_factor`` for GPUs known to beat their
profiles (docs/calibration.md)."""

SPEED_MIN_INTERVAL_S: Final = 0.05
"""Snapshots closer than this to the last speed anchor wait for a later one
(bounds the evidence's cost per instance to 20 pairs per second)."""

# decide() builds its Decision positionally (keywords cost more on the hot path).
assert [f.name for f in attrs.fields(Decision)] == [
    "request_id",
    "selector",
    "instance",
    "candidates",
    "index",
    "ttft_target_s",
    "reason",
    "prompt_tokens",
    "output_tokens",
    "decided_at",
    "decide_s",
    "explored",
    "tpot_target_s",
], "Decision's fields moved"

DEFAULT_EXPLORATION: Final = Exploration()
"""Exploration by default: 1% of decisions, instances without speed evidence for 30 s."""


class RouterCore(RouterFeedback):
    """Chooses an instance per request and learns from the outcomes; no I/O.

    Args:
        pool: Instances (:class:`~bearsdk.router.InstanceConfig` values), or the
            path of a TOML pool file.
        selector: The selector (default :class:`~bearsdk.selectors.BEAR`).
        predictor: Accuracy / length / cost predictor covering every instance's
            model (default: the shipped Qwen3 placeholder); anything with
            :class:`~bearsdk.predictors.protocol.PoolPredictor`'s members.
        targets: Rule giving a TTFT target to requests that carry none
            (default: the paper's appendix A.2 rule).
        staleness: How instances handle old snapshots.
        clock: Time source (seconds); wall time, as engines stamp snapshots.
        hooks: Observability callbacks.
        resident_lengths: How BEA sizes the requests resident on an engine
            (see :class:`~bearsdk.router.AsyncRouter`).
        breaker: Circuit-breaker settings, copied for each instance.
        speed: Learn each instance's real speed from its successive snapshots
            and replay with its coefficients scaled by it (``None``: the
            coefficients as configured). A :class:`~bearsdk.state.speed.SpeedTracker`
            is copied for each instance (its ``base`` replaced by the instance's).
        margin: Widen each instance's TTFT estimates by the upper quantile of
            its recent first tokens' observed-over-predicted ratios
            (:mod:`bearsdk.router.margin`; default ``None``: the point estimates
            as they are).
        explore: Bounded exploration of instances without recent speed
            evidence (``None``: never; see :mod:`bearsdk.router.explore`).
        tokenizers: Per model (the pool's ``model`` names), its tokenizer: a
            :class:`~bearsdk.prompts.tokenizer.ChatTokenizer` or a model
            directory (``tokenizer.json`` and chat template; the
            ``tokenizers`` extra). Each request is then tokenized once per
            model as its engines do, and BEA replays every candidate with the
            prompt's exact length and block chain (the prefix the instance
            holds); see :mod:`bearsdk.router.prompts`.
        dispatch_prefixes: Estimate each prefix-caching instance's cached
            prefix from what the router sent there, where neither its KV events
            nor the prompt's token ids tell (approximate, by character blocks;
            :mod:`bearsdk.prompts.approx`).
        expect_arrivals: Add to each TTFT estimate the prefill that requests
            still to come will bring into the batch that completes the new
            request's prompt, from the prefill load the router's recent
            dispatches brought there (:func:`~bearsdk.router.pricing.ttft_arrivals`; off: BEA as the
            paper defines it). Matters at high load and for cached prompts.

    Raises:
        ConfigError: An invalid pool, or a selector whose latency estimator is
            not registered.
    """

    def __init__(
        self,
        pool: Sequence[InstanceConfig] | str | Path,
        selector: Selector | None = None,
        *,
        predictor: PoolPredictor | None = None,
        targets: TargetRule | None = None,
        staleness: StalenessRules | None = None,
        clock: Callable[[], float] = time.time,
        hooks: RouterHooks | None = None,
        resident_lengths: Literal["predicted", "calibrated"] = "predicted",
        breaker: CircuitBreaker | None = None,
        speed: SpeedTracker | None = DEFAULT_SPEED,
        margin: TtftMargin | None = None,
        explore: Exploration | None = DEFAULT_EXPLORATION,
        tokenizers: Mapping[str, ChatTokenizer | str | Path] | None = None,
        dispatch_prefixes: bool = False,
        expect_arrivals: bool = False,
    ) -> None:
        configs = load_pool_config(pool) if isinstance(pool, str | Path) else list(pool)
        # An empty pool is valid: instances may all come at run time (add, discovery).
        if resident_lengths not in ("predicted", "calibrated"):
            raise ConfigError(
                f"resident_lengths must be 'predicted' or 'calibrated' (got {resident_lengths!r})"
            )
        self.resident_lengths = resident_lengths
        self.selector: Selector = selector if selector is not None else BEAR()
        if self.selector.latency not in estimator_names():
            raise ConfigError(
                f"selector {self.selector.name!r}: latency estimator {self.selector.latency!r} "
                f"is not registered (known: {', '.join(estimator_names())})"
            )
        if predictor is None:
            from bearsdk.predictors import Predictor

            predictor = Predictor.load_default()
        self.predictor: PoolPredictor = predictor
        self.targets: TargetRule = targets if targets is not None else PaperTargets()
        self.staleness = staleness if staleness is not None else StalenessRules()
        self.clock = clock
        self.hooks = hooks if hooks is not None else RouterHooks()
        self._explorer = None if explore is None or speed is None else Explorer(explore)
        self._pruning = PruningMemo()
        # The last decision found nothing on time, every estimate past the horizon.
        self._overloaded = False
        # The model the latest overload found least late (price_least_late).
        self._late_model = -1
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        self._speed = speed
        self._margin = margin
        self.prompts = PromptEncoders.build(tokenizers)
        self.dispatch_prefixes = dispatch_prefixes
        self.expect_arrivals = expect_arrivals
        # The prompt keys each candidate was priced with, by (request, instance):
        # a dispatch's place in the instance's view hits its cache with them.
        self._dispatch_keys: OrderedDict[tuple[str, str], Sequence[int]] = OrderedDict()
        self._slots: dict[str, InstanceSlot] = {}
        self._lengths: dict[str, RememberedLengths] = {}
        self._models = list(self.predictor.models)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        for cfg in configs:
            self.add(cfg)

    # ------------------------------------------------------------------ pool

    def add(self, cfg: InstanceConfig) -> InstanceSlot:
        """Add an instance to the pool (its snapshots are fed by whoever runs it).

        Raises:
            ConfigError: Duplicate name, or a model the predictor cannot cover.
        """
        if cfg.name in self._slots:
            raise ConfigError(f"instance {cfg.name!r}: duplicate name")
        kind = get_snapshot_source(cfg.snapshots)
        # A model the predictor was not trained on routes with the predictor's prior.
        self.predictor = cover_models(self.predictor, [cfg])
        self._models = list(self.predictor.models)
        try:
            idx = self._models.index(cfg.model)
        except ValueError:
            raise ConfigError(
                f"instance {cfg.name!r}: model {cfg.model!r} is not in the predictor's pool "
                f"({', '.join(self._models)})"
            ) from None
        bt = cfg.batch_time_model()
        lengths = self._lengths.setdefault(
            cfg.model, RememberedLengths(calibrate=self.resident_lengths == "calibrated")
        )
        sched = bind_scheduler(cfg.scheduler, cfg.params)
        est = BEAEstimator(sched, bt, lengths)
        cache = SnapshotCache(cfg.name, est, expect_instance=None, clock=self.clock)
        # The fallback knows the instance: its prefill rate and its sequence cap
        # (LPS's defaults are off by orders of magnitude for a real engine).
        lps = LPSEstimator(theta_pre=nominal_theta_pre(bt), concurrency=sched.max_seqs)
        rules = self.staleness
        if kind.shadow:
            # A shadow view's snapshots are counts, not the engine's steps: there
            # is no batch in flight to place (bench staleness: its MAPE 18.4 %
            # unplaced, 19.9 % placed).
            rules = attrs.evolve(rules, anchor_steps=False)
        state = InstanceState(cache, est, rules=rules, name=cfg.name, fallback=lps)
        slot = InstanceSlot(
            config=cfg,
            model_index=idx,
            batch_time=bt,
            scheduler=sched,
            cache=cache,
            state=state,
            stats=InstanceStats(),
            breaker=attrs.evolve(self._breaker),
            # Engines without snapshots: the router's own events, reconciled by the source.
            shadow=(
                ShadowView(cfg.name, clock=self.clock, prefill_tokens_per_s=nominal_theta_pre(bt))
                if kind.shadow
                else None
            ),
        )
        if self._margin is not None:
            slot.margin = self._margin.tracker()
        if self._speed is not None:
            slot.speed = attrs.evolve(self._speed, base=bt)
            cache.on_accept = functools.partial(self._snapshot_accepted, slot)
        if self.dispatch_prefixes and sched.prefix_caching:
            slot.dispatches = dispatch_index(sched)
        self._slots[cfg.name] = slot
        return slot

    def _snapshot_accepted(
        self, slot: InstanceSlot, prev: CachedSnapshot | None, new: CachedSnapshot
    ) -> None:
        # Successive snapshots of a busy engine measure its speed with no traffic
        # of ours needed: an instance the router stopped choosing stays calibrated.
        speed = slot.speed
        snap = new.snapshot
        anchor = slot.speed_anchor
        if speed is None:
            return
        if prev is None or anchor is None or anchor.epoch != snap.epoch:
            slot.speed_anchor = snap
            return
        if snap.time - anchor.time < SPEED_MIN_INTERVAL_S:
            return
        slot.speed_anchor = snap
        iv = interval_evidence(anchor, snap, speed.base, slot.scheduler.token_budget)
        if iv is not None and speed.observe(iv, snap.time):
            model = speed.model
            est = slot.state.estimator
            if model is not est.batch_time:
                est.batch_time = model

    def rebase(self, name: str, model: BatchTimeModel) -> None:
        """Give ``name`` new base eq. 12 coefficients (e.g. an online fit of its batches).

        The speed evidence learned so far is priced again with them
        (:meth:`~bearsdk.state.speed.SpeedTracker.rebase`): the model it gave
        holds until new evidence moves it.
        """
        slot = self.slot(name)
        if slot.speed is None:
            slot.state.estimator.batch_time = model
            return
        slot.speed.rebase(model)
        slot.state.estimator.batch_time = slot.speed.model

    def speed(self, name: str) -> SpeedEstimate | None:
        """``name``'s learned speed against its base coefficients (``None``: not learned)."""
        slot = self.slot(name)
        if slot.speed is None:
            return None
        anchor = slot.speed_anchor
        return slot.speed.estimate(None if anchor is None else anchor.time)

    def remove(self, name: str) -> InstanceSlot:
        """Take ``name`` out of the pool; returns what the router kept for it."""
        return self._slots.pop(self.slot(name).name)

    def drain(self, name: str, draining: bool = True) -> None:
        """Stop (or, with ``draining=False``, resume) routing new requests to ``name``."""
        self.slot(name).draining = draining

    @property
    def instances(self) -> list[str]:
        """Names of the instances in the pool (draining ones included)."""
        return list(self._slots)

    def slots(self) -> list[InstanceSlot]:
        """What the router keeps per instance, in pool order."""
        return list(self._slots.values())

    def slot(self, name: str) -> InstanceSlot:
        """What the router keeps for ``name``.

        Raises:
            BearError: ``name`` is not in the pool.
        """
        try:
            return self._slots[name]
        except KeyError:
            raise BearError(
                f"instance {name!r} is not in the pool ({', '.join(self._slots)})"
            ) from None

    def cache(self, name: str) -> SnapshotCache:
        """The snapshot cache of instance ``name`` (offer it snapshots)."""
        return self.slot(name).cache

    def state(self, name: str) -> InstanceState:
        """The TTFT state of instance ``name``."""
        return self.slot(name).state

    def find(self, name: str) -> InstanceSlot | None:
        """What the router keeps for ``name``, or ``None`` once it left the pool."""
        return self._slots.get(name)

    # ------------------------------------------------------------------ deciding

    def next_id(self) -> str:
        """A fresh request id."""
        # Fixed width: no id is a prefix of another (engines embed it in their own,
        # and the overlay matches a dispatch to a snapshot's id by containment).
        return f"bear-{self._prefix}-{next(self._ids):010d}"

    def decide(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        ttft_target: float | None = None,
        max_tokens: int | None = None,
        request_id: str | None = None,
        exclude: frozenset[str] = frozenset(),
        instances: Collection[str] | None = None,
        tpot_target: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Decision:
        """Choose an instance for a request (synchronous; no I/O).

        Args:
            prompt: A prompt, or chat messages.
            ttft_target: The request's TTFT target in seconds, > 0 (default: the
                target rule; ``math.inf``: no target, every instance is on time).
            tpot_target: Its target mean time per output token after the first,
                seconds > 0 (default and ``math.inf``: none). A selector that
                routes on TPOT (BEAR) has BEA follow its first tokens and
                requires both targets.
            prompt_token_ids: The prompt's token ids as the engines see them:
                BEA then replays each candidate with the prompt's full-block
                content keys, so that its admission hits the prefix the
                instance holds where the snapshot carries the block pool
                (``kv.prefix_cache``, with content keys: the emulator's);
                ``docs/prefix-caching.md``.
            max_tokens: The request's output cap.
            request_id: Id to record (default: a fresh one).
            exclude: Instances not to consider.
            instances: Consider only these instances (default: the whole pool);
                a gateway's routing group or model.

        Returns:
            The decision, with every candidate's predictions.

        Raises:
            RequestError: ``ttft_target``, ``max_tokens`` or ``request_id`` is not
                a valid value, or ``prompt`` is neither a string nor messages.
            NoInstanceError: No instance can take the request.
        """
        t0 = time.perf_counter()
        ttft_target = check_target(ttft_target)
        tpot = check_target(tpot_target, "tpot_target")
        given = check_token_ids(prompt_token_ids)
        tpot_s = math.inf if tpot is None else tpot
        max_tokens = check_max_tokens("max_tokens", max_tokens)
        if request_id is not None and not (
            isinstance(request_id, str) and 0 < len(request_id) <= 256
        ):
            raise RequestError(
                f"request_id must be a string of 1 to 256 characters (got {short(request_id)})"
            )
        now = self.clock()
        text = prompt_text(prompt)
        fast = getattr(self.predictor, "predict_lists", None)
        cols = self.predictor.predict(text, quantiles=False).lists() if fast is None else fast(text)
        if exclude or instances is not None:
            slots = [
                s
                for s in self._slots.values()
                if not s.draining
                and s.name not in exclude
                and (instances is None or s.name in instances)
                and s.breaker.routable(now)
            ]
        else:
            slots = [s for s in self._slots.values() if not s.draining and s.breaker.routable(now)]
        if not slots:
            raise NoInstanceError(
                "no instance can take the request (all drained, removed or failing)"
            )
        outs, ptoks = cols[1], cols[2]
        prompt_tokens = int(ptoks[slots[0].model_index])
        target = self.targets.target_for(prompt_tokens) if ttft_target is None else ttft_target
        sel_ = self.selector
        horizon = self._horizon(target)
        want = getattr(sel_, "next_tokens", None)
        follow = 0 if want is None else int(want(tpot_s))
        if given is not None:
            ids: PromptIds | dict[str, PromptIds] | None = PromptIds(given)
        elif self.prompts:
            ids = self.prompts.encode(prompt, {s.config.model for s in slots})
        else:
            ids = None
        # Instances known only by what was sent there: the text's character blocks.
        # (Only a router with dispatch_prefixes gives instances a dispatch index.)
        approx = (
            text_chain(text, BLOCK_CHARS)
            if self.dispatch_prefixes and any(s.dispatches is not None for s in slots)
            else None
        )
        priced: dict[str, Sequence[int]] = {}
        ask = Ask(cols, max_tokens, now, follow, ids, (text, approx), priced)

        def select(options: list[Option]) -> Selection:
            if want is None:
                return sel_.select(options, target)
            # (The protocol's optional TPOT form; see Selector.)
            tpot_aware: Any = sel_
            got: Selection = tpot_aware.select(options, target, tpot_target_s=tpot_s)
            return got

        # One seeded draw per decision, before pricing: a decision that may
        # explore prices every instance (exploring needs their estimates).
        explore = self._explorer is not None and self._explorer.draw()
        prunes = not explore and len(slots) > 1 and getattr(sel_, "prunes_by_utility", False)
        best_first = prunes and self._pruning.worth_it()

        # Only the best utility on time, else the lowest TTFT, is chosen: past the
        # target and the lowest TTFT found so far an estimate can stay a bound.
        floor = (
            target
            if prunes and horizon != math.inf and (want is None or tpot_s == math.inf)
            else None
        )

        def choose(h: float, best_first: bool) -> tuple[list[Row], Selection]:
            if best_first:
                return price_best_first(self, slots, ask, h, select, target, floor)
            rows = price(self, slots, ask, h, floor)
            return rows, select([c[0] for c in rows])

        far = horizon * _FALLBACK_REACH
        # An overload lasts: after a decision that needed the second look below,
        # the next is priced that far out at once, rather than replaying the
        # same instances to the horizon and then again from the start. The
        # choice is the same (no instance on time at the horizon becomes so
        # further out; the lowest TTFT is exact either way); only the cost and
        # the other instances' values differ (exact where they were bounds).
        # (A selector that does not send the late where they are least late
        # needs no estimate past the horizon.)
        least_late = getattr(sel_, "seeks_least_late", True)
        reach = far if self._overloaded and not explore and least_late else horizon
        if reach == far and prunes and (want is None or tpot_s == math.inf):
            # (Its fallback is the lowest TTFT: only that one must be exact.)
            rows = price_least_late(self, slots, ask, horizon, far, self._late_model)
            sel = select([c[0] for c in rows])
            best_first = False
        else:
            rows, sel = choose(reach, best_first)
        if (
            least_late
            and reach == horizon
            and horizon != math.inf
            and sel.feasible is not None
            and not any(sel.feasible)
            and rows[sel.index][7]
        ):
            # Nothing is on time and every estimate stopped at the horizon: the
            # fallback compared lower bounds, which say nothing about which instance
            # is least late. Look further (in overload only, so bounded cost). No
            # instance becomes on time further out.
            if prunes and (want is None or tpot_s == math.inf):
                # (Its fallback is the lowest TTFT: only bounds that could be it.)
                rows = reprice_lowest(self, slots, rows, ask, far)
                sel = select([c[0] for c in rows])
            else:
                rows, sel = choose(far, False)
        if prunes:
            self._pruning.observe(rows, sel, best_first)
        self._overloaded = (
            horizon != math.inf
            and sel.feasible is not None
            and not any(sel.feasible)
            and rows[sel.index][0].ttft_s > horizon
        )
        if self._overloaded:
            self._late_model = slots[sel.index].model_index
        index, reason = sel.index, sel.reason
        if explore:
            assert self._explorer is not None
            got = self._explorer.pick(
                index,
                [c[0].ttft_s if c[1] != "lps" else math.nan for c in rows],
                [math.nan if s.speed is None else s.speed.last_evidence_at for s in slots],
                target,
                now,
            )
            if got is not None:
                index, reason = got
        chosen = slots[index]
        if chosen.dispatches is not None and approx is not None:
            chosen.dispatches.record(approx)
        j = chosen.model_index
        # (Positional: Decision's field order, as its class lists them.)
        d = Decision(
            request_id or self.next_id(),
            sel_.name,
            chosen.name,
            Candidates(rows, sel),
            index,
            target,
            reason,
            int(ptoks[j]),
            int(outs[j]),
            now,
            time.perf_counter() - t0,
            index != sel.index,
            tpot_s,
        )
        if priced:
            keep = self._dispatch_keys
            for name, keys in priced.items():
                keep[(d.request_id, name)] = keys
            while len(keep) > _MAX_DISPATCH_KEYS:
                keep.popitem(last=False)
        for hook in self.hooks.on_decision:
            hook(d)
        return d

    def _horizon(self, target: float) -> float:
        """The selector's horizon for ``target`` (``inf``: it needs exact estimates)."""
        fn = getattr(self.selector, "horizon", None)
        if fn is None:
            return math.inf
        h = float(fn(target))
        # A selector's bad horizon must not cut estimates it needs: none below the target.
        return h if h >= target else math.inf

    def estimator_for(self, s: InstanceSlot, kind: str) -> InstanceEstimator:
        """``s``'s estimator of kind ``kind``, built on first use."""
        ctx = EstimatorContext(
            name=s.name,
            model=s.config.model,
            batch_time=s.batch_time,
            scheduler=s.scheduler,
            state=s.state,
            view=functools.partial(self.view, s.name),
        )
        try:
            est = build_estimator(kind, ctx)
        except EstimatorError as exc:
            raise ConfigError(f"selector {self.selector.name!r}: {exc}") from None
        s.estimators[kind] = est
        return est

    def view(self, name: str, now: float) -> InstanceView:
        """The router's statistics of ``name`` at ``now``, with its latest snapshot."""
        s = self.slot(name)
        entry = s.cache.entry
        return s.stats.view(
            now,
            snapshot=None if entry is None else entry.snapshot,
            snapshot_time=None if entry is None else entry.captured,
            name=s.name,
        )

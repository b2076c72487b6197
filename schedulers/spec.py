"""Scheduler specs: an engine's scheduling policy as data, built from a few composable blocks.

A spec (TOML file, dict, or :class:`SchedulerSpec`) names its engine flags under
``[params]`` with their defaults and wires them into six building blocks:

``[budget]``
    What one batch may hold: a token budget, a sequence cap, the model's context
    limit, and how tokens are counted (``"tokens"``: sum of scheduled tokens;
    ``"padded"``: sequences x longest chunk, as padded prefill kernels count).
``[batch]``
    The order of batch-formation stages (``"running"``: running requests in
    running order, decodes and partial prefills alike; ``"decodes"``;
    ``"prefills"``: running partial prefills; ``"waiting"``: admissions, FCFS),
    whether a batch holds only the first stage that schedules anything
    (``exclusive``: prefill-only or decode-only batches), whether admissions run
    in a step that preempted, and asynchronous scheduling (one batch in flight).
``[prefill]``
    Chunked prefill on or off, a per-request cap on prompt tokens per step, and
    whether that cap is lifted when a request is alone.
``[admission]``
    What a blocked admission does (``"stop"``: head-of-line blocking; ``"skip"``:
    try the next request) and whether admission must fit the whole sequence in KV.
``[kv]``
    Block size, pool size, blocks that are never free, allocation mode
    (``"on-demand"``, ``"prompt"``: the whole prompt at admission, ``"max-length"``:
    prompt + max output at admission), and the watermark with when it applies.
``[preemption]``
    The victim when a running request cannot get its blocks (``"newest"`` or
    ``"none"``), where it re-enters the waiting queue, and whether it keeps its
    output tokens (recomputing prompt + outputs) or restarts from scratch.

A block field holds a literal or ``"$param"``, a reference to a parameter; so
parameter names mirror the engine's own flags while the blocks stay generic.
:meth:`SchedulerSpec.bind` resolves references against defaults plus overrides
and validates everything into a :class:`BoundScheduler`, the flat value the
replay implementations compile.

Words: a :class:`SchedulerSpec` is an engine's scheduling policy as data; a
:class:`BoundScheduler` is one spec bound to parameter values (it was called
``Policy``, which stays an alias). "Selector" is the router's word for BEAR,
Lagrangian and the baselines (:mod:`bearsdk.selectors`); "staleness rules" are
:class:`~bearsdk.state.StalenessRules`.

Decoding is strict: unknown keys anywhere are errors (with the close name
suggested), a parameter no block uses is an error, and every error names the
scheduler, the field and the value (``scheduler 'sarathi': chunk_size must be > 0
(got 0)``). Numbers are bounded physically with the snapshot caps
(``docs/snapshots.md``, "Bounds"): ``block_size`` <= 4096, ``num_blocks`` and
``reserved_blocks`` <= 2**24, the token budget, ``max_model_len`` and
``chunk_cap`` <= 2**24 tokens, ``seqs`` <= 4096. Spec files are UTF-8 (a BOM is
ignored).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from bearsdk.errors import SpecError, short_repr
from bearsdk.snapshot import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, MAX_REQUEST_TOKENS, MAX_REQUESTS

__all__ = [
    "SPEC_SCHEMA",
    "AdmissionBlock",
    "BatchBlock",
    "BoundScheduler",
    "BudgetBlock",
    "KVBlock",
    "Policy",
    "PreemptionBlock",
    "PrefillBlock",
    "SchedulerSpec",
    "load_spec",
    "spec_from_dict",
]

SPEC_SCHEMA: Final = "bear.scheduler/1"

ParamValue = int | float | bool
Ref = int | float | bool | str  # a literal, or "$name" naming a parameter

STAGES: Final = ("running", "decodes", "prefills", "waiting")
BUDGET_COUNTS: Final = ("tokens", "padded")
ON_BLOCKED: Final = ("stop", "skip")
ALLOCATE: Final = ("on-demand", "prompt", "max-length")
WATERMARK_APPLIES: Final = ("always", "while-running", "never")
VICTIMS: Final = ("newest", "none")
REQUEUE: Final = ("front", "back")

# Numeric parameters are bounded physically, with the caps snapshots have
# (docs/snapshots.md, "Bounds"): a bound scheduler then never asks a replay for more
# than a snapshot could (a block_size of 10**12 made the compiled one raise
# MemoryError), and every count stays far inside int32.
MAX_TOKEN_BUDGET: Final = MAX_REQUEST_TOKENS
MAX_SEQS: Final = MAX_REQUESTS
MAX_MODEL_LEN: Final = MAX_REQUEST_TOKENS


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for a close candidate, else ``""``."""
    if len(word) > 200:  # a huge key is no typo; difflib is quadratic
        return ""
    close = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _stages_repr(stages: tuple[str, ...]) -> str:
    if len(stages) > len(STAGES) * 2:
        return short_repr(stages)
    return repr([x if len(x) <= 40 else short_repr(x, 40) for x in stages])


@attrs.frozen
class BudgetBlock:
    """What one batch may hold.

    Attributes:
        tokens: Token budget per batch (``> 0``).
        seqs: Most requests running at once (``> 0``).
        max_model_len: Context limit per request; ``0`` for none.
        count: ``"tokens"`` or ``"padded"``.
    """

    tokens: Ref
    seqs: Ref
    max_model_len: Ref = 0
    count: str = "tokens"


@attrs.frozen
class BatchBlock:
    """How a batch is formed.

    Attributes:
        stages: Stage order, from ``running``, ``decodes``, ``prefills``, ``waiting``.
        exclusive: A batch holds only the first stage that schedules anything.
        admit_after_preemption: Run the ``waiting`` stage in a step that preempted.
        async_scheduling: One batch is in flight while the next is scheduled.
    """

    stages: tuple[str, ...]
    exclusive: Ref = False
    admit_after_preemption: Ref = False
    async_scheduling: Ref = False


@attrs.frozen
class PrefillBlock:
    """How prompts are split across batches.

    Attributes:
        chunked: Prompts may be split across batches.
        chunk_cap: Most prompt tokens one request takes per batch; ``0`` for none.
        cap_exempt_when_alone: Lift ``chunk_cap`` when only one request is resident.
    """

    chunked: Ref = True
    chunk_cap: Ref = 0
    cap_exempt_when_alone: Ref = False


@attrs.frozen
class AdmissionBlock:
    """How waiting requests are admitted.

    Attributes:
        on_blocked: ``"stop"`` (head-of-line blocking) or ``"skip"``.
        reserve_full_sequence: Admission requires KV for the whole sequence, not
            only for this step's chunk.
    """

    on_blocked: str = "stop"
    reserve_full_sequence: Ref = False


@attrs.frozen
class KVBlock:
    """KV-cache accounting.

    Attributes:
        block_size: Tokens per block.
        num_blocks: Blocks in the pool; ``0``: take it from the snapshot (unlimited
            when the snapshot has none).
        reserved_blocks: Blocks that are never free (vLLM's null block).
        allocate: ``"on-demand"``, ``"prompt"`` or ``"max-length"``.
        watermark: Fraction of the pool kept free on admissions.
        watermark_applies: ``"always"``, ``"while-running"`` or ``"never"``.
        decode_needs_free_block: A decode step requires at least one free block
            even when it needs no new one (vLLM V0, Sarathi-Serve, Vidur); vLLM V1
            checks only the blocks actually needed.
        prefix_caching: Automatic prefix caching as vLLM V1 does it: full blocks
            stay findable by content until evicted, admissions skip the cached
            prefix (``docs/prefix-caching.md``); needs ``allocate = "on-demand"``.
    """

    block_size: Ref
    num_blocks: Ref = 0
    reserved_blocks: Ref = 0
    allocate: str = "on-demand"
    watermark: Ref = 0.0
    watermark_applies: str = "always"
    decode_needs_free_block: Ref = False
    prefix_caching: Ref = False


@attrs.frozen
class PreemptionBlock:
    """What happens when a running request cannot get its KV blocks.

    Attributes:
        victim: ``"newest"`` (most recently admitted running request) or ``"none"``.
        requeue: Where the victim re-enters the waiting queue: ``"front"``/``"back"``.
        keep_outputs: The victim keeps its output tokens and recomputes prompt +
            outputs; otherwise it restarts from its prompt alone.
    """

    victim: str = "newest"
    requeue: str = "front"
    keep_outputs: Ref = True


@attrs.frozen
class BoundScheduler:
    """A scheduler spec bound to concrete parameter values and validated.

    This is what the replay implementations compile; it is hashable, so compiled
    replayers are cached per bound scheduler. Field meanings are those of the
    blocks. Made by :meth:`SchedulerSpec.bind` or
    :func:`~bearsdk.schedulers.bind_scheduler`.
    """

    name: str
    token_budget: int
    max_seqs: int
    max_model_len: int
    budget_count: str
    stages: tuple[str, ...]
    exclusive: bool
    admit_after_preemption: bool
    async_scheduling: bool
    chunked_prefill: bool
    chunk_cap: int
    cap_exempt_when_alone: bool
    on_blocked: str
    reserve_full_sequence: bool
    block_size: int
    num_blocks: int
    reserved_blocks: int
    allocate: str
    watermark: float
    watermark_applies: str
    decode_needs_free_block: bool
    victim: str
    requeue: str
    keep_outputs: bool
    prefix_caching: bool = False
    params: tuple[tuple[str, ParamValue], ...] = ()

    @property
    def watermark_blocks(self) -> int:
        """Blocks the watermark keeps free, given the pool size (``int(wm * blocks)``)."""
        return int(self.watermark * self.num_blocks) if self.num_blocks > 0 else 0

    def with_kv(self, block_size: int, num_blocks: int) -> BoundScheduler:
        """Return this bound scheduler with the KV geometry an engine reported.

        Raises:
            SpecError: A value outside the physical bounds.
        """
        if block_size == self.block_size and num_blocks == self.num_blocks:
            return self
        for field, v, lo, hi in (
            ("kv.block_size", block_size, 1, MAX_BLOCK_SIZE),
            ("kv.num_blocks", num_blocks, 0, MAX_NUM_BLOCKS),
        ):
            if type(v) is not int or not lo <= v <= hi:
                raise SpecError(
                    self.name, field, f"must be in [{lo}, {hi}] (got {short_repr(v)})", v
                )
        return attrs.evolve(self, block_size=block_size, num_blocks=num_blocks)

    def param(self, name: str) -> ParamValue:
        """Return the bound value of a parameter.

        Raises:
            KeyError: The spec has no such parameter.
        """
        return dict(self.params)[name]


_BLOCK_TYPES: Final[dict[str, type]] = {
    "budget": BudgetBlock,
    "batch": BatchBlock,
    "prefill": PrefillBlock,
    "admission": AdmissionBlock,
    "kv": KVBlock,
    "preemption": PreemptionBlock,
}


@attrs.frozen
class SchedulerSpec:
    """An engine's scheduling policy as data (bind it with :meth:`bind`).

    Attributes:
        name: Registry name (``"vllm-v1"``).
        description: One line for ``bearsdk schedulers``.
        params: Engine flags and their defaults.
        budget: See :class:`BudgetBlock`.
        batch: See :class:`BatchBlock`.
        prefill: See :class:`PrefillBlock`.
        admission: See :class:`AdmissionBlock`.
        kv: See :class:`KVBlock`.
        preemption: See :class:`PreemptionBlock`.
        source: Where the spec was loaded from, for error messages.
    """

    name: str
    description: str
    params: Mapping[str, ParamValue]
    budget: BudgetBlock
    batch: BatchBlock
    prefill: PrefillBlock = PrefillBlock()
    admission: AdmissionBlock = AdmissionBlock()
    kv: KVBlock = KVBlock(block_size=16)
    preemption: PreemptionBlock = PreemptionBlock()
    source: str = attrs.field(default="", eq=False)

    def __attrs_post_init__(self) -> None:
        # Validate the defaults once, so a broken spec fails at registration,
        # not at the first replay. A parameter no block uses is a typo (its
        # intended reference then fails too; naming the unused one is clearer).
        refs = self._references()
        for key in self.params:
            if key not in refs:
                undeclared = refs - set(self.params)
                raise SpecError(
                    self.name,
                    f"params.{key}",
                    f"is not used by any block{_did_you_mean(key, undeclared)}",
                    self.params[key],
                )
        self.bind()

    def _references(self) -> set[str]:
        out = set()
        for section in _BLOCK_TYPES:
            block = getattr(self, section)
            for f in attrs.fields(type(block)):
                v = getattr(block, f.name)
                if isinstance(v, str) and v.startswith("$"):
                    out.add(v[1:])
        return out

    def bind(self, overrides: Mapping[str, object] | None = None) -> BoundScheduler:
        """Resolve parameter references and validate into a :class:`BoundScheduler`.

        Args:
            overrides: Parameter values replacing the defaults, by engine flag name.
                Values may be strings (from a command line) and are parsed to the
                default's type.

        Returns:
            The bound, validated scheduler.

        Raises:
            SpecError: Unknown parameter, wrong type, or a value out of range.
        """
        values = dict(self.params)
        for key, raw in (overrides or {}).items():
            if key not in self.params:
                known = ", ".join(sorted(self.params)) or "none"
                hint = _did_you_mean(key, self.params) if isinstance(key, str) else ""
                raise SpecError(
                    self.name,
                    key if isinstance(key, str) else short_repr(key),
                    f"is not a parameter of this scheduler{hint} (known: {known})",
                    raw,
                )
            values[key] = _coerce(self.name, key, raw, self.params[key])
        return _Binder(self, values).bound()


class _Binder:
    def __init__(self, spec: SchedulerSpec, values: dict[str, ParamValue]) -> None:
        self.spec = spec
        self.values = values

    def err(self, label: str, message: str, value: object) -> SpecError:
        return SpecError(self.spec.name, label, message, value)

    def get(self, block: str, field: str, ref: Ref) -> tuple[ParamValue, str]:
        """Return (value, label): label names the param when ref points at one."""
        if isinstance(ref, str):
            if not ref.startswith("$"):
                raise self.err(
                    f"{block}.{field}",
                    f"must be a literal or a '$param' reference (got {short_repr(ref)})",
                    ref,
                )
            name = ref[1:]
            if name not in self.values:
                raise self.err(
                    f"{block}.{field}",
                    f"refers to unknown parameter {short_repr(name)}"
                    f"{_did_you_mean(name, self.values)}",
                    ref,
                )
            return self.values[name], name
        return ref, f"{block}.{field}"

    def int_(self, block: str, field: str, ref: Ref, lo: int, hi: int) -> int:
        v, label = self.get(block, field, ref)
        if type(v) is not int:
            raise self.err(label, f"must be an integer (got {short_repr(v)})", v)
        if v < lo:
            raise self.err(label, f"must be {'> 0' if lo == 1 else f'>= {lo}'} (got {v})", v)
        if v > hi:
            raise self.err(label, f"must be <= {hi} (got {short_repr(v)})", v)
        return v

    def bool_(self, block: str, field: str, ref: Ref) -> bool:
        v, label = self.get(block, field, ref)
        if type(v) is not bool:
            raise self.err(label, f"must be true or false (got {short_repr(v)})", v)
        return v

    def frac(self, block: str, field: str, ref: Ref) -> float:
        v, label = self.get(block, field, ref)
        if type(v) not in (int, float) or not (0.0 <= float(v) < 1.0) or math.isnan(float(v)):
            raise self.err(label, f"must be a fraction in [0, 1) (got {short_repr(v)})", v)
        return float(v)

    def choice(self, block: str, field: str, v: str, allowed: tuple[str, ...]) -> str:
        if v not in allowed:
            opts = ", ".join(repr(a) for a in allowed)
            raise self.err(f"{block}.{field}", f"must be one of {opts} (got {short_repr(v)})", v)
        return v

    def bound(self) -> BoundScheduler:
        s = self.spec
        b, ba, pf, ad, kv, pr = s.budget, s.batch, s.prefill, s.admission, s.kv, s.preemption
        stages = tuple(ba.stages)
        if not stages:
            raise self.err("batch.stages", "must list at least one stage (got [])", list(stages))
        for st in stages:
            self.choice("batch", "stages", st, STAGES)
        if len(set(stages)) != len(stages):
            raise self.err(
                "batch.stages",
                f"must not repeat a stage (got {_stages_repr(stages)})",
                list(stages),
            )
        if "waiting" not in stages:
            raise self.err(
                "batch.stages", f"must include 'waiting' (got {_stages_repr(stages)})", list(stages)
            )
        has_running = "running" in stages
        has_split = "decodes" in stages or "prefills" in stages
        if has_running and has_split:
            raise self.err(
                "batch.stages",
                f"'running' already covers 'decodes' and 'prefills' (got {_stages_repr(stages)})",
                list(stages),
            )
        if has_split and not ("decodes" in stages and "prefills" in stages):
            raise self.err(
                "batch.stages",
                f"'decodes' and 'prefills' go together (got {_stages_repr(stages)})",
                list(stages),
            )
        if has_split and stages.index("prefills") != stages.index("decodes") + 1:
            raise self.err(
                "batch.stages",
                f"'prefills' must directly follow 'decodes' (got {_stages_repr(stages)})",
                list(stages),
            )
        if not has_running and not has_split:
            raise self.err(
                "batch.stages",
                f"must schedule running requests (got {_stages_repr(stages)})",
                list(stages),
            )
        token_budget = self.int_("budget", "tokens", b.tokens, 1, MAX_TOKEN_BUDGET)
        max_seqs = self.int_("budget", "seqs", b.seqs, 1, MAX_SEQS)
        mml = self.int_("budget", "max_model_len", b.max_model_len, 0, MAX_MODEL_LEN)
        if max_seqs > token_budget:
            # Decodes take one token each; every engine modelled here requires this.
            _, slabel = self.get("budget", "seqs", b.seqs)
            _, tlabel = self.get("budget", "tokens", b.tokens)
            raise self.err(slabel, f"must be <= {tlabel} {token_budget} (got {max_seqs})", max_seqs)
        count = self.choice("budget", "count", b.count, BUDGET_COUNTS)
        chunked = self.bool_("prefill", "chunked", pf.chunked)
        chunk_cap = self.int_("prefill", "chunk_cap", pf.chunk_cap, 0, MAX_REQUEST_TOKENS)
        allocate = self.choice("kv", "allocate", kv.allocate, ALLOCATE)
        if allocate == "max-length" and mml == 0:
            _, label = self.get("budget", "max_model_len", b.max_model_len)
            raise self.err(label, "must be > 0 when kv.allocate is 'max-length' (got 0)", 0)
        if not chunked and mml > 0 and token_budget < mml:
            _, tlabel = self.get("budget", "tokens", b.tokens)
            raise self.err(
                tlabel,
                f"must be >= max_model_len {mml} when chunked prefill is off (got {token_budget})",
                token_budget,
            )
        if chunk_cap and mml and chunk_cap > mml:
            _, clabel = self.get("prefill", "chunk_cap", pf.chunk_cap)
            raise self.err(clabel, f"must be <= max_model_len {mml} (got {chunk_cap})", chunk_cap)
        exclusive = self.bool_("batch", "exclusive", ba.exclusive)
        async_sched = self.bool_("batch", "async_scheduling", ba.async_scheduling)
        if exclusive and async_sched:
            _, alabel = self.get("batch", "async_scheduling", ba.async_scheduling)
            raise self.err(alabel, "must be false when batch.exclusive is true (got true)", True)
        block_size = self.int_("kv", "block_size", kv.block_size, 1, MAX_BLOCK_SIZE)
        num_blocks = self.int_("kv", "num_blocks", kv.num_blocks, 0, MAX_NUM_BLOCKS)
        reserved = self.int_("kv", "reserved_blocks", kv.reserved_blocks, 0, MAX_NUM_BLOCKS)
        if num_blocks and reserved >= num_blocks:
            _, rlabel = self.get("kv", "reserved_blocks", kv.reserved_blocks)
            raise self.err(rlabel, f"must be < num_blocks {num_blocks} (got {reserved})", reserved)
        prefix_caching = self.bool_("kv", "prefix_caching", kv.prefix_caching)
        if prefix_caching and allocate != "on-demand":
            _, plabel = self.get("kv", "prefix_caching", kv.prefix_caching)
            raise self.err(
                plabel,
                f"must be false unless kv.allocate is 'on-demand' (got true with {allocate!r})",
                True,
            )
        return BoundScheduler(
            name=s.name,
            token_budget=token_budget,
            max_seqs=max_seqs,
            max_model_len=mml,
            budget_count=count,
            stages=stages,
            exclusive=exclusive,
            admit_after_preemption=self.bool_(
                "batch", "admit_after_preemption", ba.admit_after_preemption
            ),
            async_scheduling=async_sched,
            chunked_prefill=chunked,
            chunk_cap=chunk_cap,
            cap_exempt_when_alone=self.bool_(
                "prefill", "cap_exempt_when_alone", pf.cap_exempt_when_alone
            ),
            on_blocked=self.choice("admission", "on_blocked", ad.on_blocked, ON_BLOCKED),
            reserve_full_sequence=self.bool_(
                "admission", "reserve_full_sequence", ad.reserve_full_sequence
            ),
            block_size=block_size,
            num_blocks=num_blocks,
            reserved_blocks=reserved,
            allocate=allocate,
            watermark=self.frac("kv", "watermark", kv.watermark),
            watermark_applies=self.choice(
                "kv", "watermark_applies", kv.watermark_applies, WATERMARK_APPLIES
            ),
            decode_needs_free_block=self.bool_(
                "kv", "decode_needs_free_block", kv.decode_needs_free_block
            ),
            victim=self.choice("preemption", "victim", pr.victim, VICTIMS),
            requeue=self.choice("preemption", "requeue", pr.requeue, REQUEUE),
            keep_outputs=self.bool_("preemption", "keep_outputs", pr.keep_outputs),
            prefix_caching=prefix_caching,
            params=tuple(sorted(self.values.items())),
        )


def _coerce(name: str, key: str, raw: object, default: ParamValue) -> ParamValue:
    """Parse an override to the type of the parameter's default."""
    want = type(default)
    if isinstance(raw, str):
        text = raw.strip()
        try:
            if want is bool:
                low = text.lower()
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError(text)
            if want is int:
                return int(text)
            return float(text)
        except ValueError:
            raise SpecError(
                name, key, f"must be {_type_word(want)} (got {short_repr(raw)})", raw
            ) from None
    if want is bool:
        if type(raw) is not bool:
            raise SpecError(name, key, f"must be true or false (got {short_repr(raw)})", raw)
        return raw
    if want is int:
        if type(raw) is not int:
            raise SpecError(name, key, f"must be an integer (got {short_repr(raw)})", raw)
        return raw
    if type(raw) not in (int, float):
        raise SpecError(name, key, f"must be a number (got {short_repr(raw)})", raw)
    return float(raw)  # type: ignore[arg-type]


def _type_word(t: type) -> str:
    return {bool: "true or false", int: "an integer"}.get(t, "a number")


def _strict_block(name: str, section: str, raw: object, cls: type) -> Any:
    if not isinstance(raw, Mapping):
        raise SpecError(name, section, f"must be a table (got {short_repr(raw)})", raw)
    fields = {f.name for f in attrs.fields(cls)}
    for key in raw:
        if key not in fields:
            hint = _did_you_mean(key, fields) if isinstance(key, str) else ""
            raise SpecError(
                name,
                f"{section}.{key if isinstance(key, str) else short_repr(key)}",
                f"is not a known field{hint} (known: {', '.join(sorted(fields))})",
                raw[key],
            )
    kwargs: dict[str, Any] = {}
    for f in attrs.fields(cls):
        if f.name not in raw:
            if f.default is attrs.NOTHING:
                raise SpecError(name, f"{section}.{f.name}", "is required")
            continue
        v = raw[f.name]
        if f.name == "stages":
            if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
                raise SpecError(
                    name,
                    f"{section}.stages",
                    f"must be a list of stage names (got {short_repr(v)})",
                    v,
                )
            v = tuple(v)
        elif isinstance(v, Mapping | list):
            raise SpecError(
                name,
                f"{section}.{f.name}",
                f"must be a scalar or '$param' (got {short_repr(v)})",
                v,
            )
        kwargs[f.name] = v
    return cls(**kwargs)


_TOP_KEYS: Final = frozenset({"schema", "name", "description", "params", *_BLOCK_TYPES})


def spec_from_dict(doc: Mapping[str, Any], *, source: str = "") -> SchedulerSpec:
    """Decode a spec from its dict form (a parsed TOML document), strictly.

    Args:
        doc: The document.
        source: Where it came from, kept for messages.

    Returns:
        The validated spec.

    Raises:
        SpecError: Unknown keys, missing blocks, bad values.
    """
    if not isinstance(doc, Mapping):
        raise SpecError("?", "", f"must be a table (got {short_repr(doc)})", doc)
    name = doc.get("name")
    if not isinstance(name, str) or not name.strip():
        shown = name if isinstance(name, str) else short_repr(name)
        raise SpecError(shown, "name", f"must be a non-empty string (got {short_repr(name)})", name)
    schema = doc.get("schema", SPEC_SCHEMA)
    if type(schema) is not str or schema != SPEC_SCHEMA:
        raise SpecError(
            name, "schema", f"must be {SPEC_SCHEMA!r} (got {short_repr(schema)})", schema
        )
    for key in doc:
        if key not in _TOP_KEYS:
            shown = key if isinstance(key, str) else short_repr(key)
            hint = _did_you_mean(key, _TOP_KEYS) if isinstance(key, str) else ""
            raise SpecError(
                name,
                shown,
                f"is not a known section{hint} (known: {', '.join(sorted(_TOP_KEYS))})",
                doc[key],
            )
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise SpecError(name, "description", f"must be a string (got {short_repr(desc)})", desc)
    params_raw = doc.get("params", {})
    if not isinstance(params_raw, Mapping):
        raise SpecError(
            name, "params", f"must be a table (got {short_repr(params_raw)})", params_raw
        )
    params: dict[str, ParamValue] = {}
    for key, v in params_raw.items():
        shown = key if isinstance(key, str) else short_repr(key)
        if not isinstance(key, str) or type(v) not in (int, float, bool):
            raise SpecError(
                name,
                f"params.{shown}",
                f"must be an integer, number or boolean (got {short_repr(v)})",
                v,
            )
        params[key] = v
    blocks: dict[str, Any] = {}
    for section, cls in _BLOCK_TYPES.items():
        if section in doc:
            blocks[section] = _strict_block(name, section, doc[section], cls)
        elif section in ("budget", "batch", "kv"):
            raise SpecError(name, section, "section is required")
    return SchedulerSpec(name=name, description=desc, params=params, source=source, **blocks)


def load_spec(path: str | Path) -> SchedulerSpec:
    """Load a spec from a TOML file.

    Args:
        path: The file.

    Returns:
        The validated spec.

    Raises:
        SpecError: The file is not valid TOML or the spec is invalid.
        OSError: The file cannot be read.
    """
    p = Path(path)
    data = p.read_bytes()
    try:
        # Editors on Windows write a BOM; it is no part of the document.
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise SpecError(
            p.stem,
            str(p),
            f"is not UTF-8 text (byte {exc.start} is {data[exc.start : exc.start + 1]!r})",
            None,
        ) from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(p.stem, str(p), f"is not valid TOML ({exc})", None) from None
    except RecursionError:
        raise SpecError(p.stem, str(p), "nests arrays or tables too deeply", None) from None
    return spec_from_dict(doc, source=str(p))


Policy = BoundScheduler
"""The old name of :class:`BoundScheduler`, kept as an alias."""

"""The ``bear.snapshot/1`` workload snapshot: model, strict decoder, compact form.

An engine publishes a snapshot of its resident requests after every step
(``docs/contracts.md`` section 1). The router keeps the latest valid one per
instance and replays batch formation from it. This module turns the wire form
(JSON) into a :class:`Snapshot`, validating every field; a document that fails
validation raises :class:`~bearsdk.errors.SnapshotError` naming the field and the
value and never yields a partial snapshot.

The replay loop does not read Python objects: :attr:`Snapshot.table` is an
``int64`` array with one row per request, in scheduling order, whose columns are
named by the ``COL_*`` constants below. It is built once, at decode time.

Two decoders honour one contract: the compiled scanner ``bearsdk._snapshot_c``
(built from ``cext/_snapshot_c.pyx``) decodes the bytes of a valid snapshot in
one pass, and defers every document it does not fully understand (including
every invalid one) to the pure-Python reference below, which therefore produces
every error message. ``BEARSDK_NO_EXTENSIONS=1`` selects the reference alone;
:data:`DECODER` says which one :func:`decode_snapshot` uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import orjson

from bearsdk import _twins
from bearsdk.errors import SnapshotError, short_repr
from bearsdk.prefix_cache import REQUEST_FIELDS as _CACHE_FIELDS
from bearsdk.prefix_cache import PrefixCacheState, prefix_cache_from_dict

__all__ = [
    "COLUMNS",
    "DECODER",
    "MAX_BLOCK_SIZE",
    "MAX_ID_CHARS",
    "MAX_INFLIGHT_S",
    "MAX_NUM_BLOCKS",
    "MAX_PLACEHOLDERS",
    "MAX_REQUESTS",
    "MAX_REQUEST_TOKENS",
    "MAX_SNAPSHOT_BYTES",
    "MAX_TOTAL_TOKENS",
    "SCHEMA",
    "KVState",
    "RequestState",
    "Snapshot",
    "decode_snapshot",
    "decoders",
    "snapshot_from_dict",
]

SCHEMA: Final = "bear.snapshot/1"

# Columns of Snapshot.table. The Cython replay reads the same indices; a test
# pins them so the two cannot drift apart.
COL_STATE: Final = 0  # 0 running, 1 waiting
COL_PROMPT: Final = 1
COL_COMPUTED: Final = 2
COL_OUTPUT: Final = 3
COL_MAX_TOKENS: Final = 4  # -1: no cap known
COL_OUTPUT_LEN: Final = 5  # -1: unknown, to be predicted
COL_PLACEHOLDERS: Final = 6
COLUMNS: Final = (
    "state",
    "prompt_tokens",
    "computed_tokens",
    "output_tokens",
    "max_tokens",
    "output_len",
    "placeholders",
)
NCOLS: Final = len(COLUMNS)
STATE_RUNNING: Final = 0
STATE_WAITING: Final = 1
# Every integer must fit the int64 table (orjson yields integers up to 2**64 - 1).
INT_MAX: Final = 2**63 - 1

# Physical bounds, defined here only (docs/snapshots.md, "Bounds", says why
# each): the compiled scanner is handed the same values at import, and the
# scheduler specs validate against them too. They keep every sum the replays
# form far inside int32, and any accepted snapshot's replay cheap.
MAX_BLOCK_SIZE: Final = 4096
"""Tokens per KV block (vLLM uses 1 to a few hundred; hybrid models ~1-2k)."""
MAX_NUM_BLOCKS: Final = 2**24
"""KV blocks in one engine's pool."""
MAX_REQUEST_TOKENS: Final = 2**24
"""Tokens of one request: its prompt plus its output (any context window)."""
MAX_PLACEHOLDERS: Final = 64
"""Output tokens of one request scheduled in the batch in flight (1 + speculative)."""
MAX_REQUESTS: Final = 4096
"""Resident requests (running and waiting) in one snapshot."""
MAX_TOTAL_TOKENS: Final = 2**26
"""Prompt plus output tokens of all resident requests together."""
MAX_ID_CHARS: Final = 1024
"""Characters of a request id, an instance name or an epoch."""
MAX_INFLIGHT_S: Final = 3600.0
"""Seconds left of the batch in flight."""
MAX_SNAPSHOT_BYTES: Final = 2 << 20
"""Bytes of one snapshot document. The largest snapshot the other bounds allow
in practice (4,096 requests with ids of a few dozen characters) is ~0.5 MB;
parsing 2 MiB costs a few ms, where the 16 MiB the transports used to take cost
~0.3 s to reject: the cap keeps every rejection fast."""

_STATES: Final = {"running": STATE_RUNNING, "waiting": STATE_WAITING}
_REQUEST_REQUIRED: Final = ("id", "state", "prompt_tokens", "computed_tokens", "output_tokens")
_REQUEST_OPTIONAL: Final = ("max_tokens", "output_len", "placeholders")
_REQUEST_FIELDS: Final = frozenset(_REQUEST_REQUIRED + _REQUEST_OPTIONAL + _CACHE_FIELDS)
# A tuple, not a set: which missing field an error names must not depend on
# the hash seed.
_KV_FIELDS: Final = ("block_size", "num_blocks", "free_blocks")


@attrs.frozen
class KVState:
    """KV-cache geometry and occupancy as the engine counts it.

    Attributes:
        block_size: Tokens per KV block.
        num_blocks: Blocks in the engine's pool.
        free_blocks: Blocks free when the snapshot was taken.
    """

    block_size: int
    num_blocks: int
    free_blocks: int


@attrs.frozen
class RequestState:
    """One resident request, as a row of a snapshot.

    Attributes:
        id: Engine request id.
        state: ``"running"`` (admitted, holds KV blocks) or ``"waiting"``.
        prompt_tokens: Prompt length in tokens.
        computed_tokens: Tokens whose KV is computed (vLLM's ``num_computed_tokens``).
        output_tokens: Output tokens produced so far.
        max_tokens: The request's cap on output tokens, when known.
        output_len: The request's total output length, when known.
        placeholders: Output tokens scheduled in the batch still in flight (async).
    """

    id: str
    state: str
    prompt_tokens: int
    computed_tokens: int
    output_tokens: int
    max_tokens: int | None = None
    output_len: int | None = None
    placeholders: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the wire form of this request (optional fields only when set)."""
        d: dict[str, Any] = {
            "id": self.id,
            "state": self.state,
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "output_tokens": self.output_tokens,
        }
        if self.max_tokens is not None:
            d["max_tokens"] = self.max_tokens
        if self.output_len is not None:
            d["output_len"] = self.output_len
        if self.placeholders:
            d["placeholders"] = self.placeholders
        return d


def _freeze_table(table: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    table = np.ascontiguousarray(table, dtype=np.int64)
    table.setflags(write=False)
    return table


@attrs.frozen(eq=False)
class Snapshot:
    """A validated ``bear.snapshot/1``.

    Build one with :func:`decode_snapshot` (bytes or str) or
    :func:`snapshot_from_dict`; both validate. ``Snapshot(...)`` itself trusts
    its arguments.

    Attributes:
        instance: Name of the engine instance.
        seq: Engine step counter (strictly increasing per instance).
        time: Capture time, seconds since the Unix epoch (engine clock).
        kv: KV-cache state, when the engine reports it.
        ids: Request ids, in scheduling order (running first, then waiting).
        table: Read-only ``int64`` array, one row per request, columns ``COLUMNS``.
        inflight_remaining_s: Time until the batch executing at capture completes.
        epoch: Identifies one run of the engine process (``docs/protocol.md``): a
            new epoch means the engine restarted and its ``seq`` started over.
        prefix_cache: The blocks and who holds them, from an engine that caches
            prefixes (:mod:`bearsdk.prefix_cache`); ``None`` for a plain snapshot.
    """

    instance: str
    seq: int
    time: float
    kv: KVState | None
    ids: tuple[str, ...]
    table: npt.NDArray[np.int64] = attrs.field(converter=_freeze_table)
    inflight_remaining_s: float | None = None
    epoch: str | None = None
    prefix_cache: PrefixCacheState | None = None

    @property
    def num_running(self) -> int:
        """Number of running (admitted) requests."""
        return int(np.count_nonzero(self.table[:, COL_STATE] == STATE_RUNNING))

    @property
    def num_waiting(self) -> int:
        """Number of waiting (queued or preempted) requests."""
        return len(self.ids) - self.num_running

    def __len__(self) -> int:
        return len(self.ids)

    def requests(self) -> list[RequestState]:
        """Return the requests as :class:`RequestState` values, in scheduling order."""
        out = []
        for rid, row in zip(self.ids, self.table.tolist(), strict=True):
            out.append(
                RequestState(
                    id=rid,
                    state="running" if row[COL_STATE] == STATE_RUNNING else "waiting",
                    prompt_tokens=row[COL_PROMPT],
                    computed_tokens=row[COL_COMPUTED],
                    output_tokens=row[COL_OUTPUT],
                    max_tokens=None if row[COL_MAX_TOKENS] < 0 else row[COL_MAX_TOKENS],
                    output_len=None if row[COL_OUTPUT_LEN] < 0 else row[COL_OUTPUT_LEN],
                    placeholders=row[COL_PLACEHOLDERS],
                )
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return the wire form (round-trips through :func:`snapshot_from_dict`)."""
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "instance": self.instance,
            "seq": self.seq,
            "time": self.time,
        }
        if self.kv is not None:
            d["kv"] = attrs.asdict(self.kv)
        d["requests"] = [r.to_dict() for r in self.requests()]
        pc = self.prefix_cache
        if pc is not None:
            d["kv"]["prefix_cache"] = pc.to_dict()
            for i, r in enumerate(d["requests"]):
                r.update(pc.request_fields(i))
        if self.inflight_remaining_s is not None:
            d["inflight"] = {"remaining_s": self.inflight_remaining_s}
        if self.epoch is not None:
            d["epoch"] = self.epoch
        return d

    def to_json(self) -> bytes:
        """Return the wire form as JSON bytes."""
        return orjson.dumps(self.to_dict())

    @classmethod
    def build(
        cls,
        requests: Iterable[RequestState | Mapping[str, Any]],
        *,
        instance: str = "local",
        seq: int = 0,
        time: float = 0.0,
        kv: KVState | None = None,
        inflight_remaining_s: float | None = None,
        epoch: str | None = None,
    ) -> Snapshot:
        """Build and validate a snapshot from request values or dicts.

        Args:
            requests: Resident requests in scheduling order.
            instance: Instance name.
            seq: Step counter.
            time: Capture time (Unix seconds).
            kv: KV-cache state, if known.
            inflight_remaining_s: Remaining time of the batch in flight, if any.
            epoch: The engine run's identifier, if it publishes one.

        Returns:
            The validated snapshot.

        Raises:
            SnapshotError: A field is missing or out of range.
        """
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "instance": instance,
            "seq": seq,
            "time": time,
            "requests": [r.to_dict() if isinstance(r, RequestState) else dict(r) for r in requests],
        }
        if kv is not None:
            doc["kv"] = attrs.asdict(kv)
        if inflight_remaining_s is not None:
            doc["inflight"] = {"remaining_s": inflight_remaining_s}
        if epoch is not None:
            doc["epoch"] = epoch
        return snapshot_from_dict(doc)


def _decode_py(data: bytes | bytearray | memoryview | str) -> Snapshot:
    """The reference decoder: orjson, then :func:`snapshot_from_dict`."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SnapshotError("", f"is not valid JSON ({exc})") from None
    return snapshot_from_dict(doc)


def _int(v: object, field: str, lo: int, hi: int = INT_MAX) -> int:
    # bool is an int subclass: reject it explicitly, a flag is never a count.
    if type(v) is not int or v < lo or v > hi:
        rng = f"in [{lo}, 2**63 - 1]" if hi == INT_MAX else f"in [{lo}, {hi}]"
        raise SnapshotError(field, f"must be an integer {rng} (got {short_repr(v)})", v)
    return v


def _name(v: object, field: str) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        raise SnapshotError(
            field,
            f"must be a non-empty string of at most {MAX_ID_CHARS} characters "
            f"(got {short_repr(v)})",
            v,
        )
    return v


def _kv(v: object) -> KVState:
    if not isinstance(v, Mapping):
        raise SnapshotError("kv", f"must be an object (got {short_repr(v)})", v)
    for key in v:
        if key not in _KV_FIELDS and key != "prefix_cache":
            raise SnapshotError(
                f"kv.{_key(key)}", f"is not a known field (got {short_repr(v[key])})", v[key]
            )
    for key in _KV_FIELDS:
        if key not in v:
            raise SnapshotError(f"kv.{key}", "is required")
    bs = _int(v["block_size"], "kv.block_size", 1, MAX_BLOCK_SIZE)
    nb = _int(v["num_blocks"], "kv.num_blocks", 1, MAX_NUM_BLOCKS)
    fb = _int(v["free_blocks"], "kv.free_blocks", 0, nb)
    return KVState(bs, nb, fb)


def _key(key: object) -> str:
    return key if isinstance(key, str) else short_repr(key)


def _row(i: int, r: object) -> tuple[str, list[int]]:
    where = f"requests[{i}]"
    if not isinstance(r, Mapping):
        raise SnapshotError(where, f"must be an object (got {short_repr(r)})", r)
    for key in r:
        if key not in _REQUEST_FIELDS:
            raise SnapshotError(
                f"{where}.{_key(key)}",
                f"is not a known request field (got {short_repr(r[key])})",
                r[key],
            )
    for key in _REQUEST_REQUIRED:
        if key not in r:
            raise SnapshotError(f"{where}.{key}", "is required")
    rid = _name(r["id"], f"{where}.id")
    state = _STATES.get(r["state"]) if isinstance(r["state"], str) else None
    if state is None:
        raise SnapshotError(
            f"{where}.state",
            f"must be 'running' or 'waiting' (got {short_repr(r['state'])})",
            r["state"],
        )
    prompt = _int(r["prompt_tokens"], f"{where}.prompt_tokens", 1, MAX_REQUEST_TOKENS)
    output = _int(r["output_tokens"], f"{where}.output_tokens", 0, MAX_REQUEST_TOKENS)
    if prompt + output > MAX_REQUEST_TOKENS:
        raise SnapshotError(
            f"{where}.output_tokens",
            f"must be <= {MAX_REQUEST_TOKENS} - prompt_tokens {prompt} (got {output})",
            output,
        )
    ph = _int(r.get("placeholders", 0), f"{where}.placeholders", 0, MAX_PLACEHOLDERS)
    if state == STATE_WAITING:
        computed = _int(r["computed_tokens"], f"{where}.computed_tokens", 0, 0)
        if ph:
            raise SnapshotError(
                f"{where}.placeholders", f"must be 0 for a waiting request (got {ph})", ph
            )
    else:
        computed = _int(r["computed_tokens"], f"{where}.computed_tokens", 0, prompt + output + ph)
    max_tokens = r.get("max_tokens")
    mt = (
        -1 if max_tokens is None else _int(max_tokens, f"{where}.max_tokens", 1, MAX_REQUEST_TOKENS)
    )
    output_len = r.get("output_len")
    ol = -1
    if output_len is not None:
        # A resident request still has at least one token to produce.
        ol = _int(output_len, f"{where}.output_len", max(1, output + 1), MAX_REQUEST_TOKENS)
        if mt >= 0 and ol > mt:
            raise SnapshotError(
                f"{where}.output_len", f"must be <= max_tokens {mt} (got {ol})", output_len
            )
    if mt >= 0 and output >= mt:
        raise SnapshotError(
            f"{where}.max_tokens", f"must be > output_tokens {output} (got {mt})", max_tokens
        )
    return rid, [state, prompt, computed, output, mt, ol, ph]


def snapshot_from_dict(doc: object) -> Snapshot:
    """Validate a decoded ``bear.snapshot/1`` document and build a :class:`Snapshot`.

    Unknown top-level keys are ignored (forward compatibility); unknown or
    malformed request fields are errors.

    Args:
        doc: The decoded JSON object.

    Returns:
        The validated snapshot.

    Raises:
        SnapshotError: Wrong schema or a bad field.
    """
    if not isinstance(doc, Mapping):
        raise SnapshotError("", f"must be a JSON object (got {type(doc).__name__})", doc)
    schema = doc.get("schema")
    if type(schema) is not str or schema != SCHEMA:
        raise SnapshotError("schema", f"must be {SCHEMA!r} (got {short_repr(schema)})", schema)
    instance = _name(doc.get("instance"), "instance")
    seq = _int(doc.get("seq"), "seq", 0)
    t = doc.get("time")
    if not (
        (type(t) is float and math.isfinite(t))
        or (type(t) is int and t.bit_length() < 1024)  # a larger int overflows float()
    ):
        raise SnapshotError("time", f"must be a finite number (got {short_repr(t)})", t)
    capture = float(t)
    kv = _kv(doc["kv"]) if doc.get("kv") is not None else None
    inflight = doc.get("inflight")
    remaining: float | None = None
    if inflight is not None:
        if not isinstance(inflight, Mapping) or "remaining_s" not in inflight:
            raise SnapshotError(
                "inflight", f"must be an object with remaining_s (got {short_repr(inflight)})"
            )
        rs = inflight["remaining_s"]
        if type(rs) not in (int, float) or not (0.0 <= rs <= MAX_INFLIGHT_S):
            raise SnapshotError(
                "inflight.remaining_s",
                f"must be a number in [0, {MAX_INFLIGHT_S:g}] (got {short_repr(rs)})",
                rs,
            )
        remaining = float(rs)
    epoch = doc.get("epoch")
    if epoch is not None:
        epoch = _name(epoch, "epoch")
    reqs = doc.get("requests")
    if not isinstance(reqs, Sequence) or isinstance(reqs, str | bytes | bytearray):
        raise SnapshotError("requests", f"must be a list (got {short_repr(reqs)})", reqs)
    if len(reqs) > MAX_REQUESTS:
        raise SnapshotError(
            "requests", f"must hold at most {MAX_REQUESTS} requests (got {len(reqs)})", len(reqs)
        )
    ids: list[str] = []
    rows: list[list[int]] = []
    seen: set[str] = set()
    seen_waiting = False
    total = 0
    for i, r in enumerate(reqs):
        rid, row = _row(i, r)
        total += row[COL_PROMPT] + row[COL_OUTPUT]
        if total > MAX_TOTAL_TOKENS:
            raise SnapshotError(
                f"requests[{i}].prompt_tokens",
                f"+ output_tokens take the snapshot's requests to {total} tokens, over the "
                f"{MAX_TOTAL_TOKENS} of all requests together (got {row[COL_PROMPT]})",
                row[COL_PROMPT],
            )
        if rid in seen:
            raise SnapshotError(f"requests[{i}].id", f"is a duplicate (got {short_repr(rid)})", rid)
        seen.add(rid)
        if row[COL_STATE] == STATE_WAITING:
            seen_waiting = True
        elif seen_waiting:
            raise SnapshotError(
                f"requests[{i}].state",
                "'running' after a waiting request: requests must be in scheduling order "
                "(running first, then waiting)",
                "running",
            )
        ids.append(rid)
        rows.append(row)
    table = np.array(rows, dtype=np.int64).reshape(len(rows), NCOLS)
    pc = _prefix_cache(doc["kv"] if kv is not None else None, kv, reqs, rows)
    if kv is not None and pc is None:
        held = sum(-(-row[COL_COMPUTED] // kv.block_size) for row in rows)
        if held > kv.num_blocks:
            raise SnapshotError(
                "kv.num_blocks",
                f"is smaller than the {held} blocks the running requests hold "
                f"(got {kv.num_blocks})",
                kv.num_blocks,
            )
    return Snapshot(
        instance=instance,
        seq=seq,
        time=capture,
        kv=kv,
        ids=tuple(ids),
        table=table,
        inflight_remaining_s=remaining,
        epoch=epoch,
        prefix_cache=pc,
    )


def _prefix_cache(
    raw_kv: Mapping[str, Any] | None,
    kv: KVState | None,
    reqs: Sequence[Any],
    rows: list[list[int]],
) -> PrefixCacheState | None:
    """The validated ``kv.prefix_cache`` (None without one); it checks held blocks exactly."""
    if kv is None or raw_kv is None or raw_kv.get("prefix_cache") is None:
        for i, r in enumerate(reqs):
            for key in _CACHE_FIELDS:
                if key in r:
                    raise SnapshotError(
                        f"requests[{i}].{key}", "needs kv.prefix_cache (got none)", r[key]
                    )
        return None
    raw = raw_kv["prefix_cache"]
    if _validate_pc is not None:
        pc = _validate_pc(raw, kv.block_size, kv.num_blocks, kv.free_blocks, reqs, rows)
        if pc is not None:
            return pc
    return prefix_cache_from_dict(
        raw,
        block_size=kv.block_size,
        num_blocks=kv.num_blocks,
        free_blocks=kv.free_blocks,
        requests=reqs,
        rows=rows,
    )


def _snapshot_from_parts(parts: tuple[Any, ...]) -> Snapshot:
    instance, seq, t, kv, ids, table, remaining, epoch = parts
    return Snapshot(
        instance=instance,
        seq=seq,
        time=t,
        kv=None if kv is None else KVState(*kv),
        ids=ids,
        table=table,
        inflight_remaining_s=remaining,
        epoch=epoch,
    )


_validate_pc: Callable[..., PrefixCacheState | None] | None = None
"""The compiled ``kv.prefix_cache`` validator (``bearsdk._prefix_cache_c``); like the
scanner it declines (None) whatever it does not fully understand, and the reference
:func:`~bearsdk.prefix_cache.prefix_cache_from_dict` decides."""
if _twins.compiled("bearsdk._prefix_cache_c") is not None:
    from bearsdk._prefix_cache_c import validate as _validate_pc

_scan: Callable[[object], tuple[Any, ...] | None] | None = None
if _twins.compiled("bearsdk._snapshot_c") is not None:
    from bearsdk._snapshot_c import _set_limits
    from bearsdk._snapshot_c import decode as _scan

    _set_limits(
        MAX_BLOCK_SIZE,
        MAX_NUM_BLOCKS,
        MAX_REQUEST_TOKENS,
        MAX_PLACEHOLDERS,
        MAX_REQUESTS,
        MAX_TOTAL_TOKENS,
        MAX_ID_CHARS,
        MAX_INFLIGHT_S,
    )


def _decode_c(data: bytes | bytearray | memoryview | str) -> Snapshot:
    """The compiled scanner, deferring to the reference for whatever it declines."""
    assert _scan is not None
    buf = data
    if isinstance(data, str):
        try:
            buf = data.encode()
        except UnicodeEncodeError:  # lone surrogates: the reference reports them
            return _decode_py(data)
    parts = _scan(buf)
    if parts is None:
        return _decode_py(data)
    return _snapshot_from_parts(parts)


DECODER: str = "python" if _scan is None else "cython"
"""``"cython"`` or ``"python"``: the decoder :func:`decode_snapshot` uses."""


def decoders() -> dict[str, Callable[[bytes | bytearray | memoryview | str], Snapshot]]:
    """Return every importable decoder by name (tests run against each)."""
    out: dict[str, Callable[[bytes | bytearray | memoryview | str], Snapshot]] = {
        "python": _decode_py
    }
    if _scan is not None:
        out["cython"] = _decode_c
    return out


def decode_snapshot(data: bytes | bytearray | memoryview | str) -> Snapshot:
    """Decode and validate a ``bear.snapshot/1`` JSON document.

    Args:
        data: The JSON text.

    Returns:
        The validated snapshot.

    Raises:
        SnapshotError: Malformed JSON, wrong schema, or a bad field; the message
            names the field and the value.
    """
    if _scan is not None:
        return _decode_c(data)
    return _decode_py(data)

"""vLLM's KV cache events on the wire (``--kv-events-config``), decoded strictly.

vLLM 0.33's ``ZmqEventPublisher`` sends one msgpack ``KVEventBatch`` per engine
step as the multipart message ``(topic, seq, payload)``: ``seq`` an 8-byte
big-endian counter, ``payload`` the array ``[ts, events, data_parallel_rank]``
(the rank left out when unset), each event a map tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (new full blocks, in chain order),
  ``parent_block_hash`` (the block before the first, ``None`` at a chain's
  start), ``token_ids`` (all their tokens), ``block_size``, ``lora_id``,
  ``medium``, ``lora_name`` (and, in later versions, more optional fields);
- ``BlockRemoved``: ``block_hashes`` evicted, ``medium``;
- ``AllBlocksCleared``: the prefix cache was reset.

A hash is vLLM's ``ExternalBlockHash``: bytes, or an int in older versions.
The structs below mirror ``vllm/distributed/kv_events.py`` field for field, so
that :func:`encode_batch` writes what vLLM writes (the emulator publishes with
it) and :func:`decode_batch` reads what vLLM sends. Payloads are untrusted:
every count is bounded and an event that cannot be what it claims is refused,
naming the field and the value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from bearsdk.errors import BearError, short_repr

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventError",
    "decode_batch",
    "encode_batch",
    "from_scheduler",
]

MAX_EVENTS: Final = 100_000
"""Events in one batch (a step frees or fills at most the pool's blocks)."""
MAX_BLOCKS_PER_EVENT: Final = 1 << 16
"""Blocks one event names (a 1M-token prompt in blocks of 16)."""
MAX_BLOCK_SIZE: Final = 4096
"""Tokens per block (the snapshot contract's bound)."""
MAX_HASH_BYTES: Final = 64
"""A block hash's length (vLLM's are 32 bytes, or 8 with a group id)."""

BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """New full blocks entered the prefix cache (vLLM's ``BlockStored``)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks were evicted from the prefix cache (vLLM's ``BlockRemoved``)."""

    block_hashes: list[BlockHash]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events (vLLM's ``KVEventBatch``)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class KVEventError(BearError, ValueError):
    """A KV event payload that is not one (the message names the field and value)."""


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int | None = None) -> bytes:
    """The msgpack payload vLLM's publisher sends for one step."""
    return _ENCODER.encode(KVEventBatch(ts, events, data_parallel_rank))


def _check_hash(h: object, where: str) -> None:
    if isinstance(h, bytes):
        if not 0 < len(h) <= MAX_HASH_BYTES:
            raise KVEventError(
                f"{where}: a block hash must be 1 to {MAX_HASH_BYTES} bytes (got {len(h)})"
            )
    elif not -(1 << 63) <= h < 1 << 64:  # type: ignore[operator]
        raise KVEventError(f"{where}: a block hash must fit in 64 bits (got {short_repr(h)})")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode and check one batch.

    Raises:
        KVEventError: Not a ``KVEventBatch``, or a count beyond its bound, or a
            ``BlockStored`` whose tokens are not its blocks' (the message says
            which event and field).
    """
    try:
        batch = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventError(f"KV event batch: {exc}") from None
    if len(batch.events) > MAX_EVENTS:
        raise KVEventError(
            f"KV event batch: events must be at most {MAX_EVENTS} (got {len(batch.events)})"
        )
    for i, e in enumerate(batch.events):
        where = f"events[{i}] ({type(e).__name__})"
        if isinstance(e, AllBlocksCleared):
            continue
        n = len(e.block_hashes)
        if n > MAX_BLOCKS_PER_EVENT:
            raise KVEventError(
                f"{where}.block_hashes: at most {MAX_BLOCKS_PER_EVENT} blocks (got {n})"
            )
        for h in e.block_hashes:
            _check_hash(h, f"{where}.block_hashes")
        if isinstance(e, BlockStored):
            if not 1 <= e.block_size <= MAX_BLOCK_SIZE:
                raise KVEventError(
                    f"{where}.block_size must be in [1, {MAX_BLOCK_SIZE}] "
                    f"(got {short_repr(e.block_size)})"
                )
            if len(e.token_ids) != n * e.block_size:
                raise KVEventError(
                    f"{where}.token_ids: {n} blocks of {e.block_size} need {n * e.block_size} "
                    f"tokens (got {len(e.token_ids)})"
                )
            if e.parent_block_hash is not None:
                _check_hash(e.parent_block_hash, f"{where}.parent_block_hash")
    return batch


def from_scheduler(events: Sequence[tuple[Any, ...]], block_size: int) -> list[Event]:
    """A live scheduler's KV events (:meth:`~bearsdk.replay.scheduler.SchedulerCore.take_kv_events`)
    as vLLM's, content keys standing for vLLM's block hashes (what the emulator publishes)."""
    out: list[Event] = []
    for e in events:
        if e[0] == "stored":
            _, parent, keys, tokens = e
            out.append(BlockStored(list(keys), parent, list(tokens), block_size, None, "GPU", None))
        elif e[0] == "removed":
            out.append(BlockRemoved([e[1]], "GPU"))
    return out


def as_dict(batch: KVEventBatch) -> dict[str, Any]:
    """A batch as plain data (for logs and tests)."""
    return msgspec.to_builtins(batch)  # type: ignore[no-any-return]

"""Which prompt blocks an instance holds, from its KV events, matched by token ids.

vLLM names blocks by a hash of their tokens and their parent's hash, computed
with whatever algorithm the engine was started with (``--prefix-caching-hash-algo``).
The index does not need to know it: a stored block's tokens (``BlockStored``
carries them) and its parent's *content key* give the block's own content key,
the same :func:`~bearsdk.replay.blocks.chain_keys` gives a request's prompt, and
vLLM's hash is kept only to find the key again when the block is removed. So
a router hashes a prompt once (its chain of keys) and asks every instance's
index how many of its leading blocks are cached there.

Blocks are counted per content: two blocks with the same tokens after the same
prefix (vLLM caches duplicates when two requests fill the same block in the
same step) are two entries, and the content stays findable until both are
removed, as vLLM's own map keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from bearsdk.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventError,
)
from bearsdk.replay.blocks import KEY_MASK, extend_chain

__all__ = ["PrefixIndex", "hash_key"]


def hash_key(h: bytes | int) -> int:
    """vLLM's block hash as a ``kv.prefix_cache`` key: its last 8 bytes, big-endian,
    63 bits (``docs/contracts.md``), whether the event sent it as bytes or, as
    vLLM does by default, as the int of those 8 bytes (the emulator's: its key)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big") & KEY_MASK
    return h & KEY_MASK


@attrs.define
class PrefixIndex:
    """One instance's cached blocks, by content key (see the module).

    Args:
        block_size: The engine's tokens per block.
        max_blocks: The most blocks the index may hold (the engine's pool size,
            with room to spare): a stream that names more is not the engine's,
            and the index refuses it rather than grow.

    Attributes:
        broken: Stored blocks whose parent the index did not know (it joined the
            stream late, or missed a batch): their content keys are unknown, so
            they are not findable. A resync starts over from a full stream.
    """

    block_size: int
    max_blocks: int
    broken: int = 0
    # vLLM hash -> (content key, blocks with that hash)
    _by_hash: dict[bytes | int, list[int]] = attrs.field(factory=dict, init=False)
    # content key -> blocks holding it
    _count: dict[int, int] = attrs.field(factory=dict, init=False)
    # content key -> vLLM's hash of it (equal content after an equal prefix: one hash)
    _hash_of: dict[int, bytes | int] = attrs.field(factory=dict, init=False)
    _blocks: int = attrs.field(default=0, init=False)

    @property
    def blocks(self) -> int:
        """Blocks the index holds (duplicates counted)."""
        return self._blocks

    def clear(self) -> None:
        """Forget every block (``AllBlocksCleared``, or before a resync)."""
        self._by_hash.clear()
        self._count.clear()
        self._hash_of.clear()
        self._blocks = 0

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one step's events, in order.

        Raises:
            KVEventError: A block size other than the engine's, or more blocks
                than ``max_blocks``.
        """
        for e in batch.events:
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                self._removed(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.clear()

    def _stored(self, e: BlockStored) -> None:
        if e.block_size != self.block_size:
            raise KVEventError(
                f"BlockStored.block_size {e.block_size} is not the engine's {self.block_size}"
            )
        parent: int | None = None
        if e.parent_block_hash is not None:
            got = self._by_hash.get(e.parent_block_hash)
            if got is None:
                self.broken += len(e.block_hashes)
                return
            parent = got[0]
        if self._blocks + len(e.block_hashes) > self.max_blocks:
            raise KVEventError(
                f"BlockStored: {self._blocks + len(e.block_hashes)} blocks, more than the "
                f"{self.max_blocks} the engine can hold"
            )
        keys = extend_chain(parent, e.token_ids, self.block_size)
        count = self._count
        for h, k in zip(e.block_hashes, keys, strict=True):
            entry = self._by_hash.get(h)
            if entry is None:
                self._by_hash[h] = [k, 1]
            else:
                entry[1] += 1
            count[k] = count.get(k, 0) + 1
            self._hash_of.setdefault(k, h)
        self._blocks += len(keys)

    def _removed(self, hashes: Sequence[bytes | int]) -> None:
        count = self._count
        for h in hashes:
            entry = self._by_hash.get(h)
            if entry is None:
                continue  # stored before the index joined, or under a broken parent
            k = entry[0]
            entry[1] -= 1
            if entry[1] == 0:
                del self._by_hash[h]
            n = count[k] - 1
            if n:
                count[k] = n
            else:
                del count[k]
                self._hash_of.pop(k, None)
            self._blocks -= 1

    def engine_keys(self, keys: Sequence[int]) -> list[int]:
        """A prompt's chain as the engine's snapshot names its blocks, up to the first miss.

        The bearsdk vLLM publisher's ``kv.prefix_cache`` names a block by the
        last 8 bytes of vLLM's hash (:func:`hash_key`); the emulator's by its
        content key. A replay given these keys hits the snapshot's blocks.
        """
        out = []
        hash_of = self._hash_of
        for k in keys:
            h = hash_of.get(k)
            if h is None:
                break
            out.append(hash_key(h))
        return out

    def hit_blocks(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's chain) are cached here, from the start."""
        count = self._count
        n = 0
        for k in keys:
            if k not in count:
                break
            n += 1
        return n

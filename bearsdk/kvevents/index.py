"""Which prompt blocks an instance holds, from its KV events, matched by token ids.

vLLM names blocks by a hash of their tokens and their parent's hash, computed
with whatever algorithm the engine was started with (``--prefix-caching-hash-algo``).
The index does not need to know it: a stored block's tokens (``BlockStored``
carries them) and its parent's *content key* give the block's own content key,
the same :func:`chain_keys` gives a request's prompt, and vLLM's hash (as
:func:`hash_key`, its last 8 bytes) is kept only to find the key again when the
block is removed. So a router hashes a prompt once (its chain of keys) and asks
every instance's index how many of its leading blocks are cached there.

The index and the chain hashing run in C (``cext/_index_c.pyx``, about 35 to 57
bytes per cached block) unless ``BEARSDK_NO_EXTENSIONS`` selects the
pure-Python twin (:mod:`bearsdk.kvevents._index_py`), which is the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from bearsdk._twins import compiled
from bearsdk.kvevents import _index_py

if TYPE_CHECKING:
    from bearsdk.kvevents.wire import BlockStored, KVEventBatch

_impl: ModuleType = compiled("bearsdk.kvevents._index_c") or _index_py

__all__ = [
    "IMPLEMENTATION",
    "PrefixIndex",
    "chain_keys",
    "extend_chain",
    "hash_key",
    "text_chain",
    "token_ids",
]

IMPLEMENTATION = "python" if _impl is _index_py else "cython"
"""Which twin is in use."""

chain_keys: Callable[..., list[int]] = _impl.chain_keys
"""The content keys of a prompt's full blocks (:func:`bearsdk.replay.blocks.chain_keys`)."""
extend_chain: Callable[[int | None, Sequence[int], int], list[int]] = _impl.extend_chain
"""Keys of blocks after a known parent (:func:`bearsdk.replay.blocks.extend_chain`)."""
text_chain: Callable[[str, int], list[int]] = _impl.text_chain
"""Keys of a text's character blocks, for routers without the model's tokenizer
(:func:`bearsdk.kvevents._index_py.text_chain`)."""
token_ids: Callable[[object], list[int] | None] = _impl.token_ids
"""A copy of a list or tuple of token ids (ints in ``[0, 2**63)``), else ``None``."""
hash_key: Callable[[bytes | int], int] = _impl.hash_key
"""vLLM's block hash as a 63-bit key: its last 8 bytes (see ``_index_py.hash_key``)."""

if TYPE_CHECKING:
    _Core = _index_py.PrefixCore
else:
    _Core = _impl.PrefixCore


class PrefixIndex(_Core):
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
        blocks: Blocks the index holds (duplicates counted).
        memory_bytes: What the index holds in memory, bytes.
    """

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one step's events, in order.

        Raises:
            KVEventError: A block size other than the engine's, or more blocks
                than ``max_blocks``.
        """
        from bearsdk.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored

        for e in batch.events:
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                self.removed(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.clear()

    def _stored(self, e: BlockStored) -> None:
        from bearsdk.kvevents.wire import KVEventError

        if e.block_size != self.block_size:
            raise KVEventError(
                f"BlockStored.block_size {e.block_size} is not the engine's {self.block_size}"
            )
        parent: int | None = None
        if e.parent_block_hash is not None:
            parent = self.parent_key(e.parent_block_hash)
            if parent is None:
                self.broken += len(e.block_hashes)
                return
        if self.blocks + len(e.block_hashes) > self.max_blocks:
            raise KVEventError(
                f"BlockStored: {self.blocks + len(e.block_hashes)} blocks, more than the "
                f"{self.max_blocks} the engine can hold"
            )
        self.stored(e.block_hashes, extend_chain(parent, e.token_ids, self.block_size))

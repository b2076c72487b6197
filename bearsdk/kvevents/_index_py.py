"""Pure-Python twin of the compiled prefix index (``cext/_index_c.pyx``).

The readable reference and the test oracle: :class:`PrefixCore` keeps one
instance's cached blocks by content key and by vLLM's hash, the chain functions
are the replay's own (:mod:`bearsdk.replay.blocks`). The compiled module gives
the same answers, call for call, in a fraction of the memory.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from bearsdk.replay.blocks import KEY_MASK, chain_keys, extend_chain

__all__ = ["PrefixCore", "chain_keys", "extend_chain", "hash_key", "text_chain", "token_ids"]

_ROOT = 0x5BD1E995
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_M64 = (1 << 64) - 1


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    return k ^ (k >> 33)


def token_ids(value: object) -> list[int] | None:
    """A list copy of ``value`` when it is a list or tuple of ints in ``[0, 2**63)``
    (a prompt's token ids, as a caller hands them), else ``None``: the caller
    then finds which element is wrong and says so."""
    if type(value) is not list and type(value) is not tuple:
        return None
    seq: list[int] | tuple[int, ...] = value
    # At C speed: a per-element isinstance costs ~0.7 us a token.
    if not set(map(type, seq)) <= {int}:
        return None
    if seq and (min(seq) < 0 or max(seq) >= 1 << 63):
        return None
    return list(seq)


def text_chain(text: str, block_chars: int) -> list[int]:
    """Chained keys of the full ``block_chars``-character blocks of ``text``.

    The prompt's blocks as a router without the model's tokenizer can name
    them (llm-d's approximate prefix scorer hashes characters the same way):
    each key is FNV-1a over the block's code points, started from the key
    before it, finished with MurmurHash3's mixer. The same in every process
    (``hash()`` of a string is not), so router replicas agree.
    """
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1 (got {block_chars})")
    out = []
    key = _ROOT
    for b in range(len(text) // block_chars):
        h = _FNV_OFFSET ^ key
        for c in text[b * block_chars : (b + 1) * block_chars]:
            h = ((h ^ ord(c)) * _FNV_PRIME) & _M64
        key = _fmix64(h) & KEY_MASK
        out.append(key)
    return out


def hash_key(h: bytes | int) -> int:
    """vLLM's block hash as a ``kv.prefix_cache`` key: its last 8 bytes, big-endian,
    63 bits (``docs/contracts.md``), whether the event sent it as bytes or, as
    vLLM does by default, as the int of those 8 bytes (the emulator's: its key)."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big") & KEY_MASK
    return h & KEY_MASK


class PrefixCore:
    """One instance's cached blocks: which content keys it holds, under which hashes.

    Blocks are counted per hash: two blocks with one hash (vLLM caches
    duplicates when two requests fill the same block in the same step) are
    one entry counted twice, findable until both are removed. Equal content
    under different hashes (a salted or LoRA prefix) is findable while any of
    them is cached; the one stored first names it.

    Args:
        block_size: The engine's tokens per block.
        max_blocks: The most blocks the index may hold (checked by the caller).

    Attributes:
        broken: Stored blocks whose parent was unknown (counted by the caller).
    """

    __slots__ = ("_blocks", "_by_content", "_by_hash", "block_size", "broken", "max_blocks")

    def __init__(self, block_size: int, max_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        if not 0 <= max_blocks < (1 << 31) - 1:
            raise ValueError(f"max_blocks must be in [0, 2**31 - 1) (got {max_blocks})")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.broken = 0
        self._blocks = 0
        # hash key -> [content key, blocks with that hash]
        self._by_hash: dict[int, list[int]] = {}
        # content key -> hash keys holding it, first stored first
        self._by_content: dict[int, list[int]] = {}

    @property
    def blocks(self) -> int:
        """Blocks the index holds (duplicates counted)."""
        return self._blocks

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the index's containers (shallow: ints shared with callers aside)."""
        n = sys.getsizeof(self._by_hash) + sys.getsizeof(self._by_content)
        n += sum(sys.getsizeof(v) for v in self._by_hash.values())
        return n + sum(sys.getsizeof(v) for v in self._by_content.values())

    def clear(self) -> None:
        """Forget every block."""
        self._by_hash.clear()
        self._by_content.clear()
        self._blocks = 0

    def parent_key(self, h: bytes | int) -> int | None:
        """The content key of the block vLLM hashed ``h``, or ``None`` if unknown."""
        got = self._by_hash.get(hash_key(h))
        return None if got is None else got[0]

    def stored(self, hashes: Sequence[bytes | int], keys: Sequence[int]) -> None:
        """Blocks ``hashes`` (vLLM's) entered the cache with content ``keys``."""
        if len(hashes) != len(keys):
            raise ValueError(f"{len(hashes)} hashes for {len(keys)} content keys")
        for h, k in zip(hashes, keys, strict=True):
            hk = hash_key(h)
            entry = self._by_hash.get(hk)
            if entry is None:
                self._by_hash[hk] = [k, 1]
                self._by_content.setdefault(k, []).append(hk)
            else:
                entry[1] += 1
            self._blocks += 1

    def removed(self, hashes: Iterable[bytes | int]) -> None:
        """Blocks ``hashes`` (vLLM's) left the cache; unknown ones are skipped."""
        for h in hashes:
            hk = hash_key(h)
            entry = self._by_hash.get(hk)
            if entry is None:
                continue  # stored before the index joined, or under a broken parent
            self._blocks -= 1
            entry[1] -= 1
            if entry[1]:
                continue
            del self._by_hash[hk]
            holders = self._by_content[entry[0]]
            holders.remove(hk)
            if not holders:
                del self._by_content[entry[0]]

    def hit_blocks(self, keys: Iterable[int]) -> int:
        """How many of ``keys`` (a prompt's chain) are cached here, from the start."""
        held = self._by_content
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def engine_keys(self, keys: Iterable[int]) -> list[int]:
        """A prompt's chain as the engine names its blocks, up to the first miss.

        The bearsdk vLLM publisher's ``kv.prefix_cache`` names a block by the
        last 8 bytes of vLLM's hash (:func:`hash_key`); the emulator's by its
        content key. A replay given these keys hits the snapshot's blocks.
        """
        out = []
        held = self._by_content
        for k in keys:
            got = held.get(k)
            if got is None:
                break
            out.append(got[0])
        return out

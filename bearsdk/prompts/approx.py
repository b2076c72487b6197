"""What the router sent where: an approximate prefix index without a tokenizer or KV events.

When an instance neither announces its blocks (KV events) nor gets the
prompt's token ids (no tokenizer for its model), the router can still know
what it sent there. It names a prompt's text by character blocks
(:func:`~bearsdk.kvevents.index.text_chain`, :data:`BLOCK_CHARS` characters
each, chained: llm-d's approximate prefix scorer does the same) and keeps, per
instance, the blocks of the prompts it dispatched there in least-recently-used
order, at most as many as the instance's KV cache holds in characters: an LRU
model of the engine's own cache. A new prompt's hit is its leading blocks
found there, converted to tokens at the prompt's own characters per token.

It is approximate (decisions mark it ``cache_source = "dispatches"``): it does
not see requests other routers sent, the engine's real evictions, or the
answers' tokens (which the engine caches and the next turn resends), and a
character block is not a token block. Its accuracy against the engines' own
counts is measured by ``bearsdk bench prefix-index --approximate``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

import attrs

__all__ = ["BLOCK_CHARS", "DispatchIndex"]

BLOCK_CHARS: Final = 64
"""Characters per block of the approximate chain (about 16 tokens of English)."""


@attrs.define
class DispatchIndex:
    """One instance's dispatched prompt blocks, oldest first out (see the module).

    Args:
        capacity: The most blocks kept (the instance's KV cache in characters,
            over :data:`BLOCK_CHARS`).
    """

    capacity: int
    _lru: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._lru)

    def record(self, keys: Sequence[int]) -> None:
        """A prompt with these block keys was sent here: its blocks are the newest."""
        lru = self._lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def hit_blocks(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` were sent here and not aged out, from the start."""
        lru = self._lru
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def clear(self) -> None:
        """Forget everything (the instance restarted or reset its cache)."""
        self._lru.clear()

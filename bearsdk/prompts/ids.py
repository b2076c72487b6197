"""A prompt's token ids and its block chains (no tokenizer needed to hold them)."""

from __future__ import annotations

import attrs

from bearsdk.kvevents.index import chain_keys

__all__ = ["PromptIds"]


@attrs.define(eq=False)
class PromptIds:
    """A prompt's token ids and, per block size, its full-block content keys.

    Attributes:
        ids: The token ids.
        reused: Leading tokens taken from an earlier turn of the same session
            (not tokenized again).
    """

    ids: list[int]
    reused: int = 0
    _chains: dict[int, tuple[int, ...]] = attrs.field(factory=dict, alias="_chains")

    def __len__(self) -> int:
        return len(self.ids)

    def chain(self, block_size: int) -> tuple[int, ...]:
        """The content keys of the prompt's full blocks of ``block_size`` tokens.

        One tuple per block size, the same object on every call: the compiled
        replay converts a chain once for all the instances it prices.
        """
        got = self._chains.get(block_size)
        if got is None:
            got = self._chains[block_size] = tuple(chain_keys(self.ids, block_size))
        return got

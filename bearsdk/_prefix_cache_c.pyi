# Type stub of the compiled kv.prefix_cache validator (cext/_prefix_cache_c.pyx);
# the reference and the contract are in bearsdk/prefix_cache.py.
from collections.abc import Sequence
from typing import Any, Final

from bearsdk.prefix_cache import PrefixCacheState

IMPLEMENTATION: Final[str]

def validate(
    raw: object,
    block_size: int,
    num_blocks: int,
    free_blocks: int,
    requests: Sequence[Any],
    rows: Sequence[Sequence[int]],
) -> PrefixCacheState | None: ...

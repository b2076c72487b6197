# Type stub of the compiled snapshot scanner (cext/_snapshot_c.pyx); the
# reference and the contract are in bearsdk/snapshot.py.
from typing import Any, Final

IMPLEMENTATION: Final[str]

def decode(data: object) -> tuple[Any, ...] | None: ...
def _set_limits(
    block_size: int,
    num_blocks: int,
    request_tokens: int,
    placeholders: int,
    requests: int,
    total_tokens: int,
    id_chars: int,
    inflight_s: float,
) -> None: ...

# Type stub of the compiled snapshot scanner (cext/_snapshot_c.pyx); the
# reference and the contract are in bearsdk/snapshot.py.
from typing import Any, Final

IMPLEMENTATION: Final[str]

def decode(data: object) -> tuple[Any, ...] | None: ...

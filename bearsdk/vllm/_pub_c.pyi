# Type stub of the compiled capture (cext/_vllm_pub_c.pyx); same API as _pub_py.
from collections.abc import Callable, Iterable
from typing import Any, Final

IMPLEMENTATION: Final[str]

def id_fragment(rid: str) -> bytes: ...
def json_head(instance: str, epoch: str) -> bytes: ...

class Capture:
    block_size: int
    num_blocks: int
    num_running: int
    num_waiting: int
    def __init__(
        self,
        instance: str,
        epoch: str,
        block_size: int,
        num_blocks: int,
        placeholders: bool = True,
        threaded: bool = False,
        shadow: bool = False,
        audit: int = 2,
        poll_us: float = 500.0,
    ) -> None: ...
    @property
    def cached(self) -> int: ...
    def capture(
        self,
        running: list[Any],
        waiting: tuple[Iterable[Any], ...],
        seq: int,
        time_s: float,
        free_blocks: int,
        inflight_s: float = -1.0,
        batch_terms: bool = False,
    ) -> int: ...
    def encode(self) -> int: ...
    def payload(self) -> bytes: ...
    def commit(self) -> None: ...
    def take_and_encode(self) -> int: ...
    def taken_payload(self) -> bytes: ...
    def close(self) -> None: ...
    @property
    def shadow(self) -> bool: ...
    @property
    def mismatches(self) -> int: ...
    def after_schedule(
        self, scheduled: dict[str, int], key: object = None
    ) -> tuple[int, int, int, int, int]: ...
    def batch_done(self, key: object = None) -> None: ...
    def preempted(self, request: object) -> None: ...

INLINE_DOCUMENT: Final[int]
INLINE_BATCHES: Final[int]

class Hooks:
    threaded: bool
    want_terms: bool
    seq: int
    captures: int
    failures: int
    batches: int
    dropped: int
    engine_ns: int
    closed: bool
    def __init__(
        self,
        capture: Capture,
        free_blocks: Callable[[], int],
        on_failure: Callable[[str, BaseException], None],
        threaded: bool,
        batch_time: tuple[float, float, float, float] | None = None,
        batch_buffer: int = 4096,
    ) -> None: ...
    def before_schedule(self, sched: Any) -> int: ...
    def after_schedule(self, out: Any) -> int: ...
    def before_update(self, out: Any, model_output: Any) -> int: ...
    def after_change(self, sched: Any) -> int: ...
    def preempted(self, request: Any) -> int: ...
    def take_batches(self) -> list[tuple[int, float, int, int, int, int, int, float]]: ...
    def close(self) -> None: ...

def json_ints(values: Any) -> bytes: ...

# Type stub of the compiled prefix-caching replay (cext/_replay_apc_c.pyx).
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from bearsdk.prefix_cache import PrefixCacheState
from bearsdk.replay.types import ReplayResult
from bearsdk.schedulers.spec import Policy

IMPLEMENTATION: str

class Prepared:
    @property
    def free_blocks(self) -> int: ...
    def __len__(self) -> int: ...
    def hit_blocks(self, keys: Sequence[int]) -> int: ...

class Replayer:
    implementation: str
    policy: Policy
    resume: bool
    @property
    def last_resumed(self) -> bool: ...
    @property
    def last_work(self) -> int: ...
    @property
    def last_new_examined(self) -> bool: ...
    @property
    def last_lazy_batches(self) -> int: ...
    @property
    def last_pool(self) -> tuple[int, int, int, int]: ...
    def __init__(self, policy: Policy) -> None: ...
    def last_blocks(
        self,
    ) -> tuple[list[int], list[int | None], list[tuple[int, int | None]]]: ...
    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
        cache: PrefixCacheState | None = None,
    ) -> Prepared: ...
    def ttft(
        self,
        prepared: Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = ...,
        arrival_s: float = ...,
    ) -> float: ...
    def residents(
        self, prepared: Prepared, coeffs: Sequence[float], max_batches: int
    ) -> tuple[int, float]: ...
    def replay(
        self,
        prepared: Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        record: bool = False,
        max_batches: int = 1_000_000,
        max_tokens: int = -1,
        max_work: int | None = None,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = ...,
        arrival_s: float = ...,
        next_tokens: int = ...,
    ) -> ReplayResult: ...

# Type stub of the compiled replay (cext/_replay_c.pyx); same API as _replay_py.
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from bearsdk.prefix_cache import PrefixCacheState
from bearsdk.replay import _replay_apc_c
from bearsdk.replay.types import ReplayResult
from bearsdk.schedulers.spec import Policy

IMPLEMENTATION: str

class Prepared:
    def __len__(self) -> int: ...

class Replayer:
    implementation: str
    policy: Policy
    force_slow: bool
    resume: bool
    @property
    def last_work(self) -> int: ...
    @property
    def last_resumed(self) -> bool: ...
    @property
    def last_new_examined(self) -> bool: ...
    def __init__(self, policy: Policy) -> None: ...
    def prepare(
        self,
        table: npt.NDArray[np.int64],
        free_blocks: int = -1,
        ids: Sequence[str] | None = None,
        cache: PrefixCacheState | None = None,
    ) -> Prepared | _replay_apc_c.Prepared: ...
    def ttft(
        self,
        prepared: Prepared | _replay_apc_c.Prepared,
        prompt_tokens: int,
        output_len: int,
        coeffs: Sequence[float],
        max_tokens: int = -1,
        prefix_keys: Sequence[int] | None = None,
        horizon_s: float = ...,
        arrival_s: float = ...,
    ) -> float: ...
    def residents(
        self, prepared: Prepared | _replay_apc_c.Prepared, coeffs: Sequence[float], max_batches: int
    ) -> tuple[int, float]: ...
    def replay(
        self,
        prepared: Prepared | _replay_apc_c.Prepared,
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

"""What the emulated engine knows about a request: its plan, its live handle, its record.

A request's future is fixed when it arrives (:class:`GenerationPlan`, made by
:func:`plan_generation`); the engine appends tokens to its
:class:`RequestHandle` as batches complete, and whoever waits on it (an HTTP
handler, a test) wakes; a finished request leaves a :class:`RequestRecord`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import attrs

from bearsdk.emulator.text import filler_tokens

if TYPE_CHECKING:
    from bearsdk.emulator.text import Tokenizer

__all__ = [
    "GenerationPlan",
    "RequestHandle",
    "RequestRecord",
    "apply_stop",
    "plan_generation",
]


@attrs.frozen
class GenerationPlan:
    """What a request will generate, fixed at arrival (the emulator knows the future).

    Attributes:
        prompt_tokens: Prompt length.
        max_tokens: Effective output cap (``max_tokens`` clamped to the context).
        output_len: True output length (``<= max_tokens``).
        texts: Text of each output token (an end-of-sequence token is ``""``;
            text from a stop string on is cut).
        finish_reason: ``"stop"`` or ``"length"``.
        stop_reason: The stop string that ended it, if any.
        requested_max_tokens: ``max_tokens`` as requested (metrics).
        prompt_ids: The prompt's token ids, where the engine needs them (a
            prefix-caching engine matches cached blocks by them).
        output_ids: The ids of the ``output_len`` tokens it generates (with
            ``prompt_ids``): each text's id, the end of sequence's for ``""``;
            a token cut by a stop string keeps the id of its whole text.
    """

    prompt_tokens: int
    max_tokens: int
    output_len: int
    texts: tuple[str, ...]
    finish_reason: str
    stop_reason: str | None = None
    requested_max_tokens: int | None = None
    prompt_ids: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    output_ids: tuple[int, ...] | None = attrs.field(default=None, repr=False)

    @property
    def token_ids(self) -> list[int] | None:
        """Prompt then output ids (``None`` without ``prompt_ids``)."""
        if self.prompt_ids is None or self.output_ids is None:
            return None
        return [*self.prompt_ids, *self.output_ids]


@attrs.frozen
class RequestRecord:
    """A finished request, as the engine timed it (loop clock, seconds).

    Attributes:
        id: Request id.
        prompt_tokens: Prompt length.
        output_tokens: Tokens generated.
        finish_reason: ``stop``, ``length`` or ``abort``.
        arrival: When the engine received it.
        first_token: When its first token was emitted (``None``: never).
        finished: When it finished.
        first_token_batch: 1-based index (since engine start) of the batch that sampled
            its first token (0: never).
    """

    id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    arrival: float
    first_token: float | None
    finished: float
    first_token_batch: int

    @property
    def ttft(self) -> float | None:
        """Time to first token as the engine measured it."""
        return None if self.first_token is None else self.first_token - self.arrival


@attrs.define(eq=False)
class RequestHandle:
    """A request in flight: the engine appends tokens, the HTTP layer streams them.

    Attributes:
        id: Engine request id.
        plan: What it generates.
        arrival: Loop clock at arrival.
        produced: Output tokens emitted so far.
        token_times: Loop clock at each emitted token.
        token_ends: When the emulated GPU finished the batch that computed each
            emitted token (loop clock; a late loop delivers it after that).
        done: Finished (or aborted).
        finish_reason: ``stop``, ``length``, ``abort`` (when done).
        dropped: The connection must be dropped (engine restart).
        first_token_batch: Batch index that sampled its first token (0: not yet).
        scheduled_at: Loop clock when first scheduled (``None``: not yet).
        cached_tokens: Prompt tokens its first admission found in the prefix
            cache (vLLM's ``num_cached_tokens``; 0 without the cache).
        created_cache_tokens: Prompt tokens it wrote to the cache, as vLLM
            reports them (``num_cache_creation_tokens``; set at its first token).
        first_token_late: How much later than its batch's end on the emulated
            GPU the loop delivered the first token (the host's lateness).
    """

    id: str
    plan: GenerationPlan
    arrival: float
    produced: int = 0
    token_times: list[float] = attrs.field(factory=list)
    token_ends: list[float] = attrs.field(factory=list)
    done: bool = False
    finish_reason: str | None = None
    dropped: bool = False
    first_token_batch: int = 0
    scheduled_at: float | None = None
    first_token_late: float = 0.0
    cached_tokens: int = 0
    created_cache_tokens: int = 0
    _event: anyio.Event | None = None

    @property
    def prompt_tokens(self) -> int:
        """Prompt length."""
        return self.plan.prompt_tokens

    @property
    def ttft(self) -> float | None:
        """Engine-measured time to first token (``None`` before it)."""
        return self.token_times[0] - self.arrival if self.token_times else None

    def text(self, start: int = 0, stop: int | None = None) -> str:
        """Concatenated text of output tokens ``start..stop``."""
        return "".join(self.plan.texts[start : self.produced if stop is None else stop])

    def notify(self) -> None:
        """Wake the task waiting on this request."""
        if self._event is not None:
            self._event.set()
            self._event = None

    def finish(self, reason: str, now: float) -> RequestRecord:
        """Mark the request done at loop time ``now``, wake its waiter; its record."""
        self.done = True
        self.finish_reason = reason
        self.notify()
        first = self.token_times[0] if self.token_times else None
        return RequestRecord(
            self.id,
            self.plan.prompt_tokens,
            self.produced,
            reason,
            self.arrival,
            first,
            now,
            self.first_token_batch,
        )

    async def changed(self) -> None:
        """Wait until a token arrives or the request ends (returns at once if it has)."""
        if self.done:
            return
        self._event = anyio.Event()
        await self._event.wait()

    async def result(self) -> RequestHandle:
        """Wait until the request is done; return itself."""
        while not self.done:
            await self.changed()
        return self


def apply_stop(texts: list[str], stops: Sequence[str]) -> tuple[int, list[str], str | None]:
    """Cut the output at the first stop string (its text excluded, as vLLM does)."""
    full = "".join(texts)
    best_end, best_start, hit = len(full) + 1, 0, None
    for s in stops:
        if not s:
            continue
        i = full.find(s)
        if i >= 0 and i + len(s) < best_end:
            best_end, best_start, hit = i + len(s), i, s
    if hit is None:
        return len(texts), texts, None
    out: list[str] = []
    pos = 0
    for t in texts:
        nxt = pos + len(t)
        out.append(full[min(pos, best_start) : min(nxt, best_start)])
        pos = nxt
        if pos >= best_end:
            break
    return len(out), out, hit


def plan_generation(
    max_model_len: int,
    prompt_tokens: int,
    *,
    natural_len: int,
    max_tokens: int | None = None,
    seed: int = 0,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    prompt_ids: Sequence[int] | None = None,
    tokenizer: Tokenizer | None = None,
) -> GenerationPlan:
    """Fix what a request generates.

    Args:
        max_model_len: The engine's context length.
        prompt_tokens: Prompt length (``<= max_model_len - 1``; validated by callers).
        natural_len: Where the model would stop by itself (end of sequence).
        max_tokens: Requested cap (``None``: the context's remainder).
        seed: Seeds the filler text.
        stop: Stop strings.
        ignore_eos: Generate until the cap.
        min_tokens: No end of sequence before this many tokens.
        prompt_ids: The prompt's token ids (``prompt_tokens`` of them), to carry.
        tokenizer: With ``prompt_ids``: gives the output tokens' ids.
    """
    cap = max_model_len - prompt_tokens
    if max_tokens is not None:
        cap = min(cap, max_tokens)
    cap = max(cap, 1)
    natural = cap if ignore_eos else max(natural_len, min_tokens, 1)
    n = min(natural, cap)
    finish = "stop" if natural <= cap and not ignore_eos else "length"
    texts = filler_tokens(n, seed)
    if finish == "stop":
        texts[-1] = ""  # the end-of-sequence token has no text
    ids = None
    if prompt_ids is not None and tokenizer is not None:
        ids = tuple(tokenizer.output_ids(texts))
    stop_reason = None
    if stop:
        n, texts, hit = apply_stop(texts, stop)
        if hit is not None:
            finish, stop_reason = "stop", hit
    return GenerationPlan(
        prompt_tokens,
        cap,
        n,
        tuple(texts),
        finish,
        stop_reason,
        max_tokens,
        None if ids is None or prompt_ids is None else tuple(prompt_ids),
        None if ids is None else ids[:n],
    )

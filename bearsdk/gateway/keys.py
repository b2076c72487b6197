"""API keys of the gateway at run time: who may call it, which models, and how fast.

The keys themselves (their ``[[keys]]`` tables, salted hashes and refusals)
are defined in :mod:`bearsdk.gateway.keyspec`; their names are re-exported
here.

:class:`KeyRing` answers the two questions the gateway asks per request:
:meth:`~KeyRing.authenticate` (which key is this? 401 if none) and
:meth:`~KeyRing.admit` (may it run now? 403, or 429 with ``Retry-After``).
Refusals are :class:`Denied` errors carrying the HTTP status and the OpenAI
error body.

Cost on the hot path (the gateway adds at most 0.5 ms p50 per request):

* A known key: one keyed BLAKE2b of the presented key (BLAKE2's MAC mode)
  under a secret drawn at random per ring, then a dict lookup: about half a
  microsecond (CPython's own BLAKE2, not OpenSSL's HMAC, whose per-call
  algorithm fetch costs more than the hash). The caches are keyed by that
  MAC, so they hold neither the plaintext nor anything that can be checked
  offline without the ring's secret.
* The positive cache needs no eviction: a secret matches at most one
  configured key, so it never holds more entries than there are keys.
* An unknown key is remembered in an LRU of ``cache_size`` entries (32 bytes
  each): a client hammering with one bad key costs O(1) per request.
* A key seen for the first time (a new valid one, or each distinct random bad
  one) costs one SHA-256 per configured key (salts differ, so there is no
  index), compared with :func:`hmac.compare_digest`: about 0.5 µs per key, so
  100 keys cost ~50 µs. The bound is the number of keys in the config; the
  presented key is refused unhashed unless 16 to 512 characters long.
* Admission: a dict lookup, two token-bucket refills and a counter.

Admission uses token buckets refilled continuously (capacity ``rpm`` refilled
at ``rpm / 60`` per second; likewise ``tpm``) and a count of leases in flight.
Its checks are all-or-nothing: a refused request consumes nothing. The token
charge is the gateway's estimate, corrected when the :class:`Lease` is
released with the engine's usage.

A request whose token estimate exceeds the key's whole ``tpm`` is admitted when
the bucket is full, and drives it negative: the debt keeps the key waiting
until its average is back within ``tpm``. Refusing it (as OpenAI does, "Request
too large") would answer 429, which clients retry, for a request that no
waiting could admit, and the estimate is an upper bound (``max_tokens``) the
release usually refunds.

Not thread-safe: one event loop owns a ring.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final

import attrs

from bearsdk.gateway.keyspec import (
    _INCORRECT,
    _MALFORMED,
    _MAX_SECRET_CHARS,
    _MIN_SECRET_CHARS,
    _MISSING,
    _REVOKED,
    HASH_SCHEME,
    Denied,
    KeyConfigError,
    KeySpec,
    _check_unique,
    _digest,
    _parse_hash,
    _unauthorized,
    hash_key,
    key_from_dict,
    keys_from_list,
    new_key,
)
from bearsdk.router.errors import short

__all__ = [
    "HASH_SCHEME",
    "Denied",
    "KeyConfigError",
    "KeyRing",
    "KeySpec",
    "Lease",
    "hash_key",
    "key_from_dict",
    "keys_from_list",
    "new_key",
]

_MAX_CACHE: Final = 10_000_000
# Floating-point refills land a hair below a whole token; that is not a reason to refuse.
_EPS: Final = 1e-9
# A wait of 1 s is the natural retry for a full concurrency cap: no clock tells when a
# request in flight ends.
_CONCURRENCY_RETRY_S: Final = 1.0


def _seconds(s: float) -> str:
    text = f"{math.ceil(s * 1000) / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


# --- admission state ---------------------------------------------------------------------------


@attrs.define(eq=False)
class _Bucket:
    """A token bucket of capacity ``limit`` refilled at ``limit`` per minute."""

    limit: int
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(float(self.limit), self.level + (now - self.stamp) * self.limit / 60.0)
            self.stamp = now

    def peek(self, now: float) -> float:
        if now > self.stamp:
            return min(float(self.limit), self.level + (now - self.stamp) * self.limit / 60.0)
        return self.level

    def wait(self, need: int) -> float:
        """Seconds until ``need`` could be taken (0: now); above capacity, until full."""
        deficit = min(need, self.limit) - self.level
        if deficit <= _EPS * max(1, need):
            return 0.0
        return deficit * 60.0 / self.limit


def _bucket(limit: int | None, now: float, old: _Bucket | None) -> _Bucket | None:
    if limit is None:
        return None
    if old is None:
        return _Bucket(limit, float(limit), now)
    # Kept key: bring the level to now at the old rate, then clamp to the new capacity. The
    # object itself is kept so that leases taken before correct the live bucket.
    old.refill(now)
    old.limit = limit
    old.level = min(old.level, float(limit))
    return old


@attrs.define(eq=False)
class _KeyState:
    """What the ring knows of one key: its spec, parsed hash, buckets and leases in flight."""

    spec: KeySpec
    salt: bytes
    digest: bytes
    allowed: frozenset[str] | None
    rpm: _Bucket | None
    tpm: _Bucket | None
    in_flight: int = 0


@attrs.define(repr=False, eq=False)
class Lease:
    """An admitted request's hold on its key's budgets (made by :meth:`KeyRing.admit`).

    Release it exactly once, when the request ends (a second release does
    nothing). Holds no plaintext.
    """

    _state: _KeyState | None
    _bucket: _Bucket | None = None
    _charged: int = 0
    _clock: Callable[[], float] | None = None

    @property
    def key_name(self) -> str | None:
        """The key's name while the lease is held; ``None`` once released, or with auth off."""
        return None if self._state is None else self._state.spec.name

    @property
    def charged_tokens(self) -> int:
        """Tokens charged to the key's ``tpm`` budget at admission (0 without one)."""
        return self._charged

    def release(self, used_tokens: int | None = None) -> None:
        """Free the concurrency slot and settle the token charge.

        Args:
            used_tokens: Tokens the request really used (prompt + completion, from
                the engine's usage). The budget gets back what was charged and
                not used, or pays what was used beyond the charge; negative
                counts are taken as 0. ``None``: the charge stands.
        """
        state = self._state
        if state is None:
            return
        self._state = None
        state.in_flight -= 1
        bucket = self._bucket
        if used_tokens is None or bucket is None or self._clock is None:
            return
        bucket.refill(self._clock())
        settle = self._charged - max(0, int(used_tokens))
        bucket.level = min(float(bucket.limit), bucket.level + settle)

    def __repr__(self) -> str:
        if self._state is None:
            return "Lease(released)"
        return f"Lease(key={self._state.spec.name!r}, charged_tokens={self._charged})"


_NO_LEASE: Final = Lease(None)


# --- the ring ----------------------------------------------------------------------------------


@attrs.define(init=False, repr=False, eq=False)
class KeyRing:
    """The configured keys, their caches and their budgets.

    Args:
        specs: The keys (:func:`keys_from_list`); none: authentication off.
        clock: Monotonic seconds (injectable for tests).
        cache_size: Most unknown keys remembered (32 bytes each; 0: none).

    Raises:
        KeyConfigError: Two keys share a name or a hash, or a bad ``cache_size``.
    """

    _clock: Callable[[], float]
    _cache_size: int
    _secret: bytes
    _states: dict[str, _KeyState]
    _order: tuple[_KeyState, ...]
    _hits: dict[bytes, _KeyState]
    _misses: OrderedDict[bytes, None]

    def __init__(
        self,
        specs: Sequence[KeySpec] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        cache_size: int = 4096,
    ) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int):
            raise KeyConfigError(f"cache_size must be an integer (got {short(cache_size)})")
        if not 0 <= cache_size <= _MAX_CACHE:
            raise KeyConfigError(f"cache_size must be in [0, {_MAX_CACHE}] (got {cache_size})")
        self._clock = clock
        self._cache_size = cache_size
        # Per ring, never stored anywhere: the caches' keys mean nothing without it.
        self._secret = secrets.token_bytes(32)
        self._states = {}
        self._order = ()
        self._hits = {}
        self._misses = OrderedDict()
        self._install(specs)

    def _install(self, specs: Sequence[KeySpec]) -> None:
        specs = tuple(specs)
        _check_unique(specs)
        now = self._clock()
        states: dict[str, _KeyState] = {}
        for spec in specs:
            parsed = _parse_hash(spec.hash)
            assert not isinstance(parsed, str)  # KeySpec validated it
            old = self._states.get(spec.name)
            if old is None:
                old = _KeyState(spec, parsed[0], parsed[1], None, None, None)
            # A kept name keeps its state object: leases taken before release into it.
            old.spec = spec
            old.salt, old.digest = parsed
            old.allowed = frozenset(spec.models) if spec.models else None
            old.rpm = _bucket(spec.rpm, now, old.rpm)
            old.tpm = _bucket(spec.tpm, now, old.tpm)
            states[spec.name] = old
        self._states = states
        self._order = tuple(states.values())
        self._hits = {}
        self._misses = OrderedDict()

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (else the gateway is open to all)."""
        return bool(self._states)

    @property
    def specs(self) -> tuple[KeySpec, ...]:
        """The configured keys, in order."""
        return tuple(s.spec for s in self._order)

    def authenticate(self, authorization: str | None) -> KeySpec | None:
        """The key an ``Authorization`` header presents.

        Args:
            authorization: The header's value, ``Bearer <key>`` (the scheme in
                any case), or ``None`` when absent.

        Returns:
            The key's spec; ``None`` when no key is configured (the gateway is open).

        Raises:
            Denied: 401, the header is missing or malformed, or presents no
                configured key.
        """
        if not self._states:
            return None
        found = self._lookup(authorization)
        # Error reporters that record frame locals (Sentry does) must not see the key.
        del authorization
        if isinstance(found, _KeyState):
            return found.spec
        raise _unauthorized(found)

    def _lookup(self, authorization: str | None) -> _KeyState | str:
        """The key's state, or the 401 message (returned, not raised: no frame keeps the key)."""
        if not authorization:
            return _MISSING
        parts = authorization.split(None, 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return _MISSING if not parts else _MALFORMED
        secret = parts[1].strip()
        # No configured key is outside these bounds; refusing unhashed bounds the work.
        if not _MIN_SECRET_CHARS <= len(secret) <= _MAX_SECRET_CHARS or not secret.isascii():
            return _INCORRECT
        raw = secret.encode("ascii")
        tag = hashlib.blake2b(raw, key=self._secret, digest_size=32).digest()
        state = self._hits.get(tag)
        if state is not None:
            return state
        misses = self._misses
        if tag in misses:
            misses.move_to_end(tag)
            return _INCORRECT
        for state in self._order:
            if hmac.compare_digest(_digest(state.salt, raw), state.digest):
                self._hits[tag] = state
                return state
        if self._cache_size:
            misses[tag] = None
            if len(misses) > self._cache_size:
                misses.popitem(last=False)
        return _INCORRECT

    def admit(self, key: KeySpec | None, model: str, tokens: int) -> Lease:
        """Admit one request of ``key`` for ``model``, or refuse it.

        All checks pass or nothing is consumed. On success the request takes a
        concurrency slot, one request of ``rpm`` and ``tokens`` of ``tpm``.

        Args:
            key: What :meth:`authenticate` returned (``None``: auth off).
            model: The requested model or routing group.
            tokens: The estimated tokens: prompt tokens plus ``max_tokens`` (or
                the predicted output). One above the key's whole ``tpm`` is
                admitted when the bucket is full and leaves it in debt.

        Returns:
            The lease to release when the request ends.

        Raises:
            Denied: 401, the key was removed or rotated since it authenticated
                (or ``None`` while keys are configured); 403, the key may not use
                ``model``; 429, the concurrency cap is reached or a budget is
                short, with ``retry_after_s``.
            ValueError: ``tokens`` is not an integer >= 0.
        """
        if key is None:
            if self._states:
                raise _unauthorized(_MISSING)
            return _NO_LEASE
        state = self._states.get(key.name)
        if state is None or (state.spec is not key and state.spec.hash != key.hash):
            raise _unauthorized(_REVOKED)
        spec = state.spec
        if state.allowed is not None and model not in state.allowed:
            raise Denied(
                403,
                f"Key {spec.name!r} does not have access to model {short(model)} "
                f"(allowed: {', '.join(spec.models)}).",
                "model_not_allowed",
                "invalid_request_error",
                None,
                spec.name,
            )
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be an integer >= 0 (got {short(tokens)})")
        now = self._clock()
        rpm, tpm = state.rpm, state.tpm
        rpm_wait = tpm_wait = 0.0
        if rpm is not None:
            rpm.refill(now)
            rpm_wait = rpm.wait(1)
        if tpm is not None:
            tpm.refill(now)
            tpm_wait = tpm.wait(tokens)
        cap = spec.max_concurrency
        if cap is not None and state.in_flight >= cap:
            raise Denied(
                429,
                f"Concurrency limit reached for key {spec.name!r}: {state.in_flight} requests "
                f"in flight (limit {cap}). Please retry when one completes.",
                "concurrency_limit_exceeded",
                "requests",
                max(_CONCURRENCY_RETRY_S, rpm_wait, tpm_wait),
                spec.name,
            )
        if rpm_wait > 0.0 and rpm_wait >= tpm_wait:
            assert rpm is not None
            raise Denied(
                429,
                f"Rate limit reached for key {spec.name!r} on requests per min (RPM): "
                f"Limit {rpm.limit}. Please try again in {_seconds(rpm_wait)}.",
                "rate_limit_exceeded",
                "requests",
                rpm_wait,
                spec.name,
            )
        if tpm_wait > 0.0:
            assert tpm is not None
            raise Denied(
                429,
                f"Rate limit reached for key {spec.name!r} on tokens per min (TPM): "
                f"Limit {tpm.limit}, Available {max(0, math.floor(tpm.level))}, "
                f"Requested {tokens}. Please try again in {_seconds(tpm_wait)}.",
                "tokens_limit_exceeded",
                "tokens",
                tpm_wait,
                spec.name,
            )
        if rpm is not None:
            rpm.level -= 1.0
        if tpm is None:
            state.in_flight += 1
            return Lease(state)
        tpm.level -= tokens
        state.in_flight += 1
        return Lease(state, tpm, tokens, self._clock)

    def replace(self, specs: Sequence[KeySpec]) -> None:
        """Hot reload: install ``specs`` in place of the current keys.

        A key whose name persists keeps its budgets' levels (refilled to now,
        clamped to the new capacities) and its requests in flight; a removed
        key stops authenticating at once, and its leases still release. Both
        caches are cleared (a rotated secret stops working at once).

        Args:
            specs: The new keys.

        Raises:
            KeyConfigError: Two keys share a name or a hash; or ``specs`` is
                empty while keys are configured: a reload never turns
                authentication off (restart without keys to open the gateway).
                Nothing changes then.
        """
        specs = tuple(specs)
        if not specs and self._states:
            raise KeyConfigError(
                "keys: a reload cannot remove every key (that would open the gateway to all); "
                "restart without keys to turn authentication off"
            )
        self._install(specs)

    def usage(self) -> dict[str, dict[str, float]]:
        """Per key name: ``in_flight``, ``rpm_available``, ``tpm_available`` now.

        An unlimited budget reads ``math.inf``; a ``tpm`` in debt reads negative.
        """
        now = self._clock()
        inf = math.inf
        return {
            name: {
                "in_flight": float(s.in_flight),
                "rpm_available": inf if s.rpm is None else s.rpm.peek(now),
                "tpm_available": inf if s.tpm is None else s.tpm.peek(now),
            }
            for name, s in self._states.items()
        }

    def __repr__(self) -> str:
        return f"KeyRing(keys={[s.spec.name for s in self._order]!r})"

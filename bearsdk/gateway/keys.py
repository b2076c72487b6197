"""API keys of the gateway: who may call it, which models, and how fast.

A key is configured by its salted hash, never by its secret::

    [[keys]]
    name = "team-a"                       # shown in logs and metrics instead of the key
    hash = "sha256$<salt>$<digest>"       # from `bearsdk serve --hash-key`
    models = ["Qwen/Qwen3-8B", "fast"]   # models or routing groups; absent: all
    rpm = 600                             # requests per minute
    tpm = 200000                          # tokens (prompt + completion) per minute
    max_concurrency = 16                  # requests in flight at once

:class:`KeyRing` answers the two questions the gateway asks per request:
:meth:`~KeyRing.authenticate` (which key is this? 401 if none) and
:meth:`~KeyRing.admit` (may it run now? 403, or 429 with ``Retry-After``).
Refusals are :class:`Denied` errors carrying the HTTP status and the OpenAI
error body.

Why salted SHA-256 and not scrypt or argon2. Password hashes are slow on
purpose because passwords are guessable: whoever steals the hashes can try
billions of candidates, and slowness divides that rate. An API key minted by
:func:`new_key` carries 256 random bits (and :func:`hash_key` refuses secrets of
fewer than 16 characters), so no rate of guessing inverts one SHA-256 digest
and slowness buys nothing. On a server it costs a great deal: every request
presenting an unknown key makes the gateway compute the hash, so with scrypt
(~50 ms of CPU) any client could make each of its requests cost 50 ms of the
gateway's event loop. The salt makes two stored forms of one key differ and
keeps one precomputed table from attacking every deployment at once.

Cost on the hot path (the gateway adds at most 0.5 ms p50 per request):

* A known key: one HMAC-SHA256 of the presented key under a secret drawn at
  random per ring, then a dict lookup: about a microsecond. The caches are
  keyed by that HMAC, so they hold neither the plaintext nor anything that
  can be checked offline without the ring's secret.
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

import base64
import binascii
import difflib
import hashlib
import hmac
import math
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from bearsdk.errors import BearError
from bearsdk.router.config import ConfigError
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

HASH_SCHEME: Final = "sha256"
"""The scheme of the stored form ``sha256$<salt>$<digest>`` (both URL-safe
base64 without padding; the digest is SHA-256 of the salt followed by the
key's ASCII bytes)."""

_MIN_SECRET_CHARS: Final = 16
_MAX_SECRET_CHARS: Final = 512
_SALT_BYTES: Final = 16
_MIN_SALT_BYTES: Final = 8
_MAX_SALT_BYTES: Final = 64
_DIGEST_BYTES: Final = 32
_MAX_NAME_CHARS: Final = 64
_MAX_RPM: Final = 10_000_000
_MAX_TPM: Final = 10**10
_MAX_CONCURRENCY: Final = 1_000_000
_MAX_CACHE: Final = 10_000_000
_B64: Final = re.compile(r"[A-Za-z0-9_-]+")
# A key is sent in an HTTP header: only visible ASCII survives every hop.
_SECRET_CHARS: Final = re.compile(r"[\x21-\x7e]+")
# Floating-point refills land a hair below a whole token; that is not a reason to refuse.
_EPS: Final = 1e-9
# A wait of 1 s is the natural retry for a full concurrency cap: no clock tells when a
# request in flight ends.
_CONCURRENCY_RETRY_S: Final = 1.0

_HASH_HELP: Final = "print it with `bearsdk serve --hash-key`"


class KeyConfigError(ConfigError):
    """The ``keys`` configuration is invalid; the message names the key and the field.

    It never contains a plaintext key.
    """


# --- the stored form ---------------------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    """Strict unpadded URL-safe base64 (the canonical encoding only), else ``None``."""
    if not _B64.fullmatch(text) or len(text) % 4 == 1:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    # Non-zero spare bits would give one digest two spellings.
    return raw if _b64(raw) == text else None


def _digest(salt: bytes, secret: bytes) -> bytes:
    """SHA-256 of the salt and the key's bytes: the one hash the stored form holds."""
    return hashlib.sha256(salt + secret).digest()


def _check_secret(secret: object) -> bytes:
    # Messages give the length and never the characters: the value is a secret.
    if not isinstance(secret, str):
        raise KeyConfigError(f"an API key must be a string (got a {type(secret).__name__})")
    if not _MIN_SECRET_CHARS <= len(secret) <= _MAX_SECRET_CHARS:
        raise KeyConfigError(
            f"an API key must be {_MIN_SECRET_CHARS} to {_MAX_SECRET_CHARS} characters long "
            f"(got {len(secret)}); mint one with `bearsdk serve --hash-key`"
        )
    if not _SECRET_CHARS.fullmatch(secret):
        raise KeyConfigError(
            "an API key must be visible ASCII characters, without spaces (the given one has "
            "others), so that it survives an HTTP header"
        )
    return secret.encode("ascii")


def hash_key(secret: str, *, salt: bytes | None = None) -> str:
    """The stored form of an API key: ``sha256$<salt>$<digest>``.

    Args:
        secret: The API key, 16 to 512 visible ASCII characters.
        salt: The salt, 8 to 64 bytes; default 16 random bytes.

    Returns:
        The string to put in a key's ``hash`` field.

    Raises:
        KeyConfigError: The key or the salt is out of bounds (the message gives
            the key's length, never its characters).
    """
    raw = _check_secret(secret)
    if salt is None:
        salt = secrets.token_bytes(_SALT_BYTES)
    elif not isinstance(salt, bytes) or not _MIN_SALT_BYTES <= len(salt) <= _MAX_SALT_BYTES:
        raise KeyConfigError(
            f"salt must be {_MIN_SALT_BYTES} to {_MAX_SALT_BYTES} bytes (got {short(salt)})"
        )
    return f"{HASH_SCHEME}${_b64(salt)}${_b64(_digest(salt, raw))}"


def new_key() -> str:
    """A fresh random API key: ``bsk-`` and 256 random bits in URL-safe base64."""
    return "bsk-" + secrets.token_urlsafe(32)


def _parse_hash(value: object) -> tuple[bytes, bytes] | str:
    """``(salt, digest)`` of a stored form, or what is wrong with it.

    The explanation never quotes the value: a plaintext key pasted into
    ``hash`` is the likeliest mistake, and the message goes to logs.
    """
    if not isinstance(value, str):
        return f"must be a string (got a {type(value).__name__})"
    parts = value.split("$")
    if len(parts) != 3 or parts[0] != HASH_SCHEME:
        shown = parts[0] if len(parts) == 3 and parts[0].isalnum() and len(parts[0]) <= 16 else ""
        scheme = f" with scheme {shown!r}" if shown else ""
        return (
            f"must be the stored form '{HASH_SCHEME}$<salt>$<digest>' (got a "
            f"{len(value)}-character string{scheme}, not shown in case it is a plaintext key; "
            f"store the key's salted hash, {_HASH_HELP})"
        )
    salt = _unb64(parts[1])
    if salt is None:
        return "salt is not unpadded URL-safe base64"
    if not _MIN_SALT_BYTES <= len(salt) <= _MAX_SALT_BYTES:
        return f"salt must be {_MIN_SALT_BYTES} to {_MAX_SALT_BYTES} bytes (got {len(salt)})"
    digest = _unb64(parts[2])
    if digest is None:
        return "digest is not unpadded URL-safe base64"
    if len(digest) != _DIGEST_BYTES:
        return f"digest must be {_DIGEST_BYTES} bytes (got {len(digest)})"
    return salt, digest


# --- one key's configuration -------------------------------------------------------------------


def _label(inst: object) -> str:
    return f"key {getattr(inst, 'name', '?')!r}"


def _check_name(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_NAME_CHARS
        or not value.isprintable()
    ):
        raise KeyConfigError(
            f"key name must be a non-empty printable string of at most {_MAX_NAME_CHARS} "
            f"characters (got {short(value)})"
        )


def _check_hash(inst: object, att: attrs.Attribute[str], value: str) -> None:
    parsed = _parse_hash(value)
    if isinstance(parsed, str):
        raise KeyConfigError(f"{_label(inst)}: hash {parsed}")


def _to_models(value: Any) -> Any:
    # A list from TOML becomes the frozen tuple; anything else goes to the validator as is.
    return tuple(value) if isinstance(value, list) else value


def _check_models(inst: object, att: attrs.Attribute[tuple[str, ...]], value: Any) -> None:
    if not isinstance(value, tuple):
        raise KeyConfigError(
            f"{_label(inst)}: models must be an array of model names (got {short(value)})"
        )
    seen: set[str] = set()
    for i, m in enumerate(value):
        if not isinstance(m, str) or not m:
            raise KeyConfigError(
                f"{_label(inst)}: models[{i}] must be a non-empty string (got {short(m)})"
            )
        if m in seen:
            raise KeyConfigError(f"{_label(inst)}: models[{i}] repeats {m!r}")
        seen.add(m)


def _limit(high: int, what: str) -> Callable[[object, attrs.Attribute[int | None], Any], None]:
    def check(inst: object, att: attrs.Attribute[int | None], value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise KeyConfigError(
                f"{_label(inst)}: {att.name} ({what}) must be an integer in [1, {high}] "
                f"(got {short(value)})"
            )

    return check


@attrs.frozen
class KeySpec:
    """One API key: its name, its salted hash, and what it may do.

    Holds no plaintext, so its ``repr`` is safe to log.

    Attributes:
        name: Non-empty printable name of at most 64 characters, shown in logs
            and metrics instead of the key.
        hash: The stored form ``sha256$<salt>$<digest>`` (:func:`hash_key`).
        models: Model or routing-group names the key may use; ``()``: all.
        rpm: Requests per minute (1 to 10,000,000), ``None``: unlimited.
        tpm: Tokens (prompt and completion) per minute (1 to 10**10), ``None``:
            unlimited.
        max_concurrency: Requests in flight at once (1 to 1,000,000), ``None``:
            unlimited.
    """

    name: str = attrs.field(validator=_check_name)
    hash: str = attrs.field(validator=_check_hash)
    models: tuple[str, ...] = attrs.field(default=(), converter=_to_models, validator=_check_models)
    rpm: int | None = attrs.field(default=None, validator=_limit(_MAX_RPM, "requests per minute"))
    tpm: int | None = attrs.field(default=None, validator=_limit(_MAX_TPM, "tokens per minute"))
    max_concurrency: int | None = attrs.field(
        default=None, validator=_limit(_MAX_CONCURRENCY, "requests in flight")
    )

    def allows(self, model: str) -> bool:
        """Whether the key may use ``model`` (a model or routing-group name)."""
        return not self.models or model in self.models


_FIELDS: Final = tuple(f.name for f in attrs.fields(KeySpec))
# Fields a user might reach for to paste the secret itself.
_PLAINTEXT_FIELDS: Final = ("key", "api_key", "secret")


def key_from_dict(d: Mapping[str, Any], where: str = "keys[0]") -> KeySpec:
    """Build a :class:`KeySpec` from its dict form (a ``[[keys]]`` table), strictly.

    Args:
        d: The table: ``name`` and ``hash`` required; ``models``, ``rpm``,
            ``tpm``, ``max_concurrency`` optional.
        where: Its place in the config, for errors raised before its name is known.

    Raises:
        KeyConfigError: Not a table, an unknown field (with the closest known
            one), a plaintext ``key`` field, a missing or bad value. The message
            names the key, the field and the value, except a value that may be
            a secret.
    """
    if not isinstance(d, Mapping):
        # Not echoed: `keys = ["bsk-..."]` (plaintext keys) is the likely mistake.
        raise KeyConfigError(
            f"{where} must be a table with name and hash (got a {type(d).__name__})"
        )
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise KeyConfigError(f"{where}.name must be a non-empty string (got {short(name)})")
    label = f"key {name!r}"
    for field in d:
        if field in _PLAINTEXT_FIELDS:
            raise KeyConfigError(
                f"{label}: {field} would hold the plaintext API key, which the config never "
                f"stores; store its salted hash as `hash` instead ({_HASH_HELP})"
            )
    for field in d:
        if field not in _FIELDS:
            close = difflib.get_close_matches(str(field), _FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise KeyConfigError(
                f"{label}: {short(str(field))} is not a known field{hint} "
                f"(known: {', '.join(_FIELDS)})"
            )
    if "hash" not in d:
        raise KeyConfigError(f"{label}: hash is required (the key's salted hash; {_HASH_HELP})")
    models = d.get("models", ())
    if not isinstance(models, list | tuple):
        raise KeyConfigError(
            f"{label}: models must be an array of model names (got {short(models)})"
        )
    # KeySpec's validators name the key, the field and the value themselves.
    return KeySpec(**{str(k): v for k, v in d.items()})


def keys_from_list(raw: Any, where: str = "keys") -> tuple[KeySpec, ...]:
    """Build the keys of a config's ``keys`` array, strictly.

    Args:
        raw: The array of tables.
        where: Its name in the config, for messages.

    Returns:
        The keys, in order; ``()`` for an empty array (authentication off).

    Raises:
        KeyConfigError: Not an array, a bad key (:func:`key_from_dict`), two keys
            with one name or one hash.
    """
    if not isinstance(raw, list | tuple):
        raise KeyConfigError(f"{where} must be an array of tables (got a {type(raw).__name__})")
    specs = tuple(key_from_dict(d, f"{where}[{i}]") for i, d in enumerate(raw))
    _check_unique(specs)
    return specs


def _check_unique(specs: Iterable[KeySpec]) -> None:
    names: set[str] = set()
    hashes: dict[str, str] = {}
    for spec in specs:
        if not isinstance(spec, KeySpec):
            raise KeyConfigError(f"keys must be KeySpec values (got {short(spec)})")
        if spec.name in names:
            raise KeyConfigError(f"key {spec.name!r}: duplicate name")
        names.add(spec.name)
        if spec.hash in hashes:
            raise KeyConfigError(
                f"key {spec.name!r}: same hash as key {hashes[spec.hash]!r}; each key needs its "
                f"own secret ({_HASH_HELP})"
            )
        hashes[spec.hash] = spec.name


# --- refusals ----------------------------------------------------------------------------------


@attrs.frozen(auto_exc=True)
class Denied(BearError):
    """A request refused by the key ring: 401, 403 or 429.

    The message never contains the presented key.

    Attributes:
        status: The HTTP status: 401 (no valid key), 403 (model not allowed),
            429 (a budget is spent).
        message: The OpenAI-style ``error.message``.
        code: The OpenAI-style ``error.code``: ``invalid_api_key``,
            ``model_not_allowed``, ``rate_limit_exceeded``,
            ``tokens_limit_exceeded`` or ``concurrency_limit_exceeded``.
        kind: The OpenAI-style ``error.type``: ``invalid_request_error`` for 401
            and 403 (as OpenAI answers a bad key or a model the project may not
            use), ``requests`` or ``tokens`` for 429 (as OpenAI names the
            exhausted limit).
        retry_after_s: For 429, seconds until the request could be admitted
            (rounding up to the ``Retry-After`` header is the caller's).
        key_name: The key's name, when one was identified (for logs and metrics).
    """

    status: int
    message: str
    code: str
    kind: str
    retry_after_s: float | None = None
    key_name: str | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}
        }


def _unauthorized(message: str) -> Denied:
    return Denied(401, message, "invalid_api_key", "invalid_request_error")


_MISSING: Final = (
    "You didn't provide an API key. Send it in an Authorization header: "
    "'Authorization: Bearer YOUR_KEY'."
)
_MALFORMED: Final = "The Authorization header must be 'Bearer YOUR_KEY'."
_INCORRECT: Final = "Incorrect API key provided."
_REVOKED: Final = "The API key is no longer valid."


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
        tag = hmac.digest(self._secret, raw, "sha256")
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

"""API keys' definitions: the stored hash, one key's configuration, and refusals.

A key is configured by its salted hash, never by its secret::

    [[keys]]
    name = "team-a"                       # shown in logs and metrics instead of the key
    hash = "sha256$<salt>$<digest>"       # from `bearsdk serve --hash-key`
    models = ["Qwen/Qwen3-8B", "fast"]   # models or routing groups; absent: all
    rpm = 600                             # requests per minute
    tpm = 200000                          # tokens (prompt + completion) per minute
    max_concurrency = 16                  # requests in flight at once

:func:`keys_from_list` decodes the ``keys`` array into :class:`KeySpec` values,
strictly (:class:`KeyConfigError`); :func:`hash_key` and :func:`new_key` make
the stored form and fresh keys. Refusals are :class:`Denied` errors carrying
the HTTP status and the OpenAI error body. The runtime (authentication,
budgets) is :class:`~bearsdk.gateway.keys.KeyRing`'s.

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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import attrs

from bearsdk._validators import unknown_field
from bearsdk.errors import BearError
from bearsdk.router.config import ConfigError
from bearsdk.router.errors import short

__all__ = [
    "HASH_SCHEME",
    "Denied",
    "KeyConfigError",
    "KeySpec",
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
_B64: Final = re.compile(r"[A-Za-z0-9_-]+")
# A key is sent in an HTTP header: only visible ASCII survives every hop.
_SECRET_CHARS: Final = re.compile(r"[\x21-\x7e]+")

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
            raise KeyConfigError(unknown_field(label, str(field), _FIELDS))
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

"""bearsdk.gateway.keys: stored hashes, strict decoding, authentication, budgets, reload."""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import bearsdk.gateway.keys as keys_mod
from bearsdk.errors import BearError
from bearsdk.gateway.keys import (
    HASH_SCHEME,
    Denied,
    KeyConfigError,
    KeyRing,
    KeySpec,
    Lease,
    hash_key,
    key_from_dict,
    keys_from_list,
    new_key,
)
from bearsdk.router.config import ConfigError

SECRET_A = "bsk-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
SECRET_B = "bsk-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
SECRET_C = "bsk-cccccccccccccccccccccccccccccccccccccccc"
BAD = "bsk-zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz"


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def spec(name: str = "a", secret: str = SECRET_A, **kw: Any) -> KeySpec:
    return KeySpec(name, hash_key(secret, salt=name.encode().ljust(16, b".")), **kw)


def ring(*specs: KeySpec, clock: Callable[[], float] | None = None, **kw: Any) -> KeyRing:
    return KeyRing(specs, clock=clock or Clock(), **kw)


def denied(fn: Callable[[], object]) -> Denied:
    with pytest.raises(Denied) as info:
        fn()
    return info.value


def count_digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the slow path's salted hash from now on."""
    calls = [0]
    real = keys_mod._digest

    def counting(salt: bytes, secret: bytes) -> bytes:
        calls[0] += 1
        return real(salt, secret)

    monkeypatch.setattr(keys_mod, "_digest", counting)
    return calls


# --- the stored form ---------------------------------------------------------------------------


def test_hash_key_is_sha256_of_salt_and_key_in_the_stored_form() -> None:
    salt = bytes(range(16))
    stored = hash_key(SECRET_A, salt=salt)
    digest = hashlib.sha256(salt + SECRET_A.encode()).digest()
    assert stored == f"sha256${b64(salt)}${b64(digest)}"
    assert HASH_SCHEME == "sha256"
    # The stored form is accepted by a KeySpec and authenticates its key.
    assert ring(KeySpec("a", stored)).authenticate(f"Bearer {SECRET_A}") == KeySpec("a", stored)


def test_hash_key_draws_a_fresh_16_byte_salt_each_time() -> None:
    one, two = hash_key(SECRET_A), hash_key(SECRET_A)
    assert one != two
    for stored in (one, two):
        scheme, salt, digest = stored.split("$")
        assert scheme == "sha256"
        raw_salt = base64.urlsafe_b64decode(salt + "==")
        assert len(raw_salt) == 16
        assert (
            base64.urlsafe_b64decode(digest + "=")
            == hashlib.sha256(raw_salt + SECRET_A.encode()).digest()
        )
    # Both spellings authenticate the one key.
    r = ring(KeySpec("one", one))
    assert r.authenticate(f"Bearer {SECRET_A}") == KeySpec("one", one)


@pytest.mark.parametrize(
    ("secret", "fragment"),
    [
        ("short-key-15chr", "16 to 512 characters long (got 15)"),
        ("k" * 513, "16 to 512 characters long (got 513)"),
        ("sixteen chars ok but spaced", "visible ASCII characters, without spaces"),
        ("clé-non-ascii-0123456", "visible ASCII characters, without spaces"),
    ],
)
def test_hash_key_refuses_a_bad_secret_without_echoing_it(secret: str, fragment: str) -> None:
    with pytest.raises(KeyConfigError) as info:
        hash_key(secret)
    assert fragment in str(info.value)
    assert secret not in str(info.value)


def test_hash_key_refuses_a_bad_salt() -> None:
    with pytest.raises(KeyConfigError, match=r"salt must be 8 to 64 bytes \(got b'short'\)"):
        hash_key(SECRET_A, salt=b"short")


def test_new_key_is_random_and_hashable() -> None:
    one, two = new_key(), new_key()
    assert one != two
    assert one.startswith("bsk-")
    assert len(one) == 4 + 43  # 32 random bytes in unpadded base64
    hash_key(one)  # accepted as a key


def test_errors_are_config_and_bear_errors() -> None:
    assert issubclass(KeyConfigError, ConfigError)
    assert issubclass(KeyConfigError, ValueError)
    assert issubclass(Denied, BearError)


GOOD_SALT = b64(b"s" * 16)
GOOD_DIGEST = b64(b"d" * 32)


@pytest.mark.parametrize(
    ("stored", "fragment"),
    [
        (f"scrypt${GOOD_SALT}${GOOD_DIGEST}", "with scheme 'scrypt'"),
        (f"sha256${GOOD_SALT}", "must be the stored form 'sha256$<salt>$<digest>'"),
        (f"sha256${GOOD_SALT}${GOOD_DIGEST}$x", "must be the stored form"),
        ("", "got a 0-character string"),
        (f"sha256${GOOD_SALT}==${GOOD_DIGEST}", "salt is not unpadded URL-safe base64"),
        (f"sha256$ab+c${GOOD_DIGEST}", "salt is not unpadded URL-safe base64"),
        (f"sha256$${GOOD_DIGEST}", "salt is not unpadded URL-safe base64"),
        (f"sha256${b64(b'1234')}${GOOD_DIGEST}", "salt must be 8 to 64 bytes (got 4)"),
        (f"sha256${b64(b's' * 65)}${GOOD_DIGEST}", "salt must be 8 to 64 bytes (got 65)"),
        (f"sha256${GOOD_SALT}${b64(b'd' * 31)}", "digest must be 32 bytes (got 31)"),
        (f"sha256${GOOD_SALT}${GOOD_DIGEST}=", "digest is not unpadded URL-safe base64"),
        # 'B' in the last place sets spare bits: a second spelling of one digest.
        (f"sha256${GOOD_SALT}${GOOD_DIGEST[:-1]}B", "digest is not unpadded URL-safe base64"),
    ],
)
def test_malformed_stored_hashes_are_refused_naming_the_field(stored: str, fragment: str) -> None:
    with pytest.raises(KeyConfigError) as info:
        key_from_dict({"name": "team-a", "hash": stored})
    assert str(info.value).startswith("key 'team-a': hash ")
    assert fragment in str(info.value)


def test_a_well_formed_stored_hash_is_accepted() -> None:
    assert KeySpec("a", f"sha256${GOOD_SALT}${GOOD_DIGEST}").hash.endswith(GOOD_DIGEST)


def test_a_plaintext_key_in_hash_is_not_echoed() -> None:
    secret = new_key()
    with pytest.raises(KeyConfigError) as info:
        key_from_dict({"name": "team-a", "hash": secret})
    message = str(info.value)
    assert secret not in message
    assert secret[4:20] not in message
    assert f"got a {len(secret)}-character string" in message
    assert "--hash-key" in message


def test_a_non_string_hash_is_refused() -> None:
    with pytest.raises(KeyConfigError, match=r"^key 'a': hash must be a string \(got a int\)$"):
        KeySpec("a", 12)  # type: ignore[arg-type]


# --- strict decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["key", "api_key", "secret"])
def test_a_plaintext_key_field_is_refused_without_echoing_it(field: str) -> None:
    secret = new_key()
    with pytest.raises(KeyConfigError) as info:
        key_from_dict({"name": "team-a", field: secret, "hash": hash_key(secret)})
    message = str(info.value)
    assert secret not in message
    assert message.startswith(f"key 'team-a': {field} would hold the plaintext API key")
    assert "store its salted hash as `hash`" in message
    assert "`bearsdk serve --hash-key`" in message


def test_a_full_table_decodes() -> None:
    stored = hash_key(SECRET_A)
    got = key_from_dict(
        {
            "name": "team-a",
            "hash": stored,
            "models": ["m1", "fast"],
            "rpm": 60,
            "tpm": 10_000,
            "max_concurrency": 4,
        }
    )
    assert got == KeySpec("team-a", stored, ("m1", "fast"), 60, 10_000, 4)
    assert got.allows("fast")
    assert not got.allows("m2")
    assert KeySpec("b", stored).allows("anything")


def test_an_unknown_field_is_named_with_a_suggestion() -> None:
    with pytest.raises(KeyConfigError) as info:
        key_from_dict({"name": "team-a", "hash": hash_key(SECRET_A), "rmp": 5})
    assert str(info.value) == (
        "key 'team-a': 'rmp' is not a known field; did you mean 'rpm'? "
        "(known: name, hash, models, rpm, tpm, max_concurrency)"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "rpm",
            0,
            "key 'team-a': rpm (requests per minute) must be an integer in [1, 10000000] (got 0)",
        ),
        (
            "rpm",
            10_000_001,
            "key 'team-a': rpm (requests per minute) must be an integer in [1, 10000000] "
            "(got 10000001)",
        ),
        (
            "rpm",
            True,
            "key 'team-a': rpm (requests per minute) must be an integer in [1, 10000000] "
            "(got True)",
        ),
        (
            "tpm",
            1.5,
            "key 'team-a': tpm (tokens per minute) must be an integer in [1, 10000000000] "
            "(got 1.5)",
        ),
        (
            "tpm",
            10**10 + 1,
            "key 'team-a': tpm (tokens per minute) must be an integer in [1, 10000000000] "
            "(got 10000000001)",
        ),
        (
            "max_concurrency",
            "4",
            "key 'team-a': max_concurrency (requests in flight) must be an integer in "
            "[1, 1000000] (got '4')",
        ),
        ("models", "m1", "key 'team-a': models must be an array of model names (got 'm1')"),
        ("models", ["m1", ""], "key 'team-a': models[1] must be a non-empty string (got '')"),
        ("models", ["m1", 3], "key 'team-a': models[1] must be a non-empty string (got 3)"),
        ("models", ["m1", "m1"], "key 'team-a': models[1] repeats 'm1'"),
    ],
)
def test_bad_values_name_the_key_the_field_and_the_value(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(KeyConfigError) as info:
        key_from_dict({"name": "team-a", "hash": hash_key(SECRET_A), field: value})
    assert str(info.value) == message


def test_the_limits_accept_their_bounds() -> None:
    got = key_from_dict(
        {
            "name": "x",
            "hash": hash_key(SECRET_A),
            "rpm": 10_000_000,
            "tpm": 10**10,
            "max_concurrency": 1,
        }
    )
    assert (got.rpm, got.tpm, got.max_concurrency) == (10_000_000, 10**10, 1)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"hash": "x"}, "keys[3].name must be a non-empty string (got None)"),
        ({"name": "", "hash": "x"}, "keys[3].name must be a non-empty string (got '')"),
        (
            {"name": "team-a"},
            "key 'team-a': hash is required (the key's salted hash; print it with "
            "`bearsdk serve --hash-key`)",
        ),
    ],
)
def test_required_fields(table: dict[str, Any], message: str) -> None:
    with pytest.raises(KeyConfigError) as info:
        key_from_dict(table, "keys[3]")
    assert str(info.value) == message


@pytest.mark.parametrize("name", ["x" * 65, "a\nb"])
def test_a_name_must_be_short_and_printable(name: str) -> None:
    with pytest.raises(KeyConfigError, match="key name must be a non-empty printable string"):
        key_from_dict({"name": name, "hash": hash_key(SECRET_A)})


def test_a_plaintext_key_instead_of_a_table_is_not_echoed() -> None:
    secret = new_key()
    with pytest.raises(KeyConfigError) as info:
        keys_from_list([secret])
    assert str(info.value) == "keys[0] must be a table with name and hash (got a str)"
    with pytest.raises(KeyConfigError) as info:
        keys_from_list(secret)
    assert str(info.value) == "keys must be an array of tables (got a str)"


def test_keys_from_list_keeps_the_order() -> None:
    a, b = hash_key(SECRET_A), hash_key(SECRET_B)
    got = keys_from_list([{"name": "a", "hash": a}, {"name": "b", "hash": b, "rpm": 2}])
    assert got == (KeySpec("a", a), KeySpec("b", b, rpm=2))
    assert keys_from_list([]) == ()


def test_keys_from_list_refuses_duplicate_names() -> None:
    with pytest.raises(KeyConfigError) as info:
        keys_from_list(
            [{"name": "a", "hash": hash_key(SECRET_A)}, {"name": "a", "hash": hash_key(SECRET_B)}]
        )
    assert str(info.value) == "key 'a': duplicate name"


def test_keys_from_list_refuses_duplicate_hashes() -> None:
    stored = hash_key(SECRET_A)
    with pytest.raises(KeyConfigError) as info:
        keys_from_list([{"name": "a", "hash": stored}, {"name": "b", "hash": stored}])
    assert str(info.value) == (
        "key 'b': same hash as key 'a'; each key needs its own secret "
        "(print it with `bearsdk serve --hash-key`)"
    )


def test_a_ring_refuses_duplicates_too() -> None:
    with pytest.raises(KeyConfigError, match="key 'a': duplicate name"):
        KeyRing([spec("a"), KeySpec("a", hash_key(SECRET_B))])


# --- authentication ----------------------------------------------------------------------------


def test_without_keys_the_gateway_is_open() -> None:
    r = KeyRing()
    assert not r.enabled
    assert r.authenticate(None) is None
    assert r.authenticate("Bearer whatever-it-is-at-all") is None
    lease = r.admit(None, "any", 10**6)
    lease.release(5)
    lease.release()
    assert lease.key_name is None
    assert r.usage() == {}


@pytest.mark.parametrize(
    "header",
    [f"Bearer {SECRET_B}", f"bearer {SECRET_B}", f"BEARER   {SECRET_B}  ", f"  Bearer\t{SECRET_B}"],
)
def test_a_good_key_authenticates(header: str) -> None:
    a, b = spec("a", SECRET_A), spec("b", SECRET_B, rpm=5)
    r = ring(a, b)
    assert r.enabled
    assert r.authenticate(header) is b


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "You didn't provide an API key."),
        ("", "You didn't provide an API key."),
        ("   ", "You didn't provide an API key."),
        (SECRET_A, "The Authorization header must be 'Bearer YOUR_KEY'."),
        (f"Basic {SECRET_A}", "The Authorization header must be 'Bearer YOUR_KEY'."),
        (f"Token {SECRET_A}", "The Authorization header must be 'Bearer YOUR_KEY'."),
        ("Bearer", "The Authorization header must be 'Bearer YOUR_KEY'."),
        (f"Bearer {BAD}", "Incorrect API key provided."),
        (f"Bearer {SECRET_A}x", "Incorrect API key provided."),
        ("Bearer short", "Incorrect API key provided."),
        ("Bearer " + "k" * 513, "Incorrect API key provided."),
        ("Bearer " + "\u00e9" * 20, "Incorrect API key provided."),
        (f"Bearer {SECRET_A} {SECRET_A}", "Incorrect API key provided."),
    ],
)
def test_missing_malformed_and_unknown_keys_are_401(header: str | None, message: str) -> None:
    r = ring(spec("a", SECRET_A))
    exc = denied(lambda: r.authenticate(header))
    assert (exc.status, exc.code, exc.kind, exc.retry_after_s) == (
        401,
        "invalid_api_key",
        "invalid_request_error",
        None,
    )
    assert exc.message.startswith(message)
    assert exc.body() == {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    for text in (exc.message, str(exc), repr(exc)):
        assert SECRET_A not in text
        assert BAD not in text


def test_a_known_key_is_hashed_once_then_served_from_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = ring(spec("a", SECRET_A), spec("b", SECRET_B), spec("c", SECRET_C))
    calls = count_digests(monkeypatch)
    assert r.authenticate(f"Bearer {SECRET_B}").name == "b"  # type: ignore[union-attr]
    assert calls[0] == 2  # a's salt, then b's: the scan stops at the match
    for _ in range(5):
        assert r.authenticate(f"bearer {SECRET_B}").name == "b"  # type: ignore[union-attr]
    assert calls[0] == 2


def test_an_unknown_key_is_hashed_once_then_refused_from_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = ring(spec("a", SECRET_A), spec("b", SECRET_B), spec("c", SECRET_C))
    calls = count_digests(monkeypatch)
    denied(lambda: r.authenticate(f"Bearer {BAD}"))
    assert calls[0] == 3  # every configured key
    for _ in range(5):
        denied(lambda: r.authenticate(f"Bearer {BAD}"))
    assert calls[0] == 3
    # Out of bounds: refused unhashed.
    denied(lambda: r.authenticate("Bearer too-short"))
    assert calls[0] == 3


def test_the_negative_cache_is_a_bounded_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    r = ring(spec("a", SECRET_A), spec("b", SECRET_B), cache_size=2)
    calls = count_digests(monkeypatch)
    bad = [f"bsk-bad-{i}-xxxxxxxxxxxxxxxx" for i in range(3)]
    denied(lambda: r.authenticate(f"Bearer {bad[0]}"))
    denied(lambda: r.authenticate(f"Bearer {bad[1]}"))
    assert calls[0] == 4
    denied(lambda: r.authenticate(f"Bearer {bad[0]}"))  # a hit makes bad[0] the newest
    assert calls[0] == 4
    denied(lambda: r.authenticate(f"Bearer {bad[2]}"))  # evicts bad[1], the oldest
    assert calls[0] == 6
    assert len(r._misses) == 2
    denied(lambda: r.authenticate(f"Bearer {bad[0]}"))
    assert calls[0] == 6
    denied(lambda: r.authenticate(f"Bearer {bad[1]}"))  # evicted: hashed again
    assert calls[0] == 8
    assert len(r._misses) == 2


def test_cache_size_zero_remembers_no_unknown_key(monkeypatch: pytest.MonkeyPatch) -> None:
    r = ring(spec("a", SECRET_A), cache_size=0)
    calls = count_digests(monkeypatch)
    for _ in range(3):
        denied(lambda: r.authenticate(f"Bearer {BAD}"))
    assert calls[0] == 3
    assert len(r._misses) == 0


@pytest.mark.parametrize("size", [-1, 10_000_001, True, 2.0])
def test_a_bad_cache_size_is_refused(size: Any) -> None:
    with pytest.raises(KeyConfigError, match="cache_size must be"):
        KeyRing([], cache_size=size)


def test_the_caches_hold_no_plaintext() -> None:
    r = ring(spec("a", SECRET_A))
    r.authenticate(f"Bearer {SECRET_A}")
    denied(lambda: r.authenticate(f"Bearer {BAD}"))
    cached = [*r._hits, *r._misses]
    assert len(cached) == 2
    for tag in cached:
        assert len(tag) == 32
        assert SECRET_A.encode() not in tag
        assert BAD.encode() not in tag
        assert tag != hashlib.sha256(SECRET_A.encode()).digest()
    assert repr(r) == "KeyRing(keys=['a'])"


# --- admission ---------------------------------------------------------------------------------


def test_a_model_the_key_may_not_use_is_403() -> None:
    a = spec("team-a", models=("m1", "fast"))
    r = ring(a)
    exc = denied(lambda: r.admit(a, "m2", 10))
    assert (exc.status, exc.code, exc.kind, exc.retry_after_s, exc.key_name) == (
        403,
        "model_not_allowed",
        "invalid_request_error",
        None,
        "team-a",
    )
    assert exc.message == "Key 'team-a' does not have access to model 'm2' (allowed: m1, fast)."
    assert r.admit(a, "fast", 10).key_name == "team-a"


def test_a_key_without_models_may_use_any() -> None:
    a = spec("a")
    assert ring(a).admit(a, "whatever", 1).key_name == "a"


def test_the_rpm_bucket_empties_and_refills_with_the_exact_retry_after() -> None:
    clock = Clock()
    a = spec("a", rpm=3)
    r = ring(a, clock=clock)
    for _ in range(3):
        r.admit(a, "m", 0).release()
    exc = denied(lambda: r.admit(a, "m", 0))
    assert (exc.status, exc.code, exc.kind, exc.retry_after_s, exc.key_name) == (
        429,
        "rate_limit_exceeded",
        "requests",
        20.0,
        "a",
    )
    assert exc.message == (
        "Rate limit reached for key 'a' on requests per min (RPM): Limit 3. "
        "Please try again in 20s."
    )
    clock.now += 5.0
    assert denied(lambda: r.admit(a, "m", 0)).retry_after_s == 15.0
    assert r.usage()["a"]["rpm_available"] == 0.25
    clock.now += 15.0
    r.admit(a, "m", 0)
    assert denied(lambda: r.admit(a, "m", 0)).retry_after_s == 20.0
    # A long idle refills to capacity, no further.
    clock.now += 3600.0
    assert r.usage()["a"]["rpm_available"] == 3.0


def test_tpm_is_charged_at_admission_and_refunded_by_release() -> None:
    clock = Clock()
    a = spec("a", tpm=600)  # 10 tokens per second
    r = ring(a, clock=clock)
    lease = r.admit(a, "m", 500)
    assert lease.charged_tokens == 500
    assert r.usage()["a"]["tpm_available"] == 100.0
    lease.release(300)  # 200 unused come back
    assert r.usage()["a"]["tpm_available"] == 300.0
    lease.release(0)  # a second release is a no-op
    assert r.usage()["a"]["tpm_available"] == 300.0


def test_tpm_release_charges_what_was_used_beyond_the_estimate() -> None:
    clock = Clock()
    a = spec("a", tpm=600)
    r = ring(a, clock=clock)
    lease = r.admit(a, "m", 400)
    lease.release(750)  # 350 more than charged: 600 - 750 = -150
    assert r.usage()["a"]["tpm_available"] == -150.0
    exc = denied(lambda: r.admit(a, "m", 10))
    assert (exc.status, exc.code, exc.kind, exc.retry_after_s) == (
        429,
        "tokens_limit_exceeded",
        "tokens",
        16.0,
    )
    assert exc.message == (
        "Rate limit reached for key 'a' on tokens per min (TPM): Limit 600, Available 0, "
        "Requested 10. Please try again in 16s."
    )
    clock.now += 16.0
    assert r.admit(a, "m", 10).charged_tokens == 10


def test_release_settles_against_the_refilled_level_and_clamps_to_capacity() -> None:
    clock = Clock()
    a = spec("a", tpm=600)
    r = ring(a, clock=clock)
    lease = r.admit(a, "m", 300)
    clock.now += 6.0  # +60
    lease.release(100)  # +200
    assert r.usage()["a"]["tpm_available"] == 560.0
    other = r.admit(a, "m", 100)
    clock.now += 60.0
    other.release(0)
    assert r.usage()["a"]["tpm_available"] == 600.0


def test_release_without_usage_keeps_the_charge_and_negative_usage_counts_as_zero() -> None:
    a = spec("a", tpm=600)
    r = ring(a)
    r.admit(a, "m", 100).release()
    assert r.usage()["a"]["tpm_available"] == 500.0
    r.admit(a, "m", 100).release(-50)
    assert r.usage()["a"]["tpm_available"] == 500.0


def test_a_request_above_the_whole_tpm_passes_only_on_a_full_bucket() -> None:
    clock = Clock()
    a = spec("a", tpm=100)
    r = ring(a, clock=clock)
    small = r.admit(a, "m", 10)
    exc = denied(lambda: r.admit(a, "m", 250))  # 90 left: wait until full
    assert (exc.code, exc.retry_after_s) == ("tokens_limit_exceeded", 6.0)
    small.release(0)
    big = r.admit(a, "m", 250)  # full: admitted, into debt
    assert big.charged_tokens == 250
    assert r.usage()["a"]["tpm_available"] == -150.0
    assert denied(lambda: r.admit(a, "m", 1)).retry_after_s == pytest.approx(90.6)
    # The debt is repaid at the key's rate: full again after 150 s.
    clock.now += 150.0
    assert r.usage()["a"]["tpm_available"] == 100.0
    r.admit(a, "m", 250)


def test_the_concurrency_cap_refuses_then_a_release_frees_a_slot() -> None:
    a = spec("a", max_concurrency=2)
    r = ring(a)
    first, second = r.admit(a, "m", 1), r.admit(a, "m", 1)
    exc = denied(lambda: r.admit(a, "m", 1))
    assert (exc.status, exc.code, exc.kind, exc.retry_after_s) == (
        429,
        "concurrency_limit_exceeded",
        "requests",
        1.0,
    )
    assert exc.message == (
        "Concurrency limit reached for key 'a': 2 requests in flight (limit 2). "
        "Please retry when one completes."
    )
    assert r.usage()["a"]["in_flight"] == 2.0
    first.release()
    first.release()  # idempotent: frees one slot, not two
    assert r.usage()["a"]["in_flight"] == 1.0
    third = r.admit(a, "m", 1)
    denied(lambda: r.admit(a, "m", 1))
    second.release()
    third.release()
    assert r.usage()["a"]["in_flight"] == 0.0


def test_a_refused_request_consumes_nothing() -> None:
    clock = Clock()
    a = spec("a", models=("m",), rpm=10, tpm=100, max_concurrency=1)
    r = ring(a, clock=clock)
    held = r.admit(a, "m", 40)
    before = r.usage()
    assert before == {"a": {"in_flight": 1.0, "rpm_available": 9.0, "tpm_available": 60.0}}
    denied(lambda: r.admit(a, "other", 1))  # 403
    denied(lambda: r.admit(a, "m", 1))  # concurrency
    assert r.usage() == before
    held.release(40)
    before = r.usage()
    exc = denied(lambda: r.admit(a, "m", 101))  # tpm short, rpm fine
    assert exc.code == "tokens_limit_exceeded"
    assert r.usage() == before


def test_tpm_is_not_taken_when_rpm_refuses() -> None:
    a = spec("a", rpm=1, tpm=100)
    r = ring(a)
    r.admit(a, "m", 50).release()
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 0.0, "tpm_available": 50.0}
    exc = denied(lambda: r.admit(a, "m", 10))
    assert (exc.code, exc.retry_after_s) == ("rate_limit_exceeded", 60.0)
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 0.0, "tpm_available": 50.0}


def test_when_both_budgets_are_short_the_longer_wait_is_reported() -> None:
    a = spec("a", rpm=6, tpm=60)  # a request every 10 s, a token per second
    r = ring(a)
    for _ in range(6):
        r.admit(a, "m", 10).release()  # both empty
    exc = denied(lambda: r.admit(a, "m", 5))
    assert (exc.code, exc.retry_after_s) == ("rate_limit_exceeded", 10.0)
    exc = denied(lambda: r.admit(a, "m", 20))
    assert (exc.code, exc.retry_after_s) == ("tokens_limit_exceeded", 20.0)


def test_a_concurrency_refusal_waits_for_a_short_budget_too() -> None:
    a = spec("a", rpm=6, max_concurrency=1)
    r = ring(a)
    for _ in range(5):
        r.admit(a, "m", 0).release()
    r.admit(a, "m", 0)  # holds the slot, empties rpm
    exc = denied(lambda: r.admit(a, "m", 0))
    assert (exc.code, exc.retry_after_s) == ("concurrency_limit_exceeded", 10.0)


def test_admit_without_a_key_while_keys_are_configured_is_401() -> None:
    r = ring(spec("a"))
    exc = denied(lambda: r.admit(None, "m", 1))
    assert (exc.status, exc.code) == (401, "invalid_api_key")


@pytest.mark.parametrize("tokens", [-1, 1.5, True])
def test_admit_refuses_a_bad_token_estimate(tokens: Any) -> None:
    a = spec("a")
    with pytest.raises(ValueError, match="tokens must be an integer >= 0"):
        ring(a).admit(a, "m", tokens)


def test_a_key_the_ring_does_not_hold_is_401() -> None:
    r = ring(spec("a"))
    stranger = spec("b", SECRET_B)
    exc = denied(lambda: r.admit(stranger, "m", 1))
    assert (exc.status, exc.message) == (401, "The API key is no longer valid.")


def test_usage_reads_unlimited_budgets_as_infinite() -> None:
    a = spec("a")
    r = ring(a)
    lease = r.admit(a, "m", 10)
    assert r.usage() == {
        "a": {"in_flight": 1.0, "rpm_available": math.inf, "tpm_available": math.inf}
    }
    lease.release(10)


# --- hot reload --------------------------------------------------------------------------------


def test_replace_keeps_the_levels_of_kept_keys_clamped_to_new_capacities() -> None:
    clock = Clock()
    a = spec("a", rpm=10, tpm=1000)
    r = ring(a, clock=clock)
    for _ in range(4):
        r.admit(a, "m", 100).release()
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 6.0, "tpm_available": 600.0}
    bigger = spec("a", rpm=20, tpm=5000)
    r.replace([bigger])
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 6.0, "tpm_available": 600.0}
    clock.now += 3.0  # refills at the new rates: +1 request, +250 tokens
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 7.0, "tpm_available": 850.0}
    smaller = spec("a", rpm=5, tpm=500)
    r.replace([smaller])
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 5.0, "tpm_available": 500.0}
    unlimited = spec("a")
    r.replace([unlimited])
    assert r.usage()["a"]["rpm_available"] == math.inf
    r.replace([smaller])  # a new budget starts full
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": 5.0, "tpm_available": 500.0}


def test_replace_keeps_in_flight_leases_of_kept_keys() -> None:
    a = spec("a", tpm=1000, max_concurrency=1)
    r = ring(a)
    lease = r.admit(a, "m", 400)
    a2 = spec("a", tpm=1000, max_concurrency=2, models=("m",))
    r.replace([a2])
    assert r.usage()["a"]["in_flight"] == 1.0
    # The request that authenticated before the reload admits under the new rules.
    second = r.admit(a, "m", 100)
    assert denied(lambda: r.admit(a, "m", 1)).code == "concurrency_limit_exceeded"
    lease.release(0)
    second.release(100)
    assert r.usage()["a"] == {"in_flight": 0.0, "rpm_available": math.inf, "tpm_available": 900.0}


def test_replace_drops_removed_keys_at_once_and_their_leases_release_cleanly() -> None:
    a, b = spec("a", SECRET_A), spec("b", SECRET_B, tpm=100, max_concurrency=1)
    r = ring(a, b)
    assert r.authenticate(f"Bearer {SECRET_B}") is b  # cached now
    lease = r.admit(b, "m", 50)
    r.replace([a])
    assert denied(lambda: r.authenticate(f"Bearer {SECRET_B}")).status == 401
    assert denied(lambda: r.admit(b, "m", 1)).message == "The API key is no longer valid."
    lease.release(10)
    lease.release(10)
    assert r.usage() == {
        "a": {"in_flight": 0.0, "rpm_available": math.inf, "tpm_available": math.inf}
    }
    # Re-added later, the key starts afresh: the old lease does not touch it.
    r.replace([a, b])
    assert r.usage()["b"] == {"in_flight": 0.0, "rpm_available": math.inf, "tpm_available": 100.0}


def test_replace_clears_the_caches_so_a_rotated_secret_stops_at_once() -> None:
    a = spec("a", SECRET_A, rpm=10)
    r = ring(a)
    assert r.authenticate(f"Bearer {SECRET_A}") is a
    denied(lambda: r.authenticate(f"Bearer {SECRET_C}"))  # remembered as unknown
    r.admit(a, "m", 0).release()
    rotated = KeySpec("a", hash_key(SECRET_C), rpm=10)
    r.replace([rotated])
    assert denied(lambda: r.authenticate(f"Bearer {SECRET_A}")).status == 401
    assert r.authenticate(f"Bearer {SECRET_C}") is rotated
    # A request authenticated with the old secret before the reload is refused too.
    assert denied(lambda: r.admit(a, "m", 0)).status == 401
    # The name kept its budget.
    assert r.usage()["a"]["rpm_available"] == 9.0


def test_replace_refuses_to_turn_authentication_off_and_bad_input_changes_nothing() -> None:
    a = spec("a", rpm=10)
    r = ring(a)
    r.admit(a, "m", 0)
    with pytest.raises(KeyConfigError, match="a reload cannot remove every key"):
        r.replace([])
    with pytest.raises(KeyConfigError, match="key 'b': duplicate name"):
        r.replace([spec("a", rpm=1), spec("b", SECRET_B), spec("b", SECRET_C)])
    assert r.enabled
    assert r.authenticate(f"Bearer {SECRET_A}") is a
    assert r.usage()["a"] == {"in_flight": 1.0, "rpm_available": 9.0, "tpm_available": math.inf}


def test_replace_can_turn_authentication_on() -> None:
    r = KeyRing()
    a = spec("a")
    r.replace([a])
    assert r.enabled
    assert r.authenticate(f"Bearer {SECRET_A}") is a
    assert r.specs == (a,)


# --- no plaintext anywhere ---------------------------------------------------------------------


def _everything_printable(secret: str) -> list[str]:
    """repr and str of every object that saw ``secret``, and the refusals' bodies."""
    a = KeySpec("a", hash_key(secret), models=("m",), rpm=1, tpm=10, max_concurrency=1)
    r = ring(a)
    texts = [repr(a), str(a), repr(r), str(r)]
    texts.append(repr(r.authenticate(f"Bearer {secret}")))
    lease = r.admit(a, "m", 5)
    texts += [repr(lease), str(lease)]
    refusals = [
        lambda: r.authenticate(f"Bearer {secret}x"),
        lambda: r.authenticate(secret),
        lambda: r.admit(a, "n", 1),
        lambda: r.admit(a, "m", 1),
    ]
    lease.release(3)
    texts.append(repr(lease))
    refusals.append(lambda: r.admit(a, "m", 1))
    for refuse in refusals:
        exc = denied(refuse)
        texts += [repr(exc), str(exc), exc.message, repr(exc.body()), repr(exc.args)]
    texts.append(repr(r.usage()))
    for table in ({"name": "a", "key": secret}, {"name": "a", "hash": secret}):
        with pytest.raises(KeyConfigError) as info:
            key_from_dict(table)
        texts.append(str(info.value))
    return texts


def test_no_plaintext_in_any_repr_str_or_message() -> None:
    secret = new_key()
    for text in _everything_printable(secret):
        assert secret not in text
        assert secret[4:16] not in text


VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)


@settings(max_examples=40, deadline=None)
@given(
    secret=st.text(VISIBLE, min_size=16, max_size=80),
    tail=st.text(VISIBLE, min_size=12, max_size=60),
)
def test_any_valid_secret_round_trips_and_is_never_shown(secret: str, tail: str) -> None:
    stored = hash_key(secret)
    assert ring(KeySpec("k", stored)).authenticate(f"Bearer {secret}") == KeySpec("k", stored)
    # A bare secret may spell a word of the messages ('model_not_allowed'); one with the
    # prefix keys have cannot, so its absence is meaningful.
    marked = "bsk-" + tail
    for text in _everything_printable(marked):
        assert marked not in text


def test_lease_is_made_by_the_ring() -> None:
    a = spec("a")
    lease = ring(a).admit(a, "m", 3)
    assert isinstance(lease, Lease)
    assert repr(lease) == "Lease(key='a', charged_tokens=0)"
    lease.release()
    assert repr(lease) == "Lease(released)"
    assert lease.key_name is None

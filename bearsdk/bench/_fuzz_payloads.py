"""The payloads of ``bearsdk bench fuzz``: untrusted snapshot documents, seeded.

Each payload is a pure function of ``(seed, index)`` (:func:`payload`), so any
finding can be regenerated: a valid ``bear.snapshot/1`` document, most of the
time then mutated (boundary numbers, wrong types, deep nesting, huge strings,
missing, unknown and duplicated fields, reordered requests) and now and then
garbled as bytes (truncated, flipped, inserted, a BOM, invalid UTF-8).
"""

from __future__ import annotations

import copy
import random
from typing import Any, Final

import orjson

from bearsdk.prefix_cache import runs

__all__ = ["T0", "payload"]

T0: Final = 1.0e9  # a frozen clock: snapshots stay fresh, estimates are functions of state

_INTS: Final = (
    0, 1, -1, 2, 7, 16, 1023, 1024, 1025, 4096, 4097, 65_535, 65_536, 65_537,
    2**24 - 1, 2**24, 2**24 + 1, 2**26, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53,
    2**53 + 1, 2**61, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 10**18, 10**30,
)  # fmt: skip
_FLOATS: Final = (0.0, -0.0, 0.5, 1.5, -1.5, 3600.0, 3600.5, 1e308, -1e308, 5e-324, 1e-9)
_OTHERS: Final[tuple[object, ...]] = (
    "", "x", "running", "waiting", True, False, None, [], {}, [1], {"a": 1}, "é",
)  # fmt: skip
_RAW: Final = (
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 400, "-" + "9" * 30, "01",
    "1.", ".5", "+1", "0x10", '"\\ud800"', '"\\u0000"', "tru", "nul",
)  # fmt: skip
_REQ_FIELDS: Final = (
    "id", "state", "prompt_tokens", "computed_tokens", "output_tokens",
    "max_tokens", "output_len", "placeholders",
)  # fmt: skip
_TOP_FIELDS: Final = ("schema", "instance", "seq", "time", "kv", "requests", "inflight", "epoch")
_KV_FIELDS: Final = ("block_size", "num_blocks", "free_blocks", "prefix_cache")
_CACHE_FIELDS: Final = ("keys", "cached", "free")
_CACHE_REQ_FIELDS: Final = ("blocks", "uncached_blocks", "chain")


def _prefix_cache(rng: random.Random, doc: dict[str, Any]) -> None:
    """Give a valid document a valid ``kv.prefix_cache``: shared, cached and free blocks."""
    kv = doc["kv"]
    bs = kv["block_size"]
    keys: list[int] = []
    prev: list[int] = []
    for r in doc["requests"]:
        if r["state"] != "running":
            continue
        held = -(-r["computed_tokens"] // bs)
        full = min(r["computed_tokens"], r["prompt_tokens"] + r["output_tokens"]) // bs
        n = rng.randint(0, min(full, held, 200))
        share = rng.randint(0, min(n, len(prev))) if rng.random() < 0.5 else 0
        mine = prev[:share] + list(range(len(keys), len(keys) + n - share))
        keys.extend(rng.getrandbits(63) for _ in range(n - share))
        if mine:
            r["blocks"] = runs(mine)
        if held > n:
            r["uncached_blocks"] = held - n
        prev = mine
    cached = len(keys)
    free_cached = rng.randint(0, min(kv["free_blocks"], 50))
    if cached + free_cached > kv["num_blocks"]:
        free_cached = 0
    keys.extend(rng.getrandbits(63) for _ in range(free_cached))
    entries = list(range(cached, cached + free_cached))
    rng.shuffle(entries)
    free: list[int] = []
    rest = kv["free_blocks"] - free_cached
    while entries or rest:
        if rest and (not entries or rng.random() < 0.3):
            n = rng.randint(1, rest)
            free.append(-n)
            rest -= n
        else:
            free.append(entries.pop())
    for r in doc["requests"]:
        known = (r["prompt_tokens"] + r["output_tokens"]) // bs
        have = sum(c for _, c in r.get("blocks", ()))
        if known > have and rng.random() < 0.5:
            m = rng.randint(1, min(known - have, 100))
            if rng.random() < 0.5 and len(keys) >= m:
                start = rng.randrange(len(keys) - m + 1)
                r["chain"] = [[start, m]]
            else:
                r["chain"] = [[len(keys), m]]
                keys.extend(rng.getrandbits(63) for _ in range(m))
    kv["prefix_cache"] = {"keys": keys, "cached": cached + free_cached, "free": free}


def _valid(rng: random.Random, instance: str) -> dict[str, Any]:
    """A valid document (running requests first), now and then near the decoders' bounds."""
    # Rare: near the bounds, one snapshot's replay costs up to ~100x a typical one's.
    extreme = rng.random() < 0.005
    n = rng.choice((0, 1, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
    n_wait = rng.randint(0, n) if rng.random() < 0.6 else 0
    bs = rng.choice((16, 16, 16, 32, 1, 4096)) if extreme else rng.choice((16, 16, 32))
    reqs: list[dict[str, Any]] = []
    held = 0
    for i in range(n):
        running = i < n - n_wait
        big = extreme and rng.random() < 0.3
        prompt = rng.randint(1, 2**24 - 2) if big else rng.choice((1, rng.randint(2, 4000)))
        out = rng.randint(0, 400) if running else rng.choice((0, 0, 0, 5))
        out = min(out, 2**24 - prompt - 1)
        r: dict[str, Any] = {
            "id": f"r{i}-{rng.getrandbits(24):06x}",
            "state": "running" if running else "waiting",
            "prompt_tokens": prompt,
            "computed_tokens": 0,
            "output_tokens": out,
        }
        if running:
            ph = rng.choice((0, 0, 1, 1, 2)) if not extreme else rng.choice((0, 1, 1024))
            r["placeholders"] = ph
            r["computed_tokens"] = rng.choice((prompt + out, rng.randint(0, prompt + out + ph)))
            held += -(-r["computed_tokens"] // bs)
        if rng.random() < 0.5:
            r["max_tokens"] = out + rng.randint(1, 2000)
        if rng.random() < 0.4:
            cap = r.get("max_tokens", out + 2000)
            r["output_len"] = rng.randint(out + 1, cap)
        reqs.append(r)
    doc: dict[str, Any] = {
        "schema": "bear.snapshot/1",
        "instance": instance,
        "seq": rng.randint(1, 10**6),
        "time": T0 - rng.random() * 0.01,
        "requests": reqs,
    }
    if rng.random() < 0.8:
        nb = max(held, 1) + rng.choice((0, 1, 100, 20_000))
        if extreme and rng.random() < 0.3:
            nb = 2**24
        nb = min(max(nb, held, 1), 2**24)
        free = rng.randint(0, max(0, nb - held))
        doc["kv"] = {"block_size": bs, "num_blocks": nb, "free_blocks": free}
        if rng.random() < 0.15 and bs <= 32 and nb <= 1_000_000:
            _prefix_cache(rng, doc)
    if rng.random() < 0.5:
        doc["inflight"] = {"remaining_s": rng.choice((0.0, rng.random() * 0.05))}
    if rng.random() < 0.5:
        doc["epoch"] = f"e{rng.getrandbits(32):08x}"
    return doc


class _Raw:
    """A JSON text spliced in verbatim (NaN, deep nesting, literals orjson cannot write)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _evil(rng: random.Random, raws: list[str]) -> object:
    k = rng.random()
    if k < 0.35:
        v = rng.choice(_INTS)
        if -(2**63) <= v < 2**64:
            return v
        raws.append(str(v))  # beyond what orjson writes, not beyond what it reads
        return _Raw(raws[-1])
    if k < 0.45:
        return rng.choice(_FLOATS)
    if k < 0.65:
        other = rng.choice(_OTHERS)
        # A copy: later mutations may write into it, and payloads must stay pure functions.
        return copy.deepcopy(other) if isinstance(other, list | dict) else other
    if k < 0.8:
        raws.append(rng.choice(_RAW))
    elif k < 0.9:
        d = rng.choice((10, 100, 255, 256, 990, 1000, 1025, 5000))
        raws.append("[" * d + "]" * d if rng.random() < 0.5 else '{"a":' * d + "1" + "}" * d)
    else:
        size = rng.choice((1024, 1025, 10_000, 100_000)) if rng.random() < 0.97 else 2_000_000
        return "x" * size
    return _Raw(raws[-1])


def _mutate(rng: random.Random, doc: dict[str, Any], raws: list[str]) -> None:
    reqs = doc.get("requests")
    containers: list[tuple[dict[str, Any], tuple[str, ...]]] = [(doc, _TOP_FIELDS)]
    rows = [r for r in reqs if isinstance(r, dict)] if isinstance(reqs, list) else []
    if rows:
        containers += [(rng.choice(rows), _REQ_FIELDS)] * 3
    if isinstance(doc.get("kv"), dict):
        containers.append((doc["kv"], _KV_FIELDS))
        if isinstance(doc["kv"].get("prefix_cache"), dict):
            containers += [(doc["kv"]["prefix_cache"], _CACHE_FIELDS)] * 2
            if rows:
                containers += [(rng.choice(rows), _CACHE_REQ_FIELDS)] * 2
    if isinstance(doc.get("inflight"), dict):
        containers.append((doc["inflight"], ("remaining_s",)))
    target, fields = rng.choice(containers)
    k = rng.random()
    if k < 0.6:
        target[rng.choice(fields)] = _evil(rng, raws)
    elif k < 0.75:
        target.pop(rng.choice(fields), None)
    elif k < 0.8:
        target[rng.choice(("x", "extra", "Seq", "prompt_token"))] = _evil(rng, raws)
    elif k < 0.9 and isinstance(reqs, list) and reqs:
        i, j = rng.randrange(len(reqs)), rng.randrange(len(reqs))
        if rng.random() < 0.5:
            reqs[i], reqs[j] = reqs[j], reqs[i]
        else:
            reqs.insert(j, copy.deepcopy(reqs[i]))
    elif k < 0.95 and rows:
        # A boundary number where the validation couples fields.
        r = rng.choice(rows)
        f = rng.choice(("computed_tokens", "output_len", "max_tokens", "output_tokens"))
        base = r.get("prompt_tokens", 1) if f == "computed_tokens" else r.get("output_tokens", 0)
        if isinstance(base, int):
            v = base + rng.choice((-1, 0, 1, 2))
            if -(2**63) <= v < 2**64:
                r[f] = v
            else:  # beyond what orjson writes
                raws.append(str(v))
                r[f] = _Raw(raws[-1])
    else:
        doc["requests"] = _evil(rng, raws)


def _garble(rng: random.Random, data: bytes) -> bytes:
    k = rng.random()
    n = len(data)
    if k < 0.3:
        return data[: rng.randrange(n + 1)]
    if k < 0.5 and n:
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] = rng.randrange(256)
        return bytes(b)
    if k < 0.6:
        i = rng.randrange(n + 1)
        return data[:i] + rng.randbytes(rng.randint(1, 8)) + data[i:]
    if k < 0.7:
        return b"\xef\xbb\xbf" + data
    if k < 0.8 and data.startswith(b"{"):
        dup = rng.choice((b'"seq":-1,', b'"schema":"x",', b'"seq":1,', b'"requests":[],'))
        return b"{" + dup + data[1:]
    if k < 0.85:
        return data + rng.choice((b"x", b" ", b"\n", b"{}", b"\x00"))
    if k < 0.9:
        return data.replace(b"i0", b"i\xff0", 1)
    return rng.choice((b"", b"null", b"[]", b"{}", b'"x"', b"1", b" ", b"\xff\xfe", b"{" * 3000))


def payload(seed: int, index: int, instance: str = "i0") -> bytes:
    """The ``index``-th payload of run ``seed`` (a pure function of both).

    About a quarter are valid documents; the rest are mutated (fields, then
    sometimes the bytes).
    """
    rng = random.Random(seed * 1_000_003 + index)
    doc = _valid(rng, instance)
    raws: list[str] = []
    for _ in range(rng.choice((0, 0, 0, 1, 1, 1, 2, 3))):
        _mutate(rng, doc, raws)
    data = orjson.dumps(doc, default=lambda r: f"\x00raw{raws.index(r.text)}\x00")
    for i, text in enumerate(raws):
        data = data.replace(f'"\\u0000raw{i}\\u0000"'.encode(), text.encode())
    if rng.random() < 0.2:
        data = _garble(rng, data)
    return data

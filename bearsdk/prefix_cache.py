"""The prefix-cache extension of ``bear.snapshot/1``: which blocks exist and who holds them.

With automatic prefix caching an engine's requests share KV blocks and freed
blocks stay findable until they are reused, so counting free blocks is not
enough to replay batch formation (``docs/prefix-caching.md``). An engine with
the cache on adds ``kv.prefix_cache`` and three request fields
(``docs/snapshots.md``, "Prefix caching"):

``kv.prefix_cache.keys``
    Content keys (integers in ``[0, 2**63)``). The first ``cached`` entries are
    the engine's cached blocks, one entry per block (two blocks with equal
    content are two entries, the one cached first first); the others are
    content no block holds yet that a request's ``chain`` names.
``kv.prefix_cache.cached``
    How many of ``keys`` are blocks.
``kv.prefix_cache.free``
    The free queue from its front (next to be reused) to its back: an entry
    ``i >= 0`` is cached block ``keys[i]``; ``-n`` is ``n`` blocks that hold no
    findable content.
``kv.prefix_cache.events_seq`` (optional)
    The sequence number of the last KV event batch the engine had published
    when it took the snapshot, from an engine whose KV events name blocks by
    these keys (the emulator's): a router that lost batches its replay socket
    no longer holds rebuilds its index from this snapshot, then applies the
    batches after it (``docs/prefix-caching.md``, "KV events").
``requests[i].blocks`` (running requests)
    Its cached blocks, first to last, as ``[start, count]`` runs of indices into
    ``keys[:cached]``; requests sharing a block name the same index.
``requests[i].uncached_blocks`` (running requests)
    Blocks it holds after those, whose content is not findable (yet).
``requests[i].chain``
    Keys of its further full blocks as far as its tokens are known, as runs of
    indices into ``keys``: what a lookup at its admission, or a block it fills,
    matches by.

:func:`prefix_cache_from_dict` validates all of it against the rest of the
snapshot and raises :class:`~bearsdk.errors.SnapshotError` naming the field;
:class:`PrefixCacheState` is the validated form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from bearsdk.errors import SnapshotError, short_repr

__all__ = [
    "KEY_LIMIT",
    "MAX_CACHE_ENTRIES",
    "REQUEST_FIELDS",
    "PrefixCacheState",
    "prefix_cache_from_dict",
    "runs",
]

KEY_LIMIT: Final = 1 << 63
"""Content keys are in ``[0, KEY_LIMIT)``."""
MAX_CACHE_ENTRIES: Final = 1 << 19
"""Keys, free-queue entries and expanded block references of one snapshot, each.
Half a million references are 8M tokens of KV in 16-token blocks, several times
what one GPU holds even when every request names a shared prefix; the bound
keeps what a hostile extension costs to decode under ~0.1 s and ~10 MB."""
REQUEST_FIELDS: Final = ("blocks", "uncached_blocks", "chain")
_FIELDS: Final = ("keys", "cached", "free")
_OPTIONAL: Final = ("events_seq",)


@attrs.frozen(eq=False)
class PrefixCacheState:
    """A validated ``kv.prefix_cache`` with the requests' block fields.

    Attributes:
        keys: Content keys; ``keys[:cached]`` are the engine's cached blocks.
        cached: How many keys are blocks.
        free: The free queue, front first: a cached block's index, or ``-n`` for
            ``n`` blocks with no findable content.
        blocks: Per request (snapshot order): indices of the cached blocks it
            holds, first to last (empty for a waiting request).
        uncached: Per request: blocks it holds after those.
        chains: Per request: key indices of its further known full blocks.
        events_seq: The last KV event batch the state includes (``None``: not said).
    """

    keys: tuple[int, ...]
    cached: int
    free: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    uncached: tuple[int, ...]
    chains: tuple[tuple[int, ...], ...]
    events_seq: int | None = None

    def request_fields(self, i: int) -> dict[str, Any]:
        """The wire fields of request ``i`` (only those it has)."""
        d: dict[str, Any] = {}
        if self.blocks[i]:
            d["blocks"] = runs(self.blocks[i])
        if self.uncached[i]:
            d["uncached_blocks"] = self.uncached[i]
        if self.chains[i]:
            d["chain"] = runs(self.chains[i])
        return d

    def to_dict(self) -> dict[str, Any]:
        """The wire form of ``kv.prefix_cache``."""
        d: dict[str, Any] = {
            "keys": list(self.keys),
            "cached": self.cached,
            "free": list(self.free),
        }
        if self.events_seq is not None:
            d["events_seq"] = self.events_seq
        return d


def runs(ix: Sequence[int]) -> list[list[int]]:
    """``[start, count]`` runs of consecutive indices (the wire form of a block list)."""
    out: list[list[int]] = []
    for i in ix:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return out


def _int(v: object, field: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise SnapshotError(field, f"must be an integer in [{lo}, {hi}] (got {short_repr(v)})", v)
    return v


def _list(v: object, field: str) -> Sequence[Any]:
    if not isinstance(v, Sequence) or isinstance(v, str | bytes | bytearray):
        raise SnapshotError(field, f"must be a list (got {short_repr(v)})", v)
    if len(v) > MAX_CACHE_ENTRIES:
        raise SnapshotError(
            field, f"must hold at most {MAX_CACHE_ENTRIES} entries (got {len(v)})", len(v)
        )
    return v


class _Budget:
    """Expanded references left (runs can name many blocks in few bytes)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CACHE_ENTRIES


def _expand(v: object, field: str, stop: int, budget: _Budget) -> tuple[int, ...]:
    """Indices of ``[start, count]`` runs, each in ``[0, stop)``, none twice."""
    items = _list(v, field)
    if items and stop == 0:
        raise SnapshotError(field, "must be empty: there is nothing to name", v)
    out: list[int] = []
    for j, run in enumerate(items):
        where = f"{field}[{j}]"
        if (
            not isinstance(run, Sequence)
            or isinstance(run, str | bytes | bytearray)
            or len(run) != 2
        ):
            raise SnapshotError(
                where, f"must be a [start, count] pair (got {short_repr(run)})", run
            )
        start = _int(run[0], f"{where}[0]", 0, stop - 1)
        count = _int(run[1], f"{where}[1]", 1, stop - start)
        budget.left -= count
        if budget.left < 0:
            raise SnapshotError(
                where, f"takes the block references over {MAX_CACHE_ENTRIES} (got {count})", count
            )
        out.extend(range(start, start + count))
    if len(set(out)) != len(out):
        raise SnapshotError(field, "names a block twice", runs(out))
    return tuple(out)


def prefix_cache_from_dict(
    raw: object,
    *,
    block_size: int,
    num_blocks: int,
    free_blocks: int,
    requests: Sequence[Mapping[str, Any]],
    rows: Sequence[Sequence[int]],
) -> PrefixCacheState:
    """Validate ``kv.prefix_cache`` and the requests' block fields together.

    Args:
        raw: The ``kv.prefix_cache`` value.
        block_size: ``kv.block_size``. num_blocks: ``kv.num_blocks``.
        free_blocks: ``kv.free_blocks``.
        requests: The raw request objects (their block fields are read here).
        rows: The validated rows of the same requests
            (``[state, prompt, computed, output, ...]``, ``bearsdk.snapshot`` columns).

    Returns:
        The validated state.

    Raises:
        SnapshotError: A malformed field, or a pool no engine can be in (a
            block both free and held, held blocks that do not cover a request's
            computed tokens, more blocks than the pool has).
    """
    if not isinstance(raw, Mapping):
        raise SnapshotError("kv.prefix_cache", f"must be an object (got {short_repr(raw)})", raw)
    for key in raw:
        if key not in _FIELDS and key not in _OPTIONAL:
            name = key if isinstance(key, str) else short_repr(key)
            raise SnapshotError(
                f"kv.prefix_cache.{name}", f"is not a known field (got {short_repr(raw[key])})"
            )
    for key in _FIELDS:
        if key not in raw:
            raise SnapshotError(f"kv.prefix_cache.{key}", "is required")
    keys_raw = _list(raw["keys"], "kv.prefix_cache.keys")
    keys = tuple(keys_raw)
    if not all(type(k) is int for k in keys) or (
        keys and not 0 <= min(keys) <= max(keys) < KEY_LIMIT
    ):
        for j, k in enumerate(keys):  # the slow path only names the culprit
            _int(k, f"kv.prefix_cache.keys[{j}]", 0, KEY_LIMIT - 1)
    cached = _int(raw["cached"], "kv.prefix_cache.cached", 0, min(len(keys), num_blocks))
    events_seq = None
    if "events_seq" in raw:
        events_seq = _int(raw["events_seq"], "kv.prefix_cache.events_seq", 0, KEY_LIMIT - 1)
    free_raw = _list(raw["free"], "kv.prefix_cache.free")
    free: list[int] = []
    in_free: set[int] = set()
    queued = 0
    for j, e in enumerate(free_raw):
        e = _int(e, f"kv.prefix_cache.free[{j}]", -num_blocks, max(cached - 1, -1))
        if e >= 0:
            if e in in_free:
                raise SnapshotError(
                    f"kv.prefix_cache.free[{j}]", f"names cached block {e} twice (got {e})", e
                )
            in_free.add(e)
            queued += 1
        else:
            queued -= e
        free.append(e)
    if queued != free_blocks:
        raise SnapshotError(
            "kv.prefix_cache.free",
            f"must hold kv.free_blocks {free_blocks} blocks (got {queued})",
            queued,
        )
    budget = _Budget()
    blocks: list[tuple[int, ...]] = []
    uncached: list[int] = []
    chains: list[tuple[int, ...]] = []
    held: set[int] = set()
    private = 0
    for i, (r, row) in enumerate(zip(requests, rows, strict=True)):
        where = f"requests[{i}]"
        running = row[0] == 0
        known = (row[1] + row[3]) // block_size
        mine: tuple[int, ...] = ()
        n_un = 0
        if "blocks" in r:
            mine = _expand(r["blocks"], f"{where}.blocks", cached, budget)
        if "uncached_blocks" in r:
            n_un = _int(r["uncached_blocks"], f"{where}.uncached_blocks", 0, num_blocks)
        if running:
            need = -(-row[2] // block_size)
            if len(mine) + n_un != need:
                raise SnapshotError(
                    f"{where}.uncached_blocks",
                    f"with its {len(mine)} cached blocks must make the {need} blocks its "
                    f"{row[2]} computed tokens hold (got {n_un})",
                    n_un,
                )
            if len(mine) > min(row[2], row[1] + row[3]) // block_size:
                raise SnapshotError(
                    f"{where}.blocks",
                    f"holds {len(mine)} cached blocks, more than its computed tokens fill",
                    runs(mine),
                )
            both = in_free.intersection(mine)
            if both:
                b = min(both)
                raise SnapshotError(
                    f"{where}.blocks", f"holds block {b}, which is in the free queue", b
                )
        elif mine or n_un:
            raise SnapshotError(
                f"{where}.blocks" if mine else f"{where}.uncached_blocks",
                "must be empty for a waiting request (it holds no blocks)",
                runs(mine) if mine else n_un,
            )
        chain: tuple[int, ...] = ()
        if "chain" in r:
            chain = _expand(r["chain"], f"{where}.chain", len(keys), budget)
            if len(mine) + len(chain) > known:
                raise SnapshotError(
                    f"{where}.chain",
                    f"with its cached blocks names {len(mine) + len(chain)} full blocks, more "
                    f"than its {row[1] + row[3]} tokens fill",
                    runs(chain),
                )
        held.update(mine)
        private += n_un
        blocks.append(mine)
        uncached.append(n_un)
        chains.append(chain)
    orphans = set(range(cached)).difference(in_free, held)
    if orphans:
        b = min(orphans)
        raise SnapshotError(
            "kv.prefix_cache.cached",
            f"counts block {b} (key {keys[b]}), which is neither free nor held by a running "
            "request",
            cached,
        )
    used = len(held) + private + free_blocks
    if used > num_blocks:
        raise SnapshotError(
            "kv.num_blocks",
            f"is smaller than the {used} blocks held and free (got {num_blocks})",
            num_blocks,
        )
    return PrefixCacheState(
        keys=keys,
        cached=cached,
        free=tuple(free),
        blocks=tuple(blocks),
        uncached=tuple(uncached),
        chains=tuple(chains),
        events_seq=events_seq,
    )

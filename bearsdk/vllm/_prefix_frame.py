"""How one capture of vLLM's block pool becomes ``kv.prefix_cache`` text.

:class:`~bearsdk.vllm._prefix.PoolTracker` copies the pool's columns on the
engine thread into a :class:`PrefixFrame`; formatting it (the keys and the
free queue in full, as the wire format asks, and each resident's fields) runs
later on the publisher thread: bulk numpy work, the compiled ``json_ints`` of
``bearsdk.vllm._pub_c`` to print integers, and :class:`KeysText`, which
re-prints only the chunks of keys that changed since the last frame.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from bearsdk import _twins

__all__ = ["KEY_MASK", "KeysText", "PrefixFrame", "json_ints", "key_of", "key_of_grouped"]

KEY_MASK: Final = (1 << 63) - 1


def key_of(h: bytes) -> int:
    """A vLLM block hash as a ``bear.snapshot`` content key: its last 8 bytes, 63 bits.

    The hash vLLM's KV events send by default is the same 8 bytes as an int
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so that a router following the
    events names a block as the snapshot does (``bearsdk.kvevents``).
    """
    return int.from_bytes(h[-8:], "big") & KEY_MASK


def key_of_grouped(h: bytes) -> int:
    """:func:`key_of` of a ``BlockHashWithGroupId`` (the hash, then 4 bytes of group id)."""
    return int.from_bytes(h[-12:-4], "big") & KEY_MASK


def _json_ints_py(values: Any) -> bytes:
    return ",".join(map(str, np.asarray(values, dtype=np.int64).tolist())).encode()


def _pick_json_ints() -> Callable[[Any], bytes]:
    mod = _twins.compiled("bearsdk.vllm._pub_c")
    fn = getattr(mod, "json_ints", None) if mod is not None else None
    return fn if fn is not None else _json_ints_py


json_ints: Callable[[Any], bytes] = _pick_json_ints()
"""Integers as JSON joined by commas (compiled when the extension is built)."""


def _runs_text(ix: Sequence[int]) -> bytes:
    out: list[list[int]] = []
    for i in ix:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return b",".join(b"[%d,%d]" % (s, c) for s, c in out)


class KeysText:
    """The ``keys`` text of the last frame in chunks of slots, re-printed only where it changed.

    The keys are most of a warm pool's document (19-digit integers) and change
    by a few slots per step; comparing two frames' columns is one vectorised
    pass, printing them all is not.
    """

    CHUNK: Final = 2048

    def __init__(self) -> None:
        self._keys: Any = None
        self._occupied: Any = None
        self._texts: list[bytes] = []

    def text(self, keys: Any, occupied: Any) -> bytes:
        """``keys[occupied]`` printed (``keys`` in slot order, never written to after)."""
        ch = self.CHUNK
        n = len(keys)
        nch = -(-n // ch)
        prev = self._keys
        m = 0 if prev is None else min(n, len(prev))
        dirty = np.zeros(nch, dtype=bool)
        if m:
            diff = (keys[:m] != prev[:m]) | (occupied[:m] != self._occupied[:m])
            dirty[np.flatnonzero(diff) // ch] = True
        if m < n or (prev is not None and len(prev) != n):
            dirty[m // ch :] = True
        texts = self._texts[:nch]
        texts.extend([b""] * (nch - len(texts)))
        for c in np.flatnonzero(dirty).tolist():
            lo, hi = c * ch, (c + 1) * ch
            texts[c] = json_ints(np.ascontiguousarray(keys[lo:hi][occupied[lo:hi]]))
        self._keys, self._occupied, self._texts = keys, occupied, texts
        return b",".join([t for t in texts if t])


class PrefixFrame:
    """One capture of the pool: raw copies taken on the engine thread, formatted later.

    The engine thread only copies (:meth:`PoolTracker.export`: the tracker's
    columns in bulk, and per resident its runs and chain in slot space); the
    squeezing of holes, the free queue's wire form and the JSON happen in
    :meth:`format`, on the publisher thread when there is one.

    Attributes:
        seq: The snapshot it belongs to.
        error: Why the capture could not be exported, or None.
    """

    __slots__ = (
        "_text",
        "error",
        "extra",
        "holes",
        "queue",
        "reqs",
        "seq",
        "slot_block",
        "slot_key",
        "slot_of",
    )

    def __init__(
        self,
        seq: int,
        slot_key: Any = None,
        slot_block: Any = None,
        holes: bool = False,
        queue: Any = None,
        slot_of: Any = None,
        reqs: list[tuple[Any, int, Any]] | None = None,
        extra: list[int] | None = None,
        error: str | None = None,
    ) -> None:
        self.seq = seq
        self.slot_key = slot_key
        self.slot_block = slot_block
        self.holes = holes
        self.queue = queue
        self.slot_of = slot_of
        self.reqs = reqs if reqs is not None else []
        self.extra = extra if extra is not None else []
        self.error = error
        self._text: tuple[bytes, list[bytes]] | None = None

    def format(
        self,
        memo: dict[int, tuple[Any, bytes]] | None = None,
        keys_text: KeysText | None = None,
    ) -> tuple[bytes, list[bytes]]:
        """``("prefix_cache":{...}, [each resident's extra members])``.

        Args:
            memo: The previous format's ``blocks`` texts by runs tuple (a
                resident's runs tuple is the same object while its cached
                blocks do not change); updated in place. Used when no slot is a
                hole, so that slot order is the wire's.
            keys_text: The previous format's keys text, reused where unchanged.
        """
        if self._text is None:
            self._text = self._format(memo, keys_text)
        return self._text

    def _format(
        self, memo: dict[int, tuple[Any, bytes]] | None, keys_text: KeysText | None
    ) -> tuple[bytes, list[bytes]]:
        if self.error is not None:
            raise RuntimeError(self.error)
        blocks = np.frombuffer(self.slot_block, dtype=np.int32)
        occupied = blocks >= 0
        slot_keys = np.frombuffer(self.slot_key, dtype=np.int64)
        cached = int(np.count_nonzero(occupied))
        if keys_text is not None:
            ktext = keys_text.text(slot_keys, occupied)
        else:
            ktext = json_ints(np.ascontiguousarray(slot_keys[occupied]))
        if self.extra:
            more = json_ints(np.asarray(self.extra, dtype=np.int64))
            ktext = ktext + b"," + more if ktext else more
        dense: Any = np.cumsum(occupied, dtype=np.int64) - 1 if self.holes else None
        q = np.frombuffer(self.queue, dtype=np.int32)
        live = q[q >= 0]
        slots = np.frombuffer(self.slot_of, dtype=np.int32)[live].astype(np.int64)
        named = slots >= 0
        if dense is not None:
            slots[named] = dense[slots[named]]
        if not named.all():
            # Runs of blocks that hold nothing findable become -n.
            unnamed = ~named
            starts = unnamed & np.concatenate(([True], named[:-1]))
            ends = unnamed & np.concatenate((named[1:], [True]))
            lengths = np.flatnonzero(ends) - np.flatnonzero(starts) + 1
            keep = named | starts
            free = slots[keep]
            free[np.cumsum(keep)[starts] - 1] = -lengths
        else:
            free = slots
        # Slot-space starts of every run and chain entry, mapped in one go.
        flat: list[int] = []
        use_memo = memo is not None and dense is None
        old_memo = dict(memo) if use_memo and memo is not None else {}
        if memo is not None:
            memo.clear()
        texts: list[bytes | None] = []
        pairs: list[list[tuple[int, int]] | None] = []
        for frozen, _, chain in self.reqs:
            text = None
            runs = None
            if frozen is not None:
                if use_memo:
                    hit = old_memo.get(id(frozen))
                    if hit is not None and hit[0] is frozen:
                        text = hit[1]
                if text is None:
                    lst, n, last = frozen
                    runs = lst[: n - 1]
                    runs.append(last)
                    flat.extend(r[0] for r in runs)
            texts.append(text)
            pairs.append(runs)
            if chain:
                flat.extend(chain)
        if flat:
            arr = np.asarray(flat, dtype=np.int64)
            pos = arr >= 0
            if dense is not None:
                arr[pos] = dense[arr[pos]]
            arr[~pos] = cached - 1 - arr[~pos]  # extra j, stored as -(j + 1)
            mapped = arr.tolist()
        else:
            mapped = []
        fields: list[bytes] = []
        at = 0
        for (frozen, uncached, chain), text, runs in zip(self.reqs, texts, pairs, strict=True):
            part = b""
            if frozen is not None:
                if text is None:
                    assert runs is not None
                    n = len(runs)
                    text = (
                        b',"blocks":['
                        + b",".join(
                            b"[%d,%d]" % (m, r[1])
                            for m, r in zip(mapped[at : at + n], runs, strict=True)
                        )
                        + b"]"
                    )
                    at += n
                if use_memo and memo is not None:
                    memo[id(frozen)] = (frozen, text)
                part = text
            if uncached:
                part += b',"uncached_blocks":%d' % uncached
            if chain:
                n = len(chain)
                part += b',"chain":[' + _runs_text(mapped[at : at + n]) + b"]"
                at += n
            fields.append(part)
        ext = b"".join(
            (
                b'"prefix_cache":{"keys":[',
                ktext,
                b'],"cached":%d,"free":[' % cached,
                json_ints(np.ascontiguousarray(free)),
                b"]}",
            )
        )
        return ext, fields

"""A snapshot with ``kv.prefix_cache`` in a form that two equal replay inputs share.

Used by ``apc_publish.py`` (oracle interpreter) and ``test_apc_publish.py``
(bearsdk's): no vLLM, no bearsdk.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def expand(runs: list[list[int]]) -> list[int]:
    """Indices of ``[start, count]`` runs."""
    return [i for s, c in runs for i in range(s, s + c)]


def canonical(doc: dict[str, Any]) -> dict[str, Any]:
    """A snapshot as a replay sees it: block identities as (key, rank among equal keys).

    Two snapshots that differ only in the order of distinct keys in ``keys``
    (which the wire leaves free) or in which index a chain names for a key
    have the same canonical form.
    """
    kv = doc["kv"]
    pc = kv.get("prefix_cache")
    out: dict[str, Any] = {
        "block_size": kv["block_size"],
        "num_blocks": kv["num_blocks"],
        "free_blocks": kv["free_blocks"],
    }
    rows = []
    if pc is None:
        out["prefix_cache"] = None
        names: list[tuple[int, int]] = []
        keys: list[int] = []
    else:
        keys = pc["keys"]
        seen: Counter[int] = Counter()
        names = []
        for k in keys[: pc["cached"]]:
            names.append((k, seen[k]))
            seen[k] += 1
        out["cached"] = sorted(names)
        out["free"] = [list(names[e]) if e >= 0 else e for e in pc["free"]]
    for r in doc["requests"]:
        rows.append(
            [
                r["id"],
                r["state"],
                r["prompt_tokens"],
                r["computed_tokens"],
                r["output_tokens"],
                r.get("placeholders", 0),
                [list(names[j]) for j in expand(r.get("blocks", []))],
                r.get("uncached_blocks", 0),
                [keys[j] for j in expand(r.get("chain", []))],
            ]
        )
    out["requests"] = rows
    return out

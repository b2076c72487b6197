"""Replay vLLM-oracle cases and compare them with what vLLM did, batch by batch."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

import bearsdk
from bearsdk.replay import ReplayResult
from bearsdk.schedulers import compile_scheduler
from bearsdk.snapshot import snapshot_from_dict

NEW_ID = "<new>"
COEFFS = (0.004, 2.0e-5, 4.0e-8, 1.0e-10)


def case_params(case: Mapping[str, Any]) -> dict[str, Any]:
    """vllm-v1 parameters of a gen_cases.py line (its `config`)."""
    cfg = dict(case["config"])
    if cfg.pop("enable_prefix_caching", False):
        raise ValueError(f"{case['case_id']}: prefix caching is not modelled")
    return cfg


def replay_case(case: Mapping[str, Any], impl: str) -> ReplayResult:
    snap = snapshot_from_dict(case["snapshot"])
    assert snap.kv is not None
    pol = bearsdk.bind_scheduler("vllm-v1", case_params(case)).with_kv(
        snap.kv.block_size, snap.kv.num_blocks
    )
    rp = compile_scheduler(pol, impl)
    prep = rp.prepare(snap.table, snap.kv.free_blocks, snap.ids)
    new = case["new"]
    return rp.replay(
        prep,
        new["prompt_tokens"],
        new["output_len"],
        COEFFS,
        record=True,
        max_tokens=new["output_len"],
    )


@attrs.define
class Tally:
    """Agreement counts for one configuration."""

    cases: int = 0
    first_token_exact: int = 0
    batches_exact: int = 0
    per_request_exact: int = 0
    failures: list[str] = attrs.Factory(list)


def compare(
    case: Mapping[str, Any],
    vllm_batches: list[Any] | None,
    impls: Iterable[str],
    tally: dict[str, Tally],
) -> None:
    """Replay ``case`` under each implementation and count agreement with vLLM.

    ``vllm_batches``: vLLM's steps as ``[step, {request: tokens}, preempted]``
    up to (at least) the first-token batch, or None when not captured.
    """
    want = case["isolated_first_token_batch"]
    new_id = case["new"]["id"]
    for impl in impls:
        t = tally.setdefault(impl, Tally())
        t.cases += 1
        res = replay_case(case, impl)
        ok_first = res.first_token_batch == want
        t.first_token_exact += ok_first
        if not ok_first:
            t.failures.append(
                f"{case['case_id']}: first_token_batch {res.first_token_batch} != vLLM {want}"
            )
            continue
        if vllm_batches is None:
            continue
        assert res.batches is not None
        vb = vllm_batches[: len(res.batches)]
        totals_ok = len(vb) == len(res.batches) and all(
            sum(v[1].values()) == b.total_tokens and len(v[1]) == b.num_seqs
            for v, b in zip(vb, res.batches, strict=True)
        )
        t.batches_exact += totals_ok
        if not totals_ok:
            t.failures.append(f"{case['case_id']}: per-batch token counts differ from vLLM")
        if res.batches and res.batches[0].tokens_by_request is not None:
            mine = [
                {new_id if k == NEW_ID else k: n for k, n in b.tokens_by_request or ()}
                for b in res.batches
            ]
            same = mine == [v[1] for v in vb]
            t.per_request_exact += same
            if not same:
                t.failures.append(f"{case['case_id']}: per-request tokens differ from vLLM")


def ttft_agree(case: Mapping[str, Any], impls: list[str]) -> bool:
    """Do all implementations predict the same TTFT (to rounding)?"""
    vals = [replay_case(case, impl).ttft_s for impl in impls]
    return all(math.isclose(v, vals[0], rel_tol=1e-9) for v in vals)

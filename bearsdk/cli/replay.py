"""``bearsdk replay``: what-if replay of batch formation (CONTRACTS.md section 2).

Batch mode reads one case per JSONL line and writes one result per line, in
order; a bad line yields ``{"case_id": ..., "error": "line N: ..."}`` and the run
goes on, and the exit status is then 2. Single mode replays one snapshot file and
can print the batches.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any

import orjson

from bearsdk.cli import positive_int, scheduler_arg
from bearsdk.errors import BearError, short_repr

if TYPE_CHECKING:
    from bearsdk.estimators.batch_time import BatchTimeModel
    from bearsdk.estimators.bea import BEAEstimator, TTFTEstimate

# The estimator, the schedulers and the snapshot decoder (numpy with them) are
# imported where a replay runs: every other command builds this parser too.

__all__ = ["register", "replay_case"]

_NEW_KEYS = frozenset({"prompt_tokens", "output_len", "max_tokens", "id", "prefix_keys"})
_MAX_PREFIX_KEYS = 1 << 20  # far beyond any prompt's blocks


class CaseError(BearError, ValueError):
    """A replay case line is malformed."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "replay",
        help="replay batch formation from a snapshot up to a new request's first token",
        description=(
            "Predict the batch in which a new request gets its first token, and its TTFT. "
            "With --cases, every line gets a result line in order; a bad line's result is "
            "an error naming the line (and the case id when it has one), the other lines "
            "still run, and the exit status is 2 when any line had an error (0 otherwise)."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--cases", metavar="FILE.jsonl", help="batch mode: one case per line ('-': stdin)"
    )
    src.add_argument("--snapshot", metavar="FILE", help="single mode: a bear.snapshot/1 JSON file")
    p.add_argument(
        "--scheduler",
        type=scheduler_arg,
        default="vllm-v1",
        help="registered policy, or a policy spec file (.toml) (single mode)",
    )
    p.add_argument(
        "--param", action="append", default=[], metavar="K=V", help="policy parameter override"
    )
    p.add_argument(
        "--prompt-tokens", type=positive_int, help="new request's prompt length (single mode)"
    )
    p.add_argument(
        "--output-len", type=positive_int, help="new request's output length (default: predicted)"
    )
    p.add_argument(
        "--batch-time",
        metavar="B0,B1,B2,B3",
        help="eq. 12 coefficients in seconds (single mode); a decode's context counts "
        "its own key (decode_keys 'attended', docs/batch-time.md)",
    )
    p.add_argument(
        "--mean-output-len",
        type=positive_int,
        default=256,
        help="predicted length of requests without output_len",
    )
    p.add_argument(
        "--batches", action="store_true", help="print the simulated batches (single mode)"
    )
    p.add_argument(
        "--next-tokens",
        type=next_tokens_arg,
        default=0,
        metavar="K",
        help="also follow K tokens past the first: their batches and the TPOT (single mode)",
    )
    p.add_argument(
        "--impl", choices=("cython", "python"), help="replay implementation (default: loaded)"
    )
    p.add_argument("--json", action="store_true", help="JSON output")
    p.set_defaults(func=_run)


def next_tokens_arg(text: str) -> int:
    """``--next-tokens``: an integer in ``[0, MAX_NEXT_TOKENS]``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer (got {short_repr(text)})") from None
    from bearsdk.replay.types import check_next_tokens

    try:
        return check_next_tokens(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("next_tokens ", "")) from None


def _params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CaseError(f"--param must be KEY=VALUE (got {item!r})")
        out[key.strip()] = value
    return out


def _coeffs(v: object, where: str) -> BatchTimeModel | None:
    from bearsdk.estimators.batch_time import BatchTimeModel

    if v is None:
        return None
    if isinstance(v, str):
        v = [x for x in v.split(",") if x.strip()]
    if not isinstance(v, list | tuple) or len(v) != 4:
        raise CaseError(f"{where} must be four numbers [b0, b1, b2, b3] (got {v!r})")
    try:
        return BatchTimeModel(*(float(x) for x in v))
    except (TypeError, ValueError) as exc:
        raise CaseError(f"{where}: {exc}") from None


def _estimator(
    scheduler: str,
    params: Mapping[str, object],
    coeffs: BatchTimeModel | None,
    mean_output_len: int,
    impl: str | None,
) -> BEAEstimator:
    """The estimator a case or ``--snapshot`` replays with (no coefficients: zeros,
    the first-token batch is the answer)."""
    from bearsdk.estimators.batch_time import BatchTimeModel
    from bearsdk.estimators.bea import BEAEstimator
    from bearsdk.estimators.length import MeanLengthPredictor
    from bearsdk.schedulers import bind_scheduler

    return BEAEstimator(
        bind_scheduler(scheduler, params),
        coeffs or BatchTimeModel(0.0, 0.0, 0.0, 0.0),
        MeanLengthPredictor(mean=mean_output_len),
        implementation=impl,
    )


def replay_case(
    case: Mapping[str, Any], *, mean_output_len: int = 256, impl: str | None = None
) -> dict[str, Any]:
    """Run one replay case (the dict form of a ``--cases`` line).

    Args:
        case: ``case_id``, ``scheduler``, ``params``, ``snapshot``, ``new`` and
            optionally ``batch_time``.
        mean_output_len: Predicted length of residents without ``output_len``.
        impl: Replay implementation; default: the loaded one.

    Returns:
        ``{"case_id", "first_token_batch", "ttft_s"}``.

    Raises:
        BearError: The case is malformed (the message names the field).
    """
    from bearsdk.snapshot import snapshot_from_dict

    for key in ("scheduler", "snapshot", "new"):
        if key not in case:
            raise CaseError(f"{key} is required")
    params = case.get("params") or {}
    if not isinstance(params, Mapping):
        raise CaseError(f"params must be an object (got {params!r})")
    new = case["new"]
    if not isinstance(new, Mapping):
        raise CaseError(f"new must be an object (got {new!r})")
    for key in new:
        if key not in _NEW_KEYS:
            raise CaseError(f"new.{key} is not a known field")
    prompt = new.get("prompt_tokens")
    if type(prompt) is not int or prompt < 1:
        raise CaseError(f"new.prompt_tokens must be an integer >= 1 (got {prompt!r})")
    out_len = new.get("output_len")
    if out_len is not None and (type(out_len) is not int or out_len < 1):
        raise CaseError(f"new.output_len must be an integer >= 1 (got {out_len!r})")
    max_tokens = new.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise CaseError(f"new.max_tokens must be an integer >= 1 (got {max_tokens!r})")
    prefix_keys = new.get("prefix_keys")
    if prefix_keys is not None and (
        not isinstance(prefix_keys, list)
        or len(prefix_keys) > _MAX_PREFIX_KEYS
        or not all(type(k) is int and 0 <= k < 1 << 63 for k in prefix_keys)
    ):
        raise CaseError(
            "new.prefix_keys must be a list of integers in [0, 2**63) "
            f"(got {short_repr(prefix_keys)})"
        )
    scheduler = case["scheduler"]
    if not isinstance(scheduler, str):
        raise CaseError(f"scheduler must be a name (got {scheduler!r})")
    coeffs = _coeffs(case.get("batch_time"), "batch_time")
    snap = snapshot_from_dict(case["snapshot"])
    est = _estimator(scheduler, params, coeffs, mean_output_len, impl)
    res = est.estimate(snap, prompt, out_len, max_tokens=max_tokens, prefix_keys=prefix_keys)
    return {
        "case_id": case.get("case_id"),
        "first_token_batch": res.first_token_batch,
        "ttft_s": None if coeffs is None or not math.isfinite(res.ttft_s) else res.ttft_s,
    }


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    stream: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for i, line in enumerate(stream, 1):
            if line.strip():
                yield i, line
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _run_cases(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    n = bad = 0
    for lineno, raw in _lines(args.cases):
        n += 1
        case_id: object = None
        try:
            case = orjson.loads(raw)
            if not isinstance(case, dict):
                raise CaseError(f"must be a JSON object (got {type(case).__name__})")
            case_id = case.get("case_id")
            res = replay_case(case, mean_output_len=args.mean_output_len, impl=args.impl)
        except orjson.JSONDecodeError as exc:
            bad += 1
            res = {"case_id": None, "error": f"line {lineno}: not valid JSON ({exc})"}
        except (BearError, ValueError) as exc:
            bad += 1
            res = {"case_id": case_id, "error": f"line {lineno}: {exc}"}
        # A case without an id is known by its line, never as "None".
        label = f"line {lineno}" if res["case_id"] is None else str(res["case_id"])
        if args.json:
            out.write(orjson.dumps(res) + b"\n")
        elif "error" in res:
            out.write(f"{label}\tERROR\t{res['error']}\n".encode())
        else:
            ttft = "-" if res["ttft_s"] is None else f"{res['ttft_s'] * 1000:.3f} ms"
            out.write(f"{label}\tbatch {res['first_token_batch']}\t{ttft}\n".encode())
        # Results stream: a reader of a pipe (or Ctrl-C) keeps every finished line.
        out.flush()
    if bad:
        print(f"bearsdk replay: error: {bad} of {n} lines had errors", file=sys.stderr)
        return 2
    return 0


def _run_single(args: argparse.Namespace) -> int:
    from bearsdk.snapshot import decode_snapshot

    if args.prompt_tokens is None:
        raise CaseError("--prompt-tokens is required with --snapshot")
    with open(args.snapshot, "rb") as f:
        snap = decode_snapshot(f.read())
    coeffs = _coeffs(args.batch_time, "--batch-time")
    est = _estimator(args.scheduler, _params(args.param), coeffs, args.mean_output_len, args.impl)
    res = est.estimate(
        snap,
        args.prompt_tokens,
        args.output_len,
        explain=args.batches,
        next_tokens=args.next_tokens,
    )
    if args.json:
        sys.stdout.buffer.write(
            orjson.dumps(_result_dict(res, coeffs is not None, args.batches)) + b"\n"
        )
        return 0
    print(
        f"scheduler {args.scheduler}: {len(snap)} resident requests "
        f"({snap.num_running} running, {snap.num_waiting} waiting)"
    )
    if res.first_token_batch:
        ttft = ""
        if coeffs is not None:
            ttft = (
                f", TTFT {res.ttft_s * 1000:.3f} ms (including {res.inflight_s * 1000:.3f} ms "
                "left of the batch in flight at the snapshot)"
            )
        print(f"first token in batch {res.first_token_batch}{ttft}")
        if args.next_tokens:
            tb = res.token_batches
            tpot = ""
            if coeffs is not None and res.tpot_s is not None and res.gap_p90_s is not None:
                tpot = f"; TPOT {res.tpot_s * 1000:.3f} ms, p90 gap {res.gap_p90_s * 1000:.3f} ms"
            print(f"tokens 1-{len(tb)} in batches {', '.join(map(str, tb))}{tpot}")
    else:
        print(f"no first token: {res.stop_reason}")
    if args.batches and res.batches:
        cols = ("batch", "seqs", "prefill", "decode", "ctx", "adm", "pre", "ms")
        widths = (6, 5, 8, 7, 9, 4, 4, 9)
        print(" ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True)))
        for i, b in enumerate(res.batches, 1):
            print(
                f"{i:>6} {b.num_seqs:>5} {b.prefill_tokens:>8} {b.decode_tokens:>7} "
                f"{b.decode_context:>9} {b.admitted:>4} {b.preempted:>4} "
                f"{b.duration_s * 1000:>9.3f}"
            )
    return 0


def _result_dict(res: TTFTEstimate, timed: bool, batches: bool) -> dict[str, Any]:
    d: dict[str, Any] = {
        "first_token_batch": res.first_token_batch,
        "ttft_s": res.ttft_s if timed and math.isfinite(res.ttft_s) else None,
        "inflight_s": res.inflight_s if timed else None,
        "stop_reason": str(res.stop_reason),
    }
    if res.token_batches:
        d["token_batches"] = list(res.token_batches)
        d["tpot_s"] = res.tpot_s if timed else None
        d["gap_p90_s"] = res.gap_p90_s if timed else None
    if batches and res.batches is not None:
        d["batches"] = [
            {
                "num_seqs": b.num_seqs,
                "prefill_tokens": b.prefill_tokens,
                "decode_tokens": b.decode_tokens,
                "decode_context": b.decode_context,
                "prefill_attention": b.prefill_attention,
                "admitted": b.admitted,
                "preempted": b.preempted,
                "duration_s": b.duration_s,
            }
            for b in res.batches
        ]
    return d


def _run(args: argparse.Namespace) -> int:
    if args.cases:
        return _run_cases(args)
    return _run_single(args)

"""Replay an Azure LLM inference trace against a pool and print SLO attainment and utility.

    python examples/batch_eval.py                                  # azure-conv, 2 policies
    python examples/batch_eval.py --rate 12 --requests 200 --policies bear,shortest-queue
    python examples/batch_eval.py --pool pool.toml --trace my.csv  # real vLLM servers
    python examples/batch_eval.py --data-dir ~/data                # where azure_llm_2023/ is

The trace (``azure-conv`` or ``azure-code``: the public Azure LLM inference
trace 2023, read from ``--data-dir`` or ``$BEARSDK_DATA``, see ``docs/data.md``;
or any CSV with the Azure columns ``TIMESTAMP,ContextTokens,GeneratedTokens``) gives each
request's arrival time and prompt length; ``--rate`` rescales the arrivals.
Prompts are the paper's four tasks (their text stands for the request's last
turn), with true accuracies per model; targets follow appendix A.2. Every
policy sees the same requests, on fresh emulated engines (or, with ``--pool``,
one after the other on the same servers). The table is eq. 6's OnTimeUtility,
SLO attainment, TTFT and where requests went.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import anyio
import attrs
from _pool import add_pool_args, fail, pool_for

from bearsdk import AsyncRouter, make_selector
from bearsdk.errors import BearError
from bearsdk.evaluation import RunSummary, drive_workload, summarize
from bearsdk.workload import WorkItem, read_trace, requests_at, task_prompts

_CONTEXT = [
    "the",
    "report",
    "notes",
    "that",
    "our",
    "team",
    "will",
    "review",
    "each",
    "part",
    "of",
    "the",
    "plan",
    "and",
    "share",
    "what",
    "we",
    "find",
    "with",
    "the",
    "group",
    "before",
    "the",
    "end",
    "of",
    "the",
    "week",
    "so",
    "that",
    "we",
    "can",
    "make",
    "a",
    "clear",
    "choice",
]


def with_context(item: WorkItem) -> WorkItem:
    """Prefix earlier-turn context so the prompt is about the trace's length.

    Common English words are one token each for vLLM's tokenizers and the
    emulator's alike, so words stand in for tokens.
    """
    missing = item.prompt_tokens - len(item.prompt.split())
    if missing <= 0:
        return item
    context = " ".join(itertools.islice(itertools.cycle(_CONTEXT), missing))
    return attrs.evolve(item, prompt=f"Context: {context}\n\n{item.prompt}")


async def run_policy(args: argparse.Namespace, policy: str, items: list[WorkItem]) -> RunSummary:
    async with (
        pool_for(args) as configs,
        AsyncRouter(configs, make_selector(policy, lam=args.lam)) as router,
    ):
        await anyio.sleep(0.3)  # first snapshots
        results, lag = await drive_workload(router, items, tail_s=args.tail)
    return summarize(policy, args.rate or 0.0, results, lam=args.lam, arrival_lag_p99_s=lag)


async def main(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, args.data_dir).window(args.requests, args.start)
    times = trace.arrivals(args.rate)
    prompts = task_prompts(200, seed=args.seed)
    items = [
        with_context(it)
        for it in requests_at(prompts, times, seed=args.seed, prompt_tokens=trace.prompt_tokens)
    ]
    rate = len(items) / max(times[-1], 1e-9)
    print(
        f"trace {args.trace}: {len(items)} requests from #{args.start}, {times[-1]:.1f} s "
        f"({rate:.1f} req/s), prompts {int(trace.prompt_tokens.mean())} tokens on average"
    )
    rows = []
    for policy in args.policies.split(","):
        s = await run_policy(args, policy.strip(), items)
        rows.append(s)
        print(
            f"  {s.policy:17} OnTimeUtility {s.on_time_utility:6.3f}  SLO {s.attainment:4.0%}",
            flush=True,
        )
    print(f"\n{'policy':17} {'OnTimeUtility':>13} {'SLO':>5} {'TTFT p50':>9} {'p99':>7}  routed")
    for s in sorted(rows, key=lambda r: -r.on_time_utility):
        comp = ", ".join(f"{k or 'failed'} {v:.0%}" for k, v in s.composition.items())
        print(
            f"{s.policy:17} {s.on_time_utility:13.3f} {s.attainment:5.0%} "
            f"{s.ttft_p50_s * 1e3:7.0f}ms {s.ttft_p99_s * 1e3:5.0f}ms  {comp}"
        )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pool_args(parser)
    parser.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code or a CSV")
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help="folder holding azure_llm_2023/ (default: $BEARSDK_DATA; see docs/data.md)",
    )
    parser.add_argument("--requests", type=int, default=120, help="requests to replay")
    parser.add_argument("--start", type=int, default=0, help="first trace row")
    parser.add_argument("--rate", type=float, default=10.0, help="rescale arrivals to this rate")
    parser.add_argument("--policies", default="bear,round-robin")
    parser.add_argument("--lam", type=float, default=5e-4, help="cost weight of the utility")
    parser.add_argument("--tail", type=float, default=1.3, help="wait after the last arrival (s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        sys.exit(anyio.run(main, args))
    except (BearError, OSError, ValueError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        print("batch_eval.py: interrupted", file=sys.stderr)
        sys.exit(130)

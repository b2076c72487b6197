"""A multi-step agent whose steps have different TTFT targets: plan, act with tools, summarise.

    python examples/agent.py                     # 12 agents at once over 3 emulated engines
    python examples/agent.py --agents 40         # more load: watch the router shift steps
    python examples/agent.py --pool pool.toml    # real vLLM servers

Each agent answers one question in three kinds of step, and each kind carries
the TTFT target its latency matters for:

* **plan** (the user is waiting for something to happen): 0.3 s;
* **act**: a local tool runs (a calculator, a lookup table) and the model reads
  its observation; nobody watches these, so 1.5 s;
* **summarise** (the answer the user reads as it streams): 0.4 s.

With the same router, the tight steps go to instances predicted to answer in
time and the loose ones can take the large model's queue. The table at the end
shows, per step kind, where requests went and how many met their target.
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import sys
from collections import Counter, defaultdict
from collections.abc import Callable

import anyio
import attrs
from _pool import add_pool_args, pool_for

from bearsdk import BEAR, AsyncRouter, DispatchError, NoInstanceError

TARGETS = {"plan": 0.3, "act": 1.5, "summarise": 0.4}
MAX_TOKENS = {"plan": 64, "act": 48, "summarise": 160}

FACTS = {
    "boiling point of water": "100 degrees Celsius at sea level",
    "speed of light": "299,792,458 metres per second",
    "tallest mountain": "Mount Everest, 8,849 metres",
    "largest ocean": "the Pacific Ocean",
    "author of hamlet": "William Shakespeare",
}
QUESTIONS = [
    ("What is 17 * 23 + 4, and what is the boiling point of water?", "17 * 23 + 4"),
    ("How far does light travel in 3 seconds (use the speed of light)?", "299792458 * 3"),
    ("Who is the author of Hamlet, and what is 2 ** 10?", "2 ** 10"),
    ("Which is the largest ocean, and what is (125 - 5) / 4?", "(125 - 5) / 4"),
    ("How tall is the tallest mountain in km (divide by 1000)?", "8849 / 1000"),
]

_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def calculator(expr: str) -> str:
    """Evaluate arithmetic safely (numbers and + - * / ** only)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    return f"{expr} = {ev(ast.parse(expr, mode='eval').body):g}"


def lookup(question: str) -> str:
    """Facts whose key appears in the question."""
    q = question.lower()
    hits = [f"{k}: {v}" for k, v in FACTS.items() if k in q]
    return "; ".join(hits) or "no fact found"


@attrs.frozen
class StepRecord:
    """One model call of one agent."""

    kind: str
    instance: str | None
    predicted_s: float | None
    observed_s: float | None
    target_s: float

    @property
    def met(self) -> bool:
        return self.observed_s is not None and self.observed_s <= self.target_s


async def ask(router: AsyncRouter, kind: str, prompt: str, log: list[StepRecord]) -> str:
    """One streamed model call with its step's TTFT target; returns the text."""
    target = TARGETS[kind]
    try:
        stream = await router.chat(
            [{"role": "user", "content": prompt}],
            ttft_target=target,
            stream=True,
            max_tokens=MAX_TOKENS[kind],
        )
        parts = []
        async with stream:
            async for chunk in stream:
                for choice in chunk.get("choices", ()):
                    parts.append(choice.get("delta", {}).get("content") or "")
    except (NoInstanceError, DispatchError) as exc:
        log.append(StepRecord(kind, None, None, None, target))
        return f"(failed: {exc})"
    log.append(
        StepRecord(kind, stream.instance, stream.decision.chosen.ttft_s, stream.ttft_s, target)
    )
    return "".join(parts)


async def run_agent(router: AsyncRouter, question: str, expr: str, log: list[StepRecord]) -> str:
    """Plan, act with two tools, summarise."""
    plan = await ask(
        router,
        "plan",
        f"You can use the tools calculator(expr) and lookup(topic).\n"
        f"Question: {question}\nWrite a short numbered plan.",
        log,
    )
    observations = []
    # The tool choice comes from the question (emulated models write filler text).
    for tool, arg in (("calculator", expr), ("lookup", question)):
        result = calculator(arg) if tool == "calculator" else lookup(arg)
        observations.append(f"{tool}({arg!r}) -> {result}")
        await ask(
            router,
            "act",
            f"Plan:\n{plan[:400]}\nObservation: {observations[-1]}\n"
            "Does this answer part of the question? Say what is still missing.",
            log,
        )
    return await ask(
        router,
        "summarise",
        f"Question: {question}\nFindings:\n" + "\n".join(observations) + "\nAnswer concisely.",
        log,
    )


def report(log: list[StepRecord]) -> str:
    by_kind: dict[str, list[StepRecord]] = defaultdict(list)
    for r in log:
        by_kind[r.kind].append(r)
    instances = sorted({r.instance for r in log if r.instance})
    lines = [
        f"{'step':10} {'target':>7} {'calls':>6} {'met':>6} {'TTFT p50':>9}  "
        + "  ".join(f"{i:>18}" for i in instances)
    ]
    for kind in TARGETS:
        rs = by_kind.get(kind, [])
        if not rs:
            continue
        obs = sorted(r.observed_s for r in rs if r.observed_s is not None)
        where = Counter(r.instance for r in rs)
        p50 = f"{obs[len(obs) // 2] * 1e3:7.0f}ms" if obs else "      -"
        lines.append(
            f"{kind:10} {TARGETS[kind]:6.2f}s {len(rs):6} {sum(r.met for r in rs) / len(rs):6.0%} "
            f"{p50:>9}  " + "  ".join(f"{where.get(i, 0) / len(rs):18.0%}" for i in instances)
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    log: list[StepRecord] = []
    async with pool_for(args) as configs, AsyncRouter(configs, BEAR(lam=args.lam)) as router:
        answers: list[str] = []

        async def one(i: int) -> None:
            await anyio.sleep(rng.uniform(0, args.spread))  # agents start over a few seconds
            question, expr = QUESTIONS[i % len(QUESTIONS)]
            answers.append(await run_agent(router, question, expr, log))

        async with anyio.create_task_group() as tg:
            for i in range(args.agents):
                tg.start_soon(one, i)
    print(f"{args.agents} agents, {len(log)} model calls\n")
    print(report(log))
    failed = sum(r.instance is None for r in log)
    if failed:
        print(f"\n{failed} calls failed")
    return 0 if len(answers) == args.agents else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pool_args(parser)
    parser.add_argument("--agents", type=int, default=12, help="agents running at once")
    parser.add_argument("--spread", type=float, default=2.0, help="start agents over this long (s)")
    parser.add_argument("--lam", type=float, default=5e-4, help="BEAR's cost weight")
    parser.add_argument("--seed", type=int, default=0)
    sys.exit(anyio.run(main, parser.parse_args()))

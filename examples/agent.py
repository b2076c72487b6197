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

Each agent is one conversation: every step resends the system prompt (the
tools, the same for every agent), the question and the steps so far, as agents
do. The engines cache prefixes (vLLM's automatic prefix caching), and the
router knows what each holds: the emulated engines publish their KV events and
the router tokenizes each step as they do, so a step can go where its
conversation is already cached (with a pool file: an estimate from what the
router sent where). The last columns show the prompt tokens the chosen
instance held and how often the step went to the instance holding the most;
``--explain N`` prints the first N decisions in full.
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
from _pool import add_pool_args, cached_pool_for

from bearsdk import BEAR, AsyncRouter, DispatchError, NoInstanceError

TARGETS = {"plan": 0.3, "act": 1.5, "summarise": 0.4}
SYSTEM = (
    "You are a careful research agent. You answer questions by planning, calling tools "
    "and summarising what they returned. Tools:\n"
    "- calculator(expr): evaluates arithmetic with + - * / ** and parentheses, and "
    "returns the expression with its value.\n"
    "- lookup(topic): returns the facts the knowledge base holds on the topics named in "
    "the text (boiling points, physical constants, geography, literature).\n"
    "Rules: call one tool at a time; quote every number you use from an observation; "
    "say what is still missing after each observation; never guess a fact a tool can "
    "give; keep the final answer to two sentences."
)
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


@attrs.define
class Explained:
    """The first ``limit`` decisions' explanations."""

    limit: int
    texts: list[str] = attrs.Factory(list)


@attrs.frozen
class StepRecord:
    """One model call of one agent."""

    kind: str
    instance: str | None
    predicted_s: float | None
    observed_s: float | None
    target_s: float
    cached: int = -1  # prompt tokens the chosen instance held (-1: unknown)
    most_cached: int = -1  # the most any candidate held

    @property
    def met(self) -> bool:
        return self.observed_s is not None and self.observed_s <= self.target_s


async def ask(
    router: AsyncRouter,
    kind: str,
    messages: list[dict[str, str]],
    log: list[StepRecord],
    explain: Explained,
) -> str:
    """One streamed model call of the conversation with its step's TTFT target;
    the answer is appended to ``messages`` and returned."""
    target = TARGETS[kind]
    try:
        stream = await router.chat(
            messages,
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
    d = stream.decision
    if explain.limit > len(explain.texts):
        explain.texts.append(d.explain())
    log.append(
        StepRecord(
            kind,
            stream.instance,
            d.chosen.ttft_s,
            stream.ttft_s,
            target,
            d.chosen.cached_tokens,
            max(c.cached_tokens for c in d.candidates),
        )
    )
    text = "".join(parts)
    messages.append({"role": "assistant", "content": text})
    return text


async def run_agent(
    router: AsyncRouter, question: str, expr: str, log: list[StepRecord], explain: Explained
) -> str:
    """Plan, act with two tools, summarise: one growing conversation."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question: {question}\nWrite a short numbered plan."},
    ]
    await ask(router, "plan", messages, log, explain)
    # The tool choice comes from the question (emulated models write filler text).
    for tool, arg in (("calculator", expr), ("lookup", question)):
        result = calculator(arg) if tool == "calculator" else lookup(arg)
        messages.append(
            {
                "role": "user",
                "content": f"Observation: {tool}({arg!r}) -> {result}\n"
                "Does this answer part of the question? Say what is still missing.",
            }
        )
        await ask(router, "act", messages, log, explain)
    messages.append({"role": "user", "content": "Answer the question concisely."})
    return await ask(router, "summarise", messages, log, explain)


def report(log: list[StepRecord]) -> str:
    by_kind: dict[str, list[StepRecord]] = defaultdict(list)
    for r in log:
        by_kind[r.kind].append(r)
    instances = sorted({r.instance for r in log if r.instance})
    lines = [
        f"{'step':10} {'target':>7} {'calls':>6} {'met':>6} {'TTFT p50':>9} "
        f"{'cached':>7} {'on cache':>8}  " + "  ".join(f"{i:>18}" for i in instances)
    ]
    for kind in TARGETS:
        rs = by_kind.get(kind, [])
        if not rs:
            continue
        obs = sorted(r.observed_s for r in rs if r.observed_s is not None)
        where = Counter(r.instance for r in rs)
        p50 = f"{obs[len(obs) // 2] * 1e3:7.0f}ms" if obs else "      -"
        # Mean prompt tokens the chosen instance held; how often it held the most.
        known = [r for r in rs if r.cached >= 0]
        cached = f"{sum(r.cached for r in known) / len(known):7.0f}" if known else "      -"
        warm = [r for r in known if r.most_cached > 0]
        on = (
            f"{sum(r.cached == r.most_cached for r in warm) / len(warm):8.0%}"
            if warm
            else "       -"
        )
        lines.append(
            f"{kind:10} {TARGETS[kind]:6.2f}s {len(rs):6} {sum(r.met for r in rs) / len(rs):6.0%} "
            f"{p50:>9} {cached} {on}  "
            + "  ".join(f"{where.get(i, 0) / len(rs):18.0%}" for i in instances)
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    log: list[StepRecord] = []
    explain = Explained(args.explain)
    async with (
        cached_pool_for(args) as (configs, cache_kw),
        AsyncRouter(configs, BEAR(lam=args.lam), **cache_kw) as router,
    ):
        answers: list[str] = []

        async def one(i: int) -> None:
            await anyio.sleep(rng.uniform(0, args.spread))  # agents start over a few seconds
            question, expr = QUESTIONS[i % len(QUESTIONS)]
            answers.append(await run_agent(router, question, expr, log, explain))

        async with anyio.create_task_group() as tg:
            for i in range(args.agents):
                tg.start_soon(one, i)
    for text in explain.texts:
        print(text, end="\n\n")
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
    parser.add_argument(
        "--explain", type=int, default=0, metavar="N", help="print the first N decisions"
    )
    sys.exit(anyio.run(main, parser.parse_args()))

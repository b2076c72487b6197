"""Shared by the examples: the pool to route over, emulated unless ``--pool`` names a file.

``--pool pool.toml`` routes over real vLLM servers (see ``AsyncRouter``'s pool
file format); without it three emulated engines (Qwen3-0.6B, 8B and 32B
profiles) start in process, each GPU ``--slowdown`` times slower than the
profiled H100s so that this machine can emulate a busy pool in real time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from bearsdk import InstanceConfig, load_pool_config
from bearsdk.emulator import EnginePool, GroundTruthParams
from bearsdk.errors import BearError

PROFILES = ("qwen3-0.6b-h100", "qwen3-8b-h100", "qwen3-32b-2xh100")


def fail(message: str) -> NoReturn:
    """Print ``message`` as the example's one-line error and exit with status 2."""
    prog = os.path.basename(sys.argv[0])
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def read_pool(path: str) -> list[InstanceConfig]:
    """Read and check a pool file, or :func:`fail` naming the file, the field and the value.

    Everything a router would refuse at start (unknown keys, bad values, an
    unknown profile or scheduler parameter) is refused here, before any engine
    is contacted, so that a typo is one line rather than a traceback.
    """
    try:
        pool = load_pool_config(path)
        for inst in pool:
            inst.batch_time_model()
    except (BearError, OSError, UnicodeDecodeError) as exc:
        fail(f"pool file {path}: {exc}")
    return pool


def add_pool_args(parser: argparse.ArgumentParser) -> None:
    """``--pool FILE`` (real engines) and ``--slowdown X`` (emulated ones)."""
    parser.add_argument(
        "--pool",
        type=read_pool,
        metavar="FILE",
        help="TOML pool file of real vLLM servers (default: emulated)",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=3.0,
        help="emulated GPUs run this many times slower than the profiled H100s (default 3)",
    )


@contextlib.asynccontextmanager
async def pool_for(args: argparse.Namespace) -> AsyncIterator[list[InstanceConfig]]:
    """The instances to route over, for as long as the block runs."""
    if args.pool:
        yield list(args.pool)  # read and checked by read_pool when the arguments were parsed
        return
    slow = GroundTruthParams(time_scale=args.slowdown)
    async with EnginePool.of(*PROFILES, time_model=slow) as pool:
        # The router learns the slower GPUs from the engines' /bear/batches;
        # start it from each GPU's own calibration rather than the H100 profile.
        yield [
            InstanceConfig(
                name=c.name,
                url=c.url,
                model=c.model,
                scheduler=c.scheduler,
                scheduler_params=c.params,
                batch_time=e.time_model.fit_eq12(),
            )
            for c, e in zip(pool.instance_configs(), pool, strict=True)
        ]


@contextlib.asynccontextmanager
async def cached_pool_for(
    args: argparse.Namespace,
) -> AsyncIterator[tuple[list[InstanceConfig], dict[str, Any]]]:
    """Like :func:`pool_for`, for a router that routes on the engines' prefix caches.

    Yields the instances and the router's keyword arguments. Emulated engines
    (prefix caching is on, as in vLLM) also publish their KV events, and the
    router tokenizes prompts with each model's tokenizer and chat template as
    the engines do; a pool file's real servers get the router's approximate
    index of what it sent where (give ``kv_events`` in the pool file to follow
    their events).
    """
    if args.pool:
        yield list(args.pool), {"dispatch_prefixes": True}
        return
    from bearsdk.emulator.chat_tokenizer import stand_in_chat_tokenizer

    slow = GroundTruthParams(time_scale=args.slowdown)
    async with EnginePool.of(*PROFILES, time_model=slow, kv_events=True) as pool:
        configs = pool.instance_configs(calibrated=True)
        tokenizers = {e.model_name: stand_in_chat_tokenizer(e.tokenizer) for e in pool}
        yield configs, {"tokenizers": tokenizers}

"""``bearsdk emulate``: serve one or more emulated vLLM engines until interrupted.

``bearsdk emulate --profile qwen3-8b-h100 --port 8001`` serves vLLM's
OpenAI-compatible API for the profile's model, with ``bear.snapshot/1``
endpoints; repeat ``--profile`` for several engines in one process (consecutive
ports from ``--port``). ``--list-profiles`` lists the shipped profiles.
``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` and
``--enable-prompt-tokens-details`` are vLLM's flags.
"""

from __future__ import annotations

import argparse
import gc
import signal
import sys
from typing import TYPE_CHECKING

from bearsdk.cli import nonnegative_int, positive_float, scheduler_arg
from bearsdk.errors import BearError

if TYPE_CHECKING:
    from bearsdk.emulator import EmulatedEngine, EngineConfig

# The emulator (and numpy, the schedulers and the replay with it) is imported
# by the functions that run the command: every other command builds this
# parser too, and should not pay for it.

__all__ = ["register"]


class EmulateError(BearError, ValueError):
    """A bad ``bearsdk emulate`` argument."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "emulate",
        help="serve an emulated vLLM engine (OpenAI API, real scheduling, no GPU)",
        description=(
            "Serve vLLM's OpenAI-compatible API from an emulated engine: a registered "
            "scheduler policy forms the batches, a roofline model of the GPU times them, "
            "tokens stream in real time, and bear.snapshot/1 is published after every step."
        ),
    )
    p.add_argument(
        "--profile",
        action="append",
        metavar="NAME",
        help="emulator profile (repeat for several engines; default qwen3-8b-h100)",
    )
    p.add_argument("--list-profiles", action="store_true", help="list the profiles and exit")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=nonnegative_int, default=8001, help="port of the first engine (0: any)"
    )
    p.add_argument(
        "--scheduler",
        type=scheduler_arg,
        default="vllm-v1",
        help="registered scheduler policy, or a policy spec file (.toml)",
    )
    p.add_argument(
        "--param", action="append", default=[], metavar="K=V", help="policy parameter override"
    )
    p.add_argument("--instance", help="instance name (one engine only; default <profile>-<i>)")
    p.add_argument("--served-model-name", help="model name in the API (one engine only)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the first engine")
    p.add_argument(
        "--publish-output-len",
        action="store_true",
        help="put each request's true output_len in snapshots (tests)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching, as vLLM's flag (default: the scheduler's "
        "enable_prefix_caching, on in vllm-v1 as in vLLM)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details (cached_tokens), as vLLM's flag",
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="publish vLLM's KV cache events on ZeroMQ, as --kv-events-config does "
        "(prefix caching only; the kvevents extra); the endpoints are printed",
    )
    p.add_argument("--no-noise", action="store_true", help="deterministic batch times")
    p.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="multiply batch durations (0.5: run twice as fast as the modelled GPU)",
    )
    p.set_defaults(func=_run)


def _params(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise EmulateError(f"--param must be KEY=VALUE (got {item!r})")
        out[key.strip()] = value.strip()
    return out


def _configs(args: argparse.Namespace) -> list[EngineConfig]:
    from bearsdk.emulator import EngineConfig, get_profile
    from bearsdk.emulator.timing import GroundTruthParams

    profiles = args.profile or ["qwen3-8b-h100"]
    if len(profiles) > 1 and (args.instance or args.served_model_name):
        raise EmulateError("--instance and --served-model-name need a single --profile")
    if not 0 <= args.port <= 65535 - len(profiles):
        raise EmulateError(f"--port must be in [0, 65535] (got {args.port})")
    if not args.time_scale > 0:
        raise EmulateError(f"--time-scale must be > 0 (got {args.time_scale})")
    for name in profiles:
        try:
            get_profile(name)
        except KeyError as exc:
            raise EmulateError(str(exc.args[0])) from None
    time_model = GroundTruthParams(time_scale=args.time_scale)
    if args.no_noise:
        time_model = time_model.without_noise()
    params = _params(args.param)
    _prefix_caching(args, params)
    counts: dict[str, int] = {}
    out = []
    for i, name in enumerate(profiles):
        k = counts.get(name, 0)
        counts[name] = k + 1
        out.append(
            EngineConfig(
                profile=name,
                scheduler=args.scheduler,
                params=params,
                instance=args.instance or f"{name}-{k}",
                served_model_name=args.served_model_name,
                host=args.host,
                port=0 if args.port == 0 else args.port + i,
                seed=args.seed + i,
                time_model=time_model,
                publish_output_len=args.publish_output_len,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                kv_events=args.kv_events,
            )
        )
    return out


def _prefix_caching(args: argparse.Namespace, params: dict[str, object]) -> None:
    """Put ``--[no-]enable-prefix-caching`` into the policy parameters."""
    flag = args.enable_prefix_caching
    if flag is None:
        return
    name = "--enable-prefix-caching" if flag else "--no-enable-prefix-caching"
    if "enable_prefix_caching" in params:
        raise EmulateError(f"{name} and --param enable_prefix_caching=...: give one of them")
    from bearsdk.schedulers import get_scheduler

    try:
        known = "enable_prefix_caching" in get_scheduler(args.scheduler).params
    except BearError:
        return  # an unknown scheduler is reported where it is bound
    if known:
        params["enable_prefix_caching"] = flag
    elif flag:
        raise EmulateError(
            f"{name}: scheduler {args.scheduler!r} has no prefix cache "
            "(no enable_prefix_caching parameter)"
        )


async def _serve(configs: list[EngineConfig]) -> int:
    import anyio

    from bearsdk.emulator import EnginePool

    async with EnginePool(configs) as pool:
        # A long-lived server: keep the start-up objects out of every full collection
        # (a full pass over them stalls the loop for 10-20 ms).
        gc.collect()
        gc.freeze()
        for e in pool:
            _describe(e)
        print("press Ctrl-C to stop", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                # SIGTERM is the orderly stop of a service; Ctrl-C is an interruption.
                return 130 if signum == signal.SIGINT else 0
    return 0


def _describe(e: EmulatedEngine) -> None:
    p = e.policy
    print(
        f"{e.instance}: {e.model_name} ({e.profile.description}) on {e.url} | "
        f"scheduler {p.name}, {p.token_budget} tokens/batch, {p.max_seqs} seqs, "
        f"{p.num_blocks} KV blocks of {p.block_size}, max_model_len {e.max_model_len}"
        f"{', prefix caching' if e.prefix_caching else ''}",
        flush=True,
    )
    ends = e.kv_events_endpoints
    if ends is not None:
        print(f"{e.instance}: KV events on {ends[0]} (replay {ends[1]})", flush=True)


def _run(args: argparse.Namespace) -> int:
    import anyio

    from bearsdk.emulator import get_profile, profile_names

    if args.list_profiles:
        for name in profile_names():
            prof = get_profile(name)
            print(f"{name:20s} {prof.model:40s} {prof.description}")
        return 0
    configs = _configs(args)
    # The engines are closed (sockets, tasks) before this returns; an OSError here (a
    # port in use) becomes `bearsdk emulate: error: ...` in bearsdk.cli.main.
    status: int = anyio.run(_serve, configs)
    if status == 130:
        print("bearsdk emulate: interrupted", file=sys.stderr, flush=True)
    return status

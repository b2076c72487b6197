"""How an emulated engine is configured, and how a configuration binds its scheduler.

:class:`EngineConfig` names the profile, the scheduler policy and its flags, and
the HTTP address (used only when the engine serves HTTP, :class:`~bearsdk.emulator.
EmulatedEngine`; the HTTP-free :class:`~bearsdk.emulator.core.EngineCore` ignores
``host``, ``port`` and ``serve_http``). :func:`bind_config` turns it into the bound
policy, with the defaults ``vllm serve`` picks on the profile's hardware.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from bearsdk.emulator.profiles import EmulatorProfile
from bearsdk.emulator.timing import GroundTruthParams
from bearsdk.errors import BearError
from bearsdk.schedulers import Policy, bind_scheduler, get_scheduler

__all__ = ["EngineConfig", "EngineConfigError", "bind_config", "config_check"]


class EngineConfigError(BearError, ValueError):
    """An engine configuration is invalid (the message names the field and value)."""


def config_check(cond: bool, field: str, message: str, value: object) -> None:
    """Raise :class:`EngineConfigError` naming ``field`` and ``value`` unless ``cond``."""
    if not cond:
        raise EngineConfigError(f"{field} {message} (got {value!r})")


@attrs.frozen
class EngineConfig:
    """How to run one emulated engine instance.

    Attributes:
        profile: Emulator profile (``bearsdk emulate --list-profiles``).
        scheduler: Registered scheduler policy that forms the batches.
        params: Policy parameter overrides, named as the engine's flags
            (``max_num_batched_tokens``, ``max_num_seqs``, ``num_gpu_blocks``, ...).
            vLLM-named flags the policy has default to what ``vllm serve`` picks
            on the profile's hardware.
        instance: Instance name in snapshots (default ``<profile>-0``).
        served_model_name: Model name in the API (default: the profile's model).
        host: Address to bind (HTTP; an :class:`~bearsdk.emulator.EmulatedEngine` only).
        port: Port to bind (0: any free port; an :class:`~bearsdk.emulator.EmulatedEngine` only).
        seed: Seeds batch-time noise and fault draws.
        time_model: Ground-truth time-model constants (noise, overheads, speed).
        schedule_lead_s: How long before the running batch completes the next one
            is scheduled (async scheduling).
        publish_output_len: Put each request's true ``output_len`` in snapshots (tests).
        heartbeat_s: Empty line on push streams after this long without data.
        batch_buffer: Unsent records a ``/bear/batches`` reader may have.
        log_size: Finished-request and batch records kept in memory.
        serve_http: Whether an :class:`~bearsdk.emulator.EmulatedEngine` serves the
            HTTP API (``False``: in-process use only, like a bare
            :class:`~bearsdk.emulator.core.EngineCore`).
        answer_lengths: Known answers: the natural output length, in tokens, of
            prompts whose text (a completion's prompt, a chat's last user
            message) is a key, as when replaying a dataset's real answers
            (``bearsdk demo --workload alpaca-eval``). Other prompts draw from the
            profile's length model; ``bear_output_len`` still overrides both.
        kv_events: Publish vLLM's KV events (``BlockStored``, ``BlockRemoved``,
            ``AllBlocksCleared``) on a ZeroMQ PUB socket with a replay socket, as
            ``vllm serve --kv-events-config`` does (prefix caching only; the
            ``kvevents`` extra; :mod:`bearsdk.emulator.kvevents`).
        enable_prompt_tokens_details: Report ``usage.prompt_tokens_details``
            (``cached_tokens``: the prefix-cache hit) as vLLM's
            ``--enable-prompt-tokens-details`` does. Prefix caching itself is the
            scheduler's ``enable_prefix_caching`` parameter.
    """

    profile: str = "qwen3-8b-h100"
    scheduler: str = "vllm-v1"
    params: Mapping[str, object] = attrs.field(factory=dict, hash=False)
    instance: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    time_model: GroundTruthParams = attrs.field(factory=GroundTruthParams)
    schedule_lead_s: float = 0.002
    publish_output_len: bool = False
    heartbeat_s: float = 1.0
    batch_buffer: int = 4096
    log_size: int = 10_000
    serve_http: bool = True
    answer_lengths: Mapping[str, int] = attrs.field(factory=dict, hash=False, repr=False)
    enable_prompt_tokens_details: bool = False
    kv_events: bool = False

    def __attrs_post_init__(self) -> None:
        config_check(0 <= self.port <= 65535, "port", "must be in [0, 65535]", self.port)
        lead = self.schedule_lead_s
        config_check(math.isfinite(lead) and lead >= 0, "schedule_lead_s", "must be >= 0", lead)
        hb = self.heartbeat_s
        config_check(math.isfinite(hb) and hb > 0, "heartbeat_s", "must be > 0", hb)
        config_check(self.batch_buffer >= 1, "batch_buffer", "must be >= 1", self.batch_buffer)
        config_check(self.log_size >= 1, "log_size", "must be >= 1", self.log_size)
        if not isinstance(self.params, Mapping):
            raise EngineConfigError(f"params must be a mapping (got {self.params!r})")
        if not isinstance(self.answer_lengths, Mapping):
            raise EngineConfigError(
                f"answer_lengths must be a mapping (got {type(self.answer_lengths).__name__})"
            )
        for text, n in self.answer_lengths.items():
            if not isinstance(text, str) or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise EngineConfigError(
                    f"answer_lengths[{str(text)[:40]!r}] must map a str to an int >= 1 (got {n!r})"
                )


def _defaults_for(
    spec_params: Mapping[str, object], profile: EmulatorProfile, user: Mapping[str, object]
) -> dict[str, object]:
    """Profile-derived defaults for the flags a scheduler spec takes, under the user's.

    Every scheduler with vLLM's KV flags gets the profile's pool size, and its
    context length when the spec leaves ``max_model_len`` at 0; ``vllm serve``'s
    hardware-dependent token budget and sequence cap apply to specs that take
    vLLM V1's flags (``long_prefill_token_threshold`` among them).
    """
    block = user.get("block_size", spec_params.get("block_size", 16))
    try:
        block_size = max(int(str(block)), 1)
    except ValueError:
        block_size = 16
    defaults = profile.engine_defaults(block_size)
    out: dict[str, object] = {}
    if "num_gpu_blocks" in spec_params:
        out["num_gpu_blocks"] = defaults["num_gpu_blocks"]
    if spec_params.get("max_model_len") == 0:
        out["max_model_len"] = defaults["max_model_len"]
    if "long_prefill_token_threshold" in spec_params:
        for k in ("max_num_batched_tokens", "max_num_seqs"):
            if k in spec_params:
                out[k] = defaults[k]
    out.update(user)
    return out


def bind_config(config: EngineConfig, profile: EmulatorProfile) -> tuple[Policy, int]:
    """The policy ``config`` binds on ``profile``, and the context length it accepts.

    Raises:
        EngineConfigError: The KV pool cannot hold one context.
        SpecError: Unknown scheduler or bad policy parameter.
    """
    spec = get_scheduler(config.scheduler)
    pol = bind_scheduler(config.scheduler, _defaults_for(dict(spec.params), profile, config.params))
    if pol.num_blocks <= 0:
        pol = pol.with_kv(pol.block_size, profile.num_gpu_blocks(pol.block_size))
    mml = pol.max_model_len if pol.max_model_len > 0 else profile.max_model_len
    usable = (pol.num_blocks - pol.reserved_blocks) * pol.block_size
    if usable < mml:
        raise EngineConfigError(
            f"the KV pool holds {usable} tokens ({pol.num_blocks} blocks of {pol.block_size}), "
            f"fewer than max_model_len={mml}: lower max_model_len or raise num_gpu_blocks"
        )
    return pol, mml

"""An emulated vLLM engine: vLLM's HTTP API over a real scheduler and a ground-truth clock.

No GPU needed: :class:`EmulatedEngine` speaks vLLM 0.33's OpenAI-compatible API
(completions and chat, SSE streaming, ``/metrics``), forms every batch with a
registered scheduler policy (``vllm-v1`` by default), times it with a roofline
model derived from measured GPU profiles (not eq. 12), streams tokens as batches
complete in real time, publishes ``bear.snapshot/1`` after every step, and
injects faults on demand. :class:`EngineCore` is the same engine without HTTP
(in-process use; no aiohttp). Run one with ``bearsdk emulate --profile qwen3-8b-h100
--port 8001``, or several in process with :class:`EnginePool`. See
``docs/emulator.md``.
"""

from bearsdk.emulator.config import EngineConfig, EngineConfigError
from bearsdk.emulator.core import EngineCore
from bearsdk.emulator.engine import EmulatedEngine
from bearsdk.emulator.faults import Faults, FaultsError
from bearsdk.emulator.hubs import PublishedSnapshot
from bearsdk.emulator.loopstats import LoopStats
from bearsdk.emulator.pool import EnginePool
from bearsdk.emulator.profiles import EmulatorProfile, get_profile, profile_names
from bearsdk.emulator.requests import GenerationPlan, RequestHandle, RequestRecord
from bearsdk.emulator.text import OutputLengthModel, Tokenizer
from bearsdk.emulator.timing import BatchShape, GroundTruthParams, GroundTruthTimeModel

__all__ = [
    "BatchShape",
    "EmulatedEngine",
    "EmulatorProfile",
    "EngineConfig",
    "EngineConfigError",
    "EngineCore",
    "EnginePool",
    "Faults",
    "FaultsError",
    "GenerationPlan",
    "GroundTruthParams",
    "GroundTruthTimeModel",
    "LoopStats",
    "OutputLengthModel",
    "PublishedSnapshot",
    "RequestHandle",
    "RequestRecord",
    "Tokenizer",
    "get_profile",
    "profile_names",
]

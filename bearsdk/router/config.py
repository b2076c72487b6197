"""The pool a router routes over: instances, their engines, and how to watch them.

A pool is built in Python (:class:`InstanceConfig` values) or read from a TOML
file (:func:`load_pool_config`)::

    [[instances]]
    name = "qwen3-8b-0"
    url = "http://10.0.0.5:8000"
    model = "Qwen/Qwen3-8B"               # the predictor's model name
    scheduler = "vllm-v1"                  # a registered policy spec
    profile = "qwen3-8b-h100"              # a batch-time profile (or batch_time = [b0, b1, b2, b3])
    snapshots = "push"                     # push | poll | shm | metrics | redis
    accuracy_prior = 0.6                   # only for a model the predictor was not trained on
    [instances.scheduler_params]
    max_num_batched_tokens = 8192
    max_num_seqs = 256

Decoding is strict: unknown keys are errors naming the instance and the field.

A model the router's predictor was not trained on still routes, on latency,
from day one: it gets the predictor's prior (:meth:`Predictor.with_priors
<bearsdk.predictors.Predictor.with_priors>`: the pool-average output length and
prices, accuracy ``accuracy_prior`` if given, else the trained models' mean),
and a WARNING is logged once per model saying how to train a predictor for it.
"""

from __future__ import annotations

import difflib
import logging
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from bearsdk.errors import BearError
from bearsdk.estimators.batch_time import BatchTimeModel
from bearsdk.router.sources import SourceError, get_snapshot_source

if TYPE_CHECKING:
    from bearsdk.predictors.protocol import PoolPredictor

__all__ = ["SNAPSHOT_MODES", "ConfigError", "InstanceConfig", "cover_models", "load_pool_config"]

_log = logging.getLogger("bearsdk.router")

SNAPSHOT_MODES: Final = ("push", "poll", "shm", "metrics", "redis")
"""The built-in snapshot source kinds (any kind registered with
:func:`~bearsdk.router.sources.register_snapshot_source` is accepted too).
How the router learns an instance's state: the push stream, polling
``/bear/snapshot``, a shared-memory segment, (unmodified vLLM) a shadow view
reconciled with ``/metrics``, or the Redis bus router replicas share (needs
``AsyncRouter(..., cluster=...)``; the push stream stands in while Redis is
unusable)."""


class ConfigError(BearError, ValueError):
    """A pool configuration is invalid; the message names the instance and the field."""


def _url(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ConfigError(f"{att.name} must start with http:// or https:// (got {value!r})")


def _mode(inst: object, att: attrs.Attribute[str], value: str) -> None:
    # Any registered kind (bearsdk.router.sources), the built-ins and users' own.
    try:
        get_snapshot_source(value)
    except SourceError as exc:
        raise ConfigError(str(exc)) from None


def _positive(inst: object, att: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{att.name} must be a number > 0 (got {value!r})")


def _zmq(inst: object, att: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(
            f"{att.name} must be a ZeroMQ endpoint (tcp://host:port, ipc://path) (got {value!r})"
        )


def _prior(inst: object, att: attrs.Attribute[float | None], value: float | None) -> None:
    if value is None:
        return
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not 0.0 <= value <= 1.0
    ):
        raise ConfigError(f"{att.name} must be a number in [0, 1] (got {value!r})")


def _frozen_params(v: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((v or {}).items()))


@attrs.frozen
class InstanceConfig:
    """One model instance of the pool.

    Attributes:
        name: Unique instance name (metrics, decisions, snapshots' ``instance``).
        url: Base URL of its OpenAI-compatible server (vLLM or the emulator).
        snapshot_url: Base URL of its ``/bear/*`` endpoints (snapshots, batch
            records) when another port serves them, as the vLLM plugin's side
            server does (``bearsdk.vllm``); default: ``url``.
        model: The model's name in the predictor's pool (accuracy, length, prices).
        served_model: The ``model`` field the engine expects; default: ``model``.
        scheduler: Registered scheduler-policy name.
        scheduler_params: Policy parameters, named as the engine's flags.
        profile: Batch-time profile name (``bearsdk calibrate --list-profiles``).
        batch_time: Explicit eq. 12 coefficients, overriding ``profile``; in a
            pool file ``[b0, b1, b2, b3]`` or a table with those keys and
            optionally ``dense_floor_tokens`` and ``decode_keys``.
        snapshots: A registered snapshot source kind (:data:`SNAPSHOT_MODES` are
            the built-ins).
        poll_interval_s: Interval of polling sources (``poll``, ``metrics``).
        shm_name: Shared-memory segment name (``shm``); default ``bear.<name>``.
        timeout_s: Per-request timeout for dispatch (connect to last byte).
        kv_events: The engine's KV event PUB endpoint (``vllm serve
            --kv-events-config``'s ``endpoint``, e.g. ``tcp://host:5557``): the
            router keeps the instance's cached blocks from it and prices each
            request's cached prefix there (``prompt_token_ids``; the
            ``kvevents`` extra; ``docs/prefix-caching.md``).
        kv_events_replay: Its replay endpoint (``replay_endpoint``): lost
            batches are fetched again; without it a gap restarts the index.
        accuracy_prior: Accuracy in [0, 1] assumed for ``model`` when the
            predictor was not trained on it (default: neutral, the trained
            models' mean for each prompt); ignored for a model it knows.
    """

    name: str
    url: str = attrs.field(validator=_url)
    model: str
    snapshot_url: str | None = attrs.field(default=None, validator=attrs.validators.optional(_url))
    served_model: str | None = None
    scheduler: str = "vllm-v1"
    scheduler_params: tuple[tuple[str, Any], ...] = attrs.field(
        default=(), converter=_frozen_params
    )
    profile: str | None = None
    batch_time: BatchTimeModel | None = None
    snapshots: str = attrs.field(default="push", validator=_mode)
    poll_interval_s: float = attrs.field(default=0.05, validator=_positive)
    shm_name: str | None = None
    timeout_s: float = attrs.field(default=300.0, validator=_positive)
    accuracy_prior: float | None = attrs.field(default=None, validator=_prior)
    kv_events: str | None = attrs.field(default=None, validator=attrs.validators.optional(_zmq))
    kv_events_replay: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_zmq)
    )

    @property
    def bear_url(self) -> str:
        """Where the ``/bear/*`` endpoints are: ``snapshot_url``, else ``url``."""
        return self.snapshot_url or self.url

    @property
    def engine_model(self) -> str:
        """The ``model`` value sent to the engine."""
        return self.served_model or self.model

    @property
    def params(self) -> dict[str, Any]:
        """``scheduler_params`` as a dict."""
        return dict(self.scheduler_params)

    def batch_time_model(self) -> BatchTimeModel:
        """The instance's eq. 12 coefficients (explicit, else its profile).

        Raises:
            ConfigError: Neither is given, or the profile is unknown.
        """
        if self.batch_time is not None:
            return self.batch_time
        if self.profile is None:
            raise ConfigError(f"instance {self.name!r}: needs a profile or batch_time")
        from bearsdk.estimators.profiles import load_profile

        try:
            return load_profile(self.profile)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"instance {self.name!r}: profile: {exc}") from None


_FIELDS: Final = {f.name for f in attrs.fields(InstanceConfig)}


_BATCH_TIME_KEYS: Final = ("b0", "b1", "b2", "b3", "dense_floor_tokens", "decode_keys")


def _batch_time(label: str, bt: object) -> BatchTimeModel:
    """``batch_time``: ``[b0, b1, b2, b3]``, or a table as ``bearsdk calibrate`` prints it."""
    try:
        if isinstance(bt, Mapping):
            unknown = sorted(set(map(str, bt)) - set(_BATCH_TIME_KEYS))
            if unknown:
                raise ConfigError(
                    f"{label}: batch_time.{unknown[0]} is not a known field"
                    f" (known: {', '.join(_BATCH_TIME_KEYS)})"
                )
            missing = [k for k in _BATCH_TIME_KEYS[:4] if k not in bt]
            if missing:
                raise ConfigError(f"{label}: batch_time.{missing[0]} is required")
            return BatchTimeModel(**{str(k): v for k, v in bt.items()})
        if isinstance(bt, str) or not isinstance(bt, Sequence) or len(bt) != 4:
            raise ConfigError(
                f"{label}: batch_time must be [b0, b1, b2, b3] or a table (got {bt!r})"
            )
        return BatchTimeModel(*bt)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        # The model names its field ("batch-time coefficient b2 must be ..."):
        # say it as the pool file spells it.
        msg = str(exc)
        for prefix in ("batch-time coefficient ", "batch-time "):
            if msg.startswith(prefix):
                raise ConfigError(f"{label}: batch_time.{msg[len(prefix) :]}") from None
        raise ConfigError(f"{label}: batch_time: {msg}") from None


def instance_from_dict(d: Mapping[str, Any], where: str = "instance") -> InstanceConfig:
    """Build an :class:`InstanceConfig` from its dict form, strictly."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where} must be a table (got {d!r})")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name must be a non-empty string (got {name!r})")
    label = f"instance {name!r}"
    for key in d:
        if key not in _FIELDS:
            close = difflib.get_close_matches(str(key), sorted(_FIELDS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{label}: {key} is not a known field{hint} (known: {', '.join(sorted(_FIELDS))})"
            )
    for key in ("url", "model"):
        if key not in d:
            raise ConfigError(f"{label}: {key} is required")
    kw = dict(d)
    bt = kw.get("batch_time")
    if bt is not None and not isinstance(bt, BatchTimeModel):
        kw["batch_time"] = _batch_time(label, bt)
    params = kw.get("scheduler_params")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"{label}: scheduler_params must be a table (got {params!r})")
    try:
        inst = InstanceConfig(**kw)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    # Fail at load time, not at the first request: bind the scheduler spec now.
    from bearsdk.errors import SpecError
    from bearsdk.schedulers import bind_scheduler

    try:
        bind_scheduler(inst.scheduler, inst.params)
    except SpecError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    return inst


_WARNED: set[str] = set()


def cover_models(predictor: PoolPredictor, configs: Sequence[InstanceConfig]) -> PoolPredictor:
    """Return ``predictor``, extended with a prior for each model of ``configs`` it lacks.

    Logs a WARNING (once per model and process) naming the model and how to
    train a predictor that knows it.

    Raises:
        ConfigError: Two instances of one unknown model give different priors.
    """
    # Stand-ins for a Predictor (the simulator's feed) have only ``models``.
    trained = getattr(predictor, "trained_models", predictor.models)
    given: dict[str, float | None] = dict(getattr(predictor, "priors", ()))
    priors: dict[str, float | None] = {}
    for cfg in configs:
        if cfg.model in trained:
            continue
        if cfg.model in given and given[cfg.model] != cfg.accuracy_prior:
            raise ConfigError(
                f"instance {cfg.name!r}: accuracy_prior {cfg.accuracy_prior!r} differs from "
                f"another instance's for model {cfg.model!r} ({given[cfg.model]!r})"
            )
        if cfg.model in priors and priors[cfg.model] != cfg.accuracy_prior:
            raise ConfigError(
                f"instance {cfg.name!r}: accuracy_prior {cfg.accuracy_prior!r} differs from "
                f"another instance's for model {cfg.model!r} ({priors[cfg.model]!r})"
            )
        if cfg.model not in given:
            priors[cfg.model] = cfg.accuracy_prior
    if not priors:
        return predictor
    if not hasattr(predictor, "with_priors"):
        model = next(iter(priors))
        raise ConfigError(
            f"model {model!r} is not in the predictor's pool ({', '.join(predictor.models)})"
        )
    for model, acc in priors.items():
        if model not in _WARNED:
            _WARNED.add(model)
            prior = "neutral" if acc is None else f"{acc:g}"
            _log.warning(
                "model %r is not in the predictor's pool (%s): routing it with a prior "
                "(pool-average output length and prices, accuracy %s); to predict it, train "
                "a predictor on your evaluations with `bearsdk train --data EVALS.jsonl "
                "--pool MODELS.json --out DIR` and pass AsyncRouter(..., "
                "predictor=Predictor.load(DIR)) (docs/predictors.md)",
                model,
                ", ".join(trained),
                prior,
            )
    covered: PoolPredictor = predictor.with_priors(priors)
    return covered


def load_pool_config(source: str | Path | Mapping[str, Any]) -> list[InstanceConfig]:
    """Read a pool from a TOML file (or its parsed dict): ``[[instances]]`` tables.

    Raises:
        ConfigError: Invalid TOML, unknown keys, bad values (a scheduler or its
            parameters included), duplicate names.
    """
    if isinstance(source, Mapping):
        doc: Mapping[str, Any] = source
    else:
        path = Path(source)
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    for key in doc:
        if key not in ("instances", "router"):
            raise ConfigError(f"pool: {key} is not a known section (known: instances, router)")
    raw = doc.get("instances")
    if not isinstance(raw, list) or not raw:
        raise ConfigError("pool: instances must be a non-empty array of tables")
    out = [instance_from_dict(d, f"instances[{i}]") for i, d in enumerate(raw)]
    seen: set[str] = set()
    for inst in out:
        if inst.name in seen:
            raise ConfigError(f"instance {inst.name!r}: duplicate name")
        seen.add(inst.name)
    return out

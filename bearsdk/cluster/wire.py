"""What travels on the Redis bus: key names, dispatch events, the URL as logged.

The bus (:mod:`bearsdk.cluster.bus`) and its readers share these. A
:class:`DispatchEvent` comes from any peer with access to the server, so it is
parsed strictly and every size in it is bounded.
"""

from __future__ import annotations

import math
import re
from typing import Final

import attrs
import orjson

__all__ = [
    "EVENT_KINDS",
    "MAX_EVENT_BYTES",
    "MAX_NAME",
    "MAX_TOKENS",
    "DispatchEvent",
    "key_name",
    "redact_url",
]

EVENT_KINDS: Final = ("dispatch", "token", "complete")
"""What a :class:`DispatchEvent` reports: a request sent to an instance, its first
token seen, or its end (finished, failed or abandoned)."""


MAX_EVENT_BYTES: Final = 4096
"""Larger dispatch entries are malformed (a real one is about 100 bytes)."""
MAX_NAME: Final = 512
"""Longest replica, instance or request id a dispatch event may carry."""
MAX_TOKENS: Final = 1 << 24
"""Largest prompt or output length a dispatch event may carry (beyond any model's context)."""

# The password of a URL's user info, and password=... in its query string.
# Greedy up to the netloc's last '@', as URL parsers split it: a password may hold '@'.
_USERINFO_PW: Final = re.compile(r"^([a-z0-9+.-]+://[^/?#@:]*):[^/?#]*@", re.IGNORECASE)
_QUERY_PW: Final = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs, names and errors).

    ``redis://:secret@host:6379/0`` becomes ``redis://:***@host:6379/0``;
    ``redis://user:secret@host`` becomes ``redis://user:***@host``; a
    ``password=`` query parameter is masked the same way.
    """
    return _QUERY_PW.sub(r"\1***", _USERINFO_PW.sub(r"\1:***@", url))


def key_name(name: str) -> str:
    """``name`` as one component of a Redis key: ``%`` and ``:`` percent-encoded.

    Without it, prefix ``bear:snap:x`` and instance ``y`` would share a key with
    prefix ``bear`` and instance ``x:snap:y``. Names without either character
    are unchanged.
    """
    if "%" not in name and ":" not in name:
        return name
    return name.replace("%", "%25").replace(":", "%3A")


def _prefix(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(
            f"{att.name} must be a non-empty string without spaces (got {value!r:.200})"
        )
    if value.endswith(":snap"):
        # {prefix}:dispatch would be the snapshot key of an instance named
        # "dispatch" under the prefix one level up.
        raise ValueError(f"{att.name} must not end with ':snap' (got {value!r:.200})")


def _url(inst: object, att: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("redis://", "rediss://", "unix://")):
        shown = redact_url(value) if isinstance(value, str) else value
        raise ValueError(
            f"{att.name} must start with redis://, rediss:// or unix:// (got {shown!r:.200})"
        )


def _short(v: object) -> str:
    """A bounded repr of an untrusted JSON value (containers by type and size only)."""
    if isinstance(v, list | dict):
        return f"a {type(v).__name__} of {len(v)}"
    return f"{v!r:.80}"


@attrs.frozen
class DispatchEvent:
    """One replica's dispatch event, as it travels on ``{prefix}:dispatch``.

    Attributes:
        replica: The replica that sent the request.
        kind: One of :data:`EVENT_KINDS`.
        instance: Where the request went.
        rid: The replica's request id (engines' ids contain it).
        time: When it happened, on the replica's clock (wall time).
        prompt_tokens: Prompt length (``dispatch`` only; else 0).
        output_tokens: Predicted output length (``dispatch`` only).
    """

    replica: str
    kind: str
    instance: str
    rid: str
    time: float
    prompt_tokens: int = 0
    output_tokens: int | None = None

    def encode(self) -> bytes:
        """The wire form: a JSON array."""
        return orjson.dumps(
            [
                self.replica,
                self.kind,
                self.instance,
                self.rid,
                self.time,
                self.prompt_tokens,
                self.output_tokens,
            ]
        )

    @classmethod
    def decode(cls, data: bytes | str) -> DispatchEvent:
        """Parse the wire form strictly.

        Entries come from any peer with access to the server: they are
        untrusted, so sizes and numbers are bounded (:data:`MAX_EVENT_BYTES`,
        :data:`MAX_NAME`, :data:`MAX_TOKENS`).

        Raises:
            ValueError: Too large, not a 7-element array, or a field of the wrong
                type or out of bounds (the message names the field and the value).
        """
        if len(data) > MAX_EVENT_BYTES:
            raise ValueError(
                f"dispatch event: must be <= {MAX_EVENT_BYTES} bytes (got {len(data)})"
            )
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"dispatch event: not JSON ({exc})") from None
        if not isinstance(doc, list) or len(doc) != 7:
            # Not the repr of doc: a deeply nested value has no repr (RecursionError).
            what = f"a {len(doc)}-element array" if isinstance(doc, list) else type(doc).__name__
            raise ValueError(f"dispatch event: must be a 7-element array (got {what})")
        replica, kind, instance, rid, t, prompt, out = doc
        for name, v in (("replica", replica), ("instance", instance), ("rid", rid)):
            if not isinstance(v, str) or not v or len(v) > MAX_NAME:
                raise ValueError(
                    f"dispatch event {name}: must be a non-empty string of at most "
                    f"{MAX_NAME} characters (got {_short(v)})"
                )
        if kind not in EVENT_KINDS:
            raise ValueError(
                f"dispatch event kind: must be one of {EVENT_KINDS} (got {_short(kind)})"
            )
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ValueError(f"dispatch event time: must be a finite number (got {_short(t)})")
        lo = 1 if kind == "dispatch" else 0
        bad = isinstance(prompt, bool) or not isinstance(prompt, int)
        if bad or not lo <= prompt <= MAX_TOKENS:
            raise ValueError(
                f"dispatch event prompt_tokens: must be an integer in [{lo}, {MAX_TOKENS}] "
                f"(got {_short(prompt)})"
            )
        if out is not None and (
            isinstance(out, bool) or not isinstance(out, int) or not 1 <= out <= MAX_TOKENS
        ):
            raise ValueError(
                f"dispatch event output_tokens: must be an integer in [1, {MAX_TOKENS}] or null "
                f"(got {_short(out)})"
            )
        return cls(replica, kind, instance, rid, float(t), prompt, out)

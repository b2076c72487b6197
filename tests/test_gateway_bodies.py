"""The gateway's body decoder on arbitrary JSON: it accepts or refuses, never crashes.

Bodies are untrusted. Whatever JSON arrives, ``parse_request`` either returns a
checked request or raises :class:`BadRequest` naming the field; what it returns
passes only known fields, each of the right type and range.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk.gateway.bodies import FIELDS, BadRequest, parse_request

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
known = sorted({k for fields in FIELDS.values() for k in fields} | {"model", "stream"})
keys = st.one_of(st.sampled_from([*known, "messages", "prompt", "bear"]), st.text(max_size=10))
# Values near the fields' bounds, so that accepted bodies are common too.
near = st.sampled_from(
    [None, 0, 1, -1, 2, 20, 128, 129, 2**31 - 1, 2**31, 0.0, 0.5, 1.0, 2.0, 2.5, -2.0,
     True, False, "", "s", ["a"], ["a"] * 17, {}, [], {"k": 1}]
)  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text()}),
    max_size=3,
)
bear = st.dictionaries(
    st.sampled_from(["ttft_ms", "tpot_ms", "timeout_s", "other"]),
    st.one_of(near, st.floats(allow_nan=False), st.text(max_size=4)),
    max_size=3,
)
fields = st.dictionaries(st.sampled_from(known), st.one_of(near, json_values), max_size=5)


def _body(kind: str, prompt: Any, extra: dict[str, Any], b: Any) -> dict[str, Any]:
    body = {("messages" if kind == "chat" else "prompt"): prompt, **extra}
    if b is not None:
        body["bear"] = b
    return body


bodies = st.one_of(
    json_values,
    st.dictionaries(keys, json_values, max_size=6),
    st.builds(_body, st.just("chat"), messages, fields, st.one_of(st.none(), bear)),
    st.builds(_body, st.just("completions"), st.text(), fields, st.one_of(st.none(), bear)),
)
headers = st.dictionaries(
    st.sampled_from(["x-slo-ttft-ms", "x-llm-d-slo-ttft-ms", "x-slo-tpot-ms", "other"]),
    st.one_of(st.text(max_size=10), st.sampled_from(["nan", "inf", "-1", "0", "500", "1e9"])),
    max_size=2,
)


def _json(value: Any) -> Any:
    # What the gateway sees: JSON as orjson decodes it (no NaN, no huge ints).
    try:
        return orjson.loads(orjson.dumps(value))
    except (TypeError, orjson.JSONEncodeError):
        return None


@settings(max_examples=600, deadline=None)
@given(body=bodies, hdrs=headers, kind=st.sampled_from(["chat", "completions"]))
def test_any_body_is_accepted_checked_or_refused_naming_the_field(
    body: Any, hdrs: dict[str, str], kind: str
) -> None:
    body = _json(body)
    refused: BadRequest | None = None
    try:
        req = parse_request(kind, body, hdrs)  # type: ignore[arg-type]
    except BadRequest as exc:
        refused = exc
    if refused is not None:
        assert str(refused)
        assert refused.param is None or isinstance(refused.param, str)
        return
    assert isinstance(body, dict)
    fields = FIELDS[kind]  # type: ignore[index]
    for key, value in req.params.items():
        assert key in fields
        assert fields[key][0](value), (key, value)
    for t in (req.ttft_target_s, req.tpot_target_s):
        assert t is None or (math.isfinite(t) and t > 0)
    assert req.timeout_s is None or 0.01 <= req.timeout_s <= 600
    assert isinstance(req.stream, bool)
    assert req.prompt_chars() >= 0

"""``prompt_token_ids`` as a decision takes them: checked element by element
in meaning, at C speed for the common list of ints."""

from __future__ import annotations

import numbers
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bearsdk._twins import available
from bearsdk.kvevents import _index_py
from bearsdk.router.errors import MAX_PROMPT_TOKEN_IDS, RequestError, check_token_ids


def _reference(value: Any) -> list[int] | str:
    """The rule, one element at a time: the ids, or the error."""
    for i, t in enumerate(value):
        n = -1 if type(t) is bool or not isinstance(t, numbers.Integral) else int(t)
        if not 0 <= n < 1 << 63:
            return f"prompt_token_ids[{i}]"
    return [int(t) for t in value]


_element = st.one_of(
    st.integers(0, 200_000),
    st.integers(0, 200_000),
    st.integers(-3, 3),
    st.sampled_from([(1 << 63) - 1, 1 << 63, 1 << 70]),
    st.booleans(),
    st.floats(0, 10),
    st.integers(0, 1000).map(np.int64),
    st.just("7"),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(_element, max_size=12),
    st.booleans(),
)
def test_every_list_is_judged_as_element_by_element(ids: list[Any], as_tuple: bool) -> None:
    value = tuple(ids) if as_tuple else ids
    want = _reference(value)
    if isinstance(want, str):
        with pytest.raises(RequestError, match="^" + re.escape(want)):
            check_token_ids(value)
    else:
        got = check_token_ids(value)
        assert got == want
        assert type(got) is list
        assert all(type(t) is int for t in got)


def test_the_first_bad_element_is_named() -> None:
    with pytest.raises(RequestError, match=r"prompt_token_ids\[2\] .* \(got True\)"):
        check_token_ids([5, 6, True, -1])
    with pytest.raises(RequestError, match=r"prompt_token_ids\[1\] .* \(got -1\)"):
        check_token_ids([5, -1])
    with pytest.raises(RequestError, match=r"must be a list of integers \(got 'abc'\)"):
        check_token_ids("abc")
    with pytest.raises(RequestError, match=r"at most 2097152 tokens"):
        check_token_ids(range(MAX_PROMPT_TOKEN_IDS + 1))


def test_a_list_is_copied_not_shared() -> None:
    ids = [1, 2, 3]
    got = check_token_ids(ids)
    assert got == ids
    assert got is not ids
    assert check_token_ids(None) is None


_C = available("bearsdk.kvevents._index_c")


@pytest.mark.skipif(_C is None, reason="the compiled index is not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(_element, max_size=12), st.booleans())
def test_both_twins_take_the_same_lists(ids: list[Any], as_tuple: bool) -> None:
    # The fast check: a list copy of plain ints in range, else None (the caller
    # then names the element); a list subclass or any other sequence is None.
    value = tuple(ids) if as_tuple else ids
    assert _C is not None
    want = _index_py.token_ids(value)
    assert _C.token_ids(value) == want
    assert want is None or (want == value if not as_tuple else want == ids)
    assert _C.token_ids(type("L", (list,), {})(ids)) is None
    assert _C.token_ids(np.array([1, 2])) is None

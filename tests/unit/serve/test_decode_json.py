"""Request bodies decode to what json.loads makes of them (msgspec is only a faster road to the same
values), and what msgspec refuses still gets json.loads' verdict."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.protocol.errors import RequestError
from pdserve.serve.http.body import check_json, decode_json

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=30,
)


@given(JSON, st.booleans())
def test_any_document_decodes_as_json_loads_does(value: object, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert decode_json(raw) == json.loads(raw)


def test_what_msgspec_refuses_gets_json_loads_answer() -> None:
    assert math.isnan(decode_json(b'{"t": NaN}')["t"])  # json.loads accepts it; validation then judges
    assert decode_json(b'{"t": 1e400}')["t"] == math.inf
    assert decode_json(b'{"s": "\\ud800"}')["s"] == "\ud800"  # check_json then names the field
    with pytest.raises(RequestError, match="JSON decode error"):
        decode_json(b'{"a": ')
    with pytest.raises(RequestError, match="nests deeper"):
        decode_json(b"[" * 100_000 + b"]" * 100_000)


SURROGATE = st.sampled_from(["\ud800", "a\udfff", "\udc00b"])


@given(JSON, SURROGATE, st.data())
def test_a_lone_surrogate_anywhere_is_named(value: object, bad: str, data: st.DataObject) -> None:
    """check_json finds a lone surrogate wherever it sits, lists of numbers included (their fast pass
    must fall back to the element walk for anything but numbers, booleans and nulls)."""
    numbers = data.draw(st.lists(st.integers(0, 2**40) | st.floats(allow_nan=False) | st.none(), max_size=8))
    body = {"ok": value, "ids": [*numbers, bad, *numbers]}
    with pytest.raises(RequestError, match=rf"ids\[{len(numbers)}\]: the string holds a lone UTF-16 surrogate"):
        check_json(body)
    check_json({"ok": value, "ids": numbers})  # numbers alone pass

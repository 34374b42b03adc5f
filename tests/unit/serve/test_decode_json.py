"""Request bodies decode to what json.loads makes of them (msgspec is only a faster road to the same
values), and what msgspec refuses still gets json.loads' verdict."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.protocol.errors import RequestError
from pdserve.serve.http import decode_json

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

"""The streaming derender state's JSON (protocol.derender.encode_stream_state) is what pydantic writes for
it, byte for byte, for any state the wire type accepts: the route encodes it from its fields directly."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from pdserve.protocol.derender import DerenderStreamState, encode_stream_state

ids = st.lists(st.integers(0, 2**31), max_size=50)


@st.composite
def states(draw: st.DrawFn) -> DerenderStreamState:
    output = draw(ids)
    cuts = sorted(draw(st.sets(st.integers(1, max(len(output) - 1, 1)), max_size=5)))
    bounds = [0, *(c for c in cuts if c < len(output)), len(output)] if output else []
    prev = draw(st.lists(st.text(max_size=6), max_size=5))
    read = draw(st.integers(0, len(prev)))
    return DerenderStreamState(
        role_sent=draw(st.booleans()),
        logprob_context_token_ids=draw(st.lists(st.integers(0, 2**31), max_size=4)),
        logprob_text_offset=draw(st.integers(0, 10**6)),
        output_token_ids=output,
        output_chunk_lens=[b - a for a, b in itertools.pairwise(bounds)],
        tools_streamed=draw(st.booleans()),
        last_tool_call_ids=draw(st.lists(st.text(max_size=12), max_size=3)),
        prev_tokens=prev, prefix_offset=draw(st.integers(0, read)), read_offset=read,
    )


@given(states())
def test_state_json_is_the_models_own(state: DerenderStreamState) -> None:
    assert encode_stream_state(state) == state.model_dump_json().encode()

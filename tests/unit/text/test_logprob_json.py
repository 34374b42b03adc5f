"""Logprob content written as JSON is byte for byte what the structs and models encode to."""

from __future__ import annotations

import math

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol.engine import PositionLogprobs
from pdserve.protocol.generate import GenerateLogProbs
from pdserve.text.logprob_json import ChatLogprobJson, generate_content_json
from pdserve.text.logprobs import LogprobDecoder, TokenLogprob, to_generate_logprobs
from pdserve.text.tokenizer import Tokenizer, logprob_candidate_format

TOK = Tokenizer.load("qwen3")
REPAIR_IDS = sorted(TOK.split_piece_ids)

# Ids of every kind: ordinary pieces, split-character pieces (repaired from context), special ids,
# ids outside the vocabulary; few enough that repeats happen.
ids_ = st.one_of(
    st.integers(0, 2000),
    st.sampled_from(REPAIR_IDS),
    st.sampled_from(sorted(TOK.special_ids)),
    st.integers(TOK.vocab_size, TOK.vocab_size + 3),
    st.sampled_from([11, 12, 13]),
)
logprob_ = st.one_of(
    st.floats(-20, 0), st.sampled_from([-math.inf, math.inf, math.nan, -0.0, -1e-300, -12345.678, -9999.0])
)


@st.composite
def position_(draw: st.DrawFn) -> tuple[PositionLogprobs | None, int]:
    """A position and its sampled id: usually the engine's shape (sampled first, then the top-k,
    which often repeats it), sometimes none, sometimes a sampled id the candidates do not lead with."""
    sampled = draw(ids_)
    if draw(st.integers(0, 9)) == 0:
        return None, sampled
    tops = draw(st.lists(ids_, max_size=8, unique=draw(st.booleans())))
    if draw(st.booleans()):
        tops.insert(draw(st.integers(0, len(tops))), sampled)
    ids = [sampled, *tops] if draw(st.integers(0, 9)) else tops
    logprobs = [draw(logprob_) for _ in ids]
    ranks = draw(st.lists(st.integers(0, 50), min_size=len(ids), max_size=len(ids)))
    return PositionLogprobs(ids, logprobs, ranks), sampled


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.lists(position_(), max_size=4), max_size=5),
    top_limit=st.one_of(st.none(), st.integers(0, 6)),
    context=st.lists(st.one_of(st.integers(0, 2000), st.sampled_from(REPAIR_IDS)), max_size=4),
)
def test_chat_content_json_is_the_structs_encoded(chunks, top_limit, context) -> None:
    """Chunk by chunk on one sequence (the repair context carries over), both give the same bytes."""
    structs = LogprobDecoder(TOK, context)
    encoded = ChatLogprobJson(LogprobDecoder(TOK, context))
    for chunk in chunks:
        positions = [p for p, _ in chunk]
        sampled = [s for _, s in chunk]
        expected = msgspec.json.encode(structs.chat_content(positions, sampled, top_limit))
        assert encoded.content(positions, sampled, top_limit) == expected


@settings(max_examples=300, deadline=None)
@given(chunk=st.lists(position_(), max_size=6))
def test_generate_content_json_is_the_models_dumped(chunk) -> None:
    positions = [p for p, _ in chunk]
    sampled = [s for _, s in chunk]
    model = GenerateLogProbs(content=to_generate_logprobs(positions, sampled)).model_dump(mode="json")
    assert generate_content_json(positions, sampled) == msgspec.json.encode(model["content"])


def test_split_characters_are_repaired_in_json_too() -> None:
    """A split emoji's pieces need the preceding ids: the JSON path gives the repaired text."""
    ids = TOK.encode(" 🎉ok")
    positions = [PositionLogprobs([i], [-0.5], [1]) for i in ids]
    content = msgspec.json.decode(ChatLogprobJson(LogprobDecoder(TOK)).content(positions, ids, None))
    assert "".join(entry["token"] for entry in content) == " 🎉ok"
    assert all("\ufffd" not in entry["token"] for entry in content)


@given(piece=st.text(max_size=12), value=st.floats(-9999, 0))
def test_candidate_format_is_the_struct_with_its_value(piece, value) -> None:
    """Any piece (a ``%`` in it is not a format directive, quotes and controls are escaped) filled
    with a value written by msgspec gives the candidate struct's JSON."""
    filled = logprob_candidate_format(piece) % msgspec.json.encode(value)
    assert filled == msgspec.json.encode(TokenLogprob(piece, value, list(piece.encode("utf-8"))))

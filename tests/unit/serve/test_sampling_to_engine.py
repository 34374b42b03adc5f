"""Sampling params reach the engine intact: penalties, logit_bias, allowed ids, bad_words as id sequences."""

from __future__ import annotations

from typing import cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.api import Engine
from pdserve.protocol.engine import EngineInfo
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest
from pdserve.serve.admission import admit
from pdserve.serve.config import ServerConfig
from pdserve.serve.metrics import Metrics
from pdserve.serve.state import AppState
from pdserve.serve.validation import bad_words_token_ids
from pdserve.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.load("qwen3")


class UpEngine:
    """Admission reads an engine's facts and health only: a stand-in that is up (unit level)."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info

    def is_healthy(self) -> bool:
        return True


INFO = EngineInfo(model_name="m", vocab_size=TOKENIZER.vocab_size, max_model_len=4096, max_num_seqs=16,
                  eos_token_ids=[151645])


def state(tokens_only: bool = False, info: EngineInfo = INFO) -> AppState:
    config = ServerConfig(engine=None, tokens_only=tokens_only)
    return AppState(config=config, engine=cast(Engine, UpEngine(info)),
                    tokenizer=None if tokens_only else TOKENIZER, metrics=Metrics())


def prepared(sampling: dict, tokens_only: bool = False):  # type: ignore[no-untyped-def]
    req = GenerateRequest.model_validate({"token_ids": [9707, 11], "sampling_params": sampling})
    return admit(state(tokens_only), req, "r").engine_request.sampling


def test_penalties_bias_and_allowed_ids_reach_the_engine() -> None:
    s = prepared({"presence_penalty": 0.5, "frequency_penalty": -1.25, "repetition_penalty": 1.3,
                  "logit_bias": {"9707": -100, "11": 4.5}, "allowed_token_ids": [11, 9707, 13]})
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.25, 1.3)
    assert s.logit_bias == {9707: -100.0, 11: 4.5}
    assert s.allowed_token_ids == [11, 9707, 13]
    assert s.bad_words_token_ids is None
    plain = prepared({})
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty) == (0.0, 0.0, 1.0)
    assert plain.logit_bias is None and plain.allowed_token_ids is None


def test_bad_words_become_start_and_mid_text_sequences() -> None:
    s = prepared({"bad_words": ["Paris", " hello world"]})
    assert s.bad_words_token_ids is not None
    texts = [TOKENIZER.decode(seq) for seq in s.bad_words_token_ids]
    # Each word is banned as it starts a text and, under byte-level BPE, as the space-prefixed word token.
    assert texts == ["Paris", " Paris", "hello world", " hello world"]


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"logit_bias": {"999999": 1}}, "sampling_params.logit_bias"),
        ({"allowed_token_ids": [1, 10**6]}, "sampling_params.allowed_token_ids"),
        ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
        ({"bad_words": ["   "]}, "sampling_params.bad_words"),
        ({"bad_words": [f"w{i}" for i in range(129)]}, "sampling_params.bad_words"),
    ],
)
def test_ids_outside_the_vocabulary_and_bad_bad_words_are_400(sampling: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        prepared(sampling)
    assert info.value.param == param and info.value.status == 400


def test_bad_words_need_a_tokenizer() -> None:
    with pytest.raises(RequestError) as info:
        prepared({"bad_words": ["x"]}, tokens_only=True)
    assert info.value.param == "sampling_params.bad_words" and "tokens-only" in info.value.message


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="abcXYZ é漢😀-'", min_size=1, max_size=8).filter(lambda w: w.strip()))
def test_bad_word_sequences_spell_the_word(word: str) -> None:
    sequences = bad_words_token_ids(TOKENIZER, [word], TOKENIZER.vocab_size)
    bare = word.lstrip()
    assert sequences[0] == TOKENIZER.encode(bare)
    assert len(sequences) in (1, 2)
    if len(sequences) == 2:
        assert TOKENIZER.decode(sequences[1]) == " " + bare
        assert len(sequences[1]) == len(sequences[0]) and sequences[1][0] != sequences[0][0]


@settings(max_examples=40, deadline=None)
@given(top_k=st.integers(-1, 10**40), interval=st.none() | st.integers(1, 10**40), stream=st.booleans())
def test_any_accepted_int_fits_the_engine_wire(top_k: int, interval: int | None, stream: bool) -> None:
    # The engine core's wire (msgpack) carries 64-bit ints; values past any vocabulary or length mean the same
    # as the largest that fits: top_k keeps every candidate, a stream interval sends the first token and the rest.
    app = state()
    req = GenerateRequest.model_validate({"token_ids": [9707, 11], "stream": stream,
                                          "sampling_params": {"top_k": top_k, "stream_interval": interval}})
    ereq = admit(app, req, "r").engine_request
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(ereq), type=type(ereq))
    assert back.sampling.top_k == (top_k if top_k < 2**31 else 0)
    assert back.stream_interval == (min(interval or 1, app.require_engine().info.max_model_len) if stream else 1)

"""The streaming /derender state cache (pdserve.output.derender_cache) and its use by derender.advance.

* The cache: a state is found only by the stream and the exact output it consumed, once (it is taken
  out); at most ``max_entries`` are kept, least recently used evicted first, each dropped ``ttl_s``
  after its last use (an injected clock).
* advance with the cache says, chunk by chunk, exactly what a replay of the client's state says, for
  random chunkings of the parser cases (qwen3 reasoning + hermes tools) and of plain completions.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.output import derender
from pdserve.output.derender_cache import DerenderCache, StreamKey, ids_digest, text_digest
from pdserve.output.request_state import OutputConfig
from pdserve.parsers import ChatParser
from pdserve.protocol.derender import DerenderStreamState
from pdserve.protocol.generate import GenerateTokensStreamChoice
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import ALL_CASES, QWEN3_HERMES
from tests.unit.parsers.parser_support import TOOL_CALL_ID, parser_config, render_prompt_ids

TOK = Tokenizer.load("qwen3")
EOS = TOK.token_to_id("<|im_end|>")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(request_id: str = "r", index: int = 0, prompt: tuple[int, ...] = (1, 2, 3), settings: object = "s") -> StreamKey:
    return StreamKey(request_id, index, ids_digest(prompt), settings)


OUT, LENS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [4, 6]


def test_a_state_is_found_once_by_its_stream_and_the_exact_output_it_consumed() -> None:
    cache: DerenderCache[str] = DerenderCache(8, 60.0, Clock())
    cache.put(key(), list(OUT), list(LENS), "state")
    others = [
        (key(request_id="r2"), OUT, LENS),
        (key(index=1), OUT, LENS),
        (key(prompt=(1, 2, 4)), OUT, LENS),
        (key(settings="other request"), OUT, LENS),
        (key(), [99, *OUT[1:]], LENS),  # same length and tail, other earlier output (another RL rollout)
        (key(), OUT, [5, 5]),  # same ids, other chunking (a parser's state depends on it)
        (key(), OUT[:-1], [4, 5]),
    ]
    for stream, ids, lens in others:
        assert cache.take(stream, ids, lens) is None
    assert (cache.hits, cache.misses, len(cache)) == (0, len(others), 1)  # a near miss leaves the entry be
    assert cache.take(key(), list(OUT), list(LENS)) == "state"
    assert cache.take(key(), OUT, LENS) is None  # taken out: never continued twice
    assert (cache.hits, cache.misses, len(cache), cache.evictions) == (1, len(others) + 1, 0, 0)


def test_the_least_recently_used_goes_first_and_a_replaced_entry_counts_as_evicted() -> None:
    cache: DerenderCache[str] = DerenderCache(2, 60.0, Clock())
    for name in ("a", "b"):
        cache.put(key(name), [1], [], name)
    assert cache.take(key("a"), [1], []) == "a"
    cache.put(key("a"), [1, 2], [], "a2")  # a used after b
    cache.put(key("c"), [1], [], "c")
    assert (len(cache), cache.evictions) == (2, 1)
    assert cache.take(key("b"), [1], []) is None
    cache.put(key("c"), [1], [], "c again")  # the same position of the same stream: the newer one stays
    assert cache.evictions == 2
    assert cache.take(key("c"), [1], []) == "c again"
    assert cache.take(key("a"), [1, 2], []) == "a2"


def test_a_state_lives_ttl_s_after_its_last_use() -> None:
    clock = Clock()
    cache: DerenderCache[str] = DerenderCache(8, 10.0, clock)
    cache.put(key(), [1], [1], "first")
    clock.now += 9.0
    assert cache.take(key(), [1], [1]) == "first"
    cache.put(key(), [1, 2], [1, 1], "second")
    clock.now += 9.0  # 18 s after the stream began, 9 s after its last chunk
    assert cache.take(key(), [1, 2], [1, 1]) == "second"
    cache.put(key(), [1, 2, 3], [1, 1, 1], "third")
    cache.put(key("other"), [1], [1], "other")
    clock.now += 10.0
    cache.expire()
    assert (len(cache), cache.evictions) == (0, 2)
    assert cache.take(key(), [1, 2, 3], [1, 1, 1]) is None


def test_zero_entries_keeps_nothing_and_bad_bounds_are_refused() -> None:
    cache: DerenderCache[str] = DerenderCache(0, 1.0)
    cache.put(key(), [1], [], "x")
    assert len(cache) == 0 and cache.take(key(), [1], []) is None
    for entries, ttl in ((-1, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            DerenderCache(entries, ttl)


# A reference model: a dict in order of last use, the oldest first.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5)),
        st.tuples(st.just("take"), st.integers(0, 5)),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 3.0])),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), ops)
def test_the_cache_behaves_like_an_lru_with_a_ttl(max_entries: int, operations: list[tuple[str, float]]) -> None:
    clock = Clock()
    ttl = 2.0
    cache: DerenderCache[int] = DerenderCache(max_entries, ttl, clock)
    model: OrderedDict[int, tuple[int, float]] = OrderedDict()  # stream -> (value, stored at)
    version = itertools.count()
    for op, arg in operations:
        if op == "tick":
            clock.now += arg
            continue
        stream = int(arg)
        for s in [s for s, (_, at) in model.items() if clock.now - at >= ttl]:
            del model[s]
        if op == "put":
            value = next(version)
            model.pop(stream, None)
            model[stream] = (value, clock.now)
            while len(model) > max_entries:
                model.popitem(last=False)
            cache.put(key(str(stream)), [stream], [1], value)
        else:
            expected = model.pop(stream, (None, 0.0))[0]
            assert cache.take(key(str(stream)), [stream], [1]) == expected
        assert len(cache) == len(model)


# -- advance with the cache == replay of the carried state ------------------------------------------

HERMES_CASES = [case for case in ALL_CASES if QWEN3_HERMES in case.setups]
PARSERS = parser_config(QWEN3_HERMES)
PLAIN_PIECES = ["Paris", " is", " 中文", "é", "🙂", "\n", " 42", "naïve", "ß", "<think>", " 🇫🇷", "👩‍👩‍👧"]
PLAIN_PROMPT = TOK.encode("Complete this: 龘")


@dataclass(frozen=True)
class Stream:
    config: OutputConfig
    parsed: bool
    ids: list[int]
    stream: StreamKey


def _chat_stream(case_index: int) -> Stream:
    case = HERMES_CASES[case_index]
    request = ChatCompletionRequest(**case.request)
    prompt = render_prompt_ids(TOK, request)
    config = OutputConfig(
        mode="derender", prompt_token_ids=prompt, tokenizer=TOK, skip_special_tokens=False,
        stop=StopConfig(eos_token_ids=(EOS,)), parser_factory=lambda: ChatParser(PARSERS, TOK, request, prompt),
        streaming=True,
    )
    stream = StreamKey("r", 0, ids_digest(prompt), ("chat", PARSERS, text_digest(case.name)))
    return Stream(config, True, case.engine_token_ids(TOK), stream)


def _plain_stream(pieces: list[str]) -> Stream:
    config = OutputConfig(mode="text", prompt_token_ids=PLAIN_PROMPT, tokenizer=TOK,
                          stop=StopConfig(eos_token_ids=(EOS,)))
    return Stream(config, False, TOK.encode("".join(pieces)), StreamKey("r", 0, ids_digest(PLAIN_PROMPT), "plain"))


streams = st.one_of(
    st.integers(0, len(HERMES_CASES) - 1).map(_chat_stream),
    st.lists(st.sampled_from(PLAIN_PIECES), min_size=1, max_size=16).map(_plain_stream),
)


def _chunks(ids: list[int], cuts: list[int], empties: list[int]) -> list[list[int]]:
    """``ids`` cut before each of ``cuts``, with an empty chunk (no ids, as a keep-alive) before each of ``empties``."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    chunks = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    for at in sorted(empties, reverse=True):
        chunks.insert(min(at, len(chunks) - 1), [])
    return chunks


def _wire(step: derender.StreamStep) -> str:
    """What the client gets for a step, with tool-call ids (random per parser) numbered by first appearance."""
    update = step.update
    fields = {
        "text": update.text, "delta": update.delta.model_dump() if update.delta is not None else None,
        "finish_reason": update.finish_reason, "stop_reason": update.stop_reason, "token_ids": update.token_ids,
        "hides": step.choice.hides_metadata, "state": step.state.model_dump(),
    }
    text, ids = json.dumps(fields), {}
    return TOOL_CALL_ID.sub(lambda m: ids.setdefault(m.group(0), f"call-{len(ids)}"), text)


@settings(max_examples=80, deadline=None)
@given(streams, st.lists(st.integers(1, 60), max_size=12), st.lists(st.integers(0, 12), max_size=2),
       st.sampled_from(["stop", "length"]))
def test_a_stream_continued_from_the_cache_says_what_replay_says(
    s: Stream, cuts: list[int], empties: list[int], finish: str
) -> None:
    cache: DerenderCache = DerenderCache(4, 60.0, Clock())
    resume = derender.Resume(cache, s.stream)
    chunks = _chunks(s.ids + ([EOS] if finish == "stop" else []), cuts, empties)
    carried = DerenderStreamState()
    for k, ids in enumerate(chunks):
        last = k == len(chunks) - 1
        wire = GenerateTokensStreamChoice(index=0, token_ids=ids, finish_reason=finish if last else None)
        replayed = derender.advance(s.config, carried, s.parsed, wire, "r", None)
        cached = derender.advance(s.config, carried, s.parsed, wire, "r", None, resume)
        assert _wire(cached) == _wire(replayed)
        carried = DerenderStreamState.model_validate_json(cached.state.model_dump_json())  # the client echoes it
        # The advanced state, and only that, waits for the next chunk (once there is output to continue).
        assert len(cache) == (0 if last or not carried.output_token_ids else 1)
    assert cache.misses == 0
    assert cache.hits == sum(1 for k in range(1, len(chunks)) if any(chunks[:k]))  # every chunk after output


def test_a_resent_request_id_with_other_earlier_output_replays_its_own() -> None:
    """Two rollouts of one request id and prompt: each continues its own output, never the other's."""
    s = _plain_stream(["Paris", " is", " nice"])
    cache: DerenderCache = DerenderCache(4, 60.0, Clock())
    resume = derender.Resume(cache, s.stream)
    first = derender.advance(s.config, DerenderStreamState(), False,
                             GenerateTokensStreamChoice(index=0, token_ids=TOK.encode("Paris")), "r", None, resume)
    other = DerenderStreamState(role_sent=True, output_token_ids=TOK.encode("Rome"))
    nxt = GenerateTokensStreamChoice(index=0, token_ids=TOK.encode(" is"))
    step = derender.advance(s.config, other, False, nxt, "r", None, resume)
    assert (cache.hits, cache.misses) == (0, 1)
    assert _wire(step) == _wire(derender.advance(s.config, other, False, nxt, "r", None))
    assert step.update.text == " is"
    assert cache.take(s.stream, first.state.output_token_ids, []) is not None  # the first rollout's state stayed

"""The scripted engine honours the engine-side sampling rules (its core in the one engine loop, on a thread)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from pdserve.engine.api import EngineDeadError, EngineError
from pdserve.engine.runners.scripted import ScriptedEngine
from pdserve.engine.spec import TokenScript
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling

EOS = 99
SCRIPT = [10, 11, 12, 13, 14]
T = TypeVar("T")


def engine(**kw) -> ScriptedEngine:  # type: ignore[no-untyped-def]
    scripts = kw.pop("scripts", [TokenScript(SCRIPT)])
    return ScriptedEngine(scripts, vocab_size=100, eos_token_ids=[EOS, 98], **kw)


def request(rid: str = "r", prompt=(1, 2, 3), extra_args=None, **sampling) -> EngineRequest:  # type: ignore[no-untyped-def]
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SequenceSampling(**sampling),
                         extra_args=extra_args)


async def collect(eng: ScriptedEngine, req: EngineRequest) -> list[EngineOutput]:
    return [o async for o in eng.generate(req)]


def serve(eng: ScriptedEngine, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` against the started engine in one event loop, then shut the engine down."""
    async def go() -> T:
        await eng.start()
        try:
            return await work()
        finally:
            await eng.shutdown()

    return asyncio.run(go())


def run(eng: ScriptedEngine, rid: str = "r", prompt=(1, 2, 3), extra_args=None, **sampling) -> list[EngineOutput]:  # type: ignore[no-untyped-def]
    return serve(eng, lambda: collect(eng, request(rid, prompt, extra_args, **sampling)))


def ids(outs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outs if o.index == index for t in o.new_token_ids]


def test_script_then_eos() -> None:
    outs = run(engine(), max_tokens=100)
    assert ids(outs) == SCRIPT + [EOS]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None


def test_max_tokens_and_model_length() -> None:
    outs = run(engine(), max_tokens=3)
    assert ids(outs) == SCRIPT[:3] and outs[-1].finish_reason == "length"
    outs = run(engine(max_model_len=5), max_tokens=100)  # 3 prompt ids leave room for 2
    assert ids(outs) == SCRIPT[:2] and outs[-1].finish_reason == "length"


def test_min_tokens_and_ignore_eos_replay_the_script() -> None:
    outs = run(engine(), max_tokens=100, min_tokens=7)
    assert ids(outs) == SCRIPT + SCRIPT + [EOS], "EOS waits for min_tokens and comes at the end of a script pass"
    outs = run(engine(), max_tokens=12, ignore_eos=True)
    assert ids(outs) == (SCRIPT * 3)[:12] and outs[-1].finish_reason == "length"


def test_stop_token_ids_and_secondary_eos() -> None:
    outs = run(engine(), max_tokens=100, stop_token_ids=[12])
    assert ids(outs) == [10, 11, 12] and outs[-1].stop_reason == 12
    outs = run(engine(scripts=[TokenScript([10, 98, 11])]), max_tokens=100)
    assert ids(outs) == [10, 98] and outs[-1].stop_reason == 98
    outs = run(engine(), max_tokens=100, stop_token_ids=[10], min_tokens=2)
    assert ids(outs)[:6] == SCRIPT + [EOS], "min_tokens blocks an early stop token"


def test_tokens_per_step_and_n() -> None:
    outs = run(engine(tokens_per_step=2), max_tokens=100, n=2)
    assert ids(outs, 0) == ids(outs, 1) == SCRIPT + [EOS]
    assert all(len(o.new_token_ids) <= 2 for o in outs)
    assert {o.index for o in outs if o.finished} == {0, 1}


def test_seeded_logprobs_are_reproducible_and_sampled_first() -> None:
    a = run(engine(), max_tokens=4, logprobs=3, seed=7, prompt_logprobs=1)
    b = run(engine(), max_tokens=4, logprobs=3, seed=7, prompt_logprobs=1)
    assert [o.new_logprobs for o in a] == [o.new_logprobs for o in b]
    for out in a:
        for tok, pos in zip(out.new_token_ids, out.new_logprobs or [], strict=True):
            assert pos.token_ids[0] == tok and len(pos.token_ids) == 4
            assert pos.logprobs[0] == max(pos.logprobs)
    assert a[0].prompt_logprobs is not None and a[0].prompt_logprobs[0] is None and len(a[0].prompt_logprobs) == 3


def test_script_index_pick_and_round_robin() -> None:
    eng = engine(scripts=[TokenScript([1]), TokenScript([2])])

    async def in_turn() -> list[list[int]]:
        picks = [("a", None), ("b", None), ("c", {"script_index": 1}), ("d", None)]
        return [ids(await collect(eng, request(rid, extra_args=extra))) for rid, extra in picks]

    assert serve(eng, in_turn) == [[1, EOS], [2, EOS], [2, EOS], [1, EOS]]


def test_a_request_may_set_its_own_tokens_per_step() -> None:
    eng = engine(scripts=[TokenScript([1, 2, 3, 4, 5, 6, 7])])

    async def paces() -> list[list[list[int]]]:
        picks = [("a", None), ("b", {"tokens_per_step": 3}), ("c", {"tokens_per_step": 1})]
        return [[o.new_token_ids for o in await collect(eng, request(rid, extra_args=extra))] for rid, extra in picks]

    one_at_a_time = [[1], [2], [3], [4], [5], [6], [7], [EOS]]
    assert serve(eng, paces) == [one_at_a_time, [[1, 2, 3], [4, 5, 6], [7, EOS]], one_at_a_time]


def test_abort_and_stop_sequence() -> None:
    eng = engine(step_ms=5)

    async def go() -> tuple[list[EngineOutput], int]:
        outs = []
        async for out in eng.generate(request("x", prompt=[1], n=2, max_tokens=1000, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 4:
                await eng.stop_sequence("x", 1)
            if len(outs) == 8:
                await eng.abort(["x"])
        for _ in range(100):  # the loop reads its stats after the turn that sent the abort's outputs
            if eng.stats().running_requests == 0:
                break
            await asyncio.sleep(0.01)
        return outs, eng.stats().running_requests

    outs, running = serve(eng, go)
    finals = [o for o in outs if o.finished]
    assert [(o.index, o.finish_reason) for o in finals] == [(0, "abort")]
    assert running == 0


def test_an_abort_by_client_id_reaches_every_request_that_carries_it() -> None:
    eng = engine(step_ms=5)

    async def go() -> list[list[str | None]]:
        reqs = [request(rid, max_tokens=10_000, ignore_eos=True) for rid in ("c#1", "c#2", "other#1")]
        streams = [eng.generate(req) for req in reqs]
        firsts = [await anext(stream) for stream in streams]
        assert all(not o.finished for o in firsts)
        await eng.abort(["c"])
        ends = [[o.finish_reason async for o in stream] for stream in streams[:2]]
        await eng.abort(["other#1"])
        return [*ends, [o.finish_reason async for o in streams[2]]]

    ends = serve(eng, go)
    assert [end[-1] for end in ends] == ["abort", "abort", "abort"]


def test_failure_and_dead_engine() -> None:
    with pytest.raises(EngineError, match="after 2 tokens"):
        run(engine(scripts=[TokenScript(SCRIPT, fail_after=2)]), max_tokens=10)

    async def dead() -> None:
        eng = engine()
        req = EngineRequest(request_id="d", prompt_token_ids=[1], sampling=SequenceSampling())
        async for _ in eng.generate(req):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(dead())


def test_allowed_token_ids_skip_the_ids_they_leave_out() -> None:
    assert ids(run(engine(), max_tokens=100, allowed_token_ids=[10, 12, 14, EOS])) == [10, 12, 14, EOS]
    outs = run(engine(), max_tokens=6, allowed_token_ids=[11, 13])
    assert ids(outs) == [11, 13, 11, 13, 11, 13] and outs[-1].finish_reason == "length", "EOS left out: replay"
    assert ids(run(engine(), max_tokens=3, allowed_token_ids=[50, 40])) == [40, 40, 40], "nothing allowed: lowest"


def test_bad_words_are_skipped_where_they_would_complete() -> None:
    assert ids(run(engine(), max_tokens=100, bad_words_token_ids=[[12]])) == [10, 11, 13, 14, EOS]
    assert ids(run(engine(), max_tokens=100, bad_words_token_ids=[[11, 12]])) == [10, 11, 13, 14, EOS]
    assert ids(run(engine(), max_tokens=100, bad_words_token_ids=[[10, 12]])) == SCRIPT + [EOS]
    outs = run(engine(), max_tokens=7, bad_words_token_ids=[[14, EOS]])
    assert ids(outs) == SCRIPT + [10, 11], "EOS right after 14 is banned, so the script replays"


def test_penalties_and_logit_bias_leave_the_script_as_it_is() -> None:
    shifted = {"presence_penalty": 1.5, "frequency_penalty": -1.0, "repetition_penalty": 1.3, "logit_bias": {10: -99.0}}
    assert ids(run(engine(), max_tokens=100, **shifted)) == SCRIPT + [EOS]


def test_out_of_vocabulary_ids_in_logits_params_are_rejected() -> None:
    cases = [
        ({"logit_bias": {100: 1.0}}, "logit_bias token ids"),
        ({"allowed_token_ids": [5, 100]}, "allowed_token_ids must be in"),
        ({"bad_words_token_ids": [[3, -1]]}, "bad_words_token_ids must be in"),
        ({"allowed_token_ids": [12], "bad_words_token_ids": [[12]]}, "ban every id in allowed_token_ids"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be greater than zero"),
    ]
    for sampling, message in cases:
        with pytest.raises(EngineError, match=message):
            run(engine(), **sampling)


def test_a_stream_interval_folds_the_outputs_in_the_engine() -> None:
    eng = engine(scripts=[TokenScript(list(range(10, 30)))])
    req = EngineRequest(request_id="r", prompt_token_ids=[1], sampling=SequenceSampling(max_tokens=12),
                        stream_interval=4)
    outs = serve(eng, lambda: collect(eng, req))
    assert [len(o.new_token_ids) for o in outs] == [1, 4, 4, 3]
    assert ids(outs) == list(range(10, 22)) and outs[-1].finish_reason == "length"


def test_shutdown_is_clean_when_the_loop_has_already_closed_its_socket() -> None:
    """The loop may see ``stopped`` on a turn something else woke and close its socket before the client's
    goodbye goes out (seen in `pdserve bench interference` as zmq.Again out of shutdown)."""
    eng = engine()

    async def go() -> None:
        await eng.start()
        assert eng._server is not None and eng._thread is not None
        eng._server.stopped = True
        await eng.abort(["nobody"])  # wakes a turn, after which the loop leaves and closes its socket
        thread = eng._thread
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
        await eng.shutdown()
        assert not eng.is_healthy()

    asyncio.run(go())

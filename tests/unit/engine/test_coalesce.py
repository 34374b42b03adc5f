"""The stream-interval coalescer: nothing lost, nothing reordered, chunks of at least N tokens between a
sequence's first token and its end, logprobs aligned with their ids (unit level; the e2e tests in
tests/e2e/test_stream_interval.py run real servers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.coalesce import OutputCoalescer, folded
from pdserve.protocol.engine import EngineOutput, PositionLogprobs


def lp(token: int) -> PositionLogprobs:
    return PositionLogprobs([token], [-float(token % 7)], [1])


def output(index: int, ids: list[int], with_logprobs: bool, finish: str | None = None) -> EngineOutput:
    return EngineOutput(request_id="r", index=index, new_token_ids=ids,
                        new_logprobs=[lp(t) for t in ids] if with_logprobs else None,
                        finish_reason=finish, stop_reason=7 if finish else None)


# One sequence's steps: 0 to 3 ids each (an engine step, a spec-decode burst, an empty output), each with or
# without logprobs (a replayed output has none).
steps = st.lists(st.tuples(st.lists(st.integers(0, 1000), max_size=3), st.booleans()), min_size=1, max_size=30)


@given(steps=steps, interval=st.integers(1, 6), two=st.booleans())
def test_released_outputs_are_the_input_in_chunks_of_the_interval(
    steps: list[tuple[list[int], bool]], interval: int, two: bool
) -> None:
    indexes = [0, 1] if two else [0]
    coalescer = OutputCoalescer(interval)
    released: dict[int, list[tuple[int, EngineOutput]]] = {i: [] for i in indexes}
    for k, (ids, with_logprobs) in enumerate(steps):
        last = k == len(steps) - 1
        for i in indexes:
            for out in coalescer.push(output(i, ids, with_logprobs, "length" if last else None)):
                released[out.index].append((k, out))
    mixed = len({lp for ids, lp in steps if ids}) > 1
    for i in indexes:
        outs = [out for _, out in released[i]]
        assert [t for out in outs for t in out.new_token_ids] == [t for ids, _ in steps for t in ids]
        # Logprobs stay with their ids: an output's logprobs are its ids' own, or it has none.
        for out in outs:
            assert out.new_logprobs is None or out.new_logprobs == [lp(t) for t in out.new_token_ids]
        if not mixed:  # then every id has logprobs, or none has
            has = next((with_lp for ids, with_lp in steps if ids), None)
            assert all((out.new_logprobs is not None) == has for out in outs if out.new_token_ids)
        assert outs[-1].finish_reason == "length" and outs[-1].stop_reason == 7
        assert all(out.finish_reason is None for out in outs[:-1])
        # Up to the first output with a token everything goes out as it comes; then full chunks only
        # (or shorter ones where logprobs come or go).
        first_token = next((k for k, (ids, _) in enumerate(steps) if ids), None)
        for k, out in released[i]:
            if first_token is None or k <= first_token:
                assert len(out.new_token_ids) == len(steps[k][0])
            elif out.finish_reason is None and not mixed:
                assert len(out.new_token_ids) >= interval
        if first_token is not None:
            at_first = [out for k, out in released[i] if k == first_token]
            assert at_first[0].new_token_ids == steps[first_token][0]


def test_interval_one_releases_every_output_as_it_is() -> None:
    coalescer = OutputCoalescer(1)
    outs = [output(0, [5], True), output(0, [6, 7], True), output(0, [], False, "stop")]
    assert [coalescer.push(o) for o in outs] == [[o] for o in outs]


def test_outputs_with_and_without_logprobs_are_never_folded_together() -> None:
    coalescer = OutputCoalescer(8)
    assert coalescer.push(output(0, [1], True))  # the first token goes out at once
    assert coalescer.push(output(0, [2, 3], True)) == []
    # ids without logprobs (a replayed output): what is held goes first, with its logprobs.
    released = coalescer.push(output(0, [4], False))
    assert [(o.new_token_ids, o.new_logprobs) for o in released] == [([2, 3], [lp(2), lp(3)])]
    end = coalescer.push(output(0, [], False, "abort"))
    assert [(o.new_token_ids, o.new_logprobs, o.finish_reason) for o in end] == [([4], None, "abort")]


def test_an_output_without_ids_between_does_not_hide_a_mismatch() -> None:
    coalescer = OutputCoalescer(8)
    assert coalescer.push(output(0, [1], False))
    assert coalescer.push(output(0, [2], False)) == [] and coalescer.push(output(0, [], False)) == []
    released = coalescer.push(output(0, [3], True))
    assert [(o.new_token_ids, o.new_logprobs) for o in released] == [([2], None)]
    end = coalescer.push(output(0, [], False, "length"))
    assert [(o.new_token_ids, o.new_logprobs) for o in end] == [([3], [lp(3)])]


def test_folding_keeps_what_arrives_once() -> None:
    first = EngineOutput(request_id="r", new_token_ids=[1], prompt_logprobs=[None, lp(3)], scheduled_at=2.5,
                         num_cached_tokens=16)
    last = EngineOutput(request_id="r", new_token_ids=[2], finish_reason="stop", kv_transfer_params={"a": 1})
    out = folded([first, last])
    assert (out.new_token_ids, out.prompt_logprobs, out.scheduled_at, out.num_cached_tokens) == (
        [1, 2], [None, lp(3)], 2.5, 16)
    assert (out.finish_reason, out.kv_transfer_params) == ("stop", {"a": 1})


def test_an_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        OutputCoalescer(0)


def test_stream_intervals_hold_only_requests_that_ask_and_forget_them_when_they_end() -> None:
    from pdserve.engine.coalesce import StreamIntervals
    from pdserve.engine.messages import RequestFailed, StepOutputs
    from pdserve.protocol.engine import EngineRequest, SequenceSampling

    def request(rid: str, interval: int) -> EngineRequest:
        return EngineRequest(request_id=rid, prompt_token_ids=[1], sampling=SequenceSampling(), stream_interval=interval)

    def out(rid: str, token: int, finish: str | None = None) -> EngineOutput:
        return EngineOutput(request_id=rid, index=0, new_token_ids=[token], finish_reason=finish)

    held = StreamIntervals()
    plain = StepOutputs(outputs=[out("a", 1)])
    assert held.release(plain) is plain  # nothing held: the batch passes as it is
    held.add(request("a", 1))
    held.add(request("b", 3))
    held.add(request("c", 3))
    sent = [held.release(StepOutputs(outputs=[out("a", t), out("b", t), out("c", t)])).outputs for t in range(4)]
    assert [[(o.request_id, o.new_token_ids) for o in batch] for batch in sent] == [
        [("a", [0]), ("b", [0]), ("c", [0])], [("a", [1])], [("a", [2])], [("a", [3]), ("b", [1, 2, 3]), ("c", [1, 2, 3])],
    ]
    last = held.release(StepOutputs(outputs=[out("b", 4), out("c", 4, "length")], finished=["c"],
                                    failed=[RequestFailed("b", "gone")]))
    assert [(o.request_id, o.new_token_ids) for o in last.outputs] == [("c", [4])]
    plain = StepOutputs(outputs=[out("b", 5)])
    assert held.release(plain) is plain  # b and c are forgotten

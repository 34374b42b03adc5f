"""Chunked prefill in the torch step loop (``--max-num-batched-tokens``): the same answers as prefilling each
prompt whole, running streams that keep their pace while a long prompt is prefilled, aborts and stops
mid-prompt that leave nothing behind.

qwen3-tiny in float32 and the batch-invariant mode, where a chunked prompt's rows get the bits of an
unchunked prefill (tests/unit/engine/test_models.py), so "the same answers" means equal ids and logprobs.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.models.llama import KERNEL_CHUNK_MIN_ROWS, SDPA_CHUNK_MIN_ROWS
from pdserve.engine.runners.torch_runner import TorchSetup
from pdserve.engine.step_loop import CHUNK_ATTENTION_SPAN, StepLoop, chunk_rows_within
from pdserve.protocol.engine import EngineInfo, EngineOutput, EngineRequest, SequenceSampling

MAX_NUM_SEQS = 4
UNCHUNKED = 4096  # more than any prompt here: every prompt prefilled whole


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaForCausalLM, EngineInfo]:
    setup = TorchSetup.create("qwen3-tiny", dtype="float32", max_model_len=1024, max_num_seqs=MAX_NUM_SEQS,
                              batch_invariant=True)
    return setup.load().model, setup.info


def loop_with(tiny: tuple[LlamaForCausalLM, EngineInfo], budget: int) -> StepLoop:
    model, info = tiny
    return StepLoop(model, msgspec.structs.replace(info, max_num_batched_tokens=budget), seed=0)


def request(rid: str, prompt: list[int], **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SequenceSampling(**sampling))  # type: ignore[arg-type]


def run(steps: StepLoop, requests: list[EngineRequest]) -> dict[tuple[str, int], list[EngineOutput]]:
    """Every output of ``requests`` (all added at once), per (request, sequence), without timestamps."""
    for r in requests:
        steps.validate(r)
        steps.add(r)
    outputs: dict[tuple[str, int], list[EngineOutput]] = {}
    while steps.has_work():
        steps.step()
        for o in steps.take_outputs().outputs:
            outputs.setdefault((o.request_id, o.index), []).append(msgspec.structs.replace(o, scheduled_at=None))
    return outputs


# Prompts sharing prefixes (a system prompt and a history), some longer than any budget below.
_BASE = list(range(1000, 1300))


@st.composite
def workloads(draw: st.DrawFn) -> list[EngineRequest]:
    requests = []
    for i in range(draw(st.integers(1, 5))):
        shared = draw(st.integers(0, len(_BASE)))
        own = draw(st.lists(st.integers(100, 50000), min_size=1 if shared == 0 else 0, max_size=120))
        n = draw(st.sampled_from([1, 1, 2]))
        sampling: dict[str, object] = {"max_tokens": draw(st.integers(1, 6)), "n": n, "ignore_eos": True}
        if draw(st.booleans()):
            sampling |= {"temperature": 0.9, "seed": i}
        if draw(st.booleans()):
            sampling |= {"logprobs": 2}
        if draw(st.integers(0, 3)) == 0:
            sampling |= {"prompt_logprobs": 1}
        requests.append(request(f"r{i}", _BASE[:shared] + own, **sampling))
    return requests


@settings(max_examples=12, deadline=None)
@given(requests=workloads(), budget=st.integers(MAX_NUM_SEQS, 96))
def test_chunked_prefill_answers_exactly_as_whole_prompt_prefill(tiny, requests, budget) -> None:  # type: ignore[no-untyped-def]
    assert run(loop_with(tiny, budget), requests) == run(loop_with(tiny, UNCHUNKED), requests)


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_prefilled(tiny) -> None:  # type: ignore[no-untyped-def]
    steps = loop_with(tiny, 16)
    for i in range(2):
        steps.add(request(f"stream{i}", [500 + i, 600, 700], max_tokens=200, ignore_eos=True))
    steps.step()
    steps.take_outputs()
    steps.add(request("long", list(range(2000, 2300)), max_tokens=1))
    per_step = []
    while True:
        ids = sorted(o.request_id for o in _step(steps))
        if "long" in ids:
            break
        per_step.append(ids)
        assert steps.chunked is not None and steps.stats().running_requests == 3
    assert len(per_step) >= 300 // 16  # the prompt took many steps: chunks of what the two streams left
    assert all(ids == ["stream0", "stream1"] for ids in per_step)  # and they never missed one


def _step(steps: StepLoop) -> list[EngineOutput]:
    steps.step()
    return steps.take_outputs().outputs


@pytest.mark.parametrize("how", ["abort", "stop"])
def test_a_request_ended_mid_prompt_leaves_nothing_behind(tiny, how) -> None:  # type: ignore[no-untyped-def]
    steps = loop_with(tiny, 8)
    steps.add(request("long", list(range(3000, 3200)), max_tokens=4, n=2))
    for _ in range(3):
        assert _step(steps) == []  # three chunks in, no token yet
    if how == "abort":
        steps.abort(["long"], "client")
        assert {(o.index, o.finish_reason) for o in steps.take_outputs().outputs} == {(0, "abort"), (1, "abort")}
    else:
        steps.stop_sequence("long", 0)
        steps.stop_sequence("long", 1)
        assert steps.take_outputs().finished == ["long"]
    assert steps.chunked is None and steps.scheduler.reserved == [] and not steps.has_work()
    # The engine is whole: a request that needs every slot runs and answers as on a fresh engine.
    wide = request("wide", list(range(3000, 3200)), max_tokens=3, n=MAX_NUM_SEQS, temperature=0.8, seed=1)
    assert run(steps, [wide]) == run(loop_with(tiny, 8), [wide])


def test_the_budget_must_cover_every_running_sequence() -> None:
    with pytest.raises(ValueError, match="must be at least --max-num-seqs"):
        TorchSetup.create("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=4)


@pytest.fixture(scope="module")
def tiny_long() -> tuple[LlamaForCausalLM, EngineInfo]:
    """qwen3-tiny with room for prompts past CHUNK_ATTENTION_SPAN, where the chunks' attention cap binds."""
    setup = TorchSetup.create("qwen3-tiny", dtype="float32", max_model_len=4096, max_num_seqs=MAX_NUM_SEQS,
                              batch_invariant=True)
    return setup.load().model, setup.info


def _chunks_of(steps: StepLoop, rid: str, prompt_len: int) -> tuple[list[tuple[int, int]], list[EngineOutput]]:
    """Step until ``rid`` (a prompt of ``prompt_len``) answers: the (start, rows) of each of its chunks, and every output."""
    chunks, outputs, done = [], [], 0  # no cached prefix here: the first chunk starts at 0
    while not any(o.request_id == rid for o in outputs):
        outputs += _step(steps)
        now = steps.chunked.computed if steps.chunked is not None else prompt_len
        chunks.append((done, now - done))
        done = now
    return chunks, outputs


# (budget, the model's floor): SDPA's (the batch-invariant model's own), where it binds late in the prompt; and
# pdserve's kernel's, set here on the same model, where a smaller budget's cap goes down to it.
@pytest.mark.parametrize(("budget", "floor", "prompt_len"),
                         [(256, SDPA_CHUNK_MIN_ROWS, 3000), (16, KERNEL_CHUNK_MIN_ROWS, 2200)])
def test_beside_running_streams_a_chunk_reads_a_bounded_number_of_keys(
    tiny_long, budget: int, floor: int, prompt_len: int, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    model, _ = tiny_long
    if floor != model.chunk_min_rows:
        monkeypatch.setattr(type(model), "chunk_min_rows", floor)
    prompt = list(range(5000, 5000 + prompt_len))
    steps = loop_with(tiny_long, budget)
    for i in range(2):
        steps.add(request(f"stream{i}", [500 + i, 600, 700], max_tokens=3000, ignore_eos=True))
    _step(steps)
    steps.add(request("long", prompt, max_tokens=2, prompt_logprobs=1, temperature=0))
    chunks, outputs = _chunks_of(steps, "long", len(prompt))
    key_rows = budget * CHUNK_ATTENTION_SPAN
    assert sum(rows for _, rows in chunks) == len(prompt)
    *whole, (_, rest) = chunks  # the last chunk is what was left of the prompt
    assert rest <= floor
    assert all(rows <= budget - 2 and (rows == floor or rows * (start + rows) <= key_rows) for start, rows in whole)
    # Each chunk took the most rows the streams left of the budget and the key cap allow, never below the floor:
    # early ones the budget's, late ones (their rows read thousands of keys) cut, to the floor.
    assert all(rows == min(budget - 2, max(floor, chunk_rows_within(start, key_rows))) for start, rows in whole)
    assert whole[0][1] == budget - 2 and whole[-1][1] == floor
    # Each step decoded both streams, so they got a token per step however small the chunk.
    tokens = [o for o in outputs if o.request_id.startswith("stream")]
    assert len(tokens) == 2 * len(chunks)
    # The cut chunks answer as the whole prompt prefilled at once (ids and every prompt logprob).
    while not any(o.request_id == "long" and o.finish_reason for o in outputs):
        outputs += _step(steps)
    long = [msgspec.structs.replace(o, scheduled_at=None) for o in outputs if o.request_id == "long"]
    assert long == run(loop_with(tiny_long, UNCHUNKED), [request("long", prompt, max_tokens=2, prompt_logprobs=1, temperature=0)])[("long", 0)]


def test_alone_a_long_prompt_takes_the_whole_budget_every_chunk(tiny_long) -> None:  # type: ignore[no-untyped-def]
    steps = loop_with(tiny_long, 512)
    steps.add(request("long", list(range(5000, 8000)), max_tokens=1))
    chunks, _ = _chunks_of(steps, "long", 3000)
    assert [rows for _, rows in chunks] == [512] * (3000 // 512) + [3000 % 512]


@given(computed=st.integers(0, 1 << 20), key_rows=st.integers(1, 1 << 30))
def test_chunk_rows_within_is_the_most_rows_under_the_key_rows(computed: int, key_rows: int) -> None:
    rows = chunk_rows_within(computed, key_rows)
    assert rows >= 1
    assert rows == 1 or rows * (computed + rows) <= key_rows
    assert (rows + 1) * (computed + rows + 1) > key_rows

"""The torch engine's behaviour through the Engine protocol.

Most tests run qwen3-tiny (random weights, real Qwen3 vocabulary: starts in a fraction of a
second); SmolLM2 checks what needs a real model: a sensible answer. Bit-exact batch invariance in
bf16 depends on the CPU's kernels unless the engine runs ``--batch-invariant``
(tests/unit/engine/test_batch_invariant_engine.py). Many tests here compare a request run alone
with the same request in a batch (n sequences, a crowd, the greedy probe against a batch of
three): the shared ``tiny`` engine therefore runs batch-invariant, so those comparisons hold on
every CPU (AMX, AVX-512 bf16, and emulated bf16 alike) and test the engine's sampling and
batching, not oneDNN's row-count-dependent rounding (docs/engine.md, "Batch invariance").
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer

from pdserve.checkpoints.resolve import resolve_model
from pdserve.engine.api import EngineDeadError, EngineError
from pdserve.engine.factory import build_engine
from pdserve.engine.runners.torch_runner import TorchEngine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling
from tests.waiting import async_wait_until

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def started(loop: asyncio.AbstractEventLoop, model: str, **kw: object) -> TorchEngine:
    engine = TorchEngine(model, **kw)  # type: ignore[arg-type]
    loop.run_until_complete(engine.start())
    return engine


@pytest.fixture(scope="module")
def tiny(loop: asyncio.AbstractEventLoop) -> Iterator[TorchEngine]:
    # batch_invariant: a sequence's bits must not depend on its batch here (module docstring).
    engine = started(loop, "qwen3-tiny", max_model_len=512, max_num_seqs=16, batch_invariant=True)
    yield engine
    loop.run_until_complete(engine.shutdown())


def req(rid: str, prompt: list[int] = PROMPT, **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SequenceSampling(**sampling))  # type: ignore[arg-type]


async def collect(engine: TorchEngine, request: EngineRequest) -> list[EngineOutput]:
    return [o async for o in engine.generate(request)]


def run(loop: asyncio.AbstractEventLoop, engine: TorchEngine, *requests: EngineRequest) -> list[list[EngineOutput]]:
    async def go() -> list[list[EngineOutput]]:
        return list(await asyncio.gather(*(collect(engine, r) for r in requests)))

    return loop.run_until_complete(go())


def tokens(outputs: list[EngineOutput], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.new_token_ids]


def finals(outputs: list[EngineOutput]) -> dict[int, EngineOutput]:
    done: dict[int, EngineOutput] = {}
    for o in outputs:
        if o.finished:
            assert o.index not in done, "a sequence finished twice"
            done[o.index] = o
    return done


def greedy_first_token(loop: asyncio.AbstractEventLoop, engine: TorchEngine) -> int:
    return tokens(run(loop, engine, req("probe", max_tokens=1, temperature=0))[0])[0]


# -- sampling ---------------------------------------------------------------------------


def test_greedy_is_deterministic_and_n_sequences_carry_their_index(loop, tiny) -> None:
    (a,) = run(loop, tiny, req("g1", max_tokens=12, temperature=0, n=3))
    (b,) = run(loop, tiny, req("g2", max_tokens=12, temperature=0))
    assert {o.index for o in a} == {0, 1, 2}
    assert tokens(a, 0) == tokens(a, 1) == tokens(a, 2) == tokens(b) and len(tokens(b)) == 12
    assert {i: o.finish_reason for i, o in finals(a).items()} == {0: "length", 1: "length", 2: "length"}
    assert all(len(o.new_token_ids) == 1 for o in a)


def test_seeded_sampling_is_reproducible_per_sequence_and_independent_of_the_batch(loop, tiny) -> None:
    sampling = {"max_tokens": 16, "temperature": 1.0, "seed": 7}
    (pair,) = run(loop, tiny, req("s-pair", n=2, **sampling))
    (alone7,) = run(loop, tiny, req("s7", **sampling))
    (alone8,) = run(loop, tiny, req("s8", **(sampling | {"seed": 8})))
    assert tokens(pair, 0) == tokens(alone7) and tokens(pair, 1) == tokens(alone8)  # sequence i uses seed + i
    assert tokens(alone7) != tokens(alone8)
    crowd = [req(f"other{i}", prompt=[100 + i] * (3 + i), max_tokens=20, temperature=0.9) for i in range(6)]
    crowded = run(loop, tiny, req("s7-crowded", **sampling), *crowd)
    assert tokens(crowded[0]) == tokens(alone7)
    unseeded = run(loop, tiny, req("u1", max_tokens=16), req("u2", max_tokens=16))
    assert tokens(unseeded[0]) != tokens(unseeded[1])


def test_float32_greedy_is_identical_alone_and_in_a_batch(loop) -> None:
    engine = started(loop, "qwen3-tiny", dtype="float32", max_model_len=256)
    try:
        (alone,) = run(loop, engine, req("f32", max_tokens=24, temperature=0, logprobs=5))
        crowd = [req(f"f32-{i}", prompt=[500 + i] * (2 + 5 * i), max_tokens=8 + 4 * i, temperature=0) for i in range(5)]
        again = req("f32-again", max_tokens=24, temperature=0, logprobs=5)
        crowded = run(loop, engine, *crowd[:2], again, *crowd[2:])[2]
    finally:
        loop.run_until_complete(engine.shutdown())
    assert tokens(crowded) == tokens(alone) and len(tokens(alone)) == 24
    assert [o.new_logprobs for o in crowded] == [o.new_logprobs for o in alone]  # bit-identical logits


def test_truncation_parameters_reduce_to_greedy_at_their_limits(loop, tiny) -> None:
    (greedy,) = run(loop, tiny, req("lim-g", max_tokens=8, temperature=0))
    limits = [{"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}]
    outs = run(
        loop, tiny, *(req(f"lim{i}", max_tokens=8, temperature=1.5, seed=i, **lim) for i, lim in enumerate(limits))
    )
    for out in outs:
        assert tokens(out) == tokens(greedy)


def test_top_k_and_min_p_restrict_the_sampled_tokens(loop, tiny) -> None:
    top_k, min_p = run(
        loop,
        tiny,
        req("tk", max_tokens=40, temperature=1.0, top_k=3, seed=1, logprobs=3),
        req("mp", max_tokens=40, temperature=1.0, min_p=0.5, seed=2, logprobs=1),
    )
    for o in top_k:
        assert o.new_logprobs[0].ranks[0] <= 3
    for o in min_p:
        lp = o.new_logprobs[0]
        assert lp.logprobs[0] >= lp.logprobs[1] + math.log(0.5) - 1e-4


# -- logprobs -----------------------------------------------------------------------------


def test_logprobs_put_the_sampled_token_first_with_its_true_rank(loop, tiny) -> None:
    greedy, sampled, only = run(
        loop,
        tiny,
        req("lp-g", max_tokens=6, temperature=0, logprobs=5),
        req("lp-s", max_tokens=30, temperature=1.0, seed=3, logprobs=4),
        req("lp-0", max_tokens=3, temperature=0, logprobs=0),
    )
    for o in greedy:
        lp = o.new_logprobs[0]
        assert lp.token_ids[0] == o.new_token_ids[0] == lp.token_ids[1]
        assert lp.ranks == [1, 1, 2, 3, 4, 5]
        assert lp.logprobs[0] == max(lp.logprobs[1:]) == lp.logprobs[1]
        assert lp.logprobs[1:] == sorted(lp.logprobs[1:], reverse=True)
        assert lp.logprobs[0] <= 0
    for o in sampled:
        lp = o.new_logprobs[0]
        assert lp.token_ids[0] == o.new_token_ids[0] and len(lp.token_ids) == 5
        if lp.token_ids[0] in lp.token_ids[1:]:
            assert lp.ranks[0] == lp.token_ids[1:].index(lp.token_ids[0]) + 1
        else:
            assert lp.ranks[0] > 4 and lp.logprobs[0] <= lp.logprobs[-1]
    assert all(len(o.new_logprobs[0].token_ids) == 1 for o in only)


def test_prompt_logprobs_arrive_once_aligned_with_the_prompt(loop, tiny) -> None:
    (out,) = run(loop, tiny, req("plp", max_tokens=3, temperature=0, n=2, prompt_logprobs=2))
    first = [o for o in out if o.prompt_logprobs is not None]
    assert len(first) == 1 and first[0].index == 0
    plp = first[0].prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    for position, entry in zip(PROMPT[1:], plp[1:], strict=True):
        assert entry.token_ids[0] == position and len(entry.token_ids) == 3
        assert entry.ranks[1:] == [1, 2] and entry.ranks[0] >= 1
    assert all(o.new_logprobs is None for o in out)


# -- logits processing (the raw logprobs of logprobs=-1 show what the model itself preferred) ------


def raw_logprobs(output: EngineOutput) -> dict[int, float]:
    """The whole-vocabulary logprobs of one position, as the model gave them (before any processing)."""
    lp = output.new_logprobs[0]
    return dict(zip(lp.token_ids[1:], lp.logprobs[1:], strict=True))


def assert_each_step_is_the_argmax_of(
    outputs: list[EngineOutput], adjust: Callable[[int, float, list[int]], float]
) -> None:
    """Every greedy token is the argmax of ``adjust(id, raw logprob, output so far)``: the processing
    a parameter defines, recomputed here from the raw distribution of each step."""
    produced: list[int] = []
    for o in outputs:
        raw = raw_logprobs(o)
        best = max(adjust(t, raw[t], produced) for t in raw)
        # An argmax: random weights can tie two ids exactly (the engine then takes the lower id).
        assert adjust(o.new_token_ids[0], raw[o.new_token_ids[0]], produced) == best
        produced.append(o.new_token_ids[0])


def test_frequency_and_presence_penalties_penalise_the_output_and_cut_repeats(loop, tiny) -> None:
    sampling = {"max_tokens": 10, "temperature": 0, "logprobs": -1}
    plain, freq, pres = run(
        loop,
        tiny,
        req("pen-plain", **sampling),
        req("pen-freq", frequency_penalty=0.7, **sampling),
        req("pen-pres", presence_penalty=1.2, **sampling),
    )
    assert_each_step_is_the_argmax_of(freq, lambda t, lp, out: lp - 0.7 * out.count(t))
    assert_each_step_is_the_argmax_of(pres, lambda t, lp, out: lp - 1.2 * (t in out))
    most_repeated = max(Counter(tokens(plain)).values())
    assert most_repeated > 1
    assert max(Counter(tokens(freq)).values()) < most_repeated and max(Counter(tokens(pres)).values()) < most_repeated


def test_repetition_penalty_covers_the_prompt_and_cuts_repeats(loop, tiny) -> None:
    x = greedy_first_token(loop, tiny)
    assert x in PROMPT  # what makes this test meaningful: the model's first choice repeats the prompt
    plain, repetition, presence = run(
        loop,
        tiny,
        req("rep-plain", max_tokens=24, temperature=0),
        req("rep", max_tokens=24, temperature=0, repetition_penalty=2.0),
        req("rep-pres", max_tokens=24, temperature=0, presence_penalty=2.0),
    )
    assert tokens(repetition)[0] != x, "repetition_penalty counts the prompt"
    assert tokens(presence)[0] == x, "presence_penalty counts the output only"
    assert max(Counter(tokens(repetition)).values()) < max(Counter(tokens(plain)).values())


def test_logit_bias_moves_the_greedy_answer_but_not_the_logprobs(loop, tiny) -> None:
    x = greedy_first_token(loop, tiny)
    y = 12037
    banned, forced, mixed = run(
        loop,
        tiny,
        req("lb-ban", max_tokens=8, temperature=0, logit_bias={x: -100.0}, logprobs=1),
        req("lb-force", max_tokens=8, temperature=0, logit_bias={y: 100.0}),
        req("lb-mix", max_tokens=6, temperature=0, logit_bias={x: -3.0, y: 2.5}, logprobs=-1),
    )
    assert x not in tokens(banned) and len(tokens(banned)) == 8
    assert banned[0].new_logprobs[0].token_ids[1] == x, "logprobs are the model's, before the bias"
    assert tokens(forced) == [y] * 8
    bias = {x: -3.0, y: 2.5}
    assert_each_step_is_the_argmax_of(mixed, lambda t, lp, _: lp + bias.get(t, 0.0))


def test_allowed_token_ids_restrict_every_output_id(loop, tiny) -> None:
    allowed = [77, 100, 2000, 5000, 30000]
    greedy, sampled = run(
        loop,
        tiny,
        req("allow-g", max_tokens=12, temperature=0, allowed_token_ids=allowed, logprobs=-1),
        req("allow-s", max_tokens=40, temperature=1.0, seed=5, n=2, allowed_token_ids=allowed),
    )
    assert_each_step_is_the_argmax_of(greedy, lambda t, lp, _: lp if t in allowed else -math.inf)
    for index in (0, 1):
        assert len(tokens(sampled, index)) == 40 and set(tokens(sampled, index)) <= set(allowed)
    assert len(set(tokens(sampled, 0))) > 1  # sampling still draws among the allowed ids


def test_bad_words_never_appear(loop, tiny) -> None:
    x = greedy_first_token(loop, tiny)
    single, pair = run(
        loop,
        tiny,
        req("bw-one", max_tokens=12, temperature=0, bad_words_token_ids=[[x]], logprobs=-1),
        req("bw-pair", max_tokens=24, temperature=0, bad_words_token_ids=[[x, x]]),
    )
    assert_each_step_is_the_argmax_of(single, lambda t, lp, _: -math.inf if t == x else lp)
    out = tokens(pair)
    assert out[0] == x, "a longer bad word bans its last id only after the ids before it"
    assert all((a, b) != (x, x) for a, b in zip(out, out[1:], strict=False))


def test_logits_processing_is_per_row_in_a_mixed_batch(loop) -> None:
    engine = started(loop, "qwen3-tiny", dtype="float32", max_model_len=256)
    x = greedy_first_token(loop, engine)
    params = [
        {},
        {"frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"repetition_penalty": 1.7},
        {"logit_bias": {x: -100.0, 500: 4.0}},
        {"allowed_token_ids": [10, 20, 30, 40]},
        {"bad_words_token_ids": [[x], [12037, 12037]]},
        {"min_tokens": 3, "repetition_penalty": 1.2, "logit_bias": {x: 1.0}, "bad_words_token_ids": [[x, x]]},
    ]
    sampling = {"max_tokens": 12, "temperature": 0}
    try:
        alone = [tokens(run(loop, engine, req(f"a{i}", **sampling, **p))[0]) for i, p in enumerate(params)]
        together = run(loop, engine, *(req(f"m{i}", **sampling, **p) for i, p in enumerate(params)))
    finally:
        loop.run_until_complete(engine.shutdown())
    assert [tokens(o) for o in together] == alone
    assert len(set(map(tuple, alone))) == len(params), "every parameter changed the greedy answer"


# -- stopping -----------------------------------------------------------------------------


def test_stop_token_ids_and_min_tokens(loop, tiny) -> None:
    x = greedy_first_token(loop, tiny)
    stopped, delayed = run(
        loop,
        tiny,
        req("st", max_tokens=10, temperature=0, stop_token_ids=[x]),
        req("st-min", max_tokens=10, temperature=0, stop_token_ids=[x], min_tokens=3),
    )
    assert tokens(stopped) == [x]
    assert (finals(stopped)[0].finish_reason, finals(stopped)[0].stop_reason) == ("stop", x)
    assert x not in tokens(delayed)[:3] and len(tokens(delayed)) >= 4
    if finals(delayed)[0].finish_reason == "stop":
        assert tokens(delayed)[-1] == x and finals(delayed)[0].stop_reason == x


@pytest.fixture(scope="module")
def eos_models(tmp_path_factory: pytest.TempPathFactory, loop, tiny) -> dict[str, Path]:
    """qwen3-tiny copies whose EOS is the token the model greedily emits first: as the
    primary EOS (config.json) or only as an extra generation_config EOS."""
    x = greedy_first_token(loop, tiny)
    source = resolve_model("qwen3-tiny")
    dirs = {}
    for kind, (primary, extra) in {"primary": (x, [x]), "extra": (151645, [151645, x])}.items():
        d = tmp_path_factory.mktemp(f"eos-{kind}")
        for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (d / f).symlink_to(source / f)
        config = json.loads((source / "config.json").read_text()) | {"eos_token_id": primary}
        (d / "config.json").write_text(json.dumps(config))
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": extra}))
        dirs[kind] = d
    dirs["token"] = x  # type: ignore[assignment]
    return dirs


def test_eos_finishes_with_stop_reason_none_for_primary_and_the_id_for_others(loop, eos_models) -> None:
    x = eos_models["token"]
    for kind, reason in (("primary", None), ("extra", x)):
        # Batch-invariant like ``tiny``, whose greedy probe gave x: the same bits, and the batch of three
        # below gives each request what it gets alone (module docstring).
        engine = started(loop, str(eos_models[kind]), max_model_len=64, batch_invariant=True)
        try:
            assert engine.info.eos_token_ids[0] == (x if kind == "primary" else 151645)
            plain, ignored, delayed = run(
                loop,
                engine,
                req("e", max_tokens=10, temperature=0),
                req("e-ignore", max_tokens=10, temperature=0, ignore_eos=True),
                req("e-min", max_tokens=10, temperature=0, min_tokens=4, logprobs=1),
            )
        finally:
            loop.run_until_complete(engine.shutdown())
        assert tokens(plain) == [x]
        assert (finals(plain)[0].finish_reason, finals(plain)[0].stop_reason) == ("stop", reason)
        assert finals(ignored)[0].finish_reason == "length" and len(tokens(ignored)) == 10
        assert x not in tokens(delayed)[:4] and len(tokens(delayed)) >= 5
        first = delayed[0].new_logprobs[0]
        assert first.token_ids[1] == x and first.ranks[0] > 1, "logprobs are raw: before the min_tokens mask"


def test_max_model_len_finishes_with_length_and_longer_prompts_are_rejected(loop) -> None:
    engine = started(loop, "qwen3-tiny", max_model_len=12)
    try:
        (out,) = run(loop, engine, req("ml", prompt=PROMPT, max_tokens=100, temperature=0))
        assert len(tokens(out)) == 12 - len(PROMPT) and finals(out)[0].finish_reason == "length"
        with pytest.raises(EngineError, match="max_model_len 12 leaves no room"):
            run(loop, engine, req("ml-long", prompt=[1] * 12))
    finally:
        loop.run_until_complete(engine.shutdown())


# -- request lifecycle ----------------------------------------------------------------------


def test_abort_ends_every_unfinished_sequence_with_one_abort_output(loop, tiny) -> None:
    async def go() -> list[EngineOutput]:
        outs = []
        async for o in tiny.generate(req("ab", max_tokens=400, temperature=0, n=2)):
            outs.append(o)
            if len(outs) == 4:
                await tiny.abort(["ab", "unknown-id"])
        return outs

    outs = loop.run_until_complete(go())
    done = finals(outs)
    assert set(done) == {0, 1} and all(o.finish_reason == "abort" and not o.new_token_ids for o in done.values())
    assert {o.index for o in outs[-2:]} == {0, 1} and all(o.finished for o in outs[-2:])
    assert len(tokens(outs, 0)) < 400


def test_abort_of_a_waiting_request_and_fcfs_admission(loop) -> None:
    engine = started(loop, "qwen3-tiny", max_model_len=256, max_num_seqs=2)

    async def go() -> tuple[list[EngineOutput], list[EngineOutput], int]:
        busy = asyncio.ensure_future(collect(engine, req("busy", max_tokens=60, temperature=0, n=2)))
        waiting = asyncio.ensure_future(collect(engine, req("wait", max_tokens=5, temperature=0, n=2)))
        seen_waiting = await async_wait_until(lambda: engine.stats().waiting_requests, "the second request waits")
        await engine.abort(["wait"])
        return await busy, await waiting, seen_waiting

    try:
        busy, waiting, seen_waiting = loop.run_until_complete(go())
    finally:
        loop.run_until_complete(engine.shutdown())
    assert seen_waiting == 1
    assert {i: o.finish_reason for i, o in finals(waiting).items()} == {0: "abort", 1: "abort"}
    assert not tokens(waiting, 0) and not tokens(waiting, 1)
    assert len(tokens(busy, 0)) == len(tokens(busy, 1)) == 60


def test_stop_sequence_frees_one_sequence_silently(loop, tiny) -> None:
    async def go() -> tuple[list[EngineOutput], int]:
        outs, running_after = [], -1
        async for o in tiny.generate(req("ss", max_tokens=30, temperature=0, n=2)):
            outs.append(o)
            if len(outs) == 2:
                await tiny.stop_sequence("ss", 0)
            if o.index == 1 and len(tokens(outs, 1)) == 20:
                running_after = tiny.stats().running_sequences
        return outs, running_after

    outs, running_after = loop.run_until_complete(go())
    assert set(finals(outs)) == {1} and finals(outs)[1].finish_reason == "length"
    assert len(tokens(outs, 0)) < 30 and len(tokens(outs, 1)) == 30
    assert running_after == 1


def test_closing_the_iterator_aborts_and_frees_the_request(loop, tiny) -> None:
    async def go() -> int:
        stream = tiny.generate(req("close", max_tokens=400, temperature=0))
        await anext(stream)
        await stream.aclose()
        await async_wait_until(lambda: tiny.stats().running_sequences == 0, "the closed request is freed")
        return tiny.stats().running_sequences

    assert loop.run_until_complete(go()) == 0


def test_requests_join_and_leave_a_running_batch(loop, tiny) -> None:
    async def go() -> tuple[list[EngineOutput], list[EngineOutput], int]:
        long = asyncio.ensure_future(collect(tiny, req("long", max_tokens=300, temperature=0)))
        await async_wait_until(lambda: tiny.stats().running_requests == 1, "the long request runs")
        short, together = [], 0
        async for o in tiny.generate(req("short", max_tokens=5, temperature=0)):
            short.append(o)
            if not o.finished:  # read while short still streams: long must still be decoding next to it
                together = max(together, tiny.stats().running_sequences)
        return await long, short, together

    long, short, together = loop.run_until_complete(go())
    assert len(tokens(long)) == 300 and len(tokens(short)) == 5 and together == 2


def test_invalid_requests_fail_with_a_clear_error(loop, tiny) -> None:
    cases = [
        (req("empty", prompt=[]), "prompt_token_ids is empty"),
        (req("oov", prompt=[151936]), r"must be in \[0, 151936\)"),
        (req("wide", n=17), "n must be between 1 and max_num_seqs"),
        (req("zero", max_tokens=0), "max_tokens must be at least 1"),
        (req("bad-p", top_p=0.0), "top_p"),
        (req("bad-lp", logprobs=-2), "logprobs must be -1"),
        (req("bias-oov", logit_bias={151936: 1.0}), r"logit_bias token ids must be in \[0, 151936\)"),
        (req("allow-empty", allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (req("allow-oov", allowed_token_ids=[5, -1]), r"allowed_token_ids must be in \[0, 151936\)"),
        (req("bw-oov", bad_words_token_ids=[[1, 151936]]), r"bad_words_token_ids must be in \[0, 151936\)"),
        (req("bw-empty", bad_words_token_ids=[[]]), "must not contain an empty sequence"),
        (req("bw-all", allowed_token_ids=[3, 4], bad_words_token_ids=[[4], [3]]), "ban every id in allowed"),
        (req("rep-zero", repetition_penalty=0.0), "repetition_penalty must be greater than zero"),
        (req("pres-big", presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (req("freq-small", frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\]"),
    ]
    for request, message in cases:
        with pytest.raises(EngineError, match=message):
            run(loop, tiny, request)

    async def duplicate() -> None:
        first = tiny.generate(req("dup", max_tokens=50))
        await anext(first)
        try:
            await anext(tiny.generate(req("dup")))
        finally:
            await first.aclose()

    with pytest.raises(EngineError, match="already running"):
        loop.run_until_complete(duplicate())


def test_shutdown_fails_in_flight_requests_and_later_ones(loop) -> None:
    engine = build_engine(EngineSpec(kind="torch", model="qwen3-tiny", max_model_len=1024))
    assert isinstance(engine, TorchEngine) and engine.info.eos_token_ids == [151645, 151643]
    loop.run_until_complete(engine.start())
    assert engine.is_healthy()

    async def go() -> None:
        stream = engine.generate(req("inflight", max_tokens=1000, temperature=0))
        await anext(stream)
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await anext(engine.generate(req("late")))

    loop.run_until_complete(go())
    assert not engine.is_healthy()


def test_unknown_model_and_dtype_fail_clearly() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'.*smollm2-135m, qwen3-tiny"):
        TorchEngine("nope")
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        TorchEngine("qwen3-tiny", dtype="int4")


# -- SmolLM2 (real weights) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(loop) -> Iterator[TorchEngine]:
    engine = started(loop, "smollm2-135m", max_model_len=1024)
    yield engine
    loop.run_until_complete(engine.shutdown())


def chat_prompt(content: str) -> list[int]:
    model_dir = resolve_model("smollm2-135m")
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    text = jinja2.Template(template).render(messages=[{"role": "user", "content": content}], add_generation_prompt=True)
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(loop, smol) -> None:
    (out,) = run(
        loop, smol, req("paris", prompt=chat_prompt("What is the capital of France?"), max_tokens=20, temperature=0)
    )
    tokenizer = Tokenizer.from_file(str(resolve_model("smollm2-135m") / "tokenizer.json"))
    assert "Paris" in tokenizer.decode(tokens(out))
    assert finals(out)[0].finish_reason == "stop" and finals(out)[0].stop_reason is None  # <|im_end|>



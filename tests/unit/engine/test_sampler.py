"""The sampler's logits processors on hand-made logits, against vLLM's definitions written out here."""

from __future__ import annotations

import math
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.sampler import (
    RawLogprobs,
    SequenceState,
    draw,
    largest_k,
    process_logits,
    request_rules,
    sample,
    sample_row,
    top_k_top_p,
)
from pdserve.protocol.engine import SequenceSampling

INF = float("inf")
EOS = frozenset({7})


def state(prompt: list[int], output: list[int], vocab: int = 10, **sp: object) -> SequenceState:
    """A sequence that has already produced ``output``, recorded one id at a time as the engine does."""
    sampling = SequenceSampling(**sp)  # type: ignore[arg-type]
    seq = SequenceState(request_rules(sampling, prompt, vocab, EOS), None, vocab)
    for token in output:
        seq.record(token)
    return seq


def processed(logits: list[list[float]], states: list[SequenceState]) -> list[list[float]]:
    tensor = torch.tensor(logits, dtype=torch.float32)
    process_logits(tensor, states)
    return tensor.tolist()


def test_penalties_follow_their_definitions() -> None:
    logits = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
    seq = state([0, 1], [2, 2, 3], vocab=6, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    (row,) = processed([logits], [seq])
    assert row == [
        2.0 / 2,  # prompt only: repetition divides a positive logit ...
        -1.0 * 2,  # ... and multiplies a negative one; presence/frequency ignore the prompt
        0.5 / 2 - 0.5 * 2 - 0.25,  # twice in the output
        -0.5 * 2 - 0.5 * 1 - 0.25,  # once in the output
        3.0,  # never seen
        0.0,
    ]


def test_presence_and_frequency_count_the_output_only() -> None:
    seq = state([4, 4, 4], [1, 1, 1, 2], vocab=5, presence_penalty=1.0, frequency_penalty=0.5)
    (row,) = processed([[0.0] * 5], [seq])
    assert row == [0.0, -(1.0 + 0.5 * 3), -(1.0 + 0.5), 0.0, 0.0]


def test_logit_bias_is_added_before_the_penalties() -> None:
    seq = state([0, 1], [], vocab=4, repetition_penalty=2.0, logit_bias={0: 1.0, 1: 3.0, 3: -2.5})
    (row,) = processed([[1.0, -1.0, 0.5, 0.5]], [seq])
    # The bias decides the sign the repetition penalty sees: (1 + 1) / 2 and (-1 + 3) / 2.
    assert row == [(1.0 + 1.0) / 2, (-1.0 + 3.0) / 2, 0.5, 0.5 - 2.5]


def test_allowed_token_ids_mask_everything_else() -> None:
    (row,) = processed([[float(i) for i in range(6)]], [state([0], [], vocab=6, allowed_token_ids=[1, 4])])
    assert row == [-INF, 1.0, -INF, -INF, 4.0, -INF]


def test_bad_words_ban_the_last_id_after_their_prefix() -> None:
    words = [[3], [1, 4], [5, 2], [9, 1, 0], [5, 1, 6], [8, 8, 8, 8]]
    (row,) = processed([[0.0] * 10], [state([0], [5, 1], bad_words_token_ids=words)])
    banned = {i for i, v in enumerate(row) if v == -INF}
    # 3 always; 4 and 6 because the output ends with [1] and [5, 1]; not 2 (needs [5]), 0 (needs [9, 1])
    # nor 8 (its prefix is longer than the output).
    assert banned == {3, 4, 6}
    (fresh,) = processed([[0.0] * 10], [state([0], [], bad_words_token_ids=words)])
    assert {i for i, v in enumerate(fresh) if v == -INF} == {3}


def test_min_tokens_masks_eos_and_stop_ids_until_enough_are_out() -> None:
    for produced, ignore_eos, banned in [(1, False, {2, 7}), (1, True, {2}), (2, False, set())]:
        seq = state([0], [0] * produced, min_tokens=2, stop_token_ids=[2], ignore_eos=ignore_eos)
        (row,) = processed([[0.0] * 10], [seq])
        assert {i for i, v in enumerate(row) if v == -INF} == banned


def test_plain_requests_get_no_state_and_untouched_logits() -> None:
    plain = state([1, 2], [3])
    rules = plain.rules
    assert plain.counts is None and rules.disallowed is None and rules.bias_ids is None and not rules.bad_words
    logits = [[0.5, -0.25, 1.5, 0.0, 2.0, -3.0, 0.125, 9.0, 1.0, 4.0]]
    assert processed(logits, [plain]) == logits


def test_counts_follow_every_recorded_token() -> None:
    output = [3, 1, 3, 3, 0, 1]
    seq = state([2], output, vocab=5, frequency_penalty=0.1)
    assert seq.counts is not None and seq.output == output
    assert seq.counts.tolist() == [float(Counter(output)[t]) for t in range(5)]


def test_logprobs_come_from_the_raw_logits() -> None:
    raw = [2.0, 1.0, 0.0, -1.0]
    seq = state([0], [], vocab=4, logit_bias={0: -50.0}, allowed_token_ids=[0, 1, 3], logprobs=4)
    (token,), (lp,) = sample(torch.tensor([raw]), [seq])
    assert token == 1 and seq.output == [1]
    norm = math.log(sum(math.exp(v) for v in raw))
    assert lp is not None and lp.token_ids == [1, 0, 1, 2, 3] and lp.ranks == [2, 1, 2, 3, 4]
    assert all(math.isclose(a, raw[t] - norm, rel_tol=1e-6) for a, t in zip(lp.logprobs, lp.token_ids, strict=True))


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, float("-inf")]), min_size=6, max_size=6),
                  min_size=1, max_size=4),
    data=st.data(),
)
def test_ranks_count_every_id_above_the_token_wherever_it_ranks(rows: list[list[float]], data: st.DataObject) -> None:
    """The rank is read from the top-k when the token is in it, else from the whole row: always
    1 + the ids with a strictly higher logprob (ties included, top-0 included)."""
    ks = [data.draw(st.sampled_from([None, 0, 1, 2, 6, -1])) for _ in rows]
    tokens = [data.draw(st.integers(0, 5)) for _ in rows]
    logits = torch.tensor(rows)
    for i, position in enumerate(RawLogprobs.of(logits, ks).gather(tokens)):
        if ks[i] is None:
            assert position is None
            continue
        logprobs = torch.log_softmax(logits[i], -1)
        assert position is not None and position.ranks[0] == 1 + int((logprobs > logprobs[tokens[i]]).sum())
        assert position.token_ids[0] == tokens[i] and len(position.token_ids) == 1 + (6 if ks[i] == -1 else ks[i])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 3).flatmap(lambda n: st.integers(1, 300).flatmap(lambda width: st.lists(
        st.lists(st.sampled_from([-INF, -2.0, -0.5, 0.0, 0.25, 1.0, 3.0]) | st.floats(-5, 5, width=32),
                 min_size=width, max_size=width), min_size=n, max_size=n))),
    data=st.data(),
)
def test_largest_k_through_chunk_maxima_is_torch_topk(rows: list[list[float]], data: st.DataObject) -> None:
    """The same values bit for bit, largest first, at ids that hold them (ties may pick other ids);
    chunks of 4 so that short rows take the chunked path, tail and ties included."""
    values = torch.tensor(rows, dtype=torch.float32)
    k = data.draw(st.integers(0, values.shape[1]))
    got, ids = largest_k(values, k, chunk=4)
    want = torch.topk(values, k)
    assert torch.equal(got, want.values)
    assert all(len(set(row)) == len(row) for row in ids.tolist())
    assert torch.equal(values.gather(1, ids), got)
    one_row, one_ids = largest_k(values[0], k, chunk=4)
    assert torch.equal(one_row, got[0]) and torch.equal(values[0][one_ids], got[0])


def test_largest_k_of_a_row_with_nan_puts_it_first_as_torch_does() -> None:
    values = torch.zeros(2, 1000)
    values[0, 700], values[1, 3] = float("nan"), 5.0
    got, ids = largest_k(values, 3, chunk=8)
    assert math.isnan(got[0, 0]) and ids[0, 0] == 700 and got[1, 0] == 5.0 and ids[1, 0] == 3


def test_greedy_rows_take_the_first_of_equal_maxima_as_argmax_does() -> None:
    vocab = 151936
    logits = torch.randn(4, vocab)
    for row, spots in enumerate([(5, 9), (150000, 151935), (77, 140000, 3), (0, 1)]):
        logits[row, list(spots)] = 100.0
    logits[3, 60000] = float("nan")
    states = [state([0], [], vocab=vocab) for _ in range(4)]
    assert draw(logits.clone(), states) == logits.argmax(-1).tolist() == [5, 150000, 3, 60000]


def test_top_p_applies_to_what_top_k_kept() -> None:
    probs = torch.tensor([0.4, 0.3, 0.3])
    values, ids = top_k_top_p(probs, 2, 0.5)
    # Renormalised over top-2, token 0 alone holds 0.4 / 0.7 > 0.5 of the mass.
    assert ids is not None and ids.tolist() == [0] and values.tolist() == [probs[0].item()]
    values, ids = top_k_top_p(probs, 0, 0.5)
    assert ids is not None and ids.tolist() == [0, 1]


def test_top_p_beyond_the_candidate_short_list_sorts_the_whole_vocab() -> None:
    vocab = 2000
    probs = torch.full((vocab,), 1.0 / vocab)
    _, ids = top_k_top_p(probs, 0, 0.90025)  # the prefix with less than 0.90025 before it: 1801 ids
    assert ids is not None and ids.shape[0] == 1801


def test_min_p_comes_before_top_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()

    def picks(**sp: float) -> set[int]:
        params = SequenceSampling(temperature=1.0, **sp)  # type: ignore[arg-type]
        return {sample_row(logits, params, torch.Generator().manual_seed(s)) for s in range(200)}

    # Alone, top-p 0.6 keeps {0, 1}; after min-p 0.5 drops id 2, id 0 holds 0.5 / 0.8 >= 0.6 of what is left.
    assert picks(top_p=0.6) == {0, 1}
    assert picks(top_p=0.6, min_p=0.5) == {0}


# -- the batch against a reference written from the definitions -----------------------------

VOCAB = 9


def reference(logits: list[float], sp: SequenceSampling, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order: allow-list, bad words, min_tokens, logit bias, repetition, frequency, presence."""
    x = list(logits)
    if sp.allowed_token_ids is not None:
        x = [v if t in sp.allowed_token_ids else -INF for t, v in enumerate(x)]
    for word in sp.bad_words_token_ids or []:
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1 :] == word[:-1]:
            x[word[-1]] = -INF
    if len(output) < sp.min_tokens:
        for t in set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(EOS)):
            x[t] = -INF
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        count = output.count(t)
        x[t] -= sp.frequency_penalty * count + (sp.presence_penalty if count else 0.0)
    return x


ids = st.integers(0, VOCAB - 1)
rows = st.fixed_dictionaries(
    {
        "logits": st.lists(st.floats(-4, 4, width=32), min_size=VOCAB, max_size=VOCAB),
        "prompt": st.lists(ids, min_size=1, max_size=5),
        "output": st.lists(ids, max_size=6),
        "sampling": st.fixed_dictionaries(
            {},
            optional={
                "presence_penalty": st.floats(-2, 2),
                "frequency_penalty": st.floats(-2, 2),
                "repetition_penalty": st.floats(0.25, 2.0),
                "logit_bias": st.dictionaries(ids, st.floats(-10, 10), max_size=4),
                "allowed_token_ids": st.lists(ids, min_size=1, max_size=5, unique=True),
                "bad_words_token_ids": st.lists(st.lists(ids, min_size=1, max_size=3), max_size=4),
                "min_tokens": st.integers(0, 4),
                "stop_token_ids": st.lists(ids, max_size=2),
                "ignore_eos": st.booleans(),
            },
        ),
    }
)


def close(a: float, b: float) -> bool:
    return a == b if math.isinf(a) or math.isinf(b) else math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(rows, min_size=1, max_size=5))
def test_a_batch_matches_the_definitions_row_by_row_and_each_row_alone(batch: list[dict]) -> None:
    def states() -> list[SequenceState]:
        return [state(r["prompt"], r["output"], vocab=VOCAB, **r["sampling"]) for r in batch]

    together = processed([r["logits"] for r in batch], states())
    for r, got, st_alone in zip(batch, together, states(), strict=True):
        want = reference(r["logits"], SequenceSampling(**r["sampling"]), r["prompt"], r["output"])
        assert all(close(g, w) for g, w in zip(got, want, strict=True)), (got, want)
        assert processed([r["logits"]], [st_alone]) == [got], "a row's result must not depend on its batch"

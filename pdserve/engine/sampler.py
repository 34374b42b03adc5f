"""Logits processing and sampling for one engine step, over the whole batch (vLLM's order and rules).

A step hands in float32 logits ``[B, vocab]``, one row per running sequence, and one
:class:`SequenceState` per row. :func:`sample` then, as vLLM v1's sampler does:

1. takes the *raw* logprobs (before any processing) of the rows that asked for logprobs;
2. masks every id outside ``allowed_token_ids``;
3. masks ``bad_words``: the last id of a banned sequence when the output ends with the ids before it
   (a one-id sequence is always banned);
4. masks EOS (unless ``ignore_eos``) and ``stop_token_ids`` until ``min_tokens`` are out;
5. adds ``logit_bias``;
6. applies the penalties: repetition over prompt + output (positive logits divided by it, the others
   multiplied), then frequency (``- penalty x count in the output``) and presence (``- penalty`` once an
   id is in the output);
7. draws: greedy rows take the argmax; the others apply temperature, min-p, top-k, then top-p on what
   top-k left, and draw from their own generator.

Each stage runs only when some row of the batch uses it, so a plain request pays for none of them.
Per-sequence state is updated by one id per step (:meth:`SequenceState.record`): nothing is recounted
from the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.protocol.engine import PositionLogprobs, SequenceSampling

# Below this temperature sampling is greedy (as in vLLM).
GREEDY_TEMPERATURE = 1e-5
# top-p first looks at this many candidates and sorts the whole vocab only if they hold too little mass.
TOP_P_CANDIDATES = 1024
# largest_k reads a long row through the maxima of chunks this long (see there).
TOP_K_CHUNK = 128


@dataclass(frozen=True, eq=False)
class RequestRules:
    """What one request's sampling params do to its logits, prepared once and shared by its ``n`` sequences."""

    sampling: SequenceSampling
    min_tokens_banned: tuple[int, ...]  # masked until min_tokens ids are out
    disallowed: torch.Tensor | None  # [vocab] bool, True outside allowed_token_ids
    bias_ids: torch.Tensor | None  # logit_bias keys (long) ...
    bias_values: torch.Tensor | None  # ... and their float32 values
    bad_words: tuple[tuple[int, ...], ...]
    prompt_mask: torch.Tensor | None  # [vocab] bool, the prompt's ids; set when any penalty is on

    @property
    def penalized(self) -> bool:
        return self.prompt_mask is not None


def request_rules(
    sampling: SequenceSampling, prompt: list[int], vocab_size: int, eos_ids: frozenset[int]
) -> RequestRules:
    """Turn the request's params into tensors once, so a step only stacks and indexes them."""
    banned = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else eos_ids)
    disallowed = None
    if sampling.allowed_token_ids is not None:
        disallowed = torch.ones(vocab_size, dtype=torch.bool)
        disallowed[sampling.allowed_token_ids] = False
    bias_ids = bias_values = None
    if sampling.logit_bias:
        bias_ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long)
        bias_values = torch.tensor(list(sampling.logit_bias.values()), dtype=torch.float32)
    prompt_mask = None
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0:
        prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
        prompt_mask[prompt] = True
    return RequestRules(
        sampling=sampling,
        min_tokens_banned=tuple(sorted(banned)) if sampling.min_tokens > 0 else (),
        disallowed=disallowed,
        bias_ids=bias_ids,
        bias_values=bias_values,
        bad_words=tuple(tuple(word) for word in sampling.bad_words_token_ids or ()),
        prompt_mask=prompt_mask,
    )


class SequenceState:
    """One sequence's sampling state: its rules, its generator (None = greedy), its output ids and,
    when a penalty is on, a running count of each id in the output."""

    def __init__(self, rules: RequestRules, generator: torch.Generator | None, vocab_size: int,
                 prior_output: list[int] | None = None) -> None:
        self.rules = rules
        self.generator = generator
        self.output: list[int] = []
        self.counts = torch.zeros(vocab_size, dtype=torch.float32) if rules.penalized else None
        if self.counts is not None and prior_output:  # a resumed stream's earlier output is output to penalize
            self.counts.index_put_((torch.tensor(prior_output, dtype=torch.long),), torch.tensor(1.0), accumulate=True)

    def record(self, token: int) -> None:
        """The sequence produced ``token``: O(1) whatever the output length."""
        self.output.append(token)
        if self.counts is not None:
            self.counts[token] += 1.0


def sample(logits: torch.Tensor, states: list[SequenceState]) -> tuple[list[int], list[PositionLogprobs | None]]:
    """One token per row (recorded into its state) and each row's logprobs, taken from the raw logits.

    ``logits`` is processed in place.
    """
    raw = RawLogprobs.of(logits, [s.rules.sampling.logprobs for s in states])
    process_logits(logits, states)
    tokens = draw(logits, states)
    for state, token in zip(states, tokens, strict=True):
        state.record(token)
    return tokens, raw.gather(tokens)


def process_logits(logits: torch.Tensor, states: list[SequenceState]) -> None:
    """Stages 2-6 of the module docstring, in place; each is skipped when no row uses it."""
    apply_allowed(logits, states)
    apply_bans(logits, states)
    apply_logit_bias(logits, states)
    apply_penalties(logits, states)


def apply_allowed(logits: torch.Tensor, states: list[SequenceState]) -> None:
    """Ids outside a row's ``allowed_token_ids`` go to -inf."""
    picked = [(i, m) for i, s in enumerate(states) if (m := s.rules.disallowed) is not None]
    if picked:
        rows = [i for i, _ in picked]
        logits[rows] = logits[rows].masked_fill(torch.stack([m for _, m in picked]), float("-inf"))


def apply_bans(logits: torch.Tensor, states: list[SequenceState]) -> None:
    """bad_words and the min_tokens mask: one scatter of -inf for the whole batch."""
    rows: list[int] = []
    ids: list[int] = []
    for row, state in enumerate(states):
        for word in state.rules.bad_words:
            if _ends_with(state.output, word[:-1]):
                rows.append(row)
                ids.append(word[-1])
        if state.rules.min_tokens_banned and len(state.output) < state.rules.sampling.min_tokens:
            rows.extend([row] * len(state.rules.min_tokens_banned))
            ids.extend(state.rules.min_tokens_banned)
    if rows:
        logits[rows, ids] = float("-inf")


def _ends_with(output: list[int], prefix: tuple[int, ...]) -> bool:
    """Whether ``output`` ends with ``prefix`` (O(len(prefix)), never O(len(output)))."""
    return len(prefix) <= len(output) and all(
        a == b for a, b in zip(output[len(output) - len(prefix) :], prefix, strict=True)
    )


def apply_logit_bias(logits: torch.Tensor, states: list[SequenceState]) -> None:
    """Add each row's ``logit_bias`` to its ids."""
    picked = [(i, r) for i, s in enumerate(states) if (r := s.rules).bias_ids is not None]
    if not picked:
        return
    ids = [r.bias_ids for _, r in picked if r.bias_ids is not None]
    values = [r.bias_values for _, r in picked if r.bias_values is not None]
    rows = torch.cat([torch.full((len(t),), i, dtype=torch.long) for (i, _), t in zip(picked, ids, strict=True)])
    logits.index_put_((rows, torch.cat(ids)), torch.cat(values), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SequenceState]) -> None:
    """Repetition (prompt + output), then frequency and presence (output only), on the penalized rows."""
    picked = [(i, s.rules, c) for i, s in enumerate(states) if (c := s.counts) is not None]
    if not picked:
        return
    rows = [i for i, _, _ in picked]
    counts = torch.stack([c for _, _, c in picked])
    in_output = counts > 0
    seen = torch.stack([r.prompt_mask for _, r, _ in picked if r.prompt_mask is not None]) | in_output

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[:, None]

    repetition = column([r.sampling.repetition_penalty for _, r, _ in picked])
    frequency = column([r.sampling.frequency_penalty for _, r, _ in picked])
    presence = column([r.sampling.presence_penalty for _, r, _ in picked])
    sub = logits[rows]
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    logits[rows] = sub - frequency * counts - presence * in_output


def draw(logits: torch.Tensor, states: list[SequenceState]) -> list[int]:
    """One token per row. Greedy rows take the argmax; the others draw from their own generator,
    one uniform per token, so a seeded sequence's tokens never depend on its batch."""
    tokens = [0] * len(states)
    greedy = [i for i, s in enumerate(states) if s.generator is None]
    if greedy:
        # max's indices, not argmax: the same first index of the largest value (NaN counted largest), and
        # a third of argmax's time over 152k ids on CPU.
        for i, token in zip(greedy, _rows_of(logits, greedy).max(-1).indices.tolist(), strict=True):
            tokens[i] = token
    for i, state in enumerate(states):
        if state.generator is not None:
            tokens[i] = sample_row(logits[i], state.rules.sampling, state.generator)
    return tokens


def sample_row(logits: torch.Tensor, sp: SequenceSampling, gen: torch.Generator) -> int:
    """vLLM's order: temperature; min-p drops what is below min_p x the top probability; top-k, then
    top-p over what top-k kept; then an inverse-CDF draw over what is left."""
    probs = torch.softmax(logits / sp.temperature, -1)
    if sp.min_p > 0.0:
        probs = torch.where(probs >= sp.min_p * probs.max(), probs, 0.0)
    values, ids = top_k_top_p(probs, sp.top_k, sp.top_p)
    cdf = values.cumsum(0)
    u = torch.rand((), generator=gen) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
    return int(ids[pick]) if ids is not None else pick


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` for ascending row indices; ``logits`` itself when they are every row, as indexing
    copies the rows out (0.5 ms for 8 rows of 152k ids)."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def largest_k(values: torch.Tensor, k: int, chunk: int = TOP_K_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(values, k)`` over the last dimension (largest first): the same values, bit for bit;
    among equal values the ids may be others.

    ``torch.topk`` on one CPU thread took 1.8 ms for k=20 over 8 rows of Qwen3's 152k ids, more than the
    log-softmax before it. A row's k largest lie in the k chunks with the largest maxima (a chunk holding
    one of them that was not picked would leave k picked chunks whose maxima are each at least as large),
    so one max per chunk, a top-k over those maxima and one over the k picked chunks give them: 0.38 ms
    for the same rows. Rows too short for that to pay go to ``torch.topk`` directly.
    """
    width = values.shape[-1]
    chunks = width // chunk
    if k == 0 or 4 * k > chunks:
        return torch.topk(values, k)
    lead = values.shape[:-1]
    rows = values.reshape(-1, width)
    body = rows[:, : chunks * chunk].reshape(rows.shape[0], chunks, chunk)
    picked = body.amax(-1).topk(k, -1).indices
    candidates = body.gather(1, picked[:, :, None].expand(-1, -1, chunk)).flatten(1)
    ids = (picked[:, :, None] * chunk + torch.arange(chunk)).flatten(1)
    if chunks * chunk < width:  # the tail that fills no chunk is always a candidate
        candidates = torch.cat([candidates, rows[:, chunks * chunk :]], 1)
        ids = torch.cat([ids, torch.arange(chunks * chunk, width).expand(rows.shape[0], -1)], 1)
    top_values, where = candidates.topk(k, -1)
    return top_values.reshape(*lead, k), ids.gather(1, where).reshape(*lead, k)


def top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (unnormalised) probabilities that top-k and top-p keep, best first, with their ids;
    ``ids`` is None when nothing is cut (then ``values`` is ``probs`` itself, in id order).

    top-p keeps the smallest best-first prefix holding ``top_p`` of the mass top-k left (the first
    token always stays), as vLLM does.
    """
    vocab = probs.shape[0]
    k = top_k if 0 < top_k < vocab else vocab
    if top_p >= 1.0:
        return (probs, None) if k == vocab else largest_k(probs, k)
    if k == vocab:
        mass = probs.sum()
        values, ids = largest_k(probs, min(TOP_P_CANDIDATES, vocab))
        if values.sum() < top_p * mass:  # the short list cannot reach top_p: sort it all
            values, ids = torch.sort(probs, descending=True)
    else:
        values, ids = largest_k(probs, k)
        mass = values.sum()
    keep = int(((values.cumsum(0) - values) < top_p * mass).sum())
    return values[:keep], ids[:keep]


@dataclass(frozen=True)
class RawLogprobs:
    """log-softmax of the rows that asked for logprobs, taken before any processing (vLLM's
    default ``raw_logprobs``), and how many top candidates each of them wants.

    The log-softmax is the row-wise kernel on purpose: a ``logsumexp`` normalizer would be cheaper, but
    its reduction order depends on the batch's shape, which ``--batch-invariant`` must not see.
    """

    num_rows: int
    rows: list[int]
    widths: list[int]
    logprobs: torch.Tensor | None

    @classmethod
    def of(cls, logits: torch.Tensor, ks: list[int | None]) -> RawLogprobs:
        vocab = logits.shape[-1]
        requested = [(i, vocab if k == -1 else min(k, vocab)) for i, k in enumerate(ks) if k is not None]
        rows, widths = [i for i, _ in requested], [k for _, k in requested]
        if not rows:
            return cls(len(ks), rows, widths, None)
        return cls(len(ks), rows, widths, torch.log_softmax(_rows_of(logits, rows), -1))

    def gather(self, tokens: list[int]) -> list[PositionLogprobs | None]:
        """Logprob and 1-based rank of each row's token plus the row's top-k (None for rows that asked none)."""
        result: list[PositionLogprobs | None] = [None] * self.num_rows
        if self.logprobs is None:
            return result
        chosen = torch.tensor([tokens[i] for i in self.rows])
        chosen_lp = self.logprobs.gather(1, chosen[:, None])
        top_values, top_ids = largest_k(self.logprobs, max(self.widths))
        ranks = (_ids_above(self.logprobs, chosen_lp, top_values) + 1).tolist()
        top_values, top_ids, chosen_list = top_values.tolist(), top_ids.tolist(), chosen_lp[:, 0].tolist()
        for j, (i, k) in enumerate(zip(self.rows, self.widths, strict=True)):
            result[i] = PositionLogprobs(
                token_ids=[tokens[i], *top_ids[j][:k]],
                logprobs=[chosen_list[j], *top_values[j][:k]],
                ranks=[ranks[j], *range(1, k + 1)],
            )
        return result


def _ids_above(logprobs: torch.Tensor, chosen: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
    """Per row, how many ids have a logprob strictly above the chosen one's.

    When the chosen value is at least the row's k-th largest, every id above it is in the top-k, so the
    count is read there (a greedy token always is); only when some row's token fell below (or nothing
    but the token was asked for) is the whole vocabulary compared: at 152k ids and 8 rows that pass was
    a third of a step's logprob cost.
    """
    if top_values.shape[-1] == 0:
        return _count_above(logprobs, chosen)
    above = _count_above(top_values, chosen)
    inside = chosen[:, 0] >= top_values[:, -1]
    if bool(inside.all()):
        return above
    return torch.where(inside, above, _count_above(logprobs, chosen))


def _count_above(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Per row, the values strictly above the row's chosen one (an int32 sum: a third faster than int64)."""
    return (values > chosen).sum(-1, dtype=torch.int32)


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]) -> list[PositionLogprobs | None]:
    """Logprob and 1-based rank of each row's given token plus the row's top-k (k = -1: whole vocab)."""
    return RawLogprobs.of(logits, ks).gather(tokens)

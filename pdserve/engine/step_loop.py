"""The torch step loop: admit + prefill, one decode step for every running sequence, postprocess.

The requests admitted in one step prefill together: their prompts run through the model in one
pass (each weight read once, attention per prompt) and their first tokens are sampled in one call.

Postprocessing turns each sampled token into an :class:`EngineOutput` and decides its finish
(EOS, stop ids, max_tokens, max_model_len); the scheduler (``scheduler.py``) decides who runs and
the sampler (``sampler.py``) picks the tokens. Commands and steps add to one
:class:`~pdserve.engine.messages.StepOutputs` that the driver takes once per step.

Chunked prefill: a step computes at most ``max_num_batched_tokens`` tokens, the running
sequences' decode rows first; what is left goes to the chunk of the one prompt being prefilled
in chunks, then to whole waiting prompts that fit. A prompt longer than what is left is prefilled
in chunks over the next steps, into the slot it will run in (reserved meanwhile); the streams already
running keep their pace meanwhile.

A step reads as nano-vllm's: schedule (admit) → run the model (prefill, decode) → sample →
route the outputs (finish reasons, retire). The P/D KV hand-off is hooks at those seams
(:mod:`pdserve.engine.kv.hooks`): with ``--kv-transfer`` a prefill leg's prompt KV is exported
when it finishes (its slot held under a lease until the pull), and a decode leg enters the scheduler
only once its KV has been pulled into a slot it holds: it then runs in that slot, and its first decode
step computes the last prompt token, as vLLM's decode side does.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from pdserve.engine.api import EngineError
from pdserve.engine.kv.handoff import KVHandoff, Slots
from pdserve.engine.kv.hooks import KVHandoffHooks, NoKVHandoff
from pdserve.engine.kv.prefix_cache import PrefixCache, block_hashes
from pdserve.engine.messages import RequestFailed, StepOutputs
from pdserve.engine.models import KVCache, LlamaForCausalLM
from pdserve.engine.models.llama import PromptChunk
from pdserve.engine.request_ids import matching
from pdserve.engine.sampler import GREEDY_TEMPERATURE, SequenceState, request_rules, sample, token_logprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequences import ScheduledRequest, ScheduledSequence
from pdserve.protocol.engine import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PositionLogprobs,
    SequenceSampling,
)

# Rows of prompt logits materialised at once for prompt_logprobs.
PROMPT_LOGPROBS_CHUNK = 256
# While sequences decode, a prompt chunk's attention reads at most ``max_num_batched_tokens`` times this many key
# rows (rows times the keys each reads): as if each token of a full budget attended this many positions...
CHUNK_ATTENTION_SPAN = 1024
# ... but a chunk is not cut below the model's ``chunk_min_rows`` (128 where SDPA attends it, 8 in pdserve's kernel):
# a step has a fixed cost (the weights pass, the decode rows, a read of the chunk's keys), so smaller cuts only add
# steps to the prompt's TTFT without shortening the streams' gaps much (pdserve bench interference, docs/engine.md).


def chunk_rows_within(computed: int, key_rows: int) -> int:
    """The most rows ``c`` (at least 1) of a prompt chunk after ``computed`` cached positions whose attention
    reads at most ``key_rows`` keys in all, ``c * (computed + c)`` (each row reads the keys before it and its own
    chunk's, rounded up to the whole chunk)."""
    rows = (math.isqrt(computed * computed + 4 * key_rows) - computed) // 2
    return max(1, rows)


# Builds an engine's KV hand-off over its cache (registered with NIXL as it is) and its scheduler's slots.
KVHandoffFactory = Callable[[KVCache, Slots], KVHandoff]


@dataclass(eq=False)
class ChunkedPrefill:
    """The one request whose prompt is prefilled in chunks: how far it got, and its prompt logprobs so far."""

    request: ScheduledRequest
    computed: int = 0
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.request.prompt_len - self.computed


class StepLoop:
    """Scheduler + model + sampler behind the :class:`~pdserve.engine.stepping.StepCore` contract.

    Every method runs on the one thread that loaded the model (see ``runners/torch_runner.py``).
    """

    pace_s = 0.0  # a model step is its own pace

    def __init__(
        self, model: LlamaForCausalLM, info: EngineInfo, seed: int, kv: KVHandoffFactory | None = None,
        prefix_cache: PrefixCache | None = None, handoff_slots: int = 0,
    ) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
        self.info = info
        self.max_model_len = info.max_model_len
        # TorchSetup sets it, at least max_num_seqs: every running sequence decodes a token each step.
        assert info.max_num_batched_tokens is not None
        self.max_batched_tokens = info.max_num_batched_tokens
        self.primary_eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self.eos_ids = frozenset(info.eos_token_ids)
        # One slot per running sequence (a prompt prefilled in chunks runs into its reserved slot), and those a KV
        # hand-off holds beside them (a prefill leg's KV until its pull, a decode leg's pull before it runs).
        num_slots = info.max_num_seqs + handoff_slots
        self.cache = KVCache(model.cfg, num_slots, info.max_model_len, model.dtype)
        self.scheduler: Scheduler[ScheduledRequest, ScheduledSequence] = Scheduler(info.max_num_seqs, num_slots)
        self.chunked: ChunkedPrefill | None = None
        self.requests: dict[str, ScheduledRequest] = {}
        self._seed_source = random.Random(seed)
        self._out = StepOutputs()
        self.kv: KVHandoffHooks | NoKVHandoff = (
            KVHandoffHooks(kv(self.cache, self.scheduler), self.scheduler, self.cache, self._fail)
            if kv is not None else NoKVHandoff()
        )
        self._prompt_tokens_computed = 0
        self._steps = 0

    # -- commands ------------------------------------------------------------------------

    def validate(self, request: EngineRequest) -> None:
        """Reject what would break a step (bad ids, impossible lengths) before it reaches the loop."""
        sp, prompt = request.sampling, request.prompt_token_ids
        vocab, max_len, max_seqs = self.info.vocab_size, self.info.max_model_len, self.info.max_num_seqs
        problems = []
        if not prompt:
            problems.append("prompt_token_ids is empty")
        elif min(prompt) < 0 or max(prompt) >= vocab:
            problems.append(f"prompt token ids must be in [0, {vocab})")
        elif len(prompt) >= max_len:
            problems.append(f"prompt has {len(prompt)} tokens; max_model_len {max_len} leaves no room to generate")
        if not 1 <= sp.n <= max_seqs:
            problems.append(f"n must be between 1 and max_num_seqs ({max_seqs})")
        if sp.max_tokens < 1:
            problems.append("max_tokens must be at least 1")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or not 0 <= sp.min_p <= 1:
            problems.append("need temperature >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1")
        for name, k in (("logprobs", sp.logprobs), ("prompt_logprobs", sp.prompt_logprobs)):
            if k is not None and k < -1:
                problems.append(f"{name} must be -1 (whole vocabulary), 0 or more")
        if any(not 0 <= t < vocab for t in sp.stop_token_ids):
            problems.append(f"stop_token_ids must be in [0, {vocab})")
        problems.extend(sp.logits_problems(vocab))
        problems.extend(self.kv.problems(request))
        if problems:
            raise EngineError(f"invalid request {request.request_id!r}: " + "; ".join(problems))

    def add(self, request: EngineRequest) -> None:
        sp = request.sampling
        req = ScheduledRequest(request.request_id, list(request.prompt_token_ids), sp, frozenset(sp.stop_token_ids),
                               cache_salt=request.cache_salt)
        if self.prefix_cache is not None:
            req.prefix_keys = block_hashes(req.prompt, self.prefix_cache.block_size, request.cache_salt)
            # Prompt logprobs score every prompt position, so their request computes its whole prompt.
            req.reads_prefix_cache = not request.skip_reading_prefix_cache and sp.prompt_logprobs is None
        vocab = self.model.cfg.vocab_size
        rules = request_rules(sp, req.prompt, vocab, self.eos_ids)
        prior = req.prompt[len(req.prompt) - request.prior_output_tokens :] if request.prior_output_tokens else None
        for i in range(sp.n):
            state = SequenceState(rules, self._generator(sp, i), vocab, prior)
            req.sequences.append(ScheduledSequence(req, i, state))
        self.requests[req.request_id] = req
        if not self.kv.on_add(req, request.kv):  # a P/D leg may wait for its KV blocks first
            self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str], cause: str | None) -> None:
        for rid in matching(request_ids, list(self.requests)):
            req = self.requests[rid]
            self.scheduler.remove_waiting(rid)
            for seq in [s for s in req.sequences if s.live]:
                self._emit(EngineOutput(request_id=rid, index=seq.index, finish_reason="abort", abort_cause=cause))
                self._retire(seq)

    def stop_sequence(self, request_id: str, index: int) -> None:
        req = self.requests.get(request_id)
        if req is not None and 0 <= index < len(req.sequences) and req.sequences[index].live:
            seq = req.sequences[index]
            if seq.slot < 0:  # still waiting: it will never run, but its siblings may
                seq.live = False
                self._finish_request_if_done(req)
            else:
                self._retire(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.chunked is not None or self.kv.pending()

    def poll(self) -> None:
        """Between steps, working or idle: free pulled and expired leases, admit prefill legs that fit now."""
        self.kv.poll()

    def stats(self) -> EngineStats:
        running = {s.request.request_id for s in self.scheduler.running}
        if self.chunked is not None:
            running.add(self.chunked.request.request_id)
        return EngineStats(
            running_requests=len(running),
            waiting_requests=len(self.scheduler.waiting),
            running_sequences=len(self.scheduler.running),
            prompt_tokens_computed=self._prompt_tokens_computed,
            prefix_cache_queries=self.prefix_cache.stats.queries if self.prefix_cache is not None else None,
            prefix_cache_hits=self.prefix_cache.stats.hits if self.prefix_cache is not None else None,
            kv=self.kv.stats(),
        )

    # -- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        self._steps += 1
        self.kv.before_step()
        budget = self.max_batched_tokens - len(self.scheduler.running)  # the running sequences' decode rows first
        chunk = self._chunk_size(budget, self.chunked) if self.chunked is not None else 0
        budget -= chunk
        admitted = self.scheduler.admit(budget, self._prompt_cost)
        if admitted:
            budget -= sum(map(self._prompt_cost, admitted))
            self._prefill(admitted)
        if self.chunked is None and budget > 0 and self.scheduler.waiting and self._prompt_cost(self.scheduler.waiting[0]) > budget:
            req = self.scheduler.start_chunked()
            if req is not None:
                req.scheduled_at = time.monotonic()
                self.chunked = ChunkedPrefill(req, computed=self._load_prefix(req, self.scheduler.reserved[0]))
                chunk = self._chunk_size(budget, self.chunked)
        self._decode(chunk)

    def _chunk_size(self, budget: int, chunked: ChunkedPrefill) -> int:
        """The next chunk of the prompt prefilled in chunks: what is left of the step's token budget and of the
        prompt, and, while sequences decode beside it, no more rows (down to the model's ``chunk_min_rows``) than
        keep its attention within :data:`CHUNK_ATTENTION_SPAN` key rows per budget token: a late chunk of a long
        prompt reads every key before it (without the cap, at the default budget of 2,048, the second chunk of a
        4,096-token prompt held 8 streams for 1.5 s; with it, 0.53 s)."""
        size = min(budget, chunked.remaining)
        if not self.scheduler.running:
            return size
        key_rows = self.max_batched_tokens * CHUNK_ATTENTION_SPAN
        return min(size, max(self.model.chunk_min_rows, chunk_rows_within(chunked.computed, key_rows)))

    def _prompt_cost(self, req: ScheduledRequest) -> int:
        """Prompt tokens a request's admission computes: none for a decode leg whose KV was pulled, those past
        its cached prefix for the others."""
        return 0 if self.kv.pulled(req) else req.prompt_len - self._cached_prefix(req)

    def _cached_prefix(self, req: ScheduledRequest) -> int:
        """Leading prompt positions the prefix cache holds for ``req`` now (whole blocks)."""
        if self.prefix_cache is None or not req.reads_prefix_cache:
            return 0
        return self.prefix_cache.hit_blocks(req.prefix_keys, req.prompt_len) * self.prefix_cache.block_size

    def _load_prefix(self, req: ScheduledRequest, slot: int) -> int:
        """Copy ``req``'s cached prefix into ``slot``; the positions it covers (the model starts there)."""
        cache = self.prefix_cache
        if cache is None or not req.reads_prefix_cache:
            return 0
        req.cached_tokens = cache.load(req.prefix_keys[: self._cached_prefix(req) // cache.block_size], self.cache, slot)
        cache.count_lookup(req.prompt_len, req.cached_tokens)
        return req.cached_tokens

    def _keep_prefix(self, req: ScheduledRequest, slot: int) -> None:
        """Offer the full blocks of a computed prompt (in ``slot``) to the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(req.prefix_keys, self.cache, slot, req.prompt_len)

    def take_outputs(self) -> StepOutputs:
        out, self._out = self._out, StepOutputs()
        return out

    def _prefill(self, admitted: list[ScheduledRequest]) -> None:
        """Place the admitted requests' sequences, then compute their prompts in one pass, each past its cached
        prefix (pulled ones load theirs)."""
        computed: list[tuple[ScheduledRequest, list[ScheduledSequence], int]] = []
        for req in admitted:
            req.scheduled_at = time.monotonic()
            live = [s for s in req.sequences if s.live]  # stop_sequence may have dropped some while waiting
            for i, seq in enumerate(live):  # a pulled decode leg's first sequence runs where its KV landed
                self.scheduler.place(seq, req.held_slot if i == 0 else None)
            if not self.kv.load_prompt(req, live):  # a pulled decode leg's KV is there already
                computed.append((req, live, self._load_prefix(req, live[0].slot)))
        if computed:
            self._compute_prompts(computed)

    def _after_chunk(self, hidden: torch.Tensor, size: int) -> None:
        """The next ``size`` positions of the prompt being prefilled in chunks ran (``hidden``, into its first
        reserved slot); after its last chunk the request is placed and samples its first tokens."""
        chunk = self.chunked
        assert chunk is not None
        req, start = chunk.request, chunk.computed
        self._prompt_tokens_computed += size
        if req.sampling.prompt_logprobs is not None:
            chunk.prompt_logprobs += self._prompt_logprobs(req, hidden, start)
        chunk.computed += size
        if chunk.remaining:
            return
        self.chunked = None
        computed_in = self.scheduler.reserved[0]
        self._keep_prefix(req, computed_in)
        live = [s for s in req.sequences if s.live]
        # The first live sequence runs in the slot the chunks ran into; its siblings get copies.
        for seq, slot in zip(live, self.scheduler.reserved[: len(live)], strict=False):
            self.scheduler.place(seq, slot)
            if slot != computed_in:
                self.cache.copy_slot(computed_in, slot, req.prompt_len)
            seq.num_cached = req.prompt_len
            seq.prefilled_in_step = self._steps
        self.scheduler.unreserve()  # the slots of siblings stopped while it ran
        logits = self.model.logits(hidden[-1:])
        prompt_logprobs = {req: chunk.prompt_logprobs} if req.sampling.prompt_logprobs is not None else {}
        self._sample_and_emit(live, logits.expand(len(live), -1), prompt_logprobs)

    def _compute_prompts(self, batch: list[tuple[ScheduledRequest, list[ScheduledSequence], int]]) -> None:
        """Prefill the prompts together, each from its start (past its cached prefix) into its first live
        sequence's slot, copied to the others, and sample every sequence's first token in one call."""
        starts = [start for _, _, start in batch]
        lengths = [req.prompt_len - start for req, _, start in batch]
        self._prompt_tokens_computed += sum(lengths)
        tokens = torch.tensor([t for req, _, start in batch for t in req.prompt[start:]], dtype=torch.long)
        slots = [live[0].slot for _, live, _ in batch]
        hidden = self.model.prefill_batch(tokens, lengths, slots, self.cache, starts)
        last_rows = torch.tensor(lengths).cumsum(0) - 1
        last_logits = self.model.logits(hidden[last_rows])
        seqs: list[ScheduledSequence] = []
        logit_rows: list[int] = []
        prompt_logprobs: dict[ScheduledRequest, list[PositionLogprobs | None]] = {}
        for row, ((req, live, _), prompt_hidden) in enumerate(zip(batch, hidden.split(lengths), strict=True)):
            self._keep_prefix(req, live[0].slot)
            for seq in live[1:]:
                self.cache.copy_slot(live[0].slot, seq.slot, req.prompt_len)
            if req.sampling.prompt_logprobs is not None:
                prompt_logprobs[req] = self._prompt_logprobs(req, prompt_hidden)
            for seq in live:
                seq.num_cached = req.prompt_len
                seq.prefilled_in_step = self._steps
            seqs.extend(live)
            logit_rows.extend([row] * len(live))
        self._sample_and_emit(seqs, last_logits[logit_rows], prompt_logprobs)

    def _decode(self, chunk: int) -> None:
        """One decode row per running sequence and, when ``chunk``, the next ``chunk`` positions of the prompt
        being prefilled in chunks: one pass through the weights for both (:meth:`LlamaForCausalLM.step`).

        Sequences whose prefill sampled their first token in this step decode from the next step: their first
        token goes out at the end of this one without waiting for a decode pass. The rows go in slot order, so
        that runs of consecutive slots are attended as views of the cache."""
        running = sorted((s for s in self.scheduler.running if s.prefilled_in_step != self._steps), key=lambda s: s.slot)
        if not running and not chunk:
            return
        # A pulled decode leg has no output yet: its first step runs the last prompt token.
        tokens = torch.tensor([s.output[-1] if s.output else s.request.prompt[-1] for s in running], dtype=torch.long)
        positions = torch.tensor([s.num_cached for s in running], dtype=torch.long)
        slots = torch.tensor([s.slot for s in running], dtype=torch.long)
        prompt_chunk = None
        if chunk:
            assert self.chunked is not None
            start = self.chunked.computed
            ids = torch.tensor(self.chunked.request.prompt[start : start + chunk], dtype=torch.long)
            prompt_chunk = PromptChunk(ids, start, self.scheduler.reserved[0])
        hidden, chunk_hidden = self.model.step(tokens, positions, slots, prompt_chunk, self.cache)
        for seq in running:
            seq.num_cached += 1
        self.kv.after_decode(running)
        if running:
            self._sample_and_emit(running, self.model.logits(hidden), {})
        if chunk_hidden is not None:
            self._after_chunk(chunk_hidden, chunk)

    def _sample_and_emit(
        self,
        seqs: list[ScheduledSequence],
        logits: torch.Tensor,
        prompt_logprobs: Mapping[ScheduledRequest, list[PositionLogprobs | None]],
    ) -> None:
        """Sample one token per row of ``logits`` (one row per sequence), emit it and retire what finished.

        ``prompt_logprobs`` go out with the first token of the sequence of index 0 of their request.
        """
        tokens, logprobs = sample(logits, [s.state for s in seqs])
        finished: list[tuple[ScheduledSequence, bool]] = []
        for row, seq in enumerate(seqs):
            token = tokens[row]
            finish, reason = self._finish_reason(seq, token)
            kv_params = self.kv.on_finish(seq, finish) if finish is not None else None
            first = len(seq.output) == 1
            pull = seq.request.kv_pull if first else None
            self._emit(
                EngineOutput(
                    request_id=seq.request.request_id,
                    index=seq.index,
                    new_token_ids=[token],
                    new_logprobs=None if logprobs[row] is None else [logprobs[row]],
                    prompt_logprobs=prompt_logprobs.get(seq.request) if seq.index == 0 else None,
                    finish_reason=finish,
                    stop_reason=reason,
                    kv_transfer_params=kv_params,
                    scheduled_at=seq.request.scheduled_at if first else None,
                    num_cached_tokens=seq.request.cached_tokens if first else 0,
                    kv_pull_seconds=pull[0] if pull is not None else None,
                    kv_pull_bytes=pull[1] if pull is not None else None,
                )
            )
            if finish is not None:
                finished.append((seq, kv_params is not None))
        for seq, exported in finished:
            self._retire(seq, keep_slot=exported)  # an exported prefill leg's KV waits in its slot for the pull

    def _finish_reason(self, seq: ScheduledSequence, token: int) -> tuple[str | None, int | None]:
        sp, req = seq.request.sampling, seq.request
        if not sp.ignore_eos and token in self.eos_ids:
            return "stop", None if token == self.primary_eos else token
        if token in req.stop_ids:
            return "stop", token
        if len(seq.output) >= sp.max_tokens or req.prompt_len + len(seq.output) >= self.max_model_len:
            return "length", None
        return None, None

    def _prompt_logprobs(
        self, req: ScheduledRequest, hidden: torch.Tensor, offset: int = 0
    ) -> list[PositionLogprobs | None]:
        """The prompt logprobs ``hidden`` (the prompt's rows from position ``offset``) gives: each row scores
        the next prompt token; position 0 has none."""
        k = req.sampling.prompt_logprobs
        result: list[PositionLogprobs | None] = [None] if offset == 0 else []
        last = min(offset + hidden.shape[0], req.prompt_len - 1)  # the prompt's last row scores no prompt token
        for start in range(offset, last, PROMPT_LOGPROBS_CHUNK):
            end = min(start + PROMPT_LOGPROBS_CHUNK, last)
            logits = self.model.logits(hidden[start - offset : end - offset])
            result.extend(token_logprobs(logits, req.prompt[start + 1 : end + 1], [k] * (end - start)))
        return result

    # -- bookkeeping -----------------------------------------------------------------------

    def _generator(self, sp: SequenceSampling, index: int) -> torch.Generator | None:
        if sp.temperature < GREEDY_TEMPERATURE:
            return None
        seed = sp.seed + index if sp.seed is not None else self._seed_source.getrandbits(63)
        return torch.Generator().manual_seed(seed)

    def _retire(self, seq: ScheduledSequence, keep_slot: bool = False) -> None:
        """A sequence is over (finished, aborted or stopped): free its slot, or hold it (``keep_slot``: a prefill
        leg's exported KV is there, under a lease); end the request after its last one."""
        seq.live = False
        if seq.slot >= 0:
            if self.prefix_cache is not None:  # its output's full blocks too: a next turn's prompt holds them
                req = seq.request
                keys = block_hashes(req.prompt + seq.output, self.prefix_cache.block_size, req.cache_salt, req.prefix_keys)
                self.prefix_cache.store(keys, self.cache, seq.slot, seq.num_cached)
            if keep_slot:
                self.scheduler.hold(seq)
            else:
                self.scheduler.release(seq)
        self._finish_request_if_done(seq.request)

    def _finish_request_if_done(self, req: ScheduledRequest) -> None:
        if not any(s.live for s in req.sequences) and self.requests.pop(req.request_id, None) is not None:
            self.scheduler.remove_waiting(req.request_id)
            if self.chunked is not None and self.chunked.request is req:  # aborted or stopped mid-prefill
                self.chunked = None
                self.scheduler.unreserve()
            self.kv.forget(req)
            self._out.finished.append(req.request_id)

    def _fail(self, req: ScheduledRequest, message: str, kind: str) -> None:
        """End a request that has not run with an error (a failed KV pull): nothing else is emitted for it."""
        for seq in req.sequences:
            seq.live = False
        self.requests.pop(req.request_id, None)
        self._out.failed.append(RequestFailed(req.request_id, message, kind=kind))

    def _emit(self, output: EngineOutput) -> None:
        self._out.outputs.append(output)

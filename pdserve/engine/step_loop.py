"""The torch step loop: admit + prefill, one decode step for every running sequence, postprocess.

Postprocessing turns each sampled token into an :class:`EngineOutput` and decides its finish
(EOS, stop ids, max_tokens, max_model_len); the scheduler (``scheduler.py``) decides who runs and
the sampler (``sampler.py``) picks the tokens. Commands and steps add to one
:class:`~pdserve.engine.messages.StepOutputs` that the driver takes once per step.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch

from pdserve.engine.api import EngineError
from pdserve.engine.messages import StepOutputs
from pdserve.engine.models import KVCache, LlamaForCausalLM
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

# Prompt tokens prefilled in one step beyond the first admitted request.
MAX_PREFILL_TOKENS = 2048
# Rows of prompt logits materialised at once for prompt_logprobs.
PROMPT_LOGPROBS_CHUNK = 256


class StepLoop:
    """Scheduler + model + sampler behind the :class:`~pdserve.engine.stepping.StepCore` contract.

    Every method runs on the one thread that loaded the model (see ``runners/torch_runner.py``).
    """

    pace_s = 0.0  # a model step is its own pace

    def __init__(self, model: LlamaForCausalLM, info: EngineInfo, seed: int) -> None:
        self.model = model
        self.info = info
        self.max_model_len = info.max_model_len
        self.primary_eos = info.eos_token_ids[0] if info.eos_token_ids else None
        self.eos_ids = frozenset(info.eos_token_ids)
        self.cache = KVCache(model.cfg, info.max_num_seqs, info.max_model_len, model.dtype)
        self.scheduler: Scheduler[ScheduledRequest, ScheduledSequence] = Scheduler(info.max_num_seqs, MAX_PREFILL_TOKENS)
        self.requests: dict[str, ScheduledRequest] = {}
        self._seed_source = random.Random(seed)
        self._out = StepOutputs()

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
        if problems:
            raise EngineError(f"invalid request {request.request_id!r}: " + "; ".join(problems))

    def add(self, request: EngineRequest) -> None:
        sp = request.sampling
        req = ScheduledRequest(request.request_id, list(request.prompt_token_ids), sp, frozenset(sp.stop_token_ids))
        vocab = self.model.cfg.vocab_size
        rules = request_rules(sp, req.prompt, vocab, self.eos_ids)
        for i in range(sp.n):
            req.sequences.append(ScheduledSequence(req, i, SequenceState(rules, self._generator(sp, i), vocab)))
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self.scheduler.remove_waiting(rid)
            for seq in sorted((s for s in req.sequences if s.live), key=lambda s: -s.slot):
                self._emit(EngineOutput(request_id=rid, index=seq.index, finish_reason="abort"))
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
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        running = {s.request.request_id for s in self.scheduler.running}
        return EngineStats(
            running_requests=len(running),
            waiting_requests=len(self.scheduler.waiting),
            running_sequences=len(self.scheduler.running),
        )

    # -- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        for req in self.scheduler.admit():
            self._prefill(req)
        if self.scheduler.running:
            self._decode()

    def take_outputs(self) -> StepOutputs:
        out, self._out = self._out, StepOutputs()
        return out

    def _prefill(self, req: ScheduledRequest) -> None:
        live = [s for s in req.sequences if s.live]  # stop_sequence may have dropped some while waiting
        for seq in live:
            self.scheduler.place(seq)
        prompt = torch.tensor(req.prompt, dtype=torch.long)
        hidden = self.model.prefill(prompt, self.cache, live[0].slot)
        for seq in live[1:]:
            self.cache.copy_slot(live[0].slot, seq.slot, req.prompt_len)
        prompt_logprobs = self._prompt_logprobs(req, hidden) if req.sampling.prompt_logprobs is not None else None
        logits = self.model.logits(hidden[-1:]).expand(len(live), -1).contiguous()
        for seq in live:
            seq.num_cached = req.prompt_len
        self._sample_and_emit(live, logits, prompt_logprobs)

    def _decode(self) -> None:
        running = list(self.scheduler.running)
        tokens = torch.tensor([s.output[-1] for s in running], dtype=torch.long)
        positions = torch.tensor([s.num_cached for s in running], dtype=torch.long)
        hidden = self.model.decode(tokens, positions, self.cache)
        for seq in running:
            seq.num_cached += 1
        self._sample_and_emit(running, self.model.logits(hidden), None)

    def _sample_and_emit(
        self, seqs: list[ScheduledSequence], logits: torch.Tensor, prompt_logprobs: list[PositionLogprobs | None] | None
    ) -> None:
        tokens, logprobs = sample(logits, [s.state for s in seqs])
        finished: list[ScheduledSequence] = []
        for row, seq in enumerate(seqs):
            token = tokens[row]
            finish, reason = self._finish_reason(seq, token)
            self._emit(
                EngineOutput(
                    request_id=seq.request.request_id,
                    index=seq.index,
                    new_token_ids=[token],
                    new_logprobs=None if logprobs[row] is None else [logprobs[row]],
                    prompt_logprobs=prompt_logprobs if seq.index == 0 else None,
                    finish_reason=finish,
                    stop_reason=reason,
                )
            )
            if finish is not None:
                finished.append(seq)
        for seq in sorted(finished, key=lambda s: -s.slot):
            self._retire(seq)

    def _finish_reason(self, seq: ScheduledSequence, token: int) -> tuple[str | None, int | None]:
        sp, req = seq.request.sampling, seq.request
        if not sp.ignore_eos and token in self.eos_ids:
            return "stop", None if token == self.primary_eos else token
        if token in req.stop_ids:
            return "stop", token
        if len(seq.output) >= sp.max_tokens or req.prompt_len + len(seq.output) >= self.max_model_len:
            return "length", None
        return None, None

    def _prompt_logprobs(self, req: ScheduledRequest, hidden: torch.Tensor) -> list[PositionLogprobs | None]:
        k = req.sampling.prompt_logprobs
        result: list[PositionLogprobs | None] = [None]
        for start in range(0, req.prompt_len - 1, PROMPT_LOGPROBS_CHUNK):
            end = min(start + PROMPT_LOGPROBS_CHUNK, req.prompt_len - 1)
            logits = self.model.logits(hidden[start:end])
            result.extend(token_logprobs(logits, req.prompt[start + 1 : end + 1], [k] * (end - start)))
        return result

    # -- bookkeeping -----------------------------------------------------------------------

    def _generator(self, sp: SequenceSampling, index: int) -> torch.Generator | None:
        if sp.temperature < GREEDY_TEMPERATURE:
            return None
        seed = sp.seed + index if sp.seed is not None else self._seed_source.getrandbits(63)
        return torch.Generator().manual_seed(seed)

    def _retire(self, seq: ScheduledSequence) -> None:
        """A sequence is over (finished, aborted or stopped): free its slot; end the request after its last one."""
        seq.live = False
        if seq.slot >= 0:
            move = self.scheduler.release(seq)
            if move is not None:
                moved = self.scheduler.running[move.dst]
                self.cache.copy_slot(move.src, move.dst, moved.num_cached)
        self._finish_request_if_done(seq.request)

    def _finish_request_if_done(self, req: ScheduledRequest) -> None:
        if not any(s.live for s in req.sequences) and self.requests.pop(req.request_id, None) is not None:
            self.scheduler.remove_waiting(req.request_id)
            self._out.finished.append(req.request_id)

    def _emit(self, output: EngineOutput) -> None:
        self._out.outputs.append(output)

"""The scripted engine: replays token scripts at a fixed pace.

Used by tests and benchmarks where the *frontend* is under test: output is known
in advance, arrives ``tokens_per_step`` ids every ``step_ms`` milliseconds, and
honours every engine-side sampling rule (max/min tokens, stop token ids, EOS,
ignore_eos, n, abort) plus seeded pseudo logprobs. A script ends with EOS; while
``min_tokens`` (or ``ignore_eos``) forbids that, the script is replayed from its
start and EOS comes at the end of the first pass that is allowed to end.
The hard constraints hold as in a model engine: an id that ``allowed_token_ids`` leaves out or
``bad_words_token_ids`` bans at that point is skipped (the replay moves on to the next id, EOS
included); when a whole pass offers nothing allowed, the lowest allowed id is emitted. The penalties
and ``logit_bias`` only shift a distribution, and a script has none: they are validated, then have
no effect. Scripts are token ids
(:class:`~pdserve.engine.spec.TokenScript`; the serve layer reads and encodes the JSONL file),
chosen round-robin per request unless ``sampling_params.extra_args.script_index``
picks one; ``extra_args.tokens_per_step`` sets one request's pace (the server's otherwise), so one server
can feed its parsers and streams one id at a time and several at once. A script may set ``fail_after``
to make the engine raise :class:`EngineError`
for its request after N tokens (for error-path tests). A resumed stream (``prior_output_tokens``)
continues its script after the ids it already produced, as a model continues its text.

:class:`ScriptedCore` holds the replay state behind the step-loop contract, so the one engine loop
(:mod:`pdserve.engine.core_server`) drives it like any step loop, a step every ``step_ms``: in the
engine core process, or on a thread of this process (``runners/scripted.ScriptedEngine``).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.api import EngineError
from pdserve.engine.messages import RequestFailed, StepOutputs
from pdserve.engine.request_ids import matching
from pdserve.engine.spec import EngineSpec, TokenScript
from pdserve.protocol.engine import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PositionLogprobs,
    SequenceSampling,
)

DEFAULT_MAX_MODEL_LEN = 32768


@dataclass
class _Sequence:
    index: int
    script: list[int]
    rng: random.Random
    produced: int = 0
    cursor: int = 0
    done: bool = False
    output: list[int] = field(default_factory=list)
    allowed: frozenset[int] | None = None  # allowed_token_ids as a set


def _banned(token: int, seq: _Sequence, sampling: SequenceSampling) -> bool:
    """Whether allowed_token_ids or bad_words_token_ids forbid ``token`` as the sequence's next id."""
    if seq.allowed is not None and token not in seq.allowed:
        return True
    out = seq.output
    for word in sampling.bad_words_token_ids or ():
        prefix = word[:-1]
        if word[-1] == token and len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
            return True
    return False


@dataclass
class ReplayingRequest:
    """One request being replayed: its script, sequences and how far it got."""

    request: EngineRequest
    script: TokenScript
    seqs: list[_Sequence]
    budget: int  # max_model_len minus the prompt
    tokens_per_step: int  # ids a step gives each sequence (extra_args.tokens_per_step, else the server's)
    aborted: bool = False
    abort_cause: str | None = None
    first: bool = True
    over: bool = False
    finished: set[int] = field(default_factory=set)


def spec_options(spec: EngineSpec) -> dict[str, Any]:
    """The :class:`ScriptedCore` keyword arguments an engine spec asks for."""
    if spec.vocab_size is None:
        raise ValueError("the scripted engine needs the vocab_size its scripts' ids come from")
    return {
        "vocab_size": spec.vocab_size,
        "eos_token_ids": spec.eos_token_ids,
        "tokens_per_step": spec.tokens_per_step,
        "step_ms": spec.step_ms,
        "max_model_len": spec.max_model_len or DEFAULT_MAX_MODEL_LEN,
        "max_num_seqs": spec.max_num_seqs,
        "model_name": spec.model or "scripted",
    }


class ScriptedCore:
    """The replay state of every running request, behind the step-loop contract (one thread only)."""

    def __init__(
        self,
        scripts: Sequence[TokenScript],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        tokens_per_step: int = 1,
        step_ms: float = 0.0,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = 16,
        model_name: str = "scripted",
    ) -> None:
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        if not scripts:
            raise ValueError("the scripted engine needs at least one script")
        if not eos_token_ids:
            raise ValueError("the scripted engine needs an EOS id (it ends scripts with it)")
        self._scripts = list(scripts)
        self._next_script = itertools.count()
        self._tokens_per_step = tokens_per_step
        self.pace_s = step_ms / 1000.0
        self._eos = list(eos_token_ids)
        self._live: dict[str, ReplayingRequest] = {}
        self._out = StepOutputs()
        self.info = EngineInfo(
            model_name=model_name,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            eos_token_ids=self._eos,
        )

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> ScriptedCore:
        return cls(spec.scripts, **spec_options(spec))

    # -- commands ------------------------------------------------------------------------

    def validate(self, request: EngineRequest) -> None:
        """Reject ids outside the vocabulary in the logits-processing params, as the torch engine does."""
        problems = request.sampling.logits_problems(self.info.vocab_size)
        if request.kv.any:
            problems.append("the scripted engine holds no KV cache to hand off; P/D needs --engine torch --kv-transfer nixl")
        if problems:
            raise EngineError(f"invalid request {request.request_id!r}: " + "; ".join(problems))

    def add(self, request: EngineRequest) -> None:
        """Pick the request's script (``extra_args.script_index``, else round robin) and track it."""
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.validate(request)
        sampling = request.sampling
        extra_args = request.extra_args or {}
        chosen = extra_args.get("script_index")
        if chosen is None:
            chosen = next(self._next_script)
        script = self._scripts[int(chosen) % len(self._scripts)]
        seed = sampling.seed if sampling.seed is not None else 0
        allowed = None if sampling.allowed_token_ids is None else frozenset(sampling.allowed_token_ids)
        # A resumed stream continues the script where its prior output left it.
        start = min(request.prior_output_tokens, len(script.token_ids))
        seqs = [_Sequence(i, script.token_ids, random.Random(seed + i), cursor=start, allowed=allowed)
                for i in range(sampling.n)]
        self._live[request.request_id] = ReplayingRequest(
            request, script, seqs, self.info.max_model_len - len(request.prompt_token_ids),
            extra_args.get("tokens_per_step") or self._tokens_per_step,
        )

    def abort(self, request_ids: list[str], cause: str | None) -> None:
        """Mark requests aborted: their next step ends each unfinished sequence with ``"abort"``."""
        for request_id in matching(request_ids, list(self._live)):
            live = self._live[request_id]
            live.aborted, live.abort_cause = True, cause

    def stop_sequence(self, request_id: str, index: int) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.finished.add(index)

    def has_work(self) -> bool:
        return bool(self._live)

    def poll(self) -> None:
        """Nothing to tend between steps: no KV."""

    def stats(self) -> EngineStats:
        running = sum(live.request.sampling.n - len(live.finished) for live in self._live.values())
        return EngineStats(running_requests=len(self._live), running_sequences=running)

    # -- stepping ------------------------------------------------------------------------

    def step(self) -> None:
        for request_id, live in list(self._live.items()):
            outputs, failure = self._advance(live)
            self._out.outputs.extend(outputs)
            if failure is not None:
                self._out.failed.append(RequestFailed(request_id, str(failure)))
            elif live.over:
                self._out.finished.append(request_id)
            if failure is not None or live.over:
                del self._live[request_id]

    def take_outputs(self) -> StepOutputs:
        out, self._out = self._out, StepOutputs()
        return out

    def _advance(self, live: ReplayingRequest) -> tuple[list[EngineOutput], EngineError | None]:
        """One step of one request: its outputs, and the error that ends it (a script's ``fail_after``).

        A request whose sequences are all done is ``over`` one step after its last output.
        """
        running = [s for s in live.seqs if not s.done and s.index not in live.finished]
        rid = live.request.request_id
        if live.aborted:
            live.over = True
            return [
                EngineOutput(request_id=rid, index=seq.index, finish_reason="abort", abort_cause=live.abort_cause)
                for seq in running
            ], None
        if not running:
            live.over = True
            return [], None
        sampling = live.request.sampling
        outputs: list[EngineOutput] = []
        now = time.monotonic()
        for seq in running:
            if live.script.fail_after is not None and seq.produced >= live.script.fail_after:
                return outputs, EngineError(f"scripted failure after {seq.produced} tokens")
            out = self._step(seq, live)
            if live.first:
                out.scheduled_at = now
            if live.first and sampling.prompt_logprobs is not None and seq.index == 0:
                out.prompt_logprobs = self._prompt_logprobs(live.request)
            if out.finished:
                live.finished.add(seq.index)
            outputs.append(out)
        live.first = False
        return outputs, None

    def _next_token(self, seq: _Sequence, sampling: SequenceSampling) -> tuple[int, str | None, int | str | None]:
        """The next id of a sequence and, if it ends there, (finish_reason, stop_reason)."""
        past_min = seq.produced + 1 > sampling.min_tokens
        for _ in range(len(seq.script) + 1):  # one replay pass at most, EOS included
            token = self._candidate(seq, sampling, past_min)
            if not _banned(token, seq, sampling):
                break
        else:
            token = self._fallback(seq, sampling)
        seq.output.append(token)
        if past_min:
            if token in self._eos and not sampling.ignore_eos:
                return token, "stop", None if token == self._eos[0] else token
            if token in sampling.stop_token_ids:
                return token, "stop", token
        return token, None, None

    def _candidate(self, seq: _Sequence, sampling: SequenceSampling, past_min: bool) -> int:
        """The script's next id; past its end EOS when the sequence may end, else the replay's first id."""
        if seq.cursor >= len(seq.script):
            seq.cursor = 0
            if past_min and not sampling.ignore_eos:
                return self._eos[0]
        token = seq.script[seq.cursor]
        seq.cursor += 1
        return token

    def _fallback(self, seq: _Sequence, sampling: SequenceSampling) -> int:
        """The lowest id the constraints allow here, for when a whole script pass offers none."""
        allowed = sampling.allowed_token_ids
        ids = sorted(allowed) if allowed is not None else range(self.info.vocab_size)
        for token in ids:
            if not _banned(token, seq, sampling):
                return token
        raise EngineError("allowed_token_ids and bad_words_token_ids leave no id to emit")

    def _pseudo_logprobs(self, rng: random.Random, token: int, k: int) -> PositionLogprobs:
        """Deterministic fake candidates: the sampled id ranked first, k-1 other ids below it."""
        k = max(k, 1)
        others = []
        while len(others) < k - 1:
            candidate = rng.randrange(self.info.vocab_size)
            if candidate != token and candidate not in others:
                others.append(candidate)
        top = -rng.random() * 0.5
        logprobs = [top] + [top - 1.0 - i - rng.random() for i in range(len(others))]
        return PositionLogprobs([token, *others], logprobs, list(range(1, len(others) + 2)))

    def _prompt_logprobs(self, request: EngineRequest) -> list[PositionLogprobs | None]:
        rng = random.Random((request.sampling.seed or 0) ^ 0x5EED)
        k = (request.sampling.prompt_logprobs or 0) + 1
        return [None] + [self._pseudo_logprobs(rng, t, k) for t in request.prompt_token_ids[1:]]

    def _step(self, seq: _Sequence, live: ReplayingRequest) -> EngineOutput:
        request, budget = live.request, live.budget
        sampling = request.sampling
        ids: list[int] = []
        finish: str | None = None
        stop_reason: int | str | None = None
        for _ in range(live.tokens_per_step):
            token, finish, stop_reason = self._next_token(seq, sampling)
            ids.append(token)
            seq.produced += 1
            if finish is None and (seq.produced >= sampling.max_tokens or seq.produced >= budget):
                finish = "length"
            if finish is not None:
                break
        seq.done = finish is not None
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = [self._pseudo_logprobs(seq.rng, t, sampling.logprobs + 1) for t in ids]
        return EngineOutput(
            request_id=request.request_id,
            index=seq.index,
            new_token_ids=ids,
            new_logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
        )

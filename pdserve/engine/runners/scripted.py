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
no effect. Scripts are JSONL lines,
``{"text": ...}`` (encoded with the server tokenizer) or ``{"token_ids": [...]}``,
chosen round-robin per request unless ``sampling_params.extra_args.script_index``
picks one. A line may add ``"fail_after": N`` to make the
engine raise :class:`EngineError` after N tokens (for error-path tests).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.api import (
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PositionLogprobs,
    SequenceSampling,
)

if TYPE_CHECKING:
    from pdserve.engine.factory import EngineSpec

DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(frozen=True)
class Script:
    token_ids: list[int]
    fail_after: int | None = None


def load_scripts(path: str | Path, encode: Callable[[str], list[int]]) -> list[Script]:
    """Read a JSONL script file (``encode`` turns text into ids)."""
    scripts = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        if "token_ids" in entry:
            ids = [int(i) for i in entry["token_ids"]]
        elif "text" in entry:
            ids = encode(entry["text"])
        else:
            raise ValueError(f"{path}:{line_no}: a script line needs 'text' or 'token_ids'")
        if not ids:
            raise ValueError(f"{path}:{line_no}: empty script")
        fail_after = entry.get("fail_after")
        scripts.append(Script(ids, None if fail_after is None else int(fail_after)))
    if not scripts:
        raise ValueError(f"{path}: no scripts")
    return scripts


@dataclass
class _Live:
    """Bookkeeping for one running request."""

    n: int
    aborted: bool = False
    finished: set[int] = field(default_factory=set)


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


class ScriptedEngine:
    """An in-process :class:`~pdserve.engine.api.Engine` that replays scripts."""

    def __init__(
        self,
        scripts: Sequence[Script],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        tokens_per_step: int = 1,
        step_ms: float = 0.0,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        max_num_seqs: int = 16,
        model_name: str = "scripted",
    ):
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        self._scripts = list(scripts)
        self._next_script = itertools.count()
        self._tokens_per_step = tokens_per_step
        self._step_s = step_ms / 1000.0
        self._eos = list(eos_token_ids)
        self._live: dict[str, _Live] = {}
        self._alive = False
        self.info = EngineInfo(
            model_name=model_name,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            eos_token_ids=self._eos,
        )

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> ScriptedEngine:
        from pdserve.text.tokenizer import Tokenizer

        if not spec.script:
            raise ValueError("the scripted engine needs --script FILE (JSONL of {'text': ...} or {'token_ids': [...]})")
        if not spec.tokenizer:
            raise ValueError("the scripted engine needs --tokenizer (e.g. qwen3)")
        tokenizer = Tokenizer.load(spec.tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {spec.tokenizer!r} has no eos_token; the scripted engine ends scripts with it")
        return cls(
            load_scripts(spec.script, tokenizer.encode),
            vocab_size=tokenizer.vocab_size,
            eos_token_ids=[tokenizer.eos_token_id],
            tokens_per_step=spec.tokens_per_step,
            step_ms=spec.step_ms,
            max_model_len=spec.max_model_len or DEFAULT_MAX_MODEL_LEN,
            max_num_seqs=spec.max_num_seqs,
            model_name=spec.model or "scripted",
        )

    async def start(self) -> None:
        self._alive = True

    async def shutdown(self) -> None:
        self._alive = False
        for live in self._live.values():
            live.aborted = True

    def is_healthy(self) -> bool:
        return self._alive

    def stats(self) -> EngineStats:
        running = sum(live.n - len(live.finished) for live in self._live.values())
        return EngineStats(running_requests=len(self._live), running_sequences=running)

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is not None:
                live.aborted = True

    async def stop_sequence(self, request_id: str, index: int) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.finished.add(index)

    # ------------------------------------------------------------------ generation

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

    def _step(self, seq: _Sequence, request: EngineRequest, budget: int) -> EngineOutput:
        sampling = request.sampling
        ids: list[int] = []
        finish: str | None = None
        stop_reason: int | str | None = None
        for _ in range(self._tokens_per_step):
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

    def _validate(self, request: EngineRequest) -> None:
        """Reject ids outside the vocabulary in the logits-processing params, as the torch engine does."""
        problems = request.sampling.logits_problems(self.info.vocab_size)
        if problems:
            raise EngineError(f"invalid request {request.request_id!r}: " + "; ".join(problems))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._alive:
            raise EngineDeadError("the scripted engine is not running")
        if request.request_id in self._live:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self._validate(request)
        sampling = request.sampling
        chosen = (request.extra_args or {}).get("script_index")
        if chosen is None:
            chosen = next(self._next_script)
        script = self._scripts[int(chosen) % len(self._scripts)]
        seed = sampling.seed if sampling.seed is not None else 0
        allowed = None if sampling.allowed_token_ids is None else frozenset(sampling.allowed_token_ids)
        seqs = [_Sequence(i, script.token_ids, random.Random(seed + i), allowed=allowed) for i in range(sampling.n)]
        budget = self.info.max_model_len - len(request.prompt_token_ids)
        live = _Live(n=sampling.n)
        self._live[request.request_id] = live
        try:
            first = True
            while True:
                # A plain sleep per step (an abort is seen at the next step): waiting on the abort
                # event with a timeout would cost a task and a timer per token.
                await asyncio.sleep(self._step_s)
                if not self._alive:
                    raise EngineDeadError("the scripted engine was shut down")
                running = [s for s in seqs if not s.done and s.index not in live.finished]
                if live.aborted:
                    for seq in running:
                        yield EngineOutput(request_id=request.request_id, index=seq.index, finish_reason="abort")
                    return
                if not running:
                    return
                for seq in running:
                    if script.fail_after is not None and seq.produced >= script.fail_after:
                        raise EngineError(f"scripted failure after {seq.produced} tokens")
                    out = self._step(seq, request, budget)
                    if first and sampling.prompt_logprobs is not None and seq.index == 0:
                        out.prompt_logprobs = self._prompt_logprobs(request)
                    if out.finished:
                        live.finished.add(seq.index)
                    yield out
                first = False
        finally:
            self._live.pop(request.request_id, None)

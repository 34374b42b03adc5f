"""The torch engine: real causal LMs on CPU behind the :class:`~pdserve.engine.api.Engine` protocol.

One background thread owns the model, the KV cache and the scheduler and runs the step
loop (admit + prefill, then one decode step for every running sequence). The asyncio
side only validates, enqueues commands and hands each request's outputs to its
iterator through an asyncio queue (``loop.call_soon_threadsafe``), so no model state is
ever touched from two threads. Torch ops release the GIL, so the event loop keeps
serving while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import random
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
from pdserve.engine.channels import DONE, OutputChannels
from pdserve.engine.factory import EngineSpec
from pdserve.engine.model_registry import model_display_name, resolve_model
from pdserve.engine.models import KVCache, LlamaForCausalLM, load_model, model_config
from pdserve.engine.sampler import GREEDY_TEMPERATURE, SequenceState, request_rules, sample, token_logprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.threads import configure_torch_threads

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Default context when --max-model-len is not given: the model's own, capped (the KV
# cache reserves address space for max_num_seqs * max_model_len positions).
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# Prompt tokens prefilled in one step beyond the first admitted request.
MAX_PREFILL_TOKENS = 2048
# Rows of prompt logits materialised at once for prompt_logprobs.
PROMPT_LOGPROBS_CHUNK = 256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the engine needs from a model dir before loading weights."""

    path: Path
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]  # primary first


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Vocab size, context and EOS ids from config.json + generation_config.json (primary EOS first)."""
    config = json.loads((model_dir / "config.json").read_text())
    cfg = model_config(config)
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}

    def ids(value: Any) -> list[int]:
        return [] if value is None else [int(v) for v in (value if isinstance(value, list) else [value])]

    eos: list[int] = []
    for candidate in ids(config.get("eos_token_id")) + ids(generation.get("eos_token_id")):
        if candidate not in eos:
            eos.append(candidate)
    return ModelFacts(model_dir, cfg.vocab_size, cfg.max_position_embeddings, eos)


# -- per-request state (engine thread only) ---------------------------------------------


@dataclass(eq=False)
class _Sequence:
    request: _Request
    index: int
    state: SequenceState  # what the sampler keeps per sequence: output ids, generator, penalty counts
    slot: int = -1
    num_cached: int = 0  # positions with keys/values in the cache
    live: bool = True

    @property
    def output(self) -> list[int]:
        return self.state.output


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SequenceSampling
    stop_ids: frozenset[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return self.sampling.n

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


class StepLoop:
    """Scheduler + model + sampler; every method runs on the engine thread.

    ``step()`` returns ``(request_id, item)`` pairs where ``item`` is an EngineOutput or
    ``DONE`` (that request will produce nothing more).
    """

    def __init__(
        self, model: LlamaForCausalLM, facts: ModelFacts, max_model_len: int, max_num_seqs: int, seed: int
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.primary_eos = facts.eos_token_ids[0] if facts.eos_token_ids else None
        self.eos_ids = frozenset(facts.eos_token_ids)
        self.cache = KVCache(model.cfg, max_num_seqs, max_model_len, model.dtype)
        self.scheduler: Scheduler[_Request, _Sequence] = Scheduler(max_num_seqs, MAX_PREFILL_TOKENS)
        self.requests: dict[str, _Request] = {}
        self._seed_source = random.Random(seed)
        self._out: list[tuple[str, Any]] = []

    # -- commands ------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        sp = request.sampling
        req = _Request(request.request_id, list(request.prompt_token_ids), sp, frozenset(sp.stop_token_ids))
        vocab = self.model.cfg.vocab_size
        rules = request_rules(sp, req.prompt, vocab, self.eos_ids)
        for i in range(sp.n):
            req.sequences.append(_Sequence(req, i, SequenceState(rules, self._generator(sp, i), vocab)))
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_ids: Iterable[str]) -> list[tuple[str, Any]]:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self.scheduler.remove_waiting(rid)
            for seq in sorted((s for s in req.sequences if s.live), key=lambda s: -s.slot):
                self._emit(EngineOutput(request_id=rid, index=seq.index, finish_reason="abort"))
                self._retire(seq)
        return self._take_outputs()

    def stop_sequence(self, request_id: str, index: int) -> list[tuple[str, Any]]:
        req = self.requests.get(request_id)
        if req is not None and 0 <= index < len(req.sequences) and req.sequences[index].live:
            seq = req.sequences[index]
            if seq.slot < 0:  # still waiting: it will never run, but its siblings may
                seq.live = False
                self._finish_request_if_done(req)
            else:
                self._retire(seq)
        return self._take_outputs()

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
    def step(self) -> list[tuple[str, Any]]:
        for req in self.scheduler.admit():
            self._prefill(req)
        if self.scheduler.running:
            self._decode()
        return self._take_outputs()

    def _prefill(self, req: _Request) -> None:
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
        self, seqs: list[_Sequence], logits: torch.Tensor, prompt_logprobs: list[PositionLogprobs | None] | None
    ) -> None:
        tokens, logprobs = sample(logits, [s.state for s in seqs])
        finished: list[_Sequence] = []
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

    def _finish_reason(self, seq: _Sequence, token: int) -> tuple[str | None, int | None]:
        sp, req = seq.request.sampling, seq.request
        if not sp.ignore_eos and token in self.eos_ids:
            return "stop", None if token == self.primary_eos else token
        if token in req.stop_ids:
            return "stop", token
        if len(seq.output) >= sp.max_tokens or req.prompt_len + len(seq.output) >= self.max_model_len:
            return "length", None
        return None, None

    def _prompt_logprobs(self, req: _Request, hidden: torch.Tensor) -> list[PositionLogprobs | None]:
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

    def _retire(self, seq: _Sequence) -> None:
        """A sequence is over (finished, aborted or stopped): free its slot; end the request after its last one."""
        seq.live = False
        if seq.slot >= 0:
            move = self.scheduler.release(seq)
            if move is not None:
                moved = self.scheduler.running[move.dst]
                self.cache.copy_slot(move.src, move.dst, moved.num_cached)
        self._finish_request_if_done(seq.request)

    def _finish_request_if_done(self, req: _Request) -> None:
        if not any(s.live for s in req.sequences) and self.requests.pop(req.request_id, None) is not None:
            self.scheduler.remove_waiting(req.request_id)
            self._emit_done(req.request_id)

    def _emit(self, output: EngineOutput) -> None:
        self._out.append((output.request_id, output))

    def _emit_done(self, request_id: str) -> None:
        self._out.append((request_id, DONE))

    def _take_outputs(self) -> list[tuple[str, Any]]:
        out, self._out = self._out, []
        return out


# -- the asyncio facade -----------------------------------------------------------------


class TorchEngine:
    """In-process engine (see module docstring); ``info`` is ready at construction, weights load in ``start()``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        seed: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self._facts = read_model_facts(resolve_model(model))
        limit = self._facts.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 2 and the model's {limit}; got {max_model_len}")
        self._dtype = DTYPES[dtype]
        self._max_model_len = max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        self._seed = seed
        self.batch_invariant = batch_invariant
        self.info = EngineInfo(
            model_name=model_display_name(model),
            vocab_size=self._facts.vocab_size,
            max_model_len=self._max_model_len,
            max_num_seqs=max_num_seqs,
            eos_token_ids=list(self._facts.eos_token_ids),
        )
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._channels = OutputChannels()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._stats = EngineStats()

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TorchEngine:
        return cls(
            spec.model,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            seed=spec.seed,
            batch_invariant=spec.batch_invariant,
        )

    async def start(self) -> None:
        """Load the model on the engine thread and start its step loop (raises if loading fails)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="pdserve-torch-engine", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(loaded)
        except BaseException:
            self._thread = None
            raise

    async def shutdown(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._inbox.put(("shutdown",))
        await asyncio.to_thread(thread.join)
        self._fail_all(EngineDeadError("engine shut down"))

    def is_healthy(self) -> bool:
        return self._thread is not None and self._dead is None

    def stats(self) -> EngineStats:
        return self._stats

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))

    async def stop_sequence(self, request_id: str, index: int) -> None:
        self._inbox.put(("stop", request_id, index))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            raise EngineDeadError("engine is not running (call start() first)")
        self._validate(request)
        rid = request.request_id

        def abandon() -> None:
            if self._dead is None:
                self._inbox.put(("abort", [rid]))

        # aclosing: closing this iterator must close the channel's at once (its cleanup aborts).
        async with contextlib.aclosing(self._channels.stream(rid, lambda: self._inbox.put(("add", request)), abandon)) as outputs:
            async for output in outputs:
                yield output

    def _validate(self, request: EngineRequest) -> None:
        """Reject what would break a step (bad ids, impossible lengths) before it reaches the loop."""
        sp, prompt = request.sampling, request.prompt_token_ids
        problems = []
        if not prompt:
            problems.append("prompt_token_ids is empty")
        elif min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            problems.append(f"prompt token ids must be in [0, {self.info.vocab_size})")
        elif len(prompt) >= self._max_model_len:
            problems.append(
                f"prompt has {len(prompt)} tokens; max_model_len {self._max_model_len} leaves no room to generate"
            )
        if not 1 <= sp.n <= self.info.max_num_seqs:
            problems.append(f"n must be between 1 and max_num_seqs ({self.info.max_num_seqs})")
        if sp.max_tokens < 1:
            problems.append("max_tokens must be at least 1")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or not 0 <= sp.min_p <= 1:
            problems.append("need temperature >= 0, 0 < top_p <= 1 and 0 <= min_p <= 1")
        for name, k in (("logprobs", sp.logprobs), ("prompt_logprobs", sp.prompt_logprobs)):
            if k is not None and k < -1:
                problems.append(f"{name} must be -1 (whole vocabulary), 0 or more")
        if any(not 0 <= t < self.info.vocab_size for t in sp.stop_token_ids):
            problems.append(f"stop_token_ids must be in [0, {self.info.vocab_size})")
        problems.extend(sp.logits_problems(self.info.vocab_size))
        if problems:
            raise EngineError(f"invalid request {request.request_id!r}: " + "; ".join(problems))

    # -- engine thread ---------------------------------------------------------------------

    def _run(self, loaded: concurrent.futures.Future[None]) -> None:
        # The weights are prepacked on this thread: packed on one thread and used on another,
        # oneDNN's matmuls ran ~1.5x slower here. Threads are sized first, before any torch op
        # on this thread (see pdserve/engine/threads.py).
        try:
            self.info.intra_op_threads = configure_torch_threads()
            log.info(
                "torch engine %s: %d intra-op threads, batch_invariant=%s",
                self.info.model_name,
                self.info.intra_op_threads,
                self.batch_invariant,
            )
            model = load_model(
                self._facts.path, self._dtype, self._max_model_len, batch_invariant=self.batch_invariant
            )
            steps = StepLoop(model, self._facts, self._max_model_len, self.info.max_num_seqs, self._seed)
        except Exception as exc:  # noqa: BLE001 - start() raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(None)
        try:
            while True:
                command = self._inbox.get() if not steps.has_work() else self._next_command()
                while command is not None:
                    if command[0] == "shutdown":
                        return
                    self._publish(self._apply(steps, command))
                    command = self._next_command()
                if steps.has_work():
                    self._publish(steps.step())
                self._stats = steps.stats()
        except Exception as exc:  # any failure kills the engine loudly, never silently
            log.exception("torch engine loop failed; the engine is dead")
            dead = EngineDeadError(f"engine step failed: {exc!r}")
            self._dead = dead
            self._call_soon(self._fail_all, dead)

    def _next_command(self) -> tuple[Any, ...] | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    @staticmethod
    def _apply(steps: StepLoop, command: tuple[Any, ...]) -> list[tuple[str, Any]]:
        kind = command[0]
        if kind == "add":
            steps.add(command[1])
            return []
        if kind == "abort":
            return steps.abort(command[1])
        return steps.stop_sequence(command[1], command[2])

    def _publish(self, items: list[tuple[str, Any]]) -> None:
        if items:
            self._call_soon(self._deliver, items)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event loop ------------------------------------------------------------------------

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for rid, item in items:
            self._channels.put(rid, item)

    def _fail_all(self, error: EngineError) -> None:
        self._dead = self._dead or (error if isinstance(error, EngineDeadError) else EngineDeadError(str(error)))
        self._channels.fail_all(error)

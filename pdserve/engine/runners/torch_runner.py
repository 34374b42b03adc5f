"""The torch engine: real causal LMs on CPU behind the :class:`~pdserve.engine.api.Engine` protocol.

:class:`TorchSetup` checks a model and its limits without loading it (so ``info`` is known at
once) and :meth:`TorchSetup.load` builds the :class:`~pdserve.engine.step_loop.StepLoop` on the
calling thread. The engine-core process runs that step loop itself; :class:`TorchEngine` runs it
in this process, on one background thread that owns the model, the KV cache and the scheduler:
the asyncio side only validates, puts typed commands in the thread's inbox and receives one
:class:`~pdserve.engine.messages.StepOutputs` per step (``loop.call_soon_threadsafe``), so no
model state is ever touched from two threads. Torch ops release the GIL, so the event loop keeps
serving while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.checkpoints.model_dir import model_eos_ids
from pdserve.checkpoints.resolve import model_display_name, resolve_model
from pdserve.engine.api import EngineDeadError, EngineError
from pdserve.engine.channels import OutputChannels, Sink
from pdserve.engine.coalesce import StreamIntervals
from pdserve.engine.kv.handoff import KVHandoff
from pdserve.engine.kv.peers import PeerDirectory
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.transport import NixlTransport
from pdserve.engine.messages import AbortRequests, AddRequest, Command, Shutdown, StepOutputs, StopSequence
from pdserve.engine.models import LlamaForCausalLM, load_model, model_config
from pdserve.engine.spec import EngineSpec, KVTransferSpec
from pdserve.engine.step_loop import StepLoop
from pdserve.engine.stepping import apply
from pdserve.engine.threads import configure_torch_threads
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineInfo, EngineOutput, EngineRequest, EngineStats
from pdserve.protocol.kv import KVLayout

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Default context when --max-model-len is not given: the model's own, capped (the KV
# cache reserves address space for max_num_seqs * max_model_len positions).
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# An idle in-process engine still turns this often (KV leases expire, "pulled" notifications arrive).
IDLE_POLL_S = 0.5

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
    cfg = model_config(json.loads((model_dir / "config.json").read_text()))
    return ModelFacts(model_dir, cfg.vocab_size, cfg.max_position_embeddings, model_eos_ids(model_dir))


@dataclass
class TorchSetup:
    """A checked model and its limits; :meth:`load` turns it into a running step loop."""

    facts: ModelFacts
    info: EngineInfo
    dtype: torch.dtype
    seed: int
    batch_invariant: bool
    kv_transfer: KVTransferSpec | None = None

    @classmethod
    def create(
        cls,
        model: str | None = None,
        *,
        dtype: str = "bfloat16",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        seed: int = 0,
        batch_invariant: bool = False,
        kv_transfer: KVTransferSpec | None = None,
    ) -> TorchSetup:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        facts = read_model_facts(resolve_model(model))
        limit = facts.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 2 and the model's {limit}; got {max_model_len}")
        info = EngineInfo(
            model_name=model_display_name(model),
            vocab_size=facts.vocab_size,
            max_model_len=max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN_CAP),
            max_num_seqs=max_num_seqs,
            eos_token_ids=list(facts.eos_token_ids),
        )
        return cls(facts, info, DTYPES[dtype], seed, batch_invariant, kv_transfer)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TorchSetup:
        return cls.create(
            spec.model,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            seed=spec.seed,
            batch_invariant=spec.batch_invariant,
            kv_transfer=spec.kv_transfer,
        )

    def load(self) -> StepLoop:
        """Size the thread pool, load the weights and build the step loop, all on this thread.

        The weights are prepacked here: packed on one thread and used on another, oneDNN's
        matmuls ran ~1.5x slower. Threads are sized first, before any torch op on this thread
        (see pdserve/engine/threads.py), so call it on the thread that will run every step.
        """
        self.info.intra_op_threads = configure_torch_threads()
        log.info(
            "torch engine %s: %d intra-op threads, batch_invariant=%s",
            self.info.model_name,
            self.info.intra_op_threads,
            self.batch_invariant,
        )
        model = load_model(self.facts.path, self.dtype, self.info.max_model_len, batch_invariant=self.batch_invariant)
        kv = self._kv_handoff(model) if self.kv_transfer is not None else None
        return StepLoop(model, self.info, self.seed, kv)

    def _kv_handoff(self, model: LlamaForCausalLM) -> KVHandoff:
        """The block pool, registered with NIXL, and its bookkeeping; ``info.kv`` says where to pull from."""
        spec, cfg = self.kv_transfer, model.cfg
        assert spec is not None
        layout = KVLayout(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            block_size=spec.block_size, dtype=next(k for k, v in DTYPES.items() if v == self.dtype),
            itemsize=torch.empty((), dtype=self.dtype).element_size(),
        )
        tokens = spec.pool_tokens or self.info.max_num_seqs * self.info.max_model_len
        pool = KVBlockPool(layout, layout.blocks_for(tokens), self.dtype)
        transport = NixlTransport(spec.engine_id, pool)
        self.info.kv = transport.agent_info()
        return KVHandoff(spec, pool, transport, PeerDirectory(layout, spec.api_key))


class TorchEngine:
    """In-process engine (see module docstring); ``info`` is ready at construction, weights load in ``start()``."""

    def __init__(self, model: str | None = None, *, setup: TorchSetup | None = None, **limits: Any) -> None:
        self._setup = setup if setup is not None else TorchSetup.create(model, **limits)
        self.info = self._setup.info
        self.batch_invariant = self._setup.batch_invariant
        self._inbox: queue.SimpleQueue[Command | Shutdown] = queue.SimpleQueue()
        self._channels = OutputChannels()
        self._steps: StepLoop | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDeadError | None = None
        self._stats = EngineStats()

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TorchEngine:
        return cls(setup=TorchSetup.from_spec(spec))

    async def start(self) -> None:
        """Load the model on the engine thread and start its step loop (raises if loading fails)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        loaded: concurrent.futures.Future[StepLoop] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="pdserve-torch-engine", daemon=True)
        self._thread.start()
        try:
            self._steps = await asyncio.wrap_future(loaded)
        except BaseException:
            self._thread = None
            raise

    async def shutdown(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._inbox.put(Shutdown())
        await asyncio.to_thread(thread.join)
        self._fail_all(EngineDeadError("engine shut down"))

    def is_healthy(self) -> bool:
        return self._thread is not None and self._dead is None

    def stats(self) -> EngineStats:
        return self._stats

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        if request_ids:
            self._inbox.put(AbortRequests(list(request_ids), cause))

    async def stop_sequence(self, request_id: str, index: int) -> None:
        self._inbox.put(StopSequence(request_id, index))

    def attach_sink(self, request_id: str, sink: Sink) -> bool:
        return self._channels.attach_sink(request_id, sink)

    def direct_outputs(self) -> int:
        return self._channels.direct_outputs

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._dead is not None:
            raise self._dead
        if self._thread is None or self._steps is None:
            raise EngineDeadError("engine is not running (call start() first)")
        self._steps.validate(request)  # reads only the immutable info: safe off the engine thread
        rid = request.request_id

        def abandon() -> None:
            if self._dead is None:
                self._inbox.put(AbortRequests([rid]))

        # aclosing: closing this iterator must close the channel's at once (its cleanup aborts).
        submit = lambda: self._inbox.put(AddRequest(request))
        async with contextlib.aclosing(self._channels.stream(rid, submit, abandon)) as outputs:
            async for output in outputs:
                yield output

    # -- engine thread ---------------------------------------------------------------------

    def _run(self, loaded: concurrent.futures.Future[StepLoop]) -> None:
        try:
            steps = self._setup.load()
        except Exception as exc:  # noqa: BLE001 - start() raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(steps)
        held = StreamIntervals()  # requests streamed with a stream interval: outputs held per chunk
        try:
            while True:
                command = self._next_command(wait_s=None if steps.has_work() else IDLE_POLL_S)
                while command is not None:
                    if isinstance(command, Shutdown):
                        return
                    apply(steps, command)
                    if isinstance(command, AddRequest):
                        held.add(command.request)
                    command = self._next_command()
                steps.poll()
                if steps.has_work():
                    steps.step()
                self._publish(held.release(steps.take_outputs()))
                self._stats = steps.stats()
        except Exception as exc:  # any failure kills the engine loudly, never silently
            log.exception("torch engine loop failed; the engine is dead")
            dead = EngineDeadError(f"engine step failed: {exc!r}")
            self._dead = dead
            self._call_soon(self._fail_all, dead)

    def _next_command(self, wait_s: float | None = None) -> Command | Shutdown | None:
        """The next command: at once (``wait_s`` None), or within ``wait_s`` seconds; None if there is none."""
        try:
            return self._inbox.get_nowait() if wait_s is None else self._inbox.get(timeout=wait_s)
        except queue.Empty:
            return None

    def _publish(self, batch: StepOutputs) -> None:
        """One event-loop callback per step, whatever its batch."""
        if batch:
            self._call_soon(self._channels.deliver, batch)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event loop ------------------------------------------------------------------------

    def _fail_all(self, error: EngineError) -> None:
        self._dead = self._dead or (error if isinstance(error, EngineDeadError) else EngineDeadError(str(error)))
        self._channels.fail_all(error)

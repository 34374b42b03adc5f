"""The torch engine: real causal LMs on CPU behind the :class:`~pdserve.engine.api.Engine` protocol.

:class:`TorchSetup` checks a model and its limits without loading it (so ``info`` is known at
once) and :meth:`TorchSetup.load` builds the :class:`~pdserve.engine.step_loop.StepLoop` on the
calling thread. The engine-core process runs that step loop in its loop (:mod:`pdserve.engine.core_server`);
:class:`TorchEngine` runs the same loop in this process, on one background thread that owns the
model, the KV cache and the scheduler, over an ``inproc://`` socket (:mod:`pdserve.engine.inproc`):
the asyncio side sends typed commands and receives one :class:`~pdserve.engine.messages.StepOutputs`
per step, so no model state is ever touched from two threads. Torch ops release the GIL, so the
event loop keeps serving while a step runs.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.checkpoints.model_dir import model_eos_ids
from pdserve.checkpoints.resolve import model_display_name, resolve_model
from pdserve.engine.dtype_choice import choose_dtype
from pdserve.engine.inproc import InProcessCore
from pdserve.engine.kernels import choose_kernels
from pdserve.engine.kv.handoff import KVHandoff, Slots
from pdserve.engine.kv.peers import PeerDirectory
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.prefix_cache import PrefixCache
from pdserve.engine.kv.transport import NixlTransport
from pdserve.engine.models import KVCache, LlamaForCausalLM, load_model, model_config
from pdserve.engine.spec import EngineSpec, KVTransferSpec
from pdserve.engine.step_loop import StepLoop
from pdserve.engine.threads import configure_torch_threads
from pdserve.protocol.engine import EngineInfo
from pdserve.protocol.kv import KVLayout

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Default context when --max-model-len is not given: the model's own, capped (the KV
# cache reserves address space for max_num_seqs * max_model_len positions).
DEFAULT_MAX_MODEL_LEN_CAP = 8192
# Tokens one engine step computes (decode rows and prompt chunks) when --max-num-batched-tokens is not given.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Positions per prefix-cache block (vLLM's default block size).
PREFIX_CACHE_BLOCK_SIZE = 16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFacts:
    """What the engine needs from a model dir before loading weights."""

    path: Path
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]  # primary first
    kv_values_per_position: int  # keys and values of every layer and KV head, per position


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Vocab size, context, EOS ids and KV size from config.json + generation_config.json (primary EOS first)."""
    cfg = model_config(json.loads((model_dir / "config.json").read_text()))
    return ModelFacts(model_dir, cfg.vocab_size, cfg.max_position_embeddings, model_eos_ids(model_dir),
                      2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim)


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
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None,
        seed: int = 0,
        batch_invariant: bool = False,
        kv_transfer: KVTransferSpec | None = None,
        enable_prefix_caching: bool | None = None,
    ) -> TorchSetup:
        dtype = choose_dtype(dtype).dtype
        facts = read_model_facts(resolve_model(model))
        limit = facts.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be between 2 and the model's {limit}; got {max_model_len}")
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"--max-num-batched-tokens ({max_num_batched_tokens}) must be at least --max-num-seqs "
                             f"({max_num_seqs}): every running sequence decodes a token each step")
        info = EngineInfo(
            model_name=model_display_name(model),
            vocab_size=facts.vocab_size,
            max_model_len=max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN_CAP),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            eos_token_ids=list(facts.eos_token_ids),
            kv_role=kv_transfer.role if kv_transfer is not None else "both",
        )
        if enable_prefix_caching is not False:
            # As much as every running sequence's whole context: address space, committed as blocks are kept.
            info.prefix_cache_blocks = -(-max_num_seqs * info.max_model_len // PREFIX_CACHE_BLOCK_SIZE)
            info.prefix_cache_block_size = PREFIX_CACHE_BLOCK_SIZE
            itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
            info.prefix_cache_block_bytes = PREFIX_CACHE_BLOCK_SIZE * facts.kv_values_per_position * itemsize
        return cls(facts, info, DTYPES[dtype], seed, batch_invariant, kv_transfer)

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TorchSetup:
        return cls.create(
            spec.model,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            seed=spec.seed,
            batch_invariant=spec.batch_invariant,
            kv_transfer=spec.kv_transfer,
            enable_prefix_caching=spec.enable_prefix_caching,
        )

    def load(self) -> StepLoop:
        """Size the thread pool, load the weights and build the step loop, all on this thread.

        The weights are prepacked here: packed on one thread and used on another, oneDNN's
        matmuls ran ~1.5x slower. Threads are sized first, before any torch op on this thread
        (see pdserve/engine/threads.py), so call it on the thread that will run every step.
        """
        self.info.intra_op_threads = configure_torch_threads()
        self.info.kernels = choose_kernels(self.dtype).reason
        log.info(
            "torch engine %s: %d intra-op threads, kernels %s, batch_invariant=%s",
            self.info.model_name,
            self.info.intra_op_threads,
            self.info.kernels,
            self.batch_invariant,
        )
        model = load_model(self.facts.path, self.dtype, self.info.max_model_len, batch_invariant=self.batch_invariant)
        prefix_cache = self._prefix_cache(model)
        spec = self.kv_transfer
        if spec is None:
            return StepLoop(model, self.info, self.seed, None, prefix_cache)
        layout = self._layout(model, spec.block_size)

        def handoff(cache: KVCache, slots: Slots) -> KVHandoff:
            """The KV cache registered with NIXL as it is, and the hand-off's bookkeeping; ``info.kv`` says where
            to pull from."""
            transport = NixlTransport(spec.engine_id, cache, layout)
            self.info.kv = transport.agent_info()
            return KVHandoff(spec, transport, PeerDirectory(layout, spec.api_key), slots, prefix_cache=prefix_cache)

        handoff_slots = spec.handoff_slots if spec.handoff_slots is not None else self.info.max_num_seqs
        return StepLoop(model, self.info, self.seed, handoff, prefix_cache, handoff_slots)

    def _layout(self, model: LlamaForCausalLM, block_size: int) -> KVLayout:
        cfg = model.cfg
        return KVLayout(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            block_size=block_size, dtype=next(k for k, v in DTYPES.items() if v == self.dtype),
            itemsize=torch.empty((), dtype=self.dtype).element_size(),
        )

    def _prefix_cache(self, model: LlamaForCausalLM) -> PrefixCache | None:
        """The prefix cache's blocks (a pool of their own, not registered with NIXL), when it is on."""
        blocks, size = self.info.prefix_cache_blocks, self.info.prefix_cache_block_size
        if not blocks or not size:
            return None
        return PrefixCache(KVBlockPool(self._layout(model, size), blocks, self.dtype))

class TorchEngine(InProcessCore):
    """In-process engine: the engine loop on a thread of this process that owns the model (see module
    docstring); ``info`` is ready at construction, weights load in ``start()``."""

    def __init__(self, model: str | None = None, *, setup: TorchSetup | None = None, **limits: Any) -> None:
        self._setup = setup if setup is not None else TorchSetup.create(model, **limits)
        super().__init__(self._setup.load, self._setup.info, thread_name="pdserve-torch-engine")
        self.batch_invariant = self._setup.batch_invariant

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> TorchEngine:
        return cls(setup=TorchSetup.from_spec(spec))

"""Llama-architecture causal LM (RMSNorm, RoPE, GQA, SwiGLU), the base of every supported model.

Written for CPU decode, where a step is one row per sequence, weights stream from memory
once per step and Python overhead per op matters as much as the matmuls: weights are
fused (QKV, gate+up) and prepacked for oneDNN (:class:`Linear`, ~1.8x the bandwidth of
``F.linear`` here), the layer loop is plain tensor code (no nn.Module dispatch), and the
KV cache is preallocated. In float32 on an AVX2 CPU without AVX-512 the linears and decode
attention run pdserve's own kernels instead (:mod:`pdserve.engine.kernels`), which are
batch-invariant by construction.

Batch invariance (a sequence decodes to the same tokens whatever else shares its batch)
needs every op to compute a row with shapes that do not depend on the other rows. Decode
attention does: SDPA's flash kernel computes each (row, head) on its own, and keys past each
row's length are masked, which adds exact zeros only (also across its 512-key blocks); in
float32 that needs MKL's reproducible mode (:mod:`~pdserve.engine.models.mkl_mode`), and on an
AVX2-only CPU whole groups of query rows and whole key blocks (:data:`INVARIANT_QUERY_ROWS`). The
linears do only in the batch-invariant mode (``batch_invariant=True``): oneDNN chooses its
matmul kernel by the number of rows (on CPUs with AMX, up to ~32 rows run an AVX-512 kernel
and more rows the AMX tiles, which round differently), so by default a row's bits may change
with the batch size. In the batch-invariant mode every linear kernel call has exactly
:data:`INVARIANT_ROWS` rows, padded, so the choice cannot depend on the batch on any CPU.
tests/unit/engine/test_models.py checks both modes; docs/engine.md has the speed cost.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import DecodeRows, choose_kernels
from pdserve.engine.models.mkl_mode import pin_mkl_code_path

pin_mkl_code_path()  # before any torch op of the process: MKL reads its mode at its first call

# Decode attention runs over a key span rounded up to this many positions, so its kernels
# see a new shape at most every this many steps (oneDNN compiles a kernel per matmul shape).
# The padding costs attention time: 16 instead of 64 saved ~3% of a batch-8 SmolLM2 step.
ATTENTION_SPAN_ALIGN = 16
# SDPA's CPU flash kernel splits the keys into blocks of up to this many (fewer when the span is shorter,
# which rounds differently): a chunked prefill's key span is a whole number of them.
PREFILL_KEY_BLOCK = 512
# A decode batch's attention is split into runs of consecutive slots, one SDPA call each over its own key span,
# where padding every row to the batch's longest costs more key rows than this: what one more SDPA call costs
# in key rows (per layer: ~36 us a call against ~0.14 us a key row, SmolLM2 bf16; `pdserve bench kv-layout`).
SPLIT_KEY_ROWS = 256
# In the batch-invariant mode every attention call has a multiple of this many query rows per sequence
# (zero-padded): a prompt's (or chunk's) rows are padded up to one, and each decode row is padded to this many.
# SDPA's CPU kernel splits a call's query rows into blocks of 32, 64 or 256, the last block keeping the rest,
# and on an AVX2-only CPU (an AMD EPYC host, 2026-12-06) the rows of a block past its last multiple of 4, a
# decode row alone among them, round differently from the others; rows in whole groups of 4 agree whatever the
# block's size and wherever the row sits in it (on the AVX-512 hosts every row did already).
INVARIANT_QUERY_ROWS = 4
# A prompt chunk (or a prompt past a cached prefix) of at most this many rows attends in pdserve's decode attention
# kernel, where the kernels run: each row over its own positions, rows of one slot sharing each block of keys. Over
# 8-120 rows it took 0.95-1.96x less time than SDPA's masked call (scripts/bench_kernels.py, the AVX2 EPYC).
NATIVE_CHUNK_ROWS = 128
# The fewest rows a chunk keeps when the step loop cuts it for the streams decoding beside it (its attention capped
# in keys read): below them a chunk's attention gets little cheaper, and smaller cuts only add steps to the prompt's
# TTFT. Where SDPA attends it, 128: SDPA's CPU kernel takes about as long for 4 query rows over 4k keys as for 16.
SDPA_CHUNK_MIN_ROWS = 128
# Where pdserve's kernel attends it, 8: there a chunk's attention falls with its rows, steeply down to one group of
# rows that share each read of the keys (GROUP_ROWS in decode_attention_f32.c), slowly below: after 4,000 positions,
# 30 layers, 2 threads on the AVX2 EPYC, 16 rows took 52 ms, 8 rows 29, 4 rows 24, one row 11.
KERNEL_CHUNK_MIN_ROWS = 8
# Largest decode batch computed in one pass (rows beyond run in further passes).
DECODE_MICROBATCH = 64
# Rows of every linear-layer kernel call in the batch-invariant mode: the default max_num_seqs,
# so a default server's decode step is one call per layer. Measured faster than 64 up to
# batch 16 both with and without AMX (docs/engine.md).
INVARIANT_ROWS = 16


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a Hugging Face ``config.json`` these models use."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("models with attention or MLP biases are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' (SwiGLU)")
        heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=str(cfg["architectures"][0]),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with the scaling variants Llama checkpoints use ("linear", "llama3")."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(wavelen > original / low, inv / factor, torch.where(wavelen < original / high, inv, blended))
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


class KVCache:
    """Preallocated keys/values: ``[2, layers, slots, kv_heads, max_len, head_dim]``.

    One slot per running sequence, kept from its placement to its release; decode attention reads
    each run of consecutive slots ``cache[:, :, a:b, :, :L]`` as a view, without gathering. The memory is
    an anonymous mapping: pages are committed only when written, so a long
    ``max_model_len`` costs address space, not RAM, and never-written keys read as 0.0
    (finite, so masked padding contributes exact zeros). Huge pages are turned off for it:
    a sequence writes 128-byte rows in many places at once, and faulting in (and zeroing)
    a 2 MiB page for each of them made the first steps of a new slot take seconds.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (2, cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._memory = mmap.mmap(-1, math.prod(shape) * itemsize)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._memory.madvise(mmap.MADV_NOHUGEPAGE)
        self.data = torch.frombuffer(self._memory, dtype=dtype).view(shape)
        self.keys, self.values = self.data[0], self.data[1]
        self.max_len = max_len
        # The whole cache as rows of head_dim: one index_put_ scatters a layer's new keys and
        # values of a decode step, read in place from the fused heads of its projection.
        self._rows = self.data.view(-1, cfg.head_dim)
        self._layers, self._slots, self._kv_heads = cfg.num_layers, num_slots, cfg.num_kv_heads

    @property
    def num_slots(self) -> int:
        return self._slots

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (address space: pages are committed as they are written)."""
        return len(self._memory)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of a slot (all layers) to another slot."""
        self.data[:, :, dst, :, :length] = self.data[:, :, src, :, :length]

    def flat_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indices for :meth:`store`, ``[layers, rows, 2 * kv_heads]``: where each sequence's keys, then values, go."""
        kv_head = torch.arange(2 * self._kv_heads)
        kv, head = kv_head // self._kv_heads, kv_head % self._kv_heads
        layer = torch.arange(self._layers)[:, None, None]
        slot_of = ((kv * self._layers + layer) * self._slots + slots[:, None]) * self._kv_heads + head
        return slot_of * self.max_len + positions[:, None]

    def store(self, layer: int, flat_rows: torch.Tensor, keys_values: torch.Tensor) -> None:
        """Write ``[rows, 2 * kv_heads, head_dim]`` (keys, then values) of one layer at the places of ``flat_rows``."""
        self._rows.index_put_((flat_rows[layer],), keys_values)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a weight of ``dtype`` on this CPU. Torch's bfloat16 path needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT: on an AVX2-only CPU (an AMD EPYC host, 2026-12-06) the reorder raises, so there the weight
    stays as it is and ``F.linear`` computes (bfloat16 emulated: ``--dtype auto`` picks float32 on such a CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except RuntimeError:
        return False
    return True


class Linear:
    """``x @ weight.T`` with the weight packed once for its kernel.

    float32 on an AVX2 CPU without AVX-512 runs pdserve's own kernel (:mod:`pdserve.engine.kernels`), which gives
    every row the same bits whatever shares its call, so ``fixed_rows`` has nothing to add there. Elsewhere the
    weight is reordered into oneDNN's blocked layout. There, by default all rows go to the kernel in one call
    (the fastest), and a single row is computed as two (itself twice), as oneDNN's one-row (GEMV) path rounds
    differently from its batched one; its batched paths for different row counts agree with each other on
    AVX-512 CPUs without AMX, not on CPUs with it. With ``fixed_rows=R`` every kernel call
    gets exactly R rows (zero-padded, more rows in blocks of R): one shape means one kernel
    and one reduction order for every call, so a row's result cannot depend on the rows it
    shares a call with. Falls back to ``F.linear`` (padded the same way) where oneDNN cannot pack the
    weight's dtype (:func:`onednn_packs`).
    """

    def __init__(self, weight: torch.Tensor, fixed_rows: int | None = None) -> None:
        self._native = choose_kernels(weight.dtype).kernels
        self.out_features = weight.shape[0]
        self.fixed_rows = fixed_rows
        if self._native is not None:
            self.weight, self._packed = self._native.pack(weight), False  # _packed: oneDNN's layout
        elif onednn_packs(weight.dtype):
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, fixed_rows or DECODE_MICROBATCH)
            self._packed = True
        else:
            self.weight, self._packed = weight, False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:
            return self._native.linear(x, self.weight, self.out_features)
        rows = x.shape[0]
        if self.fixed_rows is not None:
            blocks = F.pad(x, (0, 0, 0, -rows % self.fixed_rows)).split(self.fixed_rows)
            out = self._matmul(blocks[0]) if len(blocks) == 1 else torch.cat([self._matmul(b) for b in blocks])
            return out[:rows]
        if rows == 1 and self._packed:
            return self._matmul(torch.cat([x, x]))[:1]
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionGroup:
    """Rows ``[start, end)`` of a decode batch, in slots from ``first_slot`` on, attended in one SDPA call over
    ``span`` keys, under ``mask``."""

    start: int
    end: int
    first_slot: int
    span: int
    mask: torch.Tensor


@dataclass(frozen=True)
class PromptChunk:
    """Positions ``[start, start + len(ids))`` of a prompt prefilled in chunks, computed into ``slot``."""

    ids: torch.Tensor
    start: int
    slot: int


class LlamaForCausalLM:
    """Inference-only Llama; also the base class of :class:`~pdserve.engine.models.qwen3.Qwen3ForCausalLM`."""

    # Extra per-layer tensors an architecture adds (HF suffix -> LayerWeights field).
    extra_layer_weights: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        cfg: ModelConfig,
        state: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
        *,
        batch_invariant: bool = False,
    ) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.batch_invariant = batch_invariant
        remaining = dict(state)
        fixed_rows = INVARIANT_ROWS if batch_invariant else None

        def take(name: str) -> torch.Tensor:
            try:
                return remaining.pop(name).to(dtype).contiguous()
            except KeyError:
                raise ValueError(f"checkpoint is missing tensor {name!r}") from None

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        if cfg.tie_word_embeddings:
            remaining.pop("lm_head.weight", None)
            self.lm_head = Linear(self.embed, fixed_rows)
        else:
            self.lm_head = Linear(take("lm_head.weight"), fixed_rows)
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            layer = LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=Linear(torch.cat([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]), fixed_rows),
                o=Linear(take(p + "self_attn.o_proj.weight"), fixed_rows),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=Linear(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]), fixed_rows
                ),
                down=Linear(take(p + "mlp.down_proj.weight"), fixed_rows),
            )
            for suffix, field in self.extra_layer_weights.items():
                setattr(layer, field, take(p + suffix))
            self.layers.append(layer)
        unused = sorted(k for k in remaining if "rotary_emb" not in k)
        if unused:
            raise ValueError(f"checkpoint has tensors this {cfg.architecture} model does not use: {unused[:5]}")
        inv = rope_inv_freq(cfg)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        # rotate_half form: x * cos + roll(x, half) * sin_signed, sin_signed = [-sin, sin].
        self._cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
        self._sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
        self._q_width = cfg.num_heads * cfg.head_dim
        self._qk_heads = cfg.num_heads + cfg.num_kv_heads
        self._heads = self._qk_heads + cfg.num_kv_heads
        # pdserve's decode attention kernel (float32 on AVX2 CPUs: pdserve.engine.kernels), or SDPA over runs of slots.
        # The batch-invariant mode keeps SDPA, padded as a prompt's rows are: there a decode step must write the
        # keys/values a prefill writes for its position (the prefix cache's exactness), and prompts run SDPA.
        native = choose_kernels(dtype).kernels
        self._native_attention = (native if native is not None and cfg.head_dim % 8 == 0 and not batch_invariant
                                  else None)

    # -- architecture hooks -------------------------------------------------------------

    def _normalize_qk(self, layer: LayerWeights, heads: torch.Tensor) -> torch.Tensor:
        """Per-head normalisation of the query and key heads of ``[N, heads, head_dim]`` before RoPE (none for Llama)."""
        return heads

    # -- forward passes -----------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as Hugging Face computes it: normalise in float32, round, then scale in the model dtype.

        Rounding before the weight multiply matters: SmolLM2's greedy answer to "What is the
        capital of France?" flips between two near-tied first tokens with a single rounding.
        """
        xf = x.float()
        inverse_rms = torch.mean(xf * xf, -1, keepdim=True).add_(self.cfg.rms_norm_eps).rsqrt_()
        # A float product written to a model-dtype tensor is rounded once, as .to(dtype) would.
        return torch.mul(xf, inverse_rms, out=torch.empty_like(x)).mul_(weight)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[N, heads, head_dim]`` for :meth:`_rope` over all heads of a projection.

        The value heads get cos 1 and sin 0: ``v * 1 + roll(v) * 0`` is ``v`` exactly, and one
        op over every head is cheaper than slicing the query/key heads out and back.
        """
        n, cfg = positions.shape[0], self.cfg
        qk_shape, v_shape = (n, self._qk_heads, cfg.head_dim), (n, cfg.num_kv_heads, cfg.head_dim)
        one, zero = torch.ones((), dtype=self.dtype), torch.zeros((), dtype=self.dtype)
        cos = torch.cat([self._cos[positions][:, None].expand(qk_shape), one.expand(v_shape)], 1)
        sin = torch.cat([self._sin[positions][:, None].expand(qk_shape), zero.expand(v_shape)], 1)
        return cos, sin

    def _rope(self, heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(heads * cos, heads.roll(self.cfg.head_dim // 2, -1), sin)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer.post_norm)
        gate, up = layer.gate_up(h).split(self.cfg.intermediate_size, -1)
        return x + layer.down(F.silu(gate) * up)

    def _project(self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention inputs for rows ``x``: ``[N, heads + 2 * kv_heads, head_dim]``, queries and keys RoPE'd, then values."""
        h = self._rms_norm(x, layer.input_norm)
        heads = layer.qkv(h).view(-1, self._heads, self.cfg.head_dim)
        return self._rope(self._normalize_qk(layer, heads), cos, sin)

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        """Run a whole prompt from position 0 into ``slot``; returns final hidden states ``[L, hidden]``."""
        return self.prefill_batch(token_ids, [token_ids.shape[0]], [slot], cache)

    @torch.inference_mode()
    def prefill_batch(
        self, token_ids: torch.Tensor, lengths: Sequence[int], slots: Sequence[int], cache: KVCache,
        starts: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run prompts, concatenated in ``token_ids``, each into its slot from position ``starts[i]`` (0 by
        default); a slot already holds the keys/values of positions before its start (a prefix cache hit).

        Everything but attention runs over the rows of all prompts at once, so each weight is
        read once per layer for the batch instead of once per prompt; attention is causal over
        each prompt's own rows, and over its cached positions too when it starts past 0 (in pdserve's kernel
        for up to :data:`NATIVE_CHUNK_ROWS` rows, where it runs). Returns
        final hidden states ``[sum(lengths), hidden]``, the prompts' rows in order. In the
        batch-invariant mode a prompt gets the bits it gets alone, and wherever it starts: the
        fixed-row linears give a row the same bits wherever it sits in a call, and attention
        computes each row over the cached keys under a mask (:meth:`_chunk_mask`), as a chunk
        of a prompt prefilled in chunks does (:meth:`step`).
        """
        cfg = self.cfg
        starts = list(starts) if starts is not None else [0] * len(lengths)
        spans = [torch.arange(start, start + n) for start, n in zip(starts, lengths, strict=True)]
        positions = torch.cat(spans)
        row_slots = torch.tensor(slots).repeat_interleave(torch.tensor(lengths))
        flat_rows = cache.flat_rows(row_slots, positions)
        # A few rows past a cached prefix attend in pdserve's kernel where it runs, as a small chunk's do (step);
        # the others causally over their own rows (None: from position 0, outside the batch-invariant mode), or
        # over the cached keys under a mask.
        plans = [self._decode_plan(span, torch.full((len(span),), slot), cache)
                 if start > 0 and self._kernel_attends(len(span)) else None
                 for start, span, slot in zip(starts, spans, slots, strict=True)]
        masks = [None if plan is not None or (start == 0 and not self.batch_invariant)
                 else self._chunk_mask(span, cache.max_len) for start, span, plan in zip(starts, spans, plans, strict=True)]
        cos, sin = self._rope_tables(positions)
        x = F.embedding(token_ids, self.embed)
        for i, layer in enumerate(self.layers):
            heads = self._project(layer, x, cos, sin)
            cache.store(i, flat_rows, heads[:, cfg.num_heads :])
            if all(mask is None and plan is None for mask, plan in zip(masks, plans, strict=True)):
                attn = self._prompt_attention(heads, lengths)
            else:
                attn = torch.cat([
                    self._decode_attention(cache, i, rows, plan) if plan is not None
                    else self._prompt_attention(rows, [rows.shape[0]]) if mask is None
                    else self._cached_attention(cache, i, slot, rows[:, : cfg.num_heads], mask)
                    for rows, slot, mask, plan in zip(heads.split(list(lengths)), slots, masks, plans, strict=True)
                ])
            x = x + layer.o(attn)
            x = self._mlp(layer, x)
        return self._rms_norm(x, self.norm)

    @torch.inference_mode()
    def step(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, chunk: PromptChunk | None,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One engine step: a decode row for each of ``slots`` (:meth:`decode`) and, with ``chunk``,
        the next chunk of a prompt prefilled in chunks, in one pass through the weights: every linear runs
        over the decode rows and the chunk's rows together, attention apart. Returns the decode rows' and the
        chunk's final hidden states.

        The chunk's slot holds the prompt's earlier chunks. From position 0 a chunk computes what
        :meth:`prefill_batch` does for one prompt; later chunks attend over the cached keys, each row up to
        its own position (a mask over the key span; keys past a row add exact zeros). Where pdserve's kernels
        run, a chunk of up to :data:`NATIVE_CHUNK_ROWS` rows attends as decode rows, in the same kernel call as
        the step's decode rows. Their rows match an
        unchunked prefill's to rounding; bit for bit in the batch-invariant mode, where :meth:`prefill_batch`
        computes its attention the same way (tests/unit/engine/test_models.py).
        """
        rows = token_ids.shape[0]
        if chunk is None:
            return self.decode(token_ids, positions, cache, slots), None
        if rows > DECODE_MICROBATCH:  # a batch that takes several passes anyway: the chunk in one more
            rest = self.step(token_ids[:0], positions[:0], slots[:0], chunk, cache)[1]
            return self.decode(token_ids, positions, cache, slots), rest
        cfg, size = self.cfg, chunk.ids.shape[0]
        chunk_positions = torch.arange(chunk.start, chunk.start + size)
        all_positions = torch.cat([positions, chunk_positions])
        all_slots = torch.cat([slots, torch.full((size,), chunk.slot)])
        flat_rows = cache.flat_rows(all_slots, all_positions)
        # A small chunk's rows attend in pdserve's kernel as decode rows do, each over its own positions, in one
        # call with the decode rows: SDPA takes as long for a few query rows over a long cached prefix as for many.
        rows_as_decode = self._kernel_attends(size)
        if rows_as_decode:
            plan = self._decode_plan(all_positions, all_slots, cache)
        else:
            plan = self._decode_plan(positions, slots, cache) if rows else []
        causal_own_rows = chunk.start == 0 and not self.batch_invariant  # as prefill_batch computes a prompt
        chunk_mask = None if causal_own_rows or rows_as_decode else self._chunk_mask(chunk_positions, cache.max_len)
        cos, sin = self._rope_tables(all_positions)
        x = F.embedding(torch.cat([token_ids, chunk.ids]), self.embed)
        for i, layer in enumerate(self.layers):
            heads = self._project(layer, x, cos, sin)
            cache.store(i, flat_rows, heads[:, cfg.num_heads :])
            if rows_as_decode:
                attn = self._decode_attention(cache, i, heads, plan)
            else:
                if chunk_mask is None:
                    attn = self._prompt_attention(heads[rows:], [size])
                else:
                    attn = self._cached_attention(cache, i, chunk.slot, heads[rows:, : cfg.num_heads], chunk_mask)
                if rows:
                    attn = torch.cat([self._decode_attention(cache, i, heads[:rows], plan), attn])
            x = x + layer.o(attn)
            x = self._mlp(layer, x)
        hidden = self._rms_norm(x, self.norm)
        return hidden[:rows], hidden[rows:]

    def _chunk_mask(self, positions: torch.Tensor, max_len: int) -> torch.Tensor:
        """``[1, 1, rows, span]``: row ``i`` (at ``positions[i]``) sees the keys up to its position. In the
        batch-invariant mode the span is rounded up to whole blocks of SDPA's key split
        (:data:`PREFILL_KEY_BLOCK`), so a row meets the same kernel blocks whatever chunk it is computed in;
        else only to :data:`ATTENTION_SPAN_ALIGN` (rows past a cached prefix of 1,300 positions: 13% less
        attention than a 1,536-key span)."""
        span = self._key_span(int(positions[-1]), max_len)
        return (torch.arange(span)[None, :] <= positions[:, None])[None, None]

    def _key_span(self, position: int, max_len: int) -> int:
        """Keys an attention call reads for a row at ``position``: rounded up to :data:`ATTENTION_SPAN_ALIGN`, in the
        batch-invariant mode to whole blocks of SDPA's key split (:data:`PREFILL_KEY_BLOCK`)."""
        align = PREFILL_KEY_BLOCK if self.batch_invariant else ATTENTION_SPAN_ALIGN
        return min(-(-(position + 1) // align) * align, max_len)

    def _cached_attention(
        self, cache: KVCache, layer: int, slot: int, queries: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of query rows ``[rows, heads, head_dim]`` over ``slot``'s cached keys, under ``mask``; in the
        batch-invariant mode over a multiple of :data:`INVARIANT_QUERY_ROWS` rows (the padding rows see every key)."""
        end, rows = mask.shape[-1], queries.shape[0]
        if self.batch_invariant and rows % INVARIANT_QUERY_ROWS:
            pad = INVARIANT_QUERY_ROWS - rows % INVARIANT_QUERY_ROWS
            queries = F.pad(queries, (0, 0, 0, 0, 0, pad))
            mask = torch.cat([mask, mask.new_ones(1, 1, pad, end)], 2)
        attn = F.scaled_dot_product_attention(
            queries.transpose(0, 1)[None],
            cache.keys[layer, slot, :, :end][None],
            cache.values[layer, slot, :, :end][None],
            attn_mask=mask,
            enable_gqa=True,
        )[0]
        return attn.transpose(0, 1)[:rows].reshape(rows, self._q_width)

    def _prompt_attention(self, heads: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Causal attention of each prompt over its own rows of ``heads``: ``[rows, heads * head_dim]``."""
        cfg = self.cfg
        outs = []
        for rows in heads.split(list(lengths)):
            q, k, v = rows.split([cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads], 1)
            # 4-D inputs: with 3-D ones SDPA falls back from its flash kernel to the (3x slower) math path.
            attn = F.scaled_dot_product_attention(
                q[None].transpose(1, 2),
                k[None].transpose(1, 2),
                v[None].transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )[0]
            outs.append(attn.transpose(0, 1).reshape(rows.shape[0], self._q_width))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def decode(
        self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One token for each of ``slots`` (default ``0..B-1``) at ``positions``; returns final hidden states
        ``[B, hidden]``."""
        slots = torch.arange(token_ids.shape[0]) if slots is None else slots
        outs = [
            self._decode_rows(token_ids[rows], positions[rows], slots[rows], cache)
            for rows in (slice(start, start + DECODE_MICROBATCH) for start in range(0, token_ids.shape[0], DECODE_MICROBATCH))
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        cfg = self.cfg
        plan = self._decode_plan(positions, slots, cache)
        flat_rows = cache.flat_rows(slots, positions)
        cos, sin = self._rope_tables(positions)
        x = F.embedding(token_ids, self.embed)
        for i, layer in enumerate(self.layers):
            heads = self._project(layer, x, cos, sin)
            cache.store(i, flat_rows, heads[:, cfg.num_heads :])
            x = x + layer.o(self._decode_attention(cache, i, heads, plan))
            x = self._mlp(layer, x)
        return self._rms_norm(x, self.norm)

    @property
    def chunk_min_rows(self) -> int:
        """The fewest rows of a prompt chunk cut for the streams beside it (the step loop's floor), for the path its
        attention takes here: :data:`KERNEL_CHUNK_MIN_ROWS` in pdserve's kernel, else :data:`SDPA_CHUNK_MIN_ROWS`."""
        return KERNEL_CHUNK_MIN_ROWS if self._kernel_attends(KERNEL_CHUNK_MIN_ROWS) else SDPA_CHUNK_MIN_ROWS

    def _kernel_attends(self, prompt_rows: int) -> bool:
        """Whether that many rows of one prompt past its cached positions attend in pdserve's kernel, as decode
        rows do (:data:`NATIVE_CHUNK_ROWS`), rather than in SDPA's masked call."""
        return self._native_attention is not None and prompt_rows <= NATIVE_CHUNK_ROWS

    def _decode_plan(
        self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache
    ) -> list[AttentionGroup] | DecodeRows:
        """How a decode batch attends, worked out once per step for every layer: its rows' slots and lengths for
        pdserve's kernel (checked against the cache), else SDPA calls over runs of slots (:meth:`_decode_groups`)."""
        if self._native_attention is not None:
            return self._native_attention.decode_rows(slots, positions + 1, cache.num_slots, cache.max_len)
        return self._decode_groups(positions, slots, cache)

    def _decode_groups(self, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache) -> list[AttentionGroup]:
        """A decode batch's attention calls: runs of rows in consecutive slots, each a view of the cache padded
        to its longest row's span.

        Rows in slots apart are attended apart. One call over such a run pads every row's keys to the longest; a row far shorter than its
        neighbours starts a run of its own when the padding it would add (or make the run add) exceeds
        :data:`SPLIT_KEY_ROWS` (greedily, and one call wherever that costs less). Rows of equal lengths stay
        one call; eight sequences, one of 1,024 positions and seven of 256, attend in half the time of one
        padded call. A row's bits do not depend on its run: keys past its length add exact zeros under the
        mask, whatever the span. In the batch-invariant mode spans are whole blocks of SDPA's key split, as a
        prompt's (:meth:`_chunk_mask`): on an AVX2-only CPU a row's bits changed with its span.
        """
        spans = [self._key_span(p, cache.max_len) for p in positions.tolist()]
        slot_of = slots.tolist()
        runs: list[tuple[int, int, int]] = []  # (first row, end row, span)
        first, span = 0, spans[0]
        for row in range(1, len(spans)):
            rows, own = row - first, spans[row]
            adjacent = slot_of[row] == slot_of[row - 1] + 1
            if adjacent and (rows + 1) * max(span, own) <= rows * span + own + SPLIT_KEY_ROWS:
                span = max(span, own)
            else:
                runs.append((first, row, span))
                first, span = row, own
        runs.append((first, len(spans), span))
        longest = max(spans)
        packed = slot_of == list(range(slot_of[0], slot_of[0] + len(slot_of)))
        if packed and sum((end - start) * span for start, end, span in runs) + SPLIT_KEY_ROWS * (len(runs) - 1) > len(spans) * longest:
            runs = [(0, len(spans), longest)]  # the greedy split can lose to one call: never worse than that
        return [
            AttentionGroup(start, end, slot_of[start], span, torch.zeros(end - start, 1, 1, span).masked_fill_(
                (torch.arange(span)[None, :] > positions[start:end, None])[:, None, None, :], float("-inf")))
            for start, end, span in runs
        ]

    def _decode_attention(
        self, cache: KVCache, layer: int, heads: torch.Tensor, plan: Sequence[AttentionGroup] | DecodeRows
    ) -> torch.Tensor:
        """Attention of decode rows (their ``heads``) over their cached keys, as :meth:`_decode_plan` planned it: each
        row over its own positions in pdserve's kernel, else an SDPA call per run of slots."""
        if isinstance(plan, DecodeRows):
            assert self._native_attention is not None  # only it plans DecodeRows
            return self._native_attention.decode_attention(
                heads, self.cfg.num_heads, cache.keys[layer], cache.values[layer], plan)
        outs = []
        for group in plan:
            slots = slice(group.first_slot, group.first_slot + group.end - group.start)
            # SDPA's flash kernel reads the strided cache views in place; a bfloat16 torch.matmul
            # copied both (oneDNN takes only contiguous batches), a third of a batch-8 step.
            queries, mask = heads[group.start : group.end, : self.cfg.num_heads, None], group.mask
            if self.batch_invariant:  # each row padded to a whole group of query rows, as a prompt's rows are
                queries = F.pad(queries, (0, 0, 0, INVARIANT_QUERY_ROWS - 1))
                mask = mask.expand(-1, -1, INVARIANT_QUERY_ROWS, -1)
            outs.append(F.scaled_dot_product_attention(
                queries,
                cache.keys[layer, slots, :, : group.span],
                cache.values[layer, slots, :, : group.span],
                attn_mask=mask,
                enable_gqa=True,
            )[:, :, :1])
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        return attn.reshape(heads.shape[0], self._q_width)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` (computed in the model dtype, like HF and vLLM)."""
        return self.lm_head(hidden).float()

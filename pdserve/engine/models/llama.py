"""Llama-architecture causal LM (RMSNorm, RoPE, GQA, SwiGLU), the base of every supported model.

Written for CPU decode, where a step is one row per sequence, weights stream from memory
once per step and Python overhead per op matters as much as the matmuls: weights are
fused (QKV, gate+up) and prepacked for oneDNN (:class:`Linear`, ~1.8x the bandwidth of
``F.linear`` here), the layer loop is plain tensor code (no nn.Module dispatch), and the
KV cache is preallocated.

Batch invariance (a sequence decodes to the same tokens whatever else shares its batch)
needs every op to compute a row with shapes that do not depend on the other rows. Decode
attention does: it is batched per (row, kv head) and pads keys past each row's length with
a mask, which adds exact zeros only. The linears do only in the batch-invariant mode
(``batch_invariant=True``): oneDNN chooses its matmul kernel by the number of rows (on CPUs
with AMX, up to ~32 rows run an AVX-512 kernel and more rows the AMX tiles, which round
differently), so by default a row's bits may change with the batch size. In the
batch-invariant mode every linear kernel call has exactly :data:`INVARIANT_ROWS` rows,
padded, so the choice cannot depend on the batch on any CPU. tests/unit/engine/test_models.py
checks both modes; docs/engine.md has the speed cost.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

# Decode attention runs over a key span rounded up to this many positions: oneDNN compiles
# a kernel per matmul shape, and a span growing by one every step recompiled it every step.
ATTENTION_SPAN_ALIGN = 64
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

    One slot per running sequence; slot ``i`` is row ``i`` of the decode batch, so decode
    attention reads ``cache[:, :, :B, :, :L]`` as a view, without gathering. The memory is
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
        # Flat per-layer views: one index_copy_ scatters a decode step's new rows.
        self._flat_keys = [k.view(-1, cfg.head_dim) for k in self.keys]
        self._flat_values = [v.view(-1, cfg.head_dim) for v in self.values]
        self._kv_heads = cfg.num_kv_heads

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of a slot (all layers) to another slot."""
        self.data[:, :, dst, :, :length] = self.data[:, :, src, :, :length]

    def flat_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Indices for :meth:`store`: (slot, every kv head, position), slot-major like the rows of k/v."""
        heads = torch.arange(self._kv_heads)
        return ((slots[:, None] * self._kv_heads + heads[None, :]) * self.max_len + positions[:, None]).reshape(-1)

    def store(self, layer: int, flat_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one ``[rows, kv_heads, head_dim]`` key/value per sequence at the places of ``flat_rows``."""
        self._flat_keys[layer].index_copy_(0, flat_rows, keys.reshape(-1, keys.shape[-1]))
        self._flat_values[layer].index_copy_(0, flat_rows, values.reshape(-1, values.shape[-1]))


class Linear:
    """``x @ weight.T`` with the weight reordered once into oneDNN's blocked layout.

    By default all rows go to the kernel in one call (the fastest), and a single row is
    computed as two (itself twice), as oneDNN's one-row (GEMV) path rounds differently from
    its batched one; its batched paths for different row counts agree with each other on
    AVX-512 CPUs without AMX, not on CPUs with it. With ``fixed_rows=R`` every kernel call
    gets exactly R rows (zero-padded, more rows in blocks of R): one shape means one kernel
    and one reduction order for every call, so a row's result cannot depend on the rows it
    shares a call with. Falls back to ``F.linear`` where torch was built without oneDNN
    (padded the same way).
    """

    def __init__(self, weight: torch.Tensor, fixed_rows: int | None = None) -> None:
        if torch.backends.mkldnn.is_available():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, fixed_rows or DECODE_MICROBATCH)
            self._packed = True
        else:
            self.weight, self._packed = weight, False
        self.fixed_rows = fixed_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
        self._scale = cfg.head_dim**-0.5
        self._q_width = cfg.num_heads * cfg.head_dim
        self._qk_heads = cfg.num_heads + cfg.num_kv_heads

    # -- architecture hooks -------------------------------------------------------------

    def _normalize_qk(self, layer: LayerWeights, qk: torch.Tensor) -> torch.Tensor:
        """Per-head normalisation of queries/keys before RoPE (none for Llama)."""
        return qk

    # -- forward passes -----------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as Hugging Face computes it: normalise in float32, round, then scale in the model dtype.

        Rounding before the weight multiply matters: SmolLM2's greedy answer to "What is the
        capital of France?" flips between two near-tied first tokens with a single rounding.
        """
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.rms_norm_eps).to(self.dtype) * weight

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(qk * cos, qk.roll(self.cfg.head_dim // 2, -1), sin)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer.post_norm)
        gate, up = layer.gate_up(h).split(self.cfg.intermediate_size, -1)
        return x + layer.down(F.silu(gate) * up)

    def _project(
        self, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention inputs for rows ``x``: RoPE'd ``[N, heads+kv_heads, head_dim]`` and ``v``."""
        cfg = self.cfg
        h = self._rms_norm(x, layer.input_norm)
        qkv = layer.qkv(h)
        qk = self._normalize_qk(layer, qkv[:, : self._qk_heads * cfg.head_dim].view(-1, self._qk_heads, cfg.head_dim))
        v = qkv[:, self._qk_heads * cfg.head_dim :].view(-1, cfg.num_kv_heads, cfg.head_dim)
        return self._rope(qk, cos, sin), v

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        """Run a whole prompt from position 0 into ``slot``; returns final hidden states ``[L, hidden]``."""
        cfg = self.cfg
        n = token_ids.shape[0]
        x = F.embedding(token_ids, self.embed)
        cos, sin = self._cos[:n, None], self._sin[:n, None]
        for i, layer in enumerate(self.layers):
            qk, v = self._project(layer, x, cos, sin)
            k = qk[:, cfg.num_heads :]
            cache.keys[i, slot, :, :n] = k.transpose(0, 1)
            cache.values[i, slot, :, :n] = v.transpose(0, 1)
            # 4-D inputs: with 3-D ones SDPA falls back from its flash kernel to the (3x slower) math path.
            attn = F.scaled_dot_product_attention(
                qk[None, :, : cfg.num_heads].transpose(1, 2),
                k[None].transpose(1, 2),
                v[None].transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )[0]
            x = x + layer.o(attn.transpose(0, 1).reshape(n, self._q_width))
            x = self._mlp(layer, x)
        return self._rms_norm(x, self.norm)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token for each of slots ``0..B-1`` at ``positions``; returns final hidden states ``[B, hidden]``."""
        outs = [
            self._decode_rows(
                token_ids[start : start + DECODE_MICROBATCH], positions[start : start + DECODE_MICROBATCH], start, cache
            )
            for start in range(0, token_ids.shape[0], DECODE_MICROBATCH)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, first_slot: int, cache: KVCache
    ) -> torch.Tensor:
        cfg = self.cfg
        b = token_ids.shape[0]
        slots = torch.arange(first_slot, first_slot + b)
        longest = int(positions.max()) + 1
        span = min(-(-longest // ATTENTION_SPAN_ALIGN) * ATTENTION_SPAN_ALIGN, cache.max_len)
        flat_rows = cache.flat_rows(slots, positions)
        # Additive mask over the padded key span: each row sees its own positions only.
        mask = torch.zeros(b, 1, span, 1).masked_fill_(
            (torch.arange(span)[None, :] > positions[:, None])[:, None, :, None], float("-inf")
        )
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        group = cfg.num_heads // cfg.num_kv_heads
        x = F.embedding(token_ids, self.embed)
        for i, layer in enumerate(self.layers):
            qk, v = self._project(layer, x, cos, sin)
            cache.store(i, flat_rows, qk[:, cfg.num_heads :], v)
            keys = cache.keys[i, first_slot : first_slot + b, :, :span]
            values = cache.values[i, first_slot : first_slot + b, :, :span]
            # A contiguous q keeps float32 (MKL) batched matmuls row-invariant; strided, a lone
            # row took a different path than a batch.
            q = qk[:, : cfg.num_heads].reshape(b, cfg.num_kv_heads, group, cfg.head_dim).contiguous()
            # keys @ q^T reads the strided cache view in place; q @ keys^T would copy it.
            scores = torch.add(mask, torch.matmul(keys, q.transpose(-1, -2)).float(), alpha=self._scale)
            attn = torch.matmul(torch.softmax(scores, -2).to(self.dtype).transpose(-1, -2), values)
            x = x + layer.o(attn.view(b, self._q_width))
            x = self._mlp(layer, x)
        return self._rms_norm(x, self.norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` (computed in the model dtype, like HF and vLLM)."""
        return self.lm_head(hidden).float()

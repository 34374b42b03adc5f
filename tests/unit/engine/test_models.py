"""The model code: batch invariance of its kernels and decode path, RoPE layout, config errors."""

import numpy as np
import pytest
import torch

from pdserve.engine.models import (
    DECODE_MICROBATCH,
    KVCache,
    LlamaForCausalLM,
    ModelConfig,
    Qwen3ForCausalLM,
    model_config,
)
from pdserve.engine.models.llama import Linear
from pdserve.engine.weights import permute_rope_rows, unpermute_rope_rows

# (out, in) of every linear in SmolLM2-135M (qkv, o, gate_up, down, lm_head) and qwen3-tiny.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (128, 64), (64, 64), (256, 64), (64, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_rows_do_not_depend_on_the_batch(shape: tuple[int, int], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = Linear(torch.randn(shape, generator=gen).to(dtype))
    x = torch.randn(DECODE_MICROBATCH, shape[1], generator=gen).to(dtype)
    full = linear(x)
    for m in (1, 2, 3, 7, 8, 16, 33):
        assert torch.equal(linear(x[:m]), full[:m]), f"M={m}"
    for j in range(0, DECODE_MICROBATCH, 5):
        assert torch.equal(linear(x[j : j + 1].clone()), full[j : j + 1]), f"row {j} alone"


def _random_model(cls: type[LlamaForCausalLM], dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture=cls.__name__,
        vocab_size=1000,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        rope_scaling=None,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    gen = torch.Generator().manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    state = {"model.embed_tokens.weight": w(1000, 576), "model.norm.weight": 1 + w(576)}
    for i in range(2):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + w(576),
            p + "post_attention_layernorm.weight": 1 + w(576),
            p + "self_attn.q_proj.weight": w(576, 576),
            p + "self_attn.k_proj.weight": w(192, 576),
            p + "self_attn.v_proj.weight": w(192, 576),
            p + "self_attn.o_proj.weight": w(576, 576),
            p + "mlp.gate_proj.weight": w(1536, 576),
            p + "mlp.up_proj.weight": w(1536, 576),
            p + "mlp.down_proj.weight": w(576, 1536),
        }
        if cls is Qwen3ForCausalLM:
            state |= {p + "self_attn.q_norm.weight": 1 + w(64), p + "self_attn.k_norm.weight": 1 + w(64)}
    return cls(cfg, state, dtype, max_positions=512)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_decode_row_is_identical_alone_and_in_any_batch(cls: type[LlamaForCausalLM], dtype: torch.dtype) -> None:
    """The same sequence decodes to the same bits alone or among others of other lengths, in any slot."""
    model = _random_model(cls, dtype)
    cache = KVCache(model.cfg, 12, 512, dtype)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in (37, 5, 120, 64, 1, 90, 17, 300, 11, 2, 250)]
    for slot, prompt in enumerate(prompts):
        model.prefill(prompt, cache, slot)
    cache.copy_slot(0, 11, 37)  # the sequence of slot 0, again in the last slot
    tokens = torch.randint(0, 1000, (12,), generator=gen)
    tokens[11] = tokens[0]
    positions = torch.tensor([len(p) for p in prompts] + [37])
    snapshot = cache.data.clone()

    def decode(rows: int) -> torch.Tensor:
        cache.data.copy_(snapshot)
        return model.decode(tokens[:rows], positions[:rows], cache)

    alone = decode(1)[0]
    for rows in (2, 3, 8, 12):
        assert torch.equal(decode(rows)[0], alone), f"batch of {rows}"
    assert torch.equal(decode(12)[11], alone), "same sequence in slot 11"


def test_decode_matches_prefill_in_float32() -> None:
    """Decoding token by token agrees with running the whole sequence at once (KV cache, RoPE positions)."""
    model = _random_model(LlamaForCausalLM, torch.float32)
    cache = KVCache(model.cfg, 2, 64, torch.float32)
    ids = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(3))
    full = model.prefill(ids, cache, 0)
    model.prefill(ids[:12], cache, 1)
    stepped = [model.decode(torch.stack([ids[0], ids[i]]), torch.tensor([0, i]), cache)[1] for i in range(12, 20)]
    assert torch.allclose(torch.stack(stepped), full[12:], atol=1e-4)


def test_rope_row_permutation_round_trips() -> None:
    w = np.arange(6 * 64 * 3, dtype=np.float32).reshape(6 * 64, 3)
    permuted = permute_rope_rows(w, 6)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rope_rows(permuted, 6), w)
    # llama.cpp pairs row i of each head's first half with row i of its second half.
    assert np.array_equal(permuted[:2], w[[0, 32]])


def test_unsupported_configs_fail_clearly() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    assert ModelConfig.from_hf(base).head_dim == 4
    with pytest.raises(ValueError, match="biases"):
        ModelConfig.from_hf(base | {"attention_bias": True})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(base | {"hidden_act": "gelu"})
    with pytest.raises(
        ValueError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM, Qwen3"
    ):
        model_config(base | {"architectures": ["GPT2LMHeadModel"]})

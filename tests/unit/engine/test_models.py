"""The model code: batch invariance of its kernels, decode and batched prefill, RoPE layout, config errors."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.checkpoints.gguf_tensors import unpermute_rope_rows
from pdserve.engine import kernels
from pdserve.engine.models import (
    DECODE_MICROBATCH,
    KVCache,
    LlamaForCausalLM,
    ModelConfig,
    Qwen3ForCausalLM,
    model_config,
)
from pdserve.engine.models.llama import (
    ATTENTION_SPAN_ALIGN,
    INVARIANT_ROWS,
    KERNEL_CHUNK_MIN_ROWS,
    NATIVE_CHUNK_ROWS,
    SDPA_CHUNK_MIN_ROWS,
    SPLIT_KEY_ROWS,
    Linear,
    PromptChunk,
)
from tests.unit.engine.rope_rows import permute_rope_rows

# (out, in) of every linear in SmolLM2-135M (qkv, o, gate_up, down, lm_head) and qwen3-tiny.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (128, 64), (64, 64), (256, 64), (64, 128)]
# Row counts around the kernel switches seen on AMX (~32 rows), the invariant block and the microbatch edge.
ROW_COUNTS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 40, 63, 64, 65, 100)
# Relative L2 error of bfloat16 decode logits against float32 after two layers (measured below
# 0.05 here; the logits of another sequence are off by more than 1).
BF16_DECODE_TOLERANCE = 0.08


@functools.cache
def _linear_case(
    shape: tuple[int, int], dtype: torch.dtype, fixed_rows: int | None
) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A Linear of ``shape`` with random weights, the weights, and ``max(ROW_COUNTS)`` random input rows."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen).to(dtype)
    return Linear(weight, fixed_rows), weight, torch.randn(max(ROW_COUNTS), shape[1], generator=gen).to(dtype)


@functools.cache
def _rows_alone(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Each input row of :func:`_linear_case` computed on its own by the batch-invariant Linear."""
    linear, _, x = _linear_case(shape, dtype, INVARIANT_ROWS)
    return torch.cat([linear(x[j : j + 1]) for j in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@settings(max_examples=8)
@given(batch=st.lists(st.integers(0, max(ROW_COUNTS) - 1), min_size=1, max_size=DECODE_MICROBATCH + 3))
def test_batch_invariant_linear_gives_each_row_the_bits_it_gets_alone(
    shape: tuple[int, int], dtype: torch.dtype, batch: list[int]
) -> None:
    """Any batch (any size, order, repeats) of rows gets, row for row, what each row gets alone."""
    linear, _, x = _linear_case(shape, dtype, INVARIANT_ROWS)
    alone = _rows_alone(shape, dtype)
    out = linear(x[batch])
    for row, j in enumerate(batch):
        assert torch.equal(out[row], alone[j]), f"row {j} at position {row} of {len(batch)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_invariant_linear_rows_do_not_depend_on_the_batch_size(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    linear, _, x = _linear_case(shape, dtype, INVARIANT_ROWS)
    full = linear(x)
    for m in ROW_COUNTS:
        assert torch.equal(linear(x[:m]), full[:m]), f"M={m}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_default_linear_is_within_rounding_of_exact_at_every_batch_size(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    """The fast path may round differently per batch size, but never by more than the dtype allows.

    Bound: float32 accumulation of K exact products errs by at most ~K * 2**-24 * sum|x*w|
    (doubled here for slack), and bfloat16 output adds half an ulp (2**-9 relative, 2**-8 here).
    """
    linear, weight, x = _linear_case(shape, dtype, None)
    weight = weight.double()
    for m in ROW_COUNTS:
        exact = x[:m].double() @ weight.T
        bound = shape[1] * 2**-23 * (x[:m].double().abs() @ weight.abs().T)
        if dtype == torch.bfloat16:
            bound += 2**-8 * exact.abs()
        error = (linear(x[:m]).double() - exact).abs()
        assert bool((error <= bound).all()), f"M={m}: worst error {float((error - bound).max())} beyond the bound"


def _random_model(
    cls: type[LlamaForCausalLM], dtype: torch.dtype, batch_invariant: bool = False, max_positions: int = 512
) -> LlamaForCausalLM:
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
        max_position_embeddings=max_positions,
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
    return cls(cfg, state, dtype, max_positions=max_positions, batch_invariant=batch_invariant)


# A batch wider than one decode pass.
BATCH_SLOTS = 72


@functools.cache
def _prefilled(cls: type[LlamaForCausalLM]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 cache of ``BATCH_SLOTS`` prompts of many lengths (its data), their lengths and each one's next
    token, prefilled once per model by its float32 default: the prefills were most of the decode tests' time
    (bfloat16 is emulated on an AVX2 CPU), and a decode test needs keys/values to read, not ones the model under
    test wrote (the bfloat16 prefill's own accuracy is test_default_bfloat16_prefill_stays_close_to_float32's)."""
    model = _random_model(cls, torch.float32)
    cache = KVCache(model.cfg, BATCH_SLOTS, 512, torch.float32)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 300, (BATCH_SLOTS,), generator=gen)
    tokens = torch.randint(0, 1000, (BATCH_SLOTS,), generator=gen)
    for slot, n in enumerate(lengths.tolist()):
        model.prefill(torch.randint(0, 1000, (n,), generator=gen), cache, slot)
    return cache.data.clone(), lengths, tokens


class _DecodeBatches:
    """One decode step over slots ``0..rows-1`` (sequences of many lengths), always from the same cache."""

    def __init__(self, model: LlamaForCausalLM, dtype: torch.dtype) -> None:
        self.model, self.cache = model, KVCache(model.cfg, BATCH_SLOTS, 512, dtype)
        data, self.lengths, self.tokens = _prefilled(type(model))
        self.snapshot = data.to(dtype)

    def batch(self, rows: int) -> torch.Tensor:
        """Logits of the first ``rows`` sequences decoded together."""
        self.cache.data.copy_(self.snapshot)
        return self.model.logits(self.model.decode(self.tokens[:rows], self.lengths[:rows], self.cache))

    def scattered(self, slots: list[int]) -> torch.Tensor:
        """Logits of the sequences of ``slots`` (in order, gaps between them) decoded together where they are."""
        self.cache.data.copy_(self.snapshot)
        index = torch.tensor(slots)
        return self.model.logits(self.model.decode(self.tokens[index], self.lengths[index], self.cache, index))

    def alone(self, slot: int) -> torch.Tensor:
        """Logits of the sequence of ``slot`` decoded on its own (moved to slot 0, as the engine would)."""
        self.cache.data.copy_(self.snapshot)
        self.cache.copy_slot(slot, 0, int(self.lengths[slot]))
        one = slice(slot, slot + 1)
        return self.model.logits(self.model.decode(self.tokens[one], self.lengths[one], self.cache))[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_batch_invariant_decode_rows_are_identical_alone_and_in_any_batch(
    cls: type[LlamaForCausalLM], dtype: torch.dtype
) -> None:
    """Every sequence's logits have the same bits alone as in batches of any size, in any slot."""
    runs = _DecodeBatches(_random_model(cls, dtype, batch_invariant=True), dtype)
    alone = torch.stack([runs.alone(slot) for slot in range(BATCH_SLOTS)])
    for rows in (2, 3, 8, 33, 40, 64, 65, BATCH_SLOTS):
        together = runs.batch(rows)
        for slot in range(rows):
            assert torch.equal(together[slot], alone[slot]), f"slot {slot} in a batch of {rows}"
    # Sequences that stay in their slots while others come and go: runs of slots with gaps between them.
    for slots in ([1, 2, 3, 7, 8, 20], [0, 5], list(range(3, 70, 2)), [*range(10, 30), *range(40, 72)]):
        together = runs.scattered(slots)
        for row, slot in enumerate(slots):
            assert torch.equal(together[row], alone[slot]), f"slot {slot} among {slots}"


@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_default_bfloat16_decode_rows_stay_close_to_float32_in_any_batch(cls: type[LlamaForCausalLM]) -> None:
    """The fast path (not bit-invariant on every CPU) computes every row of any batch to bfloat16 accuracy."""
    reference = _DecodeBatches(_random_model(cls, torch.float32), torch.float32).batch(BATCH_SLOTS)
    runs = _DecodeBatches(_random_model(cls, torch.bfloat16), torch.bfloat16)
    for rows in (1, 8, 40, BATCH_SLOTS):
        error = (runs.batch(rows) - reference[:rows]).norm(dim=-1) / reference[:rows].norm(dim=-1)
        assert float(error.max()) < BF16_DECODE_TOLERANCE, f"batch of {rows}: relative error {error.max():.4f}"


@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_default_bfloat16_prefill_stays_close_to_float32(cls: type[LlamaForCausalLM]) -> None:
    """A bfloat16 prefill's logits, each position's, to bfloat16 accuracy (prompts up to the decode tests')."""
    exact, fast = _random_model(cls, torch.float32), _random_model(cls, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 17, 150, 299):
        prompt = torch.randint(0, 1000, (n,), generator=gen)
        reference = exact.logits(exact.prefill(prompt, KVCache(exact.cfg, 1, 512, torch.float32), 0))
        got = fast.logits(fast.prefill(prompt, KVCache(fast.cfg, 1, 512, torch.bfloat16), 0)).float()
        error = (got - reference).norm(dim=-1) / reference.norm(dim=-1)
        assert float(error.max()) < BF16_DECODE_TOLERANCE, f"{n} positions: relative error {error.max():.4f}"


@functools.cache
def _long_cache() -> KVCache:
    """A one-slot cache of 2,048 positions (only its length matters to the runs)."""
    return KVCache(_runs_model(False).cfg, 1, 2048, torch.float32)


@functools.cache
def _runs_model(batch_invariant: bool) -> LlamaForCausalLM:
    return _random_model(LlamaForCausalLM, torch.float32, batch_invariant=batch_invariant)


@given(lengths=st.lists(st.integers(1, 2000), min_size=1, max_size=70))
def test_decode_attention_runs_cover_the_batch_and_split_only_to_save_padding(lengths: list[int]) -> None:
    """The runs partition the rows in order, each row's keys fit its run's span, and a split is never
    costlier, in padded key rows plus SPLIT_KEY_ROWS per extra call, than one call over the whole batch."""
    cache = _long_cache()
    groups = _runs_model(False)._decode_groups(torch.tensor(lengths) - 1, torch.arange(len(lengths)), cache)
    assert [g.start for g in groups] == [0] + [g.end for g in groups[:-1]] and groups[-1].end == len(lengths)
    for g in groups:
        assert g.span % ATTENTION_SPAN_ALIGN == 0 or g.span == cache.max_len
        assert max(lengths[g.start : g.end]) <= g.span <= cache.max_len
        assert g.mask.shape == (g.end - g.start, 1, 1, g.span)
        visible = (g.mask == 0).sum(-1).flatten().tolist()
        assert visible == lengths[g.start : g.end]  # each row sees exactly its own positions
    one_call = len(lengths) * max(g.span for g in groups)
    split = sum((g.end - g.start) * g.span for g in groups) + SPLIT_KEY_ROWS * (len(groups) - 1)
    assert split <= one_call
    if len(set(lengths)) == 1:
        assert len(groups) == 1


def test_one_long_sequence_among_short_ones_attends_apart() -> None:
    groups = _runs_model(False)._decode_groups(torch.tensor([255, 255, 1023, 255, 255, 255]), torch.arange(6),
                                               _long_cache())
    assert [(g.start, g.end, g.span) for g in groups] == [(0, 2, 256), (2, 3, 1024), (3, 6, 256)]


def test_batch_invariant_decode_spans_are_whole_key_blocks() -> None:
    """As a prompt's rows read them (on an AVX2-only CPU a decode row's bits changed with its span)."""
    groups = _runs_model(True)._decode_groups(torch.tensor([19, 600, 1100]), torch.arange(3), _long_cache())
    assert [(g.start, g.end, g.span) for g in groups] == [(0, 1, 512), (1, 2, 1024), (2, 3, 1536)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_row_does_not_depend_on_the_padded_key_span(dtype: torch.dtype) -> None:
    """A short sequence decodes to the same bits next to one over 512 keys longer (SDPA's key block)."""
    model = _random_model(LlamaForCausalLM, dtype, batch_invariant=True, max_positions=1100)
    cache = KVCache(model.cfg, 2, 1100, dtype)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.tensor([20, 1050])
    for slot, n in enumerate(lengths.tolist()):
        model.prefill(torch.randint(0, 1000, (n,), generator=gen), cache, slot)
    tokens = torch.randint(0, 1000, (2,), generator=gen)
    together = model.logits(model.decode(tokens, lengths, cache))
    alone = model.logits(model.decode(tokens[:1], lengths[:1], cache))
    assert torch.equal(together[0], alone[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_rounds_like_hugging_face(dtype: torch.dtype) -> None:
    """Bit for bit HF's RMSNorm: normalise in float32, round to the model dtype, then scale."""
    model = _random_model(LlamaForCausalLM, dtype)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(33, 576, generator=gen) * 4).to(dtype)
    weight = model.layers[0].input_norm
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + model.cfg.rms_norm_eps)).to(dtype) * weight
    assert torch.equal(model._rms_norm(x, weight), expected)


# Prompts batched in one prefill: one row (the linears' one-row path), the invariant block and
# its neighbours, a prompt longer than the rest; in slots other than their order in the batch.
PREFILL_LENGTHS = [17, 1, 130, 16, 7, 33, 2]
PREFILL_SLOTS = [3, 0, 6, 1, 5, 2, 4]
# Relative L2 error of batched against one-by-one prefill in the default mode: kernels for other
# row counts round the bfloat16 outputs differently (measured below 0.01 for the logits and 4e-4
# for the cache; the logits of another prompt are off by more than 1).
BF16_PREFILL_TOLERANCE = {"logits": 0.02, "cache": 2e-3}
F32_PREFILL_TOLERANCE = {"logits": 1e-5, "cache": 1e-5}


def _prefill_one_by_one_and_batched(
    model: LlamaForCausalLM, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The cache and the prompts' last-row logits, ``{"logits"|"cache": (one by one, batched)}``."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in PREFILL_LENGTHS]
    alone_cache, batch_cache = (KVCache(model.cfg, len(prompts), 256, dtype) for _ in range(2))
    alone = torch.cat(
        [model.logits(model.prefill(p, alone_cache, s)[-1:]) for p, s in zip(prompts, PREFILL_SLOTS, strict=True)]
    )
    hidden = model.prefill_batch(torch.cat(prompts), PREFILL_LENGTHS, PREFILL_SLOTS, batch_cache)
    together = model.logits(hidden[torch.tensor(PREFILL_LENGTHS).cumsum(0) - 1])
    return {"logits": (alone, together), "cache": (alone_cache.data, batch_cache.data)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_batch_invariant_batched_prefill_gives_each_prompt_its_bits_alone(
    cls: type[LlamaForCausalLM], dtype: torch.dtype
) -> None:
    results = _prefill_one_by_one_and_batched(_random_model(cls, dtype, batch_invariant=True), dtype)
    for name, (alone, together) in results.items():
        assert torch.equal(together, alone), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_default_batched_prefill_is_within_rounding_of_one_by_one(
    cls: type[LlamaForCausalLM], dtype: torch.dtype
) -> None:
    """Same KV cache and last-row logits as prefilling each prompt alone, up to the dtype's rounding."""
    tolerance = BF16_PREFILL_TOLERANCE if dtype == torch.bfloat16 else F32_PREFILL_TOLERANCE
    results = _prefill_one_by_one_and_batched(_random_model(cls, dtype), dtype)
    alone, together = results["logits"]
    error = (together - alone).norm(dim=-1) / alone.norm(dim=-1)
    assert float(error.max()) < tolerance["logits"], f"logits: relative error {error.max():.2e}"
    alone, together = (t.float() for t in results["cache"])
    error = (together - alone).norm() / alone.norm()
    assert float(error) < tolerance["cache"], f"cache: relative error {error:.2e}"


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


# A prompt past two of SDPA's 512-key blocks, and room behind it.
CHUNKED_PROMPT, CHUNKED_CACHE = 1100, 2048


@functools.cache
def _unchunked(cls: type[LlamaForCausalLM], dtype: torch.dtype, batch_invariant: bool
               ) -> tuple[LlamaForCausalLM, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A model, a prompt, its unchunked prefill's hidden states and KV cache."""
    model = _random_model(cls, dtype, batch_invariant=batch_invariant, max_positions=CHUNKED_CACHE)
    ids = torch.randint(0, 1000, (CHUNKED_PROMPT,), generator=torch.Generator().manual_seed(5))
    cache = KVCache(model.cfg, 1, CHUNKED_CACHE, dtype)
    hidden = model.prefill(ids, cache, 0)
    return model, ids, hidden, cache.data[:, :, 0, :, :CHUNKED_PROMPT].clone()


def _chunked(model: LlamaForCausalLM, ids: torch.Tensor, sizes: list[int], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    cache, outs, start = KVCache(model.cfg, 2, CHUNKED_CACHE, dtype), [], 0
    none = torch.empty(0, dtype=torch.long)  # no decode rows: the chunk alone
    for size in [*sizes, ids.shape[0]]:  # the rest in one last chunk
        end = min(start + size, ids.shape[0])
        if end > start:
            outs.append(model.step(none, none, none, PromptChunk(ids[start:end], start, 1), cache)[1])
        start = end
    return torch.cat(outs), cache.data[:, :, 1, :, : ids.shape[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=5))
def test_batch_invariant_chunked_prefill_gives_the_unchunked_bits_for_any_chunking(
    cls: type[LlamaForCausalLM], dtype: torch.dtype, sizes: list[int]
) -> None:
    model, ids, hidden, kv = _unchunked(cls, dtype, True)
    chunked_hidden, chunked_kv = _chunked(model, ids, sizes, dtype)
    assert torch.equal(chunked_hidden, hidden) and torch.equal(chunked_kv, kv)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_default_chunked_prefill_is_within_rounding_of_unchunked(cls: type[LlamaForCausalLM]) -> None:
    model, ids, hidden, kv = _unchunked(cls, torch.float32, False)
    chunked_hidden, chunked_kv = _chunked(model, ids, [300, 257, 513], torch.float32)
    assert torch.allclose(chunked_hidden, hidden, atol=1e-4) and torch.allclose(chunked_kv, kv, atol=1e-4)


def _chunks_beside_decode_rows(model: LlamaForCausalLM, ids: torch.Tensor, sizes: list[int]
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids`` prefilled into slot 1 in chunks of ``sizes`` (the rest in one last chunk), each step beside decode
    rows of two sequences in slots 0 and 2: the chunks' hidden states, the decode rows' and slot 1's cache."""
    cache = KVCache(model.cfg, 3, CHUNKED_CACHE, torch.float32)
    gen = torch.Generator().manual_seed(9)
    for slot, length in ((0, 40), (2, 700)):
        model.prefill(torch.randint(0, 1000, (length,), generator=gen), cache, slot)
    slots, positions = torch.tensor([0, 2]), torch.tensor([40, 700])
    chunk_outs, decode_outs, start = [], [], 0
    for size in [*sizes, ids.shape[0]]:
        end = min(start + size, ids.shape[0])
        if end > start:
            decoded, chunked = model.step(torch.randint(0, 1000, (2,), generator=gen), positions, slots,
                                          PromptChunk(ids[start:end], start, 1), cache)
            chunk_outs.append(chunked)
            decode_outs.append(decoded)
            positions = positions + 1
        start = end
    return torch.cat(chunk_outs), torch.cat(decode_outs), cache.data[:, :, 1, :, : ids.shape[0]]


@pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="pdserve's kernels need AVX2 and FMA")
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_small_chunks_attending_in_pdserve_kernel_match_sdpa_and_the_unchunked_prompt(
    cls: type[LlamaForCausalLM],
) -> None:
    """A chunk of up to NATIVE_CHUNK_ROWS rows attends in the decode kernel, in one call with the step's decode
    rows: its rows, the decode rows and the cache agree to rounding with SDPA's masked path and with one prefill."""
    _, ids, hidden, kv = _unchunked(cls, torch.float32, False)
    sizes = [300, 1, NATIVE_CHUNK_ROWS, 17, NATIVE_CHUNK_ROWS + 1, 40]
    native, sdpa = (_random_model(cls, torch.float32, max_positions=CHUNKED_CACHE) for _ in range(2))
    counting = _RowCountingKernels(kernels.load_native_kernels())
    native._native_attention, sdpa._native_attention = counting, None  # type: ignore[assignment]
    # The step loop's floor for a chunk cut for the streams beside it: one that attends here, in the kernel.
    assert (native.chunk_min_rows, sdpa.chunk_min_rows) == (KERNEL_CHUNK_MIN_ROWS, SDPA_CHUNK_MIN_ROWS)
    by_kernel, by_sdpa = _chunks_beside_decode_rows(native, ids, sizes), _chunks_beside_decode_rows(sdpa, ids, sizes)
    for ours, theirs in zip(by_kernel, by_sdpa, strict=True):
        assert torch.allclose(ours, theirs, atol=1e-4)
    assert torch.allclose(by_kernel[0], hidden, atol=1e-4) and torch.allclose(by_kernel[2], kv, atol=1e-4)
    # Every layer's call: the 2 decode rows with each small chunk's rows, alone beside a larger chunk's SDPA call.
    layers = native.cfg.num_layers
    expected = [2, 2 + 1, 2 + NATIVE_CHUNK_ROWS, 2 + 17, 2, 2 + 40, 2]  # chunks of 300, 1, 64, 17, 65, 40, the rest
    assert counting.rows == [rows for rows in expected for _ in range(layers)]


class _RowCountingKernels:
    """pdserve's kernels, recording how many rows each decode attention call computes."""

    def __init__(self, inner: kernels.NativeKernels) -> None:
        self.inner, self.rows = inner, list[int]()
        self.decode_rows = inner.decode_rows

    def decode_attention(self, heads: torch.Tensor, *args: object) -> torch.Tensor:
        self.rows.append(heads.shape[0])
        return self.inner.decode_attention(heads, *args)  # type: ignore[arg-type]


@pytest.mark.skipif(not {"avx2", "fma"} <= kernels.cpu_flags(), reason="pdserve's kernels need AVX2 and FMA")
@pytest.mark.parametrize("cls", [LlamaForCausalLM, Qwen3ForCausalLM])
def test_prompts_past_a_cached_prefix_attend_in_pdserve_kernel_up_to_its_row_limit(cls: type[LlamaForCausalLM]) -> None:
    """Prefix-cache hits in one batched prefill: the prompt with few rows left attends in the kernel, the longer
    one under SDPA's mask; both agree to rounding with the whole prompt prefilled at once, and with SDPA alone."""
    _, ids, hidden, _ = _unchunked(cls, torch.float32, False)
    starts, end = [CHUNKED_PROMPT - NATIVE_CHUNK_ROWS, CHUNKED_PROMPT - NATIVE_CHUNK_ROWS - 1], CHUNKED_PROMPT
    native, sdpa = (_random_model(cls, torch.float32, max_positions=CHUNKED_CACHE) for _ in range(2))
    counting = _RowCountingKernels(kernels.load_native_kernels())
    native._native_attention, sdpa._native_attention = counting, None  # type: ignore[assignment]
    outs = []
    for model in (native, sdpa):
        cache = KVCache(model.cfg, 2, CHUNKED_CACHE, torch.float32)
        for slot, start in enumerate(starts):
            model.prefill(ids[:start], cache, slot)  # the cached prefix
        outs.append(model.prefill_batch(torch.cat([ids[start:end] for start in starts]),
                                        [end - start for start in starts], [0, 1], cache, starts))
    reference = torch.cat([hidden[start:end] for start in starts])
    assert torch.allclose(outs[0], outs[1], atol=1e-4) and torch.allclose(outs[0], reference, atol=1e-4)
    assert counting.rows == [NATIVE_CHUNK_ROWS] * native.cfg.num_layers  # the longer prompt took SDPA

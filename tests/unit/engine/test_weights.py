"""GGUF -> Hugging Face dir conversion: tensor names, llama.cpp's Q/K permutation, dequantization,
config and tokenizer, checked by writing GGUFs the way llama.cpp's converter does and reading them back."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from pdserve.checkpoints.builtin import qwen3_tokenizer_dir
from pdserve.checkpoints.gguf_tensors import hf_tensor_name
from pdserve.checkpoints.gguf_tokenizer import tokenizer_from_gguf_metadata
from pdserve.checkpoints.resolve import resolve_model
from tests.unit.engine.rope_rows import permute_rope_rows

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def tokenizer_lists(tokenizer_json: Path) -> tuple[list[str], list[int], list[str]]:
    """GGUF's tokenizer arrays (tokens by id, token types, "a b" merges) from a tokenizer.json."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"] | {t["content"]: t["id"] for t in data["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"]: t["special"] for t in data["added_tokens"]}
    types = [1 if t not in special else (3 if special[t] else 4) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def small_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """The first ``size`` Qwen3 tokens (bytes and early merges) with the merges that stay inside them:
    a consistent BPE, small enough that writing and parsing the GGUF is instant."""
    tokens, types, merges = tokenizer_lists(qwen3_tokenizer_dir() / "tokenizer.json")
    kept = set(tokens[:size])
    return (
        tokens[:size],
        types[:size],
        [m for m in merges if "".join(m.split(" ")) in kept and set(m.split(" ")) <= kept],
    )


def write_gguf(path: Path, arch: str, cfg: dict, state: dict[str, torch.Tensor]) -> None:
    """A GGUF as llama.cpp's converter writes it (embeddings as Q8_0, the rest F32)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, types, merges = small_vocab(300)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(5)
    w.add_chat_template("{{ messages[0]['content'] }}")
    for name, tensor in state.items():
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = permute_rope_rows(array, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = permute_rope_rows(array, cfg["num_key_value_heads"])
        if name == "model.embed_tokens.weight":
            w.add_tensor(
                gguf_name(name),
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(gguf_name(name), array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_gguf_round_trip_restores_hf_tensors_and_config(arch: str, isolated_cache: Path) -> None:
    tiny = resolve_model("qwen3-tiny")
    cfg = json.loads((tiny / "config.json").read_text())
    state = load_file(str(tiny / "model.safetensors"))
    if arch == "llama":  # the same weights without Qwen3's q/k norms
        state = {k: v for k, v in state.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
    source = isolated_cache / f"tiny-{arch}.gguf"
    write_gguf(source, arch, cfg, state)

    out = resolve_model(str(source))
    assert out.parent == isolated_cache / "cache" / "models"
    converted = load_file(str(out / "model.safetensors"))
    assert converted.keys() == state.keys()
    for name, tensor in state.items():
        assert converted[name].dtype == torch.bfloat16
        if name == "model.embed_tokens.weight":  # Q8_0: close, not equal
            assert torch.allclose(converted[name].float(), tensor.float(), atol=2e-3)
        else:  # F32 in the GGUF: exact, Q/K rows back in Hugging Face order
            assert torch.equal(converted[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[arch]]
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert config[key] == cfg[key], key
    assert config["eos_token_id"] == 5
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == "{{ messages[0]['content'] }}"
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == 300
    assert resolve_model(str(source)) == out  # built once, then reused


def test_tokenizer_rebuilt_from_gguf_metadata_matches_the_real_qwen3_tokenizer() -> None:
    tokens, types, merges = tokenizer_lists(qwen3_tokenizer_dir() / "tokenizer.json")
    meta = {
        "general.architecture": "qwen3",
        "qwen3.context_length": 40960,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": 151645,
        "tokenizer.chat_template": "x",
    }
    rebuilt, config = tokenizer_from_gguf_metadata(meta)
    real = Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    for text in [
        "Hello world! 12345",
        "<|im_start|>user\nI'm <think>fine</think><|im_end|>",
        "  x\n\n\t y  ",
        "Café naïve 日本語 😀👍🏽",
        "def f(x):\n    return x**2  # 3.14",
        "Ｆｕｌｌ-width ﬁ ligature",
    ]:
        assert rebuilt.encode(text).ids == real.encode(text).ids, text
        assert rebuilt.decode(rebuilt.encode(text).ids, skip_special_tokens=False) == real.decode(
            real.encode(text).ids, skip_special_tokens=False
        )
    assert config["eos_token"] == "<|im_end|>" and config["chat_template"] == "x"
    assert config["added_tokens_decoder"]["151667"] == {
        "content": "<think>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": False,
    }
    with pytest.raises(ValueError, match="supported: smollm, starcoder, qwen2"):
        tokenizer_from_gguf_metadata(meta | {"tokenizer.ggml.pre": "falcon"})


def test_unknown_gguf_tensor_and_unsupported_inputs_fail_clearly(isolated_cache: Path) -> None:
    assert hf_tensor_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="unsupported GGUF tensor 'rope_freqs.weight'"):
        hf_tensor_name("rope_freqs.weight")
    w = gguf.GGUFWriter(str(isolated_cache / "x.gguf"), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma3'; supported: \\['llama', 'qwen3'\\]"):
        resolve_model(str(isolated_cache / "x.gguf"))
    assert not list((isolated_cache / "cache" / "models").iterdir())  # nothing half-written left behind

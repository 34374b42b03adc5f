"""Model names and paths resolve to complete Hugging Face-style dirs, built once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from pdserve.checkpoints import resolve as model_registry
from pdserve.checkpoints.resolve import resolve_model


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_model("smollm2-135m")  # the default user cache: converted once per machine


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2 / "tokenizer.json"))


def test_smollm2_dir_has_the_standard_layout(smollm2: Path) -> None:
    assert resolve_model(None) == smollm2  # the default model
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert (config["num_key_value_heads"], config["rms_norm_eps"], config["rope_theta"]) == (3, 1e-5, 100000.0)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_cfg = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    assert "<|im_start|>assistant" in tok_cfg["chat_template"]


def test_smollm2_tokenizer_matches_the_reference_ids(smollm2_tokenizer: Tokenizer) -> None:
    # GPT-2 byte-level BPE with single-digit splitting (llama.cpp's "smollm" pre-tokenizer).
    assert smollm2_tokenizer.encode("What is the capital of France?").ids == [1780, 314, 260, 3575, 282, 4649, 47]
    assert smollm2_tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n").ids == [1, 4093, 198, 26843, 2, 198]
    assert smollm2_tokenizer.encode(" 2024").tokens == ["Ġ", "2", "0", "2", "4"]
    vocab = smollm2_tokenizer.get_vocab()
    for token in ("Ġcapital", "ĠFrance", "Hello", "ĠParis"):
        text = smollm2_tokenizer.decode([vocab[token]])
        assert smollm2_tokenizer.encode(text).ids == [vocab[token]]


def gpt2_byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def test_smollm2_vocab_lacks_only_bytes_that_text_rarely_needs(smollm2_tokenizer: Tokenizer) -> None:
    """SmolLM2's own vocabulary has no token for 21 bytes (so no tokenizer can round-trip text with them):
    UTF-8's invalid lead bytes, the leads of code points U+40000..U+BFFFF and six ASCII control characters."""
    vocab = smollm2_tokenizer.get_vocab()
    missing = [b for b, symbol in enumerate(gpt2_byte_symbols()) if symbol not in vocab]
    assert missing == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]


@settings(max_examples=200, deadline=None)
@given(
    st.text(
        alphabet=st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters="\x04\x06\x13\x14\x16\x1d"),
        max_size=60,
    )
)
def test_smollm2_tokenizer_round_trips_text(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text).ids
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text


def file_identities(model_dir: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file in a dir: a rebuild renames a new dir into place, changing both."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in model_dir.iterdir()}


def test_resolving_a_built_model_reuses_it(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rebuild(source: Path, out: Path) -> None:
        raise AssertionError(f"the built model was converted again from {source}")

    before = file_identities(smollm2)
    monkeypatch.setattr(model_registry, "convert_gguf", no_rebuild)
    assert resolve_model("smollm2-135m") == smollm2
    assert file_identities(smollm2) == before


def test_qwen3_tiny_and_local_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("qwen3-tiny"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tiny = tmp_path / "models" / "qwen3-tiny"
    assert results == [tiny] * 3  # concurrent first runs all get the one complete dir
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["qwen3-tiny"]  # no temp dirs left
    assert {p.name for p in tiny.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((tiny / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (151936, 64, 2)
    assert "enable_thinking" in json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    assert resolve_model(str(tiny)) == tiny  # a local HF dir is used in place
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="needs config.json and \\*.safetensors"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9")

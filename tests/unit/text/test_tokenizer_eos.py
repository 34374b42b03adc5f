"""The tokenizer's EOS ids: what a render server (no engine) uses to tell an EOS stop in derender."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.checkpoints.resolve import resolve_model
from pdserve.engine.runners.torch_runner import read_model_facts
from pdserve.text.tokenizer import Tokenizer
from tests.modeldirs import qwen3_model_dir


def test_tokenizer_alone_has_its_own_eos() -> None:
    tok = Tokenizer.load("qwen3")
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)


def test_generation_config_adds_every_eos_id(tmp_path: Path) -> None:
    qwen3_model_dir(tmp_path, config={"eos_token_id": 151645}, generation_config={"eos_token_id": [151643, 151645, 7]})
    assert Tokenizer.load(str(tmp_path)).eos_token_ids == (151645, 151643, 7)


@pytest.mark.parametrize("model", ["qwen3-tiny", "smollm2-135m"])
def test_model_dir_tokenizer_agrees_with_the_engine(model: str) -> None:
    """An engine server loads its tokenizer from the model dir: both must see the same EOS ids."""
    model_dir = resolve_model(model)
    engine_eos = read_model_facts(model_dir).eos_token_ids
    assert set(Tokenizer.load(str(model_dir)).eos_token_ids) == set(engine_eos)
    assert Tokenizer.load(str(model_dir)).eos_token_ids[0] == engine_eos[0]

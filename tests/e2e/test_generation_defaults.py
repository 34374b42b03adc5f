"""A model's generation_config.json sampling defaults, applied as vLLM applies them (``--generation-config auto``).

OpenAI requests (and their render) take the model's value for each sampling knob the client left out
(user, then model, then OpenAI default); a missing ``max_tokens`` is the model's ``max_new_tokens``
capped by the room left, on generate too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.modeldirs import qwen3_model_dir
from tests.serverproc import ServerProcess

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 7}
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    generation_config = {"eos_token_id": [151645, 151643], "do_sample": True, **MODEL_DEFAULTS}
    return qwen3_model_dir(tmp_path_factory.mktemp("with-generation-config"), generation_config=generation_config)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", str(model_dir), "--script", str(SCRIPTS),
                       "--max-model-len", "256") as srv:
        yield srv


def post(srv: ServerProcess, path: str, body: dict) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_tokenizer_reads_the_models_sampling_defaults(model_dir: Path) -> None:
    defaults = Tokenizer.load(str(model_dir)).generation_defaults
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    assert Tokenizer.load("qwen3").generation_defaults == {}  # no generation_config.json: no defaults


def test_render_fills_what_the_client_left_out_from_the_model(server: ServerProcess) -> None:
    sp = post(server, "/v1/chat/completions/render", CHAT)["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["repetition_penalty"], sp["max_tokens"]) == \
        (0.6, 0.95, 20, 1.05, 7)
    mine = post(server, "/v1/chat/completions/render", {**CHAT, "temperature": 0.2, "top_k": 5, "max_tokens": 30})
    sp = mine["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_tokens"]) == (0.2, 0.95, 5, 30)
    # Completions default max_tokens to 16 (OpenAI's and vLLM's); an explicit null takes the model's.
    sp = post(server, "/v1/completions/render", {"prompt": "Hi"})[0]["sampling_params"]
    assert (sp["temperature"], sp["top_k"], sp["max_tokens"]) == (0.6, 20, 16)
    assert post(server, "/v1/completions/render", {"prompt": "Hi", "max_tokens": None})[0]["sampling_params"][
        "max_tokens"] == 7


def test_a_missing_max_tokens_is_the_models_max_new_tokens(server: ServerProcess) -> None:
    scripted = {"extra_args": {"script_index": 0}}  # a script far longer than 7 tokens
    gen = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": scripted})
    assert len(gen["choices"][0]["token_ids"]) == 7 and gen["choices"][0]["finish_reason"] == "length"
    chat = post(server, "/v1/chat/completions", {**CHAT, "vllm_xargs": {"script_index": 0}})
    assert chat["usage"]["completion_tokens"] == 7
    longer = post(server, "/inference/v1/generate",
                  {"token_ids": PROMPT, "sampling_params": {**scripted, "max_tokens": 9}})
    assert len(longer["choices"][0]["token_ids"]) == 9

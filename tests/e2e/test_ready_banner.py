"""A server says, once it accepts connections, where it listens and what it serves (as ``vllm serve`` does)."""

from __future__ import annotations

import torch

from pdserve.engine.dtype_choice import choose_dtype
from pdserve.engine.kernels import choose_kernels
from tests.e2e.test_generate import SCRIPTS
from tests.serverproc import ServerProcess
from tests.waiting import wait_until


def banner(srv: ServerProcess) -> str:
    text = wait_until(lambda: "pdserve ready on" in srv.log() and srv.log(), "the server prints its ready banner")
    assert isinstance(text, str)
    return text[text.index("pdserve ready on"):]


def test_a_generate_server_with_parsers_names_its_model_engine_parsers_and_routes() -> None:
    with ServerProcess("serve", "--engine", "scripted", "--script", str(SCRIPTS), "--reasoning-parser", "qwen3",
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--max-num-seqs", "4") as srv:
        text = banner(srv)
        assert f"pdserve ready on {srv.url}" in text
        assert "engine     scripted (engine-core process " in text and "max_model_len" in text and "max_num_seqs 4" in text
        assert "tokenizer  qwen3" in text
        assert "parsers    reasoning qwen3, tools hermes" in text
        assert "streams    a chunk per engine step" in text
        assert "/inference/v1/generate (tokens, text, derender)" in text and "/v1/chat/completions" in text


def test_the_torch_engine_core_reports_its_process_threads_and_dtype() -> None:
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "128") as srv:
        text = banner(srv)
        assert "model      qwen3-tiny" in text
        assert "engine     torch (engine-core process " in text and "intra-op threads" in text
        # --dtype auto, the default, names the dtype this CPU got and why.
        auto = choose_dtype("auto")
        assert f", {auto.dtype} ({auto.reason})" in text


def test_a_dtype_asked_for_is_the_one_that_runs() -> None:
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "128", "--dtype", "float32") as srv:
        text = banner(srv)
        assert ", float32 (--dtype)" in text
        # The kernels and why: pdserve's own on an AVX2 CPU, oneDNN and SDPA elsewhere.
        assert f", kernels: {choose_kernels(torch.float32).reason}); " in text


def test_render_and_tokens_only_roles_say_what_they_lack() -> None:
    with ServerProcess("launch", "render", "--tokenizer", "qwen3") as srv:
        text = banner(srv)
        assert "engine     none (render/derender only)" in text and "/inference/v1/generate" not in text
    with ServerProcess("serve", "--engine", "scripted", "--script", str(SCRIPTS), "--tokens-only") as srv:
        text = banner(srv)
        assert "tokenizer  none (--tokens-only)" in text and "/inference/v1/generate (tokens only)" in text
        assert "/v1/chat/completions" not in text

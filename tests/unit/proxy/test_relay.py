"""The proxy's relay builds the client's answer with the coupled endpoints' surfaces: decode-leg chunks
and responses in, OpenAI chunks and responses out (tests/unit/output/test_surfaces.py proves the surfaces
give the same answer from a relayed choice as from a local choice state)."""

from __future__ import annotations

from typing import Any

from pdserve.proxy import relay

USAGE = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


def derender_chunk(**choice: Any) -> dict[str, Any]:
    base = {"index": 0, "finish_reason": None, "stop_reason": None, "token_ids": [7], "logprobs": None,
            "delta": {"role": None, "content": None, "reasoning": None}}
    return {"request_id": "generate-tokens-x", "usage": None, "output_mode": "derender", "choices": [{**base, **choice}]}


def test_a_chat_chunk_drops_the_role_and_keeps_usage() -> None:
    surface = relay.chat_surface("chatcmpl-x", "m", 2, return_token_ids=True)
    assert [c["choices"][0]["index"] for c in surface.opening()] == [0, 1]
    chunk = derender_chunk(delta={"role": "assistant", "content": "hi", "reasoning": None})
    chunk["usage"] = USAGE
    out = relay.chunk(surface, chunk)
    assert out is not None
    assert out["id"] == "chatcmpl-x" and out["object"] == "chat.completion.chunk" and out["model"] == "m"
    assert out["choices"] == [{"index": 0, "delta": {"role": None, "content": "hi", "reasoning": None},
                               "logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": [7]}]
    assert out["usage"] == {**USAGE, "prompt_tokens_details": None}


def test_a_chat_step_with_nothing_for_the_client_is_left_out() -> None:
    assert relay.chunk(relay.chat_surface("c", "m", 1, return_token_ids=False), derender_chunk()) is None
    shown = relay.chunk(relay.chat_surface("c", "m", 1, return_token_ids=True), derender_chunk())
    assert shown is not None and shown["choices"][0]["token_ids"] == [7]


def test_completions_chunks_keep_text_offsets_and_cut_candidates() -> None:
    surface = relay.completions_surface("cmpl-x", "m", return_token_ids=False, logprobs=0)
    entry = {"token": "ab", "logprob": -1.0, "bytes": None,
             "top_logprobs": [{"token": "ab", "logprob": -1.0, "bytes": None},
                              {"token": "c", "logprob": -2.0, "bytes": None}]}
    chunk = {"request_id": "g", "output_mode": "text",
             "choices": [{"index": 0, "text": "ab", "token_ids": [1], "logprobs": {"content": [entry]}}]}
    first, second = relay.chunk(surface, chunk), relay.chunk(surface, chunk)
    assert first is not None and second is not None
    assert first["choices"][0]["logprobs"] == {"text_offset": [0], "token_logprobs": [-1.0], "tokens": ["ab"],
                                               "top_logprobs": [{"ab": -1.0}]}
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert first["choices"][0]["token_ids"] is None


def test_a_derendered_completions_chunk_follows_the_same_rule() -> None:
    surface = relay.completions_surface("cmpl-x", "m", return_token_ids=False, logprobs=None)
    held = {"id": "g", "choices": [{"index": 0, "text": "", "finish_reason": None}]}
    assert relay.derendered_completion(surface, {"choices": [{"index": 0, "token_ids": []}]}, held) is None
    renamed = relay.derendered_completion(surface, {"choices": [{"index": 0, "token_ids": [4]}]}, held)
    assert renamed is not None and renamed["id"] == "cmpl-x" and renamed["model"] == "m"


def test_a_derender_answer_loses_the_decode_members_metrics() -> None:
    """/derender passes a generate response's metrics through; the client's metrics are the proxy's own."""
    answer = {"id": "g", "model": "tok", "choices": [], "metrics": {"time_to_first_token_ms": 1.0}}
    assert relay.renamed(answer, "chatcmpl-x", "m") == {"id": "chatcmpl-x", "model": "m", "choices": [],
                                                        "metrics": None}


def test_batch_answers_from_decode_responses() -> None:
    chat = relay.chat_response(relay.chat_surface("chatcmpl-x", "m", 1, return_token_ids=True), {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                     "token_ids": [1, 2], "logprobs": None}],
        "usage": USAGE, "kv_transfer_params": {"k": 1},
    }, [9, 9, 9])
    assert chat["choices"][0]["message"]["content"] == "hi" and chat["choices"][0]["token_ids"] == [1, 2]
    assert chat["prompt_token_ids"] == [9, 9, 9] and chat["kv_transfer_params"] == {"k": 1}
    completion = relay.completion_response(relay.completions_surface("cmpl-x", "m", True, None), {
        "choices": [{"index": 0, "text": "hi", "finish_reason": None, "token_ids": [1]}], "usage": USAGE,
    }, [9])
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert completion["choices"][0]["prompt_token_ids"] == [9] and completion["usage"]["total_tokens"] == 5

"""What the interop P/D tests ask with the openai SDK, and how they fold its answers.

The random qwen3-tiny answers greedy requests with one token repeated; sampled (seeded) with the pieces
of :data:`MARKUP` favoured, its answers mix reasoning and tool-call markup, so the reasoning and tool
parsers have something to parse.
"""

from __future__ import annotations

from typing import Any

import openai
from tokenizers import Tokenizer

from pdserve.checkpoints.builtin import qwen3_tokenizer_dir

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " Paris",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}')


def markup_bias() -> dict[str, int]:
    """A ``logit_bias`` that makes :data:`MARKUP`'s tokens the likely ones."""
    tok = Tokenizer.from_file(str(qwen3_tokenizer_dir() / "tokenizer.json"))
    return {str(i): 10 for piece in MARKUP for i in tok.encode(piece, add_special_tokens=False).ids}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def folded_stream(c: openai.OpenAI, kwargs: dict[str, Any]) -> tuple[str, str, list[Any], list[int], int | None]:
    """A streamed chat folded: content, reasoning, tool-call deltas, token ids, usage's completion tokens."""
    content, reasoning, calls, ids, tokens = "", "", [], [], None
    for chunk in c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            calls += [(t.index, t.function and t.function.model_dump()) for t in choice.delta.tool_calls or []]
            ids += (choice.model_extra or {}).get("token_ids") or []
    return content, reasoning, calls, ids, tokens


def message_of(c: openai.OpenAI, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """A batch chat's message (content, reasoning, tool calls) and token ids (``return_token_ids``)."""
    choice = c.chat.completions.create(**kwargs).choices[0]
    message = choice.message.model_dump()
    return {k: message.get(k) for k in ("content", "reasoning", "tool_calls")}, (choice.model_extra or {})["token_ids"]

"""What each leg's ``/inference/v1/generate`` body carries, built from one rendered request.

A rendered request (``/v1/{chat/,}completions/render``) is already a generate body. The prefill leg
only has to fill the prompt's KV, so everything that shapes *output* is reset there: one token, no
stream, ``tokens`` out, and the fields that would make a lean (``--tokens-only``) prefill server
refuse the request or do wasted work are dropped. The decode leg is the rendered request as the
client asked for it, plus the prefill's ``kv_transfer_params`` (opaque, relayed unchanged).
"""

from __future__ import annotations

from typing import Any

from pdserve.protocol.generate import OutputMode, parses_message

# vLLM 0.33's NixlConnector: what a router asks the prefill side for.
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True}

# Top-level fields the prefill leg drops: parser context and stream shaping read output only.
PREFILL_DROPPED_FIELDS = ("parse_context", "chat_request", "reasoning_parser_kwargs", "reasoning_ended",
                          "stream_options")
# Sampling fields the prefill leg drops. min_tokens > 1 would be a 400 against max_tokens=1; stop
# strings and bad_words are 400s on a --tokens-only server; logprobs of a discarded token are waste.
PREFILL_DROPPED_SAMPLING = ("min_tokens", "stop", "include_stop_str_in_output", "bad_words", "logprobs",
                            "prompt_logprobs", "output_kind")
# Fields only the derender level reads; a tokens/text decode leg leaves them out.
DERENDER_ONLY_FIELDS = ("parse_context", "chat_request", "reasoning_parser_kwargs", "reasoning_ended")


def prefill_body(rendered: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the rendered prompt, one token, no stream, ``tokens``, KV kept for a remote decode."""
    body = {k: v for k, v in rendered.items() if k not in PREFILL_DROPPED_FIELDS}
    sampling = {k: v for k, v in (rendered.get("sampling_params") or {}).items() if k not in PREFILL_DROPPED_SAMPLING}
    sampling["max_tokens"] = 1
    sampling["n"] = 1
    body.update(
        sampling_params=sampling,
        output_mode="tokens",
        stream=False,
        return_token_ids=None,
        kv_transfer_params=dict(PREFILL_KV_PARAMS),
    )
    return body


def decode_body(rendered: dict[str, Any], mode: OutputMode, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg: the rendered request in ``mode`` with the prefill's ``kv_transfer_params`` as
    they came back (``None`` when the prefill returned none: the decode server then prefills itself)."""
    dropped = () if parses_message(mode) else DERENDER_ONLY_FIELDS
    body = {k: v for k, v in rendered.items() if k not in dropped}
    body["output_mode"] = mode
    body["kv_transfer_params"] = kv_transfer_params
    return body

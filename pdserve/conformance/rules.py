"""The rules, as data: an id, what the rule says (docs/protocol.md's words), and its check.

A check returns its evidence on a pass and raises ``Failed`` (with the evidence), ``Unsupported`` (the
server lacks a capability the rule needs, e.g. ``output_mode="derender"`` on vLLM 0.32) or
``NotApplicable`` (the rule depends on how the server was started, e.g. its parsers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.conformance import checks_generate as g
from pdserve.conformance import checks_text as t
from pdserve.conformance.server import DERENDER, TEXT, Server


@dataclass(frozen=True)
class Rule:
    id: str
    says: str
    check: Callable[[Server], str]


RULES: tuple[Rule, ...] = (
    # output modes and their echo
    Rule("mode.tokens", "no output_mode: token_ids, finish_reason and stop_reason on every choice", g.tokens_default),
    Rule("mode.text", "output_mode=text adds text; the greedy ids equal tokens mode's", g.text_mode),
    Rule("echo.tokens", "output_mode=tokens is echoed on the response and every chunk", g.echo("tokens")),
    Rule("echo.text", "output_mode=text is echoed on the response and every chunk", g.echo("text")),
    Rule("echo.derender", "output_mode=derender is echoed on the response and every chunk", g.echo("derender")),
    # 400 rules
    Rule("reject.empty_token_ids", "empty token_ids is a 400", t.reject(t.REJECTS["empty_token_ids"])),
    Rule("reject.negative_token_id", "a negative token id is a 400", t.reject(t.REJECTS["negative_token_id"])),
    Rule(
        "reject.token_id_outside_vocabulary",
        "a token id outside the vocabulary is a 400",
        t.reject(t.REJECTS["token_id_outside_vocabulary"]),
    ),
    Rule(
        "reject.missing_sampling_params",
        "sampling_params is required (400)",
        t.reject(t.REJECTS["missing_sampling_params"]),
    ),
    Rule(
        "reject.over_model_len",
        "prompt + max_tokens over the model length is a 400",
        t.reject(t.REJECTS["prompt_plus_max_tokens_over_model_len"]),
    ),
    Rule("reject.n_over_limit", "n over the server's limit is a 400", t.reject(t.REJECTS["n_over_limit"])),
    Rule(
        "reject.logprobs_over_limit",
        "logprobs over the server's maximum is a 400",
        t.reject(t.REJECTS["logprobs_over_limit"]),
    ),
    Rule("reject.malformed_json", "malformed JSON is a 400", t.reject_malformed_json),
    Rule("reject.unknown_model", "an unknown model is a 404", t.reject_unknown_model),
    Rule(
        "reject.text_without_detokenize",
        "output_mode=text with detokenize=false is a 400",
        t.reject(t.REJECTS["text_without_detokenize"], TEXT),
    ),
    Rule(
        "reject.chat_request_without_derender",
        "chat_request without output_mode=derender is a 400",
        t.reject(t.REJECTS["chat_request_without_derender"], DERENDER),
    ),
    Rule(
        "reject.derender_without_context",
        "output_mode=derender without parser context on a parser server is a 400",
        t.reject_derender_without_context,
    ),
    Rule("reject.abort_without_ids", "abort without request_ids is a 400", t.reject_abort_without_ids),
    # stop strings and ids
    Rule("stop.length", "max_tokens ends a stream with finish_reason=length and stop_reason=null", g.stop_length),
    Rule(
        "stop.token_id",
        "a stop token id ends the output with that id, finish_reason=stop, stop_reason=id",
        g.stop_token_id,
    ),
    Rule("stop.string", "a stop string is cut from text, stop_reason is the string", g.stop_string(False)),
    Rule("stop.string_included", "include_stop_str_in_output keeps the stop string", g.stop_string(True)),
    Rule("stop.string_stream", "a stop string cuts the streamed text the same way", g.stop_string_stream),
    # end of stream
    Rule("stream.end", "one choice per event, finish_reason on the last, then data: [DONE]", g.stream_end),
    Rule("stream.tokens_equal_batch", "streamed ids fold to the batch ids", g.stream_equals_batch(None)),
    Rule("stream.text_equal_batch", "streamed text folds to the batch text", g.stream_equals_batch("text")),
    Rule("stream.usage", "include_usage ends with a choices: [] chunk carrying the usage", g.stream_usage),
    Rule(
        "stream.holdback_flushed",
        "text held back for a stop string is flushed when the stream ends",
        g.stream_holdback_flushed,
    ),
    # abort
    Rule("abort.stream", "an aborted stream ends with finish_reason=abort, then [DONE]", g.abort_stream),
    Rule("abort.unknown_id", "aborting an unknown id is a 200", g.abort_unknown),
    # render shape
    Rule(
        "render.shape",
        "chat render returns a GenerateRequest (chatcmpl- id, token_ids, sampling_params, model)",
        t.render_shape,
    ),
    Rule("render.accepted", "generate accepts render's output unchanged", t.render_accepted),
    Rule("render.completions", "completions render returns one GenerateRequest per prompt", t.render_completions),
    Rule("render.stream", "render carries stream: true into the GenerateRequest", t.render_stream_flag),
    # derender batch and stream
    Rule(
        "derender.equals_text",
        "/derender of a tokens answer equals the text answer (no parsers)",
        t.derender_equals_text,
    ),
    Rule(
        "derender.stream_equals_batch",
        "streaming /derender chunk by chunk folds to the batch message",
        t.derender_stream_equals_batch,
    ),
    Rule(
        "derender.inline_equals_endpoint",
        "output_mode=derender equals /derender of the tokens answer",
        t.derender_inline_equals_endpoint,
    ),
    Rule(
        "derender.inline_stream", "streamed output_mode=derender folds to the batch message", t.derender_inline_stream
    ),
    Rule("derender.reasoning", "the reasoning parser splits <think> reasoning from content", t.derender_reasoning),
    Rule("derender.tool_call", "the tool parser returns the call and finish_reason=tool_calls", t.derender_tool_call),
    # logprob shapes
    Rule("logprobs.tokens", "tokens mode: int-id logprobs, one entry per id, sampled id first", g.logprobs_tokens),
    Rule("logprobs.text", "text mode: chat-shape logprobs {token, logprob, bytes, top_logprobs}", g.logprobs_text),
)

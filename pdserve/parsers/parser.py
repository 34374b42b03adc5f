"""The per-choice chat parser: reasoning + tool calls + message assembly, batch and streaming.

One ``ChatParser`` is created per choice when a request starts. Batch
(``parse``) and streaming (``step``) run the same two-stage pipeline
(reasoning parser, then tool parser) and fold the same events, so the
concatenated stream deltas equal the batch message for any chunking of the
output. Streaming is incremental: each step costs O(len(delta)).

Assembly follows vLLM 0.33 (reference sections 9.2-9.6):

* ``include_reasoning=false`` drops reasoning (and ``hide_metadata`` tells the
  caller to drop logprobs and token ids);
* tool calls are kept for ``tool_choice`` ``"required"`` / a named tool, and
  for ``"auto"`` (or null) when the request has tools; otherwise they are
  parsed (so their markup leaves the content) and dropped. With
  ``tool_choice="none"`` the hermes parser does not run at all (raw text
  stays content) while qwen3_coder still strips its markup;
* ``parallel_tool_calls=false`` keeps only the first call;
* a forced choice (required/named) reports content ``""`` instead of null;
* a batch message without reasoning text reports reasoning ``""`` for
  deepseek_r1 (when it parsed reasoning) and null otherwise, as vLLM does; a
  stream never sends an empty delta, so it folds to null either way;
* tool parsers learn whether the output was cut by ``length`` (hermes keeps a
  call cut short after its name, but not one the model left broken);
* finish reason ``stop`` (or none) becomes ``tool_calls`` when calls were
  kept, unless the tool was named; ``length`` and others stay.

The parser path expects text decoded with special tokens kept, so that the
markup tokens are in the text. A terminating EOS (``<|im_end|>`` for Qwen3) is
not part of that text: the frontend's detokenizer (pdserve.text.detokenizer)
drops the stop token before the parser sees the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from pdserve.parsers.events import Content, Event, Reasoning, ToolArgs, ToolStart
from pdserve.parsers.reasoning import ReasoningParser
from pdserve.parsers.registry import reasoning_parser_class, tool_parser_class
from pdserve.parsers.tools import ToolParser
from pdserve.parsers.vocab import Vocab
from pdserve.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    StreamDelta,
    TextDelta,
    ToolCall,
    make_tool_call_id,
)


@dataclass(frozen=True)
class ParserConfig:
    """The server's parser flags; unknown names fail here, at startup.

    The tool parser is active only with ``enable_auto_tool_choice`` (as in vLLM).
    """

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)
        if self.tool_call_parser is not None:
            tool_parser_class(self.tool_call_parser)

    @property
    def reasoning_class(self) -> type[ReasoningParser] | None:
        return reasoning_parser_class(self.reasoning_parser) if self.reasoning_parser is not None else None

    @property
    def tool_class(self) -> type[ToolParser] | None:
        if self.tool_call_parser is None or not self.enable_auto_tool_choice:
            return None
        return tool_parser_class(self.tool_call_parser)

    @property
    def configured(self) -> bool:
        """Whether derender needs parser context (a reasoning parser, or an active tool parser)."""
        return self.reasoning_class is not None or self.tool_class is not None

    def validate(self, vocab: Vocab) -> None:
        """Check the active parsers against the tokenizer (their markup must be single tokens)."""
        for parser_class in (self.reasoning_class, self.tool_class):
            if parser_class is not None:
                parser_class.validate(vocab)


class _Pipeline:
    """Reasoning stage, then tool stage, over one choice's output."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def scanned(self) -> int:
        return sum(stage.scanned for stage in (self.reasoning, self.tools) if stage is not None)

    def run(self, text: str, finish_reason: str | None, finished: bool) -> list[Event]:
        """Events for the next piece of output; ``finished`` flushes everything held back."""
        first: list[Event] = []
        if self.reasoning is None:
            if text:
                first.append(Content(text))
        else:
            if text:
                self.reasoning.feed(text, first)
            if finished:
                self.reasoning.finish(first)
        if self.tools is None:
            return first
        out: list[Event] = []
        for event in first:
            if isinstance(event, Content):
                self.tools.feed(event.text, out)
            else:
                out.append(event)
        if finished:
            self.tools.finish(out, cut=finish_reason == "length")
        return out


class ChatParser:
    """Parses one choice's output into an assistant message (``parse``) or deltas (``step``).

    ``parse`` is a pure function of the text (it may be called any number of
    times); ``step`` keeps streaming state and must be called once per engine
    step, in order, until a step that carries a finish reason.
    """

    def __init__(
        self,
        config: ParserConfig,
        tokenizer: Vocab,
        chat_request: ChatCompletionRequest | None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._vocab = tokenizer
        self._request = chat_request
        self._prompt_token_ids = prompt_token_ids
        self.active = config.configured and chat_request is not None
        self._reasoning_class = config.reasoning_class if self.active else None
        self._tool_class: type[ToolParser] | None = None
        self._keeps_tool_calls = False
        self._named_tool = False
        self._forced = False
        self._parallel = True
        self._include_reasoning = True
        if chat_request is not None and self.active:
            choice = chat_request.tool_choice
            tool_class = config.tool_class
            if tool_class is not None and (choice != "none" or tool_class.RUNS_WHEN_TOOL_CHOICE_NONE):
                self._tool_class = tool_class
            self._named_tool = chat_request.named_tool() is not None
            self._forced = self._named_tool or choice == "required"
            auto = choice in ("auto", None) and tool_class is not None and bool(chat_request.tools)
            self._keeps_tool_calls = self._forced or auto
            self._parallel = chat_request.parallel_tool_calls is not False
            self._include_reasoning = chat_request.include_reasoning
        # Parsed with reasoning hidden: callers must also drop logprobs and token ids (read per chunk).
        self.hide_metadata = self.active and not self._include_reasoning
        self._stream: _Pipeline | None = None
        self._finished = False
        self._tool_call_ids: list[str] = []
        self.tools_streamed = False

    @property
    def tool_call_ids(self) -> list[str]:
        """Ids of the streamed tool calls, by index (what a stateless replay pins)."""
        return list(self._tool_call_ids)

    @property
    def scanned_chars(self) -> int:
        """Characters the streaming pipeline's tag scanners examined (grows with the output, not output x steps)."""
        return self._stream.scanned if self._stream is not None else 0

    # ------------------------------------------------------------ batch

    def parse(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> tuple[ChatMessage, str]:
        """The whole output as one assistant message, and the chat finish reason.

        ``token_ids`` is the output's ids as the engine produced them; markup is
        found in ``text`` (where every tag survives, since the parser path keeps
        special tokens), so the result does not depend on how text and ids align.
        """
        if not self.active:
            return ChatMessage(content=text), self._resolve_finish_reason(finish_reason, False)
        pipeline = self._pipeline()
        reasoning, content, calls = _fold(self._visible(pipeline.run(text, finish_reason, finished=True)))
        tool_calls: list[ToolCall] = []
        if pipeline.tools is not None:
            finalize = pipeline.tools.finalize_arguments
            for name, parts in calls.values():
                assert name is not None, "one pass over the whole text sees every call's start"
                tool_calls.append(ToolCall(function=FunctionCall(name=name, arguments=finalize("".join(parts)))))
        message = ChatMessage(
            content="".join(content) or ("" if self._forced else None),
            reasoning="".join(reasoning) or self._empty_reasoning(pipeline),
            tool_calls=tool_calls,
        )
        return message, self._resolve_finish_reason(finish_reason, bool(tool_calls))

    # ------------------------------------------------------------ streaming

    def step(
        self, delta_text: str, delta_ids: Sequence[int], finish_reason: str | None
    ) -> tuple[StreamDelta | None, str | None]:
        """One engine step: the delta to send (None: nothing to send) and the chat finish reason.

        ``delta_text`` is the step's newly detokenized text, ``delta_ids`` its
        token ids (not needed for parsing, see ``parse``). A step with a finish
        reason flushes everything held back (a partial tag at the end, deferred
        whitespace, unclosed tool-call arguments), even when its text is empty;
        the caller still sends a final chunk when the delta is None. The role is
        the caller's business.
        """
        if self._finished:
            raise RuntimeError("ChatParser.step called after the step that carried the finish reason")
        finished = finish_reason is not None
        self._finished = finished
        if not self.active:
            return (TextDelta(content=delta_text) if delta_text else None), finish_reason
        if self._stream is None:
            self._stream = self._pipeline()
        reasoning = self._stream.reasoning
        if not finished and reasoning is not None and reasoning.take_plain_reasoning(delta_text):
            # Most steps of a thinking model: one piece of reasoning, which the tool stage never sees.
            return (TextDelta(reasoning=delta_text) if self._include_reasoning else None), None
        delta = self._delta(self._stream.run(delta_text, finish_reason, finished))
        resolved = self._resolve_finish_reason(finish_reason, self.tools_streamed) if finished else None
        return delta, resolved

    # ------------------------------------------------------------ internals

    def _pipeline(self) -> _Pipeline:
        request = self._request
        assert request is not None
        reasoning = None
        if self._reasoning_class is not None:
            reasoning = self._reasoning_class(self._vocab, request.chat_template_kwargs, self._prompt_token_ids)
        tools = self._tool_class(request.tools) if self._tool_class is not None else None
        return _Pipeline(reasoning, tools)

    def _empty_reasoning(self, pipeline: _Pipeline) -> str | None:
        """What a batch message reports when no reasoning text came: ``""`` or None, per parser (as vLLM).

        A stream cannot carry an empty string, so its folded reasoning is None either way.
        """
        reasoning = pipeline.reasoning
        if reasoning is not None and self._include_reasoning and reasoning.reports_empty_reasoning:
            return ""
        return None

    def _visible(self, events: Iterable[Event]) -> Iterator[Event]:
        for event in events:
            if isinstance(event, Reasoning):
                if self._include_reasoning:
                    yield event
            elif isinstance(event, ToolStart | ToolArgs):
                if self._keeps_tool_calls and (self._parallel or event.index == 0):
                    yield event
            else:
                yield event

    def _delta(self, events: list[Event]) -> StreamDelta | None:
        if len(events) == 1:  # most steps: one piece of reasoning or content, no folding needed
            event = events[0]
            if type(event) is Reasoning:
                return TextDelta(reasoning=event.text) if self._include_reasoning and event.text else None
            if type(event) is Content:
                return TextDelta(content=event.text) if event.text else None
        reasoning, content, calls = _fold(self._visible(events))
        if not (reasoning or content or calls):
            return None
        tool_calls = []
        for index, (name, parts) in calls.items():
            arguments = "".join(parts) or None
            if name is None:
                tool_calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
                continue
            call_id = make_tool_call_id()
            self._tool_call_ids.append(call_id)
            function = DeltaFunctionCall(name=name, arguments=arguments)
            tool_calls.append(DeltaToolCall(index=index, id=call_id, type="function", function=function))
        if not tool_calls:
            return TextDelta(reasoning="".join(reasoning) or None, content="".join(content) or None)
        self.tools_streamed = True
        return DeltaMessage(
            reasoning="".join(reasoning) or None,
            content="".join(content) or None,
            tool_calls=tool_calls,
        )

    def _resolve_finish_reason(self, finish_reason: str | None, tools_called: bool) -> str:
        resolved = finish_reason or "stop"
        if tools_called and resolved == "stop" and not self._named_tool:
            return "tool_calls"
        return resolved


def _fold(events: Iterable[Event]) -> tuple[list[str], list[str], dict[int, tuple[str | None, list[str]]]]:
    """Group events into reasoning pieces, content pieces and per-call (name, argument pieces).

    A call's name is None when only its arguments are in ``events`` (its start came earlier).
    """
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, tuple[str | None, list[str]]] = {}
    for event in events:
        if isinstance(event, Reasoning):
            reasoning.append(event.text)
        elif isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, ToolStart):
            calls[event.index] = (event.name, [])
        else:
            calls.setdefault(event.index, (None, []))[1].append(event.text)
    return reasoning, content, calls

"""``qwen3``: think tags, ``<tool_call>`` as an implicit end, prompt- and template-aware start.

Qwen3's template takes ``enable_thinking`` (default true). With thinking off
it writes an empty ``<think>\\n\\n</think>\\n\\n`` into the prompt, so output
starts in content. The prompt check looks only at the current turn (back to
the last ``<|im_start|>``/``<|im_end|>``) so a ``</think>`` from an earlier
assistant turn in the history cannot end this turn's reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.parsers.reasoning.base import THINK_END, THINK_START, ReasoningParser
from pdserve.parsers.scanner import TagSet
from pdserve.parsers.vocab import Vocab

TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    REASONING_TAGS = TagSet(THINK_START, THINK_END, "<tool_call>")
    # A duplicate </think> after reasoning ended is dropped, never shown as content.
    CONTENT_TAGS = TagSet(THINK_END)

    def __init__(
        self,
        vocab: Vocab,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        # Set before the base class decides the start state from them.
        self.thinking_enabled = bool((chat_template_kwargs or {}).get("enable_thinking", True))
        self._boundary_ids = frozenset(i for t in TURN_BOUNDARIES if (i := vocab.token_to_id(t)) is not None)
        super().__init__(vocab, chat_template_kwargs, prompt_token_ids)

    def _starts_in_reasoning(self, prompt_token_ids: Sequence[int] | None) -> bool:
        if prompt_token_ids is None:
            return self.thinking_enabled
        return not self.is_reasoning_end(prompt_token_ids)

    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        for token_id in reversed(prompt_token_ids):
            if token_id == self._end_id:
                return True
            if token_id == self._start_id:
                return False
            if token_id in self._boundary_ids:
                break
        return not self.thinking_enabled

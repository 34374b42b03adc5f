"""Decode-leg migration: a client's stream whose decode member fails goes on on another decode member.

A decode leg breaks when its member drops the connection, goes silent past ``--stall-timeout-s``, ends
the stream without ``[DONE]`` or sends a 5xx error event (it is draining, its engine failed, a KV pull
failed). What the client was sent is known exactly: the ids of every chunk relayed so far. The new leg's
prompt is the rendered prompt plus those ids, its ``max_tokens``/``min_tokens`` what is left of the
client's, its sampling otherwise the client's; it prefills on its own member (no KV hand-off: the first
leg's KV is gone with it). An inline leg (``text``, ``derender``) also sends ``prior_output_chunks``, so
the new member replays the output so far into its detokenizer and parsers, chunk by chunk, without
sending it again; a ``tokens`` leg (``--mode derender-tier``) needs none, since the proxy carries the
``/derender`` state itself. The client sees one stream, with no character twice or missing.

What cannot be resumed exactly is not resumed (the stream ends in an error event naming the failure, as
without migration): ``n`` > 1, ids the decode leg withholds (hidden reasoning), and an inline stream with
stop strings (the text sent runs ahead of the ids sent while a stop string might still match).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.generate import OutputMode, decodes_text
from pdserve.proxy.upstream import UpstreamError

# Why a leg broke: the values of pdserve_proxy_migrations_total's ``cause``.
CAUSES = ("dropped", "stalled", "truncated", "garbage", "error_event")


class LegBroken(Exception):
    """The decode leg failed mid-stream; ``error`` is what the client gets if it cannot go on elsewhere."""

    def __init__(self, cause: str, error: UpstreamError):
        super().__init__(str(error))
        self.cause = cause
        self.error = error


@dataclass
class Resumption:
    """One client stream's record of what it was sent, and whether (and how) another leg may continue it."""

    rendered: dict[str, Any]
    mode: OutputMode  # the decode legs' output mode
    limit: int  # migrations allowed (--migration-limit)
    chunks: list[list[int]] = field(default_factory=list)  # ids of each relayed chunk (choice 0)
    migrations: int = 0
    blocked: str | None = None  # why this stream cannot be resumed, once known
    resumed_at: int = 0  # ids the current leg's prompt holds as prior output

    def __post_init__(self) -> None:
        sampling = self.rendered.get("sampling_params") or {}
        if int(sampling.get("n") or 1) != 1:
            self.blocked = "n > 1"
        elif decodes_text(self.mode) and sampling.get("stop") and not sampling.get("include_stop_str_in_output"):
            self.blocked = "stop strings (the text sent runs ahead of the ids sent)"

    @property
    def sent_ids(self) -> int:
        return sum(len(c) for c in self.chunks)

    def saw(self, chunk: dict[str, Any]) -> None:
        """Record the ids of a relayed chunk (one with choices)."""
        for choice in chunk["choices"]:
            ids = choice.get("token_ids")
            if ids is None:
                self.blocked = self.blocked or "the decode leg withholds token ids (hidden reasoning)"
            elif ids:
                self.chunks.append(list(ids))

    def refusal(self) -> str | None:
        """Why the next break ends the stream instead of migrating it; None: it may migrate."""
        if self.limit <= 0:
            return "migration is off (--migration-limit 0)"
        if self.migrations >= self.limit:
            return f"the stream already moved {self.migrations} time(s) (--migration-limit {self.limit})"
        if self.blocked is not None:
            return f"it cannot be resumed exactly: {self.blocked}"
        if self._left("max_tokens") == 0:
            return "every token it may generate was sent"
        return None

    def _left(self, name: str) -> int | None:
        asked = (self.rendered.get("sampling_params") or {}).get(name)
        return None if asked is None else max(0, int(asked) - self.sent_ids)

    def body(self, decode_body: dict[str, Any]) -> dict[str, Any]:
        """The new leg's generate body, from the one the first leg got (its KV hand-off dropped)."""
        sampling = dict(decode_body["sampling_params"])
        for name in ("max_tokens", "min_tokens"):
            if sampling.get(name) is not None:
                sampling[name] = self._left(name)
        sampling["prompt_logprobs"] = None  # the first leg sent them; the prompt now holds output
        body = {**decode_body, "sampling_params": sampling, "kv_transfer_params": None,
                "token_ids": list(decode_body["token_ids"]) + [i for c in self.chunks for i in c]}
        if decodes_text(self.mode):
            body["prior_output_chunks"] = [len(c) for c in self.chunks]
        self.migrations += 1
        self.resumed_at = self.sent_ids
        return body

    def adjusted(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A resumed leg's chunk as the first leg would have sent it: no prompt echo (the first leg
        sent the prompt's), and on a ``tokens`` leg (no ``prior_output_chunks``) usage that counts the
        prior output as completion tokens, as an inline leg's does."""
        if not self.migrations:
            return chunk
        chunk = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
        usage = chunk.get("usage")
        if usage and not decodes_text(self.mode):
            sent = self.resumed_at
            chunk["usage"] = {**usage, "prompt_tokens": usage["prompt_tokens"] - sent,
                              "completion_tokens": (usage.get("completion_tokens") or 0) + sent}
        return chunk

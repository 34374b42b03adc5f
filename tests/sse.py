"""A small SSE client for tests (httpx streaming), and the checks on a stream that was aborted."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from pdserve.text.tokenizer import Tokenizer


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """Events (parsed JSON) and whether the stream ended with [DONE]."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        events.append(json.loads(payload))
    return events, done


def stream_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60.0):
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(list(r.iter_lines()))


def stream_and_abort(
    url: str, body: dict[str, Any], after_events: int, abort: Callable[[], None], timeout: float = 60.0
) -> tuple[list[dict[str, Any]], bool]:
    """Stream ``body``; once ``after_events`` events arrived call ``abort()``, then read the stream to its end."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # one iterator throughout: the lines read before the abort stay read
        head: list[str] = []
        for line in lines:
            head.append(line)
            if sum(h.startswith("data: {") for h in head) == after_events:
                break
        else:
            raise AssertionError(f"the stream ended before {after_events} events: {head}")
        abort()
        return parse_sse(head + list(lines))


def assert_tail_flushed(
    events: list[dict[str, Any]],
    tok: Tokenizer,
    piece: Callable[[dict[str, Any]], str],
    hold_back: int,
    finish_reason: str = "abort",
) -> None:
    """The final chunk releases the held-back tail and exactly the ids behind it.

    ``piece`` reads a choice's new text (``text`` or ``delta.content``); ``hold_back`` is what the
    request's stop strings hold back (the longest one's length - 1). Ids go out with their text: an id
    whose text reaches into the held-back tail is held with it (and so is a closing EOS), every other
    id was sent earlier.
    """
    *before, final = [ev["choices"][0] for ev in events]
    assert final["finish_reason"] == finish_reason, final
    ids = [i for c in before for i in c["token_ids"]] + final["token_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    released = "".join(piece(c) for c in before)
    assert len(full) > hold_back, "the stream ended too early to show a flush: generate more first"
    assert released + piece(final) == full, "text went missing or was duplicated at the end"
    assert piece(final) == full[-hold_back:], "the final chunk carries exactly the held-back tail"
    sent_earlier = max(
        k for k in range(len(ids) + 1) if len(tok.decode(ids[:k], skip_special_tokens=True)) <= len(released)
    )
    assert final["token_ids"], "the held-back tail's ids arrive with it"
    assert final["token_ids"] == ids[sent_earlier:], "the final chunk carries exactly the held-back ids"

"""Checks of ``/inference/v1/generate`` itself: output modes and their echo, stop handling, streams and
their end, logprob shapes, abort. Each takes the :class:`Server` and returns its evidence on a pass."""

from __future__ import annotations

import threading
from typing import Any

from pdserve.conformance.server import ABORT, DERENDER, TEXT, Server, Unsupported, expect, short


def _choice(response: dict[str, Any]) -> dict[str, Any]:
    choices = response.get("choices") or []
    expect(len(choices) == 1, f"expected one choice, got {short(choices)}")
    return choices[0]


def _ids_are_ints(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


# -- output modes -------------------------------------------------------------------------------------


def tokens_default(server: Server) -> str:
    body = server.body(max_tokens=4)
    choice = _choice(server.generate(body))
    expect(
        _ids_are_ints(choice.get("token_ids")) and len(choice["token_ids"]) == 4,
        f"token_ids of a max_tokens=4 ignore_eos request: {short(choice.get('token_ids'))}",
    )
    expect(choice.get("finish_reason") == "length", f"finish_reason {choice.get('finish_reason')!r}, want 'length'")
    expect(
        "stop_reason" in choice and choice["stop_reason"] is None,
        f"stop_reason {short(choice.get('stop_reason', '<missing>'))}",
    )
    return f"token_ids={choice['token_ids']} finish_reason=length stop_reason=null"


def echo(mode: str) -> Any:
    def check(server: Server) -> str:
        if mode != "tokens":
            server.need(TEXT if mode == "text" else DERENDER)
        batch = server.generate(server.body(mode, max_tokens=3))
        expect(batch.get("output_mode") == mode, f"batch output_mode {batch.get('output_mode')!r}, want {mode!r}")
        s = server.stream(server.body(mode, stream=True, max_tokens=3))
        modes = {ev.get("output_mode") for ev in s.events}
        expect(s.events and modes == {mode}, f"stream chunks' output_mode values {sorted(map(str, modes))}")
        return f"batch and {len(s.events)} stream chunks say output_mode={mode!r}"

    return check


def text_mode(server: Server) -> str:
    server.need(TEXT)
    choice = _choice(server.baseline("text"))
    expect(isinstance(choice.get("text"), str), f"text choice without a text string: {short(choice)}")
    expect(
        _ids_are_ints(choice.get("token_ids")) and len(choice["token_ids"]) == 12,
        f"token_ids {short(choice.get('token_ids'))}",
    )
    tokens = _choice(server.baseline())
    expect(
        choice["token_ids"] == tokens["token_ids"],
        f"greedy ids differ between text {choice['token_ids']} and tokens {tokens['token_ids']}",
    )
    return f"text={choice['text']!r}, the same 12 greedy ids as tokens mode"


# -- stop handling ------------------------------------------------------------------------------------


def stop_length(server: Server) -> str:
    s = server.stream(server.body(stream=True, max_tokens=3))
    last = s.choices()[-1] if s.choices() else {}
    expect(len(s.ids()) == 3 and s.finish() == "length", f"max_tokens=3 streamed {s.ids()}, finish {s.finish()!r}")
    expect(
        "stop_reason" in last and last["stop_reason"] is None,
        f"last chunk's stop_reason {short(last.get('stop_reason', '<missing>'))}",
    )
    return "streamed: 3 ids, finish_reason=length, stop_reason=null on the last chunk"


def stop_token_id(server: Server) -> str:
    ids = _choice(server.baseline())["token_ids"]
    target = ids[3]
    cut = ids.index(target)
    choice = _choice(server.generate(server.body(stop_token_ids=[target])))
    expect(
        choice["token_ids"] == ids[: cut + 1],
        f"stop_token_ids=[{target}]: token_ids {choice['token_ids']}, want {ids[: cut + 1]} (ending with the stop id)",
    )
    expect(choice.get("finish_reason") == "stop", f"finish_reason {choice.get('finish_reason')!r}, want 'stop'")
    expect(choice.get("stop_reason") == target, f"stop_reason {short(choice.get('stop_reason'))}, want {target}")
    return f"stop id {target}: ids cut after it, finish_reason=stop, stop_reason={target}"


# Seeded sampling, not greedy: a tiny random model's greedy text can be one repeated character, where no
# stop string has a first occurrence past the start. A request seed is as reproducible as greedy.
SEEDED = {"temperature": 1.0, "seed": 1234}


def _stop_string(server: Server) -> tuple[str, int, str]:
    """A stop string cut from the seeded text (2 characters, first seen after the text's start)."""
    server.need(TEXT)
    text = _choice(server.baseline("text", **SEEDED))["text"]
    for start in range(1, len(text) - 1):
        candidate = text[start : start + 2]
        if candidate.strip() and text.find(candidate) == start:
            return text, start, candidate
    raise Unsupported(f"the sampled text {text!r} has no usable stop string (model output too short)")


def stop_string(include: bool) -> Any:
    def check(server: Server) -> str:
        text, at, stop = _stop_string(server)
        want = text[: at + len(stop)] if include else text[:at]
        choice = _choice(
            server.generate(server.body("text", stop=[stop], include_stop_str_in_output=include, **SEEDED))
        )
        expect(
            choice["text"] == want,
            f"stop={stop!r} include={include}: text {choice['text']!r}, want {want!r} (full {text!r})",
        )
        expect(choice.get("finish_reason") == "stop", f"finish_reason {choice.get('finish_reason')!r}")
        expect(choice.get("stop_reason") == stop, f"stop_reason {short(choice.get('stop_reason'))}, want {stop!r}")
        return f"stop={stop!r}: text={choice['text']!r}, stop_reason={stop!r}"

    return check


def stop_string_stream(server: Server) -> str:
    text, at, stop = _stop_string(server)
    s = server.stream(server.body("text", stream=True, stop=[stop], **SEEDED))
    expect(s.text() == text[:at], f"streamed text {s.text()!r}, want {text[:at]!r}")
    expect(s.finish() == "stop", f"last finish_reason {s.finish()!r}")
    return f"stop={stop!r} streamed: text={s.text()!r}, finish_reason=stop"


# -- streams ------------------------------------------------------------------------------------------


def stream_end(server: Server) -> str:
    s = server.stream(server.body(stream=True, max_tokens=5))
    expect(not s.problems, "; ".join(s.problems))
    expect(s.done, f"no data: [DONE] after {len(s.events)} events")
    per_event = [len(ev.get("choices") or []) for ev in s.events]
    expect(all(n == 1 for n in per_event), f"choices per event {per_event}, want one each")
    finishes = [c.get("finish_reason") for c in s.choices()]
    expect(
        finishes[-1] == "length" and all(f is None for f in finishes[:-1]),
        f"finish_reason per chunk {finishes}: want null until the last chunk",
    )
    return f"{len(s.events)} events, one choice each, finish_reason only on the last, then [DONE]"


def stream_equals_batch(mode: str | None) -> Any:
    def check(server: Server) -> str:
        if mode == "text":
            server.need(TEXT)
        batch = _choice(server.baseline(mode))
        s = server.stream(server.body(mode, stream=True))
        expect(s.ids() == batch["token_ids"], f"streamed ids {s.ids()} != batch ids {batch['token_ids']}")
        if mode == "text":
            expect(s.text() == batch["text"], f"streamed text {s.text()!r} != batch text {batch['text']!r}")
        expect(s.finish() == batch["finish_reason"], f"finish {s.finish()!r} != {batch['finish_reason']!r}")
        return f"{len(s.events)} chunks fold to the batch answer ({len(s.ids())} ids)"

    return check


def stream_usage(server: Server) -> str:
    s = server.stream({**server.body(stream=True, max_tokens=5), "stream_options": {"include_usage": True}})
    expect(s.events, "no events")
    last = s.events[-1]
    expect(last.get("choices") == [], f"last chunk is not a choices: [] usage chunk: {short(last)}")
    usage = last.get("usage") or {}
    want = {"prompt_tokens": len(server.prompt), "completion_tokens": 5, "total_tokens": len(server.prompt) + 5}
    got = {k: usage.get(k) for k in want}
    expect(got == want, f"usage {got}, want {want}")
    return f"final usage chunk {got}"


def stream_holdback_flushed(server: Server) -> str:
    server.need(TEXT)
    batch = _choice(server.baseline("text"))
    s = server.stream(server.body("text", stream=True, stop=["\u2603never-matches\u2603"]))
    expect(s.text() == batch["text"], f"a never-matching stop string: streamed {s.text()!r}, batch {batch['text']!r}")
    expect(s.done, "no [DONE]")
    return f"held-back text flushed at the end: {s.text()!r}"


# -- logprobs -----------------------------------------------------------------------------------------


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def logprobs_tokens(server: Server) -> str:
    choice = _choice(server.generate(server.body(max_tokens=4, logprobs=2)))
    content = (choice.get("logprobs") or {}).get("content")
    expect(
        isinstance(content, list) and len(content) == len(choice["token_ids"]),
        f"logprobs.content {short(content)} for ids {choice['token_ids']}",
    )
    for pos, (entry, sampled) in enumerate(zip(content, choice["token_ids"], strict=True)):
        expect(
            entry.get("token_id") == sampled and _number(entry.get("logprob")) and entry["logprob"] <= 0,
            f"position {pos}: {short(entry)} for sampled id {sampled}",
        )
        tops = entry.get("top_logprobs")
        expect(
            isinstance(tops, list) and 2 <= len(tops) <= 3,
            f"position {pos}: top_logprobs {short(tops)}, want 2-3 entries",
        )
        expect(
            all(isinstance(t.get("token_id"), int) and _number(t.get("logprob")) and "rank" in t for t in tops),
            f"position {pos}: top_logprobs entries {short(tops)} need token_id, logprob, rank",
        )
    return f"{len(content)} positions of {{token_id, logprob, rank, top_logprobs[{{token_id, logprob, rank}}]}}"


def logprobs_text(server: Server) -> str:
    server.need(TEXT)
    choice = _choice(server.generate(server.body("text", max_tokens=4, logprobs=2)))
    content = (choice.get("logprobs") or {}).get("content")
    expect(isinstance(content, list) and len(content) == len(choice["token_ids"]), f"logprobs.content {short(content)}")
    for pos, entry in enumerate(content):
        expect(
            isinstance(entry.get("token"), str) and _number(entry.get("logprob")) and "bytes" in entry,
            f"position {pos}: {short(entry)} needs token, logprob, bytes",
        )
        tops = entry.get("top_logprobs") or []
        expect(
            len(tops) >= 2 and all(isinstance(t.get("token"), str) and _number(t.get("logprob")) for t in tops),
            f"position {pos}: top_logprobs {short(tops)}",
        )
    return f"{len(content)} positions in the chat shape {{token, logprob, bytes, top_logprobs}}"


# -- abort --------------------------------------------------------------------------------------------

ABORT_REPEAT_S = 0.05


def abort_stream(server: Server) -> str:
    """The abort is sent again every ``ABORT_REPEAT_S`` from when the request goes out until its stream ends,
    not once after the first chunk: a server may hold its outputs back and deliver the whole stream at once
    (vLLM 0.32's engine core on a 2-CPU box does, for seconds), and an abort that only follows the first chunk
    then comes after the request finished. An abort that arrives before the request is known is a 200 that
    does nothing; the next one reaches it."""
    request_id = "conformance-abort"
    room = (server.max_model_len or 2048) - len(server.prompt) - 1
    body = {**server.body(stream=True, max_tokens=room), "request_id": request_id}
    answers: list[int] = []
    ended = threading.Event()

    def abort_until_ended() -> None:
        while True:
            answers.append(server.wire.post(ABORT, {"request_ids": [f"generate-tokens-{request_id}"]}).status_code)
            if ended.wait(ABORT_REPEAT_S):
                return

    thread = threading.Thread(target=abort_until_ended)
    thread.start()
    try:
        s = server.stream(body)
    finally:
        ended.set()
        thread.join()
    expect(answers and set(answers) == {200}, f"abort answered {sorted(set(answers))}")
    expect(s.finish() == "abort", f"aborted stream ended with finish_reason {s.finish()!r} after {len(s.ids())} ids")
    expect(s.done, "aborted stream without [DONE]")
    return f"aborted after {len(s.ids())} of {room} ids: finish_reason=abort, then [DONE]"


def abort_unknown(server: Server) -> str:
    r = server.wire.post(ABORT, {"request_ids": ["generate-tokens-no-such-request"]})
    expect(r.status_code == 200, f"abort of an unknown id answered {r.status_code}: {r.text[:200]}")
    return "200 for an unknown id"

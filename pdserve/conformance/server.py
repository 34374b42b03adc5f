"""What the kit knows about the server under test, learnt over the wire only, and the helpers the checks
share: the model (``/v1/models``), a prompt the server rendered itself, capability probes and greedy
baselines (computed once, reused by every rule that compares against them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.conformance.wire import Stream, Wire

MESSAGES = [{"role": "user", "content": "Name three colours."}]
REASONING_PARSERS = frozenset({"deepseek_r1", "qwen3"})
TOOL_PARSERS = frozenset({"hermes", "qwen3_coder", "qwen3_xml"})
GENERATE = "/inference/v1/generate"
CHAT_RENDER = "/v1/chat/completions/render"
COMPLETIONS_RENDER = "/v1/completions/render"
CHAT_DERENDER = "/v1/chat/completions/derender"
ABORT = "/inference/v1/abort_requests"


class Failed(AssertionError):
    """The server broke the rule; the message is the evidence."""


class Unsupported(Exception):
    """The server lacks a capability the rule needs (e.g. ``output_mode="derender"``): not a failure."""


class NotApplicable(Exception):
    """The rule does not apply to how the server was started (e.g. a parser rule, no ``--parsers``)."""


class SetupError(RuntimeError):
    """The kit cannot start: no model on /v1/models, or no render endpoint to build prompts with."""


def expect(condition: object, evidence: str) -> None:
    if not condition:
        raise Failed(evidence)


def short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Server:
    """The server under test. ``parsers``: the reasoning/tool parser names it was started with."""

    wire: Wire
    parsers: frozenset[str] = frozenset()
    model: str = ""
    max_model_len: int | None = None
    rendered: dict[str, Any] = field(default_factory=dict)
    _probes: dict[str, bool] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def discover(cls, wire: Wire, parsers: frozenset[str]) -> Server:
        r = wire.get("/v1/models")
        if r.status_code != 200 or not r.json().get("data"):
            raise SetupError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
        card = r.json()["data"][0]
        server = cls(wire=wire, parsers=parsers, model=card["id"], max_model_len=card.get("max_model_len"))
        r = wire.post(CHAT_RENDER, {"model": server.model, "messages": MESSAGES, "max_tokens": 4})
        if r.status_code != 200:
            raise SetupError(
                f"POST {CHAT_RENDER} answered {r.status_code}: {r.text[:200]} (the kit renders its prompts there)"
            )
        server.rendered = r.json()
        return server

    @property
    def prompt(self) -> list[int]:
        return list(self.rendered["token_ids"])

    @property
    def reasoning_parser(self) -> str | None:
        return next(iter(sorted(self.parsers & REASONING_PARSERS)), None)

    @property
    def tool_parser(self) -> str | None:
        return next(iter(sorted(self.parsers & TOOL_PARSERS)), None)

    def body(self, mode: str | None = None, stream: bool = False, **sampling: Any) -> dict[str, Any]:
        """A generate body on the rendered prompt; greedy and ``ignore_eos`` unless overridden."""
        body: dict[str, Any] = {
            "model": self.model,
            "token_ids": self.prompt,
            "sampling_params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True, **sampling},
        }
        if mode is not None:
            body["output_mode"] = mode
        if mode == "derender":
            body["parse_context"] = self.rendered.get("parse_context") or {}
        if stream:
            body["stream"] = True
        return body

    def chat_request(self, **extra: Any) -> dict[str, Any]:
        return {"model": self.model, "messages": MESSAGES, **extra}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.wire.post(GENERATE, body)
        expect(r.status_code == 200, f"generate answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def stream(self, body: dict[str, Any], on_event: Any = None) -> Stream:
        s = self.wire.stream(GENERATE, body, on_event)
        expect(s.status == 200, f"streaming generate answered {s.status}: {s.body[:300]}")
        return s

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as the server tokenizes a completion prompt (its render endpoint)."""
        r = self.wire.post(COMPLETIONS_RENDER, {"model": self.model, "prompt": text, "max_tokens": 1})
        expect(r.status_code == 200, f"POST {COMPLETIONS_RENDER} answered {r.status_code}: {r.text[:300]}")
        rendered = r.json()
        first = rendered[0] if isinstance(rendered, list) else rendered
        return list(first["token_ids"])

    # -- capabilities: one probe each, remembered ------------------------------------------------------

    def need(self, capability: str) -> None:
        if capability not in self._probes:
            self._probes[capability] = _PROBES[capability](self)
        if not self._probes[capability]:
            raise Unsupported(f"the server does not support {capability}")

    def need_parser(self, kind: str) -> str:
        name = self.reasoning_parser if kind == "reasoning" else self.tool_parser
        if name is None:
            raise NotApplicable(f"needs a {kind} parser (--parsers)")
        return name

    # -- baselines: greedy answers that several rules compare against ---------------------------------

    def baseline(self, mode: str | None = None, **sampling: Any) -> dict[str, Any]:
        key = repr((mode, sorted(sampling.items())))
        if key not in self._cache:
            self._cache[key] = self.generate(self.body(mode, **sampling))
        return self._cache[key]


def _probe_mode(mode: str, stream: bool) -> Any:
    def probe(server: Server) -> bool:
        body = server.body(mode, stream=stream, max_tokens=1)
        if stream:
            s = server.wire.stream(GENERATE, body)
            return s.status == 200 and bool(s.events) and s.events[0].get("output_mode") == mode
        r = server.wire.post(GENERATE, body)
        return r.status_code == 200 and r.json().get("output_mode") == mode

    return probe


def _probe_derender_endpoint(server: Server) -> bool:
    tokens = server.baseline(max_tokens=1)
    r = server.wire.post(CHAT_DERENDER, {"generate_response": tokens, "chat_request": server.chat_request()})
    return r.status_code == 200


_PROBES = {
    "output_mode=text": _probe_mode("text", False),
    "output_mode=derender": _probe_mode("derender", False),
    "streaming output_mode=derender": _probe_mode("derender", True),
    "the /v1/chat/completions/derender endpoint": _probe_derender_endpoint,
}
TEXT, DERENDER, DERENDER_STREAM, DERENDER_ENDPOINT = _PROBES

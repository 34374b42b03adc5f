"""Server configuration (what ``pdserve serve`` flags resolve to)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.spec import EngineSpec

# vLLM's default cap on candidates per position (``--max-logprobs``).
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    engine: EngineSpec | None  # None: a render server (render + derender, no generate)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tokens_only: bool = False
    tokenizer: str | None = None
    # --engine scripted: the JSONL scripts and the tokenizer that encodes them (set even with
    # --tokens-only); the serve layer hands the engine their token ids (runner.encode_scripts).
    script: str | None = None
    script_tokenizer: str | None = None
    served_model_name: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_server_count: int = 1
    # ipc addresses of a running engine core (set by the supervisor for frontend processes).
    engine_core_addresses: dict[str, str] | None = None
    log_level: str = "info"
    # Bound for render/derender inputs on a server without an engine (else the engine's).
    max_model_len: int | None = None
    # --enable-per-request-metrics: server-side timing as ``metrics`` on responses (pdserve.output.timing).
    enable_per_request_metrics: bool = False

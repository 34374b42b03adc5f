"""Server configuration (what ``pdserve serve`` flags resolve to)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.spec import EngineSpec
from pdserve.protocol.keepalive import SERVER_KEEP_ALIVE_S

# vLLM's default cap on candidates per position (``--max-logprobs``).
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_STREAM_IDLE_TIMEOUT_S = 60.0
DEFAULT_DERENDER_CACHE_ENTRIES = 4096
DEFAULT_DERENDER_CACHE_TTL_S = 60.0


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
    log_format: str = "text"  # --log-format: text, or json (pdserve.web.logs)
    # Bound for render/derender inputs on a server without an engine (else the engine's).
    max_model_len: int | None = None
    # --enable-per-request-metrics: server-side timing as ``metrics`` on responses (pdserve.output.timing).
    enable_per_request_metrics: bool = False
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens on final usage (vLLM's flag).
    enable_prompt_tokens_details: bool = False
    # SIGTERM: /health and new requests 503 at once; requests in flight get this long to finish.
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # An idle keep-alive connection is closed after this long (pdserve.protocol.keepalive says why it is long).
    timeout_keep_alive_s: float = SERVER_KEEP_ALIVE_S
    # Requests in flight beyond the engine's max_num_seqs that wait for a slot; past it a 503 (None: unbounded).
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS
    # A stream whose client has read nothing for this long is aborted (None: never).
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    # Streaming /derender: parser/detokenizer states kept to continue a stream (0: replay every chunk).
    derender_cache_entries: int = DEFAULT_DERENDER_CACHE_ENTRIES
    derender_cache_ttl_s: float = DEFAULT_DERENDER_CACHE_TTL_S
    # --stream-interval: the fewest tokens per stream chunk (a request may ask for more).
    stream_interval: int = 1
    # --otlp-traces-endpoint: the OTLP/HTTP collector this server's spans go to (None: no tracing, no SDK loaded).
    otlp_traces_endpoint: str | None = None

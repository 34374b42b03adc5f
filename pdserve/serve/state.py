"""What every route reads: the server's config, engine, tokenizer, parsers and metrics.

Routes reach it through :func:`app_state`; it imports nothing from the routes or the app, so
every serve module can depend on it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from pdserve.engine.api import Engine, EngineDeadError
from pdserve.protocol.errors import RequestError
from pdserve.serve.config import ServerConfig
from pdserve.serve.inflight import InFlight
from pdserve.serve.metrics import Metrics
from pdserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the parsers package loads only on servers that configure one
    from pdserve.output.derender_cache import DerenderCache
    from pdserve.output.request_state import ChoiceState
    from pdserve.parsers import ParserConfig
    from pdserve.web.tracing import Tracing


@dataclass
class AppState:
    config: ServerConfig
    engine: Engine | None
    tokenizer: Tokenizer | None
    metrics: Metrics
    parser_config: ParserConfig | None = None
    inflight: InFlight = field(default_factory=lambda: InFlight(capacity=None))
    # Streaming /derender: live choice states of streams in progress (None: --derender-cache-entries 0).
    derender_cache: DerenderCache[ChoiceState] | None = None
    # --otlp-traces-endpoint: this process's tracer (pdserve.serve.tracing); None, the default, traces nothing.
    tracing: Tracing | None = None

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.engine is not None:
            return self.engine.info.model_name
        return self.config.tokenizer or "pdserve"

    @property
    def parsers_configured(self) -> bool:
        """A reasoning or tool parser reads derender output (it needs the tokenizer too)."""
        return self.parser_config is not None and self.parser_config.configured and self.tokenizer is not None

    @property
    def output_vocab_size(self) -> int:
        """Ids a generated output may hold: the model's vocabulary when this server runs one (its embedding
        is often padded past the tokenizer's, and an engine may sample a padding id, which decodes to ""),
        else the tokenizer's. What this server's generate emits, its /derender takes back."""
        if self.engine is not None:
            return self.engine.info.vocab_size
        return self.require_tokenizer().vocab_size

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise RequestError("this server has no engine (pdserve launch render): it serves render/derender only")
        if not self.engine.is_healthy():
            raise EngineDeadError("the engine is not running; see the server log")
        return self.engine

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RequestError("this endpoint needs a tokenizer, but the server runs --tokens-only")
        return self.tokenizer


def app_state(request: Request) -> AppState:
    return request.app.state.pdserve

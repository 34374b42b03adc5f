"""What is refused before any route runs: a draining server's routes, and requests without the API key."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.serve.http.errors import error_body
from pdserve.serve.inflight import RETRY_AFTER_S, InFlight

# What a draining server still answers: its metrics, aborts of what it still runs, and the KV metadata
# that decode engines need to pull the leases of prefill legs this server already answered.
DRAINING_ROUTES = frozenset({"/metrics", "/abort_requests", "/inference/v1/abort_requests", "/kv/metadata"})


class Gate:
    """What is refused before any route runs: while the server drains for a shutdown, everything but
    :data:`DRAINING_ROUTES` (503, ``/health`` included, so load balancers stop sending), and without the
    ``--api-key`` every route but ``/health`` (401). Pure ASGI: an HTTP middleware would wrap streaming responses and
    can hide a client's disconnect from the route (a storm of disconnects then leaves requests running)."""

    def __init__(self, app: ASGIApp, api_key: str | None, inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if self.inflight.draining and path not in DRAINING_ROUTES:
                body = error_body("the server is shutting down", 503, "ServiceUnavailableError")
                headers = {"retry-after": str(RETRY_AFTER_S), "connection": "close"}
                await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
                return
            if self.expected is not None and path != "/health" and not self._authorized(scope):
                body = error_body("missing or wrong API key (Authorization: Bearer <key>)", 401, "AuthenticationError")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(sent, self.expected or b"")

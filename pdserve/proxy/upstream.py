"""HTTP to pool members, with every failure turned into the status a client should see.

* a member that refuses or times out the connection is taken out of rotation and the next one is
  tried (nothing was sent, so retrying is safe); none left is a 503 naming the pool;
* a member that fails after the request went out (it died mid-request) is a 502 naming it: the
  request may have run, so it is not retried;
* a member's own error status (a 4xx for the client's request, a 5xx) is relayed unchanged, with
  its error body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx

from pdserve.protocol.errors import ErrorInfo, ErrorResponse
from pdserve.proxy.pool import Member, Pool, PoolUnavailable

_CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


class UpstreamError(Exception):
    """What the client gets instead of an answer: an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, body: dict[str, Any]):
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status = status
        self.body = body

    @classmethod
    def unavailable(cls, e: PoolUnavailable) -> UpstreamError:
        return cls(503, error_body(str(e), 503, "ServiceUnavailableError"))

    @classmethod
    def failed(cls, pool: Pool, member: Member, e: Exception) -> UpstreamError:
        message = f"{pool.name} server {member.url} failed mid-request: {type(e).__name__}: {e}"
        return cls(502, error_body(message, 502, "BadGatewayError"))


def relayed_error(pool: Pool, member: Member, status: int, raw: bytes) -> UpstreamError:
    """A member's error answer as the client's: its body when it is an error object, else one naming it."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]:
        return UpstreamError(status, body)
    text = raw.decode(errors="replace")[:500]
    kind = "BadRequestError" if status < 500 else "BadGatewayError"
    return UpstreamError(status, error_body(f"{pool.name} server {member.url} answered {status}: {text}", status, kind))


async def send(
    client: httpx.AsyncClient, pool: Pool, method: str, path: str, body: Any, headers: Mapping[str, str],
    *, stream: bool = False,
) -> tuple[Member, httpx.Response]:
    """Send to the pool's next healthy member; the member and its 200 response (open when ``stream``).

    Raises :class:`UpstreamError` for everything else (see the module docstring)."""
    tried: set[str] = set()
    while True:
        try:
            member = pool.pick(exclude=tried)
        except PoolUnavailable as e:
            raise UpstreamError.unavailable(e) from None
        tried.add(member.url)
        request = client.build_request(method, member.url + path, json=body, headers=dict(headers))
        try:
            response = await client.send(request, stream=stream)
        except _CONNECT_FAILURES as e:
            pool.mark_down(member, f"unreachable ({type(e).__name__})")
            continue
        except httpx.HTTPError as e:
            pool.mark_down(member, f"failed mid-request ({type(e).__name__})")
            raise UpstreamError.failed(pool, member, e) from None
        if response.status_code == 200:
            return member, response
        try:
            raw = await response.aread()
        except httpx.HTTPError as e:
            raise UpstreamError.failed(pool, member, e) from None
        finally:
            await response.aclose()
        raise relayed_error(pool, member, response.status_code, raw)


async def post_json(
    client: httpx.AsyncClient, pool: Pool, path: str, body: Any, headers: Mapping[str, str]
) -> tuple[Member, Any]:
    """POST ``body`` and read the JSON answer (a body that is not JSON is the member's fault: 502)."""
    member, response = await send(client, pool, "POST", path, body, headers)
    try:
        return member, response.json()
    except ValueError as e:
        raise UpstreamError.failed(pool, member, e) from None

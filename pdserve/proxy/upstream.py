"""HTTP to pool members, with every failure turned into the status a client should see.

* a member that refuses or times out the connection is taken out of rotation and the next one is
  tried (nothing was sent, so retrying is safe); none left is a 503 naming the pool;
* a member that answers 503 (draining, overloaded: it did not run the request) is left alone for its
  ``Retry-After`` (default :data:`DEFAULT_RETRY_AFTER_S`) and the next one is tried; none left relays the
  last 503;
* a member that fails after the request went out (it died mid-request) is a 502 naming it: the
  request may have run, so it is not retried;
* a member's own error status (a 4xx for the client's request, a 5xx) is relayed unchanged, with
  its error body.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.protocol.errors import ErrorInfo, ErrorResponse
from pdserve.proxy.pool import Member, Pool, PoolUnavailable

_CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# How long a member that answered 503 without Retry-After is left alone.
DEFAULT_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


class UpstreamError(Exception):
    """What the client gets instead of an answer: an HTTP status, an OpenAI error body, and the headers
    that go with it (``Retry-After`` on a 503)."""

    def __init__(self, status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None,
                 failed_member: str | None = None, cause: str | None = None):
        super().__init__(body.get("error", {}).get("message", str(body)))
        self.status = status
        self.body = body
        self.headers = dict(headers or {})
        self.failed_member = failed_member  # the URL of a member that failed mid-request
        self.cause = cause  # how it failed (dropped, garbage), for the request's record of retries

    @classmethod
    def unavailable(cls, e: PoolUnavailable) -> UpstreamError:
        headers = retry_after_header(e.retry_after_s) if e.retry_after_s is not None else None
        return cls(503, error_body(str(e), 503, "ServiceUnavailableError"), headers)

    @classmethod
    def failed(cls, pool: Pool, member: Member, e: Exception, cause: str = "dropped") -> UpstreamError:
        message = f"{pool.name} server {member.url} failed mid-request: {type(e).__name__}: {e}"
        return cls(502, error_body(message, 502, "BadGatewayError"), failed_member=member.url, cause=cause)


def relayed_error(pool: Pool, member: Member, status: int, raw: bytes,
                  headers: Mapping[str, str] | None = None) -> UpstreamError:
    """A member's error answer as the client's: its body when it is an error object, else one naming it."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict) and "message" in body["error"]:
        return UpstreamError(status, body, headers)
    text = raw.decode(errors="replace")[:500]
    kind = "BadRequestError" if status < 500 else "BadGatewayError"
    return UpstreamError(status, error_body(f"{pool.name} server {member.url} answered {status}: {text}", status, kind),
                         headers)


def retry_after_header(seconds: float) -> dict[str, str]:
    """The client's ``Retry-After`` for a wait of ``seconds`` (whole seconds, at least 1)."""
    return {"retry-after": str(max(1, round(seconds)))}


def retry_after_s(headers: httpx.Headers) -> float:
    """A 503's ``Retry-After`` in seconds (delta-seconds; a date or nothing: the default), bounded."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:
        seconds = DEFAULT_RETRY_AFTER_S
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


@dataclass(eq=False)
class OpenStream:
    """A member's streamed 200: the member counts it in flight until :meth:`aclose` (which may run twice)."""

    pool: Pool
    member: Member
    response: httpx.Response
    _closed: bool = field(default=False, repr=False)
    # Set when the proxy itself cut the stream (it is shutting down): the member did nothing wrong.
    cut_by_proxy: bool = field(default=False, repr=False)

    async def aclose(self) -> None:
        try:
            await self.response.aclose()
        finally:
            if not self._closed:
                self._closed = True
                self.pool.answered(self.member)


async def send(
    client: httpx.AsyncClient, pool: Pool, method: str, path: str, body: Any, headers: Mapping[str, str],
    exclude: Collection[str] = (),
) -> tuple[Member, httpx.Response]:
    """Send to a member the pool picks (never one in ``exclude``) and read its 200 answer; the member and
    the response. Raises :class:`UpstreamError` for everything else (see the module docstring)."""
    stream = await open_stream(client, pool, method, path, body, headers, exclude)
    try:
        await stream.response.aread()
    except httpx.HTTPError as e:
        pool.mark_down(stream.member, f"failed mid-request ({type(e).__name__})")
        pool.failed(stream.member, "dropped")
        raise UpstreamError.failed(pool, stream.member, e) from None
    finally:
        await stream.aclose()
    return stream.member, stream.response


async def open_stream(
    client: httpx.AsyncClient, pool: Pool, method: str, path: str, body: Any, headers: Mapping[str, str],
    exclude: Collection[str] = (),
) -> OpenStream:
    """Send to a member the pool picks (never one in ``exclude``); its 200 response, open (the caller
    closes it). Connect failures and 503s go to the next member; see the module docstring for the rest."""
    tried: set[str] = set(exclude)
    refused: UpstreamError | None = None
    while True:
        try:
            member = pool.pick(exclude=tried)
        except PoolUnavailable as e:
            raise refused or UpstreamError.unavailable(e) from None
        tried.add(member.url)
        request = client.build_request(method, member.url + path, json=body, headers=dict(headers))
        pool.sent(member)
        try:
            response = await client.send(request, stream=True)
        except _CONNECT_FAILURES as e:
            pool.answered(member)
            pool.mark_down(member, f"unreachable ({type(e).__name__})")
            pool.failed(member, "unreachable")
            continue
        except httpx.HTTPError as e:
            pool.answered(member)
            pool.mark_down(member, f"failed mid-request ({type(e).__name__})")
            pool.failed(member, "dropped")
            raise UpstreamError.failed(pool, member, e) from None
        opened = OpenStream(pool, member, response)
        if response.status_code == 200:
            return opened
        try:
            raw = await response.aread()
        except httpx.HTTPError as e:
            pool.failed(member, "dropped")
            raise UpstreamError.failed(pool, member, e) from None
        finally:
            await opened.aclose()
        if response.status_code >= 500:
            pool.failed(member, f"status_{response.status_code}")
        if response.status_code == 503:  # it did not run the request: another member may
            wait = retry_after_s(response.headers)
            pool.back_off(member, wait)
            refused = relayed_error(pool, member, 503, raw, retry_after_header(wait))
            continue
        raise relayed_error(pool, member, response.status_code, raw)


async def post_json(
    client: httpx.AsyncClient, pool: Pool, path: str, body: Any, headers: Mapping[str, str],
    exclude: Collection[str] = (),
) -> tuple[Member, Any]:
    """POST ``body`` and read the JSON answer (a body that is not JSON is the member's fault: 502)."""
    member, response = await send(client, pool, "POST", path, body, headers, exclude)
    try:
        return member, response.json()
    except ValueError as e:
        raise UpstreamError.failed(pool, member, e, cause="garbage") from None

"""Reading a JSON request body: content type, size limit, decoding, the checks json.loads does not make,
validation into the route's model; every failure a 400 that says what was wrong."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, TypeAdapter, ValidationError

from pdserve.protocol.errors import RequestError
from pdserve.protocol.limits import MAX_JSON_DEPTH, MAX_REQUEST_ID_CHARS
from pdserve.serve.state import app_state

ModelT = TypeVar("ModelT", bound=BaseModel)


def _where(loc: tuple[Any, ...], skip_tag: bool) -> str:
    """An error location as a dotted field path (a tagged union's tag, e.g. derender's batch/stream, left out)."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(parts[1:] if skip_tag else parts)


def format_validation_error(err: ValidationError | RequestValidationError, skip_tag: bool = False) -> str:
    parts = []
    for e in err.errors():
        loc = _where(tuple(e.get("loc", ())), skip_tag)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


_SCALAR_LIST = list[int | float | bool | None]


def decode_json(raw: bytes) -> Any:
    """A request body as Python values. msgspec first (3x json.loads' speed on the id lists a streaming
    derender body carries); whatever it refuses (a bad document, NaN, 1e400, lone surrogates, deep
    nesting) goes through json.loads, whose verdict and messages are the server's rules."""
    try:
        return _fast_decode(raw)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"JSON decode error: {e}") from None
    except RecursionError:
        raise RequestError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None


_fast_decode = msgspec.json.Decoder().decode


def check_json(data: Any) -> None:
    """Refuse (400 naming the place) what json.loads accepts but the server cannot hold: nesting
    deeper than MAX_JSON_DEPTH (it would exhaust recursion downstream) and strings with lone
    surrogates (``"\\ud800"``: valid JSON escapes, but not text; encoding them fails later).

    Iterative, and it only visits containers and strings: a long list of token ids costs one C-level
    pass over the element types (about 2.5 ms per 100k ids, next to json.loads of them)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise RequestError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels (at {where or 'the top'})")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{where}.{key}" if where else key)
                if isinstance(item, (dict, list, str)):
                    stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif not _scalars_only(value):
            stack.extend((item, f"{where}[{i}]", depth + 1)
                         for i, item in enumerate(value) if isinstance(item, (dict, list, str)))


def _scalars_only(values: list[Any]) -> bool:
    """Whether a list holds only numbers, booleans and nulls (a list of token ids): one C pass of msgspec,
    4x a type() check per element, which was a fifth of a long streamed /derender chunk's work."""
    try:
        msgspec.convert(values, _SCALAR_LIST)
    except (msgspec.ValidationError, UnicodeEncodeError):
        # A string or container is in it (or an integer msgspec does not hold; a lone surrogate fails its
        # error message): look closer.
        return False
    return True


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            where = where.encode("utf-8", "backslashreplace").decode("utf-8")  # the path may hold the surrogate
            raise RequestError(
                f"{where or 'the body'}: the string holds a lone UTF-16 surrogate (such as \\ud800 without its "
                "pair), which is not text; send valid Unicode",
                param=where or None,
            ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused once it passes ``limit``: by its Content-Length, or (chunked, or a lying
    length) as soon as what arrived passes it, never buffered whole first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes is over the limit of {limit} bytes", close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body is over the limit of {limit} bytes (stopped reading at {size})",
                               close=True)
        chunks.append(chunk)
    return b"".join(chunks)


def header_request_id(request: Request) -> str | None:
    """``X-Request-Id``, bounded like a body ``request_id`` (it is echoed back in every answer)."""
    value = request.headers.get("x-request-id")
    if value is not None and len(value) > MAX_REQUEST_ID_CHARS:
        raise RequestError(f"X-Request-Id has {len(value)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed",
                           param="X-Request-Id")
    return value


async def parse_body(request: Request, model: type[ModelT] | TypeAdapter[Any]) -> Any:
    """Read a JSON body into ``model`` (a model class or a TypeAdapter of a union); every failure
    is a 400 that says what was wrong (a body over the size limit too: DESIGN.md rule 6)."""
    state = app_state(request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(f"Content-Type must be application/json (got {content_type or 'none'!r})")
    header_request_id(request)
    raw = await _read_body(request, state.config.max_body_bytes)
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    check_json(data)
    tagged = isinstance(model, TypeAdapter)
    try:
        if tagged:
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as e:
        first = _where(tuple(e.errors()[0]["loc"]), tagged)
        raise RequestError(format_validation_error(e, tagged), param=first.split(".")[0] or None) from None
